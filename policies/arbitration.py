"""Arbitration and placement: which job gets which GPUs of the pool.

`arbitrate` is a pure, deterministic function of the pool, the jobs' demands,
their current placements and the set of frozen jobs: no I/O, no clock, no
randomness.

Admitted jobs keep their min; a pending job is admitted only when its whole min
fits, in priority then arrival order, and nobody overtakes the first pending job
(head of line). GPUs left over go by priority tier, then max-min fair share
within a tier, up to each job's wanted size (desired clamped into [min, max]).
Opt-in (`spare_by_gain`): GPUs still left are lent to the admitted jobs whose next GPU
adds most by their own policy's account (`Demand.gains`), up to their max.
Opt-in (`share_by_gain`, Pollux-like): instead of the fair share up to the wishes, a tier's
GPUs left once its jobs hold their mins go one at a time to the job whose next GPU adds most
(`Demand.gains`; a job that reports no gains is taken to gain a whole GPU from each GPU up to
its wish, and nothing past it), up to its max.
Opt-in (`share_by_speedup`, Pollux's objective): those GPUs go so as to maximise the harmonic
mean of the jobs' speedups over their fair share, a running job grown only if the grow pays
its stall (`policies/power_mean.py`).
Opt-in (`smallest_first`): within a tier, pending jobs are admitted smallest min first
(arrival breaks ties) instead of in arrival order; a job named `overdue` (the caller's
starvation bound: it waited too long) goes before every other job of its tier, oldest first,
and as head of line nobody overtakes it.

Horovod restarts every worker of a job on each size change, so the caller may
freeze jobs that resized too recently. A frozen admitted job keeps exactly its
current placement: no growth, no shrink towards its desired size, no fair-share
rebalancing and no shrink to admit a pending job. Only changes it cannot avoid
still happen: GPUs that left the pool are dropped (not replaced), and a max
below its size cuts it to max from the tail. Its slots are simply unavailable
to the others. Freezing does not touch a pending job (admission is not a
resize), nor one whose surviving GPUs fall under its min (it is pending again,
as any other job would be).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from herd_operator.policies.placement import place
from herd_operator.policies.power_mean import divide_by_speedup, fair_share, gain_of_next
from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _rank(demand: Demand) -> tuple[int, float, str]:
    return (-demand.priority, demand.arrival, demand.name)


def rank_smallest_first(
    demand: Demand, overdue: AbstractSet[str]
) -> tuple[int, int, int, float, str]:
    """Overdue jobs of a tier first, oldest first; then the smallest min first. With every
    job's run time unknown and no larger with its size (as in the Perlmutter-like mix), the
    smallest gang frees its GPUs soonest in expectation: shortest expected GPU-time first."""
    if demand.name in overdue:
        return (-demand.priority, 0, 0, demand.arrival, demand.name)
    return (-demand.priority, 1, demand.min, demand.arrival, demand.name)


def _kept_slots(
    pool: Pool,
    by_name: Sequence[Demand],
    current: Mapping[str, Placement],
    blocked: AbstractSet[Slot],
) -> tuple[dict[str, int], dict[str, Sequence[Slot]]]:
    """Each demanded job's current size, and its current slots that are still in the pool
    (and not blocked: a blocked slot counts as gone, as if the pool were without it)."""
    in_pool = pool.slot_set
    seen: set[Slot] = set()
    held: dict[str, int] = {}
    kept: dict[str, Sequence[Slot]] = {}
    for demand in by_name:
        slots = current.get(demand.name, Placement.EMPTY).slots()
        # Set operations in C rather than a test per slot: most jobs lost nothing.
        seen.update(slots)
        held[demand.name] = len(slots)
        if in_pool.issuperset(slots) and (not blocked or blocked.isdisjoint(slots)):
            kept[demand.name] = slots
        else:
            kept[demand.name] = [
                slot for slot in slots if slot in in_pool and (not blocked or slot not in blocked)
            ]
    if len(seen) != sum(held.values()):
        _refuse_shared_gpus(by_name, current)
    return held, kept


def _refuse_shared_gpus(by_name: Sequence[Demand], current: Mapping[str, Placement]) -> None:
    """Name the first GPU found in two current placements (only called when one is)."""
    owner: dict[Slot, str] = {}
    for demand in by_name:
        for slot in current.get(demand.name, Placement.EMPTY).slots():
            other = owner.setdefault(slot, demand.name)
            if other != demand.name:
                raise ValueError(
                    f"GPU {slot[0]}:{slot[1]} is in the current placements of both "
                    f"{other} and {demand.name}"
                )


@dataclass
class _Counts:
    """Outcome of the counting phase, before any slot is chosen."""

    target: dict[str, int]
    waiting: dict[str, str]
    admissions: list[Demand]
    held_fixed: set[str]
    shared_by_gain: bool = False
    by_speedup: bool = False


_NAMED_FROZEN = 3


def _frozen_note(
    pending: Demand, free: int, fixed: Sequence[Demand], target: Mapping[str, int]
) -> str:
    """Why `pending` waits on frozen jobs, if it would fit without their freeze; else ''."""
    locked: list[str] = []
    total = 0
    for demand in fixed:
        # Without the freeze a same-or-lower tier job would be at its min when `pending`
        # is considered; a higher tier one would hold at most what it wants.
        floor = demand.min if demand.priority <= pending.priority else demand.wanted
        extra = target[demand.name] - floor
        if extra > 0:
            locked.append(demand.name)
            total += extra
    if not locked or pending.min > free + total:
        return ""
    names = ", ".join(locked[:_NAMED_FROZEN])
    more = len(locked) - _NAMED_FROZEN
    return f" ({names}{f' and {more} more' if more > 0 else ''} resized recently)"


@dataclass
class _Tally:
    """The counting phase's state as it goes through the tiers."""

    target: dict[str, int]
    free: int
    waiting: dict[str, str]
    admissions: list[Demand]
    blocker: Demand | None = None
    """The first pending job that did not fit: nobody overtakes it (head of line)."""


