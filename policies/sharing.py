"""GPU sharing by memory: the jobs that opt in (`Demand.share`) packed onto GPUs by the memory
one worker needs, beside the whole-GPU arbitration of the others.

Pure, like `arbitration.py` (which it calls for the jobs that do not share): no I/O, no
clock. Apart from it because the counting there is about whole GPUs; here a GPU is a
capacity (`Pool.gpu_memory_bytes`) that several jobs' workers fill.

The rules, in the order a decision applies them:

- Jobs that do not share are arbitrated exactly as without sharing, on the pool less the
  GPUs that sharing jobs hold now. With no sharing demand, `arbitrate_sharing` is
  `arbitrate`.
- A sharing worker never lands on a GPU a non-sharing job holds, is blocked (draining past
  its deadline, cordoned, held for an adopted job) or is being given back; the memory of the
  workers on a GPU never exceeds the GPU's; at most `max_jobs_per_gpu` jobs share one GPU;
  a job never has two workers on one GPU (Horovod and torchrun give each rank its own);
  with `max_utilization`, the summed GPU utilization of the jobs on a GPU never passes it
  (a job not measured yet counts as a busy one, 1.0), which bounds how much they slow each
  other, and a worker goes to the shared GPU it fills closest to the cap first (a lightly
  used job beside a busy one, leaving room for the middling ones); with `whole_first`, a
  free GPU comes before a shared one the job would take past a summed utilization of 1.0.
- A sharing job's memory per worker is the larger of its request (`memory_bytes`) and its
  measured peak (`measured_bytes`) times `1 + margin`; with neither, or with no known GPU
  memory in the pool, a worker takes a whole GPU (still never beside an exclusive job).
- Sharing jobs, in priority then arrival order, first keep the GPUs they hold where they
  still fit (a measured peak that grew can push a worker out: it is placed again, or the job
  shrinks, or it is pending again under its min); frozen jobs (resized recently) keep theirs
  untouched where they fit. Then each grows to what it wants, up to its max of `wanted`:
  onto GPUs already shared first (fullest first: packs tighter, leaves whole GPUs whole),
  then onto free GPUs. A pending job is admitted only when its whole min fits.
  With `admit_first`, the pending jobs are admitted at their min before any job grows
  (`arbitrate`'s order: mins first), and growth repeats with admission until neither
  changes (a job that grows needs less per worker and may leave room for a pending one).
- Free GPUs go to exclusive jobs first: a sharing job opens a free GPU only when no
  exclusive job of its priority or higher is pending (unless `backfill`: then it may open
  the GPUs the exclusive arbitration left free), and no sharing job before it was
  left pending (head of line). Packing onto GPUs already shared takes no GPU from anyone,
  so it goes on past a pending job. Without `shrink_to_admit` a sharing job is never shrunk
  to admit an exclusive one: its GPUs go back as sharing jobs end, and none opens a new one
  meanwhile.
- With `shrink_to_admit`, pending jobs are admitted at their min first (in rank order,
  across tiers), then the head of the line (the first pending sharing job that may open a
  GPU and did not fit) may take workers of running sharing jobs of its priority or lower
  above their min (`sharing_shrink.py`) and is admitted if its whole min then fits; then
  the running jobs grow; all again until nothing changes. Nobody is shrunk for a job that
  is not admitted. Unlike `arbitrate`, a lower tier's pending job may be admitted at its
  min before a higher tier's running job grows. And while an exclusive job waits, whole
  GPUs may be freed for it from sharing jobs of its priority or lower above their min
  (`sharing_whole.py`: the decision made again with those GPUs free, kept only if it is
  admitted there and no sharing job loses more than those GPUs).
- With `share_to_admit`, a worker goes onto a GPU another job uses only to admit its job,
  after every free GPU it may open, and a running job grows onto free GPUs only. With
  `light_growth`, a running job grows onto a shared GPU only where it leaves the jobs there
  within `LIGHT_TOGETHER` (1.0): only admission crowds a GPU. With `move_apart` (and
  `shrink_to_admit`), after admission and before growth the running jobs' workers on crowded
  GPUs move to free ones (`sharing_apart.py`), unless the free GPUs are kept for a waiting job.
  With `share_when_waiting`, each sharing job wants its size in `arbitrate`'s division of the
  GPUs left to the sharers, or its min where it is left waiting (`sharing_division.py`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial

from herd_operator.policies.arbitration import arbitrate, ranked_demands
from herd_operator.policies.sharing_apart import move_apart
from herd_operator.policies.sharing_division import (
    ARRIVAL_FAIR_SHARE,
    DivisionOptions,
    follow_division,
)
from herd_operator.policies.sharing_room import Candidates, GpuRoom, Packing, Sharing, WorkerNeeds
from herd_operator.policies.sharing_room import counted_utilization as counted_utilization
from herd_operator.policies.sharing_room import within_utilization as within_utilization
from herd_operator.policies.sharing_room import worker_memory as worker_memory
from herd_operator.policies.sharing_room import worker_memory_at as worker_memory_at
from herd_operator.policies.sharing_shrink import Shrinker
from herd_operator.policies.sharing_text import format_bytes, pending_reason, placed_reason
from herd_operator.policies.sharing_whole import shrink_for_whole
from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot

DEFAULT_MAX_JOBS_PER_GPU = 4
"""Sharing jobs on one GPU at most: each adds a CUDA context (about 300-500 MiB) and
contends for the GPU's compute; past a few, the slowdown outweighs the memory saved."""
DEFAULT_MEMORY_MARGIN = 0.10
"""What a measured peak is raised by before it is counted: allocator caches and
fragmentation move a peak by a few percent from one epoch to the next."""


