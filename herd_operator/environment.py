"""The environment through which the operator tells a job's processes where they stand.

The operator (launcher) sets these; the shim, the worker API and the orphan search read
them. One list, so both sides agree on the names.
"""

from __future__ import annotations

from collections.abc import Mapping

JOB_ENV = "HERD_JOB"
"""The job's name."""
ALLOCATOR_ENV = "HERD_ALLOCATOR"
"""host:port of the allocator's RPC server."""
TOKEN_FILE_ENV = "HERD_TOKEN_FILE"
"""Path of the 0600 file that holds the job's own key (never the key itself): it proves
the identity ``job:<HERD_JOB>`` and nothing else."""
ENV_FILE_ENV = "HERD_ENV_FILE"
"""Path of the 0600 JSON file with the spec's `env`; the shim puts it into the worker's
environment before the user's command starts. Horovod passes its own environment to
workers on their command lines (`env K=V ...`), visible in `ps` to every user, so the
values travel by file instead."""
STATE_DIR_ENV = "HERD_STATE_DIR"
"""The operator's state directory (also the CLI's default when set)."""
LAUNCH_ID_ENV = "HERD_LAUNCH_ID"
"""Marks every process of one launch, so a restarted operator finds what a crashed one left."""
GPU_MEMORY_LIMIT_ENV = "HERD_GPU_MEMORY_LIMIT_BYTES"
"""Set by the operator for a job whose workers share GPUs: the most GPU memory, in bytes, each
worker may use on its GPU. `herd_operator.worker.bind_device` (and `apply_memory_limit`) caps
PyTorch's caching allocator at that share of the device
(`torch.cuda.set_per_process_memory_fraction`), so that a worker outgrowing its share fails
with an out-of-memory error of its own instead of its neighbour's. Unset: no limit."""
OPERATOR_SET = frozenset(
    {
        JOB_ENV,
        ALLOCATOR_ENV,
        TOKEN_FILE_ENV,
        ENV_FILE_ENV,
        STATE_DIR_ENV,
        LAUNCH_ID_ENV,
        GPU_MEMORY_LIMIT_ENV,
    }
)
"""What the operator sets for a job: a spec's `env` cannot replace these."""
WORKER_HOST_ENV = "HERD_WORKER_HOST"
"""Set by the torchrun engine's driver for each agent: the name its worker binds its GPU
with (one GPU per agent, each under a name of its own). Unset: Horovod's HOROVOD_HOSTNAME,
else the machine's name."""
GPU_ENV = "HERD_GPU"
"""Set by the shim: the allocator's GPU index of this worker on its host."""
GPUS_ENV = "HERD_GPUS"
"""Set by the shim: the job's GPUs on this host, in local-rank order."""
VIRTUAL_ENV = "HERD_VIRTUAL_GPU"
"""Set by the shim to 1 when the GPUs are virtual (CPU workers)."""
BATCH_POLICY_ENV = "HERD_BATCH_POLICY"
"""From `spec.training.batchPolicy`: how workers keep training quality across resizes
(naive, linear-lr, preserve-batch, adaptive); read by `herd_operator.worker.batch_settings`."""
WARMUP_STEPS_ENV = "HERD_WARMUP_STEPS"
"""From `spec.training.warmupSteps`: linear-lr's warm-up after a resize, in optimizer steps."""
MAX_WORKER_BATCH_ENV = "HERD_MAX_WORKER_BATCH"
"""From `spec.training.maxWorkerBatch`: preserve-batch's largest micro-batch per worker."""
MAX_BATCH_ENV = "HERD_MAX_BATCH"
"""From `spec.training.maxBatch`: the adaptive policy's largest global batch."""
MEASURE_STEPS_ENV = "HERD_MEASURE_STEPS"
"""From `spec.training.measureSteps`: the adaptive policy's steps into a new configuration
after which the workers report their measurement (0: at epoch ends only)."""
TRAINING_ENV = frozenset(
    {BATCH_POLICY_ENV, WARMUP_STEPS_ENV, MAX_WORKER_BATCH_ENV, MAX_BATCH_ENV, MEASURE_STEPS_ENV}
)
"""What `spec.training` sets for the workers; a spec's `env` cannot replace these."""


# Where a worker stands, as each engine tells it: Horovod's variables first (a Horovod
# worker has both kinds only if the operator's own environment had torchrun's), then
# torchrun's (RANK, LOCAL_RANK, WORLD_SIZE: what `torch.distributed.run` sets).


def worker_host(env: Mapping[str, str]) -> str | None:
    """The name a worker binds its GPU with (None: the machine's name)."""
    return env.get(WORKER_HOST_ENV) or env.get("HOROVOD_HOSTNAME") or None


def worker_local_rank(env: Mapping[str, str]) -> int:
    return int(env.get("HOROVOD_LOCAL_RANK") or env.get("LOCAL_RANK") or "0")


def worker_rank(env: Mapping[str, str]) -> int:
    return int(env.get("HOROVOD_RANK") or env.get("RANK") or "0")


def worker_world_size(env: Mapping[str, str]) -> int:
    return int(env.get("HOROVOD_SIZE") or env.get("WORLD_SIZE") or "1")
