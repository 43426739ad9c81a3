"""The GPUs jobs gave back that no other job has yet: the allocator's drain tracker.

A GPU taken from a running job drains before another job gets it: Horovod removes the
worker on it within seconds, but until then two jobs would share the device. It is free
again only when that is observed: the job reports its new world size (`reported`), or the
workers bound to it, on this host, are gone (`finish` looks, at most every
`PID_CHECK_SECONDS`). Past `drain_seconds` a drain is overdue: said once (a `DrainOverdue`
event), and the GPU stays held; decisions no longer count on it.

Apart from the allocator's decisions because it is state with a clock of its own (deadlines,
the next look at the workers' pids), not a decision. Not thread-safe by itself: the
allocator calls it under its lock.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, replace
from typing import Literal

from herd_operator.runtime.process_table import alive
from herd_operator.specs.values import Drain, Grant, Placement, Slot

log = logging.getLogger(__name__)

DEFAULT_DRAIN_SECONDS = 30.0
PID_CHECK_SECONDS = 1.0
"""How often draining GPUs whose workers run on this host are checked for those workers."""

Event = tuple[str, Literal["Normal", "Warning"], str, str]
"""(job, type, reason, message): an event for the allocator to record."""


@dataclass(frozen=True)
class _Drain:
    """A GPU a job gave back, not yet handed to another job: its worker may still be on it."""

    job: str
    until: float
    """When the job's workers should have left it (the tracker's clock); past it, it is
    overdue (and still held)."""
    pids: tuple[tuple[str, int], ...]
    """(host, pid) of the workers that were bound to it."""
    given_back_at: float
    """Wall-clock time it was given back: what the store keeps, since `until` is of this
    process's clock."""
    overdue: bool = False
    after_loss: bool = False
    """Given back because the job lost workers: a report of the smaller size does not free
    it (the report cannot say which GPUs the survivors use); only its worker's exit does."""

    def record(self) -> Drain:
        return Drain(self.job, self.given_back_at, self.pids, self.after_loss)


