"""The central allocator: the single owner of the pool.

It keeps every job's demand, runs the (pure) arbitration whenever a demand
changes, hands the resulting placements to a sink (which makes each reach its
job: for Horovod, the file its discovery script reads), and tells the controller
which jobs' grants changed. Workers ask it, over the authenticated RPC server,
which GPU is theirs.
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import psutil

from herd_operator.controllers.ports import Workers
from herd_operator.policies.arbitration import arbitrate
from herd_operator.rpc.protocol import BadRequest, NotFound, host_arg
from herd_operator.specs.values import Allocation, Demand, Drain, Grant, Placement, Pool, Slot

log = logging.getLogger(__name__)


class PlacementSink(Protocol):
    """Where the allocator hands its decisions: the engine of each job makes them reach it."""

    def publish(self, job: str, placement: Placement) -> None:
        """The job's placement changed to `placement` (never empty)."""
        ...

    def withdraw(self, job: str) -> None:
        """The job was released: it holds nothing any more."""
        ...


Presenter = Callable[[str, Placement], Mapping[str, Sequence[Slot]]]
"""(job, placement) -> each host name the job's workers bind with -> the slots under that
name, in local-rank order (the job's engine may show one host under several names)."""

EventSink = Callable[[str, Literal["Normal", "Warning"], str, str], object]
"""(job, type, reason, message): an event the allocator raises on its own."""


