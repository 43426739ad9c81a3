"""A job whose first launch is forming is not resized (`runtime/first_launch.py`).

A worker still waiting in the shim for a GPU that a decision took away is never told by
Horovod, and the job stalls until Gloo's timeout: so no decision resizes a job from its
first grant (or its adoption after a restart) until every granted GPU has a bound worker,
its workers report a world size, or the limit passed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import Binding, BindingTracker, plain_presentation
from herd_operator.runtime.first_launch import FirstLaunches
from herd_operator.specs.values import Demand, Grant, Placement, Pool
from tests.unit.sinks import RecordingSink

LIMIT_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def allocator(clock: Clock, limit: float = LIMIT_S, gpus: int = 4) -> Allocator:
    return Allocator(
        Pool.from_counts({"localhost": gpus}),
        RecordingSink(),
        virtual=True,
        drain_seconds=0,
        clock=clock,
        belongs=lambda job, pid: True,
        first_launch_seconds=limit,
    )


def size(alloc: Allocator, job: str) -> int:
    grant = alloc.grant(job)
    return grant.placement.size if grant is not None else 0


A = Demand("a", 1, 4, 4, arrival=1)
B = Demand("b", 2, 2, 2, arrival=2)


def test_a_job_is_not_shrunk_before_its_workers_bound_then_is() -> None:
    clock = Clock()
    alloc = allocator(clock)
    assert alloc.request(A).placement.size == 4  # type: ignore[union-attr]
    for rank in range(3):
        alloc.bind("a", "localhost", rank, None)
    assert not alloc.request(B).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 4, "a worker of a's first launch has not bound yet"

    alloc.bind("a", "localhost", 3, None)  # the last one: a formed
    assert alloc.request(B).admitted  # type: ignore[union-attr]
    assert (size(alloc, "a"), size(alloc, "b")) == (2, 2)


def test_without_the_freeze_the_forming_job_is_shrunk_at_once() -> None:
    """The case the freeze exists for (so the test above can fail)."""
    alloc = allocator(Clock(), limit=0)
    alloc.request(A)
    assert alloc.request(B).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 2


def test_a_reported_world_size_ends_the_freeze() -> None:
    clock = Clock()
    alloc = allocator(clock)
    alloc.request(A)
    alloc.observe_world_size("a", 4)
    assert alloc.request(B).admitted  # type: ignore[union-attr]


def test_a_worker_that_never_binds_freezes_its_job_for_the_limit_only() -> None:
    clock = Clock()
    alloc = allocator(clock)
    alloc.request(A)
    assert not alloc.request(B).admitted  # type: ignore[union-attr]
    assert alloc.thaw_at() == clock.now + LIMIT_S
    clock.now += LIMIT_S - 1
    assert not alloc.request(B).admitted  # type: ignore[union-attr]
    clock.now += 1
    assert alloc.request(B).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 2


def test_a_relaunch_after_a_stop_to_nothing_forms_again() -> None:
    clock = Clock()
    alloc = allocator(clock)
    alloc.request(A)
    alloc.observe_world_size("a", 4)
    alloc.release("a")
    alloc.request(A)  # launched anew: its workers wait in the shim again
    assert not alloc.request(B).admitted  # type: ignore[union-attr]


def test_an_adopted_job_found_forming_is_not_shrunk_until_its_workers_bound() -> None:
    """After an operator restart: the launch was forming when the operator died (one of two
    workers bound), so a newcomer waits for it, as it would have without the restart."""
    clock = Clock()
    alloc = allocator(clock, gpus=2)
    two = Placement((("localhost", (0, 1)),))
    alloc.restore({"a": two}, [Binding("a", "localhost", 0, 0, None)])
    alloc.request(Demand("a", 1, 2, 2, arrival=1))
    newcomer = Demand("b", 1, 1, 1, arrival=2)
    assert not alloc.request(newcomer).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 2
    alloc.bind("a", "localhost", 1, None)
    assert alloc.request(newcomer).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 1


def test_an_adopted_job_stays_frozen_through_decisions_made_before_its_first_request() -> None:
    """Decisions for other jobs can come before the adopted job's reconcile asks again
    (it is held, untouched, until then): they must not end its freeze."""
    clock = Clock()
    alloc = allocator(clock, gpus=3)
    two = Placement((("localhost", (0, 1)),))
    alloc.restore({"a": two}, [Binding("a", "localhost", 0, 0, None)])
    assert alloc.request(Demand("b", 1, 1, 1, arrival=2)).admitted  # type: ignore[union-attr]
    alloc.request(Demand("a", 1, 2, 2, arrival=1))
    assert not alloc.request(Demand("c", 1, 1, 1, arrival=3)).admitted  # type: ignore[union-attr]
    assert size(alloc, "a") == 2


def test_an_adopted_job_whose_workers_all_bound_is_decided_at_once() -> None:
    clock = Clock()
    alloc = allocator(clock, gpus=2)
    two = Placement((("localhost", (0, 1)),))
    bound = [Binding("a", "localhost", rank, rank, None) for rank in range(2)]
    alloc.restore({"a": two}, bound)
    alloc.request(Demand("a", 1, 2, 2, arrival=1))
    assert alloc.request(Demand("b", 1, 1, 1, arrival=2)).admitted  # type: ignore[union-attr]


# ---- the rule itself ----


@pytest.mark.parametrize(
    ("held", "bound", "elapsed", "forming"),
    [
        (4, 0, 0.0, True),
        (4, 3, 59.9, True),
        (4, 4, 1.0, False),  # every GPU has its worker
        (4, 0, 60.0, False),  # the limit passed
        (0, 0, 1.0, False),  # holds nothing (stopped)
    ],
)
def test_frozen(held: int, bound: int, elapsed: float, forming: bool) -> None:
    launches = FirstLaunches(LIMIT_S)
    launches.started("a", 100.0)
    frozen = launches.frozen(100.0 + elapsed, {"a": held}, lambda job: bound)
    assert (frozen == {"a"}) is forming
    assert ("a" in launches) is forming, "a job no longer forming is forgotten"


def test_a_limit_of_zero_freezes_nothing() -> None:
    launches = FirstLaunches(0.0)
    launches.started("a", 0.0)
    assert "a" not in launches
    assert launches.next_end() is None


def test_next_end_is_the_earliest_start_plus_the_limit() -> None:
    launches = FirstLaunches(LIMIT_S)
    launches.started("a", 10.0)
    launches.started("b", 5.0)
    launches.started("a", 50.0)  # already forming: its start stays
    assert launches.next_end() == 5.0 + LIMIT_S
    launches.formed("b")
    assert launches.next_end() == 10.0 + LIMIT_S


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["bind", "regrant", "clear"]),
            st.sampled_from(["a", "b"]),
            st.integers(0, 3),
            st.integers(1, 4),
        ),
        max_size=30,
    )
)
def test_the_bound_count_is_the_number_of_bound_gpus(
    steps: list[tuple[str, str, int, int]],
) -> None:
    """`BindingTracker.bound`, kept as bindings change, says what a scan says."""
    tracker = BindingTracker(plain_presentation, {"localhost"})
    grants = {job: Grant(Placement((("localhost", (0, 1, 2, 3)),)), "") for job in "ab"}
    for action, job, rank, size in steps:
        if action == "bind":
            placement = grants[job].placement
            slots = tuple(tracker.presentation(job, placement).get("localhost", ()))
            if rank < len(slots):
                tracker.bind(job, "localhost", rank, None, slots)
        elif action == "regrant":
            grants[job] = Grant(Placement((("localhost", tuple(range(size))),)), "")
            tracker.keep_matching(grants)
        else:
            tracker.clear()
        for name in "ab":
            assert tracker.bound(name) == len(tracker.of_job(name))
