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
  used job beside a busy one, leaving room for the middling ones).
- A sharing job's memory per worker is the larger of its request (`memory_bytes`) and its
  measured peak (`measured_bytes`) times `1 + margin`; with neither, or with no known GPU
  memory in the pool, a worker takes a whole GPU (still never beside an exclusive job).
- Sharing jobs, in priority then arrival order, first keep the GPUs they hold where they
  still fit (a measured peak that grew can push a worker out: it is placed again, or the job
  shrinks, or it is pending again under its min); frozen jobs (resized recently) keep theirs
  untouched where they fit. Then each grows to what it wants, up to its max of `wanted`:
  onto GPUs already shared first (fullest first: packs tighter, leaves whole GPUs whole),
  then onto free GPUs. A pending job is admitted only when its whole min fits.
- Free GPUs go to exclusive jobs first: a sharing job opens a free GPU only when no
  exclusive job of its priority or higher is pending (unless `backfill`: then it may open
  the GPUs the exclusive arbitration left free), and no sharing job before it was
  left pending (head of line). Packing onto GPUs already shared takes no GPU from anyone,
  so it goes on past a pending job. A sharing job is never shrunk to admit an exclusive
  one: its GPUs go back as sharing jobs end, and none opens a new one meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial

from herd_operator.policies.arbitration import arbitrate
from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot

DEFAULT_MAX_JOBS_PER_GPU = 4
"""Sharing jobs on one GPU at most: each adds a CUDA context (about 300-500 MiB) and
contends for the GPU's compute; past a few, the slowdown outweighs the memory saved."""
DEFAULT_MEMORY_MARGIN = 0.10
"""What a measured peak is raised by before it is counted: allocator caches and
fragmentation move a peak by a few percent from one epoch to the next."""


def worker_memory(demand: Demand, margin: float) -> int:
    """GPU memory one worker of a sharing job is counted for: the larger of its request and
    its measured peak raised by `margin`; 0 when neither is known."""
    measured = math.ceil(demand.measured_bytes * (1.0 + margin)) if demand.measured_bytes else 0
    return max(demand.memory_bytes or 0, measured)


def worker_memory_at(demand: Demand, size: int, margin: float) -> int:
    """GPU memory one of `size` workers (>= the job's min) of a sharing job is counted for:
    `worker_memory` with the request taken at that size (`Demand.memory_split_bytes`: a
    bigger job's workers each hold less of its batch). A measured peak stays a floor."""
    request = demand.memory_bytes or 0
    split = demand.memory_split_bytes or 0
    if split and size > demand.min:
        request -= split // demand.min - math.ceil(split / size)
    measured = math.ceil(demand.measured_bytes * (1.0 + margin)) if demand.measured_bytes else 0
    return max(request, measured)


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


def format_bytes(count: int) -> str:
    """`8.0Gi`-style, as a spec writes a quantity."""
    for unit, size in (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f}{unit}"
    return f"{count}"


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

    def __post_init__(self) -> None:
        if self.max_jobs_per_gpu < 1:
            raise ValueError(f"max_jobs_per_gpu must be >= 1, got {self.max_jobs_per_gpu}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be finite and >= 0, got {self.margin}")
        cap = self.max_utilization
        if cap is not None and not (math.isfinite(cap) and cap >= 1.0):
            raise ValueError(f"max_utilization must be finite and >= 1 (one busy job), got {cap}")


@dataclass
class _Gpus:
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

    def fits(self, slot: Slot, job: str, need: int, *, staying: bool = False) -> bool:
        if slot in self.closed or (not staying and slot in self.no_new):
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

    def add(self, slot: Slot, job: str, need: int) -> None:
        self.used[slot] = self.used.get(slot, 0) + need
        self.jobs.setdefault(slot, set()).add(job)
        self.busy[slot] = self.busy.get(slot, 0.0) + self._busy(job)

    def _busy(self, job: str) -> float:
        return self.busy_of.get(job, 1.0)

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
    frozen: AbstractSet[str] = frozenset(),
    may_open: Mapping[str, bool] | None = None,
    limits: SharingLimits = SharingLimits(),
) -> dict[str, tuple[Placement, str]]:
    """Place the sharing `demands` (see the module docstring); each job's placement and the
    reason. `closed`: GPUs no sharing worker may use; `no_new`: GPUs only the workers on
    them may stay on; `may_open[job]`: whether the job may take a GPU no one uses (default
    yes)."""
    capacity = pool.gpu_memory_bytes or limits.gpu_memory_bytes
    ranked = sorted(demands, key=_rank)
    if capacity is None:
        needs = _Needs(None, limits.margin)
        gpus = _Gpus(1, 1, False, closed, no_new)
    else:
        needs = _Needs(capacity, limits.margin)
        gpus = _Gpus(capacity, limits.max_jobs_per_gpu, True, closed, no_new)
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
    return _grow(pool, ranked, current, held, needs, gpus, frozen, may_open or {})