def sharers(
    limits: SharingLimits | None,
    demands: Mapping[str, Demand],
    held: Mapping[str, Placement],
    shared: AbstractSet[str],
) -> frozenset[str]:
    """The jobs whose GPUs other sharing jobs may share: those whose demand says so (none
    with sharing off), and the `held` ones (adopted, not asked for yet) that were `shared`."""
    adopted = frozenset(job for job in shared if job in held)
    if limits is None:
        return adopted
    return frozenset(name for name, demand in demands.items() if demand.share) | adopted


def held_slots(held: Mapping[str, Placement], shared: AbstractSet[str]) -> set[Slot]:
    """The GPUs of `held` jobs (adopted, not asked for yet) that share GPUs (`shared`): no
    job lands there until they ask (their memory is not known till then), but the sharing
    jobs on them stay."""
    return {slot for job in shared if job in held for slot in held[job].slots()}


@dataclass(frozen=True)
class SharingLimits:
    """The operator's settings for sharing (`run --share-gpus`)."""

    max_jobs_per_gpu: int = DEFAULT_MAX_JOBS_PER_GPU
    margin: float = DEFAULT_MEMORY_MARGIN
    gpu_memory_bytes: int | None = None
    """Each GPU's memory where the pool does not say (`Pool.gpu_memory_bytes` wins)."""
    max_utilization: float | None = None
    """The summed GPU utilization (`Demand.utilization`) of the jobs sharing one GPU at most;
    None: not limited (memory and `max_jobs_per_gpu` only). Two jobs that each keep a GPU
    busy slow each other most; a cap keeps only pairs whose kernels fit in the GPU's time."""
    backfill: bool = False
    """Sharing jobs may take GPUs the whole-GPU arbitration left free even while a whole-GPU
    job waits (its min did not fit in them). False: free GPUs are the whole-GPU jobs' first
    (a sharing job opens one only above every waiting whole-GPU job's priority)."""
    admit_first: bool = False
    """Pending sharing jobs are admitted at their min before any sharing job grows past what
    it holds, and while one waits for free GPUs no job opens one to grow (they are kept for
    the head of the line). False: in rank order, a running job first grows up to what it
    wants, then a pending one is admitted at the most it wants that fits."""
    whole_first: bool = False
    """A sharing worker takes a free GPU (where it may open one) before a shared GPU whose
    jobs' summed utilization it would take past `sharing_room.LIGHT_TOGETHER` (1.0): it
    shares beside light jobs, or where it would otherwise wait. False: shared GPUs first,
    the fullest first."""
    shrink_to_admit: bool = False
    """The first waiting sharing job that fits nowhere may take workers of running sharing
    jobs of its priority or lower above their min, as `arbitrate` shrinks whole-GPU jobs to
    admit one (`sharing_shrink.py`). False: a sharing job is never shrunk to admit another.
    Not with `admit_first`."""
    share_to_admit: bool = False
    """A sharing worker goes onto a GPU another job uses only to admit its job (to reach its
    min), and only where no free GPU is left for it; a running job grows onto free GPUs only.
    False: a job grows onto shared GPUs too, and `whole_first` says which come first."""
    light_growth: bool = False
    """A running job grows onto a shared GPU only where it leaves the jobs there within a
    summed utilization of `sharing_room.LIGHT_TOGETHER` (1.0): only admission crowds a GPU
    (up to `max_utilization`). False: growth crowds a GPU as admission does."""
    move_apart: bool = False
    """After admission and before growth, a running job's workers on crowded GPUs (summed
    utilization past `LIGHT_TOGETHER`) move to free GPUs (`sharing_apart.py`): a GPU stays
    crowded only while no GPU is free. Only with `shrink_to_admit` (its order: admission,
    then the rest)."""

    share_when_waiting: bool = False
    """Each sharing job takes the size the division of whole GPUs gives it (the allocator's:
    by speedup, by gain or fair share), on free GPUs first, and only a job that division
    leaves waiting is admitted by sharing, at its min (`sharing_division.py`). False: each
    sharing job grows up to what it wants, in rank order."""

    def __post_init__(self) -> None:
        if self.max_jobs_per_gpu < 1:
            raise ValueError(f"max_jobs_per_gpu must be >= 1, got {self.max_jobs_per_gpu}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be finite and >= 0, got {self.margin}")
        if self.shrink_to_admit and self.admit_first:
            raise ValueError("shrink_to_admit and admit_first: choose one (both admit first)")
        if self.move_apart and not self.shrink_to_admit:
            raise ValueError("move_apart: only with shrink_to_admit (admission comes first)")
        cap = self.max_utilization
        if cap is not None and not (math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"max_utilization must be finite and >= 1 (one busy job), got {cap}")


