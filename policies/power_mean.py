"""Dividing the GPUs above the mins by the power mean of the jobs' speedups (Pollux-like).

`arbitrate(share_by_speedup=True)` hands a tier's GPUs above its admitted jobs' mins out so
as to maximise the power mean with exponent -1 (the harmonic mean) of the jobs' speedups,
as Pollux's scheduler does (Qiao et al., OSDI 2021, section 4.2). A job's speedup at n GPUs
is its goodput there over its goodput at a fair share of the pool (the pool over the jobs of
the decision, within its min and max): 1 means "as well off as with an equal share". The
harmonic mean is dominated by the jobs worst off, so a GPU goes where it lifts the job
furthest behind its fair share, not where it adds most goodput in absolute terms (that is
`share_by_gain`'s sum, which starves jobs whose goodput grows late, such as those whose
gradient noise starts small).

A job's goodput at each size comes from what its policy reports (`Demand.gains` above its
min, `Demand.min_speedup` at it, both in share of one GPU's goodput; `gain_of_next` for a
job that reports none: a whole GPU for each up to its wish, nothing past it).

The search is greedy by marginal gain of the objective: maximising the harmonic mean is
minimising `sum_j G_j(fair_j) / G_j(n_j)`, a sum of one term per job; when each job's goodput
`G_j` is concave in its size (Amdahl's and the goodput policy's are, up to the batch
choice's steps), each term is convex and falls with `n_j`, and handing out GPUs one at a
time to the job whose term falls most is optimal for a separable convex objective under a
total (the greedy of Gross, 1956). A GPU that lowers no term is not handed out.
Where a job's goodput is not concave (Pollux's step-time form across a node's edge: the 5th
GPU on 4-GPU nodes adds about nothing, 8 beat 4), a one-GPU greedy stops at the edge; so a
job's step is its grow, within the GPUs left, that lowers its term most per GPU: one GPU
where the curve is concave (the same division as before), the whole way across a dip
otherwise. It is then a heuristic (not always the best division), but it never stops a job
inside a dip, where its goodput is below what a smaller size gives.

A resize has a cost, which the greedy alone does not see: a grow stalls the job's workers
(`GROW_STALL_SECONDS` under the default launch, docs/benchmarks.md), a shrink hardly (0.3 s,
not counted). So a running job is grown only if, over `RESIZE_HORIZON_SECONDS` from now,
its goodput at the new size after the stall does more than at its current size without:
`G(new) x (horizon - stall) > G(current) x horizon`. The jobs whose grow does not pay are
held at their current size and the rest divided again, until none is (each round holds at
least one more job, so there are at most as many rounds as jobs). A job being admitted is
not charged: it starts anyway.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence

from herd_operator.specs.values import Demand

GROW_STALL_SECONDS = 8.6
"""What a grow costs a running job, here and in the simulator (`simulate/model.py`): the
median `resize-stall 2->4` under the operator with its default launch, the in-process driver
(docs/benchmarks.md, run 8: 8.57 s, n = 3, load average 7-8; new workers import torch and
Horovod, then Gloo's rendezvous). Run 3 (n = 10, horovodrun launch) had 9.6 s."""
_TIE = 1e-9
"""Falls per GPU within this share of each other are taken as equal (the smaller grow wins):
the average of equal gains over several GPUs may round a hair above one GPU's."""
RESIZE_HORIZON_SECONDS = 300.0
"""How long a grow is expected to pay before the division changes the job again: five of
Pollux's 60 s periods. A grow must add more than `GROW_STALL_SECONDS / this` (2.9%) of the
job's goodput."""


def gain_of_next(demand: Demand, size: int) -> float | None:
    """What GPU `size + 1` adds to `demand` as the divisions by gain count it: its reported
    gain (None past the last one: not given); a job that reports no gains (`static`,
    `memory`) is taken to gain a whole GPU from each up to its wish, and nothing past it."""
    if demand.gains:
        above = size - demand.min
        return demand.gains[above] if 0 <= above < len(demand.gains) else None
    return 1.0 if size < demand.wanted else None


def goodput_curve(demand: Demand) -> tuple[float, ...]:
    """The job's goodput at its min, min + 1, ... as far as `gain_of_next` goes, in share of
    one GPU's: from `Demand.min_speedup` (its min when not reported: linear up to it)."""
    start = demand.min_speedup if demand.min_speedup is not None else float(demand.min)
    values = [start]
    size = demand.min
    while size < demand.max:
        gain = gain_of_next(demand, size)
        if gain is None:
            break
        values.append(values[-1] + gain)
        size += 1
    return tuple(values)


def fair_share(pool_gpus: int, jobs: int) -> int:
    """GPUs per job if the pool were split evenly among `jobs` (at least one)."""
    return max(1, math.ceil(pool_gpus / max(jobs, 1)))


class _Job:
    """One job of the division: its curve from its min, its weight (goodput at its fair
    share) and its current size (0: being admitted)."""

    __slots__ = ("curve", "demand", "floor", "held", "terms", "weight")

    def __init__(self, demand: Demand, fair: int, held: int) -> None:
        self.demand = demand
        self.curve = goodput_curve(demand)
        top = demand.min + len(self.curve) - 1
        self.weight = self.goodput(max(demand.min, min(top, fair)))
        self.held = held
        # The job's term of the objective at its min, min + 1, ...: its weight over its
        # goodput there; and the least term at each size or past it, which bounds the fall
        # of a longer grow.
        self.terms = tuple(self.weight / v if v > 0 else math.inf for v in self.curve)
        floor = list(self.terms)
        for index in range(len(floor) - 2, -1, -1):
            floor[index] = min(floor[index], floor[index + 1])
        self.floor = tuple(floor)

    def goodput(self, size: int) -> float:
        return self.curve[size - self.demand.min]

    def best_step(self, size: int, free: int) -> tuple[float, int] | None:
        """The grow from `size` by at most `free` GPUs whose term falls most per GPU, and
        that fall per GPU (the smallest grow of the most, within a relative `_TIE`); None if
        none lowers the term (or none is left of the curve)."""
        terms, floor, low = self.terms, self.floor, self.demand.min
        here = terms[size - low]
        top = min(low + len(terms) - 1, size + free)
        best: tuple[float, int] | None = None
        for to in range(size + 1, top + 1):
            if best is not None and here - floor[to - low] <= best[0] * (to - size):
                break  # no grow this long or longer falls faster per GPU
            there = terms[to - low]
            if there == here:  # also both infinite: nothing gained
                continue
            rate = math.inf if math.isinf(here) else (here - there) / (to - size)
            if rate > 0 and (best is None or rate > best[0] * (1.0 + _TIE)):
                best = (rate, to)
        return best

    def grow_pays(self, size: int) -> bool:
        """Whether growing from its current size to `size` is worth its stall."""
        if self.held < self.demand.min or size <= self.held:
            return True
        horizon = RESIZE_HORIZON_SECONDS
        return self.goodput(size) * (horizon - GROW_STALL_SECONDS) > (
            self.goodput(min(self.held, self.demand.max)) * horizon
        )


def _greedy(jobs: Sequence[_Job], sizes: dict[str, int], free: int) -> int:
    """`free` GPUs to the jobs, each time to the job whose term falls most per GPU by its
    best grow that the GPUs left allow (`_Job.best_step`: one GPU, or several where its
    goodput is not concave, across a node's edge), ties to the job holding fewest, then by
    arrival, then name; updates `sizes`, returns the GPUs left."""
    heap: list[tuple[float, int, float, str, int]] = []
    by_name: dict[str, _Job] = {}
    for job in jobs:
        name = job.demand.name
        by_name[name] = job
        step = job.best_step(sizes[name], free)
        if step is not None:
            heap.append((-step[0], sizes[name], job.demand.arrival, name, step[1]))
    heapq.heapify(heap)
    while free > 0 and heap:
        _, size, arrival, name, to = heapq.heappop(heap)
        job = by_name[name]
        if to - size > free:
            # Fewer GPUs are left than this grow takes: its best affordable one, whose fall
            # per GPU is at most this one's, goes back in its place.
            step = job.best_step(size, free)
            if step is not None:
                heapq.heappush(heap, (-step[0], size, arrival, name, step[1]))
            continue
        sizes[name] = to
        free -= to - size
        step = job.best_step(to, free)
        if step is not None:
            heapq.heappush(heap, (-step[0], to, arrival, name, step[1]))
    return free


def divide_by_speedup(
    demands: Sequence[Demand],
    start: Mapping[str, int],
    held: Mapping[str, int],
    free: int,
    fair: int,
) -> tuple[dict[str, int], int]:
    """The sizes of `demands` (a tier's admitted, unfrozen jobs, each at `start`, its min)
    once `free` more GPUs are divided by the harmonic mean of their speedups, and the GPUs
    left. `held`: each one's current size (0 or under its min: being admitted); `fair`: the
    fair share its speedup is counted against. Never below `start`, never above a job's max
    or past its reported curve, never more than `free` in all; a running job grows only if
    the grow pays its stall (the module docstring)."""
    jobs = [_Job(d, fair, held.get(d.name, 0)) for d in demands]
    kept: dict[str, int] = {}
    while True:
        sizes = {job.demand.name: start[job.demand.name] for job in jobs}
        sizes.update(kept)
        left = free - sum(size - start[name] for name, size in kept.items())
        left = _greedy([job for job in jobs if job.demand.name not in kept], sizes, left)
        unpaid = {
            job.demand.name: max(start[job.demand.name], min(job.held, job.demand.max))
            for job in jobs
            if job.demand.name not in kept and not job.grow_pays(sizes[job.demand.name])
        }
        if not unpaid:
            return sizes, left
        kept.update(unpaid)