@dataclass(frozen=True)
class _Needs:
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


def _grow(
    pool: Pool,
    ranked: Sequence[Demand],
    current: Mapping[str, Placement],
    held: dict[str, list[Slot]],
    needs: _Needs,
    gpus: _Gpus,
    frozen: AbstractSet[str],
    may_open: Mapping[str, bool],
) -> dict[str, tuple[Placement, str]]:
    """Grow each job from what it kept up to what it wants (admit it when its min fits)."""
    where = _Candidates(pool, gpus)
    blocked_line = False
    decided: dict[str, tuple[Placement, str]] = {}
    for d in ranked:
        mine = held[d.name]
        before = current.get(d.name, Placement.EMPTY).size
        need = needs.at(d, len(mine))
        if d.name in frozen and len(mine) >= d.min:
            decided[d.name] = (_placement(mine), f"holding {len(mine)}: resized recently (sharing)")
            continue
        if len(mine) >= d.wanted:  # keeps what it holds (most jobs in most decisions)
            decided[d.name] = (_placement(mine), _reason(d, need, before, len(mine)))
            continue
        opens = may_open.get(d.name, True) and not blocked_line
        need, extra = _largest_growth(d, mine, needs, where, opens)
        if len(mine) + len(extra) < d.min:
            if not mine and not blocked_line and may_open.get(d.name, True):
                blocked_line = True  # nobody after it opens a free GPU (head of line)
            decided[d.name] = (
                Placement.EMPTY,
                _pending_reason(d, needs.at(d, d.min), len(mine) + len(extra), before, gpus),
            )
            continue
        for slot in extra:
            gpus.add(slot, d.name, need)
        for slot in mine:  # at its bigger size each worker it kept holds less of the batch
            gpus.used[slot] -= needs.at(d, len(mine)) - need
        mine = mine + extra
        decided[d.name] = (_placement(mine), _reason(d, need, before, len(mine)))
    return decided


def _largest_growth(
    demand: Demand, mine: Sequence[Slot], needs: _Needs, where: _Candidates, opens: bool
) -> tuple[int, list[Slot]]:
    """(bytes per worker, the GPUs to add) for the largest size up to `wanted` whose every
    new worker finds a GPU with the memory a worker needs at that size (a smaller size needs
    more per worker: each tries the size the last one found room for). Nothing to add when
    no size above what it holds fits (below its min: it stays pending)."""
    size = demand.wanted
    while True:
        need = needs.at(demand, size)
        extra = where.best(demand.name, mine, need, size - len(mine), opens)
        found = len(mine) + len(extra)
        if found >= size or needs.constant(demand):
            return need, extra
        size = min(size - 1, found)
        if size <= len(mine) or size < demand.min:
            return needs.at(demand, len(mine)), []


class _Candidates:
    """Where a job's next workers go, best first: GPUs on the hosts it has (shared ones
    fullest first, then free ones), then GPUs shared elsewhere (fullest first), then free GPUs
    in pool order. Without scanning the pool for each job: a first decision packing
    thousands of jobs onto a Perlmutter-sized pool did that in minutes."""

    def __init__(self, pool: Pool, gpus: _Gpus) -> None:
        self._gpus = gpus
        self._order = {slot: position for position, slot in enumerate(pool.slots())}
        self._on_host = {host: [(host, gpu) for gpu in ids] for host, ids in pool.hosts}
        self._free = [
            slot
            for slot in pool.slots()
            if slot not in gpus.jobs and slot not in gpus.closed and slot not in gpus.no_new
        ]
        self._first_free = 0

    def best(
        self, job: str, mine: Sequence[Slot], need: int, count: int, opens: bool
    ) -> list[Slot]:
        """Up to `count` GPUs for `job` (holding `mine`), each with `need` bytes free;
        free GPUs only if `opens`."""
        gpus = self._gpus
        hosts = {host for host, _ in mine}
        taken = set(mine)

        def usable(slot: Slot) -> bool:
            shared = bool(gpus.jobs.get(slot))
            return slot not in taken and (opens or shared) and gpus.fits(slot, job, need)

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


