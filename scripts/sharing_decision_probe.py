"""How long one allocator decision takes with GPU sharing by memory, on a Perlmutter-sized
pool (1,792 nodes x 4 GPUs of 80 GiB): a first decision for a burst of jobs, and the same
decision again with nothing changed, for whole-GPU jobs and for sharing ones (1, 2 or 4
workers of 5-40 GiB each, seeded). Run: `.venv/bin/python scripts/sharing_decision_probe.py`.
"""

from __future__ import annotations

import random
import time
from dataclasses import replace

from herd_operator.policies.sharing import SharingLimits, arbitrate_sharing
from herd_operator.specs.values import Demand, Pool

GI = 1 << 30


def demands(count: int, share: bool, rng: random.Random) -> list[Demand]:
    made = []
    for index in range(count):
        workers = rng.choice([1, 1, 2, 4])
        demand = Demand(f"j{index}", workers, workers, workers, arrival=float(index))
        if share:
            demand = replace(demand, share=True, memory_bytes=rng.randint(5, 40) * GI)
        made.append(demand)
    return made


def main() -> None:
    pool = Pool.from_counts({f"n{i}": 4 for i in range(1792)}, gpu_memory_bytes=80 * GI)
    for count in (1000, 4000):
        for share in (False, True):
            burst = demands(count, share, random.Random(1))
            started = time.perf_counter()
            grants = arbitrate_sharing(pool, burst, {}, limits=SharingLimits())
            first = time.perf_counter() - started
            held = {job: grant.placement for job, grant in grants.items() if grant.placement.size}
            started = time.perf_counter()
            arbitrate_sharing(pool, burst, held, limits=SharingLimits(), previous=grants)
            again = time.perf_counter() - started
            used = len({slot for placement in held.values() for slot in placement.slots()})
            print(
                f"{count} jobs, sharing {share}: first decision {first:.3f} s, again"
                f" {again:.3f} s; {len(held)} admitted on {used} GPUs"
            )


if __name__ == "__main__":
    main()