def _count(
    size: int,
    ranked: Sequence[Demand],
    kept: Mapping[str, int],
    frozen: AbstractSet[str],
    spare_by_gain: bool = False,
    share_by_gain: bool = False,
    share_by_speedup: bool = False,
) -> _Counts:
    """How many GPUs each job gets (`_Counts.target`) out of `size`, each job keeping
    `kept[name]` of the GPUs it holds; where they are is `place`'s."""
    running = {d.name for d in ranked if kept[d.name] >= d.min}
    fixed = [d for d in ranked if d.name in running and d.name in frozen]
    target: dict[str, int] = {d.name: min(kept[d.name], d.max) for d in fixed}
    held_fixed = set(target)
    free = size - sum(
        target[d.name] if d.name in held_fixed else d.min for d in ranked if d.name in running
    )
    tally = _Tally(target, free, {}, [])
    fair = fair_share(size, len(ranked)) if share_by_speedup else 0
    for _, tier_iter in itertools.groupby(ranked, key=lambda d: d.priority):
        tier = list(tier_iter)
        _admit_tier(tier, tally, running, held_fixed, fixed)
        if tally.free > 0 and share_by_speedup:
            tally.free = _divide_by_speedup(tier, target, held_fixed, tally.free, kept, fair)
        elif tally.free > 0:
            tally.free = _divide_tier(tier, target, held_fixed, tally.free, share_by_gain)
    by_gain = share_by_gain or share_by_speedup
    if spare_by_gain and not by_gain and tally.free > 0:
        _share_spare_by_gain(ranked, target, held_fixed, tally.free)
    return _Counts(target, tally.waiting, tally.admissions, held_fixed, by_gain, share_by_speedup)


