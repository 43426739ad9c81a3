"""Sharing only where the division of whole GPUs leaves a job waiting (issue 30, session 11:
`SharingLimits.share_when_waiting`, `policies/sharing_division.py`), and the size-only
division it reads (`arbitration.divided_sizes`), checked against `arbitrate` itself."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.cli.arguments import UsageError
from herd_operator.cli.main import build_parser
from herd_operator.cli.run import sharing_limits
from herd_operator.policies.arbitration import arbitrate, divided_sizes, ranked_demands
from herd_operator.policies.sharing import SharingLimits, arbitrate_sharing
from herd_operator.policies.sharing_text import describe_sharing
from herd_operator.specs.values import Demand, Grant, Placement, Pool, Slot
from tests.unit.test_sharing import GI, placed_of, slots_of

WHEN_WAITING = SharingLimits(max_utilization=1.29, whole_first=True, share_when_waiting=True)


def _elastic(name: str, low: int, high: int, gains: tuple[float, ...], **fields: object) -> Demand:
    """A sharing job of 10 GiB per worker, from `low` to `high` GPUs, wanting its max."""
    demand = Demand(name, low, high, high, gains=gains)
    return replace(demand, share=True, memory_bytes=10 * GI, utilization=0.3, **fields)  # type: ignore[arg-type]


def _sizes(grants: dict[str, Grant]) -> dict[str, int]:
    return {job: grant.placement.size for job, grant in grants.items()}


def _shared(grants: dict[str, Grant]) -> set[Slot]:
    seen: set[Slot] = set()
    twice: set[Slot] = set()
    for grant in grants.values():
        for slot in grant.placement.slots():
            (twice if slot in seen else seen).add(slot)
    return twice


def test_when_nothing_waits_the_sharers_get_the_division_by_speedup_on_whole_gpus() -> None:
    pool = Pool.from_counts({"h0": 4, "h1": 4}, gpu_memory_bytes=40 * GI)
    # a scales well, b hardly past 2 GPUs: the harmonic mean of speedups gives a more.
    a = _elastic("a", 1, 6, (0.95, 0.9, 0.9, 0.85, 0.8))
    b = _elastic("b", 1, 6, (0.5, 0.05, 0.05, 0.05, 0.05), arrival=1.0)
    exclusive = [replace(d, share=False) for d in (a, b)]
    divided = _sizes(arbitrate(pool, exclusive, {}, share_by_speedup=True))
    grants = arbitrate_sharing(pool, [a, b], {}, limits=WHEN_WAITING, share_by_speedup=True)
    assert _sizes(grants) == divided and divided["a"] > divided["b"]
    assert not _shared(grants)
    # Without the option the first job grows to what it wants and the second packs beside it.
    packed = arbitrate_sharing(
        pool, [a, b], {}, limits=replace(WHEN_WAITING, share_when_waiting=False),
        share_by_speedup=True,
    )  # fmt: skip
    assert packed["a"].placement.size == 6 and _shared(packed)
    # Deciding again from the grants changes nothing.
    again = arbitrate_sharing(
        pool, [a, b], placed_of(grants), limits=WHEN_WAITING, share_by_speedup=True,
        previous=grants,
    )  # fmt: skip
    assert placed_of(again) == placed_of(grants)


def test_a_job_the_division_leaves_waiting_shares_a_gpu_at_its_min_and_grows_no_further() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=40 * GI)
    a = _elastic("a", 1, 2, (0.9,))
    b = _elastic("b", 1, 1, ())
    current = {"a": Placement((("h0", (0,)),)), "b": Placement((("h0", (1,)),))}
    c = _elastic("c", 1, 2, (0.9,), arrival=2.0)  # arrives with every GPU held at the mins
    exclusive = [replace(d, share=False) for d in (a, b, c)]
    assert arbitrate(pool, exclusive, current, share_by_speedup=True)["c"].placement.size == 0
    grants = arbitrate_sharing(pool, [a, b, c], current, limits=WHEN_WAITING, share_by_speedup=True)
    assert grants["c"].placement.size == 1  # at its min, though it wants 2
    assert _shared(grants) == set(slots_of(grants, "c"))
    assert _sizes(grants) == {"a": 1, "b": 1, "c": 1}
    assert "sharing, 10.0Gi per worker" in grants["c"].reason
    # A job whose min fits nowhere beside others waits, and says what it needs.
    big = replace(_elastic("d", 2, 2, (), arrival=3.0), memory_bytes=35 * GI)
    grants = arbitrate_sharing(
        pool, [a, b, big], current, limits=WHEN_WAITING, share_by_speedup=True
    )  # fmt: skip
    assert grants["d"].placement.size == 0 and grants["d"].reason.startswith("pending: needs 2")


def test_a_job_the_division_admits_takes_a_free_gpu_before_a_light_shared_one() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=40 * GI)
    a = _elastic("a", 1, 1, ())
    b = _elastic("b", 1, 1, (), arrival=1.0)
    current = {"a": Placement((("h0", (0,)),))}
    grants = arbitrate_sharing(pool, [a, b], current, limits=WHEN_WAITING)
    assert slots_of(grants, "b") == [("h0", 1)]
    # Without the option, the light shared GPU comes first (it packs tighter).
    off = replace(WHEN_WAITING, share_when_waiting=False)
    assert slots_of(arbitrate_sharing(pool, [a, b], current, limits=off), "b") == [("h0", 0)]


def test_a_job_admitted_by_sharing_keeps_its_place_when_the_decision_is_made_again() -> None:
    # Hypothesis found it: counted from what each job held, the one admitted by sharing held
    # its min in the next division and took it from the higher tier's job, which shrank.
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=10)
    low = replace(Demand("low", 1, 1, 1, arrival=3.0), share=True, measured_bytes=1)
    high = replace(Demand("high", 1, 2, 2, priority=1, arrival=5.0), share=True, measured_bytes=1)
    limits = SharingLimits(max_jobs_per_gpu=2, shrink_to_admit=True, share_when_waiting=True)
    grants = arbitrate_sharing(pool, [low, high], {}, limits=limits)
    assert _sizes(grants) == {"high": 2, "low": 1} and len(_shared(grants)) == 1
    again = arbitrate_sharing(pool, [low, high], placed_of(grants), limits=limits)
    assert placed_of(again) == placed_of(grants)


def test_a_running_job_the_division_leaves_out_keeps_its_min_where_it_is() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=40 * GI)
    running = _elastic("r", 1, 2, (0.9,), arrival=1.0)
    current = {"r": Placement((("h0", (0, 1)),))}
    # A job of the higher tier arrives wanting both GPUs: the division gives it both.
    urgent = _elastic("u", 2, 2, (), priority=1, arrival=2.0)
    grants = arbitrate_sharing(pool, [running, urgent], current, limits=WHEN_WAITING)
    assert grants["r"].placement.size == 1 and set(slots_of(grants, "r")) < {("h0", 0), ("h0", 1)}
    assert grants["u"].placement.size == 2  # beside r on one GPU, alone on the other
    assert _shared(grants) == set(slots_of(grants, "r"))


def test_jobs_that_do_not_share_are_decided_as_before() -> None:
    pool = Pool.from_counts({"h0": 4}, gpu_memory_bytes=40 * GI)
    whole = Demand("w", 2, 2, 2)
    a = _elastic("a", 1, 4, (0.9, 0.9, 0.9), arrival=1.0)
    grants = arbitrate_sharing(pool, [whole, a], {}, limits=WHEN_WAITING, share_by_speedup=True)
    assert _sizes(grants) == {"w": 2, "a": 2} and not _shared(grants)


Division = tuple[Pool, list[Demand], dict[str, Placement], set[str], tuple[bool, ...]]
"""A case: the pool, the demands, their GPUs now, the frozen jobs, and `arbitrate`'s options
spare_by_gain, share_by_gain, share_by_speedup, smallest_first."""


@st.composite
def _divisions(
    draw: st.DrawFn,
) -> Division:
    """A small pool, jobs (some with gains), the GPUs some of them hold now (no GPU twice),
    the frozen ones and `arbitrate`'s sizing options."""
    counts = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    pool = Pool.from_counts({f"h{i}": n for i, n in enumerate(counts)})
    demands = []
    for index in range(draw(st.integers(1, 5))):
        low = draw(st.integers(1, 3))
        high = draw(st.integers(low, 6))
        gains = tuple(draw(st.lists(st.floats(0.0, 1.0), max_size=high - low)))
        demands.append(
            Demand(
                f"j{index}",
                low,
                high,
                draw(st.integers(1, 6)),
                priority=draw(st.integers(0, 1)),
                arrival=float(index),
                gains=gains,
            )
        )
    free = list(pool.slots())
    current: dict[str, Placement] = {}
    for demand in demands:
        size = draw(st.integers(0, min(demand.max, len(free))))
        if size:
            taken, free = free[:size], free[size:]
            hosts = itertools.groupby(taken, key=lambda slot: slot[0])
            current[demand.name] = Placement(
                tuple((host, tuple(gpu for _, gpu in group)) for host, group in hosts)
            )
    frozen = {name for name in current if draw(st.booleans())}
    options = tuple(draw(st.booleans()) for _ in range(4))
    return pool, demands, current, frozen, options


