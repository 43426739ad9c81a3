"""What sharing workers use of each GPU as a packing decision goes, and where a job's next
workers go: the state and the search `sharing.pack` works with.

Pure, as `sharing.py` (which documents the rules): apart from it only to keep each module
short enough to read.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Literal

from herd_operator.specs.values import Demand, Placement, Pool, Slot

if TYPE_CHECKING:
    from herd_operator.policies.sharing import SharingLimits

Sharing = Literal["any", "light", "none"]
"""Which GPUs other jobs use a worker may go to: any, those it would not crowd
(`GpuRoom.crowded`), none."""
LIGHT_TOGETHER = 1.0
"""Summed utilization (`Demand.utilization`) up to which jobs sharing a GPU fit in its time:
in the simulator's interference model they run at most 10% slower there
(`colocation.INTERFERENCE_POINTS`), past it they time-slice."""


def worker_memory(demand: Demand, margin: float) -> int:
    """GPU memory one worker of a sharing job is counted for: the larger of its request and
    its measured peak raised by `margin`; 0 when neither is known."""
    measured = math.ceil(demand.measured_bytes * (1.0 + margin)) if demand.measured_bytes else 0
    return max(demand.memory_bytes or 0, measured)


def counted_memory(
    limits: SharingLimits | None,
    demands: Mapping[str, Demand],
    placements: Mapping[str, Placement],
    shared: AbstractSet[str],
) -> dict[str, int]:
    """Bytes one worker of each sharing job that holds GPUs is counted for at its size
    (`worker_memory_at`); a job with no demand (adopted, not asked yet) is left out. What
    the store logs per shared GPU (`Allocation.memory`)."""
    margin = limits.margin if limits is not None else 0.0
    return {
        job: worker_memory_at(demands[job], placement.size, margin)
        for job, placement in placements.items()
        if job in shared and job in demands and placement.size
    }


def worker_memory_at(demand: Demand, size: int, margin: float) -> int:
    """GPU memory one of `size` workers (>= the job's min) of a sharing job is counted for:
    `worker_memory` with the request taken at that size (`Demand.memory_split_bytes`: a
    bigger job's workers each hold less of its batch). A measured peak stays a floor."""
    request = request_at(demand.memory_bytes, demand.memory_split_bytes, demand.min, size)
    measured = math.ceil(demand.measured_bytes * (1.0 + margin)) if demand.measured_bytes else 0
    return max(request, measured)


def request_at(memory: int | None, split: int | None, low: int, size: int) -> int:
    """A worker's request (`memory` bytes at `low` GPUs, the job's min) at `size` >= `low`
    workers, of which `split` bytes in total are divided among the workers; 0 without one."""
    request = memory or 0
    if split and size > low:
        # Rounded up (never counted under what a worker holds), and never above the request
        # at the min: with a few bytes split (1 among 2 workers) the roundings made a bigger
        # job count more per worker, and a job that grew no longer fit the GPUs it held.
        request = min(request, request - split // low + math.ceil(split / size))
    return request


@dataclass
class GpuRoom:
    """What sharing workers use of each GPU as the packing goes."""

    capacity: int
    """Bytes per GPU; 1 when the pool's GPU memory is unknown (each worker counts 1)."""
    max_jobs: int
    known: bool
    """Whether the GPUs' memory is known (else no GPU is shared)."""
    closed: AbstractSet[Slot]
    """No sharing worker may land or stay here (held by an exclusive job, blocked)."""
    no_new: AbstractSet[Slot]
    """No worker may land here that is not on it already (being given back)."""
    used: dict[Slot, int] = field(default_factory=dict)
    jobs: dict[Slot, set[str]] = field(default_factory=dict)
    max_busy: float | None = None
    """`SharingLimits.max_utilization`."""
    busy_of: Mapping[str, float] = field(default_factory=dict)
    """Each job's GPU utilization as the cap counts it (`counted_utilization`)."""
    busy: dict[Slot, float] = field(default_factory=dict)
    draining: AbstractSet[Slot] = frozenset()
    """Of `no_new`, the GPUs being given back: they will be free."""
    counting_drains: bool = False
    """Whether a new worker may be placed on `draining` GPUs (the head of the line being
    admitted by shrinking others: its grant waits for them to drain, as `arbitrate`'s)."""

    def fits(self, slot: Slot, job: str, need: int, *, staying: bool = False) -> bool:
        if slot in self.closed or (not staying and not self.open_to_new(slot)):
            return False
        jobs = self.jobs.get(slot, set())
        return (
            job not in jobs
            and len(jobs) < self.max_jobs
            and self.used.get(slot, 0) + need <= self.capacity
            and (
                not jobs
                or within_utilization(self.busy.get(slot, 0.0), self._busy(job), self.max_busy)
            )
        )

    def open_to_new(self, slot: Slot) -> bool:
        """Whether a worker not on `slot` yet may be placed there (memory aside)."""
        return slot not in self.no_new or (self.counting_drains and slot in self.draining)

    def add(self, slot: Slot, job: str, need: int) -> None:
        self.used[slot] = self.used.get(slot, 0) + need
        self.jobs.setdefault(slot, set()).add(job)
        self.busy[slot] = self.busy.get(slot, 0.0) + self._busy(job)

    def remove(self, slot: Slot, job: str, need: int) -> bool:
        """Take `job`'s worker (counted `need` bytes) off `slot`; whether the GPU is free now
        (then it is as if no one had been on it)."""
        jobs = self.jobs[slot]
        jobs.remove(job)
        if not jobs:
            del self.jobs[slot], self.used[slot], self.busy[slot]
            return True
        self.used[slot] -= need
        self.busy[slot] -= self._busy(job)
        return False

    def copy(self) -> GpuRoom:
        """What `restore` puts back."""
        return replace(
            self,
            used=dict(self.used),
            jobs={slot: set(jobs) for slot, jobs in self.jobs.items()},
            busy=dict(self.busy),
        )

    def restore(self, saved: GpuRoom) -> None:
        """Back to `saved` (a `copy`), in place: a `Candidates` holds this object."""
        self.used, self.jobs, self.busy = saved.used, saved.jobs, saved.busy

    def _busy(self, job: str) -> float:
        return self.busy_of.get(job, 1.0)

    def crowded(self, slot: Slot, job: str) -> bool:
        """Whether `job` would take the jobs on `slot` (at least one) past `LIGHT_TOGETHER`."""
        return self.busy.get(slot, 0.0) + self._busy(job) > LIGHT_TOGETHER + 1e-9

    def fill_key(self, slot: Slot) -> tuple[bool, float, int]:
        """Best first: shared GPUs before free ones; with a utilization cap, the one left
        busiest (closest to the cap) first; then the fullest by memory."""
        busiest = -self.busy.get(slot, 0.0) if self.max_busy is not None else 0.0
        return (not self.jobs.get(slot), busiest, -self.used.get(slot, 0))


def counted_utilization(demand: Demand) -> float:
    """A job's GPU utilization as a utilization cap counts it: the measured one, or 1.0 (a
    busy job) until it is measured, so an unknown job never slows a neighbour past the cap."""
    return 1.0 if demand.utilization is None else demand.utilization


def within_utilization(on_gpu: float, joining: float, cap: float | None) -> bool:
    """Whether a job of utilization `joining` may join the jobs on a GPU whose utilizations
    sum to `on_gpu` (at least one job is there): always without a cap. A job alone on a GPU
    is never refused by the cap (it slows no one), however busy it is."""
    return cap is None or on_gpu + joining <= cap + 1e-9


@dataclass(frozen=True)
class WorkerNeeds:
    """Bytes one worker of a sharing job is counted for at a size (`worker_memory_at`), or a
    whole GPU where unknown; 1 per worker where the GPUs' memory is unknown."""

    capacity: int | None
    margin: float

    def at(self, demand: Demand, size: int) -> int:
        if self.capacity is None:
            return 1
        return worker_memory_at(demand, max(size, demand.min), self.margin) or self.capacity

    def constant(self, demand: Demand) -> bool:
        """Whether the need is the same at every size."""
        return self.capacity is None or not demand.memory_split_bytes


class Candidates:
    """Where a job's next workers go, best first: GPUs on the hosts it has (shared ones
    fullest first, then free ones), then GPUs shared elsewhere (fullest first), then free GPUs
    in pool order (`free_first_jobs`: free GPUs before any shared one). Without scanning the
    pool for each job: a first decision packing thousands of jobs onto a Perlmutter-sized
    pool did that in minutes. With `whole_first`
    (`SharingLimits.whole_first`), the shared GPUs it would crowd (`GpuRoom.crowded`) come
    after every other; with `free_first` (`SharingLimits.share_to_admit`), every shared GPU
    does."""

    def __init__(
        self, pool: Pool, gpus: GpuRoom, *, whole_first: bool, free_first: bool = False,
        free_first_jobs: AbstractSet[str] = frozenset(),
    ) -> None:  # fmt: skip
        self._gpus = gpus
        self._whole_first = whole_first
        self._free_first = free_first
        self._free_first_jobs = free_first_jobs
        self._order = {slot: position for position, slot in enumerate(pool.slots())}
        self._on_host = {host: [(host, gpu) for gpu in ids] for host, ids in pool.hosts}
        self._free = [
            slot
            for slot in pool.slots()
            if slot not in gpus.jobs
            and slot not in gpus.closed
            and (slot not in gpus.no_new or slot in gpus.draining)
        ]  # draining ones only while `counting_drains` (`GpuRoom.fits` says)
        self._free_set = set(self._free)
        self._first_free = 0

    def freed(self, slot: Slot) -> None:
        """`slot` has no job on it any more (a job shrank off it): free GPUs may be taken."""
        gpus = self._gpus
        if slot in gpus.closed or (slot in gpus.no_new and slot not in gpus.draining):
            return
        position = bisect.bisect_left(self._free, self._order[slot], key=self._order.__getitem__)
        if slot not in self._free_set:  # taken before this decision: not in the list yet
            self._free.insert(position, slot)
            self._free_set.add(slot)
        self._first_free = min(self._first_free, position)  # the search skips past taken ones

    def position(self, slot: Slot) -> int:
        """`slot`'s place in the pool's order."""
        return self._order[slot]

    def saved(self) -> tuple[list[Slot], int]:
        """What `restore` puts back."""
        return list(self._free), self._first_free

    def restore(self, saved: tuple[list[Slot], int]) -> None:
        self._free, self._first_free = list(saved[0]), saved[1]
        self._free_set = set(self._free)

    def best(
        self, job: str, mine: Sequence[Slot], need: int, count: int, opens: bool,
        *, shares: Sharing = "any",
    ) -> list[Slot]:  # fmt: skip
        """Up to `count` GPUs for `job` (holding `mine`), each with `need` bytes free;
        free GPUs only if `opens`; GPUs other jobs use: any, only those it would not crowd
        (`light`), or `none`."""
        gpus = self._gpus
        if shares == "none":
            return self._best(job, mine, need, count, opens, _nowhere)
        light = partial(_not_crowded, gpus, job)
        stages: list[Callable[[Slot], bool]]
        if self._free_first:
            stages = [_nowhere, light if shares == "light" else _anywhere]
        elif self._whole_first:
            stages = [light] if shares == "light" else [light, partial(gpus.crowded, job=job)]
        else:
            stages = [light if shares == "light" else _anywhere]
        if job in self._free_first_jobs and stages[0] is not _nowhere:
            stages.insert(0, _nowhere)
        chosen: list[Slot] = []
        for index, allowed in enumerate(stages):  # free GPUs may be opened in the first only
            if len(chosen) < count:
                held, more = [*mine, *chosen], count - len(chosen)
                chosen += self._best(job, held, need, more, opens and not index, allowed)
        return chosen

    def free_for(self, job: str, mine: Sequence[Slot], need: int) -> Slot | None:
        """A GPU no job uses for one more worker of `job` (holding `mine`, `need` bytes), on
        its own hosts first; None if there is none."""
        found = self._best(job, mine, need, 1, True, _nowhere)
        return found[0] if found else None

    def _best(
        self,
        job: str,
        mine: Sequence[Slot],
        need: int,
        count: int,
        opens: bool,
        allowed: Callable[[Slot], bool],
    ) -> list[Slot]:
        gpus = self._gpus
        hosts = {host for host, _ in mine}
        taken = set(mine)

        def usable(slot: Slot) -> bool:
            shared = bool(gpus.jobs.get(slot))
            return (
                slot not in taken
                and (opens or shared)
                and gpus.fits(slot, job, need)
                and (not shared or allowed(slot))
            )

        def fullest(slot: Slot) -> tuple[tuple[bool, float, int], int]:
            return (gpus.fill_key(slot), self._order[slot])

        local = [slot for host in sorted(hosts) for slot in self._on_host.get(host, ())]
        chosen = sorted(filter(usable, local), key=fullest)[:count]
        if len(chosen) < count:
            shared = (s for s in gpus.jobs if s[0] not in hosts and gpus.jobs[s] and usable(s))
            chosen += heapq.nsmallest(count - len(chosen), shared, key=fullest)
        if len(chosen) < count and opens:
            chosen += self._free_elsewhere(job, hosts, need, count - len(chosen))
        return chosen

    def _free_elsewhere(
        self, job: str, hosts: AbstractSet[str], need: int, count: int
    ) -> list[Slot]:
        """The first `count` GPUs no job uses, off `hosts`, in pool order."""
        gpus = self._gpus
        while self._first_free < len(self._free) and gpus.jobs.get(self._free[self._first_free]):
            self._first_free += 1  # taken since: never free again in this decision
        found: list[Slot] = []
        for slot in itertools.islice(self._free, self._first_free, None):
            if len(found) == count:
                break
            if slot[0] not in hosts and not gpus.jobs.get(slot) and gpus.fits(slot, job, need):
                found.append(slot)
        return found


@dataclass(frozen=True)
class Packing:
    """What one packing decision works on, changed in place as it goes: each job's GPUs
    (`held`), the GPUs' room (`gpus`) and the search for places (`where`); with the jobs in
    rank order, what each worker needs, and the jobs resized too recently to move now
    (`frozen`). One object, so that the steps after admission (`Shrinker`, `move_apart`)
    take it whole instead of the same six arguments each."""

    ranked: Sequence[Demand]
    held: dict[str, list[Slot]]
    needs: WorkerNeeds
    gpus: GpuRoom
    where: Candidates
    frozen: AbstractSet[str]


def _not_crowded(gpus: GpuRoom, job: str, slot: Slot) -> bool:
    return not gpus.crowded(slot, job)


def _nowhere(slot: Slot) -> bool:
    """No shared GPU is allowed: free ones only."""
    return False


def _anywhere(slot: Slot) -> bool:
    return True