def _divide_by_speedup(
    tier: Sequence[Demand],
    target: dict[str, int],
    held_fixed: AbstractSet[str],
    free: int,
    kept: Mapping[str, int],
    fair: int,
) -> int:
    """`free` GPUs among the tier's admitted, unfrozen jobs (each at its min now) by the
    harmonic mean of their speedups (`power_mean.divide_by_speedup`); returns the GPUs left."""
    jobs = [d for d in tier if target[d.name] > 0 and d.name not in held_fixed]
    held = {d.name: kept[d.name] for d in jobs}
    sizes, left = divide_by_speedup(jobs, {d.name: target[d.name] for d in jobs}, held, free, fair)
    target.update(sizes)
    return left


def _divide_tier(
    tier: Sequence[Demand],
    target: dict[str, int],
    held_fixed: AbstractSet[str],
    free: int,
    share_by_gain: bool,
) -> int:
    """The `free` GPUs among a tier's admitted jobs above their mins: by gain, or by
    max-min fair share up to their wishes. Returns the GPUs left."""
    if share_by_gain:
        return _share_by_gain(tier, target, held_fixed, free)
    sharers = [d for d in tier if 0 < target[d.name] < d.wanted and d.name not in held_fixed]
    return _fair_share(sharers, target, free) if sharers else free


def _admit_tier(
    tier: Sequence[Demand],
    tally: _Tally,
    running: AbstractSet[str],
    held_fixed: AbstractSet[str],
    fixed: Sequence[Demand],
) -> None:
    """One priority tier: running jobs at their min, pending ones admitted in order while
    their whole min fits, and none past the first that does not (it blocks the line)."""
    for demand in tier:
        if demand.name in held_fixed:
            continue
        if demand.name in running:
            tally.target[demand.name] = demand.min
        elif tally.blocker is not None:
            tally.target[demand.name] = 0
            blocker = tally.blocker
            tally.waiting[demand.name] = (
                f"waiting behind {blocker.name} (priority {blocker.priority})"
            )
        elif demand.min <= tally.free:
            tally.target[demand.name] = demand.min
            tally.free -= demand.min
            tally.admissions.append(demand)
        else:
            tally.target[demand.name] = 0
            note = _frozen_note(demand, tally.free, fixed, tally.target)
            tally.waiting[demand.name] = f"needs {_gpus(demand.min)}, {tally.free} free{note}"
            tally.blocker = demand


def _share_spare_by_gain(
    ranked: Sequence[Demand], target: dict[str, int], fixed: AbstractSet[str], free: int
) -> None:
    """GPUs nobody wants, one at a time to the admitted job whose next GPU adds most (its
    `gains`), up to its max; a higher priority tier first, ties by arrival then name.

    Greedy by marginal gain maximises the total gain when each job's gains do not rise
    with its size (Amdahl's do not)."""
    heap: list[tuple[int, float, float, str, int]] = []
    by_name: dict[str, Demand] = {}
    for d in ranked:
        size = target[d.name]
        above = size - d.min
        if size >= d.wanted and d.name not in fixed and 0 <= above < len(d.gains):
            heap.append((-d.priority, -d.gains[above], d.arrival, d.name, size))
            by_name[d.name] = d
    heapq.heapify(heap)
    while free > 0 and heap:
        _, _, arrival, name, size = heapq.heappop(heap)
        demand = by_name[name]
        target[name] = size + 1
        free -= 1
        above = size + 1 - demand.min
        if above < len(demand.gains):
            gain = demand.gains[above]
            heapq.heappush(heap, (-demand.priority, -gain, arrival, name, size + 1))