def _placement(slots: Sequence[Slot]) -> Placement:
    """Slots in order, grouped by host in the order hosts first appear (local-rank order)."""
    hosts: dict[str, list[int]] = {}
    for host, gpu in slots:
        hosts.setdefault(host, []).append(gpu)
    return Placement(tuple((host, tuple(gpus)) for host, gpus in hosts.items()))


def _rank(demand: Demand) -> tuple[int, float, str]:
    return (-demand.priority, demand.arrival, demand.name)


def pack(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    *,
    closed: AbstractSet[Slot],
    no_new: AbstractSet[Slot] = frozenset(),
    draining: AbstractSet[Slot] = frozenset(),
    frozen: AbstractSet[str] = frozenset(),
    may_open: Mapping[str, bool] | None = None,
    limits: SharingLimits = SharingLimits(),
    smallest_first: bool = False,
    overdue: AbstractSet[str] = frozenset(),
    division: DivisionOptions = ARRIVAL_FAIR_SHARE,
) -> dict[str, tuple[Placement, str]]:
    """Place the sharing `demands` (see the module docstring); each job's placement and the
    reason. `closed`: GPUs no sharing worker may use; `no_new`: GPUs only the workers on
    them may stay on, of which `draining` are being given back (with `shrink_to_admit`
    the head of the line counts those, as `arbitrate` counts them); `may_open[job]`:
    whether the job may take a GPU no one uses (default yes). With `smallest_first`, jobs
    are ranked within a tier as `arbitrate` ranks them (`rank_smallest_first`: the
    `overdue` first, then the smallest min), not by arrival. With
    `limits.share_when_waiting`, in `division`'s order (the queue's), each job sized by
    the division of the GPUs it may use with `division`'s options (`sharing_division.py`).
    """
    capacity = pool.gpu_memory_bytes or limits.gpu_memory_bytes
    sized = limits.share_when_waiting
    ranked = ranked_demands(demands, division.order if sized else None, smallest_first, overdue)
    free_first: frozenset[str] = frozenset()
    if sized:  # the GPUs no exclusive job holds, the draining ones counted
        usable = len(pool.slot_set - set(closed) - (set(no_new) - set(draining)))
        ranked, free_first = follow_division(usable, ranked, current, frozen, division)
    if capacity is None:
        needs = WorkerNeeds(None, limits.margin)
        gpus = GpuRoom(1, 1, False, closed, no_new)
    else:
        needs = WorkerNeeds(capacity, limits.margin)
        gpus = GpuRoom(capacity, limits.max_jobs_per_gpu, True, closed, no_new)
        gpus.draining = draining
        gpus.max_busy = limits.max_utilization
        gpus.busy_of = {d.name: counted_utilization(d) for d in ranked}
    in_pool = pool.slot_set
    held: dict[str, list[Slot]] = {}
    for d in ranked:
        now = [s for s in current.get(d.name, Placement.EMPTY).slots() if s in in_pool]
        top = d.max if d.name in frozen else d.wanted
        staying: list[Slot] = []
        size = min(len(now), top)
        while size >= d.min:  # the most of its GPUs it keeps at the memory that size needs
            need = needs.at(d, size)
            fit = [slot for slot in now if gpus.fits(slot, d.name, need, staying=True)]
            if len(fit) >= size:
                staying = fit[:size]
                break
            size = len(fit) if needs.constant(d) else min(size - 1, len(fit))
        for slot in staying:
            gpus.add(slot, d.name, needs.at(d, len(staying)))
        held[d.name] = staying
    return _grow(
        pool, ranked, current, held, needs, gpus, frozen, may_open or {}, limits, free_first
    )  # fmt: skip


