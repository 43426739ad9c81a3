"""Wires the parts together and runs the control loop in the foreground.

Threads: the main thread takes job names off the work queue and reconciles
them one at a time (so decisions never race); the spec watcher, the RPC server
and one waiter per `horovodrun` only put names on the queue. Every long-running
part is started, and stopped in reverse, by one `Manager` (herd_operator/lifecycle.py);
the settings are in `config.py`, the state dir's hand-over in `handover.py`, the
crash-only adoption in `adoption.py`, the metrics and GPU sources in `telemetry.py`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from herd_operator.auth import agent_key, ensure_token_file, write_token_file
from herd_operator.controllers.workqueue import WorkQueue
from herd_operator.environment import ALLOCATOR_ENV, STATE_DIR_ENV
from herd_operator.layout import StateLayout, remove_runtime_dir
from herd_operator.lifecycle import Hooks, Manager
from herd_operator.policies.queueing import describe_queue
from herd_operator.policies.sharing_text import describe_sharing
from herd_operator.rpc.protocol import Handler
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.adoption import adopt
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.config import OperatorConfig, OperatorError
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.engines.horovod import LOCAL_HOSTS, local_names
from herd_operator.runtime.gpu_memory import GpuMemoryWatch
from herd_operator.runtime.handlers import (
    GROUPED_OPS,
    AllocatorOps,
    BatchHandler,
    ExporterRegistry,
    ReportHandler,
    for_agents,
    for_anyone,
    for_own_host,
    for_own_job,
    heard_from,
    store_group,
)
from herd_operator.runtime.handover import Ending, Handover
from herd_operator.runtime.launcher import Launcher
from herd_operator.runtime.metrics import OperatorMetrics
from herd_operator.runtime.observer import UsageObserver
from herd_operator.runtime.out_of_memory import OutOfMemoryWatch
from herd_operator.runtime.pools.base import ListsHosts
from herd_operator.runtime.pools.heartbeat import NodeWatch
from herd_operator.runtime.pruner import Pruner
from herd_operator.runtime.store import Store, StoreError
from herd_operator.runtime.telemetry import (
    MetricsServer,
    job_mapping,
    local_gpus,
    memory_feed,
    memory_watch,
    observed_gpus,
    register_collectors,
)
from herd_operator.runtime.world_sizes import LOST_GRACE_SECONDS
from herd_operator.specs.values import Pool

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

RPC_STOP_SECONDS = 30.0
"""How long the RPC server may take to stop (its requests in flight) before the teardown
goes on without it."""

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


class Operator:
    """Opens the state dir, wires the parts and runs the control loop (`run`).

    Every long-running part is started through one `Manager` (herd_operator/lifecycle.py),
    in the order `_open` and `_start_loops` add them, with the clean-ups between them; a
    refused start and a stop tear down through the same `Manager.stop()`.
    """

    def __init__(self, config: OperatorConfig) -> None:
        self.config = config
        self.layout = StateLayout(config.state_dir)
        self.queue = WorkQueue()
        self.manager = Manager()
        self.handover = Handover(config.state_dir, self.manager)
        self.store: Store | None = None
        self.server: RpcServer | None = None
        self.watcher: DirectoryWatcher | None = None
        self.launcher: Launcher | None = None
        self.allocator: Allocator | None = None
        self.observer: UsageObserver | None = None
        self.gpu_memory: GpuMemoryWatch | None = None
        """Each job's measured GPU memory and utilization (`peaks`: the sharing packing's input)."""
        self.job_mapping: JobMappingLoop | None = None
        self.metrics = OperatorMetrics(CollectorRegistry())
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
        manager = self.manager
        health = self.metrics.loops
        self.handover.lock()
        raise_descriptor_limit()
        previous_runtime = self.handover.use_runtime_dir(config.runtime_dir)
        self.layout = self.handover.layout
        self.layout.create()
        try:
            # Made right after the store first opened: with it, a 0-byte database was truncated.
            store = Store(
                self.layout.database,
                previous_state=(self.layout.token_file,),
                max_grants_per_job=config.grant_history_per_job,
                checkpoint_seconds=STORE_CHECKPOINT_SECONDS,
                loop_health=health,
            )
        except StoreError as err:
            raise OperatorError(str(err)) from err
        self.store = store
        manager.defer("the state store", store.close)
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
            health=health,
        )
        self.allocator = allocator = Allocator(
            config.pool.pool,
            engines,
            virtual=config.pool.virtual,
            on_decision=lambda decided: store.record_allocation(decided, time.time()),
            min_resize_interval=config.min_resize_interval,
            drain_seconds=config.drain_seconds,
            spare_by_gain=config.spare_by_gain,
            smallest_first=config.smallest_first,
            share_by_gain=config.share_by_gain,
            share_by_speedup=config.share_by_speedup,
            max_wait_seconds=config.max_wait_seconds,
            queue=config.queue,
            sharing=config.sharing,
            present=engines.present,
            on_event=lambda job, type, reason, message: store.add_event(
                job, type, reason, message, time.time()
            ),
            unavailable_hosts=nodes.unavailable,
            on_workers_lost=nodes.workers_vanished,
            agents=engines.agents,
            # A worker that never binds is lost after this grace anyway.
            first_launch_seconds=LOST_GRACE_SECONDS,
        )
        # A group rolled back (a full disk) took the decisions recorded in it along.
        store.on_rollback(allocator.mark_unrecorded)
        manager.defer("the allocator's last decision", self._record_pending)
        self.launcher = launcher = Launcher(
            self.queue.add, grace_seconds=config.grace_seconds, records_dir=self.layout.launches_dir
        )
        # Before the RPC server starts: a worker's first call must find its GPUs held.
        adopt(self.layout, store, allocator, launcher, engines, config.grace_seconds)
        if previous_runtime is not None and previous_runtime != self.layout.runtime:
            remove_runtime_dir(previous_runtime)  # nothing adopted reads it
        # Ready before the RPC server starts: an exporter may register at once.
        self.exporters = exporters = ExporterRegistry(
            self.layout.scrape_targets_file, None, pool=lambda: allocator.pool, health=health
        )
        ops = AllocatorOps(allocator)
        self.server = server = self._start_rpc_server(
            token,
            {
                "bind": for_own_job(ops.bind),
                "grant": for_own_job(ops.grant),
                "placements": for_agents(ops.placements),
                "report": for_own_job(ReportHandler(store, allocator, self.queue.add)),
                "batch": for_own_job(BatchHandler(store)),
                "register_exporter": for_own_host(heard_from(nodes, exporters)),
                "unregister_exporter": for_own_host(exporters.unregister),
                "ping": for_anyone(lambda args: {"pid": os.getpid()}),
            },
            store,
        )
        # Started on its port above. Its stop waits for the requests in flight, which may
        # wait for the store: the store closes after it.
        manager.add(Hooks("rpc-server", stop=server.stop), stop_timeout=RPC_STOP_SECONDS)
        host, port = server.address
        local = local_gpus(config, allocator)
        register_collectors(self.metrics.registry, config, local, store, allocator, server)
        if config.metrics_port is not None:
            metrics_server = MetricsServer(self.metrics.registry, config, config.metrics_port)
            manager.add(metrics_server)
            self._metrics_address = metrics_server.address
        exporters.operator_address = self._metrics_address
        exporters.write_targets()
        manager.add(exporters)
        self.job_mapping = job_mapping(config, allocator, health)
        self.gpu_memory = memory_watch(store, allocator, lambda: self.specs)
        observed = observed_gpus(config, local, exporters)
        self.observer = UsageObserver(
            observed,
            allocator.placements,
            store.add_usage,
            interval=config.sample_seconds,
            health=health,
            also=memory_feed(self.gpu_memory, local, observed),
        )
        advertised = config.advertise_host or host
        address = f"[{advertised}]:{port}" if ":" in advertised else f"{advertised}:{port}"
        self.handover.write_endpoint(address, self._metrics_address, config.pool.description)
        # Stopped before the servers (the loops before them: `_start_loops`).
        manager.defer("the jobs", self._stop_jobs)
        env = {
            ALLOCATOR_ENV: address,
            STATE_DIR_ENV: str(self.layout.root.resolve()),
            **config.extra_env,
        }
        job_launcher = JobLauncher(launcher, engines, self.layout, env, token, config.sharing)
        self._enqueue_known_jobs()
        log.info(
            "pool: %s; allocator on %s; queue %s; %s; specs from %s; state in %s",
            config.pool.description, address, describe_queue(config.queue),
            describe_sharing(config.sharing), config.specs_dir, self.layout.root,
        )  # fmt: skip
        from herd_operator.controllers.loop import ControlLoop
        from herd_operator.controllers.reconciler import JobReconciler
        from herd_operator.runtime.specdir import SpecDirectory, problems_as_events

        self.specs = SpecDirectory(config.specs_dir, on_problem=problems_as_events(store))
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
            **self.gpu_memory.peaks.measures(),
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
        previous = self.handover.previous_port() if port is None else None
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

    def _pool_changed(self, pool: Pool) -> None:
        """The pool source changed the pool (Slurm took a node out of the allocation, or a
        node's GPUs changed): the allocator decides again, the store logs the new size and
        an event names each node that left or joined; then the node watch forgets the nodes
        that left (their agents' calls no longer bring them back)."""
        assert self.allocator is not None and self.store is not None and self.nodes is not None
        before = dict(self.allocator.pool.hosts)
        try:
            # One group for the decision's record, the pool's size and the events.
            with self.store.transaction():
                self.allocator.set_pool(pool)
                self._record_pool_change(before, dict(pool.hosts), pool.size)
        except StoreError as err:
            log.warning("cannot record the pool's change in the state store: %s", err)
            self.allocator.set_pool(pool)  # a no-op if the group applied it before failing
        # Only now may the watch forget the nodes that left: it lifts their cordon, and a
        # decision between that and the allocator's new pool granted a lost node's free GPUs.
        self.nodes.set_pool(pool)

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
        decision after its lock is released (the lock order: docs/architecture.md, "Locks")."""
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
        try:
            loop = self._open()
            self._start_loops(loop)
        except BaseException:
            self.handover.ending = Ending.REFUSED
            self.manager.stop()  # what this start made goes, what it found stays
            raise
        self.ready.set()
        try:
            loop.run(stop)
        finally:
            self._shutdown()
        return 0

    def _start_loops(self, loop: ControlLoop) -> None:
        """The parts that feed the control loop, once it is wired: the spec directory's
        watcher, the GPU sampler, dcgm-exporter's job mapping, the pool source, the node
        watch and the pruner (stopped in the reverse order, before the jobs)."""
        from herd_operator.runtime.specdir import DirectoryWatcher

        assert self.specs is not None and self.nodes is not None
        assert self.store is not None and self.launcher is not None
        config, manager = self.config, self.manager
        self.watcher = DirectoryWatcher(
            self.specs,
            loop.wake_all,
            relist_seconds=config.relist_seconds,
            use_events=config.watch_events,
            health=self.metrics.loops,
        )
        manager.add(self.watcher)
        if self.observer is not None:
            manager.add(self.observer)
        news = self.launcher.out_of_memory_news
        manager.add(OutOfMemoryWatch(news, self.store.add_event, health=self.metrics.loops))
        if (mapping := self.job_mapping) is not None:
            manager.defer("dcgm-exporter's job mapping files", lambda: self._clear_mapping(mapping))
            manager.add(mapping)
        # A node lost or back: the allocator decides again and wakes the jobs it moved.
        manager.add(
            Hooks("pool-source", lambda: config.pool.start(self._pool_changed), config.pool.stop)
        )
        manager.add(self.nodes)
        self.pruner = Pruner(
            self.store,
            self.layout,
            self.launcher.jobs,
            retention_seconds=config.deleted_job_retention_seconds,
            interval_seconds=config.prune_interval_seconds,
            health=self.metrics.loops,
        )
        manager.add(self.pruner)

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

    def _shutdown(self) -> None:
        # With nothing running there is nothing to hand over: clean up as on any stop.
        leave = self.config.leave_jobs_running and bool(self.launcher and self.launcher.jobs())
        self.handover.ending = Ending.HANDED_OVER if leave else Ending.STOPPED
        log.info("shutting down: %s", "leaving the jobs running" if leave else "stopping jobs")
        self.manager.stop()
        if leave:
            running = self.launcher.jobs() if self.launcher is not None else []
            log.info(
                "left %d job(s) running: %s; start `herd-operator run` on %s to adopt them",
                len(running), ", ".join(running) or "none", self.layout.root,
            )  # fmt: skip
        log.info("stopped")

    # ---- clean-ups (run by the manager, in the reverse order of the start) ----

    def _stop_jobs(self) -> None:
        self.queue.shutdown()
        if self.handover.ending is not Ending.STOPPED or self.launcher is None:
            return  # handed over, or found running by a start that was refused: they run on
        stubborn = self.launcher.stop_all(timeout=self.config.grace_seconds + 5)
        if stubborn:
            log.error("processes of %s would not exit", ", ".join(stubborn))
        self._record_shutdown()

    def _clear_mapping(self, mapping: JobMappingLoop) -> None:
        if self.handover.ending is Ending.STOPPED:  # else the jobs still hold the GPUs it labels
            mapping.writer.clear()

    def _record_pending(self) -> None:
        """Handing over: the decision the store refused until now (a full disk), if any."""
        if self.handover.ending is Ending.HANDED_OVER and self.allocator is not None:
            self.allocator.record_pending()

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


def _listed(host: str) -> bool:
    """A pool source that never takes a node out lists every node of its pool."""
    return True
