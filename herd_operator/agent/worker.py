"""The worker API: what a training script may call to cooperate with the operator.

    from herd_operator import worker as herd

    binding = herd.bind_device()            # pins torch to the allocator's GPU
    state.register_reset_callbacks([herd.report_reset])
    ...
    herd.report_epoch(epoch, {"loss": loss})  # once per epoch (rank 0 sends it)

An adaptive-batch sampler also sends `report_measurement` a few steps into each new
configuration (`spec.training.measureSteps`), so the operator need not wait for an epoch end.

Training quality across resizes (the batch policy of `spec.training`) is in
`herd_operator.agent.training`: `batch_settings`, `elastic_batches`, `sum_gradients`.

Every call is a harmless no-op when the script is not run by the operator, so
the same script runs under a bare `horovodrun`, and a script that never imports
this module still runs and resizes under the operator; it only reports nothing.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from herd_operator.auth import job_identity, read_token_file
from herd_operator.environment import (
    ALLOCATOR_ENV,
    GPU_ENV,
    GPU_MEMORY_LIMIT_ENV,
    GPUS_ENV,
    JOB_ENV,
    TOKEN_FILE_ENV,
    VIRTUAL_ENV,
    worker_host,
    worker_local_rank,
    worker_rank,
    worker_world_size,
)
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import parse_address

log = logging.getLogger(__name__)

_client: RpcClient | None = None
_client_lock = threading.Lock()


@dataclass(frozen=True)
class DeviceBinding:
    gpu: int
    """The allocator's GPU index on this host (a virtual GPU index on CPU machines)."""
    ordinal: int
    """The CUDA device number inside this process (after CUDA_VISIBLE_DEVICES)."""
    virtual: bool


def under_operator() -> bool:
    return bool(os.environ.get(JOB_ENV) and os.environ.get(ALLOCATOR_ENV))


def client_from_env(label: str) -> RpcClient:
    """A client to the allocator as this job (``job:<HERD_JOB>``), from the variables the
    operator sets; the token file holds the job's own key."""
    missing = [
        name for name in (JOB_ENV, ALLOCATOR_ENV, TOKEN_FILE_ENV) if not os.environ.get(name)
    ]
    if missing:
        raise RuntimeError(f"not started by herd-operator: {', '.join(missing)} unset")
    identity = job_identity(os.environ[JOB_ENV])
    token = read_token_file(Path(os.environ[TOKEN_FILE_ENV]))
    return RpcClient(
        parse_address(os.environ[ALLOCATOR_ENV]),
        token,
        identity=identity,
        client=label,
        timeout=10.0,
    )


def _shared_client() -> RpcClient:
    global _client
    with _client_lock:
        if _client is None:
            _client = client_from_env(f"worker:{os.environ.get(JOB_ENV)}:{os.getpid()}")
        return _client


def host_name() -> str:
    """The host name the worker binds with: as Horovod's discovery script spelled it, or
    the torchrun engine's name of the worker's GPU."""
    return worker_host(os.environ) or socket.gethostname()


def _horovod() -> Any:
    """horovod.torch if the script already imported and initialized it."""
    hvd = sys.modules.get("horovod.torch")
    if hvd is None:
        return None
    try:
        hvd.size()
    except ValueError:  # not initialized yet
        return None
    return hvd


def _local_rank() -> int:
    hvd = _horovod()
    if hvd is not None:
        return int(hvd.local_rank())
    return worker_local_rank(os.environ)


def bind_device() -> DeviceBinding:
    """Bind this worker to the GPU the allocator gave its (job, host, local rank).

    Under the operator, the shim asked the allocator before this process started
    and exported the answer; elsewhere it is the usual `local_rank` convention.
    When CUDA is usable, torch is pinned to that device, and capped at the worker's GPU
    memory limit when the operator gave one (`apply_memory_limit`). Never raises for a
    passing reason: a worker that fails makes Horovod blacklist its host.
    """
    local_rank = _local_rank()
    gpu_text = os.environ.get(GPU_ENV)
    if gpu_text is not None:
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", os.environ.get(GPUS_ENV, gpu_text)).split(",")
        ordinal = gpus.index(gpu_text) if gpu_text in gpus else local_rank
        binding = DeviceBinding(int(gpu_text), ordinal, os.environ.get(VIRTUAL_ENV) == "1")
    else:
        binding = DeviceBinding(local_rank, local_rank, virtual=False)
    if not binding.virtual:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.set_device(binding.ordinal)
            apply_memory_limit(binding.ordinal)
    return binding


