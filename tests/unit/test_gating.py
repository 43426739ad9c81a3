"""The reconcile's edges for issue 28's limits and order (controllers.gating) and progress
(controllers.running): dependencies hold a job out of the allocator until they succeed and
fail it when they never can; a time limit stops a run and fails it, its GPUs released,
counted from stored times; progress, ETA and the reported metrics land in the status.

The same parts as tests/unit/test_reconciler.py: the real store and allocator, processes
faked, a clock moved by hand.
"""

from __future__ import annotations

from typing import Any

from herd_operator.controllers.limits import DEPENDENCY_GRACE_SECONDS
from herd_operator.controllers.ports import ProcessPhase, Result
from herd_operator.controllers.reconciler import JobReconciler
from herd_operator.specs import ConditionType, HerdJob, get_condition, is_true
from herd_operator.specs.status import Progress
from tests.unit.test_reconciler import (
    RESYNC_S,
    STOP_POLL_S,
    T0,
    World,
    facts,
    herd_job,
    started,
    world,
)

__all__ = ["world"]  # the fixture, used by name


def with_spec(job: HerdJob, **extra: Any) -> HerdJob:
    document = job.model_dump(mode="json", by_alias=True)
    document["spec"].update(extra)
    return HerdJob.model_validate(document)


def job(name: str = "a", gpus: tuple[int, int] = (1, 4), **extra: Any) -> HerdJob:
    return with_spec(herd_job(name, gpus=gpus), **extra)


def succeed(world: World, name: str) -> None:
    world.launcher.exit(name, 0)
    world.reconcile(name)
    assert is_true(world.status(name).conditions, ConditionType.Succeeded)


def fail(world: World, name: str) -> None:
    world.launcher.exit(name, 1)
    world.reconcile(name)
    assert is_true(world.status(name).conditions, ConditionType.Failed)


# ---- dependencies ----


def test_a_dependent_waits_without_asking_for_gpus_then_starts_after_success(
    world: World,
) -> None:
    started(world, job("a", gpus=(1, 2)))
    world.specs.put(job("b", gpus=(1, 1), dependsOn=["a"]))

    result = world.reconcile("b")

    assert result == Result(requeue_after=RESYNC_S)  # looks again each resync
    assert world.launcher.starts == [("a", 1, 2)]
    assert world.allocator.grant("b") is None  # no demand: it holds no place in the queue
    assert facts(world.condition("b", ConditionType.DependenciesMet)) == (
        "False",
        "Waiting",
        "waiting for a to succeed",
    )
    assert world.status("b").summary() == "Waiting"
    assert world.events("b") == [("Normal", "Waiting", "waiting for a to succeed")]
    world.reconcile("b")
    assert len(world.events("b")) == 1  # said once

    succeed(world, "a")
    world.clock.advance(RESYNC_S)
    world.reconcile("b")

    assert world.launcher.starts == [("a", 1, 2), ("b", 1, 1)]
    assert facts(world.condition("b", ConditionType.DependenciesMet)) == (
        "True",
        "Met",
        "every dependency succeeded",
    )
    assert world.status("b").summary() == "Running"


def test_a_failed_dependency_fails_the_dependent(world: World) -> None:
    started(world, job("a"))
    world.specs.put(job("b", dependsOn=["a"]))
    world.reconcile("b")
    fail(world, "a")

    result = world.reconcile("b")

    assert result == Result()
    message = "dependency a (failed) can never succeed"
    assert facts(world.condition("b", ConditionType.Failed)) == (
        "True",
        "DependencyFailed",
        message,
    )
    assert facts(world.condition("b", ConditionType.DependenciesMet)) == (
        "False",
        "DependencyFailed",
        message,
    )
    assert world.events("b")[-1] == ("Warning", "DependencyFailed", message)
    assert world.status("b").summary() == "Failed"
    assert world.status("b").finished_at == world.clock()
    world.reconcile("b")
    assert world.launcher.starts == [("a", 1, 4)]  # never started
    assert world.allocator.grant("b") is None


def test_a_deleted_dependency_fails_the_dependent(world: World) -> None:
    started(world, job("a"))
    world.specs.put(job("b", dependsOn=["a"]))
    world.reconcile("b")
    world.specs.delete("a")  # its record stays until its processes are gone

    world.reconcile("b")

    assert facts(world.condition("b", ConditionType.Failed))[1:] == (
        "DependencyFailed",
        "dependency a (deleted) can never succeed",
    )