class DrainTracker:
    """The draining GPUs, their deadlines, and when to look at their workers next."""

    def __init__(
        self,
        drain_seconds: float,
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        local_hosts: AbstractSet[str],
    ) -> None:
        self.drain_seconds = drain_seconds
        self._clock = clock
        self._wall_clock = wall_clock
        self._local_hosts = local_hosts
        self._draining: dict[Slot, _Drain] = {}
        self._next_check = math.inf

    def __bool__(self) -> bool:
        return bool(self._draining)

    def __contains__(self, slot: object) -> bool:
        return slot in self._draining

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._draining)

    def job_of(self, slot: Slot) -> str:
        return self._draining[slot].job

    def by_slot(self) -> dict[Slot, str]:
        """Slot -> the job that gave it back."""
        return {slot: drain.job for slot, drain in self._draining.items()}

    def counted(self) -> set[Slot]:
        """The drains a decision counts on (as GPUs that will be free): those not overdue."""
        return {slot for slot, drain in self._draining.items() if not drain.overdue}

    def overdue(self) -> set[Slot]:
        """The drains past their deadline: held, and counted on by no decision."""
        return {slot for slot, drain in self._draining.items() if drain.overdue}

    def records(self) -> dict[Slot, Drain]:
        """What the store keeps of each drain."""
        return {slot: drain.record() for slot, drain in self._draining.items()}

    def start(
        self,
        slot: Slot,
        job: str,
        pids: tuple[tuple[str, int], ...],
        now: float,
        *,
        after_loss: bool = False,
    ) -> None:
        """`job` gave `slot` back now; `pids` are the workers bound to it."""
        drain = _Drain(
            job, now + self.drain_seconds, pids, self._wall_clock(), after_loss=after_loss
        )
        self._draining[slot] = drain
        self._next_check = min(self._next_check, self._next_look(drain, now))

    def start_given_back(
        self,
        current: Mapping[str, Placement],
        decided: Mapping[str, Grant],
        pids_on: Callable[[str, Slot], tuple[tuple[str, int], ...]],
        now: float,
        preempted: Collection[str] = (),
    ) -> None:
        """The slots each job held (`current`) and gives back in this decision (`decided`)
        start draining, watching the pids its workers bound there with (`pids_on`): all of a
        `preempted` job's, none of a released job's (no worker of it is left to wait for)."""
        for job, grant in decided.items():
            before = current.get(job, Placement.EMPTY)
            if job in preempted:
                kept: set[Slot] = set()
            elif not grant.placement.size or before is grant.placement or before == grant.placement:
                continue  # most jobs keep their placement: nothing to compare slot by slot
            else:
                kept = set(grant.placement.slots())
            for slot in before.slots():
                if slot not in kept:
                    self.start(slot, job, pids_on(job, slot), now)

    def restore(self, slot: Slot, drain: Drain, now: float) -> None:
        """A drain a previous operator recorded: its deadline counts from when the GPU was
        given back, not from now."""
        ago = max(0.0, self._wall_clock() - drain.given_back_at)
        restored = _Drain(
            drain.job,
            now + max(0.0, self.drain_seconds - ago),
            drain.pids,
            drain.given_back_at,
            after_loss=drain.after_loss,
        )
        self._draining[slot] = restored
        self._next_check = min(self._next_check, self._next_look(restored, now))

    def restore_all(
        self, drains: Mapping[Slot, Drain], usable: AbstractSet[Slot], now: float
    ) -> None:
        """The drains a previous operator recorded, of the `usable` GPUs (in the pool, taken by
        no restored job) not draining already (`restore`)."""
        for slot, drain in sorted(drains.items()):
            if slot not in usable or slot in self._draining:
                continue
            self.restore(slot, drain, now)
            log.info(
                "%s: GPU %s:%d still drains (given back %.0f s ago)",
                drain.job, slot[0], slot[1], max(0.0, self._wall_clock() - drain.given_back_at),
            )  # fmt: skip

    def release(self, job: str) -> None:
        """`job`'s processes are gone: what it was giving back is free now."""
        # Deleted in place: rebuilding the whole dict for each release added up when
        # thousands of GPUs drain (a simulation with a control period delays reports).
        for slot in [s for s, d in self._draining.items() if d.job == job]:
            del self._draining[slot]

    def keep_only(self, slots: AbstractSet[Slot]) -> None:
        """The pool changed: drains of GPUs that left it are over."""
        self._draining = {s: d for s, d in self._draining.items() if s in slots}

    def clear(self) -> None:
        self._draining.clear()
        self._next_check = math.inf

    def reported(self, job: str) -> bool:
        """`job` reported a world size within its grant: the shrink it was draining for is
        done (its workers left those GPUs). True when that freed any."""
        if not any(d.job == job and not d.after_loss for d in self._draining.values()):
            return False
        self._draining = {s: d for s, d in self._draining.items() if d.job != job or d.after_loss}
        return True

    def finish(self) -> tuple[bool, list[Event]]:
        """Drop the drains that are over (their workers are gone); say the ones past their
        deadline, once each. Returns whether any was over, and the events to record.

        Called on every request, so it looks only when a deadline has passed or, for
        drains it can check through local pids, at most every PID_CHECK_SECONDS."""
        now = self._clock()
        if not self._draining or now < self._next_check:
            return False, []
        over = [slot for slot, drain in self._draining.items() if self._drained(drain)]
        for slot in over:
            del self._draining[slot]
        events = self._mark_overdue(now)
        self._next_check = min(
            (self._next_look(drain, now) for drain in self._draining.values()), default=math.inf
        )
        return bool(over), events

    def _mark_overdue(self, now: float) -> list[Event]:
        """A drain past its deadline is said once per GPU; the GPU stays held: handing it
        over while the job's worker may still be on it would make two jobs share it."""
        events: list[Event] = []
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
            events.append((drain.job, "Warning", "DrainOverdue", message))
        return events

    def _next_look(self, drain: _Drain, now: float) -> float:
        deadline = math.inf if drain.overdue else drain.until
        return min(deadline, now + PID_CHECK_SECONDS) if self._watchable(drain) else deadline

    def _watchable(self, drain: _Drain) -> bool:
        """Whether the drain's workers can be seen from here (all on this host)."""
        return bool(drain.pids) and all(host in self._local_hosts for host, _ in drain.pids)

    def _drained(self, drain: _Drain) -> bool:
        if not self._watchable(drain):
            return False  # no way to see the workers from here: wait for a report
        return not any(alive(pid) for _, pid in drain.pids)
