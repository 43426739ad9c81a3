"""When a job may start and how long it may run: its dependencies (`spec.dependsOn`) and
its time limit (`spec.activeDeadlineSeconds`), as pure functions of stored times and states.

Apart from the reconcile step that acts on them (`gating.py`) so that each rule is one
function, tested exhaustively; the step reads the states and times they take from the
store, never from a timer, so an operator restart decides the same.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEPENDENCY_GRACE_SECONDS = 60.0
"""How long a job may name a dependency that no spec declares before it is failed for it
(counted from when the job was first recorded): `apply -f DIR` writes its files one by
one, so a dependent can be seen a moment before the job it names."""


def deadline_at(limit_seconds: int | None, run_started_at: float | None) -> float | None:
    """When a run that first started at ``run_started_at`` reaches its time limit (None:
    no limit, or not started: time before the first start does not count)."""
    if limit_seconds is None or run_started_at is None:
        return None
    return run_started_at + limit_seconds


def deadline_exceeded(limit_seconds: int | None, run_started_at: float | None, now: float) -> bool:
    """Whether the run's time limit is reached at ``now`` (at the limit itself too)."""
    deadline = deadline_at(limit_seconds, run_started_at)
    return deadline is not None and now >= deadline


def deadline_message(limit_seconds: int, run_started_at: float, now: float) -> str:
    return (
        f"activeDeadlineSeconds {limit_seconds} reached: the job first started"
        f" {now - run_started_at:.0f}s ago"
    )


def sooner(requeue_after: float | None, deadline: float | None, now: float) -> float | None:
    """When to look at a job again: its result's delay, or sooner if its deadline comes
    first (a pending job is woken by its grant only, which may not change before it)."""
    if deadline is None:
        return requeue_after
    until = max(0.0, deadline - now)
    return until if requeue_after is None else min(requeue_after, until)


class DependencyState(enum.StrEnum):
    """What a job named in `dependsOn` is, for its dependent."""

    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    UNFINISHED = "Unfinished"
    """Declared and not finished: pending, running, in BackOff, or its file is invalid."""
    DELETED = "Deleted"
    """Its spec file is gone while the store still holds it."""
    MISSING = "Missing"
    """No spec declares it and the store holds none."""


class Verdict(enum.StrEnum):
    MET = "Met"
    WAITING = "Waiting"
    FAILED = "DependencyFailed"


@dataclass(frozen=True)
class Dependencies:
    """Whether a job's dependencies let it be admitted, and why not."""

    verdict: Verdict
    message: str
    culprits: tuple[str, ...] = ()
    """The jobs it waits for (WAITING) or that failed it (FAILED)."""


def dependency_verdict(
    depends_on: Sequence[str],
    states: Mapping[str, DependencyState],
    declared_at: float,
    now: float,
    grace: float = DEPENDENCY_GRACE_SECONDS,
) -> Dependencies:
    """Whether a job that names ``depends_on`` may be admitted, given each one's state (a
    name absent from ``states`` is MISSING).

    FAILED when one of them failed or was deleted, or is missing ``grace`` seconds after
    the job was declared (``declared_at``): it can never succeed, and the job would wait
    forever (Slurm's DependencyNeverSatisfied). Else WAITING while any is not Succeeded
    (a missing one within the grace too). Else MET (an empty list: MET at once). Failure
    wins over waiting: a job is not left to wait for others when it can never start.
    """
    failed: list[str] = []
    waiting: list[str] = []
    for name in depends_on:
        state = states.get(name, DependencyState.MISSING)
        if state in (DependencyState.FAILED, DependencyState.DELETED):
            failed.append(f"{name} ({state.value.lower()})")
        elif state is DependencyState.MISSING and now - declared_at >= grace:
            failed.append(f"{name} (no such job)")
        elif state is DependencyState.MISSING:
            waiting.append(f"{name} (not declared yet)")
        elif state is DependencyState.UNFINISHED:
            waiting.append(name)
    if failed:
        names = tuple(entry.split(" ", 1)[0] for entry in failed)
        return Dependencies(
            Verdict.FAILED,
            f"dependency {', '.join(failed)} can never succeed",
            names,
        )
    if waiting:
        names = tuple(entry.split(" ", 1)[0] for entry in waiting)
        return Dependencies(Verdict.WAITING, f"waiting for {', '.join(waiting)} to succeed", names)
    return Dependencies(Verdict.MET, "every dependency succeeded" if depends_on else "")