def test_a_dependency_not_declared_yet_is_waited_for_within_the_grace(world: World) -> None:
    world.specs.put(job("b", dependsOn=["a"]))
    world.reconcile("b")
    assert facts(world.condition("b", ConditionType.DependenciesMet))[1:] == (
        "Waiting",
        "waiting for a (not declared yet) to succeed",
    )

    world.clock.advance(DEPENDENCY_GRACE_SECONDS)
    world.reconcile("b")

    assert facts(world.condition("b", ConditionType.Failed))[1:] == (
        "DependencyFailed",
        "dependency a (no such job) can never succeed",
    )


def test_a_dependency_declared_within_the_grace_is_waited_for(world: World) -> None:
    world.specs.put(job("b", dependsOn=["a"]))
    world.reconcile("b")
    world.clock.advance(DEPENDENCY_GRACE_SECONDS / 2)
    started(world, job("a"))
    world.clock.advance(DEPENDENCY_GRACE_SECONDS)

    world.reconcile("b")

    assert world.status("b").summary() == "Waiting"
    succeed(world, "a")
    world.reconcile("b")
    assert world.launcher.state("b").phase == ProcessPhase.RUNNING


def test_a_started_run_is_not_held_by_its_dependencies_any_more(world: World) -> None:
    started(world, job("a", gpus=(1, 1)))
    world.specs.put(job("b", gpus=(1, 1), dependsOn=["a"], restartPolicy={"onFailure": True}))
    succeed(world, "a")
    world.reconcile("b")
    assert world.launcher.state("b").phase == ProcessPhase.RUNNING
    world.specs.put(job("a", gpus=(1, 2)))  # a runs again: b's run has started already
    world.reconcile("a")
    world.launcher.exit("b", 1)
    world.reconcile("b")  # BackOff
    world.clock.advance(5.0)

    world.reconcile("b")

    assert [start[0] for start in world.launcher.starts].count("b") == 2


def test_a_spec_edit_of_a_failed_dependent_waits_again(world: World) -> None:
    started(world, job("a"))
    world.specs.put(job("b", dependsOn=["a"]))
    fail(world, "a")
    world.reconcile("b")
    assert world.status("b").summary() == "Failed"
    world.specs.put(job("a", priority=1))  # a runs again
    world.reconcile("a")
    world.specs.put(job("b", dependsOn=["a"], priority=1))

    world.reconcile("b")

    assert world.status("b").summary() == "Waiting"
    assert not is_true(world.status("b").conditions, ConditionType.Failed)


# ---- the time limit ----


def test_a_run_past_its_deadline_is_stopped_then_failed_and_its_gpus_released(
    world: World,
) -> None:
    started(world, job("a", activeDeadlineSeconds=60))
    assert world.status("a").run_started_at == T0
    world.clock.advance(59.0)
    assert world.reconcile("a") == Result(requeue_after=RESYNC_S)
    world.clock.advance(1.0)

    result = world.reconcile("a")

    assert result == Result(requeue_after=STOP_POLL_S)
    assert world.launcher.stops == ["a"]
    assert world.granted("a") == 4  # held while its processes stop
    message = "activeDeadlineSeconds 60 reached: the job first started 60s ago"
    assert facts(world.condition("a", ConditionType.Running)) == (
        "False",
        "DeadlineExceeded",
        f"{message}: stopping it",
    )
    world.reconcile("a")
    assert world.launcher.stops == ["a"]  # once
    world.clock.advance(2.0)
    world.launcher.exit("a", -15)

    assert world.reconcile("a") == Result()

    later = "activeDeadlineSeconds 60 reached: the job first started 62s ago"
    assert facts(world.condition("a", ConditionType.Failed)) == ("True", "DeadlineExceeded", later)
    assert world.allocator.grant("a") is None
    status = world.status("a")
    assert status.gpus is not None and status.gpus.allocated == 0
    assert status.placement == []
    assert world.store.grant_history("a")[-1].gpus == 0
    assert [event[1] for event in world.events("a")] == [
        "Started",
        "DeadlineExceeded",
        "DeadlineExceeded",
    ]
    world.clock.advance(600.0)
    world.reconcile("a")
    assert len(world.launcher.starts) == 1


def test_a_run_that_succeeds_before_its_deadline_is_seen_succeeded(world: World) -> None:
    started(world, job("a", activeDeadlineSeconds=60))
    world.clock.advance(61.0)
    world.launcher.exit("a", 0)  # it ended by itself, before the operator looked

    world.reconcile("a")

    assert world.status("a").summary() == "Succeeded"


