"""What to do about a sharing job whose worker's measured memory nears its share: count it by
what it uses, and move that worker off a GPU where it no longer fits beside its neighbours,
or shrink the job by it, before it can take the memory they were counted for.

Pure, like `sharing.py` (whose counting it uses: `worker_memory`): no I/O, no clock. Apart
from it because `pack` places jobs by what their demands say at a decision, while this looks
at what each worker uses now, between decisions (every sampling round), and picks the job
that grew to move, not whichever the arbitration's order reaches last.

The rules (`guard_sharing`):

- A worker is near its share when its readable bytes are above `near_ratio` of what its job is
  counted for per worker (`worker_memory_at`: the larger of the request at the size it runs
  at and the measured peak times 1 + margin). Workers whose use is unknown say nothing; jobs
  counted as whole GPUs (nothing requested or measured yet) have no share to near.
- A job with a worker near its share is counted from now by its measured memory raised to
  the most one of its workers uses (`measured`). Where that fits on each of its GPUs beside
  the others there, nothing else changes.
- A worker that no longer fits is moved to a GPU where it does (on its host first, then the
  GPU with the most room, then pool order): never one that is `closed` (a non-sharing job's),
  `no_new` (draining, held, on a doubted host), at the cap of jobs, or holding another worker
  of the job. Where none has room, the job shrinks by that worker, never below its min.
- A job keeps at least one worker where it is: Elastic Horovod hands the training state to
  new workers from one that stays (with none left it gives up the job), so a job whose every
  worker would have to go, and one whose min cannot fit, is not moved: it stays as it is,
  counted as before (`stuck`), and the worker's memory limit is what protects its neighbours.
- Jobs are taken worst first (highest use over share); the GPUs are never over-committed
  by the result if they were not before, and jobs without a worker near their share, and
  every job that does not share, are not touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from herd_operator.policies.sharing_room import request_at
from herd_operator.policies.sharing_text import format_bytes
from herd_operator.specs.values import Placement, Slot

NEAR_SHARE_RATIO = 0.9
"""A worker above this share of its memory share is near it (acted on before an OOM)."""

GuardKind = Literal["moved", "shrunk", "stuck"]

CleanChange = Callable[[str, Placement, Placement], bool]
"""(job, before, after): whether the job's engine sees that change as it is (each GPU left
stops its worker, each GPU kept keeps its); the allocator's `BindingTracker.moves_cleanly`."""


def any_change(job: str, before: Placement, after: Placement) -> bool:
    return True


EVENT_REASONS: Mapping[GuardKind, str] = {
    "moved": "MovedForMemory",
    "shrunk": "ShrunkForMemory",
    "stuck": "MemoryNotMovable",
}
"""The event each kind of action is said with."""


@dataclass(frozen=True)
class Sharer:
    """One sharing job as the guard sees it."""

    name: str
    placement: Placement
    min: int
    memory_bytes: int | None
    """Its request per worker at its min (`spec.gpus.memory`)."""
    measured_bytes: int | None
    """The measured peak per worker it is counted by now (`Demand.measured_bytes`)."""
    used: Mapping[Slot, int] = field(default_factory=dict)
    """What its worker on each GPU uses now (GPUs whose reading is unknown left out)."""
    memory_split_bytes: int | None = None
    """Of its request, what its workers split (`spec.gpus.memorySplit`)."""

    def share(self, margin: float, measured: int | None = None) -> int:
        """Bytes one worker is counted for at the size it runs at (`sharing.worker_memory_at`),
        by `measured` if given."""
        peak = self.measured_bytes if measured is None else measured
        counted = math.ceil(peak * (1.0 + margin)) if peak else 0
        size = self.placement.size
        return max(request_at(self.memory_bytes, self.memory_split_bytes, self.min, size), counted)


