"""GPU sharing by memory (`policies/sharing.py`): named cases, and properties of the packing
checked on generated pools, jobs and histories against a plain reference of what must hold."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.cli.arguments import UsageError
from herd_operator.cli.main import build_parser
from herd_operator.cli.run import sharing_limits
from herd_operator.controllers.job_status import ReconcilerBase
from herd_operator.policies.arbitration import arbitrate, rank_smallest_first
from herd_operator.policies.sharing import (
    SharingLimits,
    arbitrate_sharing,
    counted_utilization,
    worker_memory,
    worker_memory_at,
)
from herd_operator.runtime.allocator import Allocator
from herd_operator.specs import spec_fingerprint
from herd_operator.specs.loading import load_spec_text
from herd_operator.specs.quantity import parse_quantity
from herd_operator.specs.values import (
    Allocation,
    Demand,
    Grant,
    Placement,
    Pool,
    Slot,
)
from tests.unit.sinks import RecordingSink
from tests.unit.test_spec_loading import job_yaml

GI = 1 << 30
LIMITS = SharingLimits(max_jobs_per_gpu=4, margin=0.1)


def share(name: str, gpus: int, memory: int, **fields: object) -> Demand:
    return replace(Demand(name, gpus, gpus, gpus), share=True, memory_bytes=memory, **fields)  # type: ignore[arg-type]


def slots_of(grants: Mapping[str, Grant], job: str) -> list[Slot]:
    return list(grants[job].placement.slots())


def placed_of(grants: Mapping[str, Grant]) -> dict[str, Placement]:
    """The placements of the jobs granted GPUs: the `current` of the next decision."""
    return {job: grant.placement for job, grant in grants.items() if grant.placement.size}


def test_two_small_jobs_share_one_gpu_and_a_third_that_does_not_fit_waits() -> None:
    pool = Pool.from_counts({"h0": 1}, gpu_memory_bytes=80 * GI)
    demands = [share("a", 1, 30 * GI), share("b", 1, 30 * GI, arrival=1.0)]
    grants = arbitrate_sharing(pool, demands, {}, limits=LIMITS)
    assert slots_of(grants, "a") == slots_of(grants, "b") == [("h0", 0)]
    assert "sharing, 30.0Gi per worker" in grants["b"].reason
    third = share("c", 1, 30 * GI, arrival=2.0)
    current = {job: grant.placement for job, grant in grants.items()}
    grants = arbitrate_sharing(pool, [*demands, third], current, limits=LIMITS)
    assert grants["c"].placement.size == 0
    assert grants["c"].reason == "pending: needs 1 GPU(s) with 30.0Gi free for sharing, 0 found"


def test_a_job_never_has_two_workers_on_one_gpu() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    grants = arbitrate_sharing(pool, [share("a", 2, GI), share("b", 3, GI)], {}, limits=LIMITS)
    assert slots_of(grants, "a") == [("h0", 0), ("h0", 1)]
    assert grants["b"].placement.size == 0  # 3 workers, 2 GPUs


def test_a_measured_peak_with_its_margin_counts_over_a_smaller_request() -> None:
    demand = replace(share("a", 1, 10 * GI), measured_bytes=20 * GI)
    assert worker_memory(demand, 0.1) == 22 * GI
    assert worker_memory(replace(demand, measured_bytes=None), 0.1) == 10 * GI
    pool = Pool.from_counts({"h0": 1}, gpu_memory_bytes=40 * GI)
    grants = arbitrate_sharing(pool, [demand, share("b", 1, 20 * GI, arrival=1)], {}, limits=LIMITS)
    assert grants["b"].placement.size == 0  # 22 + 20 > 40, though the requests fit


def test_a_worker_whose_peak_grew_past_the_gpu_moves_to_where_it_fits() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=40 * GI)
    a, b = share("a", 1, 15 * GI), share("b", 1, 15 * GI, arrival=1)
    grants = arbitrate_sharing(pool, [a, b], {}, limits=LIMITS)
    assert slots_of(grants, "a") == slots_of(grants, "b") == [("h0", 0)]
    current = {job: grant.placement for job, grant in grants.items()}
    grown = replace(b, measured_bytes=30 * GI)  # 33 Gi with the margin: no longer beside a
    grants = arbitrate_sharing(pool, [a, grown], current, limits=LIMITS)
    assert slots_of(grants, "a") == [("h0", 0)] and slots_of(grants, "b") == [("h0", 1)]


def test_no_sharing_worker_beside_an_exclusive_job_and_exclusive_jobs_go_first() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    exclusive = Demand("x", 1, 1, 1)
    grants = arbitrate_sharing(pool, [exclusive, share("a", 2, GI, arrival=1)], {}, limits=LIMITS)
    assert slots_of(grants, "x") == [("h0", 0)]
    assert grants["a"].placement.size == 0  # needs 2 GPUs; the only one left is h0:1
    waiting = Demand("y", 2, 2, 2, arrival=2)
    small = share("s", 1, GI, arrival=3)
    grants = arbitrate_sharing(pool, [exclusive, waiting, small], {}, limits=LIMITS)
    # y (exclusive, priority 0) waits for 2 GPUs: a sharing job of its priority opens none.
    assert grants["y"].placement.size == 0 and grants["s"].placement.size == 0
    grants = arbitrate_sharing(
        pool, [exclusive, waiting, replace(small, priority=1)], {}, limits=LIMITS
    )
    assert slots_of(grants, "s") == [("h0", 1)]


def test_the_cap_on_jobs_per_gpu_holds() -> None:
    pool = Pool.from_counts({"h0": 1}, gpu_memory_bytes=80 * GI)
    demands = [share(f"j{i}", 1, GI, arrival=i) for i in range(4)]
    grants = arbitrate_sharing(pool, demands, {}, limits=SharingLimits(max_jobs_per_gpu=3))
    assert [grants[d.name].placement.size for d in demands] == [1, 1, 1, 0]


def test_a_utilization_cap_keeps_busy_jobs_apart_and_fills_the_busiest_gpu_first() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    limits = SharingLimits(max_utilization=1.3)
    busy = [
        share("a", 1, GI, utilization=0.9),
        share("b", 1, GI, arrival=1.0, utilization=0.5),
        share("c", 1, GI, arrival=2.0, utilization=0.8),
    ]
    grants = arbitrate_sharing(pool, busy, {}, limits=limits)
    # b joins a (1.4 > 1.3: no), so it opens the second GPU; c fits beside neither
    # (0.9 + 0.8, 0.5 + 0.8 = 1.3 fits b's): beside b.
    assert slots_of(grants, "a") == [("h0", 0)] and slots_of(grants, "b") == [("h0", 1)]
    assert slots_of(grants, "c") == [("h0", 1)]
    # Without the cap all three pack onto the first GPU by memory.
    plain = arbitrate_sharing(pool, busy, {}, limits=SharingLimits())
    assert {tuple(slots_of(plain, d.name)) for d in busy} == {(("h0", 0),)}
    # A light job goes where it fills the GPU closest to the cap: beside a (0.9 + 0.3),
    # not beside b (0.5 + 0.3); a job not measured yet counts as busy (1.0): alone only.
    current = {"a": Placement((("h0", (0,)),)), "b": Placement((("h0", (1,)),))}
    light = [*busy[:2], share("d", 1, GI, arrival=3.0, utilization=0.3)]
    assert slots_of(arbitrate_sharing(pool, light, current, limits=limits), "d") == [("h0", 0)]
    unknown = [*busy[:2], share("e", 1, GI, arrival=3.0)]
    assert arbitrate_sharing(pool, unknown, current, limits=limits)["e"].placement.size == 0


def test_a_job_splitting_its_batch_needs_less_per_worker_at_a_bigger_size() -> None:
    demand = replace(share("a", 1, 30 * GI), max=4, desired=4, memory_split_bytes=24 * GI)
    assert worker_memory_at(demand, 1, 0.1) == 30 * GI
    assert worker_memory_at(demand, 4, 0.1) == 12 * GI  # 6 fixed + 24 / 4
    assert worker_memory_at(replace(demand, measured_bytes=20 * GI), 4, 0.1) == 22 * GI
    # x leaves 20 GiB free on each of two GPUs: a needs 30 GiB at its min of 1, 6 + 24 / 2 =
    # 18 at 2: admitted at 2 at once; without the split (30 GiB at any size) it waits.
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    others = [share("x", 2, 60 * GI, arrival=-1.0)]
    wanting = replace(demand, max=2, desired=2)
    grants = arbitrate_sharing(pool, [*others, wanting], {}, limits=SharingLimits(margin=0.0))
    assert grants["a"].placement.size == 2
    whole = replace(wanting, memory_split_bytes=None)
    grants = arbitrate_sharing(pool, [*others, whole], {}, limits=SharingLimits(margin=0.0))
    assert grants["a"].placement.size == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"utilization": 1.5}, "utilization must be within [0, 1]"),
        ({"utilization": float("nan")}, "utilization must be within [0, 1]"),
        ({"memory_bytes": 10, "memory_split_bytes": 21}, "memory_split_bytes must be within"),
        ({"memory_split_bytes": 1}, "memory_split_bytes must be within"),
    ],
)
def test_a_bad_utilization_or_split_names_its_field(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        Demand("a", 2, 2, 2, **fields)
    with pytest.raises(ValueError, match="max_utilization must be finite and >= 1"):
        SharingLimits(max_utilization=0.9)


def test_with_sharing_off_or_no_sharing_job_the_decision_is_arbitrates() -> None:
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=80 * GI)
    demands = [share("a", 1, GI), share("b", 1, GI, arrival=1), Demand("c", 1, 1, 1, arrival=2)]
    assert arbitrate_sharing(pool, demands, {}, limits=None) == arbitrate(pool, demands, {})
    plain = [Demand("a", 1, 2, 2), Demand("b", 1, 2, 1, arrival=1)]
    assert arbitrate_sharing(pool, plain, {}, limits=LIMITS) == arbitrate(pool, plain, {})


def test_a_pool_without_known_memory_gives_each_sharing_worker_a_whole_gpu() -> None:
    pool = Pool.from_counts({"h0": 2})
    demands = [share("a", 1, GI), share("b", 1, GI, arrival=1), share("c", 1, GI, arrival=2)]
    grants = arbitrate_sharing(pool, demands, {}, limits=LIMITS)
    assert [grants[j].placement.size for j in "abc"] == [1, 1, 0]
    assert slots_of(grants, "a") != slots_of(grants, "b")


# ---- properties ----

CAPACITY = 10


@st.composite
def decisions(draw: st.DrawFn) -> tuple[Pool, list[Demand], SharingLimits]:
    counts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(any))
    pool = Pool.from_counts({f"h{i}": n for i, n in enumerate(counts)}, gpu_memory_bytes=CAPACITY)
    demands = []
    for index in range(draw(st.integers(1, 7))):
        low = draw(st.integers(1, 3))
        high = draw(st.integers(low, 4))
        demand = Demand(
            f"j{index}", low, high, draw(st.integers(0, 5)),
            priority=draw(st.integers(0, 1)), arrival=float(index),
        )  # fmt: skip
        if draw(st.integers(0, 3)):  # most jobs share: co-location is what is tested
            memory = draw(st.none() | st.integers(1, 12) | st.integers(1, 5))
            measured = draw(st.none() | st.integers(1, 12) | st.integers(1, 5))
            demand = replace(demand, share=True, memory_bytes=memory, measured_bytes=measured)
            busy = draw(st.none() | st.sampled_from([0.0, 0.2, 0.3, 0.5, 0.7, 1.0]))
            split = draw(st.none() | st.integers(0, (memory or 0) * low))
            demand = replace(demand, utilization=busy, memory_split_bytes=split)
        demands.append(demand)
    admit_first = draw(st.booleans())
    shrink_to_admit = not admit_first and draw(st.booleans())
    limits = SharingLimits(
        max_jobs_per_gpu=draw(st.integers(1, 4)), margin=0.1,
        max_utilization=draw(st.none() | st.sampled_from([1.0, 1.29, 2.0])),
        backfill=draw(st.booleans()), admit_first=admit_first,
        whole_first=draw(st.booleans()), shrink_to_admit=shrink_to_admit,
        share_to_admit=draw(st.booleans()), light_growth=draw(st.booleans()),
        move_apart=shrink_to_admit and draw(st.booleans()),
        share_when_waiting=draw(st.booleans()),
    )  # fmt: skip
    return pool, demands, limits


def _counted(demand: Demand, size: int, margin: float) -> int:
    """The reference's bytes for one worker of `demand` at `size`: its request at that size
    (the batch's split among `size` workers), its measured peak with the margin, or a GPU."""
    request = demand.memory_bytes or 0
    if demand.memory_split_bytes and size > demand.min:
        fixed = request - demand.memory_split_bytes / demand.min
        request = math.ceil(fixed + demand.memory_split_bytes / size)
    measured = math.ceil((demand.measured_bytes or 0) * (1 + margin))
    return max(request, measured) or CAPACITY


def _check_invariants(
    pool: Pool, demands: Sequence[Demand], grants: Mapping[str, Grant], limits: SharingLimits
) -> None:
    """The reference: what any decision must hold, computed plainly slot by slot."""
    by_name = {d.name: d for d in demands}
    assert set(grants) == set(by_name)
    on: dict[Slot, list[str]] = {}
    for name, grant in grants.items():
        demand, size = by_name[name], grant.placement.size
        assert size == 0 or demand.min <= size <= demand.max, (name, size)
        slots = grant.placement.slots()
        assert len(set(slots)) == len(slots)  # never two workers of a job on one GPU
        for slot in slots:
            assert slot in pool.slot_set
            on.setdefault(slot, []).append(name)
    for slot, names in on.items():
        if len(names) > 1:
            assert all(by_name[n].share for n in names), (slot, names)  # never beside exclusive
            assert len(names) <= limits.max_jobs_per_gpu
            sizes = {n: grants[n].placement.size for n in names}
            used = sum(_counted(by_name[n], sizes[n], limits.margin) for n in names)
            assert used <= CAPACITY, (slot, names, used)
            if limits.max_utilization is not None:
                busy = sum(counted_utilization(by_name[n]) for n in names)
                assert busy <= limits.max_utilization + 1e-9, (slot, names, busy)
    for name in grants:
        if by_name[name].share and grants[name].placement.size:
            size = grants[name].placement.size  # a worker fits alone at the size it runs at
            assert _counted(by_name[name], size, limits.margin) <= CAPACITY


def _head_of_line_not_left_out(
    pool: Pool,
    demands: Sequence[Demand],
    grants: Mapping[str, Grant],
    limits: SharingLimits,
    overdue: frozenset[str] | None = None,
) -> None:
    """Packing is maximal for the first sharing job left pending with nothing in the way:
    no exclusive job waits and no sharing job before it was left pending, so it could take
    any GPU no exclusive job holds; its min does not fit on those (each GPU with its room)."""
    exclusive_waiting = [d for d in demands if not d.share and not grants[d.name].placement.size]
    if exclusive_waiting:
        return
    held_exclusive = {
        slot for d in demands if not d.share for slot in grants[d.name].placement.slots()
    }
    if overdue is None:  # arrival order; else smallest first, the overdue before
        ranked = sorted((d for d in demands if d.share), key=lambda d: (-d.priority, d.arrival))
    else:
        ranked = sorted(
            (d for d in demands if d.share), key=lambda d: rank_smallest_first(d, overdue)
        )
    pending = next((d for d in ranked if not grants[d.name].placement.size), None)
    if pending is None:
        return
    need = _counted(pending, pending.min, limits.margin)
    busy = counted_utilization(pending)
    room = 0
    for slot in pool.slots():
        if slot in held_exclusive:
            continue
        sharers = [d for d in ranked if slot in grants[d.name].placement.slots()]
        # the decision's own rounding (whole bytes: at most one more than the reference's)
        used = sum(
            worker_memory_at(d, grants[d.name].placement.size, limits.margin) or CAPACITY
            for d in sharers
        )
        on_gpu = sum(counted_utilization(d) for d in sharers)
        cap = limits.max_utilization
        within = not sharers or cap is None or on_gpu + busy <= cap + 1e-9
        if len(sharers) < limits.max_jobs_per_gpu and used + need <= CAPACITY and within:
            room += 1
    assert room < pending.min, (pending, room)


@settings(max_examples=300, deadline=None)
@given(
    case=decisions(),
    steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=4),
    overdue=st.none() | st.frozensets(st.sampled_from([f"j{i}" for i in range(7)])),
)
def test_sharing_decisions_never_overcommit_and_keep_the_exclusive_rules(
    case: tuple[Pool, list[Demand], SharingLimits],
    steps: list[int],
    overdue: frozenset[str] | None,
) -> None:
    """Over a short history (each step: one job's measured peak or wish changes, or a job
    leaves), every decision holds the reference's invariants, the exclusive jobs' grants are
    `arbitrate`'s on the GPUs sharing jobs hold before and keep after it (a GPU a sharing
    job leaves goes to the exclusive jobs in the same decision), and deciding again on the
    result changes nothing. `overdue` None: in arrival order; else smallest first (the
    overdue jobs before), sharing jobs and the others alike."""
    pool, demands, limits = case
    current: dict[str, Placement] = {}
    for step in steps:
        current = _decide_and_check(pool, demands, current, limits, overdue)
        demands = _changed(demands, step)


