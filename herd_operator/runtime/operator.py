"""Wires the parts together and runs the control loop in the foreground.

Threads: the main thread takes job names off the work queue and reconciles
them one at a time (so decisions never race); the spec watcher, the RPC server
and one waiter per `horovodrun` only put names on the queue.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prometheus_client import CollectorRegistry

from herd_operator.auth import agent_key, ensure_token_file, write_token_file
from herd_operator.controllers.workqueue import WorkQueue
from herd_operator.environment import ALLOCATOR_ENV, GPU_ENV, STATE_DIR_ENV
from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.gpu import GpuSource, VirtualGpuSource
from herd_operator.exporters.http import serve_metrics
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.layout import (
    StateLayout,
    is_runtime_dir,
    make_runtime_dir,
    remove_runtime_dir,
    runtime_base,
    write_atomically,
)
from herd_operator.rpc.protocol import Handler, parse_address
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.allocator import (
    DEFAULT_DRAIN_SECONDS,
    DEFAULT_MAX_WAIT_SECONDS,
    Allocator,
    Binding,
)
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.engines.horovod import LOCAL_HOSTS, local_names
from herd_operator.runtime.handlers import (
    GROUPED_OPS,
    ExporterRegistry,
    ReportHandler,
    for_agents,
    for_anyone,
    for_own_host,
    for_own_job,
    heard_from,
    store_group,
)
from herd_operator.runtime.launcher import Adopted, Launcher
from herd_operator.runtime.metrics import OperatorMetrics, StateCollector
from herd_operator.runtime.observer import UsageObserver
from herd_operator.runtime.pools import PoolSource
from herd_operator.runtime.pools.base import ListsHosts
from herd_operator.runtime.pools.heartbeat import DEFAULT_NODE_TIMEOUT_SECONDS, NodeWatch
from herd_operator.runtime.process_table import (
    JobProcess,
    find_orphans,
    job_processes,
    stop_orphans,
)
from herd_operator.runtime.pruner import (
    DEFAULT_RETENTION_SECONDS,
    PRUNE_INTERVAL_SECONDS,
    Pruner,
)
from herd_operator.runtime.store import MAX_GRANTS_PER_JOB, Store, StoreError
from herd_operator.specs.conditions import REPORT_DEADLINE_SECONDS
from herd_operator.specs.values import Drain, Placement, Pool, Slot

if TYPE_CHECKING:
    # Imported where used, once the operator serves: a restarted operator answers its
    # jobs' workers before it spends the time to import the control loop, the policies,
    # the spec directory's watcher and the optional metric sources.
    from herd_operator.controllers.loop import ControlLoop
    from herd_operator.exporters.dcgm import JobMappingLoop
    from herd_operator.runtime.specdir import DirectoryWatcher, SpecDirectory

log = logging.getLogger(__name__)

GC_THRESHOLDS = (50_000, 20, 100)
"""The collector's thresholds for the operator process. Python's default (700, 10, 10)
is made for short scripts: with tens of thousands of live objects (one spec model per
job) it spent a third of a 10,000-file relist walking them again and again."""

STORE_CHECKPOINT_SECONDS = 1.0
"""How often the store's own thread copies its write-ahead log into the database (a few MB
at most at thousands of reports a second), so no commit of the RPC thread does it."""

WANTED_DESCRIPTORS = 8192
"""Open files the operator asks for: RPC connections (up to 1,024 authenticated and 256
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
    listen_port: int | None = None
    """The allocator's port; None: the previous operator's (its jobs' workers know that
    one), else any free port."""
    advertise_host: str | None = None
    """Address workers use to reach the allocator (default: listen_host)."""
    network_interface: str | None = None
    """The interface between the pool's nodes, for Horovod (None: a pool on this host)."""
    node_timeout_seconds: float = DEFAULT_NODE_TIMEOUT_SECONDS
    """A node whose agent was heard and then silent this long is lost (none of its free GPUs
    granted) until its agent calls again, whatever probes say; one whose agent missed two
    calls is suspect at once (`pools/heartbeat.py`)."""
    resync_seconds: float = 5.0
    relist_seconds: float = 10.0
    report_deadline_seconds: float = REPORT_DEADLINE_SECONDS
    """A launch none of whose workers reported within this long gets `Reporting=False`."""
    grace_seconds: float = 10.0
    watch_events: bool = True
    min_resize_interval: float = 30.0
    """A job's size is left alone this long after it changed (each change resets Horovod)."""
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    """How long a GPU taken from a job may drain before a DrainOverdue warning (it stays
    held until its workers are seen to leave it)."""
    spare_by_gain: bool = False
    """The allocator lends GPUs nobody wants by the gain policies report (`Allocator`)."""
    smallest_first: bool = False
    """The allocator admits pending jobs smallest min first (`Allocator`)."""
    share_by_gain: bool = False
    """The allocator divides the GPUs above the mins by the gain policies report (`Allocator`)."""
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS
    """With `smallest_first`: a job pending this long is admitted first."""
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
    gpu_metrics: Literal["herd", "dcgm"] = "herd"
    """Whose metrics give the memory signal: herd's exporters, or NVIDIA's dcgm-exporter
    (its DCGM_FI_DEV_FB_* series, from `prometheus_url` or `dcgm_exporter_urls`)."""
    dcgm_exporter_urls: tuple[str, ...] = ()
    """dcgm-exporter pages to scrape (default: port 9400 of every host of the pool)."""
    process_metrics: bool = False
    """Export each GPU process's memory with a `pid` label (a new series per restart)."""
    dcgm_job_mapping_dir: Path | None = None
    """Keep dcgm-exporter's HPC job mapping files for this host's GPUs here (one-host pools;
    node exporters keep their own node's)."""
    extra_env: Mapping[str, str] = field(default_factory=dict)
    leave_jobs_running: bool = False
    """On shutdown, stop only the operator: the next one on this state dir adopts the jobs."""
    runtime_dir: Path | None = None
    """Where to make the private directory for grant files and discovery scripts (default:
    $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)."""
    grant_history_per_job: int = MAX_GRANTS_PER_JOB
    """Grant changes kept per job in the store (the newest)."""
    deleted_job_retention_seconds: float = DEFAULT_RETENTION_SECONDS
    """A deleted job's grant history, log and leftover files go this long after its last
    grant change or write."""
    prune_interval_seconds: float = PRUNE_INTERVAL_SECONDS
    agent_key_files: bool = True
    """Write each pool host's agent key to the state dir (0600), where `herd-operator
    exporter` reads it; False where the agents get theirs on stdin (`agent-key`)."""


class ExitsRecordedFirst:
    """The loop's store groups, with the launch records of the exits a group handled removed
    only once the group (the statuses that record those exits) is committed.

    Removing a finished launch's record first left an instant where a killed operator had
    neither the record nor the final status, and its successor ran the job again. In this
    order a kill between the commit and the removal leaves the record of an exit that the
    status has already recorded; the reconciler sees that and does not act on it twice.
    """

    def __init__(self, store: Store, launcher: Launcher) -> None:
        self._store = store
        self._launcher = launcher

    @property
    def writable(self) -> bool:
        return self._store.writable

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        try:
            with self._store.transaction():
                yield
        except StoreError:
            # The group is lost: its reconciles are redone and must see their exits again.
            self._launcher.restore_forgotten()
            raise
        finally:
            # A no-op after restore_forgotten() took them all back.
            self._launcher.release_forgotten()


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
        self.job_mapping: JobMappingLoop | None = None
        self.metrics = OperatorMetrics(CollectorRegistry())
        self._metrics_server: Any = None
        self._metrics_address: str | None = None
        self.exporters: ExporterRegistry | None = None
        self.nodes: NodeWatch | None = None
        self.loop: ControlLoop | None = None
        self.specs: SpecDirectory | None = None
        self.ready = threading.Event()
        self.pruner: Pruner | None = None

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
        try:
            # The token is made right after the store first opened: with it there, a 0-byte
            # database was truncated, not new.
            store = Store(
                self.layout.database,
                previous_state=(self.layout.token_file,),
                max_grants_per_job=config.grant_history_per_job,
                checkpoint_seconds=STORE_CHECKPOINT_SECONDS,
            )
        except StoreError as err:
            raise OperatorError(str(err)) from err
        self.store = store
        try:
            store.record_pool_size(config.pool.pool.size, time.time())
        except StoreError as err:  # a full disk: the report then infers the pool's size
            log.warning("cannot record the pool's size in the state store: %s", err)
        token = ensure_token_file(self.layout.token_file)
        hosts = tuple(host_name for host_name, _ in config.pool.pool.hosts)
        self._write_agent_keys(token, hosts)
        engines = EngineDispatch(
            EngineContext(self.layout, hosts, network_interface=config.network_interface)
        )
        # Before the allocator, which asks it in every decision which nodes may be granted.
        source = config.pool
        self.nodes = nodes = NodeWatch(
            source.pool,
            self._cordon,
            config.node_timeout_seconds,
            on_node=self._node_event,
            local_hosts={*LOCAL_HOSTS, socket.gethostname(), *local_names()},
            still_listed=source.still_lists if isinstance(source, ListsHosts) else _listed,
        )
        self.allocator = allocator = Allocator(
            config.pool.pool,
            engines,
            virtual=config.pool.virtual,
            on_decision=lambda decision: store.replace_allocations(
                decision.placements, time.time(), decision.draining
            ),
            min_resize_interval=config.min_resize_interval,
            drain_seconds=config.drain_seconds,
            spare_by_gain=config.spare_by_gain,
            smallest_first=config.smallest_first,
            share_by_gain=config.share_by_gain,
            max_wait_seconds=config.max_wait_seconds,
            present=engines.present,
            on_event=lambda job, type, reason, message: store.add_event(
                job, type, reason, message, time.time()
            ),
            unavailable_hosts=nodes.unavailable,
            on_workers_lost=nodes.workers_vanished,
        )
        # A group rolled back (a full disk) took the decisions recorded in it along.
        store.on_rollback(allocator.mark_unrecorded)
        self.launcher = launcher = Launcher(
            self.queue.add, grace_seconds=config.grace_seconds, records_dir=self.layout.launches_dir
        )
        # Before the RPC server starts: a worker's first call must find its GPUs held.
        self._adopt(store, allocator, launcher, engines)
        if previous_runtime is not None and previous_runtime != self.layout.runtime:
            remove_runtime_dir(previous_runtime)  # nothing adopted reads it
        # Ready before the RPC server starts: an exporter may register at once.
        self.exporters = exporters = ExporterRegistry(
            self.layout.scrape_targets_file, None, pool=lambda: allocator.pool
        )
        self.server = server = self._start_rpc_server(
            token,
            {
                "bind": for_own_job(allocator.handle_bind),
                "grant": for_own_job(allocator.handle_grant),
                "placements": for_agents(allocator.handle_placements),
                "report": for_own_job(ReportHandler(store, allocator, self.queue.add)),
                "register_exporter": for_own_host(heard_from(nodes, exporters)),
                "unregister_exporter": for_own_host(exporters.unregister),
                "ping": for_anyone(lambda args: {"pid": os.getpid()}),
            },
            store,
        )
        host, port = server.address
        local = self._local_gpus(allocator)
        self._serve_metrics(local, store, allocator, server)
        exporters.operator_address = self._metrics_address
        exporters.write_targets()
        exporters.start()
        self.job_mapping = self._job_mapping(allocator)
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
        env = {
            ALLOCATOR_ENV: address,
            STATE_DIR_ENV: str(self.layout.root.resolve()),
            **config.extra_env,
        }
        job_launcher = JobLauncher(launcher, engines, self.layout, env, token)
        self._enqueue_known_jobs()
        log.info(
            "pool: %s; allocator on %s; specs from %s; state in %s",
            config.pool.description,
            address,
            config.specs_dir,
            self.layout.root,
        )
        from herd_operator.controllers.loop import ControlLoop
        from herd_operator.controllers.reconciler import JobReconciler
        from herd_operator.runtime.specdir import SpecDirectory

        self.specs = SpecDirectory(config.specs_dir)
        reconciler = JobReconciler(
            self.specs,
            store,
            allocator,
            job_launcher,
            resync_seconds=config.resync_seconds,
            metrics_stale_seconds=max(15.0, 10 * config.sample_seconds),
            report_deadline_seconds=config.report_deadline_seconds,
            observer=self.metrics,
            nodes=nodes,
        )
        self.loop = ControlLoop(
            self.queue,
            reconciler,
            allocator,
            ExitsRecordedFirst(store, launcher),
            observer=self.metrics,
        )
        return self.loop

    def _write_agent_keys(self, token: bytes, hosts: tuple[str, ...]) -> None:
        """One key per pool host for its node agent, each able to speak for that host only
        (`agent:<host>`), unless the agents get theirs on stdin (`agent-key`). The one key
        that operators before spoke for every host with goes: no server accepts it now."""
        self.layout.legacy_agent_token_file.unlink(missing_ok=True)
        for host in hosts:
            key_file = self.layout.agent_token_file(host)
            if self.config.agent_key_files:
                write_token_file(key_file, agent_key(token, host))
            else:
                key_file.unlink(missing_ok=True)

    def _start_rpc_server(
        self, token: bytes, handlers: Mapping[str, Handler], store: Store
    ) -> RpcServer:
        """The allocator's RPC server, on the previous operator's port when none is asked for:
        the workers of adopted jobs reach the allocator at the address they were given.

        Reports that arrive together share one store commit (each answered after it)."""
        config = self.config

        def serve(port: int) -> RpcServer:
            return RpcServer(
                token,
                handlers,
                host=config.listen_host,
                port=port,
                grouped_ops=GROUPED_OPS,
                commit_group=lambda: store_group(store),
            )

        port = config.listen_port
        previous = self._previous_port() if port is None else None
        if previous is not None:
            server = serve(previous)
            try:
                server.start()
                return server
            except OSError as err:
                log.warning(
                    "cannot listen on the previous operator's port %d (%s); the workers of"
                    " jobs it started cannot reach this allocator until they are restarted",
                    previous, err,
                )  # fmt: skip
        server = serve(port or 0)
        server.start()
        return server

    def _previous_port(self) -> int | None:
        """The port in the endpoint file a previous operator left (after a crash)."""
        try:
            endpoint = json.loads(self.layout.endpoint_file.read_text(encoding="utf-8"))
            return parse_address(str(endpoint["address"]))[1]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _use_runtime_dir(self) -> Path | None:
        """Pick this run's runtime directory and record it; returns the one recorded before.

        The previous operator's is used again when it is still there: the jobs it started
        run on (they are adopted) and their discovery scripts read their grants from it.
        """
        record = self.layout.runtime_record
        try:
            previous: Path | None = Path(record.read_text().strip())
        except FileNotFoundError:
            previous = None
        base = runtime_base(self.config.runtime_dir)
        runtime = None
        if previous is not None and is_runtime_dir(previous):
            runtime = previous
        elif base is not None:
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
        # Each source imported only when chosen: most runs use none of them.
        if self.config.gpu_metrics == "dcgm":
            from herd_operator.exporters.dcgm import (
                DcgmPrometheusGpuSource,
                DcgmScrapeGpuSource,
                dcgm_exporter_urls,
            )

            if self.config.prometheus_url:
                return DcgmPrometheusGpuSource(self.config.prometheus_url)
            hosts = [host for host, _ in self.config.pool.pool.hosts]
            return DcgmScrapeGpuSource(
                list(self.config.dcgm_exporter_urls) or dcgm_exporter_urls(hosts)
            )
        if self.config.prometheus_url:
            from herd_operator.exporters.sources import PrometheusGpuSource

            return PrometheusGpuSource(self.config.prometheus_url)
        if local is not None:
            return local
        from herd_operator.exporters.sources import ScrapeGpuSource

        return ScrapeGpuSource(exporters.urls)

    def _job_mapping(self, allocator: Allocator) -> JobMappingLoop | None:
        """dcgm-exporter's job mapping files for this host's GPUs, when asked for."""
        directory = self.config.dcgm_job_mapping_dir
        hosts = self.config.pool.pool.hosts
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

        from herd_operator.exporters.dcgm import JobMappingLoop, JobMappingWriter

        return JobMappingLoop(JobMappingWriter(directory, owners))

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

            registry.register(GpuCollector(local, owners, per_process=self.config.process_metrics))
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

    def _adopt(
        self, store: Store, allocator: Allocator, launcher: Launcher, engines: EngineDispatch
    ) -> None:
        """Take over what a previous operator left running (crash-only start-up).

        The launches it recorded whose keeper still runs are adopted: supervised, their
        GPUs held (from the store's allocations and the GPUs their workers are bound to),
        their grants published where their discovery scripts read them. Launches that
        ended while no operator was there are reported with the exit status their keeper
        recorded, so a finished job is not run again. A launch is recorded before its
        process starts, so processes of any other launch are orphans only when their record
        was lost (unreadable, or removed by hand); they are stopped: nothing says what they
        hold.
        """
        started = time.monotonic()
        adopted = launcher.adopt_recorded()
        running = {item.info.launch_id: item for item in adopted if item.running}
        processes = job_processes(self.layout.root)
        bound = _bindings(processes, running)
        placements, draining = adopted_holdings(
            {item.job for item in running.values()},
            store.allocations(),
            store.draining(),
            bound,
            allocator.pool,
            time.time(),
        )
        self._remove_stale_grants({item.job for item in running.values()})
        for item in adopted:
            engines.adopt(item.job, item.info.spec.engine.kind)
        allocator.restore(placements, bound, draining)
        now = time.time()
        for item in running.values():
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(item.info.started_at))
            log.info(
                "%s: adopted launch %s (pid %d), running since %s on %d GPU(s)",
                item.job, item.info.launch_id[:8], item.info.pid, since,
                placements.get(item.job, Placement.EMPTY).size,
            )  # fmt: skip
            _event_if_known(
                store, item.job, "Normal", "Adopted",
                f"running since {since} (pid {item.info.pid}): taken over by a restarted operator",
                now,
            )  # fmt: skip
        orphans = find_orphans(processes, set(running))
        for orphan in orphans:
            log.warning(
                "%s: %d process(es) of launch %s have no launch record (it was unreadable"
                " or removed); stopping them",
                orphan.job, len(orphan.pids), orphan.launch_id[:8],
            )  # fmt: skip
        if orphans:
            stop_orphans(orphans, self.config.grace_seconds)
            for orphan in orphans:
                _event_if_known(
                    store, orphan.job, "Warning", "Orphaned",
                    f"{len(orphan.pids)} process(es) of a launch with no record were stopped;"
                    " the job starts again",
                    now,
                )  # fmt: skip
        if adopted or orphans:
            log.info(
                "adopted %d running job(s), %d ended while no operator ran, %d orphan"
                " launch(es) stopped, in %.2f s",
                len(running), len(adopted) - len(running), len(orphans),
                time.monotonic() - started,
            )  # fmt: skip

    def _remove_stale_grants(self, kept: set[str]) -> None:
        """Grants a previous operator published for jobs that no longer run (a reused runtime
        dir): nothing reads them, and a job started again gets fresh ones."""
        try:
            entries = list(os.scandir(self.layout.grants_dir))
        except FileNotFoundError:
            return
        for entry in entries:
            if entry.name.partition(".")[0] not in kept:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)

    def _pool_changed(self, pool: Pool) -> None:
        """The pool source changed the pool (Slurm took a node out of the allocation, or a
        node's GPUs changed): the node watch forgets the nodes that left (their agents' calls
        no longer bring them back), the allocator decides again, the store logs the new size
        and an event names each node that left or joined."""
        assert self.allocator is not None and self.store is not None and self.nodes is not None
        before = dict(self.allocator.pool.hosts)
        self.nodes.set_pool(pool)
        try:
            # One group for the decision's record, the pool's size and the events.
            with self.store.transaction():
                self.allocator.set_pool(pool)
                self._record_pool_change(before, dict(pool.hosts), pool.size)
        except StoreError as err:
            log.warning("cannot record the pool's change in the state store: %s", err)
            self.allocator.set_pool(pool)  # a no-op if the group applied it before failing

    def _record_pool_change(
        self, before: Mapping[str, tuple[int, ...]], after: Mapping[str, tuple[int, ...]], size: int
    ) -> None:
        assert self.store is not None
        now = time.time()
        self.store.record_pool_size(size, now)
        for host in sorted(before.keys() - after.keys()):
            self.store.add_event(
                None, "Warning", "NodeRemoved",
                f"node {host} left the pool with its {len(before[host])} GPU(s): its pool"
                f" source ({self.config.pool.description}) no longer lists it, and its agent's"
                " calls do not bring it back",
                now,
            )  # fmt: skip
        for host in sorted(after.keys() - before.keys()):
            self.store.add_event(
                None, "Normal", "NodeAdded",
                f"node {host} joined the pool with {len(after[host])} GPU(s)", now,
            )  # fmt: skip

    def _cordon(self, hosts: set[str]) -> None:
        """The node watch's cordon: the allocator decides again without these nodes' free
        GPUs (it also asks the watch itself in every decision). The allocator records the
        decision after its lock is released (the lock order: docs/architecture.md)."""
        if self.allocator is not None:
            self.allocator.cordon(hosts)

    def _enqueue_known_jobs(self) -> None:
        """Reconcile every recorded job once: adopted jobs converge from where they are,
        jobs a previous operator stopped on shutdown start again if their spec is still
        there, and jobs whose spec went away while no operator ran are removed."""
        assert self.store is not None
        for record in self.store.list_jobs():
            self.queue.add(record.name)

    def run(self, stop: threading.Event) -> int:
        """Serve until `stop` is set; then stop every job and release everything."""
        recorded = self._recorded_runtime_dir()
        try:
            loop = self._open()
        except BaseException:
            self._abandon_start(recorded)
            raise
        from herd_operator.runtime.specdir import DirectoryWatcher

        assert self.specs is not None
        self.watcher = DirectoryWatcher(
            self.specs,
            loop.wake_all,
            relist_seconds=self.config.relist_seconds,
            use_events=self.config.watch_events,
        )
        self.watcher.start()
        if self.observer is not None:
            self.observer.start()
        if self.job_mapping is not None:
            self.job_mapping.start()
        assert self.allocator is not None
        # A node lost or back: the allocator decides again and wakes the jobs it moved.
        self.config.pool.start(self._pool_changed)
        assert self.nodes is not None
        self.nodes.start()
        assert self.store is not None and self.launcher is not None
        self.pruner = Pruner(
            self.store,
            self.layout,
            self.launcher.jobs,
            retention_seconds=self.config.deleted_job_retention_seconds,
            interval_seconds=self.config.prune_interval_seconds,
        )
        self.pruner.start()
        self.ready.set()
        try:
            loop.run(stop)
        finally:
            self._shutdown()
        return 0

    def _node_event(self, host: str, lost: bool, why: str) -> None:
        """A node was lost or is back: an event of the operator's, not of a job's (the jobs
        it moves get their own Resized, WorkerLost and NodeLost events)."""
        if self.store is None:
            return
        if lost:
            held = {
                job: sum(len(gpus) for name, gpus in placement.hosts if name == host)
                for job, placement in (
                    self.allocator.placements() if self.allocator else {}
                ).items()
            }
            holders = ", ".join(f"{job} {count}" for job, count in sorted(held.items()) if count)
            message = (
                f"node {host} lost: {why}. None of its free GPUs is granted until it answers"
                + (
                    f"; GPUs still held there, by jobs left to Horovod: {holders}"
                    if holders
                    else ""
                )
            )
        else:
            message = f"node {host} is back: {why}"
        try:
            self.store.add_event(
                None,
                "Warning" if lost else "Normal",
                "NodeLost" if lost else "NodeBack",
                message,
                time.time(),
            )
        except StoreError as err:  # a full disk must not stop the pool from following nodes
            log.warning(
                "could not record that node %s %s: %s", host, "left" if lost else "came back", err
            )

    def _recorded_runtime_dir(self) -> Path | None:
        try:
            return Path(self.layout.runtime_record.read_text().strip())
        except FileNotFoundError:
            return None

    def _abandon_start(self, recorded: Path | None) -> None:
        """Undo what a refused start made (a runtime dir in /dev/shm, the servers' threads),
        so that retrying a start that keeps failing leaks nothing. What an earlier operator
        left (the runtime dir `recorded`) stays for the next start to deal with."""
        if self.exporters is not None:
            self.exporters.stop()
        if self.server is not None:
            self.server.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        made = self.layout.runtime
        if made is not None and made != recorded:
            remove_runtime_dir(made)
            if self._recorded_runtime_dir() == made:
                if recorded is None:
                    self.layout.runtime_record.unlink(missing_ok=True)
                else:
                    write_atomically(self.layout.runtime_record, f"{recorded}\n")
        if self.store is not None:
            self.store.close()
        if self._lock_handle is not None:
            self._lock_handle.close()

    def _shutdown(self) -> None:
        # With nothing running there is nothing to hand over: clean up as on any stop.
        leave = self.config.leave_jobs_running and bool(self.launcher and self.launcher.jobs())
        log.info("shutting down: %s", "leaving the jobs running" if leave else "stopping jobs")
        self.config.pool.stop()
        if self.pruner is not None:
            self.pruner.stop()
        if self.nodes is not None:
            self.nodes.stop()
        if self.watcher is not None:
            self.watcher.stop()
        if self.observer is not None:
            self.observer.stop()
        if self.job_mapping is not None:
            # Left as they are when the jobs train on: the next operator takes them over.
            self.job_mapping.stop(clear=not leave)
        self.queue.shutdown()
        if self.launcher is not None and not leave:
            stubborn = self.launcher.stop_all(timeout=self.config.grace_seconds + 5)
            if stubborn:
                log.error("processes of %s would not exit", ", ".join(stubborn))
            self._record_shutdown()
        if self.exporters is not None:
            self.exporters.stop()
        if self.server is not None:
            self.server.stop()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if leave:
            # The next operator adopts the jobs: it needs their grants where their discovery
            # scripts read them, and the port their workers know (in the endpoint file).
            running = self.launcher.jobs() if self.launcher is not None else []
            log.info(
                "left %d job(s) running: %s; start `herd-operator run` on %s to adopt them",
                len(running), ", ".join(running) or "none", self.layout.root,
            )  # fmt: skip
        else:
            self.layout.endpoint_file.unlink(missing_ok=True)
            if self.layout.runtime is not None:
                remove_runtime_dir(self.layout.runtime)
                self.layout.runtime_record.unlink(missing_ok=True)
        if self.allocator is not None and leave:
            self.allocator.record_pending()  # a decision the store refused until now
        if self.store is not None:
            self.store.close()
        if self._lock_handle is not None:
            self._lock_handle.close()
        log.info("stopped")

    def _record_shutdown(self) -> None:
        """Jobs were stopped with the operator: their status says so; every GPU is free."""
        assert self.allocator is not None
        if self.loop is not None:
            self.loop.record_shutdown()  # logs what the store could not take
        self.allocator.release_all()
        if (err := self.allocator.record_pending()) is not None:
            # A full disk: the GPUs are free all the same, and the next operator adopts no
            # job, so it holds none of them.
            log.error("cannot record in the state store that every GPU is free: %s", err)