def _grow(
    pool: Pool,
    ranked: Sequence[Demand],
    current: Mapping[str, Placement],
    held: dict[str, list[Slot]],
    needs: WorkerNeeds,
    gpus: GpuRoom,
    frozen: AbstractSet[str],
    may_open: Mapping[str, bool],
    limits: SharingLimits,
    free_first_jobs: AbstractSet[str] = frozenset(),
) -> dict[str, tuple[Placement, str]]:
    """Grow each job from what it kept up to what it wants (admit it when its min fits);
    with `limits.admit_first`, tier by tier, the pending ones at their min first, then the
    growth, again until neither changes anything. With `limits.shrink_to_admit`: the pending
    ones at their min, then the head of the line by shrinking others (`Shrinker`), then
    the growth, again until none changes anything; admission before growth, so that a job
    shrunk for one waiting does not grow back into its GPUs while that one's grant waits for
    them to drain (it did, and was shrunk again at the next decision, over and over)."""
    free_first = limits.share_to_admit
    where = Candidates(
        pool, gpus, whole_first=limits.whole_first, free_first=free_first,
        free_first_jobs=free_first_jobs,
    )  # fmt: skip
    grows: Sharing = "none" if free_first else "light" if limits.light_growth else "any"
    growth = _Growth(held, needs, gpus, frozen, may_open, where, pool.size, grows)
    packing = Packing(ranked, held, needs, gpus, where, frozen)
    shrinker = Shrinker(packing)
    moved: dict[str, int] = {}
    if limits.shrink_to_admit:
        apart = partial(move_apart, packing, may_open)
        moved = _shrink_to_admit(ranked, growth, shrinker, pool.size, limits.move_apart, apart)
    elif not limits.admit_first:
        growth.step(ranked, admitting=True, growing=True)
    else:
        for _, tier_iter in itertools.groupby(ranked, key=lambda d: d.priority):
            tier = list(tier_iter)
            while growth.step(tier, True, growing=False) | growth.step(tier, False, growing=True):
                pass  # each round admits or grows a worker: it ends
            growth.upper_blocked = growth.upper_blocked or growth.blocker is not None
    decided: dict[str, tuple[Placement, str]] = {}
    for d in ranked:
        mine = held[d.name]
        before = current.get(d.name, Placement.EMPTY).size
        if len(mine) < d.min:
            fits = growth.found.get(d.name, 0)
            reason = pending_reason(d, needs.at(d, d.min), fits, before, gpus, pool.size)
            decided[d.name] = (Placement.EMPTY, reason)
        elif d.name in frozen:
            decided[d.name] = (_placement(mine), f"holding {len(mine)}: resized recently (sharing)")
        else:
            reason = placed_reason(d, needs.at(d, len(mine)), before, len(mine), moved.get(d.name))
            taker = shrinker.shrunk_for.get(d.name)
            if taker is not None and len(mine) < before:
                share = f"sharing, {format_bytes(needs.at(d, len(mine)))} per worker"
                # A taker that ran before lost its place only in this packing: this job no
                # longer fits beside it (its measured memory grew), not an admission.
                ran = current.get(taker, Placement.EMPTY).size > 0
                why = "no longer fits beside" if ran else "admitting"
                reason = f"shrunk {before} -> {len(mine)}: {why} {taker} ({share})"
            decided[d.name] = (_placement(mine), reason)
    return decided


