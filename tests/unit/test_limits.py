"""Tests for controllers.limits: the time limit and the dependency rules, exhaustively."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.controllers.limits import (
    DEPENDENCY_GRACE_SECONDS,
    Dependencies,
    DependencyState,
    Verdict,
    deadline_at,
    deadline_exceeded,
    deadline_message,
    dependency_verdict,
    sooner,
)

S = DependencyState


@pytest.mark.parametrize(
    ("limit", "started", "now", "exceeded"),
    [
        (None, 100.0, 1e9, False),  # no limit
        (60, None, 1e9, False),  # never started: queued time does not count
        (60, 100.0, 159.9, False),
        (60, 100.0, 160.0, True),  # at the limit itself
        (60, 100.0, 500.0, True),
    ],
)
def test_deadline(limit: int | None, started: float | None, now: float, exceeded: bool) -> None:
    assert deadline_exceeded(limit, started, now) is exceeded


def test_deadline_at_and_message() -> None:
    assert deadline_at(60, 100.0) == 160.0
    assert deadline_at(None, 100.0) is None and deadline_at(60, None) is None
    assert deadline_message(60, 100.0, 161.2) == (
        "activeDeadlineSeconds 60 reached: the job first started 61s ago"
    )


@pytest.mark.parametrize(
    ("after", "deadline", "now", "expected"),
    [
        (None, None, 0.0, None),
        (5.0, None, 0.0, 5.0),
        (None, 130.0, 100.0, 30.0),  # a pending job: woken at its deadline
        (5.0, 130.0, 100.0, 5.0),
        (50.0, 130.0, 100.0, 30.0),
        (5.0, 90.0, 100.0, 0.0),  # past: at once
    ],
)
def test_sooner(
    after: float | None, deadline: float | None, now: float, expected: float | None
) -> None:
    assert sooner(after, deadline, now) == expected


def verdict(
    depends_on: list[str], states: dict[str, DependencyState], age: float = 0.0
) -> Dependencies:
    return dependency_verdict(depends_on, states, declared_at=1000.0, now=1000.0 + age)


def test_no_dependencies_are_met() -> None:
    assert verdict([], {}) == Dependencies(Verdict.MET, "")


def test_all_succeeded_are_met() -> None:
    met = verdict(["a", "b"], {"a": S.SUCCEEDED, "b": S.SUCCEEDED})
    assert met == Dependencies(Verdict.MET, "every dependency succeeded")


def test_an_unfinished_one_is_waited_for_by_name() -> None:
    waiting = verdict(["a", "b"], {"a": S.SUCCEEDED, "b": S.UNFINISHED})
    assert waiting == Dependencies(Verdict.WAITING, "waiting for b to succeed", ("b",))


@pytest.mark.parametrize("state", [S.FAILED, S.DELETED])
def test_a_failed_or_deleted_one_fails_the_job(state: DependencyState) -> None:
    failed = verdict(["a", "b"], {"a": state, "b": S.UNFINISHED})
    word = state.value.lower()
    assert failed == Dependencies(
        Verdict.FAILED, f"dependency a ({word}) can never succeed", ("a",)
    )


def test_a_missing_one_is_waited_for_within_the_grace_then_fails() -> None:
    assert verdict(["x"], {}, age=DEPENDENCY_GRACE_SECONDS - 1) == Dependencies(
        Verdict.WAITING, "waiting for x (not declared yet) to succeed", ("x",)
    )
    assert verdict(["x"], {}, age=DEPENDENCY_GRACE_SECONDS) == Dependencies(
        Verdict.FAILED, "dependency x (no such job) can never succeed", ("x",)
    )


def expected_verdict(states: list[DependencyState | None], late: bool) -> Verdict:
    """The rule in words: any that can never succeed fails it; else any not succeeded
    (a missing one within the grace) is waited for; else met."""
    never = {S.FAILED, S.DELETED} | ({None} if late else set())
    if any(state in never for state in states):
        return Verdict.FAILED
    if any(state is not S.SUCCEEDED for state in states):
        return Verdict.WAITING
    return Verdict.MET


@pytest.mark.parametrize("late", [False, True])
def test_every_combination_of_two_dependencies(late: bool) -> None:
    choices: list[DependencyState | None] = [*DependencyState, None]
    for first, second in itertools.product(choices, repeat=2):
        states = {
            name: state
            for name, state in (("a", first), ("b", second))
            if state is not None and state is not S.MISSING
        }
        resolved = [None if state is S.MISSING else state for state in (first, second)]
        age = DEPENDENCY_GRACE_SECONDS + 1 if late else 0.0
        got = verdict(["a", "b"], states, age)
        assert got.verdict is expected_verdict(resolved, late), (first, second, late)
        if got.verdict is not Verdict.MET:
            assert got.culprits and all(name in got.message for name in got.culprits)


@given(st.lists(st.sampled_from(list(DependencyState)), max_size=6))
def test_the_verdict_does_not_depend_on_the_order(states: list[DependencyState]) -> None:
    names = [f"j{index}" for index in range(len(states))]
    table = dict(zip(names, states, strict=True))
    forward = verdict(names, table, age=DEPENDENCY_GRACE_SECONDS)
    backward = verdict(names[::-1], table, age=DEPENDENCY_GRACE_SECONDS)
    assert forward.verdict is backward.verdict
    assert set(forward.culprits) == set(backward.culprits)
