"""Preemption by the allocator's queue in the controller (issue 31): a job whose grant the
queue empties has its workers stopped (not a failure), shows `Preempted`, and is launched
again when granted again; what the queue counted survives an operator restart. The store
and the allocator are real, the processes faked (as in test_reconciler)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from herd_operator.cli.main import main
from herd_operator.controllers.job_status import FALSE, TRUE, preempted_for
from herd_operator.controllers.ports import ProcessPhase, Result
from herd_operator.controllers.reconciler import JobReconciler
from herd_operator.layout import StateLayout
from herd_operator.policies.queueing import PREEMPTED_FOR, QueueConfig, is_preemption
from herd_operator.runtime.adoption import adopted_holdings
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.bindings import Binding
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.store import Store
from herd_operator.specs import ConditionType, HerdJob, TrainingOptions, set_condition
from herd_operator.specs.values import Demand, Drain, Placement, Pool
from tests.unit.test_reconciler import (
    RESYNC_S,
    STOP_POLL_S,
    FakeClock,
    FakeLauncher,
    FakeSpecs,
    World,
    facts,
    herd_job,
    started,
)

MIN_RUN_S = 60.0


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """test_reconciler's world on 2 GPUs, its allocator with a `srpt` queue on the same
    clock (no draining: tests/unit/test_allocator.py covers drains)."""
    layout = StateLayout(tmp_path)
    layout.create()
    clock = FakeClock()
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}), GrantPublisher(layout), virtual=True,
        drain_seconds=0, clock=clock, wall_clock=clock,
        queue=QueueConfig("srpt", min_run_seconds=MIN_RUN_S),
    )  # fmt: skip
    specs = FakeSpecs()
    launcher = FakeLauncher(clock)
    with Store(tmp_path / "state.db") as store:
        reconciler = JobReconciler(
            specs, store, allocator, launcher, clock=clock, resync_seconds=RESYNC_S,
            stop_poll_seconds=STOP_POLL_S,
        )  # fmt: skip
        allocator.watch(lambda job, grant: None)
        yield World(store, allocator, specs, launcher, clock, reconciler)


def resumable(job: HerdJob) -> HerdJob:
    """`job` saying it goes on from a checkpoint (`training.resumable`): preemptible."""
    training = TrainingOptions(resumable=True)
    return job.model_copy(update={"spec": job.spec.model_copy(update={"training": training})})


def preempted_for_b(world: World) -> str:
    """`a` (resumable) runs on both GPUs past the minimum run; `b` (a new job, less work
    done) comes: the queue preempts `a` for it. Returns a's grant's reason."""
    started(world, resumable(herd_job("a", gpus=(2, 2))))
    world.clock.advance(2 * MIN_RUN_S)
    world.specs.put(herd_job("b", gpus=(2, 2)))
    world.reconcile("b")
    assert world.granted("a") == 0 and world.granted("b") == 2
    return world.grant_reason("a")


def test_a_job_whose_spec_does_not_say_resumable_is_not_preempted(world: World) -> None:
    started(world, herd_job("a", gpus=(2, 2)))
    world.clock.advance(2 * MIN_RUN_S)
    world.specs.put(herd_job("b", gpus=(2, 2)))
    world.reconcile("b")
    assert world.granted("a") == 2 and world.granted("b") == 0
    assert not is_preemption(world.grant_reason("a"))
    assert world.launcher.stops == []


def test_a_preempted_job_is_stopped_shown_then_relaunched_without_a_restart(
    world: World,
) -> None:
    why = preempted_for_b(world)
    assert why == "preempted for b (attained 0.1 GPU-h against its 0.0)"

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)
    assert world.launcher.stops == ["a"]
    status = world.status("a")
    assert status.summary() == "Preempted" and status.preemptions == 1
    assert facts(world.condition("a", ConditionType.Preempted)) == ("True", "Preempted", why)
    assert world.condition("a", ConditionType.Running).reason == "Preempted"
    assert ("Normal", "Preempted", why) in world.events("a")
    # Resynced while its workers stop: said once, counted once.
    world.reconcile("a")
    assert [e for e in world.events("a") if e[1] == "Preempted"] == [("Normal", "Preempted", why)]
    assert world.status("a").preemptions == 1

    world.launcher.exit("a", -15)  # stopped by us: SIGTERM
    # Pending, it asks again at each resync: its GPUs' drain ends at a request only.
    assert world.reconcile("a") == Result(requeue_after=RESYNC_S)
    status = world.status("a")
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("False", "Preempted")
    assert status.restarts == 0 and status.retry_at is None and status.finished_at is None
    assert facts(world.condition("a", ConditionType.Admitted))[:2] == ("False", "Pending")
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT
    assert not any(reason in ("BackOff", "Failed") for _, reason, _ in world.events("a"))

    world.launcher.exit("b", 0)
    world.reconcile("b")  # b succeeded: its GPUs go back, to a
    world.reconcile("a")
    assert [start[0] for start in world.launcher.starts] == ["a", "b", "a"]
    assert facts(world.condition("a", ConditionType.Preempted))[:2] == ("False", "Readmitted")
    assert world.status("a").summary() == "Running" and world.status("a").restarts == 0
    reasons = [reason for _, reason, _ in world.events("a")]
    assert reasons[-2:] == ["Started", "Readmitted"]


def test_the_stop_the_exit_and_the_relaunch_read_a_preemption_only_while_it_is_shown() -> None:
    why = f"{PREEMPTED_FOR}b (attained 0.1 GPU-h against its 0.0)"
    shown = set_condition((), ConditionType.Preempted, TRUE, "Preempted", why, 1, 10.0)
    assert preempted_for(shown) == why
    ended = set_condition(shown, ConditionType.Preempted, FALSE, "Readmitted", "granted", 1, 20.0)
    assert preempted_for(ended) is None, "a readmitted job's old reason is no preemption"
    running = set_condition((), ConditionType.Running, TRUE, "Started", why, 1, 10.0)
    assert preempted_for(running) is None, "only the Preempted condition says it"
    assert preempted_for(()) is None


def test_a_decision_before_the_preempted_jobs_reconcile_does_not_hide_the_preemption(
    world: World,
) -> None:
    why = preempted_for_b(world)
    world.specs.put(herd_job("c", gpus=(1, 1)))
    world.reconcile("c")  # another decision; a's grant stays empty
    assert world.grant_reason("a") == why
    world.reconcile("a")
    assert world.launcher.stops == ["a"]


def test_a_launch_adopted_while_it_stopped_for_a_preemption_is_stopped_not_failed(
    world: World,
) -> None:
    """The operator restarted during the stop: the adopted launch no longer says it was
    stopped by us, and the new allocator has no grant for it. The status's `Preempted`
    says what it was doing: stopped again, its exit is no failure."""
    preempted_for_b(world)
    world.reconcile("a")
    state = world.launcher.states["a"]
    world.launcher.states["a"] = replace(state, phase=ProcessPhase.RUNNING, stopped_by_us=False)
    world.allocator.release("a")  # what a restarted allocator knows of it: nothing

    world.reconcile("a")
    assert world.launcher.stops == ["a", "a"]
    assert world.status("a").preemptions == 1
    world.launcher.states["a"] = replace(world.launcher.states["a"], stopped_by_us=False)
    world.launcher.exit("a", -15)
    world.reconcile("a")
    assert world.status("a").restarts == 0
    assert world.condition("a", ConditionType.Running).reason == "Preempted"
    assert not any(reason in ("BackOff", "Failed") for _, reason, _ in world.events("a"))


def test_the_service_attained_and_preemptions_survive_an_operator_restart(
    tmp_path: Path,
) -> None:
    """Recorded with each decision (in the store, with the allocations) and restored: the
    running job attained on while no operator ran; the preempted one is still preempted,
    and its count (the preemption bound) is kept."""
    clock = FakeClock()
    config = QueueConfig("srpt", min_run_seconds=MIN_RUN_S, max_preemptions=1)
    pool = Pool.from_counts({"localhost": 2})
    layout = StateLayout(tmp_path)
    layout.create()

    def allocator() -> Allocator:
        return Allocator(pool, GrantPublisher(layout), virtual=True,
                         drain_seconds=0, clock=clock, wall_clock=clock, queue=config)  # fmt: skip

    first = allocator()
    first.request(Demand("a", 2, 2, 2, 0, 1.0, resumable=True))
    clock.advance(1000.0)
    first.request(Demand("b", 2, 2, 2, 0, 2.0))  # a preempted
    assert is_preemption(first.grant("a").reason)  # type: ignore[union-attr]
    clock.advance(500.0)
    with Store(tmp_path / "state.db") as store:
        for job in ("a", "b"):
            store.record_spec(job, f"{job}.yaml", herd_job(job, gpus=(2, 2)), job, clock())
        first.request(Demand("b", 2, 2, 2, 0, 2.0, done_fraction=0.5))  # a decision, recorded
        snapshot = first._snapshot()  # what on_decision hands the store
        store.replace_allocations(
            snapshot.placements, clock(), snapshot.draining, service=snapshot.service
        )
        service = store.service()
    assert service["a"].preemptions == 1 and service["a"].attained == 2000.0
    assert service["b"].attained == 1000.0 and is_preemption(service["a"].preempted)

    clock.advance(300.0)  # the operator was down; b's workers ran on
    second = allocator()
    second.restore({"b": snapshot.placements["b"]}, (), {}, service=service)
    records = second._service.records(clock(), clock())
    assert records["b"].attained == 1600.0 and records["a"].attained == 2000.0
    assert records["a"].preemptions == 1 and records["a"].waiting_since == 1000.0 + 1000.0
    # a asks again: still preempted (its grant says so; the controller stops it on that)
    assert is_preemption(second.request(Demand("a", 2, 2, 2, 0, 1.0, resumable=True)).reason)  # type: ignore[union-attr]


def test_an_adopted_job_does_not_hold_the_gpus_it_was_giving_back() -> None:
    """A restart during a preemption's drain: the store has no placement for the preempted
    job (it holds nothing) and its GPUs as draining; its workers, still bound there, make
    them drain on, not its placement again (then the job it yielded to, waiting for the
    drain, and it would both count on them)."""
    placements, draining = adopted_holdings(
        running={"a"},
        stored={},
        stored_draining={("localhost", 0): Drain("a", 10.0, (("localhost", 41),))},
        bound=[Binding("a", "localhost", 0, 0, 41, "localhost")],
        pool=Pool.from_counts({"localhost": 2}),
        now=100.0,
    )
    assert placements == {}
    assert draining == {("localhost", 0): Drain("a", 10.0, (("localhost", 41),))}
    assert Placement.EMPTY.size == 0


def test_get_and_describe_show_a_preempted_job(
    world: World, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why = preempted_for_b(world)
    world.reconcile("a")
    capsys.readouterr()

    assert main(["get", "--state-dir", str(tmp_path)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert "Preempted" in rows["a"] and "Running" in rows["b"]
    assert main(["describe", "a", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Status:       Preempted" in out and "Preemptions:  1" in out
    assert "allocated 0" in out and f"Last decision: {why}" in out
    lines = [line.split(None, 3) for line in out.splitlines()]
    conditions = {line[0]: line[1:3] for line in lines if len(line) > 2}
    assert conditions["Preempted"] == ["True", "Preempted"]
    assert conditions["Admitted"] == ["False", "Preempted"]
