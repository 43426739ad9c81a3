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
  a job never has two workers on one GPU (Horovod and torchrun give each rank its own).
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
  exclusive job of its priority or higher is pending, and no sharing job before it was
  left pending (head of line). Packing onto GPUs already shared takes no GPU from anyone,
  so it goes on past a pending job. A sharing job is never shrunk to admit an exclusive
  one: its GPUs go back as sharing jobs end, and none opens a new one meanwhile.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
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

    def __post_init__(self) -> None:
        if self.max_jobs_per_gpu < 1:
            raise ValueError(f"max_jobs_per_gpu must be >= 1, got {self.max_jobs_per_gpu}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"margin must be finite and >= 0, got {self.margin}")


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

    def fits(self, slot: Slot, job: str, need: int, *, staying: bool = False) -> bool:
        if slot in self.closed or (not staying and slot in self.no_new):
            return False
        jobs = self.jobs.get(slot, set())
        return (
            job not in jobs
            and len(jobs) < self.max_jobs
            and self.used.get(slot, 0) + need <= self.capacity
        )

    def add(self, slot: Slot, job: str, need: int) -> None:
        self.used[slot] = self.used.get(slot, 0) + need
        self.jobs.setdefault(slot, set()).add(job)


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
        needs = {d.name: 1 for d in ranked}
        gpus = _Gpus(1, 1, False, closed, no_new)
    else:
        needs = {d.name: worker_memory(d, limits.margin) or capacity for d in ranked}
        gpus = _Gpus(capacity, limits.max_jobs_per_gpu, True, closed, no_new)
    in_pool = pool.slot_set
    held: dict[str, list[Slot]] = {}
    for d in ranked:
        need = needs[d.name]
        staying = [
            slot
            for slot in current.get(d.name, Placement.EMPTY).slots()
            if slot in in_pool and gpus.fits(slot, d.name, need, staying=True)
        ]
        top = d.max if d.name in frozen else d.wanted
        staying = staying[:top] if len(staying) >= d.min else []
        for slot in staying:
            gpus.add(slot, d.name, need)
        held[d.name] = staying
    return _grow(pool, ranked, current, held, needs, gpus, frozen, may_open or {})


def _grow(
    pool: Pool,
    ranked: Sequence[Demand],
    current: Mapping[str, Placement],
    held: dict[str, list[Slot]],
    needs: Mapping[str, int],
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
        need = needs[d.name]
        if d.name in frozen and len(mine) >= d.min:
            decided[d.name] = (_placement(mine), f"holding {len(mine)}: resized recently (sharing)")
            continue
        if len(mine) >= d.wanted:  # keeps what it holds (most jobs in most decisions)
            decided[d.name] = (_placement(mine), _reason(d, need, before, len(mine)))
            continue
        opens = may_open.get(d.name, True) and not blocked_line
        extra = where.best(d.name, mine, need, d.wanted - len(mine), opens)
        if len(mine) + len(extra) < d.min:
            if not mine and not blocked_line and may_open.get(d.name, True):
                blocked_line = True  # nobody after it opens a free GPU (head of line)
            decided[d.name] = (
                Placement.EMPTY,
                _pending_reason(d, need, len(mine) + len(extra), before, gpus),
            )
            continue
        for slot in extra:
            gpus.add(slot, d.name, need)
        mine = mine + extra
        decided[d.name] = (_placement(mine), _reason(d, need, before, len(mine)))
    return decided


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

        def fullest(slot: Slot) -> tuple[bool, int, int]:
            return (not gpus.jobs.get(slot), -gpus.used.get(slot, 0), self._order[slot])

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
    names = {d.name for d in sharing}
    shared_now = _slots_of(current, names, pool.slot_set)
    exclusive = [d for d in demands if not d.share]
    others = {job: placement for job, placement in current.items() if job not in names}
    decided = decide(
        pool,
        exclusive,
        others,
        unavailable=set(unavailable) | shared_now | held_shared,
        draining=draining,
    )
    closed = set(unavailable) | _slots_of(
        {job: grant.placement for job, grant in decided.items()}, decided.keys(), pool.slot_set
    )
    packed = pack(
        pool, sharing, current, closed=closed, no_new=set(draining) | held_shared, frozen=frozen,
        may_open=_may_open(exclusive, sharing, decided), limits=limits,
    )  # fmt: skip
    before = previous or {}
    for d in sorted(sharing, key=_rank):
        placement, reason = packed[d.name]
        earlier = before.get(d.name)
        if earlier is not None and placement.size and earlier.placement == placement:
            decided[d.name] = earlier
        else:
            decided[d.name] = Grant(placement, reason)
    return decided


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
