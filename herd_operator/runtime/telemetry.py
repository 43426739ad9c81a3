"""Where the operator's GPU readings come from and where its metrics go.

This host's GPUs (NVML, or virtual GPUs measured from their workers), the source of the
policies' memory signal (the exported metrics read back: this host, the node exporters,
Prometheus or dcgm-exporter), the collectors and the HTTP server of `/metrics`, and
dcgm-exporter's job mapping files.

Apart from the operator's wiring because each is a choice among optional sources, made
from the settings alone (tests/unit/test_dcgm.py checks them without starting an operator),
and the sources are imported only when chosen: most runs use none of them.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.gpu import GpuSource, VirtualGpuSource
from herd_operator.exporters.http import serve_metrics
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.lifecycle import LoopHealth
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.config import OperatorConfig, OperatorError
from herd_operator.runtime.gpu_memory import GpuMemoryWatch, PeakGpuMemory
from herd_operator.runtime.handlers import ExporterRegistry
from herd_operator.runtime.metrics import StateCollector
from herd_operator.runtime.observer import ObserveReadings
from herd_operator.runtime.specdir import SpecDirectory
from herd_operator.runtime.store import Store

if TYPE_CHECKING:
    from herd_operator.exporters.dcgm import JobMappingLoop

log = logging.getLogger(__name__)


def local_gpus(config: OperatorConfig, allocator: Allocator) -> GpuSource | None:
    """This host's GPUs, when the pool is this one host: NVML, or virtual GPUs whose
    memory is their workers' memory."""
    hosts = config.pool.pool.hosts
    if len(hosts) != 1:
        return None
    host, gpus = hosts[0]
    if not config.pool.virtual:
        return NvmlGpuSource(host)

    def bound_pids() -> dict[int, list[int]]:
        pids: dict[int, list[int]] = {}
        for binding in allocator.bindings():
            if binding.host == host and binding.pid is not None:
                pids.setdefault(binding.gpu, []).append(binding.pid)
        return pids

    return VirtualGpuSource(host, max(gpus) + 1, config.virtual_gpu_memory_bytes, bound_pids)


def observed_gpus(
    config: OperatorConfig, local: GpuSource | None, exporters: ExporterRegistry
) -> GpuSource:
    """Where the policies' memory signal comes from: the exported metrics, read back."""
    # Each source imported only when chosen: most runs use none of them.
    if config.gpu_metrics == "dcgm":
        from herd_operator.exporters.dcgm import (
            DcgmPrometheusGpuSource,
            DcgmScrapeGpuSource,
            dcgm_exporter_urls,
        )

        if config.prometheus_url:
            return DcgmPrometheusGpuSource(config.prometheus_url)
        hosts = [host for host, _ in config.pool.pool.hosts]
        return DcgmScrapeGpuSource(list(config.dcgm_exporter_urls) or dcgm_exporter_urls(hosts))
    if config.prometheus_url:
        from herd_operator.exporters.sources import PrometheusGpuSource

        return PrometheusGpuSource(config.prometheus_url)
    if local is not None:
        return local
    from herd_operator.exporters.sources import ScrapeGpuSource

    return ScrapeGpuSource(exporters.urls)


def job_mapping(
    config: OperatorConfig,
    allocator: Allocator,
    health: LoopHealth | None = None,
    environ: Mapping[str, str] = os.environ,
) -> JobMappingLoop | None:
    """dcgm-exporter's job mapping files for this host's GPUs, when asked for, named by
    their physical ids (`physical_gpu_ids` of `environ`). The loop leaves its lines on
    stop: the operator takes them out unless its jobs run on."""
    directory = config.dcgm_job_mapping_dir
    hosts = config.pool.pool.hosts
    if directory is None:
        return None
    if len(hosts) != 1:
        log.warning(
            "--dcgm-job-mapping-dir: the pool spans %d hosts; each node's exporter keeps "
            "its node's files (herd-operator exporter --dcgm-job-mapping-dir)",
            len(hosts),
        )
        return None
    host = hosts[0][0]

    def owners() -> dict[int, str]:
        return {
            index: job
            for job, placement in allocator.placements().items()
            for slot_host, index in placement.slots()
            if slot_host == host
        }

    from herd_operator.exporters.dcgm import JobMappingLoop, JobMappingWriter, physical_gpu_ids

    try:
        gpu_ids, said = physical_gpu_ids(environ)
    except ValueError as err:
        raise OperatorError(f"--dcgm-job-mapping-dir: {err}") from None
    log.info("dcgm-exporter's job mapping files in %s (%s)", directory, said)

    def slots() -> tuple[int, ...]:
        return dict(allocator.pool.hosts).get(host, ())

    writer = JobMappingWriter(directory, owners, gpu_ids, slots)
    return JobMappingLoop(writer, clear_on_stop=False, health=health)