def _shrink_to_admit(
    ranked: Sequence[Demand],
    growth: _Growth,
    shrinker: Shrinker,
    pool_size: int,
    moving: bool,
    apart: Callable[[], dict[str, int]],
) -> dict[str, int]:
    """`shrink_to_admit`'s rounds (`_grow`), with `moving` (`move_apart`) the moves between
    admission and growth unless the free GPUs are kept for a waiting job; the workers moved,
    per job."""
    admit = partial(_admit_head, growth)
    moved: dict[str, int] = {}
    while True:  # each round admits a job, moves or adds a worker: it ends
        admitted = growth.step(ranked, admitting=True, growing=False)
        head = growth.head
        if head is not None and shrinker.admit(head, admit, pool_size):
            continue
        kept = growth.reserve or growth.upper_blocked
        now = apart() if moving and not kept else {}
        for job, count in now.items():
            moved[job] = moved.get(job, 0) + count
        if not (growth.step(ranked, admitting=True, growing=True) or admitted or now):
            return moved


def _admit_head(growth: _Growth, head: Demand) -> list[Slot] | None:
    return growth.admit_or_grow(head, head.wanted, opens=True)


@dataclass
class _Growth:
    """The jobs' GPUs as admission and growth go (`held`, updated in place)."""

    held: dict[str, list[Slot]]
    needs: WorkerNeeds
    gpus: GpuRoom
    frozen: AbstractSet[str]
    may_open: Mapping[str, bool]
    where: Candidates
    pool_size: int
    growth_shares: Sharing = "any"
    """Which GPUs others use a running job may grow onto (`share_to_admit`: none)."""
    found: dict[str, int] = field(default_factory=dict)
    """A pending job's GPUs found at its last try (for its reason)."""
    blocker: int | None = None
    """Admitting alone: where the first pending job that may open a GPU and did not fit is in
    the tier (at the last admitting pass): nobody after it opens a free GPU (head of line)."""
    reserve: bool = False
    """That job could fit once GPUs free up: nobody of its tier opens one to grow (they are
    kept for it)."""
    upper_blocked: bool = False
    """A higher priority tier has such a job: nobody of this one opens a free GPU."""
    head: Demand | None = None
    """The first pending job that may open a GPU and did not fit, at the last pass: the
    head of the line (the one `shrink_to_admit` shrinks others for)."""

    def step(self, ranked: Sequence[Demand], admitting: bool, growing: bool) -> bool:
        """One pass over `ranked`, in order: pending jobs admitted (at the most they want, or
        at their min when not `growing` too), running ones grown; whether any GPU was added.
        Nobody after the first pending job that may open a GPU and did not fit opens one
        (head of line); after an admitting pass alone left one waiting that could fit, nobody
        of its tier who grows does."""
        alone = admitting != growing
        if alone and admitting:
            self.blocker, self.reserve = None, False
        blocked_line = self.upper_blocked
        changed = False
        self.head = None
        for index, d in enumerate(ranked):
            if not self._has_turn(d, admitting, growing):
                continue
            may_open = self.may_open.get(d.name, True)
            opens = may_open and not blocked_line
            if alone and growing:
                after = self.blocker is not None and index > self.blocker
                opens = opens and not self.reserve and not after
            extra = self.admit_or_grow(d, d.wanted if growing else d.min, opens)
            if extra is not None:
                changed = changed or bool(extra)
            elif may_open and not blocked_line:
                blocked_line = True  # nobody after it opens a free GPU (head of line)
                self.head = d
                if alone:  # a job no GPU can hold (a peak grown past one) keeps none free
                    need = self.needs.at(d, d.min)
                    self.blocker = index
                    self.reserve = need <= self.gpus.capacity and d.min <= self.pool_size
        return changed

    def _has_turn(self, d: Demand, admitting: bool, growing: bool) -> bool:
        """Pending jobs in an admitting pass; in a growing one, the running jobs that want
        more and were not resized recently (most jobs in most decisions keep what they hold)."""
        mine = self.held[d.name]
        if len(mine) < d.min:
            return admitting
        return growing and d.name not in self.frozen and len(mine) < d.wanted

    def admit_or_grow(self, d: Demand, top: int, opens: bool) -> list[Slot] | None:
        """The GPUs added to `d` (up to `top` in all, counted in), or None: pending, its min
        did not fit."""
        mine = self.held[d.name]
        shares: Sharing = "any" if len(mine) < d.min else self.growth_shares
        need, extra = _largest_growth(d, top, mine, self.needs, self.where, opens, shares)
        if len(mine) + len(extra) < d.min:
            self.found[d.name] = len(mine) + len(extra)
            return None
        for slot in extra:
            self.gpus.add(slot, d.name, need)
        for slot in mine:  # at its bigger size each worker it kept holds less of the batch
            self.gpus.used[slot] -= self.needs.at(d, len(mine)) - need
        self.held[d.name] = mine + extra
        return extra


