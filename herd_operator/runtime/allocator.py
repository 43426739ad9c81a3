"""The central allocator: the single owner of the pool.

It keeps every job's demand, runs the (pure) arbitration whenever a demand changes, hands
the resulting placements to a sink (which makes each reach its job: for Horovod, the file
its discovery script reads), and tells the controller which jobs' grants changed. Workers
ask it, over the authenticated RPC (`runtime/handlers.py`), which GPU is theirs.

Its parts: the decision state here (demands, grants, held jobs, freezes); the GPUs given back
(`drains.py`: free only when seen free); the workers' bindings (`bindings.py`); world sizes
(`world_sizes.py`); first launches (`first_launch.py`); what a decision may not hand out
(`withheld.py`); how decisions reach the store (`recording.py`, after the lock); attained
service for the queues (`service.py`). Decisions: `policies/sharing.py`.
Horovod also shrinks a job on its own when a worker fails: the grant follows
(`observe_world_size`), with a WorkerLost event, and the policy grows the job back. No RPC
error is raised here: the handlers turn its answers into the protocol's.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from typing import Protocol

from herd_operator.controllers.ports import Workers
from herd_operator.policies.queueing import QueueConfig
from herd_operator.policies.sharing import SharingLimits, arbitrate_sharing, held_slots, sharers
from herd_operator.policies.sharing_room import counted_memory
from herd_operator.runtime.bindings import (
    Binding,
    BindingTracker,
    Presenter,
    plain_presentation,
    running_workers,
)
from herd_operator.runtime.drains import DEFAULT_DRAIN_SECONDS, DrainTracker
from herd_operator.runtime.first_launch import FirstLaunches
from herd_operator.runtime.memory_guard import MemoryGuard
from herd_operator.runtime.process_table import is_process_of_job
from herd_operator.runtime.recording import EventSink, Recorder
from herd_operator.runtime.service import ServiceLedger, ServiceRecords
from herd_operator.runtime.withheld import only, restorable, wait_for_drains, withheld_slots
from herd_operator.runtime.world_sizes import LOST_GRACE_SECONDS, WorldSizes, standing
from herd_operator.specs.values import Allocation, Demand, Drain, Grant, Placement, Pool, Slot

log = logging.getLogger(__name__)

DEFAULT_MAX_WAIT_SECONDS = 4 * 3600.0
"""Under `smallest_first`, a pending job that waited this long is admitted before any other
of its tier (the starvation bound). 4 h is a choice, not an optimum: docs/simulation.md shows
what a longer bound, or none, gains in mean completion time and costs the largest jobs."""


class NotJobsProcess(ValueError):
    """A worker's bind names a pid that is no process of its job on this host."""


class PlacementSink(Protocol):
    """Where the allocator hands its decisions: the engine of each job makes them reach it."""

    def publish(self, job: str, placement: Placement) -> None:
        """The job's placement changed to `placement` (never empty)."""
        ...

    def withdraw(self, job: str) -> None:
        """The job was released: it holds nothing any more."""
        ...


