"""The sharing guard (`policies/sharing_guard.py`): a sharing job whose worker nears its memory
share is counted by what it uses, and moved or shrunk where it no longer fits beside its
neighbours; named cases, properties on generated pools, jobs and readings, and the allocator
acting on it (`Allocator.guard_memory`)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.policies.sharing import SharingLimits
from herd_operator.policies.sharing_guard import (
    GuardDecision,
    Sharer,
    guard_sharing,
)
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import BindingTracker, plain_presentation
from herd_operator.runtime.engines.horovod import present
from herd_operator.runtime.gpu_memory import GpuMemoryWatch, PeakGpuMemory
from herd_operator.runtime.telemetry import worker_pids
from herd_operator.specs.values import Demand, Placement, Pool, Slot
from tests.unit import fake_pynvml
from tests.unit.fake_pynvml import FakeGpu, FakeNvmlConfig
from tests.unit.sinks import RecordingSink
from tests.unit.test_sharing import share

GI = 1 << 30
MARGIN = 0.1


def on(*slots: Slot) -> Placement:
    hosts: dict[str, list[int]] = {}
    for host, gpu in slots:
        hosts.setdefault(host, []).append(gpu)
    return Placement(tuple((host, tuple(gpus)) for host, gpus in hosts.items()))


def h(gpu: int) -> Slot:
    return ("h0", gpu)


def guard(
    sharers: Sequence[Sharer], gpus: int = 3, capacity: int = 10 * GI, **kwargs: Any
) -> GuardDecision:
    slots = [h(gpu) for gpu in range(gpus)]
    return guard_sharing(
        slots, sharers, capacity=capacity, max_jobs_per_gpu=4, margin=MARGIN, **kwargs
    )


def guarding_watch(allocator: Allocator) -> GpuMemoryWatch:
    """The memory watch as the operator wires it: its readings charged to the allocator's
    workers and handed to the allocator's guard."""
    return GpuMemoryWatch(
        PeakGpuMemory(),
        lambda: worker_pids(allocator),
        lambda: dict.fromkeys(allocator.placements(), "run"),
        dict,
        lambda *event: None,
        on_used=allocator.guard_memory,
    )


