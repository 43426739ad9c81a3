"""The division of GPUs above the mins by the harmonic mean of speedups (`share_by_speedup`,
`policies/power_mean.py`): hand-made cases with known answers, brute force on small ones, and
the bounds as properties."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.arbitration import arbitrate
from herd_operator.policies.power_mean import (
    GROW_STALL_SECONDS,
    RESIZE_HORIZON_SECONDS,
    divide_by_speedup,
    fair_share,
)
from herd_operator.specs.values import Demand, Pool


def curve(demand: Demand) -> list[float]:
    """Goodput at min, min + 1, ... as the module's docstring says it is read, written again
    here so that the test does not read the code it checks."""
    values = [demand.min_speedup if demand.min_speedup is not None else float(demand.min)]
    # A job that reports no gains adds a whole GPU's goodput with each GPU up to its wish.
    for gain in demand.gains or (1.0,) * (demand.wanted - demand.min):
        values.append(values[-1] + gain)
    return values


def objective(demands: Sequence[Demand], sizes: Sequence[int], fair: int) -> float:
    """Sum over jobs of goodput at the fair share over goodput at its size: the harmonic
    mean of speedups is the number of jobs over this."""
    total = 0.0
    for demand, size in zip(demands, sizes, strict=True):
        values = curve(demand)
        at_fair = values[max(0, min(len(values) - 1, fair - demand.min))]
        total += at_fair / values[size - demand.min]
    return total


def best(demands: Sequence[Demand], free: int, fair: int) -> float:
    """The least objective of any division of `free` GPUs above the mins (brute force)."""
    ranges = [range(d.min, d.min + len(curve(d))) for d in demands]
    return min(
        objective(demands, sizes, fair)
        for sizes in itertools.product(*ranges)
        if sum(s - d.min for s, d in zip(sizes, demands, strict=True)) <= free
    )


def test_the_harmonic_mean_splits_where_the_summed_gain_gives_all_to_one() -> None:
    # a scales linearly, b at half: the summed gain gives a both spare GPUs (3 and 1); the
    # harmonic mean of speedups over a fair share of 2 gives one each: 2/2 + 1.5/1.5 = 2.0
    # against 2/3 + 1.5/1 = 2.17.
    a = Demand("a", 1, 4, 4, gains=(1.0, 1.0, 1.0))
    b = Demand("b", 1, 4, 4, arrival=1.0, gains=(0.5, 0.5, 0.5))
    sizes, left = divide_by_speedup([a, b], {"a": 1, "b": 1}, {}, 2, fair_share(4, 2))
    assert (sizes, left) == ({"a": 2, "b": 2}, 0)
    pool = Pool.from_counts({"n0": 4})
    by_gain = arbitrate(pool, [a, b], {}, share_by_gain=True)
    assert {n: g.placement.size for n, g in by_gain.items()} == {"a": 3, "b": 1}
    by_speedup = arbitrate(pool, [a, b], {}, share_by_speedup=True)
    assert {n: g.placement.size for n, g in by_speedup.items()} == {"a": 2, "b": 2}
    assert "divided by speedup" in by_speedup["b"].reason


def test_a_job_no_gpu_helps_gets_none_and_idle_gpus_stay_free() -> None:
    flat = Demand("flat", 1, 4, 4, gains=(0.0, 0.0, 0.0))
    sizes, left = divide_by_speedup([flat], {"flat": 1}, {}, 3, 4)
    assert (sizes, left) == ({"flat": 1}, 3)


def test_the_job_furthest_behind_its_fair_share_is_lifted_first() -> None:
    # Two identical jobs, one held at its min of 1, the other of 3: the one GPU goes to the
    # job at 1 (its term falls from 2/1 to 2/2; the other's from 2/3 to 2/4).
    small = Demand("small", 1, 4, 4, arrival=5.0, gains=(1.0, 1.0, 1.0))
    large = Demand("large", 3, 6, 6, gains=(1.0, 1.0, 1.0), min_speedup=3.0)
    sizes, left = divide_by_speedup([small, large], {"small": 1, "large": 3}, {}, 1, 2)
    assert (sizes, left) == ({"small": 2, "large": 3}, 0)


def test_a_running_job_is_not_grown_for_less_than_its_stall() -> None:
    # Running at 4 GPUs; a fifth adds 1% of its goodput, less than a grow's stall over the
    # horizon (8.6 s over 300 s: 2.9%): it stays at 4 and the GPU stays free.
    tiny = Demand("tiny", 2, 5, 5, gains=(1.0, 1.0, 0.04), min_speedup=2.0)
    sizes, left = divide_by_speedup([tiny], {"tiny": 2}, {"tiny": 4}, 3, 4)
    assert (sizes, left) == ({"tiny": 4}, 1)
    # Being admitted (nothing held), it is not charged: it starts anyway.
    sizes, left = divide_by_speedup([tiny], {"tiny": 2}, {}, 3, 4)
    assert (sizes, left) == ({"tiny": 5}, 0)
    # A gain above the stall's share is taken.
    worth = Demand("tiny", 2, 5, 5, gains=(1.0, 1.0, 0.2), min_speedup=2.0)
    assert GROW_STALL_SECONDS / RESIZE_HORIZON_SECONDS < 0.2 / 4
    assert divide_by_speedup([worth], {"tiny": 2}, {"tiny": 4}, 3, 4) == ({"tiny": 5}, 0)


def test_a_grow_that_does_not_pay_leaves_its_gpus_to_the_others() -> None:
    # `held` runs at 3 and would get a fourth worth 1% of its goodput (more to the objective
    # than `new`'s next GPU): held at 3, that GPU goes to `new`.
    held = Demand("held", 1, 4, 4, gains=(1.0, 1.0, 0.03))
    new = Demand("new", 1, 3, 3, arrival=1.0, gains=(0.001, 0.001))
    sizes, left = divide_by_speedup([held, new], {"held": 1, "new": 1}, {"held": 3}, 3, 2)
    assert (sizes, left) == ({"held": 3, "new": 2}, 0)


def test_a_job_is_grown_across_a_node_edge_where_the_gpus_across_pay() -> None:
    # `edge` runs on one 4-GPU node; a 5th GPU crosses to a second node and adds nothing
    # (its gains as `goodput` reports them: the running max's), 5..8 together add 1.8.
    # `slow` gains 0.05 a GPU. A one-GPU greedy stops `edge` at 4 (its next GPU lowers
    # nothing) and gives `slow` all 4; the best division (brute force) gives `edge` all 4.
    edge = Demand("edge", 4, 8, 8, gains=(0.0, 0.4, 0.6, 0.8), min_speedup=3.6)
    slow = Demand("slow", 1, 5, 5, arrival=1.0, gains=(0.05, 0.05, 0.05, 0.05))
    sizes, left = divide_by_speedup([edge, slow], {"edge": 4, "slow": 1}, {}, 4, 4)
    assert (sizes, left) == ({"edge": 8, "slow": 1}, 0)
    assert objective([edge, slow], [8, 1], 4) == pytest.approx(best([edge, slow], 4, 4))
    # With 2 GPUs free `edge` reaches 6 at most, which pays less than `slow`'s two GPUs:
    # `slow` takes them (the best division too), and `edge` is not left inside the dip.
    sizes, left = divide_by_speedup([edge, slow], {"edge": 4, "slow": 1}, {}, 2, 4)
    assert (sizes, left) == ({"edge": 4, "slow": 3}, 0)
    assert objective([edge, slow], [4, 3], 4) == pytest.approx(best([edge, slow], 2, 4))
    pool = Pool.from_counts({"n0": 4, "n1": 4, "n2": 4})
    grants = arbitrate(pool, [edge, slow, Demand("c", 3, 3, 3, arrival=2.0)], {},
                       share_by_speedup=True)  # fmt: skip
    assert {n: g.placement.size for n, g in grants.items()} == {"edge": 8, "slow": 1, "c": 3}


ANY_GAINS = st.lists(st.sampled_from([0.0, 0.05, 0.3, 1.0]) | st.floats(0.0, 1.0), max_size=4)


@given(st.lists(ANY_GAINS, min_size=1, max_size=3))
@settings(max_examples=300, deadline=None)
def test_with_gpus_for_all_each_job_reaches_its_best_size_past_any_dip(
    gains_by_job: list[list[float]],
) -> None:
    demands = [
        Demand(f"j{i}", 1, 1 + len(gains), 1 + len(gains), arrival=float(i), gains=tuple(gains))
        for i, gains in enumerate(gains_by_job)
    ]
    free = sum(len(gains) for gains in gains_by_job)
    sizes, _ = divide_by_speedup(demands, {d.name: 1 for d in demands}, {}, free, 2)
    for d in demands:
        values = curve(d)
        # Its best goodput, and no more GPUs than the fewest that reach it.
        assert values[sizes[d.name] - 1] == max(values)
        assert sizes[d.name] - 1 == values.index(max(values))


GAINS = st.lists(st.floats(0.0, 1.0), max_size=3).map(lambda g: tuple(sorted(g, reverse=True)))


@st.composite
def divisions(draw: st.DrawFn) -> tuple[list[Demand], int, int]:
    count = draw(st.integers(1, 3))
    demands = []
    for index in range(count):
        low = draw(st.integers(1, 2))
        gains = draw(GAINS)
        high = low + max(len(gains), draw(st.integers(0, 3)))
        wish = draw(st.integers(low, high))
        at_min = draw(st.none() | st.floats(0.2, float(low)))
        demands.append(
            Demand(f"j{index}", low, high, wish, arrival=float(index), gains=gains,
                   min_speedup=at_min)
        )  # fmt: skip
    return demands, draw(st.integers(0, 6)), draw(st.integers(1, 4))


@given(divisions())
@settings(max_examples=300, deadline=None)
def test_without_resize_costs_the_division_is_the_best_one(
    case: tuple[list[Demand], int, int],
) -> None:
    demands, free, fair = case
    start = {d.name: d.min for d in demands}
    sizes, left = divide_by_speedup(demands, start, {}, free, fair)
    used = sum(sizes[d.name] - d.min for d in demands)
    assert left == free - used >= 0
    for d in demands:
        assert d.min <= sizes[d.name] <= d.max
        assert sizes[d.name] - d.min < len(curve(d))
    # Goodput concave in the size (gains that do not rise): the greedy is optimal.
    got = objective(demands, [sizes[d.name] for d in demands], fair)
    assert got == pytest.approx(best(demands, free, fair), rel=1e-9, abs=1e-12)
    # The same whatever the order the jobs come in.
    assert divide_by_speedup(demands[::-1], start, {}, free, fair) == (sizes, left)


@given(divisions(), st.lists(st.integers(0, 7), min_size=3, max_size=3))
@settings(max_examples=300, deadline=None)
def test_with_resize_costs_the_bounds_hold_and_no_unpaid_grow_is_made(
    case: tuple[list[Demand], int, int], held_sizes: list[int]
) -> None:
    demands, free, fair = case
    start = {d.name: d.min for d in demands}
    held = {d.name: size for d, size in zip(demands, held_sizes, strict=False)}
    sizes, left = divide_by_speedup(demands, start, held, free, fair)
    assert left == free - sum(sizes[d.name] - d.min for d in demands) >= 0
    for d in demands:
        assert d.min <= sizes[d.name] <= d.max
        now = held[d.name]
        if d.min <= now < sizes[d.name]:
            values = curve(d)
            grown, before = values[sizes[d.name] - d.min], values[min(now, d.max) - d.min]
            horizon = RESIZE_HORIZON_SECONDS
            assert grown * (horizon - GROW_STALL_SECONDS) > before * horizon
    assert divide_by_speedup(demands[::-1], start, held, free, fair) == (sizes, left)


def test_arbitrate_by_speedup_respects_the_pool_mins_and_frozen_jobs() -> None:
    pool = Pool.from_counts({"n0": 4, "n1": 4})
    a = Demand("a", 2, 8, 8, gains=(1.0,) * 6, min_speedup=2.0)
    b = Demand("b", 1, 8, 8, arrival=1.0, gains=(0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3))
    c = Demand("c", 4, 4, 4, arrival=2.0)
    grants = arbitrate(pool, [a, b, c], {}, share_by_speedup=True)
    sizes = {n: g.placement.size for n, g in grants.items()}
    assert sum(sizes.values()) <= pool.size
    assert sizes["c"] == 4 and sizes["a"] >= 2 and sizes["b"] >= 1
    # A frozen job keeps its placement as it is; the others divide the rest.
    current = {name: grants[name].placement for name in ("a", "b")}
    frozen = arbitrate(pool, [a, b], current, frozen={"a"}, share_by_speedup=True)
    assert frozen["a"].placement == current["a"]
    assert frozen["b"].placement.size == pool.size - current["a"].size
    assert sum(g.placement.size for g in frozen.values()) <= pool.size


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_a_demand_refuses_a_min_speedup_that_is_not_finite_and_positive(bad: float) -> None:
    with pytest.raises(ValueError, match=r"demand a: min_speedup must be finite and > 0"):
        Demand("a", 1, 2, 2, min_speedup=bad)