@settings(max_examples=200, deadline=None)
@given(
    case=decisions(),
    steps=st.lists(st.integers(0, 2**16), min_size=1, max_size=3),
    overdue=st.none() | st.frozensets(st.sampled_from([f"j{i}" for i in range(7)])),
)
def test_whole_gpu_jobs_arriving_beside_sharing_jobs_shrink_them_only_to_be_admitted(
    case: tuple[Pool, list[Demand], SharingLimits],
    steps: list[int],
    overdue: frozenset[str] | None,
) -> None:
    """With `shrink_to_admit`, the sharing jobs are placed first (each wanting its max), then
    the whole-GPU jobs arrive (`sharing_whole.py` may shrink the sharing jobs for them): the
    same properties as above over the history that follows."""
    pool, demands, limits = case
    limits = replace(limits, admit_first=False, shrink_to_admit=True)
    demands = [replace(d, desired=d.max) if d.share else d for d in demands]  # some to give
    current = _decide_and_check(pool, [d for d in demands if d.share], {}, limits, overdue)
    for step in steps:
        current = _decide_and_check(pool, demands, current, limits, overdue)
        demands = _changed(demands, step)


def _decide_and_check(
    pool: Pool,
    demands: Sequence[Demand],
    current: Mapping[str, Placement],
    limits: SharingLimits,
    overdue: frozenset[str] | None,
) -> dict[str, Placement]:
    """One decision checked (the two tests above say what); the placements it gives."""
    ranking: dict[str, Any] = {}
    if overdue is not None:
        ranking = {"smallest_first": True, "overdue": overdue}
    grants = arbitrate_sharing(pool, demands, current, limits=limits, **ranking)
    _check_invariants(pool, demands, grants, limits)
    _head_of_line_not_left_out(pool, demands, grants, limits, overdue)
    shared = {
        slot for d in demands if d.share for slot in current.get(d.name, Placement.EMPTY).slots()
    } & {slot for d in demands if d.share for slot in grants[d.name].placement.slots()}
    exclusive = [d for d in demands if not d.share]
    alone = arbitrate(
        pool,
        exclusive,
        {d.name: current[d.name] for d in exclusive if d.name in current},
        unavailable=shared,
        **ranking,
    )
    assert {n: g.placement for n, g in alone.items()} == {
        d.name: grants[d.name].placement for d in exclusive
    }
    if limits.shrink_to_admit:
        _shrunk_only_to_admit(demands, current, grants)
    if limits.move_apart and all(grants[d.name].placement.size for d in demands):
        on: dict[Slot, float] = {}
        for d in demands:
            for slot in grants[d.name].placement.slots():
                on[slot] = on.get(slot, 0.0) + counted_utilization(d)
        crowded = {slot for slot, busy in on.items() if busy > 1 + 1e-9}
        free = pool.slot_set - on.keys()  # nobody waits: no GPU crowded while one is free
        assert not (crowded and free), (crowded, free, grants)
    placed = placed_of(grants)
    again = arbitrate_sharing(pool, demands, placed, limits=limits, **ranking)
    assert {n: g.placement for n, g in again.items()} == {n: g.placement for n, g in grants.items()}
    return placed


