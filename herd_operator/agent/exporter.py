"""`herd-operator exporter`: one node's GPU metrics, for Prometheus and the operator.

The thing `srun --overlap` starts on every node of the allocation. It serves
this node's GPUs (NVML, or virtual GPUs on CPU nodes) at `/metrics`, labelled
with the job that holds each GPU (asked of the allocator), and registers itself
with the operator, which adds it to Prometheus' file_sd targets and scrapes it
for the policies' memory signal. Without a reachable operator it still serves,
with empty job labels. With `--dcgm-job-mapping-dir` it also keeps dcgm-exporter's HPC
job mapping files for this node's GPUs (exporters/dcgm.py).

How many virtual GPUs a node without NVML GPUs serves (`choose_gpu_count`): `--virtual-gpus`
if given, else as many as the operator's pool has on this host (the answer to each
registration), else Slurm's count for this node, else 4; the log says which.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from prometheus_client import CollectorRegistry

from herd_operator.auth import TokenFileError, agent_identity, read_token_file
from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.dcgm import JobMappingLoop, JobMappingWriter, physical_gpu_ids
from herd_operator.exporters.gpu import GpuSource, VirtualGpuSource
from herd_operator.exporters.http import serve_metrics
from herd_operator.exporters.nvml import NvmlGpuSource, check_no_unseen_gpus, nvml_gpu_count
from herd_operator.layout import StateLayout
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import parse_address
from herd_operator.specs.values import Placement

log = logging.getLogger(__name__)

REGISTER_EVERY_SECONDS = 5.0
"""The registration is also the node's heartbeat, and says this interval: a node whose
agent missed two calls is suspect (no GPU of it granted) until it answers a probe or calls
again, and one silent for the operator's --node-timeout (30 s) is lost."""
RETRY_REGISTER_SECONDS = 2.0
"""Until the operator answers (not started yet, or away)."""
OWNERS_MAX_AGE_SECONDS = 1.0

DEFAULT_VIRTUAL_GPUS = 4
"""Virtual GPUs of an agent that learns no count from anywhere (see `choose_gpu_count`)."""
MAX_POOL_GPUS = 65_536
"""The most GPUs on one host an operator's answer is believed for (a job's own limit)."""
SLURM_GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")
"""Slurm's variables that give this node's GPUs in an `srun` step on any node of the
allocation: slurmstepd sets SLURM_GPUS_ON_NODE for the step's own node (whatever the batch
script had), and SLURM_GPUS_PER_NODE is the same on every node. Not SLURM_JOB_GPUS: a step
started without GPUs keeps the batch node's value."""
_GPU_COUNT = re.compile(r"(?:[A-Za-z0-9_.-]+:)?(?P<count>[0-9]+)")
FROM_POOL = "the operator's pool"


@dataclass(frozen=True)
class GpuCount:
    count: int
    source: str
    """Where the count came from, in words for the log."""