def memory_limit_bytes(environ: Mapping[str, str] = os.environ) -> int | None:
    """The GPU memory limit the operator gave this worker (HERD_GPU_MEMORY_LIMIT_BYTES), in
    bytes; None when it gave none. A value that is not a positive integer is the operator's
    mistake, not a passing one: ValueError naming the variable."""
    text = environ.get(GPU_MEMORY_LIMIT_ENV, "").strip()
    if not text:
        return None
    try:
        limit = int(text)
    except ValueError:
        raise ValueError(
            f"{GPU_MEMORY_LIMIT_ENV} must be a number of bytes, got {text!r}"
        ) from None
    if limit < 1:
        raise ValueError(f"{GPU_MEMORY_LIMIT_ENV} must be positive, got {limit}")
    return limit


def memory_fraction(limit_bytes: int, total_bytes: int) -> float:
    """The fraction of a device of `total_bytes` that `limit_bytes` is, as
    `torch.cuda.set_per_process_memory_fraction` takes it: in (0, 1], a limit above the
    device's size being the whole device."""
    if total_bytes < 1:
        raise ValueError(f"a device's memory must be positive, got {total_bytes} bytes")
    if limit_bytes < 1:
        raise ValueError(f"a memory limit must be positive, got {limit_bytes} bytes")
    return min(1.0, limit_bytes / total_bytes)


def apply_memory_limit(ordinal: int, environ: Mapping[str, str] = os.environ) -> float | None:
    """Cap PyTorch's allocations on CUDA device `ordinal` at this worker's GPU memory limit:
    beyond it, an allocation raises torch's OutOfMemoryError in this worker instead of taking
    the memory of a job sharing the GPU. Called by `bind_device`; a script that binds its
    device itself calls it before its first CUDA allocation. Returns the fraction set (None:
    no limit, or no CUDA torch in this process)."""
    limit = memory_limit_bytes(environ)
    torch = sys.modules.get("torch")
    if limit is None or torch is None or not torch.cuda.is_available():
        return None
    total = int(torch.cuda.get_device_properties(ordinal).total_memory)
    fraction = memory_fraction(limit, total)
    torch.cuda.set_per_process_memory_fraction(fraction, ordinal)
    log.info(
        "herd: GPU memory of device %d capped at %d bytes (%.3f of it)", ordinal, limit, fraction
    )
    return fraction


def _report(
    epoch: int | None,
    metrics: Mapping[str, float],
    world_size: int | None,
    measurement: bool = False,
) -> None:
    if not under_operator():
        return
    hvd = _horovod()
    rank = int(hvd.rank()) if hvd is not None else worker_rank(os.environ)
    if rank != 0:
        return  # one report per epoch and reset is enough: rank 0 speaks for the job
    if world_size is None:
        world_size = int(hvd.size()) if hvd is not None else worker_world_size(os.environ)
    extra = {"measurement": True} if measurement else {}
    try:
        _shared_client().call(
            "report",
            job=os.environ[JOB_ENV],
            epoch=epoch,
            world_size=world_size,
            rank=rank,
            metrics={key: float(value) for key, value in metrics.items()},
            **extra,
        )
    except Exception as err:  # reporting must never break training
        log.warning("herd: report failed: %s", err)


def report_epoch(
    epoch: int, metrics: Mapping[str, float] | None = None, *, world_size: int | None = None
) -> None:
    """Tell the operator an epoch ended, with the world size it ran at."""
    _report(epoch, metrics or {}, world_size)


def report_measurement(metrics: Mapping[str, float], *, world_size: int | None = None) -> None:
    """Tell the operator what the workers measured within an epoch, a few steps into a new
    configuration (`Report.measurement`: no epoch ended). The adaptive batch sampler sends
    its `adaptive_metrics()` so `measureSteps` full steps after a start, a resize or a new
    batch; rank 0 sends it, and a failure is logged, never raised, as `report_epoch`'s."""
    _report(None, metrics, world_size, measurement=True)


def decided_batch() -> tuple[int, int] | None:
    """The global batch the operator's policy last picked for this job, as (gpus, batch):
    the batch is for that many GPUs. None when it picked none, when the script is not run
    by the operator, or when the operator cannot be asked (training goes on as it was)."""
    if not under_operator():
        return None
    try:
        answer = _shared_client().call("batch", job=os.environ[JOB_ENV])
    except Exception as err:  # asking must never break training
        log.warning("herd: asking for the batch failed: %s", err)
        return None
    gpus, batch = answer.get("gpus"), answer.get("batch_size")
    if isinstance(gpus, int) and isinstance(batch, int) and gpus > 0 and batch > 0:
        return gpus, batch
    return None


def report_reset() -> None:
    """Reset callback for `state.register_reset_callbacks`: reports the new world size.

    A torchrun script calls it once its first step after each start is done (every resize
    restarts its workers): the operator's measure of a resize (the `ResizeCompleted` event,
    `describe`) ends at the report of the new size, here the first step at it, instead of
    the end of the first epoch there (`examples/train_torchrun.py`)."""
    _report(None, {}, None)