def _shrunk_only_to_admit(
    demands: Sequence[Demand], current: Mapping[str, Placement], grants: Mapping[str, Grant]
) -> None:
    """With `shrink_to_admit`, a job shrunk to admit another names it, and that one waited
    (held no GPU), is admitted now (its whole min), is of the shrunk job's priority or
    higher, and nobody is shrunk for nothing: a sharing taker holds a GPU the shrunk job
    left; for a whole-GPU taker the GPUs it left are whole-GPU jobs' (`sharing_whole` counts
    them: one may go to a growth that leaves the taker another)."""
    by_name = {d.name: d for d in demands}
    for name, grant in grants.items():
        before = current.get(name, Placement.EMPTY).size
        if grant.reason.startswith("shrunk") and "no longer fits beside" in grant.reason:
            # A sharing job whose memory grew, shrunk so that the running job beside it
            # keeps running (hypothesis found it named as an admission).
            kept = by_name[grant.reason.split("beside ", 1)[1].split(" ", 1)[0]]
            assert current.get(kept.name, Placement.EMPTY).size, (name, kept.name)
            assert grants[kept.name].placement.size >= kept.min, (name, kept.name)
            assert before > grant.placement.size >= by_name[name].min, (name, grant)
            continue
        if "admitting" not in grant.reason or not grant.reason.startswith("shrunk"):
            continue
        taker = by_name[grant.reason.split("admitting ", 1)[1].split(" ", 1)[0]]
        assert before > grant.placement.size >= by_name[name].min, (name, grant)
        assert not current.get(taker.name, Placement.EMPTY).size, (name, taker.name)
        assert grants[taker.name].placement.size >= taker.min, (name, taker.name)
        assert taker.priority >= by_name[name].priority, (name, taker.name)
        left = set(current[name].slots()) - set(grant.placement.slots())
        if taker.share:
            assert left & set(grants[taker.name].placement.slots()), (name, taker.name, grants)
        else:
            whole = {
                slot for d in demands if not d.share for slot in grants[d.name].placement.slots()
            }
            assert left <= whole, (name, taker.name, grants)