def plain_presentation(job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
    """Each host under its own name."""
    return {host: tuple((host, gpu) for gpu in gpus) for host, gpus in placement.hosts}


@dataclass(frozen=True)
class Binding:
    job: str
    host: str
    """The pool host of the GPU."""
    local_rank: int
    gpu: int
    pid: int | None
    name: str = ""
    """The host name the worker bound with ('' when it is `host`); local_rank counts under it."""


@dataclass(frozen=True)
class _Drain:
    """A GPU a job gave back, not yet handed to another job: its worker may still be on it."""

    job: str
    until: float
    """When the job's workers should have left it (the allocator's clock); past it, it is
    overdue (and still held)."""
    pids: tuple[tuple[str, int], ...]
    """(host, pid) of the workers that were bound to it."""
    given_back_at: float
    """Wall-clock time it was given back: what the store keeps, since `until` is of this
    process's clock."""
    overdue: bool = False
    after_loss: bool = False
    """Given back by `_lose_workers`: a report of the smaller size does not free it."""

    def record(self) -> Drain:
        return Drain(self.job, self.given_back_at, self.pids, self.after_loss)


DEFAULT_DRAIN_SECONDS = 30.0
PID_CHECK_SECONDS = 1.0
"""How often draining GPUs whose workers run on this host are checked for those workers."""
DEFAULT_MAX_WAIT_SECONDS = 4 * 3600.0
"""Under `smallest_first`, a pending job that waited this long is admitted before any other
of its tier (the starvation bound). 4 h is a choice, not an optimum: docs/simulation.md shows
what a longer bound, or none, gains in mean completion time and costs the largest jobs."""
LOST_GRACE_SECONDS = 60.0
"""How long a job may report fewer workers than granted, without a drop, before the
missing ones count as lost: a grow normally completes within seconds, but a worker that
never came (a blacklisted host name) must not hold its GPU forever."""


def slots_to_give_up(
    slots: Sequence[Slot],
    count: int,
    *,
    dead: frozenset[Slot],
    bound: frozenset[Slot],
    names: Mapping[Slot, str],
) -> tuple[Slot, ...]:
    """Which `count` of a job's `slots` to take back when it lost workers.

    First the slots whose bound worker is gone, then slots no worker bound to (its worker
    never came), then slots shown under the same host name as a gone worker's (Horovod
    blacklists the whole name and stops its other workers), then the last ones.
    """
    dead_names = {names[slot] for slot in dead if slot in names}

    def rank(indexed: tuple[int, Slot]) -> tuple[int, int]:
        index, slot = indexed
        if slot in dead:
            tier = 0
        elif slot not in bound:
            tier = 1
        elif names.get(slot) in dead_names:
            tier = 2
        else:
            tier = 3
        return tier, -index

    ranked = sorted(enumerate(slots), key=rank)
    return tuple(slot for _, slot in ranked[: max(count, 0)])


class Allocator:
    """Thread-safe: the controller and the RPC server's thread both call it.

    A GPU taken from a running job drains before another job gets it: Horovod
    removes the worker on it within seconds, but until then two jobs would share
    the device. It is free again only when that is observed: the job reports its
    new world size, or the workers bound to it (on this host) are gone. Past
    `drain_seconds` it is overdue: a Warning event, and it stays held.

    Horovod also shrinks a job on its own when a worker fails: the job then reports
    fewer workers than granted. The grant follows (`observe_world_size`), taking back
    the GPUs of the workers that are gone, with a WorkerLost event; the policy grows
    the job back like any job below its desire.

    Every change ends with the allocator's state handed to `on_decision` (placements and
    drains, as an `Allocation`) and its events to `on_event`, both after its lock is released:
    the lock order is the store's lock, then the allocator's, never the other way round
    (see `_record`).
    """

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
        unavailable_hosts: Callable[[], AbstractSet[str]] = frozenset,
        on_workers_lost: Callable[[str, frozenset[str]], None] = lambda job, hosts: None,
    ) -> None:
        """`unavailable_hosts()`: hosts none of whose free GPUs a decision may grant, asked
        in every decision (suspect or lost nodes: `pools/heartbeat.NodeWatch`), on top of
        those `cordon` names. `on_workers_lost(job, hosts)`: told, before the decision that
        takes their GPUs back, that `job` lost workers and ran on `hosts` (where they may
        have vanished with their node).
        `spare_by_gain`: GPUs no job wants go to the jobs whose policy reports the most
        gain for their next GPU (`Demand.gains`) instead of sitting idle.
        `share_by_gain`: every GPU above the admitted jobs' mins goes, tier by tier, to the job
        whose next GPU adds most (`arbitrate`'s `share_by_gain`, which includes lending).
        `smallest_first`: pending jobs are admitted smallest min first within a priority
        tier, except that one pending for `max_wait_seconds` (counted from the first decision
        that left it pending) goes first (`arbitrate`'s `overdue`), from the next decision on:
        no timer is needed, since being overdue changes a decision only when GPUs come free
        or a job arrives, and each of those decides."""
        if not max_wait_seconds > 0 or not math.isfinite(max_wait_seconds):
            raise ValueError(f"max_wait_seconds must be finite and > 0, got {max_wait_seconds}")
        self.pool = pool
        self.spare_by_gain = spare_by_gain
        self.share_by_gain = share_by_gain
        self.smallest_first = smallest_first
        self.max_wait_seconds = max_wait_seconds
        # When each job not admitted was first left pending (only with smallest_first).
        self._pending_since: dict[str, float] = {}
        self.drain_seconds = drain_seconds
        self.lost_grace_seconds = lost_grace_seconds
        self._present = present
        # plain_presentation depends on the placement alone, so its answer is kept for the
        # job's current placement (every worker's bind asks for it, and computing it is
        # linear in the placement). Other presenters keep their own (Dispatch.present).
        self._plain_presented: dict[str, tuple[Placement, Mapping[str, Sequence[Slot]]]] = {}
        self._on_event = on_event
        # The world size each job last reported, and since when it has been short of its
        # grant without a drop (absent while it is not).
        self._world: dict[str, int] = {}
        self._short_since: dict[str, float] = {}
        self._draining: dict[Slot, _Drain] = {}
        self._next_drain_check = math.inf
        self._batching = False
        self._deferred: set[str] = set()
        self._dirty = False
        self._local_hosts = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
        self.min_resize_interval = min_resize_interval
        self._clock = clock
        self._wall_clock = wall_clock
        self.virtual = virtual
        self._sink = sink
        self._listeners: list[Callable[[str, Grant], None]] = []
        self._on_decision = on_decision
        self._lock = threading.RLock()
        # How deep this thread is in `_changing` blocks (only the lock's holder changes it).
        self._depth = 0
        # What the store has not been handed yet (see `_record`): whether the state changed
        # since it was last recorded, and the events raised since.
        self._unrecorded = False
        self._unsent_events: list[tuple[str, Literal["Normal", "Warning"], str, str]] = []
        self._recording = threading.Lock()
        self._record_failing = False
        self._record_error: Exception | None = None
        self._demands: dict[str, Demand] = {}
        self._grants: dict[str, Grant] = {}
        self._bindings: dict[tuple[str, str, int], Binding] = {}
        # Placements of jobs adopted after an operator restart whose demand has not come
        # yet: their workers are on these GPUs, so no decision may give them to anyone else.
        self._held: dict[str, Placement] = {}
        self._cordoned: frozenset[str] = frozenset()
        """Hosts whose free GPUs are granted to nobody (see `cordon`)."""
        self._unavailable_hosts = unavailable_hosts
        self._on_workers_lost = on_workers_lost
        # When each job's size last changed; a job is left alone for min_resize_interval
        # after that, since every change costs a Horovod reset.
        self._resized_at: dict[str, float] = {}
        self._next_thaw: float | None = None

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
        to it once the outermost such block has released the lock (`_record`)."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                outermost = self._depth == 0
        if outermost:
            self._record()

    def _record(self) -> None:
        """Hand the store the allocator's latest state and its events, outside its lock.

        The lock order is the store's lock before the allocator's, never the other way: a
        group of RPC reports holds the store's transaction while it tells the allocator each
        job's world size, and the loop's reconciles hold it while they request grants. So a
        decision never writes to the store under the allocator's lock (that order deadlocked:
        a burst's decision waited for the store held by a report group, which waited for the
        allocator). One thread records at a time; one that finds another recording leaves its
        change to it, and the recording thread looks again after letting go, so no change is
        left behind. What is recorded is always the state as it is when taken, so an older
        decision never overwrites a newer one. A write that fails (a full disk) is tried again
        at the next change or request; the decision stands meanwhile (its grants are
        published and its jobs woken)."""
        while self._unrecorded or self._unsent_events:
            if not self._recording.acquire(blocking=False):
                return  # the thread recording now looks again once it lets go
            try:
                while True:
                    with self._lock:
                        events, self._unsent_events = self._unsent_events, []
                        decision = self._snapshot() if self._unrecorded else None
                        self._unrecorded = False
                    if decision is None and not events:
                        break
                    for job, kind, reason, message in events:
                        try:
                            self._on_event(job, kind, reason, message)
                        except Exception as err:  # logged with its text when it was raised
                            log.warning("%s: cannot record the event %s: %s", job, reason, err)
                    if decision is not None and not self._write(decision):
                        return
            finally:
                self._recording.release()

    def _snapshot(self) -> Allocation:
        return Allocation(
            {job: grant.placement for job, grant in self._grants.items()},
            {slot: drain.record() for slot, drain in self._draining.items()},
        )

    def _write(self, decision: Allocation) -> bool:
        """Hand `decision` to the store; False (and said once until it works again) if it
        refused."""
        try:
            self._on_decision(decision)
        except Exception as err:
            with self._lock:
                self._unrecorded = True
                self._record_error = err
            if not self._record_failing:
                self._record_failing = True
                log.error(
                    "cannot record the allocator's decision (tried again at each change or"
                    " request; the grants stand): %s", err,
                )  # fmt: skip
            return False
        if self._record_failing:
            self._record_failing = False
            log.warning("the allocator's decisions are recorded again")
        return True

    def mark_unrecorded(self) -> None:
        """What was recorded was lost (the store rolled back the group it was written in):
        record the state again at the next change or request."""
        with self._lock:
            self._unrecorded = True

    def record_pending(self) -> Exception | None:
        """Record now what is still unrecorded (before the operator closes its store); the
        store's error if the decision is still not recorded, else None."""
        self._record()
        with self._lock:
            return self._record_error if self._unrecorded else None

    def request(self, demand: Demand) -> Grant | None:
        """Record a job's demand, decide again for everyone, return the job's grant.

        Inside `batch()`, a changed demand is only recorded: the result is None and the job
        is woken (the `watch` listeners) once the batch's single decision is made.
        """
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

    def restore(
        self,
        placements: Mapping[str, Placement],
        bindings: Iterable[Binding],
        draining: Mapping[Slot, Drain] | None = None,
    ) -> None:
        """Take back what running jobs held under a previous operator (call before any request).

        Each job keeps its placement, untouched by decisions, until its first request (the
        controller's reconcile) says what it wants now or it is released; GPUs outside the
        pool, or already taken by a job restored before it, are not restored. `bindings`
        name the host as the worker bound with it (its `name`; `host` may be that name too):
        they are matched to the pool host through the job's presentation. `draining`: the
        GPUs the jobs were giving back (see `adopted_holdings`): they drain on as they did,
        their deadline counted from when they were given back.
        """
        with self._changing():
            pool = set(self.pool.slots())
            taken: set[Slot] = set()
            for job, placement in sorted(placements.items()):
                slots = [s for s in placement.slots() if s in pool and s not in taken]
                if len(slots) != placement.size:
                    log.warning(
                        "%s: %d of its %d GPUs are not restored (gone from the pool, or held"
                        " by another job)",
                        job, placement.size - len(slots), placement.size,
                    )  # fmt: skip
                if not slots:
                    continue
                taken.update(slots)
                kept = _only(placement, set(slots))
                self._held[job] = kept
                self._grants[job] = Grant(kept, "adopted after an operator restart")
                self._sink.publish(job, kept)
                log.info("grant %s: %s (adopted)", job, _describe(kept))
            for binding in bindings:
                held = self._held.get(binding.job)
                if held is None:
                    continue
                name = binding.name or binding.host
                named = self._present(binding.job, held).get(name, ())
                host = next((h for h, gpu in named if gpu == binding.gpu), None)
                if host is not None:
                    self._bindings[(binding.job, name, binding.local_rank)] = Binding(
                        binding.job, host, binding.local_rank, binding.gpu, binding.pid,
                        "" if name == host else name,
                    )  # fmt: skip
            now, wall = self._clock(), self._wall_clock()
            for slot, drain in sorted((draining or {}).items()):
                if slot not in pool or slot in taken or slot in self._draining:
                    continue
                taken.add(slot)
                left = max(0.0, self.drain_seconds - max(0.0, wall - drain.given_back_at))
                self._draining[slot] = _Drain(
                    drain.job, now + left, drain.pids, drain.given_back_at,
                    after_loss=drain.after_loss,
                )  # fmt: skip
                log.info(
                    "%s: GPU %s:%d still drains (given back %.0f s ago)",
                    drain.job, slot[0], slot[1], max(0.0, wall - drain.given_back_at),
                )  # fmt: skip
            self._schedule_drain_check(now)
            self._unrecorded = True

    def release(self, job: str) -> None:
        """Forget a job: its GPUs go back to the pool (and to whoever waits)."""
        with self._changing():
            if self._demands.pop(job, None) is None and job not in self._grants:
                return
            self._held.pop(job, None)
            self._pending_since.pop(job, None)
            self._resized_at.pop(job, None)
            self._world.pop(job, None)
            self._short_since.pop(job, None)
            # Released once its processes are gone: what it was giving back is free now.
            # Deleted in place: rebuilding the whole dict for each release added up when
            # thousands of GPUs drain (a simulation with a control period delays reports).
            for slot in [s for s, d in self._draining.items() if d.job == job]:
                del self._draining[slot]
            self._deferred.discard(job)
            if self._batching:
                self._grants.pop(job, None)
                self._dirty = True  # decide at the end of the batch
            else:
                self._decide(caller=job)
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
            log.info("pool: %s", _describe_pool(pool))
            self.pool = pool
            slots = set(pool.slots())
            self._draining = {s: d for s, d in self._draining.items() if s in slots}
            if self._batching:
                self._dirty = True  # decide at the end of the batch
            else:
                self._decide(caller="")

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
            if self._batching:
                self._dirty = True
            else:
                self._decide(caller="")

    def observe_world_size(self, job: str, world_size: int) -> None:
        """The job's workers say how many they are.

        A finished shrink frees the GPUs it was draining. Fewer workers than granted, after
        more had been seen (Horovod dropped failed ones) or for longer than
        `lost_grace_seconds`, shrinks the grant to what runs (see `slots_to_give_up`).
        """
        with self._changing():
            now = self._clock()
            previous = self._world.get(job)
            self._world[job] = world_size
            if job in self._held:
                return  # adopted, not asked for yet: its first reconcile weighs it again
            grant = self._grants.get(job)
            if grant is None or world_size > grant.placement.size:
                return
            if any(drain.job == job and not drain.after_loss for drain in self._draining.values()):
                self._draining = {
                    s: d for s, d in self._draining.items() if d.job != job or d.after_loss
                }
                if self._batching:
                    # Like a release: the batch's one decision hands the GPUs on.
                    self._dirty = True
                else:
                    self._decide(caller="")
                    grant = self._grants.get(job)
                    if grant is None:
                        return
            granted = grant.placement.size
            if world_size >= granted:
                self._short_since.pop(job, None)
                return
            since = self._short_since.setdefault(job, now)
            # A drop below a size seen since the grant last shrank: Horovod removed workers
            # on its own (see the cap in _decide).
            dropped = previous is not None and world_size < previous
            if dropped or now - since >= self.lost_grace_seconds:
                self._lose_workers(job, world_size, now)

    def _lose_workers(self, job: str, world_size: int, now: float) -> None:
        """Shrink `job` to the `world_size` workers it still has: the slots of gone workers
        are free at once; a slot whose bound worker still runs here drains like any."""
        grant = self._grants[job]
        slots = grant.placement.slots()
        names = {
            slot: name
            for name, named in self._present(job, grant.placement).items()
            for slot in named
        }
        bound = {(b.host, b.gpu): b for b in self._bindings.values() if b.job == job}
        dead = frozenset(
            slot
            for slot, b in bound.items()
            if b.pid is not None and b.host in self._local_hosts and not _alive(b.pid)
        )
        given_up = slots_to_give_up(
            slots, len(slots) - world_size, dead=dead, bound=frozenset(bound), names=names
        )
        shrunk = _only(grant.placement, set(slots) - set(given_up))
        for slot in given_up:
            held = bound.get(slot)
            if (
                self.drain_seconds > 0
                and held is not None
                and held.pid is not None
                and slot not in dead
                and held.host in self._local_hosts
            ):
                # Its worker still runs: maybe about to be stopped by Horovod, maybe the
                # guess was wrong. Only its exit frees the GPU (the job's reports cannot
                # tell which of its GPUs the survivors use).
                self._draining[slot] = _Drain(
                    job,
                    now + self.drain_seconds,
                    ((held.host, held.pid),),
                    self._wall_clock(),
                    after_loss=True,
                )
        self._schedule_drain_check(now)
        self._short_since.pop(job, None)
        freed = ", ".join(f"{host}:{gpu}" for host, gpu in given_up)
        message = f"world size {world_size} of {len(slots)} granted; GPU(s) {freed} taken back"
        log.warning("%s: %s", job, message)
        self._unsent_events.append((job, "Warning", "WorkerLost", message))
        # Before the decision: a node the workers vanished with must not get them back.
        self._on_workers_lost(job, frozenset(host for host, _ in grant.placement.hosts))
        self._decide(caller="", shrink=(job, Grant(shrunk, f"workers lost: {message}")))

    def _finish_drains(self) -> bool:
        """Drop drains that are over (timed out, or their workers are gone); True if any.

        Called on every request, so it looks only when a deadline has passed or, for
        drains it can check through local pids, at most every PID_CHECK_SECONDS.
        """
        now = self._clock()
        if not self._draining or now < self._next_drain_check:
            return False
        over = [slot for slot, drain in self._draining.items() if self._drained(drain)]
        for slot in over:
            del self._draining[slot]
        self._warn_overdue(now)
        self._schedule_drain_check(now)
        return bool(over)

    def _warn_overdue(self, now: float) -> None:
        """A drain past its deadline is said once per GPU; the GPU stays held: handing it
        over while the job's worker may still be on it would make two jobs share it."""
        for slot, drain in list(self._draining.items()):
            if drain.overdue or now < drain.until:
                continue
            self._draining[slot] = replace(drain, overdue=True)
            host, gpu = slot
            watched = (
                "its workers' processes are gone"
                if self._watchable(drain)
                else "the job reports its smaller size"
            )
            message = (
                f"GPU {host}:{gpu} given back {self.drain_seconds:.0f}s ago is still draining:"
                f" it stays held until {watched}"
            )
            log.warning("%s: %s", drain.job, message)
            self._unsent_events.append((drain.job, "Warning", "DrainOverdue", message))

    def _schedule_drain_check(self, now: float) -> None:
        self._next_drain_check = min(
            (
                min(math.inf if drain.overdue else drain.until, now + PID_CHECK_SECONDS)
                if self._watchable(drain)
                else (math.inf if drain.overdue else drain.until)
                for drain in self._draining.values()
            ),
            default=math.inf,
        )

    def _watchable(self, drain: _Drain) -> bool:
        """Whether this allocator can see the drain's workers (all on this host)."""
        return bool(drain.pids) and all(host in self._local_hosts for host, _ in drain.pids)

    def _drained(self, drain: _Drain) -> bool:
        if not self._watchable(drain):
            return False  # no way to see the workers from here: wait for a report
        return not any(_alive(pid) for _, pid in drain.pids)

    def overdue_drains(self) -> int:
        """GPUs draining past `drain_seconds` (held until observed free)."""
        with self._lock:
            return sum(drain.overdue for drain in self._draining.values())

    def release_all(self) -> None:
        """Forget every job at once (operator shutdown): no re-arbitration in between."""
        with self._changing():
            jobs = list(self._grants)
            self._demands.clear()
            self._grants.clear()
            self._bindings.clear()
            self._held.clear()
            self._resized_at.clear()
            self._world.clear()
            self._short_since.clear()
            self._draining.clear()
            self._next_thaw = None
            for job in jobs:
                self._sink.withdraw(job)
            self._unrecorded = True

    def thaw_at(self) -> float | None:
        """When the next job that resized recently may be resized again (None: none waits).

        The operator's periodic resync requests again after it; a simulation wakes then."""
        with self._lock:
            return self._next_thaw

    def grant(self, job: str) -> Grant | None:
        with self._lock:
            return self._grants.get(job)

    def placements(self) -> dict[str, Placement]:
        with self._lock:
            return {job: grant.placement for job, grant in self._grants.items()}

    def _decide(self, caller: str, shrink: tuple[str, Grant] | None = None) -> None:
        """Decide for every job; `shrink` is a job already cut to what it still runs (lost
        workers): it keeps exactly that grant in this decision."""
        now = self._clock()
        held = {job: self._grants[job] for job in self._held}
        current = {job: grant.placement for job, grant in self._grants.items() if job not in held}
        frozen = {
            job
            for job, at in self._resized_at.items()
            if now - at < self.min_resize_interval and current.get(job, Placement.EMPTY).size
        }
        if shrink is not None:
            current[shrink[0]] = shrink[1].placement
            frozen.add(shrink[0])
        demands = list(self._demands.values())
        overdue = {
            job
            for job, since in self._pending_since.items()
            if now - since >= self.max_wait_seconds
        }
        decided = arbitrate(
            self.pool,
            demands,
            current,
            frozen=frozen,
            unavailable=self._unavailable(current),
            spare_by_gain=self.spare_by_gain,
            previous=self._grants,
            smallest_first=self.smallest_first,
            overdue=overdue,
            share_by_gain=self.share_by_gain,
            draining={slot for slot, drain in self._draining.items() if not drain.overdue},
        )
        if shrink is not None:
            decided[shrink[0]] = shrink[1]  # its given-up GPUs are not drains of this decision
        self._start_drains(current, decided, now)
        if self._draining:
            self._wait_for_drains(decided, current)
        if shrink is not None:
            decided[shrink[0]] = shrink[1]
        decided.update(held)
        # From here on, changes are against the grants as they were (the shrink is one).
        current = {job: grant.placement for job, grant in self._grants.items()}
        # A dict: ordered like `decided`, and membership costs O(1) (a list made this loop
        # quadratic: 0.9 s of a 10,000-job decision).
        changed = {
            job: None
            for job, grant in decided.items()
            # `is` first: an unchanged grant is the very object `arbitrate` was given back.
            if job not in self._grants
            or (grant is not self._grants[job] and grant.placement != self._grants[job].placement)
        }
        for job, grant in decided.items():
            if job not in changed and grant.placement.size:
                # Unchanged: keep the reason of the decision that made it, which is what
                # the job's events and status should say, not "holding".
                decided[job] = self._grants[job]
        for job in changed:
            if decided[job].placement.size != current.get(job, Placement.EMPTY).size:
                self._resized_at[job] = now
            if job in self._world:
                # A size seen before a shrink we asked for is no reference for a drop: the
                # workers leaving then were told to.
                self._world[job] = min(self._world[job], decided[job].placement.size)
            # A new grant gets its own grace to be filled.
            self._short_since.pop(job, None)
        self._resized_at = {job: at for job, at in self._resized_at.items() if job in decided}
        if self.smallest_first:
            for job, grant in decided.items():
                if grant.placement.size:
                    self._pending_since.pop(job, None)
                else:
                    self._pending_since.setdefault(job, now)
        thaws = [
            at + self.min_resize_interval
            for at in self._resized_at.values()
            if at + self.min_resize_interval > now
        ]
        self._next_thaw = min(thaws) if thaws else None
        self._grants = decided
        for job in changed:
            placement = decided[job].placement
            if placement.size:
                self._sink.publish(job, placement)
            if log.isEnabledFor(logging.INFO):  # describing 10,000 grants is not free
                log.info("grant %s: %s (%s)", job, _describe(placement), decided[job].reason)
        presented: dict[str, Mapping[str, Sequence[Slot]]] = {}
        kept: dict[tuple[str, str, int], Binding] = {}
        for key, binding in self._bindings.items():
            if binding.job not in decided:
                continue
            if binding.job not in presented:
                presented[binding.job] = self._present(binding.job, decided[binding.job].placement)
            named = presented[binding.job].get(binding.name or binding.host, ())
            if binding.local_rank < len(named) and named[binding.local_rank] == (
                binding.host,
                binding.gpu,
            ):
                kept[key] = binding
        self._bindings = kept
        self._unrecorded = True  # handed to the store once the lock is released
        for job in changed:
            if job != caller:
                self._changed(job, decided[job])

    def _wait_for_drains(self, decided: dict[str, Grant], current: Mapping[str, Placement]) -> None:
        """Take the draining GPUs out of the grants of `decided`: they go to no job yet.

        A decision counts GPUs being given back as the pool's (they will be free) and places
        them last (`arbitrate`'s `draining`), but they are not free yet: the workers of the
        job that gave one back leave it only when Horovod removes them. A running job that
        was to get one grows by the rest of its grant. A job to be admitted waits, pending,
        until a later decision, once they drained, gives it all of its grant at once: its
        share is counted for it meanwhile, so nobody else grows into it, and the jobs that
        shrank for it stay shrunk, so it takes no more than it needs. (Deciding without those
        GPUs took GPUs from another job, which went to the waiting one at once while that
        job's workers were still on them; and a job started on part of its grant was frozen
        at it while the rest went elsewhere.)
        """
        for job, grant in list(decided.items()):
            before = current.get(job, Placement.EMPTY)
            if grant.placement is before or grant.placement == before:
                continue  # most jobs keep their placement: they took no GPU
            taken = {slot for slot in grant.placement.slots() if slot in self._draining}
            if not taken:
                continue
            givers = ", ".join(sorted({self._draining[slot].job for slot in taken}))
            wait = (
                f"waiting for GPUs that {givers} gave back to drain (its workers leave them first)"
            )
            demand = self._demands.get(job)
            if demand is None or before.size < demand.min:
                decided[job] = Grant(Placement.EMPTY, f"pending: {wait}")
                continue
            rest = _only(grant.placement, set(grant.placement.slots()) - taken)
            previous = self._grants.get(job)
            if previous is not None and previous.placement == rest:
                decided[job] = previous
            else:
                decided[job] = Grant(rest, f"{grant.reason}; {len(taken)} more {wait}")

    def _start_drains(
        self, current: Mapping[str, Placement], decided: Mapping[str, Grant], now: float
    ) -> None:
        """Slots that running jobs give back in this decision start draining."""
        if self.drain_seconds <= 0:
            return
        freed: dict[Slot, str] = {}
        wall = self._wall_clock()
        for job, grant in decided.items():
            before = current.get(job, Placement.EMPTY)
            if not grant.placement.size or before is grant.placement or before == grant.placement:
                continue  # most jobs keep their placement: nothing to compare slot by slot
            kept = set(grant.placement.slots())
            for slot in before.slots():
                if slot in kept:
                    continue
                pids = tuple(
                    (b.host, b.pid)
                    for b in self._bindings.values()
                    if b.job == job and (b.host, b.gpu) == slot and b.pid is not None
                )
                self._draining[slot] = _Drain(job, now + self.drain_seconds, pids, wall)
                freed[slot] = job
        if freed:
            self._schedule_drain_check(now)

    def _unavailable(self, current: Mapping[str, Placement]) -> set[Slot]:
        """GPUs a decision shares out to nobody: those draining past their deadline (they may
        never be seen free: no decision counts on them), those of held jobs, and the GPUs of
        cordoned, suspect or lost hosts that no job keeps in it: a job keeps its `current`
        placement (a job shrunk to the workers it still has, not the GPUs it gave up), unless
        it is being released (no demand any more)."""
        unavailable = {slot for slot, drain in self._draining.items() if drain.overdue}
        for placement in self._held.values():
            unavailable.update(placement.slots())
        cordoned = self._cordoned | self._unavailable_hosts()
        if cordoned:
            granted = {
                slot
                for job, placement in current.items()
                if job in self._demands
                for slot in placement.slots()
            }
            unavailable.update(
                (host, gpu)
                for host, gpus in self.pool.hosts
                if host in cordoned
                for gpu in gpus
                if (host, gpu) not in granted
            )
        return unavailable

    def draining(self) -> dict[Slot, str]:
        """GPUs given back and not yet free: slot -> the job that gave it back."""
        with self._lock:
            return {slot: drain.job for slot, drain in self._draining.items()}

    # ---- RPC handlers (called on the RPC server's thread) ----

    def handle_bind(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Which GPU is a worker's: by (job, host, local_rank), as Horovod numbers them."""
        job, host, local_rank = _str(args, "job"), host_arg(args, "host"), _int(args, "local_rank")
        pid = args.get("pid")
        with self._lock:
            grant = self._grants.get(job)
            if grant is None or not grant.placement.size:
                raise NotFound(f"job {job!r} holds no GPUs")
            slots = self._presentation(job, grant.placement).get(host, ())
            if local_rank >= len(slots):
                raise NotFound(
                    f"job {job!r} holds {len(slots)} GPU(s) on {host!r}; no local rank {local_rank}"
                )
            real_host, gpu = slots[local_rank]
            self._bindings[(job, host, local_rank)] = Binding(
                job,
                real_host,
                local_rank,
                gpu,
                pid if isinstance(pid, int) else None,
                "" if host == real_host else host,
            )
        return {"gpu": gpu, "gpus": [g for _, g in slots], "virtual": self.virtual}

    def _presentation(self, job: str, placement: Placement) -> Mapping[str, Sequence[Slot]]:
        if self._present is not plain_presentation:
            return self._present(job, placement)
        cached = self._plain_presented.get(job)
        if cached is not None and cached[0] is placement:
            return cached[1]
        presented = plain_presentation(job, placement)
        if len(self._plain_presented) > 2 * len(self._grants) + 16:
            # Forget jobs that are gone, so finished jobs' placements are not kept forever.
            self._plain_presented = {
                name: entry for name, entry in self._plain_presented.items() if name in self._grants
            }
        self._plain_presented[job] = (placement, presented)
        return presented

    def bindings(self) -> list[Binding]:
        with self._lock:
            return list(self._bindings.values())

    def handle_placements(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """Every job's GPUs, for node exporters labelling GPUs with their job."""
        with self._lock:
            return {
                "placements": {
                    job: grant.placement.to_json()
                    for job, grant in self._grants.items()
                    if grant.placement.size
                },
                "bindings": [
                    [b.job, b.host, b.local_rank, b.gpu, b.pid] for b in self._bindings.values()
                ],
            }

    def handle_grant(self, args: Mapping[str, Any]) -> dict[str, Any]:
        job = _str(args, "job")
        with self._lock:
            grant = self._grants.get(job)
            if grant is None:
                raise NotFound(f"no job {job!r}")
            return {"placement": grant.placement.to_json(), "reason": grant.reason}

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
            pids = {
                (b.host, b.gpu): b.pid
                for b in self._bindings.values()
                if b.job == job and b.pid is not None
            }
        running = {
            slot for slot in slots if (pid := pids.get(slot)) is not None and _since(pid, since)
        }
        return Workers(len(running), tuple(slot for slot in slots if slot not in running))


def _only(placement: Placement, slots: set[Slot]) -> Placement:
    """`placement` without the GPUs not in `slots`; the order stays (position i on a host
    is the GPU of local rank i)."""
    hosts = tuple(
        (host, tuple(gpu for gpu in gpus if (host, gpu) in slots)) for host, gpus in placement.hosts
    )
    return Placement(tuple((host, gpus) for host, gpus in hosts if gpus))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _since(pid: int, since: float) -> bool:
    """Whether `pid` runs and started at or after `since` (psutil's start time counts from
    the boot time in whole seconds: a second of slack each way)."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() >= since - 2.0
    except psutil.Error:
        return False


def _describe_pool(pool: Pool) -> str:
    return ", ".join(f"{host}:{len(gpus)}" for host, gpus in pool.hosts) or "no GPUs"


def _describe(placement: Placement) -> str:
    if not placement.size:
        return "nothing (pending)"
    return ", ".join(f"{host}{list(gpus)}" for host, gpus in placement.hosts)


def _str(args: Mapping[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{key}' must be a non-empty string")
    return value


def _int(args: Mapping[str, Any], key: str) -> int:
    value = args.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"'{key}' must be a non-negative integer")
    return value