def test_a_worker_past_its_share_moves_off_its_neighbours_gpu_and_the_neighbour_stays() -> None:
    # grower: 2 workers of 4 Gi on GPUs 0 and 1; neighbour: 5 Gi on GPU 0 (9 of 10 Gi used).
    grower = Sharer("grower", on(h(0), h(1)), 1, 4 * GI, None, {h(0): 5 * GI, h(1): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {h(0): 3 * GI})
    decision = guard([grower, neighbour])
    assert decision.placements == {"grower": on(h(1), h(2)), "neighbour": on(h(0))}
    (action,) = decision.actions
    assert (action.kind, action.gpu, action.to, action.reason) == (
        "moved",
        h(0),
        h(2),
        "MovedForMemory",
    )
    assert action.need_bytes == 5.5 * GI  # what it uses, raised by the margin
    assert decision.measured == {"grower": 5 * GI}
    assert action.message == (
        "a worker of grower uses 5.0Gi of its 4.0Gi share: its worker on h0 GPU 0 moved to h0"
        " GPU 2, counted for 5.5Gi (its neighbours' memory no longer fits it)"
    )


def test_a_worker_near_its_share_that_still_fits_is_only_counted_by_its_use() -> None:
    grower = Sharer("grower", on(h(0)), 1, 4 * GI, None, {h(0): int(3.8 * GI)})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    decision = guard([grower, neighbour])
    assert decision.actions == ()
    assert decision.measured == {"grower": int(3.8 * GI)}
    assert decision.placements["grower"] == on(h(0))


def test_a_worker_far_under_its_share_is_left_alone() -> None:
    decision = guard([Sharer("a", on(h(0)), 1, 4 * GI, None, {h(0): 3 * GI})])
    assert decision.actions == () and decision.measured == {}


def test_with_no_gpu_that_has_room_the_job_shrinks_by_that_worker() -> None:
    grower = Sharer("grower", on(h(0), h(1)), 1, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    full = Sharer("full", on(h(2)), 1, 9 * GI, None, {})
    decision = guard([grower, neighbour, full])
    (action,) = decision.actions
    assert (action.kind, action.gpu, action.to) == ("shrunk", h(0), None)
    assert decision.placements["grower"] == on(h(1))
    assert action.reason == "ShrunkForMemory"


def test_a_job_at_its_min_stays_and_says_so() -> None:
    grower = Sharer("grower", on(h(0), h(1)), 2, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    full = Sharer("full", on(h(2)), 1, 9 * GI, None, {})
    decision = guard([grower, neighbour, full])
    (action,) = decision.actions
    assert action.kind == "stuck" and action.reason == "MemoryNotMovable"
    assert "its min of 2 GPU(s) does not fit with it" in action.message
    assert decision.placements["grower"] == on(h(0), h(1))
    assert "grower" not in decision.measured  # counted as before: no GPU over-committed


def test_a_job_whose_every_worker_must_go_is_not_moved() -> None:
    # Elastic Horovod hands the state on from a worker that stays: with none, the job is lost.
    grower = Sharer("grower", on(h(0)), 1, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    (action,) = guard([grower, neighbour]).actions
    assert action.kind == "stuck" and "none of its workers could stay" in action.message


def test_closed_draining_and_capped_gpus_are_never_targets() -> None:
    grower = Sharer("grower", on(h(0), h(1)), 1, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    decision = guard([grower, neighbour], gpus=5, closed={h(2)}, no_new={h(3)})
    assert decision.placements["grower"] == on(h(1), h(4))


def test_a_move_the_engine_would_not_see_takes_another_gpu() -> None:
    # One host shown under 2 names: GPU 2 has GPU 0's name and rank once GPU 0 is left, so the
    # worker would run on where it was; GPU 3 is a change Horovod sees.
    def clean(job: str, before: Placement, after: Placement) -> bool:
        def shown(placement: Placement) -> dict[Slot, tuple[str, int]]:
            names = present(placement, {"h0": ("a", "b")})
            return {s: (n, i) for n, slots in names.items() for i, s in enumerate(slots)}

        old, new = shown(before), shown(after)
        return all(
            new.get(s) == w if s in new else w not in set(new.values()) for s, w in old.items()
        )

    grower = Sharer("grower", on(h(0), h(1)), 1, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    decision = guard([grower, neighbour], gpus=4, clean=clean)
    assert decision.placements["grower"] == on(h(1), h(3))
    assert guard([grower, neighbour], gpus=4).placements["grower"] == on(h(1), h(2))


# ---- properties ----


@st.composite
def states(draw: st.DrawFn) -> tuple[int, list[Sharer], set[Slot], set[Slot]]:
    """A pool of 1-6 GPUs of 10 units, 1-5 sharing jobs placed without over-committing it
    (first fit), and each worker's use now: under, near or over its share, or unknown."""
    gpus = draw(st.integers(1, 6))
    slots = [h(g) for g in range(gpus)]
    used = Counter[Slot]()
    count = Counter[Slot]()
    sharers = []
    for index in range(draw(st.integers(1, 5))):
        size = draw(st.integers(1, 3))
        request = draw(st.integers(1, 6))
        measured = draw(st.none() | st.integers(1, 6))
        probe = Sharer(f"j{index}", Placement.EMPTY, 1, request, measured)
        need = probe.share(MARGIN)
        mine = [s for s in slots if used[s] + need <= 10 and count[s] < 4][:size]
        if not mine:
            continue
        for slot in mine:
            used[slot] += need
            count[slot] += 1
        readings = {
            slot: draw(st.integers(0, 12))
            for slot in mine
            if draw(st.booleans())  # some workers unread
        }
        low = draw(st.integers(1, len(mine)))
        sharers.append(Sharer(f"j{index}", on(*mine), low, request, measured, readings))
    closed = set(draw(st.lists(st.sampled_from(slots), max_size=2))) - set(used)
    no_new = set(draw(st.lists(st.sampled_from(slots), max_size=2)))
    return gpus, sharers, closed, no_new


@settings(max_examples=300, deadline=None)
@given(states())
def test_the_guard_never_overcommits_and_touches_only_jobs_near_their_share(
    state: tuple[int, list[Sharer], set[Slot], set[Slot]],
) -> None:
    gpus, sharers, closed, no_new = state
    decision = guard(sharers, gpus=gpus, capacity=10, closed=closed, no_new=no_new)
    by_name = {s.name: s for s in sharers}
    acted = {a.job for a in decision.actions}
    load = Counter[Slot]()
    jobs = Counter[Slot]()
    for name, placement in decision.placements.items():
        s = by_name[name]
        before = set(s.placement.slots())
        after = list(placement.slots())
        assert len(after) == len(set(after)), "two workers of a job on one GPU"
        counted = s.share(MARGIN, decision.measured.get(name))
        for slot in after:
            load[slot] += counted
            jobs[slot] += 1
            if slot not in before:
                assert slot not in closed and slot not in no_new, (name, slot)
        if after != list(s.placement.slots()):
            assert name in acted
            assert placement.size >= s.min and before & set(after), "a worker stays"
        near = any(u > 0.9 * s.share(MARGIN) for slot, u in s.used.items())
        if not near:
            assert name not in acted and name not in decision.measured
            assert placement == s.placement
        if name in decision.measured:
            assert decision.measured[name] >= (s.measured_bytes or 0)
    for slot in load:
        assert load[slot] <= 10 and jobs[slot] <= 4, (slot, load[slot], jobs[slot])
    for action in decision.actions:
        if action.kind == "stuck":
            assert decision.placements[action.job] == by_name[action.job].placement
            assert action.job not in decision.measured


# ---- the allocator acting on it ----


Event = tuple[str, str, str, str]


def _allocator(
    gpus: int, events: list[Event], gpu_memory: int, jobs_per_gpu: int, **kwargs: Any
) -> Allocator:
    """A sharing allocator on one host of `gpus` GPUs of `gpu_memory` bytes, its events
    appended to `events`."""
    return Allocator(
        Pool.from_counts({"localhost": gpus}),
        RecordingSink(),
        on_event=lambda *event: events.append(event),
        belongs=lambda job, pid: True,
        sharing=SharingLimits(
            max_jobs_per_gpu=jobs_per_gpu, margin=0.1, gpu_memory_bytes=gpu_memory
        ),
        **kwargs,
    )


def test_the_allocator_moves_the_job_that_grew_and_drains_the_gpu_it_left() -> None:
    events: list[Event] = []
    allocator = _allocator(
        3, events, 2 * GI, 2, virtual=True, drain_seconds=30,
        present=lambda job, placement: present(placement, {"localhost": ("a", "b", "c")}),
    )  # fmt: skip
    grower = share("grower", 2, GI // 2)
    neighbour = share("neighbour", 1, GI, arrival=1.0)
    allocator.request(grower)
    allocator.request(neighbour)
    assert allocator.placements() == {
        "grower": on(("localhost", 0), ("localhost", 1)),
        "neighbour": on(("localhost", 0)),
    }
    allocator.bind("grower", "a", 0, 101)
    allocator.bind("grower", "b", 0, 102)
    allocator.bind("neighbour", "a", 0, 201)
    used: Mapping[str, Mapping[Slot, int | None]] = {
        "grower": {("localhost", 0): 1000 << 20, ("localhost", 1): None},
        "neighbour": {("localhost", 0): 600 << 20},
    }
    allocator.guard_memory(used)
    assert allocator.placements() == {
        "grower": on(("localhost", 1), ("localhost", 2)),
        "neighbour": on(("localhost", 0)),
    }
    assert allocator.draining() == {("localhost", 0): "grower"}
    assert [(job, reason) for job, _, reason, _ in events] == [("grower", "MovedForMemory")]
    grant = allocator.grant("grower")
    assert grant is not None and "localhost:0 -> localhost:2" in grant.reason
    # The same readings again change nothing; the reconciler's next demand keeps it there.
    allocator.guard_memory(used)
    assert len(events) == 1
    granted = allocator.request(Demand("x", 1, 1, 1, arrival=2.0))
    assert granted is not None and not granted.admitted  # GPU 0 drains, 1 and 2 are shared
    assert allocator.placements()["grower"] == on(("localhost", 1), ("localhost", 2))


def test_a_job_that_cannot_move_is_said_once() -> None:
    events: list[Event] = []
    allocator = _allocator(1, events, 2 * GI, 2, virtual=True, present=plain_presentation)
    allocator.request(share("a", 1, GI // 2))
    allocator.request(share("b", 1, GI, arrival=1.0))
    used = {"a": {("localhost", 0): 1000 << 20}}
    for _ in range(3):
        allocator.guard_memory(used)
    assert [(job, kind, reason) for job, kind, reason, _ in events] == [
        ("a", "Warning", "MemoryNotMovable")
    ]
    assert allocator.placements()["a"] == on(("localhost", 0))


# ---- four jobs on two GPUs, through NVML's readings (the fake `pynvml`) ----


def test_four_jobs_on_two_gpus_are_accounted_per_gpu_and_the_one_that_grows_shrinks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[Event] = []
    allocator = _allocator(
        2, events, 8 * GI, 4, virtual=False,
        # A lone host under two names, as the Horovod engine shows it: GPU 1 keeps its
        # worker's name and rank when a job gives GPU 0 back.
        present=lambda job, placement: present(placement, {"localhost": ("localhost", "lo")}),
    )  # fmt: skip
    half = int(2.5 * GI)
    a = replace(Demand("a", 1, 2, 2), share=True, memory_bytes=half)
    for demand in (a, *(share(name, 1, half, arrival=n) for n, name in enumerate("bcd", 1))):
        allocator.request(demand)
    # a on both (the first free), b and c beside it on GPU 0 (fullest first), d on GPU 1.
    assert {job: list(p.slots()) for job, p in allocator.placements().items()} == {
        "a": [("localhost", 0), ("localhost", 1)],
        "b": [("localhost", 0)],
        "c": [("localhost", 0)],
        "d": [("localhost", 1)],
    }
    pids = {("a", "localhost"): 10, ("a", "lo"): 11, ("b", "localhost"): 20}
    pids |= {("c", "localhost"): 30, ("d", "lo"): 40}
    for (job, name), pid in pids.items():
        allocator.bind(job, name, 0, pid)
    gpu0 = FakeGpu("GPU-0", 8 * GI, 5 * GI, processes=[(10, 2 * GI), (20, 2 * GI), (30, GI)])
    gpu1 = FakeGpu("GPU-1", 8 * GI, 3 * GI, processes=[(11, 2 * GI), (40, GI)])
    nvml = fake_pynvml.make_module(FakeNvmlConfig([gpu0, gpu1]))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    source = NvmlGpuSource("localhost")

    collector = GpuCollector(source, pid_owners=lambda: worker_pids(allocator))
    scraped = [
        (sample.labels["herd_job"], sample.labels["gpu"], sample.value)
        for family in text_string_to_metric_families(exposition(collector))
        if family.name == "herd_job_gpu_memory_used_bytes"
        for sample in family.samples
    ]
    assert sorted(scraped) == [
        ("a", "0", 2 * GI),
        ("a", "1", 2 * GI),
        ("b", "0", 2 * GI),
        ("c", "0", GI),
        ("d", "1", GI),
    ]

    # a's worker on GPU 0 grows to 4 Gi: counted 4.4 Gi, it no longer fits beside b and c
    # (2.5 Gi each), and GPU 1 has a's other worker: a shrinks by it, to its min.
    watch = guarding_watch(allocator)
    gpu0.processes[0] = (10, 4 * GI)
    watch.observe(source.read(), 1.0)
    assert [(job, reason) for job, _, reason, _ in events] == [("a", "ShrunkForMemory")]
    assert allocator.placements()["a"] == Placement((("localhost", (1,)),))
    assert allocator.draining() == {("localhost", 0): "a"}
    assert watch.peaks.peak("a") == 4 * GI


def test_a_shrink_that_would_give_a_kept_gpu_another_local_rank_is_not_made() -> None:
    # One name per host: giving GPU 0 back makes GPU 1 local rank 0, so Horovod would stop
    # the worker on GPU 1 and keep the one on GPU 0, which the guard wanted gone.
    kept = cleanly(plain_presentation)
    assert not kept("a", on(h(0), h(1)), on(h(1)))
    assert kept("a", on(h(0), h(1)), on(h(0)))
    grower = Sharer("grower", on(h(0), h(1)), 1, 4 * GI, None, {h(0): 5 * GI})
    neighbour = Sharer("neighbour", on(h(0)), 1, 5 * GI, None, {})
    (action,) = guard([grower, neighbour], gpus=2, clean=kept).actions
    assert action.kind == "stuck" and "its engine would not see the change" in action.message


def cleanly(presenter: Any) -> Any:
    return BindingTracker(presenter, ("h0",)).moves_cleanly


def test_a_job_near_its_share_is_counted_by_its_use_so_no_newcomer_takes_that_room() -> None:
    allocator = _allocator(1, [], 8 * GI, 4, virtual=True)
    allocator.request(share("a", 1, 2 * GI))
    allocator.guard_memory({"a": {("localhost", 0): 3 * GI}})  # counted 3.3 Gi from now
    newcomer = allocator.request(share("b", 1, 5 * GI, arrival=1.0))
    assert newcomer is not None and not newcomer.admitted  # 2 + 5 would fit, 3.3 + 5 not
    assert "needs 1 GPU(s) with 5.0Gi free" in newcomer.reason
