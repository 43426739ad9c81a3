"""The plain arbitration algorithm of `herd_operator.policies.arbitration` as it stood before its fast
path (commit fedb469), kept as the reference that the property tests compare it against.

Do not optimise this file: its value is that it is the straightforward version.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


def _rank(demand: Demand) -> tuple[int, float, str]:
    return (-demand.priority, demand.arrival, demand.name)


class _FreeGpus:
    """Free GPUs per host, plus hosts bucketed by free count for best fit."""

    def __init__(self, pool: Pool, taken: Mapping[str, AbstractSet[int]]) -> None:
        """`taken`: the GPUs in use, per host. By host rather than by slot, so that a host
        nobody uses costs a list copy (a decision on 1,792 nodes spent half its time testing
        each of 7,168 slots against a set of used slots)."""
        self._names = [host for host, _ in pool.hosts]
        self._free: dict[str, list[int]] = {}
        self._by_count: dict[int, list[int]] = {}
        for position, (host, gpus) in enumerate(pool.sorted_hosts):
            out = taken.get(host)
            free = [gpu for gpu in gpus if gpu not in out] if out else list(gpus)
            self._free[host] = free
            if free:
                # Positions are visited in increasing order, so each bucket stays sorted.
                self._by_count.setdefault(len(free), []).append(position)
        self._position = {host: position for position, host in enumerate(self._names)}
        self._most = max((len(gpus) for _, gpus in pool.hosts), default=0)

    def count(self, host: str) -> int:
        return len(self._free.get(host, ()))

    def take(self, host: str, count: int) -> list[int]:
        """Remove and return the `count` lowest free GPUs of `host`."""
        free = self._free[host]
        before = len(free)
        taken = free[:count]
        del free[:count]
        position = self._position[host]
        bucket = self._by_count[before]
        del bucket[bisect.bisect_left(bucket, position)]
        if free:
            bisect.insort(self._by_count.setdefault(len(free), []), position)
        return taken

    def best_host(self, need: int) -> str:
        """The host with the fewest free GPUs that holds `need`, else the one with the most."""
        for count in range(need, self._most + 1):
            if self._by_count.get(count):
                return self._names[self._by_count[count][0]]
        for count in range(min(need, self._most + 1) - 1, 0, -1):
            if self._by_count.get(count):
                return self._names[self._by_count[count][0]]
        raise ValueError(f"no free GPU left for a job needing {_gpus(need)}")


def _group(slots: Iterable[Slot]) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for host, gpu in slots:
        grouped.setdefault(host, []).append(gpu)
    return grouped


def _kept_slots(
    pool: Pool,
    by_name: Sequence[Demand],
    current: Mapping[str, Placement],
    blocked: AbstractSet[Slot],
) -> tuple[dict[str, int], dict[str, list[Slot]]]:
    """Each demanded job's current size, and its current slots that are still in the pool
    (and not blocked: a blocked slot counts as gone, as if the pool were without it)."""
    in_pool = pool.slot_set
    owner: dict[Slot, str] = {}
    held: dict[str, int] = {}
    kept: dict[str, list[Slot]] = {}
    for demand in by_name:
        placement = current.get(demand.name, Placement.EMPTY)
        slots = placement.slots()
        for slot in slots:
            other = owner.setdefault(slot, demand.name)
            if other != demand.name:
                raise ValueError(
                    f"GPU {slot[0]}:{slot[1]} is in the current placements of both "
                    f"{other} and {demand.name}"
                )
        held[demand.name] = len(slots)
        kept[demand.name] = [
            slot for slot in slots if slot in in_pool and (not blocked or slot not in blocked)
        ]
    return held, kept


@dataclass
class _Counts:
    """Outcome of the counting phase, before any slot is chosen."""

    target: dict[str, int]
    waiting: dict[str, str]
    admissions: list[Demand]
    held_fixed: set[str]


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


def _count(
    size: int,
    ranked: Sequence[Demand],
    kept: Mapping[str, list[Slot]],
    frozen: AbstractSet[str],
) -> _Counts:
    running = {d.name for d in ranked if len(kept[d.name]) >= d.min}
    fixed = [d for d in ranked if d.name in running and d.name in frozen]
    target: dict[str, int] = {d.name: min(len(kept[d.name]), d.max) for d in fixed}
    held_fixed = set(target)
    free = size - sum(
        target[d.name] if d.name in held_fixed else d.min for d in ranked if d.name in running
    )
    waiting: dict[str, str] = {}
    admissions: list[Demand] = []
    blocker: Demand | None = None
    for _, tier_iter in itertools.groupby(ranked, key=lambda d: d.priority):
        tier = list(tier_iter)
        for demand in tier:
            if demand.name in held_fixed:
                continue
            if demand.name in running:
                target[demand.name] = demand.min
            elif blocker is not None:
                target[demand.name] = 0
                waiting[demand.name] = (
                    f"waiting behind {blocker.name} (priority {blocker.priority})"
                )
            elif demand.min <= free:
                target[demand.name] = demand.min
                free -= demand.min
                admissions.append(demand)
            else:
                target[demand.name] = 0
                note = _frozen_note(demand, free, fixed, target)
                waiting[demand.name] = f"needs {_gpus(demand.min)}, {free} free{note}"
                blocker = demand
        # Max-min fair share of what is left: one GPU at a time to the smallest holder.
        heap = [
            (target[d.name], d.arrival, d.name, d.wanted)
            for d in tier
            if 0 < target[d.name] < d.wanted and d.name not in held_fixed
        ]
        heapq.heapify(heap)
        while free > 0 and heap:
            size, arrival, name, wanted = heapq.heappop(heap)
            target[name] = size + 1
            free -= 1
            if size + 1 < wanted:
                heapq.heappush(heap, (size + 1, arrival, name, wanted))
    return _Counts(target, waiting, admissions, held_fixed)


def _place(
    pool: Pool,
    ranked: Sequence[Demand],
    kept: Mapping[str, list[Slot]],
    target: Mapping[str, int],
    blocked: AbstractSet[Slot],
) -> dict[str, Placement]:
    """Choose slots: keep each job's prefix, then grow on its own hosts, then best fit."""
    layout: dict[str, dict[str, list[int]]] = {}
    taken: dict[str, set[int]] = {}
    for host, gpu in blocked:
        taken.setdefault(host, set()).add(gpu)
    for demand in ranked:
        size = target[demand.name]
        if size > 0:
            # Truncating the flat slot list removes the last GPU of the last host first.
            hosts = layout[demand.name] = _group(kept[demand.name][:size])
            for host, gpus in hosts.items():
                taken.setdefault(host, set()).update(gpus)
    free = _FreeGpus(pool, taken)
    need = {
        name: target[name] - sum(len(gpus) for gpus in hosts.values())
        for name, hosts in layout.items()
    }
    growers = [d for d in ranked if need.get(d.name, 0) > 0]
    for demand in growers:
        hosts = layout[demand.name]
        for host, gpus in hosts.items():
            count = min(need[demand.name], free.count(host))
            if count:
                gpus.extend(free.take(host, count))
                need[demand.name] -= count
    # Larger remainders first: decreasing-size best fit packs hosts tighter.
    rank = {d.name: position for position, d in enumerate(ranked)}
    for name in sorted((d.name for d in growers), key=lambda n: (-need[n], rank[n])):
        hosts = layout[name]
        while need[name] > 0:
            host = free.best_host(need[name])
            count = min(need[name], free.count(host))
            hosts.setdefault(host, []).extend(free.take(host, count))
            need[name] -= count
    return {
        name: Placement(tuple((host, tuple(gpus)) for host, gpus in hosts.items()))
        for name, hosts in layout.items()
    }