def slurm_gpu_count(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """This node's GPUs by Slurm's variables (`4`, `a100:4`, `a100:2,v100:2`) and the
    variable that said so; None where none gives a count above 0. ValueError naming the
    variable for a value that is not Slurm's syntax."""
    for variable in SLURM_GPU_VARIABLES:
        text = environ.get(variable, "").strip()
        if not text:
            continue
        total = 0
        for entry in text.split(","):
            match = _GPU_COUNT.fullmatch(entry.strip())
            if match is None:
                raise ValueError(
                    f"{variable}={text!r}: expected COUNT or TYPE:COUNT (e.g. a100:4), "
                    "or pass --virtual-gpus"
                )
            total += int(match["count"])
        if total:
            return total, variable
    return None


def choose_gpu_count(
    nvml: int, requested: int | None, pool: int | None, slurm: tuple[int, str] | None
) -> GpuCount:
    """How many GPUs this node's agent serves, and why.

    NVML's GPUs where it sees some (real GPUs are what they are); else `--virtual-gpus`
    (`requested`); else the GPUs the operator's pool has on this host (`pool`, from the
    answer to a registration; None before one, 0: the host is not in the pool); else
    Slurm's count for this node; else DEFAULT_VIRTUAL_GPUS.
    """
    if nvml > 0:
        return GpuCount(nvml, "NVML")
    if requested is not None:
        return GpuCount(requested, "--virtual-gpus")
    if pool:
        return GpuCount(pool, FROM_POOL)
    if slurm is not None:
        count, variable = slurm
        return GpuCount(count, f"Slurm's {variable}")
    return GpuCount(
        DEFAULT_VIRTUAL_GPUS,
        "the default: no NVML GPU, no --virtual-gpus, no word from the operator's pool, "
        "no Slurm GPU variable",
    )


def pool_disagreement(host: str, served: GpuCount, pool: int | None) -> str | None:
    """A warning when the operator's pool (`pool` GPUs on `host`, None: not said) is not
    what this agent serves; None when they agree or the pool did not say."""
    if pool is None or served.source == FROM_POOL:
        return None
    if pool == 0:
        return (
            f"{host} is not in the operator's pool: no job gets a GPU of this agent's "
            "(pass --host with this node's name as the pool spells it)"
        )
    if pool != served.count:
        return (
            f"serving {served.count} GPUs ({served.source}) but the operator's pool has "
            f"{pool} on {host}: jobs get only the pool's"
        )
    return None


def pool_gpus(reply: Mapping[str, Any]) -> int | None:
    """The GPUs the operator's pool has on this host, from its answer to a registration;
    None from an operator that does not say (older ones) or says something else."""
    gpus = reply.get("gpus")
    if isinstance(gpus, int) and not isinstance(gpus, bool) and 0 <= gpus <= MAX_POOL_GPUS:
        return gpus
    return None


def pool_indices(reply: Mapping[str, Any]) -> tuple[int, ...] | None:
    """The numbers of this host's GPUs in the operator's pool (its slots here), from its
    answer to a registration; None from an operator that does not say (older ones) or
    says something else."""
    indices = reply.get("indices")
    if not isinstance(indices, list) or len(indices) > MAX_POOL_GPUS:
        return None
    for index in indices:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < MAX_POOL_GPUS:
            return None
    return tuple(indices)


class HeardSlots:
    """The pool's slots on this host as the operator's last answer said them (None before
    one): which GPU each job's slot is, for dcgm-exporter's files."""

    def __init__(self) -> None:
        self.slots: tuple[int, ...] | None = None

    def __call__(self) -> tuple[int, ...] | None:
        return self.slots


class ServedGpus:
    """The GPU count an agent serves, following what the operator's pool says."""

    def __init__(
        self, host: str, nvml: int, requested: int | None, slurm: tuple[int, str] | None
    ) -> None:
        self.host = host
        self._nvml = nvml
        self._requested = requested
        self._slurm = slurm
        self.current = choose_gpu_count(nvml, requested, None, slurm)
        self._warned: str | None = None

    def heard(self, pool: int | None) -> tuple[GpuCount | None, str | None]:
        """The operator answered a registration saying `pool` (None: nothing). Returns the
        new count when the count changed (not when only its source did), and a warning when
        the pool disagrees in a new way."""
        if pool is None:
            return None, None  # the last word stands: an operator that did not say
        chosen = choose_gpu_count(self._nvml, self._requested, pool, self._slurm)
        changed = chosen if chosen.count != self.current.count else None
        self.current = chosen
        warning = pool_disagreement(self.host, chosen, pool)
        new_warning = warning if warning != self._warned else None
        self._warned = warning
        return changed, new_warning


class AllocatorView:
    """What the allocator says about this host's GPUs, refreshed at most once a second."""

    def __init__(self, layout: StateLayout, host: str, key: bytes | None = None) -> None:
        self.layout = layout
        self.host = host
        self._key = key
        """This host's agent key when given on stdin; None: read from the state dir."""
        self._said_no_key = False
        self._lock = threading.Lock()
        self._client: RpcClient | None = None
        self._fetched = 0.0
        self._owners: dict[tuple[str, int], str] = {}
        self._pids: dict[int, list[int]] = {}
        self.reachable = False
        """Whether the allocator answered the last time it was asked."""

    def _call(self, op: str, **args: Any) -> dict[str, Any] | None:
        try:
            if self._client is None:
                endpoint = json.loads(self.layout.endpoint_file.read_text())
                # This host's agent key: it may label GPUs and register this host, nothing more.
                token = self._key or self._read_key()
                if token is None:
                    return None
                self._client = RpcClient(
                    parse_address(endpoint["address"]),
                    token,
                    identity=agent_identity(self.host),
                    client=f"exporter:{self.host}",
                )
            return self._client.call(op, **args)
        except Exception as err:  # no operator (yet, or any more): serve without job labels
            log.debug("allocator unavailable: %s", err)
            if self._client is not None:
                self._client.close()
            self._client = None
            return None

    def _read_key(self) -> bytes | None:
        """The key the operator wrote for this host; None (said once) while there is none."""
        path = self.layout.agent_token_file(self.host)
        try:
            key = read_token_file(path)
        except TokenFileError as err:
            if not self._said_no_key:
                log.warning(
                    "no key for agent:%s (%s): the operator writes one for each host of its"
                    " pool (pass --host with this node's name in the pool, or give a key on"
                    " stdin with --key-stdin); serving without job labels until there is one",
                    self.host, err,
                )  # fmt: skip
                self._said_no_key = True
            return None
        self._said_no_key = False
        return key

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._fetched < OWNERS_MAX_AGE_SECONDS:
                return
            self._fetched = time.monotonic()
            reply = self._call("placements")
            self.reachable = reply is not None
            if reply is None:
                self._owners, self._pids = {}, {}
                return
            owners = {}
            for job, data in reply["placements"].items():
                for slot in Placement.from_json(data).slots():
                    owners[slot] = job
            pids: dict[int, list[int]] = {}
            for _job, host, _rank, gpu, pid in reply["bindings"]:
                if host == self.host and isinstance(pid, int):
                    pids.setdefault(gpu, []).append(pid)
            self._owners, self._pids = owners, pids

    def owners(self) -> dict[tuple[str, int], str]:
        self._refresh()
        return dict(self._owners)

    def gpu_owners(self) -> dict[int, str] | None:
        """The job holding each GPU index of this host (for dcgm-exporter's job mapping);
        None while the allocator cannot be asked."""
        owners = self.owners()
        if not self.reachable:
            return None
        return {index: job for (host, index), job in owners.items() if host == self.host}

    def bound_pids(self) -> dict[int, list[int]]:
        self._refresh()
        return {gpu: list(pids) for gpu, pids in self._pids.items()}

    def register(self, port: int) -> dict[str, Any] | None:
        """Register (the node's heartbeat); the operator's answer, None when it did not
        answer."""
        with self._lock:
            return self._call(
                "register_exporter", host=self.host, port=port, every=REGISTER_EVERY_SECONDS
            )

    def unregister(self, port: int) -> bool:
        """Leave the operator's scrape targets now (they would expire otherwise)."""
        with self._lock:
            return self._call("unregister_exporter", host=self.host, port=port) is not None


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD = "0.0.0.0"


@dataclass(frozen=True)
class ListenChoice:
    """Where the exporter serves without --listen, and why (for its log)."""

    address: str
    reason: str
    warning: str | None = None


def is_loopback(address: str) -> bool:
    if address in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def default_listen(
    host: str,
    resolved: str | None,
    operator: str | None,
    route: str | None,
    local: Collection[str],
) -> ListenChoice:
    """Where `herd-operator exporter` serves without --listen: where it is scraped, and on
    no other interface (each other one would only let more of the network reach it).

    The operator and Prometheus scrape `host:PORT`, the name the exporter registers, so it
    serves on the address `host` resolves to here (`resolved`) when that is this node's
    (`local`): this node's own address on a cluster, loopback for a pool on this node alone
    (`localhost`, or an operator on this node). A name that resolves to loopback while the
    operator (`operator`, its address from the state dir) is on another node, or that
    resolves to no address of this node: the address this node reaches the operator from
    (`route`). Every interface only when none of these is known, with a warning.
    """
    own = resolved if resolved and (is_loopback(resolved) or resolved in local) else None
    operator_here = operator is not None and (is_loopback(operator) or operator in local)
    if own is not None and not is_loopback(own):
        return ListenChoice(own, f"the address {host} resolves to, where it is scraped")
    if own is not None and (operator_here or (operator is None and host in LOOPBACK_NAMES)):
        return ListenChoice(own, f"loopback: {host} resolves to it and the pool is this node")
    if route is not None:
        found = "to loopback" if own is not None else "to no address of this node"
        return ListenChoice(
            route,
            f"the address this node reaches the operator at {operator} from ({host} "
            f"resolves {found} here)",
        )
    return ListenChoice(
        WILDCARD,
        "every interface",
        f"serving on every interface: {host} resolves to "
        f"{resolved or 'nothing'} here and the operator's address is not known (no "
        "allocator.json in the state dir yet); pass --listen with the address the operator "
        "and Prometheus scrape",
    )


def choose_listen(host: str, layout: StateLayout) -> ListenChoice:
    """`default_listen` for this node, from its resolver, its interfaces and the state dir."""
    operator = _operator_address(layout)
    return default_listen(
        host,
        _resolve(host),
        operator,
        None if operator is None else _route_to(operator),
        _local_addresses(),
    )


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except (OSError, ValueError):  # ValueError: UnicodeError, a label over 63 characters
        return None


def _operator_address(layout: StateLayout) -> str | None:
    """The address of the operator that wrote (or last wrote) the state dir's endpoint."""
    try:
        endpoint = json.loads(layout.endpoint_file.read_text(encoding="utf-8"))
        host, _ = parse_address(str(endpoint["address"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return host if ":" in host else _resolve(host)


def _route_to(address: str) -> str | None:
    """This node's address on the route to `address`: connecting a UDP socket sends
    nothing, it only picks the route."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return None


def _local_addresses() -> set[str]:
    return {
        entry.address.partition("%")[0]
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in (socket.AF_INET, socket.AF_INET6)
    }


def run_exporter(
    state_dir: Path,
    host: str | None,
    listen: str | None,
    port: int,
    virtual_gpus: int | None,
    virtual_gpu_memory: int,
    stop: threading.Event,
    *,
    per_process: bool = False,
    dcgm_job_mapping_dir: Path | None = None,
    key: bytes | None = None,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """Serve until `stop`. `virtual_gpus`: --virtual-gpus (None: see `choose_gpu_count`);
    `listen`: --listen (None: see `default_listen`)."""
    host = host or socket.gethostname()
    try:
        agent_identity(host)
    except ValueError:
        log.error("%r is not a host name the operator accepts; pass --host", host)
        return 2
    view = AllocatorView(StateLayout(state_dir), host, key)
    try:
        source, virtual, gpus = _gpu_source(host, view, virtual_gpus, virtual_gpu_memory, environ)
        gpu_ids, said = physical_gpu_ids(environ) if dcgm_job_mapping_dir else (None, "")
    except ValueError as err:
        log.error("%s", err)
        return 2
    registry = CollectorRegistry()
    registry.register(GpuCollector(source, view.owners, per_process=per_process))
    chosen = ListenChoice(listen, "--listen") if listen else choose_listen(host, view.layout)
    if chosen.warning is not None:
        log.warning("%s", chosen.warning)
    server = serve_metrics(registry, chosen.address, port)
    bound = server.server_port
    shown = f"[{chosen.address}]" if ":" in chosen.address else chosen.address
    log.info(
        "exporter for %s (%s) on http://%s:%d/metrics (%s)",
        host, _shown(gpus.current, virtual is not None), shown, bound, chosen.reason,
    )  # fmt: skip
    mapping: JobMappingLoop | None = None
    heard_slots = HeardSlots()
    if dcgm_job_mapping_dir is not None:
        writer = JobMappingWriter(dcgm_job_mapping_dir, view.gpu_owners, gpu_ids, heard_slots)
        mapping = JobMappingLoop(writer)
        mapping.start()
        log.info("writing dcgm-exporter's job mapping files in %s (%s)", dcgm_job_mapping_dir, said)
    registered = False
    try:
        while not stop.is_set():
            reply = view.register(bound)
            if reply is not None:
                _heard(host, reply, registered, gpus, virtual)
                heard_slots.slots = pool_indices(reply)
            registered = reply is not None
            stop.wait(REGISTER_EVERY_SECONDS if registered else RETRY_REGISTER_SECONDS)
    finally:
        if registered and view.unregister(bound):
            log.info("unregistered from the operator")
        if mapping is not None:
            mapping.stop()
        server.shutdown()
        server.server_close()
    return 0


def _gpu_source(
    host: str,
    view: AllocatorView,
    virtual_gpus: int | None,
    virtual_gpu_memory: int,
    environ: Mapping[str, str],
) -> tuple[GpuSource, VirtualGpuSource | None, ServedGpus]:
    """The GPUs the agent serves: NVML's where it sees some, else virtual ones (and the
    virtual source, whose count follows the pool). ValueError for a Slurm variable that is
    not Slurm's syntax, or NVIDIA devices NVML cannot read without --virtual-gpus."""
    nvml = nvml_gpu_count()
    if nvml:
        return NvmlGpuSource(host), None, ServedGpus(host, nvml, virtual_gpus, None)
    if virtual_gpus is None:
        check_no_unseen_gpus()
    slurm = slurm_gpu_count(environ) if virtual_gpus is None else None
    gpus = ServedGpus(host, 0, virtual_gpus, slurm)
    virtual = VirtualGpuSource(host, gpus.current.count, virtual_gpu_memory, view.bound_pids)
    return virtual, virtual, gpus


def _heard(
    host: str,
    reply: Mapping[str, Any],
    registered: bool,
    gpus: ServedGpus,
    virtual: VirtualGpuSource | None,
) -> None:
    """The operator answered a registration: say so once, and follow its pool's count."""
    pool = pool_gpus(reply)
    if not registered:
        log.info(
            "registered with the operator as agent:%s%s",
            host, "" if pool is None else f" (its pool has {pool} GPUs here)",
        )  # fmt: skip
    was = gpus.current
    changed, warning = gpus.heard(pool)
    if changed is not None and virtual is not None:
        # read() takes the count at each scrape: the next one has the new GPUs.
        virtual.count = changed.count
        log.info(
            "%s now serves %s (was %s)", host, _shown(changed, True), _shown(was, True)
        )  # fmt: skip
    if warning is not None:
        log.warning("%s", warning)


def _shown(gpus: GpuCount, virtual: bool) -> str:
    kind = "virtual GPUs" if virtual else "GPUs"
    return f"{gpus.count} {kind}, from {gpus.source}"
