"""Wires the parts together and runs the control loop in the foreground.

Threads: the main thread takes job names off the work queue and reconciles
them one at a time (so decisions never race); the spec watcher, the RPC server
and one waiter per `horovodrun` only put names on the queue.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from controllers.loop import ControlLoop
from controllers.reconciler import JobReconciler
from controllers.workqueue import WorkQueue
from exporters.collector import GpuCollector
from exporters.gpu import GpuSource, VirtualGpuSource
from exporters.http import serve_metrics
from exporters.nvml import NvmlGpuSource
from exporters.sources import PrometheusGpuSource, ScrapeGpuSource
from herd_operator.auth import ensure_token_file
from herd_operator.environment import ALLOCATOR_ENV, STATE_DIR_ENV, TOKEN_FILE_ENV
from herd_operator.layout import (
    StateLayout,
    make_runtime_dir,
    remove_runtime_dir,
    runtime_base,
    write_atomically,
)
from herd_operator.rpc import RpcServer
from herd_operator.runtime.allocator import DEFAULT_DRAIN_SECONDS, Allocator
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.handlers import ExporterRegistry, ReportHandler
from herd_operator.runtime.launcher import Launcher, find_orphans, stop_orphans
from herd_operator.runtime.metrics import OperatorMetrics, StateCollector
from herd_operator.runtime.observer import UsageObserver
from herd_operator.runtime.pools import PoolSource
from herd_operator.runtime.specdir import DirectoryWatcher, SpecDirectory
from herd_operator.runtime.store import Store

log = logging.getLogger(__name__)

GC_THRESHOLDS = (50_000, 20, 100)
"""The collector's thresholds for the operator process. Python's default (700, 10, 10)
is made for short scripts: with tens of thousands of live objects (one spec model per
job) it spent a third of a 10,000-file relist walking them again and again."""


WANTED_DESCRIPTORS = 8192
"""Open files the operator asks for: RPC connections (up to 1,024 authenticated and 64
not yet), spec files during a relist, job logs, the database, metrics connections."""


def raise_descriptor_limit(wanted: int = WANTED_DESCRIPTORS) -> int:
    """Lift the soft limit on open files towards `wanted` (never above the hard limit), so a
    flood of connections cannot starve the relist, the store or the sampler; returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft != resource.RLIM_INFINITY and soft < 2048:
        log.warning(
            "only %d open files allowed (hard limit); under a flood of connections the"
            " operator may run out (raise it with `ulimit -Hn`)",
            soft,
        )
    return int(soft)


def tune_gc() -> None:
    """Collect less often: the operator allocates in bursts and holds its objects long."""
    gc.set_threshold(*GC_THRESHOLDS)