def _pending_reason(demand: Demand, need: int, fits: int, before: int, gpus: _Gpus) -> str:
    memory = gpus.capacity if gpus.known else None
    if memory is not None and need > memory:
        field = "spec.gpus.memory" if need == (demand.memory_bytes or 0) else "measured peak"
        why = (
            f"{field}: {format_bytes(need)} per worker is above the pool's GPU memory"
            f" ({format_bytes(memory)})"
        )
    else:
        each = f" with {format_bytes(need)} free" if memory is not None else ""
        why = f"needs {demand.min} GPU(s){each} for sharing, {fits} found"
    return f"pending {before} -> 0: {why}" if before else f"pending: {why}"


def _reason(demand: Demand, need: int, before: int, size: int) -> str:
    share = f"sharing, {format_bytes(need)} per worker"
    if before == 0:
        return f"admitted 0 -> {size}: min {demand.min} fits ({share})"
    if size == before:
        return f"holding {size}: policy wants {demand.wanted} ({share})"
    verb = "grown" if size > before else "shrunk"
    return f"{verb} {before} -> {size}: policy wants {demand.wanted} ({share})"


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
) -> dict[str, Grant]:
    """Every job's grant: `arbitrate` for the jobs that do not share (on the pool less the
    GPUs sharing jobs hold), `pack` for those that do. The arguments are `arbitrate`'s, with
    `limits` for the packing and `held_shared` (`held_slots`): GPUs no job lands on,
    where the sharing jobs on them stay, and `order` (the queue's, `queueing.py`) for the
    jobs that do not share. With sharing off (`limits` None: `Demand.share` is
    ignored, every job gets whole GPUs) or no sharing demand, this is `arbitrate` itself."""
    decide = partial(
        arbitrate,
        frozen=frozen,
        spare_by_gain=spare_by_gain,
        previous=previous,
        smallest_first=smallest_first,
        overdue=overdue,
        share_by_gain=share_by_gain,
        order=order,
    )
    sharing = [d for d in demands if d.share] if limits is not None else []
    if limits is None or not sharing:
        if held_shared:
            unavailable = set(unavailable) | held_shared
        return decide(pool, demands, current, unavailable=unavailable, draining=draining)
    decided, packed = _decide_beside_sharers(
        pool, demands, current, decide, limits, unavailable, draining, held_shared, frozen
    )
    before = previous or {}
    for d in sorted(sharing, key=_rank):
        placement, reason = packed[d.name]
        earlier = before.get(d.name)
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
    limits: SharingLimits,
    unavailable: AbstractSet[Slot],
    draining: AbstractSet[Slot],
    held_shared: AbstractSet[Slot],
    frozen: AbstractSet[str],
) -> tuple[dict[str, Grant], dict[str, tuple[Placement, str]]]:
    """The exclusive jobs' grants (`decide`) and the sharing jobs' packing. The jobs that do
    not share are decided on the pool less the GPUs the sharing jobs keep, and which they
    keep is known only after the packing (a job whose measured peak no longer fits anywhere,
    or that shrinks, leaves its GPU): so decide again without the GPUs they left until none
    is left. A GPU left idle for a round made the next decision differ from this one
    (hypothesis found it). Each pass keeps fewer GPUs, so this ends."""
    sharing = [d for d in demands if d.share]
    exclusive = [d for d in demands if not d.share]
    names = {d.name for d in sharing}
    others = {job: placement for job, placement in current.items() if job not in names}
    kept = _slots_of(current, names, pool.slot_set)
    while True:
        decided = decide(
            pool, exclusive, others, unavailable=set(unavailable) | kept | held_shared,
            draining=draining,
        )  # fmt: skip
        closed = set(unavailable) | _slots_of(
            {job: grant.placement for job, grant in decided.items()}, decided.keys(), pool.slot_set
        )
        packed = pack(
            pool, sharing, current, closed=closed, no_new=set(draining) | held_shared,
            frozen=frozen, limits=limits,
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