def _largest_growth(
    demand: Demand,
    top: int,
    mine: Sequence[Slot],
    needs: WorkerNeeds,
    where: Candidates,
    opens: bool,
    shares: Sharing,
) -> tuple[int, list[Slot]]:
    """(bytes per worker, the GPUs to add) for the largest size up to `top` whose every
    new worker finds a GPU with the memory a worker needs at that size (a smaller size needs
    more per worker: each tries the size the last one found room for). Nothing to add when
    no size above what it holds fits (below its min: it stays pending)."""
    size = top
    while True:
        need = needs.at(demand, size)
        extra = where.best(demand.name, mine, need, size - len(mine), opens, shares=shares)
        found = len(mine) + len(extra)
        if found >= size or needs.constant(demand):
            return need, extra
        size = min(size - 1, found)
        if size <= len(mine) or size < demand.min:
            return needs.at(demand, len(mine)), []


def arbitrate_sharing(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    *,
    limits: SharingLimits | None,
    frozen: AbstractSet[str] = frozenset(),
    unavailable: AbstractSet[Slot] = frozenset(),
    draining: AbstractSet[Slot] = frozenset(),
    previous: Mapping[str, Grant] | None = None,
    spare_by_gain: bool = False,
    smallest_first: bool = False,
    overdue: AbstractSet[str] = frozenset(),
    share_by_gain: bool = False,
    held_shared: AbstractSet[Slot] = frozenset(),
    order: Mapping[str, tuple[float, ...]] | None = None,
    share_by_speedup: bool = False,
) -> dict[str, Grant]:
    """Every job's grant: `arbitrate` for the jobs that do not share (on the pool less the
    GPUs sharing jobs hold), `pack` for those that do. The arguments are `arbitrate`'s, with
    `limits` for the packing and `held_shared` (`held_slots`): GPUs no job lands on,
    where the sharing jobs on them stay, and `order` (the queue's, `queueing.py`) for the
    jobs that do not share (`smallest_first` and `overdue` rank both kinds). With sharing
    off (`limits` None: `Demand.share` is ignored, every job gets whole GPUs) or no sharing
    demand, this is `arbitrate` itself."""
    decide = partial(
        arbitrate,
        frozen=frozen,
        spare_by_gain=spare_by_gain,
        previous=previous,
        smallest_first=smallest_first,
        overdue=overdue,
        share_by_gain=share_by_gain,
        order=order,
        share_by_speedup=share_by_speedup,
    )
    sharing = [d for d in demands if d.share] if limits is not None else []
    if limits is None or not sharing:
        if held_shared:
            unavailable = set(unavailable) | held_shared
        return decide(pool, demands, current, unavailable=unavailable, draining=draining)
    packing = partial(
        pack, frozen=frozen, limits=limits, smallest_first=smallest_first, overdue=overdue,
        division=DivisionOptions(order, spare_by_gain, share_by_gain, share_by_speedup),
    )  # fmt: skip
    beside = partial(
        _decide_beside_sharers, pool, demands, current, decide, packing, limits, unavailable,
        draining, held_shared,
    )  # fmt: skip
    (decided, packed), shrunk_for = beside(frozenset()), dict[str, str]()
    if limits.shrink_to_admit and any(not g.placement.size for g in decided.values()):
        position = {slot: index for index, slot in enumerate(pool.slots())}
        arriving = {d.name for d in demands if not current.get(d.name, Placement.EMPTY).size}
        (decided, packed), shrunk_for = shrink_for_whole(
            demands, (decided, packed), beside, frozen=frozen, fixed=held_shared,
            position=position, arriving=arriving,
        )  # fmt: skip
    before = previous or {}
    for d in sorted(sharing, key=_rank):
        placement, reason = packed[d.name]
        earlier = before.get(d.name)
        size = current.get(d.name, Placement.EMPTY).size
        if d.name in shrunk_for and size > placement.size:
            share = reason[reason.rfind("(sharing") :]
            reason = f"shrunk {size} -> {placement.size}: admitting {shrunk_for[d.name]} {share}"
        if earlier is not None and placement.size and earlier.placement == placement:
            decided[d.name] = earlier
        else:
            decided[d.name] = Grant(placement, reason)
    return decided