def _event_if_known(
    store: Store,
    job: str,
    kind: Literal["Normal", "Warning"],
    reason: str,
    message: str,
    now: float,
) -> None:
    """An event for a job the store knows; a store that cannot take it (a full disk) must
    not refuse the start: the log says it too."""
    try:
        if store.has_job(job):
            store.add_event(job, kind, reason, message, now)
    except StoreError as err:
        log.warning("%s: cannot record the event %s: %s", job, reason, err)


def _bindings(processes: list[JobProcess], running: Mapping[str, Adopted]) -> list[Binding]:
    """The GPU each live worker of an adopted launch is bound to, as the shim exported it.

    The host is the name the worker bound with (Horovod's `HOROVOD_HOSTNAME`), which may be
    another name of a pool host; the allocator resolves it (`Allocator.restore`).
    """
    found = []
    for proc in processes:
        if proc.launch_id not in running or GPU_ENV not in proc.env:
            continue
        try:
            gpu, local_rank = int(proc.env[GPU_ENV]), int(proc.env.get("HOROVOD_LOCAL_RANK", "0"))
        except ValueError:
            continue
        name = proc.env.get("HOROVOD_HOSTNAME") or socket.gethostname()
        found.append(Binding(proc.job, name, local_rank, gpu, proc.pid, name))
    return found


