"""The order in which sharing jobs get GPUs (`policies/sharing.py`): admission before growth
(`SharingLimits.admit_first`) and whole GPUs before crowded shared ones
(`SharingLimits.whole_first`). Their properties (never over-committed, the exclusive rules,
deciding again changes nothing) are `test_sharing.py`'s hypothesis test, which draws both."""

from __future__ import annotations

from dataclasses import replace

from herd_operator.policies.sharing import SharingLimits, arbitrate_sharing
from herd_operator.specs.values import Placement, Pool
from tests.unit.test_sharing import GI, share, slots_of

ALONE = 40 * GI
"""A worker that fills a 40 GiB GPU: it shares with no one."""


def _on(*gpus: int) -> Placement:
    return Placement((("h0", gpus),))


def test_a_waiting_job_is_admitted_at_its_min_before_a_running_one_grows() -> None:
    pool = Pool.from_counts({"h0": 4}, gpu_memory_bytes=ALONE)
    running = replace(share("a", 1, ALONE), max=4, desired=4)
    waiting = replace(share("b", 2, ALONE, arrival=1.0), max=4, desired=4)
    current = {"a": _on(0)}
    plain = arbitrate_sharing(pool, [running, waiting], current, limits=SharingLimits())
    assert plain["a"].placement.size == 4 and plain["b"].placement.size == 0
    first = SharingLimits(admit_first=True)
    grants = arbitrate_sharing(pool, [running, waiting], current, limits=first)
    assert slots_of(grants, "b") == [("h0", 1), ("h0", 2)]  # its min, then a grows
    assert slots_of(grants, "a") == [("h0", 0), ("h0", 3)]
    assert grants["b"].reason == "admitted 0 -> 2: min 2 fits (sharing, 40.0Gi per worker)"


def test_free_gpus_are_kept_for_the_head_of_the_line_but_not_for_a_job_no_gpu_holds() -> None:
    pool = Pool.from_counts({"h0": 4}, gpu_memory_bytes=ALONE)
    running = replace(share("a", 1, ALONE), max=4, desired=4)
    waiting = share("b", 4, ALONE, arrival=1.0)  # needs every GPU: a holds one
    first = SharingLimits(admit_first=True)
    grants = arbitrate_sharing(pool, [running, waiting], {"a": _on(0)}, limits=first)
    assert grants["a"].placement.size == 1 and grants["b"].placement.size == 0
    assert grants["b"].reason == "pending: needs 4 GPU(s) with 40.0Gi free for sharing, 3 found"
    # Packing onto a shared GPU takes none the line waits for: a light job still joins.
    halves = replace(share("a", 1, ALONE // 2), max=4, desired=4)
    light = share("c", 1, ALONE // 2, arrival=2.0)
    grants = arbitrate_sharing(pool, [halves, waiting, light], {"a": _on(0)}, limits=first)
    assert slots_of(grants, "c") == [("h0", 0)] and grants["a"].placement.size == 1
    # A waiting job whose measured peak no GPU can hold would keep the GPUs free forever.
    hopeless = replace(waiting, measured_bytes=ALONE)  # 44 GiB with the margin
    grants = arbitrate_sharing(pool, [running, hopeless], {"a": _on(0)}, limits=first)
    assert grants["a"].placement.size == 4
    assert "above the pool's GPU memory" in grants["b"].reason


def test_a_busy_job_takes_a_free_gpu_before_crowding_a_shared_one() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    light = share("a", 1, GI, utilization=0.3)
    busy = share("b", 1, GI, arrival=1.0, utilization=0.8)
    current = {"a": _on(0)}
    cap = 1.29
    packed = arbitrate_sharing(
        pool, [light, busy], current, limits=SharingLimits(max_utilization=cap)
    )
    assert slots_of(packed, "b") == [("h0", 0)]  # 0.3 + 0.8 = 1.1 fits the cap: beside a
    whole = SharingLimits(max_utilization=cap, whole_first=True)
    grants = arbitrate_sharing(pool, [light, busy], current, limits=whole)
    assert slots_of(grants, "b") == [("h0", 1)]  # 1.1 > 1.0: a free GPU first
    # A job that leaves both within 1.0 still shares; with no free GPU the busy one shares.
    lighter = replace(busy, utilization=0.6)
    assert slots_of(arbitrate_sharing(pool, [light, lighter], current, limits=whole), "b") == [
        ("h0", 0)
    ]
    other = share("x", 1, 80 * GI, arrival=-1.0, utilization=0.2)
    full = {"a": _on(0), "x": _on(1)}
    grants = arbitrate_sharing(pool, [other, light, busy], full, limits=whole)
    assert slots_of(grants, "b") == [("h0", 0)]  # h0:1 is full: it shares, not waits


def test_with_smallest_first_a_small_sharing_job_is_not_held_behind_a_large_one() -> None:
    pool = Pool.from_counts({"h0": 1}, gpu_memory_bytes=ALONE)
    large = share("large", 2, ALONE)  # needs 2 GPUs of a pool of 1: heads the line in vain
    small = share("small", 1, ALONE, arrival=1.0)
    plain = arbitrate_sharing(pool, [large, small], {}, limits=SharingLimits())
    assert plain["small"].placement.size == 0  # behind the head of the line
    grants = arbitrate_sharing(
        pool, [large, small], {}, limits=SharingLimits(), smallest_first=True
    )
    assert slots_of(grants, "small") == [("h0", 0)]
    # A job pending past the bound (overdue) goes first again, smallest or not.
    late = arbitrate_sharing(
        pool, [large, small], {}, limits=SharingLimits(), smallest_first=True,
        overdue={"large"},
    )  # fmt: skip
    assert late["small"].placement.size == 0
