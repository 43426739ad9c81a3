"""Placement: which GPUs of the pool a job gets, once arbitration has said how many.

Pure, like arbitration (`arbitration.py`, which calls `place`): no I/O, no clock. A job keeps
its prefix (the GPUs it has, in local-rank order), grows on the hosts it already has, then
by best fit, larger remainders first; GPUs being given back (`late`) are taken only where no
other GPU is free. Apart from the counting because it is about slots, hosts and their free
lists, not about who deserves how many.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet

from herd_operator.specs.values import Demand, Placement, Pool, Slot


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


class _FreeGpus:
    """Free GPUs per host, plus hosts bucketed by free count for best fit."""

    def __init__(self, pool: Pool, taken: Mapping[str, AbstractSet[int]]) -> None:
        """`taken`: the GPUs in use, per host (all of them in the pool). A host's free list is
        made when a job takes from it: on a busy 1,792-node pool, listing every host's free
        GPUs for each decision cost more than the placing."""
        self._sorted = names = pool.sorted_hosts
        self._taken = taken
        self._free: dict[str, list[int]] = {}
        self._position = pool.host_positions
        self._by_count: dict[int, list[int]] = {}
        for count, positions in pool.positions_by_gpu_count.items():
            if count:
                self._by_count[count] = [p for p in positions if names[p][0] not in taken]
        partly: dict[int, list[int]] = {}
        for host, used in taken.items():
            position = self._position[host]
            left = len(self._sorted[position][1]) - len(used)
            if left > 0:
                partly.setdefault(left, []).append(position)
        for count, added in partly.items():
            bucket = self._by_count.setdefault(count, [])
            bucket.extend(added)
            bucket.sort()
        self._most = max(pool.positions_by_gpu_count, default=0)

    def _free_on(self, host: str) -> list[int]:
        free = self._free.get(host)
        if free is None:
            gpus = self._sorted[self._position[host]][1]
            used = self._taken.get(host)
            free = self._free[host] = (
                [gpu for gpu in gpus if gpu not in used] if used else list(gpus)
            )
        return free

    def count(self, host: str) -> int:
        if host not in self._position:
            return 0
        free = self._free.get(host)
        if free is not None:
            return len(free)
        return len(self._sorted[self._position[host]][1]) - len(self._taken.get(host, ()))

    def take(self, host: str, count: int) -> list[int]:
        """Remove and return the `count` lowest free GPUs of `host`."""
        free = self._free_on(host)
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
                return self._sorted[self._by_count[count][0]][0]
        for count in range(min(need, self._most + 1) - 1, 0, -1):
            if self._by_count.get(count):
                return self._sorted[self._by_count[count][0]][0]
        raise ValueError(f"no free GPU left for a job needing {_gpus(need)}")


def group_slots(slots: Iterable[Slot]) -> dict[str, list[int]]:
    grouped: dict[str, list[int]] = {}
    for host, gpu in slots:
        grouped.setdefault(host, []).append(gpu)
    return grouped


def place(
    pool: Pool,
    ranked: Sequence[Demand],
    current: Mapping[str, Placement],
    kept: Mapping[str, Sequence[Slot]],
    target: Mapping[str, int],
    blocked: AbstractSet[Slot],
    late: AbstractSet[Slot] = frozenset(),
) -> dict[str, Placement]:
    """Choose slots: keep each job's prefix, then grow on its own hosts, then best fit; the
    `late` slots only once no other GPU is free."""
    placements: dict[str, Placement] = {}
    layout: dict[str, dict[str, list[int]]] = {}
    need: dict[str, int] = {}
    kept_placements: list[Placement] = []
    for demand in ranked:
        name = demand.name
        size = target[name]
        if size <= 0:
            continue
        slots = kept[name]
        before = current.get(name, Placement.EMPTY)
        if size == len(slots) == before.size and not before.has_empty_host:
            # Keeps exactly what it holds (most jobs in most decisions): the same placement.
            placements[name] = before
            kept_placements.append(before)
            continue
        # Truncating the flat slot list removes the last GPU of the last host first.
        layout[name] = group_slots(slots[:size])
        need[name] = size - min(size, len(slots))
    growers = [d for d in ranked if need.get(d.name, 0) > 0]
    if growers:
        # Which GPUs are taken matters only to growers: most decisions have none to place.
        _grow_all(pool, ranked, growers, layout, need, _taken(blocked, kept_placements), late)
    placements.update(
        (name, Placement(tuple((host, tuple(gpus)) for host, gpus in hosts.items())))
        for name, hosts in layout.items()
    )
    return placements


def _taken(blocked: AbstractSet[Slot], kept: Sequence[Placement]) -> dict[str, set[int]]:
    """Per host, the GPUs nobody may grow onto: the blocked ones and those kept as they are."""
    taken: dict[str, set[int]] = {}
    for host, gpu in blocked:
        taken.setdefault(host, set()).add(gpu)
    for placement in kept:
        for host, held in placement.hosts:
            taken.setdefault(host, set()).update(held)
    return taken


def _grow_all(
    pool: Pool,
    ranked: Sequence[Demand],
    growers: Sequence[Demand],
    layout: Mapping[str, dict[str, list[int]]],
    need: dict[str, int],
    taken: dict[str, set[int]],
    late: AbstractSet[Slot],
) -> None:
    """Give every grower what it needs: from the GPUs free now first, then, if some still
    need more, from the `late` ones too."""
    for hosts in layout.values():
        for host, gpus in hosts.items():
            taken.setdefault(host, set()).update(gpus)
    rank = {d.name: position for position, d in enumerate(ranked)}
    early = taken
    if late:
        early = {host: set(gpus) for host, gpus in taken.items()}
        for host, gpu in late:
            early.setdefault(host, set()).add(gpu)
    _grow(growers, layout, need, _FreeGpus(pool, early), rank, pool.size - _count_taken(early))
    if late and any(need[d.name] > 0 for d in growers):
        for hosts in layout.values():
            for host, gpus in hosts.items():
                taken.setdefault(host, set()).update(gpus)
        free = _FreeGpus(pool, taken)
        _grow(growers, layout, need, free, rank, pool.size - _count_taken(taken))


def _count_taken(taken: Mapping[str, AbstractSet[int]]) -> int:
    return sum(len(gpus) for gpus in taken.values())


def _grow(
    growers: Sequence[Demand],
    layout: Mapping[str, dict[str, list[int]]],
    need: dict[str, int],
    free: _FreeGpus,
    rank: Mapping[str, int],
    left: int,
) -> None:
    """Give the growers what they still `need` from `free` (`left` GPUs in it): first on
    the hosts each already has, then best fit, larger remainders first (decreasing-size
    best fit packs hosts tighter). Stops when `free` runs out."""
    for demand in growers:
        hosts = layout[demand.name]
        for host, gpus in hosts.items():
            count = min(need[demand.name], free.count(host))
            if count:
                gpus.extend(free.take(host, count))
                need[demand.name] -= count
                left -= count
    for name in sorted((d.name for d in growers), key=lambda n: (-need[n], rank[n])):
        hosts = layout[name]
        while need[name] > 0 and left > 0:
            host = free.best_host(need[name])
            count = min(need[name], free.count(host))
            hosts.setdefault(host, []).extend(free.take(host, count))
            need[name] -= count
            left -= count