class Allocator:
    """Thread-safe: the controller and the RPC server's thread both call it. Every change
    ends with the state handed to `on_decision` (an `Allocation`) and its events to
    `on_event`, after its lock is released (the lock order: `recording.py`)."""

    def __init__(
        self,
        pool: Pool,
        sink: PlacementSink,
        *,
        virtual: bool,
        on_decision: Callable[[Allocation], None] = lambda decision: None,
        min_resize_interval: float = 0.0,
        drain_seconds: float = DEFAULT_DRAIN_SECONDS,
        lost_grace_seconds: float = LOST_GRACE_SECONDS,
        present: Presenter = plain_presentation,
        on_event: EventSink = lambda job, type, reason, message: None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        spare_by_gain: bool = False,
        smallest_first: bool = False,
        max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS,
        share_by_gain: bool = False,
        share_by_speedup: bool = False,
        unavailable_hosts: Callable[[], AbstractSet[str]] = frozenset,
        on_workers_lost: Callable[[str, frozenset[str]], None] = lambda job, hosts: None,
        belongs: Callable[[str, int], bool] = is_process_of_job,
        agents: Callable[[str], AbstractSet[str]] = lambda job: frozenset(),
        first_launch_seconds: float = 0.0,
        queue: QueueConfig | None = None,
        sharing: SharingLimits | None = None,
    ) -> None:
        """`unavailable_hosts()`: hosts none of whose free GPUs a decision may grant, asked
        in every decision (suspect or lost nodes: `pools/heartbeat.NodeWatch`), on top of
        those `cordon` names. `on_workers_lost(job, hosts)`: told, before the decision that
        takes their GPUs back, that `job` lost workers and ran on `hosts` (where they may
        have vanished with their node). `belongs(job, pid)`: whether a pid a worker of `job`
        binds with is a process of the job (asked for workers on this host, see `bind`).
        `agents(job)`: the names of `job`'s GPUs here whose agent runs (`world_sizes.standing`).
        `spare_by_gain`, `share_by_gain`, `share_by_speedup`, `smallest_first`, `sharing`:
        `arbitrate_sharing`'s options (GPUs nobody wants lent by gain; every GPU above the
        mins divided by gain, or by the harmonic mean of speedups; pending jobs smallest min
        first; GPUs shared by memory among jobs that opt in).
        Under `smallest_first` a job pending for `max_wait_seconds` (from the first decision
        that left it pending) goes first (`arbitrate`'s `overdue`): no timer is needed,
        since being overdue changes a decision only when GPUs come free or a job arrives,
        and each of those decides. `first_launch_seconds`: how long at most a job whose
        first launch is forming is left alone (`first_launch.py`; 0: not).
        `queue`: the order by service or work left, and preemption (`queueing.py`)."""
        if not max_wait_seconds > 0 or not math.isfinite(max_wait_seconds):
            raise ValueError(f"max_wait_seconds must be finite and > 0, got {max_wait_seconds}")
        self.pool, self.virtual = pool, virtual
        self.spare_by_gain, self.share_by_gain = spare_by_gain, share_by_gain
        self.smallest_first, self.min_resize_interval = smallest_first, min_resize_interval
        self.share_by_speedup = share_by_speedup
        self.max_wait_seconds, self.sharing = max_wait_seconds, sharing
        self._service, self._sink = ServiceLedger(queue), sink
        self._clock, self._wall_clock = clock, wall_clock
        self._unavailable_hosts, self._on_workers_lost = unavailable_hosts, on_workers_lost
        self._local_hosts = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
        self._lock = threading.RLock()
        # How deep this thread is in `_changing` blocks (only the lock's holder changes it).
        self._depth = 0
        self._drains = DrainTracker(drain_seconds, clock, wall_clock, self._local_hosts)
        self._bindings = BindingTracker(present, self._local_hosts)
        self._belongs, self._agents = belongs, agents
        self._recorder = Recorder(self._lock, self._snapshot, on_decision, on_event)
        self._listeners: list[Callable[[str, Grant], None]] = []
        self._demands: dict[str, Demand] = {}
        self._grants: dict[str, Grant] = {}
        # Adopted jobs' placements whose demand has not come: no decision gives them away.
        self._held: dict[str, Placement] = {}
        self._shared_held: frozenset[str] = frozenset()  # held jobs that share GPUs by memory
        self._cordoned: frozenset[str] = frozenset()  # hosts granted to nobody: `cordon`
        # When each job not admitted was first left pending (only with smallest_first).
        self._pending_since: dict[str, float] = {}
        self._world = WorldSizes(lost_grace_seconds)
        # When each job's size last changed: left alone min_resize_interval (a reset each).
        self._resized_at: dict[str, float] = {}
        self._first, self._guard = FirstLaunches(first_launch_seconds), MemoryGuard(sharing)
        self._next_thaw: float | None = None
        self._batching = False
        self._deferred: set[str] = set()
        self._dirty = False

    @property
    def drain_seconds(self) -> float:
        return self._drains.drain_seconds

    def watch(self, listener: Callable[[str, Grant], None]) -> None:
        """Call `listener(job, grant)` for each job whose grant a decision changed, except the
        job whose own request made the decision (it gets its grant as the answer)."""
        with self._lock:
            self._listeners.append(listener)

    def _changed(self, job: str, grant: Grant) -> None:
        for listener in self._listeners:
            listener(job, grant)

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """The allocator's lock, for a change; what the change leaves for the store is handed
        to it once the outermost such block has released the lock."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                outermost = self._depth == 0
        if outermost:
            self._recorder.flush()

    def _snapshot(self) -> Allocation:
        placements = {job: grant.placement for job, grant in self._grants.items()}
        shared = sharers(self.sharing, self._demands, self._held, self._shared_held)
        service = self._service.records(self._clock(), self._wall_clock())
        memory = counted_memory(self.sharing, self._demands, placements, shared)
        return Allocation(placements, self._drains.records(), shared, service, memory)

    def mark_unrecorded(self) -> None:
        """What was recorded was lost (the store rolled back the group it was written in):
        record the state again at the next change or request."""
        self._recorder.lost()

    def record_pending(self) -> Exception | None:
        """Record now what is still unrecorded (before the operator closes its store); the
        store's error if the decision is still not recorded, else None."""
        self._recorder.flush()
        return self._recorder.error()

    # ---- demands and decisions ----

    def request(self, demand: Demand) -> Grant | None:
        """Record a job's demand, decide again for everyone, return the job's grant.

        Inside `batch()`, a changed demand is only recorded: the result is None and the job
        is woken (the `watch` listeners) once the batch's single decision is made."""
        with self._changing():
            thawed = self._next_thaw is not None and self._clock() >= self._next_thaw
            drained = self._finish_drains()
            changed = self._demands.get(demand.name) != demand
            if self._held.pop(demand.name, None) is not None:
                changed = True  # its restored placement is now weighed like any other
            self._demands[demand.name] = demand
            if self._batching:
                if changed or thawed or drained or demand.name not in self._grants:
                    self._deferred.add(demand.name)
                    return None
                return self._grants[demand.name]
            if changed or thawed or drained:
                self._decide(caller=demand.name)
            return self._grants[demand.name]

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make one decision for many requests (a burst of new specs, an operator restart).

        Each decision weighs every job, so deciding per request would make a burst of N
        jobs cost N full decisions.
        """
        with self._lock:
            self._batching = True
        try:
            yield
        finally:
            with self._changing():
                self._batching = False
                deferred, self._deferred = self._deferred, set()
                if deferred or self._dirty:
                    self._dirty = False
                    before = {job: grant.placement for job, grant in self._grants.items()}
                    self._decide(caller="")
                    for job in sorted(deferred):
                        # Those whose grant changed were told by _decide already.
                        if job in self._grants and before.get(job) == self._grants[job].placement:
                            self._changed(job, self._grants[job])

    def _decide_or_defer(self, caller: str = "") -> None:
        if self._batching:
            self._dirty = True  # decide at the end of the batch
        else:
            self._decide(caller=caller)

    def restore(
        self,
        placements: Mapping[str, Placement],
        bindings: Iterable[Binding],
        draining: Mapping[Slot, Drain] | None = None,
        shared: AbstractSet[str] = frozenset(),
        service: ServiceRecords | None = None,
    ) -> None:
        """Take back what running jobs held under a previous operator (call before any request).

        Each job keeps its placement, untouched by decisions, until its first request (the
        controller's reconcile) says what it wants now or it is released; GPUs outside the
        pool, or already taken by a job restored before it, are not restored. `bindings`
        name the host as the worker bound with it (its `name`; `host` may be that name too):
        they are matched to the pool host through the job's presentation. `draining`: the
        GPUs the jobs were giving back (`adoption.adopted_holdings`): they drain on as they
        did, from when given back. `shared`: jobs that shared GPUs by memory: a GPU is
        restored to each (nobody else's until they ask again). `service`: `ServiceLedger`'s."""
        with self._changing():
            kept, taken = restorable(self.pool, placements, shared)
            self._shared_held = frozenset(shared) & kept.keys()
            for job, placement in kept.items():
                self._held[job] = placement
                self._grants[job] = Grant(placement, "adopted after an operator restart")
                self._sink.publish(job, placement)
                log.info("grant %s: %s (adopted)", job, placement.describe(), extra={"job": job})
            self._bindings.restore(bindings, self._held)
            self._service.restore(service or {}, now := self._clock(), self._wall_clock())
            for job in kept:
                self._first.started(job, now)  # a launch may have been forming at the crash
            self._drains.restore_all(draining or {}, self.pool.slot_set - taken, now)
            self._recorder.changed()

    def release(self, job: str) -> None:
        """Forget a job: its GPUs go back to the pool (and to whoever waits)."""
        with self._changing():
            if self._demands.pop(job, None) is None and job not in self._grants:
                return
            for per_job in (self._held, self._pending_since, self._resized_at):
                per_job.pop(job, None)
            self._service.forget(job)
            self._world.forget(job)
            self._first.formed(job)
            # Released once its processes are gone: what it was giving back is free now.
            self._drains.release(job)
            self._deferred.discard(job)
            if self._batching:
                self._grants.pop(job, None)
            self._decide_or_defer(caller=job)
            self._sink.withdraw(job)

    def set_pool(self, pool: Pool) -> None:
        """The pool changed while the operator runs (a node lost, or back): decide again.

        Jobs on GPUs that left keep the rest of their placement and are told of the
        change; those left under their min are pending again. GPUs that come back are
        granted like any free GPU.
        """
        with self._changing():
            if pool == self.pool:
                return
            log.info("pool: %s", pool.describe())
            self.pool = pool
            self._drains.keep_only(set(pool.slots()))
            self._decide_or_defer()

    def cordon(self, hosts: Iterable[str]) -> None:
        """These hosts are unreachable (their agents went silent): grant none of their GPUs
        that are free, but leave the jobs running there as they are.

        A job on such a host is not told to shrink: its workers there are stuck or gone, and
        Horovod recovers best by dropping them itself (ssh keepalives, Gloo's timeout); a
        grant change in the middle of that recovery can make it give up the whole job. Its
        world size then drops, and `observe_world_size` takes back the GPUs it lost, which
        stay unused while the host is cordoned. `cordon(())` lifts it.
        """
        with self._changing():
            cordoned = frozenset(hosts)
            if cordoned == self._cordoned:
                return
            log.info("cordoned hosts: %s", ", ".join(sorted(cordoned)) or "none")
            self._cordoned = cordoned
            self._decide_or_defer()

    def observe_world_size(self, job: str, world_size: int) -> None:
        """The job's workers say how many they are.

        A finished shrink frees the GPUs it was draining. Fewer workers than granted, after
        more had been seen (Horovod dropped failed ones) or for longer than
        `lost_grace_seconds`, shrinks the grant to what runs (see `slots_to_give_up`).
        """
        with self._changing():
            now = self._clock()
            previous = self._world.said(job, world_size)
            self._first.formed(job)
            if job in self._held:
                return  # adopted, not asked for yet: its first reconcile weighs it again
            grant = self._grants.get(job)
            if grant is None or world_size > grant.placement.size:
                return
            if self._drains.reported(job):
                # Like a release: in a batch, its one decision hands the GPUs on.
                self._decide_or_defer()
                grant = self._grants.get(job)
                if grant is None:
                    return
            if self._world.lost(job, previous, world_size, grant.placement.size, now):
                if standing(self._bindings.names(job, grant.placement), self._agents(job)):
                    self._world.bound(job, now)  # a torchrun membership forming: none lost
                else:
                    self._lose_workers(job, world_size, now)

    def _lose_workers(self, job: str, world_size: int, now: float) -> None:
        """Shrink `job` to the `world_size` workers it still has: the slots of gone workers
        are free at once; a slot whose bound worker still runs here drains like any."""
        grant = self._grants[job]
        loss = self._bindings.loss(job, grant.placement, world_size)
        if self.drain_seconds > 0:
            for slot, worker in loss.still_running.items():
                self._drains.start(slot, job, (worker,), now, after_loss=True)
        freed = ", ".join(f"{host}:{gpu}" for host, gpu in loss.given_up)
        granted = grant.placement.size
        message = f"world size {world_size} of {granted} granted; GPU(s) {freed} taken back"
        log.warning("%s: %s", job, message, extra={"job": job})
        self._recorder.event(job, "Warning", "WorkerLost", message)
        # Before the decision: a node the workers vanished with must not get them back.
        self._on_workers_lost(job, frozenset(host for host, _ in grant.placement.hosts))
        shrunk = only(grant.placement, loss.kept)
        self._decide(caller="", shrink=(job, Grant(shrunk, f"workers lost: {message}")))

    def guard_memory(self, used: Mapping[str, Mapping[Slot, int | None]]) -> None:
        """What each worker uses now: sharing jobs near their share acted on (memory_guard.py)."""
        with self._changing():
            step = self._guard.step(self.pool, self._demands, self._grants, self._held,
                set(self._drains), self._cordoned | self._unavailable_hosts(), used,
                self._recorder.event, self._bindings.moves_cleanly)  # fmt: skip
            self._demands.update(step.demands)
            if step.shrink is not None:  # the GPUs its workers leave drain, as a lost worker's
                if self.drain_seconds > 0:
                    moved, pids = dict([step.shrink]), self._bindings.pids_on
                    self._drains.start_given_back(self.placements(), moved, pids, self._clock())
                self._decide(caller="", shrink=step.shrink)

    def _finish_drains(self) -> bool:
        """Drop the drains that are over; True if any was. Says the overdue ones."""
        over, events = self._drains.finish()
        for job, kind, reason, message in events:
            log.warning("%s: %s", job, message, extra={"job": job})
            self._recorder.event(job, kind, reason, message)
        return over

    def release_all(self) -> None:
        """Forget every job at once (operator shutdown): no re-arbitration in between."""
        with self._changing():
            jobs = list(self._grants)
            for state in (self._demands, self._grants, self._held, self._resized_at):
                state.clear()
            self._world.clear()
            self._first.clear()
            self._service.clear()
            self._bindings.clear()
            self._drains.clear()
            self._next_thaw = None
            for job in jobs:
                self._sink.withdraw(job)
            self._recorder.changed()

    def _decide(self, caller: str, shrink: tuple[str, Grant] | None = None) -> None:
        """Decide for every job; `shrink` is a job already cut to what it still runs (lost
        workers): it keeps exactly that grant in this decision."""
        now = self._clock()
        decided = self._arbitrate(now, shrink)
        # From here on, changes are against the grants as they were (the shrink is one).
        current = {job: grant.placement for job, grant in self._grants.items()}
        # A dict: ordered, O(1) membership (a list: 0.9 s of a 10,000-job decision).
        changed = {
            job: None
            for job, grant in decided.items()
            # `is` first: an unchanged grant is the very object `arbitrate` was given back.
            if job not in self._grants
            or (grant is not self._grants[job] and grant.placement != self._grants[job].placement)
        }
        for job, grant in decided.items():
            if job not in changed and grant.placement.size:
                # Unchanged: keep the reason of the decision that made it, not "holding".
                decided[job] = self._grants[job]
        self._note_changes(changed, decided, current, now)
        self._grants = decided
        for job in changed:
            placement = decided[job].placement
            if placement.size:
                self._sink.publish(job, placement)
            if log.isEnabledFor(logging.INFO):  # describing 10,000 grants is not free
                extra = {"job": job, "gpus": placement.size}  # for --log-format json
                why = decided[job].reason
                log.info("grant %s: %s (%s)", job, placement.describe(), why, extra=extra)
        self._bindings.keep_matching(decided)
        self._recorder.changed()  # handed to the store once the lock is released
        for job in changed:
            if job != caller:
                self._changed(job, decided[job])

    def _arbitrate(self, now: float, shrink: tuple[str, Grant] | None) -> dict[str, Grant]:
        """Every job's grant in this decision: the arbitration's (in the queue's order, less
        whom it preempts), the GPUs draining out of it, held jobs kept, a shrink at its size."""
        held = {job: self._grants[job] for job in self._held}
        current = {job: grant.placement for job, grant in self._grants.items() if job not in held}
        frozen = {
            job
            for job, at in self._resized_at.items()
            if now - at < self.min_resize_interval and current.get(job, Placement.EMPTY).size
        }
        # Held jobs count as holding theirs: they are not weighed yet, but still forming.
        sizes = {job: grant.placement.size for job, grant in self._grants.items()}
        forming = self._first.frozen(now, sizes, self._bindings.bound)
        frozen |= forming & current.keys()
        if shrink is not None:
            current[shrink[0]] = shrink[1].placement
            frozen.add(shrink[0])
        unavailable = withheld_slots(
            self.pool, self._drains.overdue(),
            {job: held for job, held in self._held.items() if job not in self._shared_held},
            self._cordoned | self._unavailable_hosts(), current, self._demands)  # fmt: skip
        usable = self.pool.size - len(unavailable & self.pool.slot_set)
        demands, queued, order, preempted = self._service.queue(
            list(self._demands.values()), current, now, usable, frozen)  # fmt: skip
        decided = arbitrate_sharing(
            self.pool, demands, queued, limits=self.sharing, frozen=frozen,
            unavailable=unavailable, spare_by_gain=self.spare_by_gain, previous=self._grants,
            smallest_first=self.smallest_first,
            overdue={j for j, t in self._pending_since.items() if now - t >= self.max_wait_seconds},
            share_by_gain=self.share_by_gain, share_by_speedup=self.share_by_speedup,
            draining=self._drains.counted(),
            held_shared=held_slots(self._held, self._shared_held), order=order,
        )  # fmt: skip
        decided.update((job, Grant(Placement.EMPTY, why)) for job, why in preempted.items())
        if shrink is not None:
            decided[shrink[0]] = shrink[1]  # its given-up GPUs are not drains of this decision
        if self.drain_seconds > 0:  # what running jobs give back (all a preempted job's)
            self._drains.start_given_back(current, decided, self._bindings.pids_on, now, preempted)
        if self._drains:
            wait_for_drains(decided, current, self._drains.by_slot(), self._demands, self._grants)
        if shrink is not None:
            decided[shrink[0]] = shrink[1]
        decided.update(held)
        self._service.decided(self._demands, decided, preempted, now)
        return decided

    def _note_changes(
        self,
        changed: Mapping[str, None],
        decided: Mapping[str, Grant],
        current: Mapping[str, Placement],
        now: float,
    ) -> None:
        """What the changed grants start: resize freezes, reference sizes, grace periods,
        waits of pending jobs, and when the next freeze ends."""
        for job in changed:
            size = decided[job].placement.size
            before = current.get(job, Placement.EMPTY).size
            if size != before:
                self._resized_at[job] = now
            if size and not before:
                self._first.started(job, now)  # a launch: frozen until it formed
            self._world.regranted(job, size)
        self._resized_at = {job: at for job, at in self._resized_at.items() if job in decided}
        if self.smallest_first:
            for job, grant in decided.items():
                if grant.placement.size:
                    self._pending_since.pop(job, None)
                else:
                    self._pending_since.setdefault(job, now)
        ends = [at + self.min_resize_interval for at in self._resized_at.values()]
        ends += [end] if (end := self._first.next_end()) is not None else []
        self._next_thaw = min((at for at in ends if at > now), default=None)

    # ---- what the rest of the operator reads ----

    def thaw_at(self) -> float | None:
        """When the next frozen job may be resized again (None: none waits): the operator's
        periodic resync requests again after it; a simulation wakes then."""
        with self._lock:
            return self._next_thaw

    def grant(self, job: str) -> Grant | None:
        with self._lock:
            return self._grants.get(job)

    def placements(self) -> dict[str, Placement]:
        with self._lock:
            return {job: grant.placement for job, grant in self._grants.items()}

    def draining(self) -> dict[Slot, str]:
        """GPUs given back and not yet free: slot -> the job that gave it back."""
        with self._lock:
            return self._drains.by_slot()

    def overdue_drains(self) -> int:
        """GPUs draining past `drain_seconds` (held until observed free)."""
        with self._lock:
            return len(self._drains.overdue())

    def bindings(self) -> list[Binding]:
        with self._lock:
            return self._bindings.all()

    def bind(self, job: str, name: str, local_rank: int, pid: int | None) -> tuple[Slot, ...]:
        """A worker of `job` (pid `pid`) that Horovod named host `name`, local rank
        `local_rank`, asks which GPU is its: returns the job's GPUs under `name`, the
        worker's at position `local_rank`. NoSuchWorker if the job holds no such GPU;
        NotJobsProcess if the GPU is on this host and `pid` is no process of the job: the
        allocator relies on the pids its workers bind with (when a GPU given back is free,
        which of a job's GPUs lost their worker), so a job may name only its own."""
        with self._lock:
            grant = self._grants.get(job)
            placement = grant.placement if grant is not None else Placement.EMPTY
            (host, _), slots = self._bindings.where(job, name, local_rank, placement, self._grants)
            if pid is not None and host in self._local_hosts and not self._belongs(job, pid):
                raise NotJobsProcess(f"pid {pid} is not a process of job {job!r} on {host}")
            self._bindings.bind(job, name, local_rank, pid, slots)
            self._world.bound(job, self._clock())
            if job in self._first and self._bindings.bound(job) >= placement.size:
                # Formed: the next request decides again (what waited for its GPUs may go).
                self._first.formed(job)
                self._next_thaw = self._clock()
            return slots

    def workers(self, job: str, since: float) -> Workers | None:
        """The job's workers as their bindings show them (each bind names the worker's pid):
        how many bound to a GPU of its grant run and started at or after `since` (unix time:
        the launch's start; a worker of an earlier launch, or another process that got its
        pid, is not one), and which granted GPUs have none. None when the job holds no GPU,
        or one on another host, whose processes cannot be seen from here."""
        with self._lock:
            grant = self._grants.get(job)
            if grant is None or not grant.placement.size:
                return None
            slots = grant.placement.slots()
            if any(host not in self._local_hosts for host, _ in slots):
                return None
            pids = self._bindings.pids_by_slot(job)
        return running_workers(slots, pids, since)  # reads the process table: not locked