def _decide_beside_sharers(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    decide: Callable[..., dict[str, Grant]],
    packing: Callable[..., dict[str, tuple[Placement, str]]],
    limits: SharingLimits,
    unavailable: AbstractSet[Slot],
    draining: AbstractSet[Slot],
    held_shared: AbstractSet[Slot],
    freed: AbstractSet[Slot],
) -> tuple[dict[str, Grant], dict[str, tuple[Placement, str]]]:
    """The exclusive jobs' grants (`decide`) and the sharing jobs' packing (`packing`: `pack`
    with the decision's settings), with the GPUs `freed` taken from the sharing jobs that
    hold them (`sharing_whole.py`: they count as free to the exclusive jobs). The jobs that do
    not share are decided on the pool less the GPUs the sharing jobs keep, and which they
    keep is known only after the packing (a job whose measured peak no longer fits anywhere,
    or that shrinks, leaves its GPU): so decide again without the GPUs they left until none
    is left. A GPU left idle for a round made the next decision differ from this one
    (hypothesis found it). Each pass keeps fewer GPUs, so this ends."""
    sharing = [d for d in demands if d.share]
    exclusive = [d for d in demands if not d.share]
    names = {d.name for d in sharing}
    others = {job: placement for job, placement in current.items() if job not in names}
    kept = _slots_of(current, names, pool.slot_set) - set(freed)
    while True:
        decided = decide(
            pool, exclusive, others, unavailable=set(unavailable) | kept | held_shared,
            draining=draining,
        )  # fmt: skip
        closed = set(unavailable) | _slots_of(
            {job: grant.placement for job, grant in decided.items()}, decided.keys(), pool.slot_set
        )
        packed = packing(
            pool, sharing, current, closed=closed, no_new=set(draining) | held_shared,
            draining=set(draining) - held_shared,
            may_open=None if limits.backfill else _may_open(exclusive, sharing, decided),
        )  # fmt: skip
        still = kept & {slot for placement, _ in packed.values() for slot in placement.slots()}
        if still == kept:
            return decided, packed
        kept = still


def _slots_of(
    placements: Mapping[str, Placement], jobs: AbstractSet[str], in_pool: AbstractSet[Slot]
) -> set[Slot]:
    """The slots of the pool that `jobs` hold in `placements`."""
    return {
        slot
        for job, placement in placements.items()
        if job in jobs
        for slot in placement.slots()
        if slot in in_pool
    }


def _may_open(
    exclusive: Sequence[Demand], sharing: Sequence[Demand], decided: Mapping[str, Grant]
) -> dict[str, bool]:
    """Whether each sharing job may take a free GPU: only above every waiting whole-GPU job's
    priority (free GPUs are theirs first)."""
    top_waiting = max(
        (d.priority for d in exclusive if not decided[d.name].placement.size), default=None
    )
    return {d.name: top_waiting is None or d.priority > top_waiting for d in sharing}
