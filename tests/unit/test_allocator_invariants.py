"""The allocator's promises at the seams: a GPU given back goes to nobody until it drained,
admission takes no more than it needs, and no lock order deadlocks the store and the
allocator. Real classes throughout; only the clock is injected."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Allocation, Demand, Pool, Slot
from tests.unit.sinks import RecordingSink
from tests.unit.test_reconciler import herd_job

# Hang guard for the deadlock test's threads; never a performance expectation.
GUARD_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Story:
    hosts: tuple[int, ...]
    running: tuple[Demand, ...]
    newcomer: Demand
    min_resize_interval: float
    first_launch_seconds: float


@st.composite
def stories(draw: st.DrawFn) -> Story:
    hosts = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    size = sum(hosts)
    running = []
    for index in range(draw(st.integers(1, 4))):
        low = draw(st.integers(1, size))
        high = draw(st.integers(low, size))
        running.append(
            Demand(f"r{index}", low, high, high, draw(st.integers(0, 1)), arrival=float(index))
        )
    low = draw(st.integers(1, size))
    newcomer = Demand("new", low, draw(st.integers(low, size)), size, draw(st.integers(0, 2)), 10.0)
    freezes = st.sampled_from([0.0, 30.0]), st.sampled_from([0.0, 60.0])
    return Story(hosts, tuple(running), newcomer, draw(freezes[0]), draw(freezes[1]))


def owners(allocator: Allocator) -> dict[Slot, str]:
    return {slot: job for job, p in allocator.placements().items() for slot in p.slots()}


@settings(max_examples=300, deadline=None)
@given(story=stories())
def test_admission_hands_on_only_drained_gpus_and_takes_no_more_than_it_needs(
    story: Story,
) -> None:
    """Jobs run, each at the size it reported (nothing drains); a new job arrives. Until the
    jobs that shrank for it report their smaller size, no GPU passes from one job to another
    and nobody else is shrunk; once they did, the newcomer holds at least every GPU the
    running jobs gave up. (The double take: the newcomer got a draining GPU, the next
    decision treated it as unavailable and shrank a second job, whose GPUs went to the
    newcomer at once while its workers were still on them.)"""
    clock = Clock()
    pool = Pool.from_counts({f"h{i}": count for i, count in enumerate(story.hosts)})
    allocator = Allocator(
        pool,
        RecordingSink(),
        virtual=True,
        drain_seconds=3600.0,  # only reports free a GPU here (no pid to watch)
        clock=clock,
        min_resize_interval=story.min_resize_interval,
        first_launch_seconds=story.first_launch_seconds,
    )
    # Settle: every job at what it is granted and says so, nothing draining, no freeze.
    for _ in range(10):
        placed = allocator.placements()
        for demand in story.running:
            allocator.request(demand)
            granted = allocator.grant(demand.name)
            if granted is not None and granted.placement.size:
                allocator.observe_world_size(demand.name, granted.placement.size)
        clock.now += 60.0
        if not allocator.draining() and allocator.placements() == placed:
            break
    assert allocator.draining() == {}
    before_sizes = {job: p.size for job, p in allocator.placements().items()}

    seen = owners(allocator)

    def decide(demand: Demand) -> None:
        nonlocal seen
        allocator.request(demand)
        now = owners(allocator)
        draining = allocator.draining()
        for slot, job in now.items():
            assert slot not in draining, f"{slot} granted to {job} while it drains"
            was = seen.get(slot)
            assert was in (None, job), f"{slot} passed from {was} to {job} without draining"
        seen = now

    decide(story.newcomer)
    shrunk = {
        job: size for job, size in before_sizes.items() if allocator.placements()[job].size < size
    }
    # The waiting period: every job asks again, more than once; no drain is over.
    for _ in range(2):
        for demand in (*story.running, story.newcomer):
            decide(demand)
    for job in before_sizes:
        if job not in shrunk:
            assert allocator.placements()[job].size >= before_sizes[job], (
                f"{job} was shrunk while the newcomer waited for others' drains"
            )
    # The jobs that shrank report their smaller size: their GPUs are free. (A newcomer that
    # started on part of its grant is frozen at it for a while; then it gets the rest.)
    for job in shrunk:
        allocator.observe_world_size(job, allocator.placements()[job].size)
    clock.now += 60.0
    decide(story.newcomer)
    after = allocator.placements()
    taken = sum(max(0, size - after[job].size) for job, size in before_sizes.items())
    grant = allocator.grant("new")
    assert grant is not None
    assert taken <= grant.placement.size, (
        f"running jobs gave up {taken} GPUs for a newcomer that holds {grant.placement.size}"
    )


def test_a_second_job_is_not_shrunk_while_the_first_ones_gpus_drain() -> None:
    """The first case the property found, spelled out: x and y run 2 GPUs each on 4; new
    (min 1) arrives and the fair share takes one of y's. new waits for it; x keeps its 2
    (it used to be shrunk too, its GPU handed to new at once, under x's worker)."""
    allocator = Allocator(
        Pool.from_counts({"h": 4}), RecordingSink(), virtual=True, drain_seconds=60
    )
    x, y = Demand("x", 1, 2, 2, arrival=1.0), Demand("y", 1, 2, 2, arrival=2.0)
    for demand in (x, y):
        allocator.request(demand)
        allocator.observe_world_size(demand.name, 2)
    new = Demand("new", 1, 2, 2, arrival=3.0)
    waiting = allocator.request(new)
    assert waiting is not None and not waiting.admitted
    assert waiting.reason == (
        "pending: waiting for GPUs that y gave back to drain (its workers leave them first)"
    )
    assert allocator.draining() == {("h", 3): "y"}
    for demand in (x, y, new, x, y, new):
        allocator.request(demand)
    assert {job: p.size for job, p in allocator.placements().items()} == {"x": 2, "y": 1, "new": 0}
    allocator.observe_world_size("y", 1)  # y's worker on h:3 is gone
    admitted = allocator.grant("new")
    assert admitted is not None and admitted.placement.slots() == (("h", 3),)


# ---- the store's lock and the allocator's ----


def test_a_report_group_and_a_decision_do_not_deadlock(tmp_path: Path) -> None:
    """An RPC report group holds the store's transaction and tells the allocator a world
    size; meanwhile the end of a burst decides under the allocator's lock and records the
    decision in the store. With the decision written under the allocator's lock, each held
    what the other waited for (forced here: the decision is held at its write until the
    report thread is inside the store's transaction and has asked the allocator)."""
    store = Store(tmp_path / "state.db")
    for name in ("a", "b"):
        store.record_spec(name, f"{name}.yaml", herd_job(name), f"f-{name}", 1.0)
    deciding = threading.Event()
    reporting = threading.Event()

    def record(decision: Allocation) -> None:
        if not deciding.is_set():
            deciding.set()
            reporting.wait(GUARD_S)  # the report thread holds the store's lock by now
        store.replace_allocations(decision.placements, 2.0, decision.draining)

    allocator = Allocator(
        Pool.from_counts({"localhost": 4}), RecordingSink(), virtual=True, on_decision=record
    )
    allocator.request(Demand("a", 1, 2, 2))
    deciding.clear()
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                target()
            except BaseException as err:
                errors.append(err)

        return run

    def burst() -> None:
        with allocator.batch():
            allocator.request(Demand("b", 1, 2, 2))

    def report_group() -> None:
        deciding.wait(GUARD_S)
        with store.transaction():
            store.add_report("a", 1, 2, 0, {}, 3.0)
            threading.Timer(0.5, reporting.set).start()  # once observe_world_size waits
            allocator.observe_world_size("a", 2)
        reporting.set()

    threads = [threading.Thread(target=guarded(burst), daemon=True),
               threading.Thread(target=guarded(report_group), daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(GUARD_S)
    assert not any(thread.is_alive() for thread in threads), "deadlocked"
    assert errors == []
    assert set(store.allocations()) == {"a", "b"}
    store.close()