def worker_pids(allocator: Allocator) -> dict[tuple[str, int], str]:
    """(host, pid) of every bound worker -> its job: whose GPU memory a process is."""
    return {
        (binding.host, binding.pid): binding.job
        for binding in allocator.bindings()
        if binding.pid is not None
    }


def memory_watch(
    store: Store,
    allocator: Allocator,
    specs: Callable[[], SpecDirectory | None],
    *,
    peaks: PeakGpuMemory | None = None,
) -> GpuMemoryWatch:
    """Each job's peak GPU memory per worker while it holds GPUs (its run, to the
    allocator: a job that gave back all its GPUs starts over) into `peaks` (the allocator's
    input for sharing: made here unless given), and the MemoryOverShare warnings against
    the sharing jobs' requests in the `specs` (`requested_shares`); each round's memory per
    job and GPU to the allocator's guard (`guard_memory`) when GPUs are shared."""
    return GpuMemoryWatch(
        PeakGpuMemory() if peaks is None else peaks,
        lambda: worker_pids(allocator),
        lambda: dict.fromkeys(allocator.placements(), "placed"),
        RequestedShares(specs),
        store.add_event,
        # A sharing job near its share is moved or shrunk by the allocator (sharing_guard.py).
        on_used=allocator.guard_memory if allocator.sharing is not None else lambda used: None,
    )


class RequestedShares:
    """`requested_shares` of the spec directory `specs()` gives, asked each sampling round:
    read again only after a relist changed a job (`SpecDirectory.version`), not every
    round (at 1,000 jobs a reading costs milliseconds; docs/mechanisms.md has the figure).
    Called by the sampling loop's thread only."""

    def __init__(self, specs: Callable[[], SpecDirectory | None]) -> None:
        self._specs = specs
        self._read: tuple[SpecDirectory, int, Mapping[str, int]] | None = None

    def __call__(self) -> Mapping[str, int]:
        directory = self._specs()
        if directory is None:  # not read yet
            return {}
        # Taken before the views are read: a relist in between makes the next call read
        # them again, never keeps what it changed unread.
        version = directory.version
        if self._read is None or self._read[0] is not directory or self._read[1] != version:
            self._read = (directory, version, requested_shares(directory))
        return self._read[2]


def requested_shares(specs: SpecDirectory | None) -> dict[str, int]:
    """Each sharing job's GPU memory request per worker (`spec.gpus.memory`): the share its
    workers are warned against (`MemoryOverShare`) and limited to (HERD_GPU_MEMORY_LIMIT_BYTES).
    A sharing job without a request has no share to be over: it is placed by its peak."""
    shares: dict[str, int] = {}
    if specs is None:  # not read yet
        return shares
    for name in specs.names():
        view = specs.view(name)
        job = view.job if view is not None else None
        memory = job.spec.gpus.memory_bytes if job is not None and job.spec.gpus.share else None
        if memory is not None:
            shares[name] = memory
    return shares


def memory_feed(
    watch: GpuMemoryWatch, local: GpuSource | None, observed: GpuSource
) -> ObserveReadings:
    """What feeds the jobs' measured memory each sampling round: the round's readings, unless
    they come back from Prometheus or dcgm-exporter, which carry no processes; then this
    host's own GPUs, read again. (Across nodes, the node exporters' readings carry processes
    with their `--process-metrics`.)"""
    if local is None or local is observed:
        return watch.observe
    return lambda readings, now: watch.observe(local.read(), now)


def register_collectors(
    registry: CollectorRegistry,
    config: OperatorConfig,
    local: GpuSource | None,
    store: Store,
    allocator: Allocator,
    server: RpcServer,
) -> None:
    """The jobs' and the pool's state, and this host's GPUs when the pool is this host."""
    registry.register(
        StateCollector(
            store,
            lambda: allocator.pool,
            allocator.placements,
            server.request_counts,
            allocator.overdue_drains,
        )
    )
    if local is not None:

        def owners() -> dict[tuple[str, int], str]:
            return {
                slot: job
                for job, placement in allocator.placements().items()
                for slot in placement.slots()
            }

        registry.register(
            GpuCollector(
                local,
                owners,
                per_process=config.process_metrics,
                pid_owners=lambda: worker_pids(allocator),
            )
        )


class MetricsServer:
    """`/metrics` over HTTP on `config.metrics_host:metrics_port` (a runnable: `start` binds);
    `address` is where Prometheus reaches it (the advertised host, or this host's name when it
    listens on every address)."""

    name = "metrics-server"

    def __init__(self, registry: CollectorRegistry, config: OperatorConfig, port: int) -> None:
        self._registry = registry
        self._config = config
        self._port = port
        self._server: Any = None
        self.address: str | None = None

    def start(self) -> None:
        config = self._config
        self._server = serve_metrics(self._registry, config.metrics_host, self._port)
        host = config.advertise_host or config.metrics_host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        port = self._server.server_port
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("metrics on http://%s/metrics", self.address)

    def stop(self, timeout: float) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