def _share_by_gain(
    tier: Sequence[Demand], target: dict[str, int], fixed: AbstractSet[str], free: int
) -> int:
    """`free` GPUs among the tier's admitted, unfrozen jobs (each at its min now), one at a
    time to the job whose next GPU adds most (`gain_of_next`), up to its max; ties to the
    job holding fewest, then by arrival and name, as the fair share's: so jobs that report no
    gains get exactly the fair share up to their wishes. Updates `target`; returns the GPUs
    left.

    Greedy by marginal gain maximises the tier's summed speedup when each job's gains do not
    rise with its size (Amdahl's do not): Pollux's division of a cluster, with its
    statistical efficiency taken as 1 (the batch-preserving modes keep the global batch)."""
    heap: list[tuple[float, int, float, str]] = []
    by_name: dict[str, Demand] = {}
    for d in tier:
        size = target[d.name]
        if size > 0 and d.name not in fixed:
            gain = gain_of_next(d, size)
            if gain is not None:
                heap.append((-gain, size, d.arrival, d.name))
                by_name[d.name] = d
    heapq.heapify(heap)
    while free > 0 and heap:
        _, size, arrival, name = heapq.heappop(heap)
        demand = by_name[name]
        size += 1
        target[name] = size
        free -= 1
        gain = gain_of_next(demand, size)
        if gain is not None:
            heapq.heappush(heap, (-gain, size, arrival, name))
    return free


def _fair_share(sharers: Sequence[Demand], target: dict[str, int], free: int) -> int:
    """Max-min fair share of `free` GPUs among `sharers`, each up to what it wants: the
    result of handing out one GPU at a time to the smallest holder (ties: earliest arrival,
    then name), computed by levels so that it costs the jobs, not the GPUs handed out.
    Updates `target`; returns the GPUs left."""
    start = {d.name: target[d.name] for d in sharers}
    bounds = [(start[d.name], d.wanted) for d in sharers]

    def cost(level: int) -> int:
        return sum(
            (wanted if wanted < level else level) - held for held, wanted in bounds if held < level
        )

    top = max(wanted for _, wanted in bounds)
    if cost(top) <= free:
        for d in sharers:
            target[d.name] = d.wanted
        return free - cost(top)
    # The highest level everyone below it can be raised to: cost(low) <= free < cost(high).
    low, high = min(start.values()), top
    while high - low > 1:
        middle = (low + high) // 2
        if cost(middle) <= free:
            low = middle
        else:
            high = middle
    left = free - cost(low)
    at_level: list[Demand] = []
    for d in sharers:
        size = max(start[d.name], min(d.wanted, low))
        target[d.name] = size
        if size == low < d.wanted:
            at_level.append(d)
    # Fewer GPUs left than jobs at the level (cost(low + 1) > free): the first ones get one.
    at_level.sort(key=lambda d: (d.arrival, d.name))
    for d in at_level[:left]:
        target[d.name] = low + 1
    return 0


def _policy_cause(
    demand: Demand, size: int, shared_by_gain: bool = False, how: str = "gain"
) -> str:
    wanted = demand.wanted
    if demand.desired > demand.max:
        wants = f"policy wants {demand.desired}, max is {demand.max}"
    elif demand.desired < demand.min:
        wants = f"policy wants {demand.desired}, min is {demand.min}"
    else:
        wants = f"policy wants {wanted}"
    if shared_by_gain and size != wanted:
        more = f"{_gpus(size - wanted)} more" if size > wanted else f"{_gpus(wanted - size)} fewer"
        return f"{wants}, {more}: GPUs divided by {how}"
    if size > wanted:
        return f"{wants}, {_gpus(size - wanted)} more lent by gain (nobody else wants them)"
    return wants if size >= wanted else f"{wants}, no more free"


