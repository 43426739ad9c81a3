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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

from herd_operator.rpc import BadRequest, NotFound, host_arg
from policies.arbitration import arbitrate
from specs.values import Demand, Grant, Placement, Pool, Slot

log = logging.getLogger(__name__)


class PlacementSink(Protocol):
    """Where the allocator hands its decisions: the engine of each job makes them reach it."""

    def publish(self, job: str, placement: Placement) -> None:
        """The job's placement changed to `placement` (never empty)."""
        ...

    def withdraw(self, job: str) -> None:
        """The job was released: it holds nothing any more."""
        ...


@dataclass(frozen=True)
class Binding:
    job: str
    host: str
    local_rank: int
    gpu: int
    pid: int | None


@dataclass(frozen=True)
class _Drain:
    """A GPU a job gave back, not yet handed to another job: its worker may still be on it."""

    job: str
    until: float
    pids: tuple[tuple[str, int], ...]
    """(host, pid) of the workers that were bound to it."""


DEFAULT_DRAIN_SECONDS = 30.0
PID_CHECK_SECONDS = 1.0
"""How often draining GPUs whose workers run on this host are checked for those workers."""


class Allocator:
    """Thread-safe: the controller and the RPC server's thread both call it.

    A GPU taken from a running job drains before another job gets it: Horovod
    removes the worker on it within seconds, but until then two jobs would share
    the device. It is free again when the job reports its new world size, when
    the workers bound to it (on this host) are gone, or after `drain_seconds`.
    """

    def __init__(
        self,
        pool: Pool,
        sink: PlacementSink,
        *,
        virtual: bool,
        on_change: Callable[[str, Grant], None] = lambda job, grant: None,
        on_decision: Callable[[Mapping[str, Placement]], None] = lambda placements: None,
        min_resize_interval: float = 0.0,
        drain_seconds: float = DEFAULT_DRAIN_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.drain_seconds = drain_seconds
        self._draining: dict[Slot, _Drain] = {}
        self._next_drain_check = math.inf
        self._batching = False
        self._deferred: set[str] = set()
        self._dirty = False
        self._local_hosts = {"localhost", "127.0.0.1", "::1", socket.gethostname()}
        self.min_resize_interval = min_resize_interval
        self._clock = clock
        self.virtual = virtual
        self._sink = sink
        self._listeners: list[Callable[[str, Grant], None]] = [on_change]
        self._on_decision = on_decision
        self._lock = threading.RLock()
        self._demands: dict[str, Demand] = {}
        self._grants: dict[str, Grant] = {}
        self._bindings: dict[tuple[str, str, int], Binding] = {}
        # Placements of jobs adopted after an operator restart whose demand has not come
        # yet: their workers are on these GPUs, so no decision may give them to anyone else.
        self._held: dict[str, Placement] = {}
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

    def request(self, demand: Demand) -> Grant | None:
        """Record a job's demand, decide again for everyone, return the job's grant.

        Inside `batch()`, a changed demand is only recorded: the result is None and the job
        is woken (`on_change`) once the batch's single decision is made.
        """
        with self._lock:
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
            with self._lock:
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

    def restore(self, placements: Mapping[str, Placement], bindings: Iterable[Binding]) -> None:
        """Take back what running jobs held under a previous operator (call before any request).

        Each job keeps its placement, untouched by decisions, until its first request (the
        controller's reconcile) says what it wants now or it is released; GPUs outside the
        pool, or already taken by a job restored before it, are not restored.
        """
        with self._lock:
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
                if held is not None and binding.gpu in held.gpus_on(binding.host):
                    self._bindings[(binding.job, binding.host, binding.local_rank)] = binding
            self._on_decision(self.placements())

    def release(self, job: str) -> None:
        """Forget a job: its GPUs go back to the pool (and to whoever waits)."""
        with self._lock:
            if self._demands.pop(job, None) is None and job not in self._grants:
                return
            self._held.pop(job, None)
            self._resized_at.pop(job, None)
            # Released once its processes are gone: what it was giving back is free now.
            self._draining = {s: d for s, d in self._draining.items() if d.job != job}
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
        with self._lock:
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

    def observe_world_size(self, job: str, world_size: int) -> None:
        """The job's workers say how many they are: a finished shrink frees its GPUs."""
        with self._lock:
            grant = self._grants.get(job)
            if grant is None or world_size > grant.placement.size:
                return
            if any(drain.job == job for drain in self._draining.values()):
                self._draining = {s: d for s, d in self._draining.items() if d.job != job}
                self._decide(caller="")

    def _finish_drains(self) -> bool:
        """Drop drains that are over (timed out, or their workers are gone); True if any.

        Called on every request, so it looks only when a deadline has passed or, for
        drains it can check through local pids, at most every PID_CHECK_SECONDS.
        """
        now = self._clock()
        if not self._draining or now < self._next_drain_check:
            return False
        over = [slot for slot, drain in self._draining.items() if self._drained(drain, now)]
        for slot in over:
            del self._draining[slot]
        self._schedule_drain_check(now)
        return bool(over)

    def _schedule_drain_check(self, now: float) -> None:
        self._next_drain_check = min(
            (
                min(drain.until, now + PID_CHECK_SECONDS) if drain.pids else drain.until
                for drain in self._draining.values()
            ),
            default=math.inf,
        )

    def _drained(self, drain: _Drain, now: float) -> bool:
        if now >= drain.until:
            return True
        if not drain.pids or any(host not in self._local_hosts for host, _ in drain.pids):
            return False  # no way to see the workers from here: wait for a report
        return not any(_alive(pid) for _, pid in drain.pids)

    def release_all(self) -> None:
        """Forget every job at once (operator shutdown): no re-arbitration in between."""
        with self._lock:
            jobs = list(self._grants)
            self._demands.clear()
            self._grants.clear()
            self._bindings.clear()
            self._held.clear()
            self._resized_at.clear()
            self._draining.clear()
            self._next_thaw = None
            for job in jobs:
                self._sink.withdraw(job)
            self._on_decision({})

    def grant(self, job: str) -> Grant | None:
        with self._lock:
            return self._grants.get(job)

    def placements(self) -> dict[str, Placement]:
        with self._lock:
            return {job: grant.placement for job, grant in self._grants.items()}

    def _decide(self, caller: str) -> None:
        now = self._clock()
        held = {job: self._grants[job] for job in self._held}
        current = {job: grant.placement for job, grant in self._grants.items() if job not in held}
        frozen = {
            job
            for job, at in self._resized_at.items()
            if now - at < self.min_resize_interval and current.get(job, Placement.EMPTY).size
        }
        demands = list(self._demands.values())
        decided = arbitrate(self._free_pool(), demands, current, frozen=frozen)
        freed = self._start_drains(current, decided, now)
        if any(
            slot in freed and freed[slot] != job
            for job, grant in decided.items()
            for slot in grant.placement.slots()
        ):
            # A GPU a job just gave back went to another job in the same decision: decide
            # again without it; the job that shrank keeps its new size (frozen at it).
            shrunk = set(freed.values())
            first = decided
            current = {**current, **{job: first[job].placement for job in shrunk}}
            decided = arbitrate(self._free_pool(), demands, current, frozen=frozen | shrunk)
            decided.update({job: first[job] for job in shrunk})
            givers = ", ".join(sorted(shrunk))
            for job, grant in decided.items():
                if first[job].admitted and not grant.admitted:
                    decided[job] = Grant(
                        grant.placement,
                        f"pending: waiting for GPUs that {givers} gave back to drain"
                        " (its workers leave them first)",
                    )
            current = {job: grant.placement for job, grant in self._grants.items()}
        decided.update(held)
        # A dict: ordered like `decided`, and membership costs O(1) (a list made this loop
        # quadratic: 0.9 s of a 10,000-job decision).
        changed = {
            job: None
            for job, grant in decided.items()
            if job not in self._grants or grant.placement != self._grants[job].placement
        }
        for job, grant in decided.items():
            if job not in changed and grant.placement.size:
                # Unchanged: keep the reason of the decision that made it, which is what
                # the job's events and status should say, not "holding".
                decided[job] = self._grants[job]
        for job in changed:
            if decided[job].placement.size != current.get(job, Placement.EMPTY).size:
                self._resized_at[job] = now
        self._resized_at = {job: at for job, at in self._resized_at.items() if job in decided}
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
            log.info("grant %s: %s (%s)", job, _describe(placement), decided[job].reason)
        self._bindings = {
            key: binding
            for key, binding in self._bindings.items()
            if binding.job in decided
            and binding.local_rank < len(decided[binding.job].placement.gpus_on(binding.host))
        }
        try:
            self._on_decision({job: grant.placement for job, grant in decided.items()})
        finally:
            # The decision stands (grants are published) even when recording it failed: the
            # jobs it moved must hear of it, or a job admitted here would wait unwoken.
            for job in changed:
                if job != caller:
                    self._changed(job, decided[job])

    def _start_drains(
        self, current: Mapping[str, Placement], decided: Mapping[str, Grant], now: float
    ) -> dict[Slot, str]:
        """Slots that running jobs give back in this decision start draining; returns them."""
        if self.drain_seconds <= 0:
            return {}
        freed: dict[Slot, str] = {}
        for job, grant in decided.items():
            if not grant.placement.size:
                continue
            kept = set(grant.placement.slots())
            for slot in current.get(job, Placement.EMPTY).slots():
                if slot in kept:
                    continue
                pids = tuple(
                    (b.host, b.pid)
                    for b in self._bindings.values()
                    if b.job == job and (b.host, b.gpu) == slot and b.pid is not None
                )
                self._draining[slot] = _Drain(job, now + self.drain_seconds, pids)
                freed[slot] = job
        if freed:
            self._schedule_drain_check(now)
        return freed

    def _free_pool(self) -> Pool:
        """The pool a decision shares out: without draining GPUs and those of held jobs."""
        unavailable = set(self._draining)
        for placement in self._held.values():
            unavailable.update(placement.slots())
        if not unavailable:
            return self.pool
        hosts = tuple(
            (host, tuple(gpu for gpu in gpus if (host, gpu) not in unavailable))
            for host, gpus in self.pool.hosts
        )
        return Pool(tuple((host, gpus) for host, gpus in hosts if gpus))

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
            gpus = grant.placement.gpus_on(host)
            if local_rank >= len(gpus):
                raise NotFound(
                    f"job {job!r} holds {len(gpus)} GPU(s) on {host!r}; no local rank {local_rank}"
                )
            gpu = gpus[local_rank]
            self._bindings[(job, host, local_rank)] = Binding(
                job, host, local_rank, gpu, pid if isinstance(pid, int) else None
            )
        return {"gpu": gpu, "gpus": list(gpus), "virtual": self.virtual}

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
