"""`arbitration`: one full `arbitrate()` decision on a Perlmutter-sized pool."""

from __future__ import annotations

import random

from herd_operator.bench.harness import Context, Row, Stats, timed_repeats
from herd_operator.policies.arbitration import arbitrate
from herd_operator.specs.values import Demand, Placement, Pool


def perlmutter_pool(nodes: int, gpus_per_node: int = 4) -> Pool:
    return Pool.from_counts({f"nid{n:06d}": gpus_per_node for n in range(nodes)})


def seeded_demands(count: int, seed: int = 11) -> list[Demand]:
    rng = random.Random(seed)
    demands = []
    for index in range(count):
        low = rng.randint(1, 4)
        high = low + rng.choice((0, 0, 2, 4, 12))
        demands.append(
            Demand(
                name=f"job-{index:05d}",
                min=low,
                max=high,
                desired=rng.randint(low, high),
                priority=rng.choice((0, 0, 0, 1, 2)),
                arrival=float(index),
            )
        )
    return demands


def first_fit(pool: Pool, demands: list[Demand], current: dict[str, Placement]) -> int:
    """Keep current GPUs, then hand out free slots in pool order up to each wanted size.

    A lower bound of the work of any arbitration: one pass over the pool and the demands.
    Returns how many GPUs it assigned (so the work cannot be optimised away).
    """
    taken = {slot for placement in current.values() for slot in placement.slots()}
    free = [slot for slot in pool.slots() if slot not in taken]
    assigned = 0
    for demand in demands:
        have = current.get(demand.name, Placement.EMPTY).size
        grow = min(max(0, demand.wanted - have), len(free))
        del free[:grow]
        assigned += have + grow
    return assigned


def run_arbitration(ctx: Context) -> list[Row]:
    nodes, jobs = (64, 100) if ctx.quick else (1792, 2000)
    pool = perlmutter_pool(nodes)
    demands = seeded_demands(jobs)
    previous = arbitrate(pool, demands[: jobs // 2], {})
    current = {name: grant.placement for name, grant in previous.items() if grant.admitted}
    ours: list[float] = []
    baseline: list[float] = []
    for _ in range(ctx.repeat):  # alternate, so drift hits both alike
        ours += timed_repeats(lambda: arbitrate(pool, demands, current), 1)
        baseline += timed_repeats(lambda: first_fit(pool, demands, current), 1)
    return [
        Row(
            name=f"arbitration ({nodes} nodes x 4 GPUs, {jobs} jobs)",
            what=f"one arbitrate() call, {len(current)} jobs already placed; goal < 100 ms",
            unit="ms",
            better="lower",
            baseline_label="first-fit of the same demands",
            baseline=Stats.of([s * 1000 for s in baseline]),
            ours=Stats.of([s * 1000 for s in ours]),
        )
    ]