@dataclass(frozen=True)
class OperatorConfig:
    specs_dir: Path
    state_dir: Path
    pool: PoolSource
    listen_host: str = "127.0.0.1"
    advertise_host: str | None = None
    """Address workers use to reach the allocator (default: listen_host)."""
    resync_seconds: float = 5.0
    relist_seconds: float = 10.0
    grace_seconds: float = 10.0
    watch_events: bool = True
    min_resize_interval: float = 30.0
    """A job's size is left alone this long after it changed (each change resets Horovod)."""
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    """How long a GPU taken from a job may drain before a DrainOverdue warning (it stays
    held until its workers are seen to leave it)."""
    virtual_gpu_memory_bytes: int = 2 << 30
    """Capacity of one virtual GPU (CPU machines), against which worker memory is measured."""
    sample_seconds: float = 1.0
    """How often the memory of each job's GPUs is sampled."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Serve Prometheus metrics here (0: any free port; None: not at all)."""
    prometheus_url: str | None = None
    """Read the GPU memory signal back from this Prometheus server (PromQL) instead of
    from this host's GPUs or the registered exporters."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    runtime_dir: Path | None = None
    """Where to make the private directory for grant files and discovery scripts (default:
    $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)."""


class OperatorError(Exception):
    """The operator cannot start (bad state dir, another operator running, port in use)."""


class Operator:
    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.layout = StateLayout(config.state_dir)
        self.queue = WorkQueue()
        self._lock_handle: Any = None
        self.store: Store | None = None
        self.server: RpcServer | None = None
        self.watcher: DirectoryWatcher | None = None
        self.launcher: Launcher | None = None
        self.allocator: Allocator | None = None
        self.observer: UsageObserver | None = None
        self.metrics = OperatorMetrics(CollectorRegistry())
        self._metrics_server: Any = None
        self._metrics_address: str | None = None
        self.exporters: ExporterRegistry | None = None
        self.loop: ControlLoop | None = None
        self.specs = SpecDirectory(config.specs_dir)
        self.ready = threading.Event()

    # ---- lifecycle ----

    def _open(self) -> ControlLoop:
        config = self.config
        self.layout.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._lock_handle = open(self.layout.root / "operator.lock", "w")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise OperatorError(
                f"another herd-operator is running on state dir {self.layout.root}"
            ) from err
        raise_descriptor_limit()
        previous_runtime = self._use_runtime_dir()
        self.layout.create()
        self.store = store = Store(self.layout.database)
        token = ensure_token_file(self.layout.token_file)
        hosts = tuple(host_name for host_name, _ in config.pool.pool.hosts)
        engines = EngineDispatch(EngineContext(self.layout, hosts))
        self.allocator = allocator = Allocator(
            config.pool.pool,
            engines,
            virtual=config.pool.virtual,
            on_decision=lambda placements: store.replace_allocations(placements, time.time()),
            min_resize_interval=config.min_resize_interval,
            drain_seconds=config.drain_seconds,
            present=engines.present,
            on_event=lambda job, type, reason, message: store.add_event(
                job, type, reason, message, time.time()
            ),
        )
        # Ready before the RPC server starts: an exporter may register at once.
        self.exporters = exporters = ExporterRegistry(self.layout.scrape_targets_file, None)
        self.server = server = RpcServer(
            token,
            {
                "bind": allocator.handle_bind,
                "grant": allocator.handle_grant,
                "placements": allocator.handle_placements,
                "report": ReportHandler(store, allocator, self.queue.add),
                "register_exporter": exporters,
                "ping": lambda args: {"pid": os.getpid()},
            },
            host=config.listen_host,
        )
        host, port = server.start()
        local = self._local_gpus(allocator)
        self._serve_metrics(local, store, allocator, server)
        exporters.operator_address = self._metrics_address
        exporters.write_targets()
        self.observer = UsageObserver(
            self._observed_gpus(local, exporters),
            allocator.placements,
            store.add_usage,
            interval=config.sample_seconds,
        )
        advertised = config.advertise_host or host
        address = f"[{advertised}]:{port}" if ":" in advertised else f"{advertised}:{port}"
        write_atomically(
            self.layout.endpoint_file,
            json.dumps(
                {
                    "address": address,
                    "metrics": self._metrics_address,
                    "pid": os.getpid(),
                    "pool": config.pool.description,
                }
            ),
            mode=0o600,
        )
        self.launcher = launcher = Launcher(self.queue.add, grace_seconds=config.grace_seconds)
        env = {
            ALLOCATOR_ENV: address,
            TOKEN_FILE_ENV: str(self.layout.token_file.resolve()),
            STATE_DIR_ENV: str(self.layout.root.resolve()),
            **config.extra_env,
        }
        job_launcher = JobLauncher(launcher, engines, self.layout, env)
        self._stop_orphans(store)
        if previous_runtime is not None and previous_runtime != self.layout.runtime:
            # A crashed operator's grants: its jobs were just stopped, nothing reads them.
            remove_runtime_dir(previous_runtime)
        self._enqueue_known_jobs()
        log.info(
            "pool: %s; allocator on %s; specs from %s; state in %s",
            config.pool.description,
            address,
            config.specs_dir,
            self.layout.root,
        )
        reconciler = JobReconciler(
            self.specs,
            store,
            allocator,
            job_launcher,
            resync_seconds=config.resync_seconds,
            metrics_stale_seconds=max(15.0, 10 * config.sample_seconds),
            observer=self.metrics,
        )
        self.loop = ControlLoop(self.queue, reconciler, allocator, store, observer=self.metrics)
        return self.loop

    def _use_runtime_dir(self) -> Path | None:
        """Make this run's runtime directory and record it; returns the one recorded before."""
        record = self.layout.runtime_record
        try:
            previous: Path | None = Path(record.read_text().strip())
        except FileNotFoundError:
            previous = None
        base = runtime_base(self.config.runtime_dir)
        runtime = None
        if base is not None:
            try:
                runtime = make_runtime_dir(base)
            except OSError as err:
                if self.config.runtime_dir is not None:
                    raise OperatorError(
                        f"cannot make a runtime directory in {base}: {err}"
                    ) from err
                log.warning(
                    "no runtime directory in %s (%s); grants go to the state dir", base, err
                )
        self.layout = StateLayout(self.layout.root, runtime)
        if runtime is None:
            record.unlink(missing_ok=True)
        else:
            write_atomically(record, f"{runtime}\n")
        log.info("grants and discovery scripts in %s", self.layout.grants_dir)
        return previous

    def _local_gpus(self, allocator: Allocator) -> GpuSource | None:
        """This host's GPUs, when the pool is this one host: NVML, or virtual GPUs whose
        memory is their workers' memory."""
        hosts = self.config.pool.pool.hosts
        if len(hosts) != 1:
            return None
        host, gpus = hosts[0]
        if not self.config.pool.virtual:
            return NvmlGpuSource(host)

        def bound_pids() -> dict[int, list[int]]:
            pids: dict[int, list[int]] = {}
            for binding in allocator.bindings():
                if binding.host == host and binding.pid is not None:
                    pids.setdefault(binding.gpu, []).append(binding.pid)
            return pids

        return VirtualGpuSource(
            host, max(gpus) + 1, self.config.virtual_gpu_memory_bytes, bound_pids
        )

    def _observed_gpus(self, local: GpuSource | None, exporters: ExporterRegistry) -> GpuSource:
        """Where the policies' memory signal comes from: the exported metrics, read back."""
        if self.config.prometheus_url:
            return PrometheusGpuSource(self.config.prometheus_url)
        if local is not None:
            return local
        return ScrapeGpuSource(exporters.urls)

    def _serve_metrics(
        self, local: GpuSource | None, store: Store, allocator: Allocator, server: RpcServer
    ) -> None:
        registry = self.metrics.registry
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

            registry.register(GpuCollector(local, owners))
        if self.config.metrics_port is None:
            return
        http_server = serve_metrics(registry, self.config.metrics_host, self.config.metrics_port)
        self._metrics_server = http_server
        host = self.config.advertise_host or self.config.metrics_host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        port = http_server.server_port
        self._metrics_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        log.info("metrics on http://%s/metrics", self._metrics_address)

    def _stop_orphans(self, store: Store) -> None:
        """Jobs a crashed operator left running are stopped before they are started again.

        Nothing tells this operator what they hold or how they are doing, and the jobs it
        is about to start would share their GPUs. (Adopting them instead is a later step.)
        """
        orphans = find_orphans(self.layout.root)
        if not orphans:
            return
        for orphan in orphans:
            log.warning(
                "%s: %d process(es) of launch %s outlived the previous operator; stopping them",
                orphan.job, len(orphan.pids), orphan.launch_id[:8],
            )  # fmt: skip
        stop_orphans(orphans, self.config.grace_seconds)
        now = time.time()
        for orphan in orphans:
            if store.get_job(orphan.job) is not None:
                store.add_event(
                    orphan.job, "Warning", "Orphaned",
                    f"{len(orphan.pids)} process(es) left by an operator that did not shut down "
                    "cleanly were stopped; the job starts again",
                    now,
                )  # fmt: skip

    def _enqueue_known_jobs(self) -> None:
        """Reconcile every recorded job once: a previous operator stopped them on shutdown,
        so they start again if their spec is still there (re-adopting jobs that outlived a
        crashed operator is a later step)."""
        assert self.store is not None
        for record in self.store.list_jobs():
            self.queue.add(record.name)

    def run(self, stop: threading.Event) -> int:
        """Serve until `stop` is set; then stop every job and release everything."""
        loop = self._open()
        self.watcher = DirectoryWatcher(
            self.specs,
            loop.wake_all,
            relist_seconds=self.config.relist_seconds,
            use_events=self.config.watch_events,
        )
        self.watcher.start()
        if self.observer is not None:
            self.observer.start()
        assert self.allocator is not None
        # A node lost or back: the allocator decides again and wakes the jobs it moved.
        self.config.pool.start(self.allocator.set_pool)
        self.ready.set()
        try:
            loop.run(stop)
        finally:
            self._shutdown()
        return 0

    def _shutdown(self) -> None:
        log.info("shutting down: stopping jobs")
        self.config.pool.stop()
        if self.watcher is not None:
            self.watcher.stop()
        if self.observer is not None:
            self.observer.stop()
        self.queue.shutdown()
        if self.launcher is not None:
            stubborn = self.launcher.stop_all(timeout=self.config.grace_seconds + 5)
            if stubborn:
                log.error("processes of %s would not exit", ", ".join(stubborn))
            self._record_shutdown()
        if self.server is not None:
            self.server.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        self.layout.endpoint_file.unlink(missing_ok=True)
        if self.layout.runtime is not None:
            remove_runtime_dir(self.layout.runtime)
            self.layout.runtime_record.unlink(missing_ok=True)
        if self.store is not None:
            self.store.close()
        if self._lock_handle is not None:
            self._lock_handle.close()
        log.info("stopped")

    def _record_shutdown(self) -> None:
        """Jobs were stopped with the operator: their status says so; every GPU is free."""
        assert self.allocator is not None
        if self.loop is not None:
            self.loop.record_shutdown()
        self.allocator.release_all()