@dataclass(frozen=True)
class GuardAction:
    """What the guard does to one worker of a job near its share."""

    job: str
    kind: GuardKind
    gpu: Slot
    """The worker's GPU."""
    to: Slot | None
    """Where it goes (a move)."""
    used_bytes: int
    """The most one worker of the job uses (what the job is counted by from now)."""
    share_bytes: int
    """What one worker was counted for."""
    need_bytes: int
    """What one worker is counted for from now (a stuck job: still `share_bytes`)."""
    placement: Placement
    """The job's placement after."""
    why: str = ""

    @property
    def reason(self) -> str:
        return EVENT_REASONS[self.kind]

    @property
    def message(self) -> str:
        host, gpu = self.gpu
        grew = (
            f"a worker of {self.job} uses {format_bytes(self.used_bytes)} of its"
            f" {format_bytes(self.share_bytes)} share: its worker on {host} GPU {gpu}"
        )
        if self.kind == "moved":
            assert self.to is not None
            return (
                f"{grew} moved to {self.to[0]} GPU {self.to[1]}, counted for"
                f" {format_bytes(self.need_bytes)} (its neighbours' memory no longer fits it)"
            )
        if self.kind == "shrunk":
            return (
                f"{grew} given up, the job shrunk to {self.placement.size} GPU(s): no GPU has"
                f" {format_bytes(self.need_bytes)} free"
            )
        return f"{grew} not moved ({self.why}); its memory limit protects its neighbours"


@dataclass(frozen=True)
class GuardDecision:
    measured: dict[str, int]
    """Each job with a worker near its share (and not stuck) -> the measured bytes per worker
    to count it by from now."""
    actions: tuple[GuardAction, ...]
    placements: dict[str, Placement]
    """Every sharer's placement after (those not acted on: as they were)."""

    def jobs_changed(self) -> list[str]:
        """The jobs whose placement the guard changed, in the order it decided them."""
        return list(dict.fromkeys(a.job for a in self.actions if a.kind in ("moved", "shrunk")))


@dataclass
class _Room:
    capacity: int
    max_jobs: int
    used: dict[Slot, int] = field(default_factory=dict)
    jobs: dict[Slot, set[str]] = field(default_factory=dict)

    def add(self, slot: Slot, job: str, need: int) -> None:
        self.used[slot] = self.used.get(slot, 0) + need
        self.jobs.setdefault(slot, set()).add(job)

    def remove(self, slot: Slot, job: str, need: int) -> None:
        self.used[slot] -= need
        self.jobs[slot].discard(job)

    def fits(self, slot: Slot, job: str, need: int) -> bool:
        jobs = self.jobs.get(slot, set())
        return (
            job not in jobs
            and len(jobs) < self.max_jobs
            and self.used.get(slot, 0) + need <= self.capacity
        )


def near_ratio_of(sharer: Sharer, margin: float) -> float:
    """The highest use over share among the job's workers (0 without a share or a reading)."""
    share = sharer.share(margin)
    if share <= 0:
        return 0.0
    mine = set(sharer.placement.slots())
    return max((used / share for slot, used in sharer.used.items() if slot in mine), default=0.0)


def guard_sharing(
    pool_slots: Sequence[Slot],
    sharers: Sequence[Sharer],
    *,
    capacity: int,
    max_jobs_per_gpu: int,
    margin: float,
    closed: AbstractSet[Slot] = frozenset(),
    no_new: AbstractSet[Slot] = frozenset(),
    near_ratio: float = NEAR_SHARE_RATIO,
    clean: CleanChange = any_change,
) -> GuardDecision:
    """The guard's decision (see the module docstring) over the sharing jobs `sharers` on
    GPUs of `capacity` bytes each, `pool_slots` in pool order. A move or shrink `clean` says
    the job's engine would not see as it is is not made (another target, or stuck)."""
    if not 0 < near_ratio <= 1:
        raise ValueError(f"near_ratio must be in (0, 1], got {near_ratio}")
    room = _Room(capacity, max_jobs_per_gpu)
    shares = {s.name: s.share(margin) for s in sharers}
    for s in sharers:
        for slot in s.placement.slots():
            room.add(slot, s.name, shares[s.name] or capacity)  # unmeasured: a whole GPU
    ratios = {s.name: near_ratio_of(s, margin) for s in sharers}
    near = sorted(
        (s for s in sharers if ratios[s.name] > near_ratio), key=lambda s: (-ratios[s.name], s.name)
    )
    order = {slot: position for position, slot in enumerate(pool_slots)}
    placements = {s.name: s.placement for s in sharers}
    measured: dict[str, int] = {}
    actions: list[GuardAction] = []
    for s in near:
        found = _guard_one(s, shares[s.name], margin, room, order, closed, no_new, clean)
        placements[s.name] = found[0].placement if found else s.placement
        if not found or found[0].kind != "stuck":
            mine = set(s.placement.slots())
            most = max(used for slot, used in s.used.items() if slot in mine)
            measured[s.name] = max(s.measured_bytes or 0, most)
        actions += found
    return GuardDecision(measured, tuple(actions), placements)