@given(_divisions())
@settings(max_examples=300)
def test_the_size_only_division_is_arbitrates(
    case: Division,
) -> None:
    pool, demands, current, frozen, (spare, by_gain, by_speedup, smallest) = case
    grants = arbitrate(
        pool, demands, current, frozen=frozen, spare_by_gain=spare, share_by_gain=by_gain,
        share_by_speedup=by_speedup, smallest_first=smallest,
    )  # fmt: skip
    ranked = ranked_demands(demands, smallest_first=smallest)
    held = {job: placement.size for job, placement in current.items()}
    sizes = divided_sizes(
        pool.size, ranked, held, frozen=frozen, spare_by_gain=spare, share_by_gain=by_gain,
        share_by_speedup=by_speedup,
    )  # fmt: skip
    assert sizes == _sizes(grants)


def test_the_option_is_named_in_the_log_line_and_needs_share_gpus() -> None:
    assert describe_sharing(WHEN_WAITING).endswith(
        "sized by the division of whole GPUs, sharing only to admit who it leaves waiting)"
    )
    parser = build_parser()
    args = parser.parse_args(
        ["run", "--share-gpus", "--gpu-memory", "40GiB", "--share-when-waiting"]
    )
    limits = sharing_limits(args, virtual=False)
    assert limits is not None and limits.share_when_waiting
    with pytest.raises(UsageError, match="--share-when-waiting: only with --share-gpus"):
        sharing_limits(parser.parse_args(["run", "--share-when-waiting"]), virtual=False)