def test_a_gpu_a_sharing_job_leaves_goes_to_a_waiting_exclusive_job_in_the_same_decision() -> None:
    """Hypothesis found it: a sharing job whose measured peak grew past the GPU's memory left
    its GPU, and the exclusive job waiting for one got it only a decision later, so deciding
    again on a decision's result changed it."""
    pool = Pool.from_counts({"h0": 2}, gpu_memory_bytes=CAPACITY)
    grower = replace(Demand("grower", 1, 1, 1), share=True, measured_bytes=CAPACITY)
    big, waiting = Demand("big", 1, 1, 1, arrival=1.0), Demand("waiting", 1, 1, 1, arrival=2.0)
    current = {"grower": Placement((("h0", (1,)),)), "big": Placement((("h0", (0,)),))}
    grants = arbitrate_sharing(pool, [grower, big, waiting], current, limits=LIMITS)
    assert grants["grower"].placement.size == 0
    assert grants["waiting"].placement == Placement((("h0", (1,)),))


def _changed(demands: list[Demand], step: int) -> list[Demand]:
    index = step % len(demands)
    demand = demands[index]
    kind = (step // len(demands)) % 3
    if kind == 0 and len(demands) > 1:
        return demands[:index] + demands[index + 1 :]
    if kind == 1:
        return [*demands[:index], replace(demand, desired=step % 5), *demands[index + 1 :]]
    measured = (step // 7) % 12 + 1
    return [*demands[:index], replace(demand, measured_bytes=measured), *demands[index + 1 :]]


@pytest.mark.parametrize(
    ("measured", "field"), [(None, "spec.gpus.memory: 12"), (12, "measured peak: 14")]
)
def test_a_worker_that_cannot_fit_any_gpu_says_so(measured: int | None, field: str) -> None:
    pool = Pool.from_counts({"h0": 1}, gpu_memory_bytes=10)
    demand = replace(share("a", 1, 12), measured_bytes=measured)
    grant = arbitrate_sharing(pool, [demand], {}, limits=LIMITS)["a"]
    assert grant.placement.size == 0
    assert grant.reason == f"pending: {field} per worker is above the pool's GPU memory (10)"


# ---- the allocator: binding, recording and adopting shared GPUs ----


def _allocator(recorded: list[Allocation], pool: Pool, **kwargs: Any) -> Allocator:
    return Allocator(
        pool,
        RecordingSink(),
        virtual=True,
        on_decision=recorded.append,
        drain_seconds=0,
        belongs=lambda job, pid: True,
        sharing=SharingLimits(max_jobs_per_gpu=4, margin=0.1, gpu_memory_bytes=8 * GI),
        **kwargs,
    )


def test_two_sharing_jobs_bind_to_one_gpu_and_a_restart_gives_it_back_to_both() -> None:
    recorded: list[Allocation] = []
    pool = Pool.from_counts({"localhost": 1})
    allocator = _allocator(recorded, pool)
    a, b = share("a", 1, 3 * GI), share("b", 1, 3 * GI, arrival=1.0)
    assert allocator.request(a) is not None and allocator.request(b) is not None
    assert allocator.bind("a", "localhost", 0, 11) == (("localhost", 0),)
    assert allocator.bind("b", "localhost", 0, 12) == (("localhost", 0),)
    assert recorded[-1].shared == {"a", "b"}
    # What each sharing worker is counted for is recorded too (the store logs it per GPU).
    assert recorded[-1].memory == {"a": 3 * GI, "b": 3 * GI}
    # An exclusive job waits: the only GPU is shared.
    waiting = allocator.request(Demand("x", 1, 1, 1, arrival=2.0))
    assert waiting is not None and not waiting.admitted
    # A restarted operator restores the GPU to both and lets no newcomer onto it until both
    # asked again (their memory is known only then).
    again: list[Allocation] = []
    restarted = _allocator(again, pool)
    placements = {
        job: placement for job, placement in recorded[-1].placements.items() if placement.size
    }
    restarted.restore(placements, allocator.bindings(), shared=recorded[-1].shared)
    assert restarted.placements() == placements
    assert again[-1].shared == {"a", "b"}
    assert again[-1].memory == {}, "adopted jobs' memory is known once they ask"
    newcomer = restarted.request(share("c", 1, GI, arrival=3.0))
    assert newcomer is not None and not newcomer.admitted
    granted = restarted.request(a)
    assert granted is not None and granted.placement == placements["a"]
    assert restarted.placements()["b"] == placements["b"]  # still held
    restarted.request(b)
    third = restarted.grant("c")
    assert third is not None and third.placement == placements["a"]  # all three fit in 8 Gi


# ---- the spec ----


def test_a_sharing_spec_loads_with_its_memory_in_bytes() -> None:
    text = job_yaml("a", "{command: [x], gpus: {min: 1, max: 2, share: true, memory: 8Gi}}")
    loaded = load_spec_text(text, "jobs/a.yaml")
    assert loaded.job is not None
    gpus = loaded.job.spec.gpus
    assert (gpus.share, gpus.memory) == (True, "8Gi")
    plain = load_spec_text(job_yaml("b"), "jobs/b.yaml").job
    assert plain is not None and (plain.spec.gpus.share, plain.spec.gpus.memory) == (False, None)
    # The reconciler's demand carries the request in bytes and the measured peak it is given.
    reconciler = ReconcilerBase()
    reconciler.peak_memory = {"a": 5 * GI}.get
    reconciler.gpu_utilization = {"a": 0.4}.get
    demand = Demand("a", 1, 2, 2, **reconciler._sharing("a", loaded.job))
    assert (demand.share, demand.memory_bytes, demand.measured_bytes) == (True, 8 * GI, 5 * GI)
    assert demand.utilization == 0.4
    assert reconciler._sharing("b", plain) == {}


@pytest.mark.parametrize(
    ("gpus", "field", "message"),
    [
        ("{min: 1, max: 1, memory: 8GB}", "spec.gpus.memory", "is not a quantity of bytes"),
        ("{min: 1, max: 1, memory: 0Mi}", "spec.gpus.memory", "at least 1 byte"),
        ("{min: 1, max: 1, memory: 8}", "spec.gpus.memory", "expected a string"),
        ("{min: 1, max: 1, share: 'yes'}", "spec.gpus.share", "expected a boolean"),
    ],
)
def test_a_bad_sharing_request_names_its_field(gpus: str, field: str, message: str) -> None:
    loaded = load_spec_text(job_yaml("a", f"{{command: [x], gpus: {gpus}}}"), "jobs/a.yaml")
    assert loaded.job is None
    assert [error.field for error in loaded.errors] == [field]
    assert message in loaded.errors[0].message.lower()


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8Gi", 8 << 30), ("512Mi", 512 << 20), ("1.5G", 1_500_000_000), ("1000", 1000)],
)
def test_quantities_parse_as_kubernetes_writes_them(text: str, expected: int) -> None:
    assert parse_quantity(text) == expected


def test_sharing_changes_the_fingerprint_and_its_absence_does_not() -> None:
    def fingerprint(gpus: str) -> str:
        job = load_spec_text(job_yaml("a", f"{{command: [x], gpus: {gpus}}}"), "a.yaml").job
        assert job is not None
        return spec_fingerprint(job)

    plain = fingerprint("{min: 1, max: 2}")
    assert plain == fingerprint("{min: 1, max: 2, share: false}")
    assert plain != fingerprint("{min: 1, max: 2, share: true}")
    assert fingerprint("{min: 1, max: 2, share: true}") != fingerprint(
        "{min: 1, max: 2, share: true, memory: 1Gi}"
    )


def test_run_share_gpus_needs_the_gpus_memory_and_is_off_by_default() -> None:
    parser = build_parser()
    off = parser.parse_args(["run", "--hosts", "h1:4"])
    assert off.share_gpus is False and sharing_limits(off, virtual=False) is None
    on = parser.parse_args(
        ["run", "--share-gpus", "--gpu-memory", "80GiB", "--max-jobs-per-gpu", "2"]
    )
    assert sharing_limits(on, virtual=False) == SharingLimits(2, 0.1, 80 << 30)
    virtual = parser.parse_args(["run", "--share-gpus", "--virtual-gpu-memory", "1GiB"])
    assert sharing_limits(virtual, virtual=True) == SharingLimits(4, 0.1, 1 << 30)
    with pytest.raises(UsageError, match="--share-gpus: give --gpu-memory"):
        sharing_limits(virtual, virtual=False)