class _Reasons:
    """Writes the human-readable reason of each grant."""

    def __init__(
        self,
        ranked: Sequence[Demand],
        held: Mapping[str, int],
        kept: Mapping[str, Sequence[Slot]],
        counts: _Counts,
    ) -> None:
        self._held = held
        self._kept = kept
        self._counts = counts
        # Ranked by priority, so the first gainer is the one with the most claim.
        self._gainer = next((d for d in ranked if counts.target[d.name] > len(kept[d.name])), None)

    def reason(self, demand: Demand) -> str:
        name = demand.name
        old = self._held[name]
        kept = len(self._kept[name])
        new = self._counts.target[name]
        lost = old - kept
        if kept < demand.min:
            if old == 0:
                history = ""
            elif lost:
                history = f"{_gpus(lost)} left the pool ({kept} left, min {demand.min})"
            else:
                history = f"holds {old}, under min {demand.min}"
            if new == 0:
                wait = self._counts.waiting[name]
                return f"pending {old} -> 0: {history}; {wait}" if old else f"pending: {wait}"
            extra = "" if new == demand.min else f", {self._cause(demand, new)}"
            if old == 0:
                if extra:
                    return f"admitted 0 -> {new}: min {demand.min} fits{extra}"
                return f"admitted: min {demand.min} fits"
            return f"re-admitted {old} -> {new}: {history}; min {demand.min} fits{extra}"
        if name in self._counts.held_fixed:
            if new == old:
                return f"holding {new}: resized recently"
            causes = [f"{_gpus(lost)} left the pool"] if lost else []
            if new < kept:
                causes.append(f"max is {demand.max}")
            return f"shrunk {old} -> {new}: {'; '.join(causes)}"
        if new == old:
            replaced = f"{_gpus(lost)} left the pool, replaced; " if lost else ""
            return f"holding {new}: {replaced}{self._cause(demand, new)}"
        if new > old:
            return f"grown {old} -> {new}: {self._cause(demand, new)}"
        if new == kept:
            return f"shrunk {old} -> {new}: {_gpus(lost)} left the pool"
        if new > kept:
            cause = self._cause(demand, new)
            return f"shrunk {old} -> {new}: {_gpus(lost)} left the pool; {cause}"
        if new == demand.wanted:
            if demand.desired > demand.max:
                return f"shrunk {old} -> {new}: max is {demand.max}"
            return f"shrunk {old} -> {new}: {self._cause(demand, new)}"
        return f"shrunk {old} -> {new}: {self._taker(demand)}"

    def _cause(self, demand: Demand, size: int) -> str:
        how = "speedup" if self._counts.by_speedup else "gain"
        return _policy_cause(demand, size, self._counts.shared_by_gain, how)

    def _taker(self, demand: Demand) -> str:
        admissions = self._counts.admissions
        if admissions and admissions[0].priority >= demand.priority:
            return f"admitting {admissions[0].name} (min {admissions[0].min})"
        gainer = self._gainer
        if gainer is None or gainer.priority < demand.priority:
            return "fewer GPUs in the pool"
        if gainer.priority == demand.priority:
            if self._counts.shared_by_gain:
                how = "speedup" if self._counts.by_speedup else "gain"
                return f"divided by {how} with {gainer.name}"
            return f"fair share with {gainer.name}"
        return f"{gainer.name} (priority {gainer.priority}) grew"


def ranked_demands(
    demands: Sequence[Demand],
    order: Mapping[str, tuple[float, ...]] | None = None,
    smallest_first: bool = False,
    overdue: AbstractSet[str] = frozenset(),
) -> list[Demand]:
    """The demands in the order a decision serves them (`arbitrate`'s `order`,
    `smallest_first` and `overdue`): priority first, then the queue's order, smallest first,
    or arrival."""
    if order is not None:
        return sorted(demands, key=lambda d: (-d.priority, order[d.name], d.arrival, d.name))
    if smallest_first:
        return sorted(demands, key=lambda d: rank_smallest_first(d, overdue))
    return sorted(demands, key=_rank)


def divided_sizes(
    gpus: int,
    ranked: Sequence[Demand],
    held: Mapping[str, int],
    *,
    frozen: AbstractSet[str] = frozenset(),
    spare_by_gain: bool = False,
    share_by_gain: bool = False,
    share_by_speedup: bool = False,
) -> dict[str, int]:
    """How many whole GPUs `arbitrate` would give each job (in `ranked` order, each holding
    `held[name]` GPUs now, 0 when absent) out of `gpus`, with the same options; 0 for a job
    it would leave waiting. Counts only, no placement: what a packing that shares GPUs takes
    as each job's size when it follows the division (`SharingLimits.share_when_waiting`)."""
    kept = {d.name: min(held.get(d.name, 0), d.max) for d in ranked}
    counts = _count(
        gpus, ranked, kept, frozen, spare_by_gain, share_by_gain, share_by_speedup
    )  # fmt: skip
    return dict(counts.target)


