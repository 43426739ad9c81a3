"""`spec.suspend` in the reconciler: a suspended job's processes are stopped (its GPUs held
until they are gone), then its GPUs go back through the allocator's release; resumed, it is
admitted and launched again. The store and allocator are real, the processes faked (as in
test_reconciler)."""

from __future__ import annotations

from herd_operator.controllers.ports import ProcessPhase, Result
from herd_operator.specs import ConditionType, HerdJob, spec_fingerprint
from tests.unit import test_reconciler
from tests.unit.test_reconciler import STOP_POLL_S, World, facts, herd_job, started

world = test_reconciler.world
"""The reconciler tests' fixture: a real store and allocator, faked processes."""

SUSPENDED = "spec.suspend is true: the job's workers are stopped and its GPUs released"


def suspended(job: HerdJob, suspend: bool = True) -> HerdJob:
    return job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": suspend})})


def test_suspend_is_a_new_generation_and_false_is_the_old_fingerprint() -> None:
    job = herd_job("a")
    assert spec_fingerprint(suspended(job, False)) == spec_fingerprint(job)
    assert spec_fingerprint(suspended(job)) != spec_fingerprint(job)


def test_a_suspended_job_stops_holds_its_gpus_until_gone_then_releases_them(
    world: World,
) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    world.specs.put(suspended(herd_job("a", gpus=(1, 4))))

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)
    assert world.launcher.stops == ["a"]
    assert world.granted("a") == 4  # a dying worker may still use them
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("False", "Suspending")
    world.specs.put(herd_job("b", gpus=(1, 1)))
    world.reconcile("b")
    assert world.granted("b") == 0

    world.launcher.exit("a", -15)
    assert world.reconcile("a") == Result()

    assert world.granted("a") == 0
    status = world.status("a")
    assert status.summary() == "Suspended"
    assert facts(world.condition("a", ConditionType.Suspended)) == ("True", "Suspended", SUSPENDED)
    assert facts(world.condition("a", ConditionType.Admitted))[:2] == ("False", "Suspended")
    assert status.gpus is not None and status.gpus.allocated == 0 and status.placement == []
    reasons = [reason for _, reason, _ in world.events("a")]
    assert reasons[-2:] == ["Suspending", "Suspended"]
    assert world.store.grant_history("a")[-1].gpus == 0
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT

    # Resynced while suspended: nothing started, nothing asked, no event again.
    assert world.reconcile("a") == Result()
    assert [reason for _, reason, _ in world.events("a")] == reasons
    assert world.launcher.starts == [("a", 1, 4)]
    world.reconcile("b")
    assert world.granted("b") == 1  # the GPUs it gave back serve another job


def test_a_resumed_job_is_admitted_and_launched_again(world: World) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    world.specs.put(suspended(herd_job("a", gpus=(1, 4))))
    world.reconcile("a")
    world.launcher.exit("a", -15)
    world.reconcile("a")

    world.specs.put(herd_job("a", gpus=(1, 4)))
    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4), ("a", 3, 4)]  # generations 1, 2, 3
    assert facts(world.condition("a", ConditionType.Suspended))[:2] == ("False", "Resumed")
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")
    assert world.status("a").summary() == "Running"
    assert [reason for _, reason, _ in world.events("a")][-2:] == ["Resumed", "Started"]
    assert world.status("a").restarts == 0  # a suspension is no failure


def test_a_job_declared_suspended_never_starts(world: World) -> None:
    world.specs.put(suspended(herd_job("a", gpus=(2, 2))))
    assert world.reconcile("a") == Result()
    assert world.launcher.starts == []
    assert world.granted("a") == 0
    assert world.status("a").summary() == "Suspended"


def test_a_job_resumed_before_its_processes_stopped_waits_for_them_then_runs(
    world: World,
) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    world.specs.put(suspended(herd_job("a", gpus=(1, 4))))
    world.reconcile("a")
    world.specs.put(herd_job("a", gpus=(1, 4)))

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)  # still stopping
    assert world.granted("a") == 4
    world.launcher.exit("a", -15)
    world.reconcile("a")

    assert [start[0] for start in world.launcher.starts] == ["a", "a"]
    assert world.launcher.state("a").phase == ProcessPhase.RUNNING


def test_a_finished_job_stays_finished_when_suspended(world: World) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    world.launcher.exit("a", 0)
    world.reconcile("a")
    assert world.status("a").summary() == "Succeeded"

    world.specs.put(suspended(herd_job("a", gpus=(1, 4))))
    assert world.reconcile("a") == Result()

    assert world.status("a").summary() == "Succeeded"
    assert world.launcher.starts == [("a", 1, 4)]
    assert "Suspended" not in [reason for _, reason, _ in world.events("a")]