def _policy_cause(demand: Demand, size: int) -> str:
    wanted = demand.wanted
    if demand.desired > demand.max:
        wants = f"policy wants {demand.desired}, max is {demand.max}"
    elif demand.desired < demand.min:
        wants = f"policy wants {demand.desired}, min is {demand.min}"
    else:
        wants = f"policy wants {wanted}"
    return wants if size >= wanted else f"{wants}, no more free"


class _Reasons:
    """Writes the human-readable reason of each grant."""

    def __init__(
        self,
        ranked: Sequence[Demand],
        held: Mapping[str, int],
        kept: Mapping[str, list[Slot]],
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
            extra = "" if new == demand.min else f", {_policy_cause(demand, new)}"
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
            return f"holding {new}: {replaced}{_policy_cause(demand, new)}"
        if new > old:
            return f"grown {old} -> {new}: {_policy_cause(demand, new)}"
        if new == kept:
            return f"shrunk {old} -> {new}: {_gpus(lost)} left the pool"
        if new > kept:
            cause = _policy_cause(demand, new)
            return f"shrunk {old} -> {new}: {_gpus(lost)} left the pool; {cause}"
        if new == demand.wanted:
            if demand.desired > demand.max:
                return f"shrunk {old} -> {new}: max is {demand.max}"
            return f"shrunk {old} -> {new}: {_policy_cause(demand, new)}"
        return f"shrunk {old} -> {new}: {self._taker(demand)}"

    def _taker(self, demand: Demand) -> str:
        admissions = self._counts.admissions
        if admissions and admissions[0].priority >= demand.priority:
            return f"admitting {admissions[0].name} (min {admissions[0].min})"
        gainer = self._gainer
        if gainer is None or gainer.priority < demand.priority:
            return "fewer GPUs in the pool"
        if gainer.priority == demand.priority:
            return f"fair share with {gainer.name}"
        return f"{gainer.name} (priority {gainer.priority}) grew"


def arbitrate(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    *,
    frozen: AbstractSet[str] = frozenset(),
    unavailable: AbstractSet[Slot] = frozenset(),
) -> dict[str, Grant]:
    """Decide every job's GPUs; returns one Grant per demand, in priority/arrival order.

    Jobs in `current` without a demand are dropped and their GPUs are free.
    `frozen` names jobs that resized too recently (see the module docstring); names
    without a demand are ignored. `unavailable` GPUs (draining, held by an adopted job)
    are granted to nobody: the decision is the one on the pool without them, without
    building that pool.
    Raises ValueError if two demands share a name or two current placements share a GPU.
    """
    by_name = sorted(demands, key=lambda d: d.name)
    for first, second in itertools.pairwise(by_name):
        if first.name == second.name:
            raise ValueError(f"two demands are named {first.name}")
    ranked = sorted(demands, key=_rank)
    in_pool = pool.slot_set
    blocked = {slot for slot in unavailable if slot in in_pool}
    held, kept = _kept_slots(pool, by_name, current, blocked)
    counts = _count(pool.size - len(blocked), ranked, kept, frozen)
    placements = _place(pool, ranked, kept, counts.target, blocked)
    reasons = _Reasons(ranked, held, kept, counts)
    return {
        d.name: Grant(placements.get(d.name, Placement.EMPTY), reasons.reason(d)) for d in ranked
    }
