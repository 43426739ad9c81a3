"""Crash-only start-up: what a restarted operator takes over from the one before it.

The launches the previous operator recorded whose keeper still runs are adopted, with the
GPUs they hold (`adopted_holdings`, a pure function of what was found: the store's
allocations and the GPUs their live workers are bound to); the ones that ended meanwhile
are reported with their recorded exit; processes of launches with no record are stopped.

Apart from the operator's wiring because it is one step of its start with its own
reasoning (and its own tests: tests/unit/test_adoption.py), run once before the RPC server
starts: a worker's first call must find its GPUs held.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import Literal

from herd_operator.environment import GPU_ENV, worker_host, worker_local_rank
from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import Binding
from herd_operator.runtime.dispatch import EngineDispatch
from herd_operator.runtime.engines.torchrun import slot_host
from herd_operator.runtime.launcher import Adopted, Launcher
from herd_operator.runtime.log_format import log_time
from herd_operator.runtime.process_table import (
    JobProcess,
    find_orphans,
    job_processes,
    stop_orphans,
)
from herd_operator.runtime.store import Store, StoreError
from herd_operator.runtime.withheld import only
from herd_operator.specs.values import Drain, Placement, Pool, Slot

log = logging.getLogger(__name__)


def adopt(
    layout: StateLayout,
    store: Store,
    allocator: Allocator,
    launcher: Launcher,
    engines: EngineDispatch,
    grace_seconds: float,
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
    processes = job_processes(layout.root)
    bound = _bindings(processes, running)
    placements, draining = adopted_holdings(
        {item.job for item in running.values()},
        store.allocations(),
        store.draining(),
        bound,
        allocator.pool,
        time.time(),
    )
    _remove_stale_grants(layout, {item.job for item in running.values()})
    for item in adopted:
        engines.adopt(item.job, item.info.spec.engine.kind)
    # Jobs that shared GPUs by memory get each shared GPU back (with sharing still on).
    shared = store.shared_jobs() if allocator.sharing is not None else frozenset()
    allocator.restore(placements, bound, draining, shared, store.service())
    now = time.time()
    for item in running.values():
        since = log_time(item.info.started_at)
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
        stop_orphans(orphans, grace_seconds)
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


def _remove_stale_grants(layout: StateLayout, kept: set[str]) -> None:
    """Grants a previous operator published for jobs that no longer run (a reused runtime
    dir): nothing reads them, and a job started again gets fresh ones."""
    try:
        entries = list(os.scandir(layout.grants_dir))
    except FileNotFoundError:
        return
    for entry in entries:
        if entry.name.partition(".")[0] not in kept:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)


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

    The host is the name the worker bound with (Horovod's `HOROVOD_HOSTNAME`, the torchrun
    engine's `HERD_WORKER_HOST`), which may be another name of a pool host; the allocator
    resolves it (`Allocator.restore`).
    """
    found = []
    for proc in processes:
        if proc.launch_id not in running or GPU_ENV not in proc.env:
            continue
        try:
            gpu, local_rank = int(proc.env[GPU_ENV]), worker_local_rank(proc.env)
        except ValueError:
            continue
        name = worker_host(proc.env) or socket.gethostname()
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
        placement = stored.get(job)
        if placement is None:
            # Not the GPUs it was giving back (a job the queue preempted holds none).
            gave_back = {slot for slot, drain in stored_draining.items() if drain.job == job}
            shown = _placement_of(bound, job, pool)
            placement = only(shown, set(shown.slots()) - gave_back)
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
    """The pool host a worker's host name stands for: itself, the host of a torchrun GPU's
    name (`h2:gpu1`), or the pool's only host (the names a lone host is shown under); None
    for a name of no pool host."""
    if name in pool.host_positions:
        return name
    host = slot_host(name)
    if host in pool.host_positions:
        return host
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