def _guard_one(
    s: Sharer,
    share: int,
    margin: float,
    room: _Room,
    order: Mapping[Slot, int],
    closed: AbstractSet[Slot],
    no_new: AbstractSet[Slot],
    clean: CleanChange,
) -> list[GuardAction]:
    """Count `s` by its raised need in `room`, moving or dropping the workers that no longer
    fit; its actions (none when it fits where it is). Leaves `room` counting its result."""
    slots = list(s.placement.slots())
    most = max(used for slot, used in s.used.items() if slot in set(slots))
    need = s.share(margin, max(s.measured_bytes or 0, most))
    for slot in slots:
        room.remove(slot, s.name, share)
    staying = [slot for slot in slots if room.fits(slot, s.name, need)]
    leaving = [slot for slot in slots if slot not in staying]
    if not leaving:
        for slot in slots:
            room.add(slot, s.name, need)
        return []
    if not staying:
        why = "none of its workers could stay where it is"
        return _stuck(s, share, most, room, leaving[0], why)
    for slot in staying:
        room.add(slot, s.name, need)
    kept = list(staying)
    moves = {
        slot: _move(s, slot, need, room, order, closed, no_new, clean, kept) for slot in leaving
    }
    new = _in_order(s, kept, order)
    why = ""
    if len(kept) < s.min:
        why = f"its min of {s.min} GPU(s) does not fit with it"
    elif not clean(s.name, s.placement, new):
        why = "its engine would not see the change (a worker would stay on the GPU it leaves)"
    if why:
        for slot in kept:
            room.remove(slot, s.name, need)
        return _stuck(s, share, most, room, leaving[0], why)
    kinds: dict[bool, GuardKind] = {True: "moved", False: "shrunk"}
    return [
        GuardAction(s.name, kinds[to is not None], slot, to, most, share, need, new)
        for slot, to in moves.items()
    ]


def _move(
    s: Sharer,
    slot: Slot,
    need: int,
    room: _Room,
    order: Mapping[Slot, int],
    closed: AbstractSet[Slot],
    no_new: AbstractSet[Slot],
    clean: CleanChange,
    kept: list[Slot],
) -> Slot | None:
    """Where the worker leaving `slot` goes (counted in `room`, added to `kept`): the best
    target whose change `clean` says its engine sees; None: nowhere."""
    mine = set(s.placement.slots())
    targets = _targets(s.name, slot, need, room, order, closed, no_new, mine)
    seen = (t for t in targets if clean(s.name, s.placement, _in_order(s, [*kept, t], order)))
    target = next(seen, None)
    if target is not None:
        room.add(target, s.name, need)
        kept.append(target)
    return target


def _stuck(
    s: Sharer, share: int, most: int, room: _Room, slot: Slot, why: str
) -> list[GuardAction]:
    for mine in s.placement.slots():
        room.add(mine, s.name, share)
    return [GuardAction(s.name, "stuck", slot, None, most, share, share, s.placement, why)]


def _targets(
    job: str,
    leaving: Slot,
    need: int,
    room: _Room,
    order: Mapping[Slot, int],
    closed: AbstractSet[Slot],
    no_new: AbstractSet[Slot],
    mine: AbstractSet[Slot],
) -> list[Slot]:
    """The GPUs a worker leaving `leaving` may go to, best first: on its host first, then the
    most room, then pool order."""
    candidates = [
        slot
        for slot in order
        if slot not in mine
        and slot not in closed
        and slot not in no_new
        and room.fits(slot, job, need)
    ]
    return sorted(
        candidates,
        key=lambda slot: (slot[0] != leaving[0], room.used.get(slot, 0), order[slot]),
    )


def _in_order(s: Sharer, kept: Sequence[Slot], order: Mapping[Slot, int]) -> Placement:
    """The job's placement after, holding `kept`: the GPUs it had in their order, then the new
    ones in pool order, grouped by host in the order hosts first appear."""
    have = set(kept)
    slots = [slot for slot in s.placement.slots() if slot in have]
    before = set(s.placement.slots())
    slots += sorted((slot for slot in kept if slot not in before), key=order.__getitem__)
    hosts: dict[str, list[int]] = {}
    for host, gpu in slots:
        hosts.setdefault(host, []).append(gpu)
    return Placement(tuple((host, tuple(gpus)) for host, gpus in hosts.items()))