def arbitrate(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    *,
    frozen: AbstractSet[str] = frozenset(),
    unavailable: AbstractSet[Slot] = frozenset(),
    spare_by_gain: bool = False,
    previous: Mapping[str, Grant] | None = None,
    smallest_first: bool = False,
    overdue: AbstractSet[str] = frozenset(),
    share_by_gain: bool = False,
    draining: AbstractSet[Slot] = frozenset(),
    order: Mapping[str, tuple[float, ...]] | None = None,
    share_by_speedup: bool = False,
) -> dict[str, Grant]:
    """Decide every job's GPUs; returns one Grant per demand, in priority/arrival order.

    Jobs in `current` without a demand are dropped and their GPUs are free.
    `frozen` names jobs that resized too recently (see the module docstring); names
    without a demand are ignored. `unavailable` GPUs (draining, held by an adopted job)
    are granted to nobody: the decision is the one on the pool without them, without
    building that pool. With `spare_by_gain`, GPUs left once every job has what it wants
    go to admitted jobs by the gain they report for their next GPU (`Demand.gains`),
    up to their max. With `share_by_gain`, all GPUs above the admitted jobs' mins are divided
    that way within each tier (`_share_by_gain`), not by fair share up to the wishes; it
    includes what `spare_by_gain` does. A job that holds GPUs and whose placement is the one
    of its grant in `previous` gets that Grant back as it is, reason included (the allocator
    keeps the reason of the decision that made a grant; writing thousands of unchanged ones
    again cost a fifth of a decision). With `smallest_first`, jobs are ranked within a tier by
    `rank_smallest_first` (`overdue`: names of pending jobs that waited past the caller's
    bound); without it `overdue` is ignored and the order is arrival's. `draining` GPUs are
    being given back by a job whose workers may still be on them: they count as the pool's
    for admission and shares (they will be free), but are placed only where no other GPU is
    free, so that the caller, which holds them back until they drained, holds back as few
    as it must. `order` (a queue's, `policies/queueing.py`): the order within a tier, instead
    of arrival's or `smallest_first`'s (arrival breaks its ties). With `share_by_speedup`, the
    GPUs above the mins are divided by the harmonic mean of speedups instead (`power_mean.py`;
    it includes `share_by_gain` and `spare_by_gain`).
    Raises ValueError if two demands share a name or two current placements share a GPU.
    """
    by_name = sorted(demands, key=lambda d: d.name)
    for first, second in itertools.pairwise(by_name):
        if first.name == second.name:
            raise ValueError(f"two demands are named {first.name}")
    ranked = ranked_demands(demands, order, smallest_first, overdue)
    in_pool = pool.slot_set
    blocked = {slot for slot in unavailable if slot in in_pool}
    held, kept = _kept_slots(pool, by_name, current, blocked)
    counts = _count(
        pool.size - len(blocked), ranked, {job: len(slots) for job, slots in kept.items()},
        frozen, spare_by_gain, share_by_gain, share_by_speedup,
    )  # fmt: skip
    late = {slot for slot in draining if slot in in_pool and slot not in blocked}
    placements = place(pool, ranked, current, kept, counts.target, blocked, late)
    reasons = _Reasons(ranked, held, kept, counts)
    grants: dict[str, Grant] = {}
    before = previous or {}
    for d in ranked:
        placement = placements.get(d.name, Placement.EMPTY)
        earlier = before.get(d.name)
        if earlier is not None and placement.size and earlier.placement == placement:
            grants[d.name] = earlier
        else:
            grants[d.name] = Grant(placement, reasons.reason(d))
    return grants