def adopted_holdings(
    running: AbstractSet[str],
    stored: Mapping[str, Placement],
    stored_draining: Mapping[Slot, Drain],
    bound: Sequence[Binding],
    pool: Pool,
    now: float,
) -> tuple[dict[str, Placement], dict[Slot, Drain]]:
    """What the jobs a restarted operator adopts hold: a pure function of what it found.

    Each running job's placement is the store's, else what its bound workers show (the
    crash came before its first decision was recorded). A GPU is free only when seen free,
    so the GPUs draining are those the store recorded as draining for a job that still
    runs, and every other GPU a live worker of a running job is bound to outside that job's
    placement (a decision that shrank the job but whose record was lost): both with the
    pids of the live workers bound there, which the allocator watches. A drain of a job that
    no longer runs is over: its workers are gone with it.
    """
    placements: dict[str, Placement] = {}
    for job in sorted(running):
        placement = stored.get(job) or _placement_of(bound, job, pool)
        if placement.size:
            placements[job] = placement
    owner = {slot: job for job, placement in placements.items() for slot in placement.slots()}
    live: dict[Slot, dict[str, list[tuple[str, int]]]] = {}
    for binding in bound:
        host = _pool_host(binding.host, pool)
        if binding.job in running and host is not None and binding.pid is not None:
            live.setdefault((host, binding.gpu), {}).setdefault(binding.job, []).append(
                (host, binding.pid)
            )
    draining: dict[Slot, Drain] = {}
    for slot, drain in stored_draining.items():
        if drain.job in running and slot not in owner:
            watched = dict.fromkeys((*drain.pids, *live.get(slot, {}).get(drain.job, ())))
            draining[slot] = replace(drain, pids=tuple(watched))
    for slot, jobs in sorted(live.items()):
        for job, pids in sorted(jobs.items()):
            if owner.get(slot) == job or slot in draining:
                continue
            if slot in owner:
                log.warning(
                    "%s: a live worker of %s (pid %s) is bound to GPU %s:%d, which the store"
                    " gives to %s",
                    job, job, pids[0][1], slot[0], slot[1], owner[slot],
                )  # fmt: skip
                continue
            draining[slot] = Drain(job, now, tuple(pids))
    return placements, draining


def _pool_host(name: str, pool: Pool) -> str | None:
    """The pool host a worker's host name stands for: itself, or the pool's only host (the
    names a lone host is shown under); None for a name of no pool host."""
    if name in pool.host_positions:
        return name
    return pool.hosts[0][0] if len(pool.hosts) == 1 else None


def _placement_of(bindings: Sequence[Binding], job: str, pool: Pool) -> Placement:
    """A job's placement as its bound workers show it, when the store has none (the crash
    came before the decision that placed them was committed). A name that is not a pool
    host is taken for the pool's host when there is one: the names a lone host is shown
    under. GPUs in index order: the order of the lost decision is not known."""
    hosts: dict[str, set[int]] = {}
    for binding in bindings:
        host = _pool_host(binding.host, pool) if binding.job == job else None
        if host is not None:
            hosts.setdefault(host, set()).add(binding.gpu)
    return Placement(tuple((host, tuple(sorted(gpus))) for host, gpus in hosts.items()))


def _listed(host: str) -> bool:
    """A pool source that never takes a node out lists every node of its pool."""
    return True