def test_the_clock_runs_across_a_backoff_and_fails_a_run_waiting_in_it(world: World) -> None:
    started(world, job("a", activeDeadlineSeconds=60, restartPolicy={"onFailure": True}))
    world.clock.advance(30.0)
    world.launcher.exit("a", 1)
    world.reconcile("a")  # BackOff: restarted after 1 s
    world.clock.advance(1.0)
    world.reconcile("a")
    assert len(world.launcher.starts) == 2
    assert world.status("a").run_started_at == T0  # the run's first start, not the relaunch's
    world.clock.advance(29.0)

    world.reconcile("a")

    assert world.launcher.stops == ["a"]


def test_queued_time_does_not_count_and_a_pending_run_is_woken_at_its_deadline(
    world: World,
) -> None:
    started(world, job("big", gpus=(4, 4)))
    world.specs.put(job("a", gpus=(2, 2), activeDeadlineSeconds=60))
    world.reconcile("a")  # pending: no GPU free
    world.clock.advance(600.0)
    world.reconcile("a")
    assert world.status("a").run_started_at is None  # queued: no clock yet
    world.launcher.exit("big", 0)
    world.reconcile("big")
    world.reconcile("a")
    assert world.status("a").run_started_at == T0 + 600.0
    # Its processes vanish and its GPUs go to a job of higher priority: it waits again ...
    world.launcher.vanish("a")
    world.allocator.release("a")
    started(world, job("hog", gpus=(4, 4), priority=10))
    world.clock.advance(10.0)

    result = world.reconcile("a")

    # ... where its grant will not change by itself: it is woken at its deadline.
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT
    assert result.requeue_after == 50.0
    world.clock.advance(50.0)
    world.reconcile("a")
    assert facts(world.condition("a", ConditionType.Failed))[1] == "DeadlineExceeded"


def test_the_deadline_counts_from_stored_times_across_an_operator_restart(
    world: World,
) -> None:
    started(world, job("a", activeDeadlineSeconds=60))
    world.clock.advance(45.0)
    world.reconcile("a")
    # A new operator: a reconciler with nothing in memory, over the same store and processes.
    fresh = JobReconciler(
        world.specs, world.store, world.allocator, world.launcher, clock=world.clock
    )
    world.clock.advance(15.0)

    fresh.reconcile("a")

    assert world.launcher.stops == ["a"]


def test_a_spec_edit_after_a_deadline_failure_runs_again_with_a_new_clock(world: World) -> None:
    started(world, job("a", activeDeadlineSeconds=60))
    world.clock.advance(60.0)
    world.reconcile("a")
    world.launcher.exit("a", -15)
    world.reconcile("a")
    assert world.status("a").summary() == "Failed"
    world.specs.put(job("a", activeDeadlineSeconds=120))

    world.reconcile("a")

    assert len(world.launcher.starts) == 2
    status = world.status("a")
    assert status.run_started_at == T0 + 60.0
    assert not is_true(status.conditions, ConditionType.Failed)


# ---- progress and metrics ----


def test_progress_eta_and_metrics_land_in_the_status(world: World) -> None:
    started(world, job("a", gpus=(2, 2), training={"epochs": 10}))
    for epoch, (seconds, loss) in enumerate([(10.0, 2.0), (12.0, 1.5), (11.0, 1.2)]):
        world.clock.advance(seconds)
        world.store.add_report("a", epoch, 2, 0, {"loss": loss}, world.clock())

    world.reconcile("a")

    status = world.status("a")
    # Epochs 1 and 2 measured whole at size 2 (12 s, 11 s): median 11.5; 7 epochs left.
    last_end = T0 + 33.0
    assert status.progress == Progress(
        epochs=10,
        completed=3,
        epoch_seconds=11.5,
        world_size=2,
        estimated_completion=last_end + 7 * 11.5,
    )
    assert status.metrics == {"loss": 1.2}
    before = status
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    assert world.status("a") == before  # a resync with no report writes nothing new

    world.launcher.exit("a", 0)
    world.reconcile("a")
    ended = world.status("a")
    assert ended.progress is not None and ended.progress.estimated_completion is None
    assert ended.progress.completed == 3 and ended.metrics == {"loss": 1.2}


def test_no_expected_epochs_no_progress(world: World) -> None:
    started(world, job("a"))
    world.store.add_report("a", 0, 4, 0, {"loss": 1.0}, world.clock())
    world.reconcile("a")
    status = world.status("a")
    assert status.progress is None
    assert status.metrics == {"loss": 1.0}
    assert get_condition(status.conditions, ConditionType.DependenciesMet) is None
