"""Tests for controllers.reconciler: the level-triggered control loop of one job.

The store and the allocator are the real ones (SQLite in tmp_path, virtual GPUs);
only the processes are faked, so each test drives a job's lifecycle by hand.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.controllers.errors import LaunchError
from herd_operator.controllers.launching import restart_delay
from herd_operator.controllers.ports import (
    LaunchInfo,
    ProcessPhase,
    ProcessState,
    Result,
    SpecView,
)
from herd_operator.controllers.reconciler import JobReconciler
from herd_operator.controllers.running import resize_cost, watch_workers
from herd_operator.layout import StateLayout
from herd_operator.rpc.protocol import NotFound
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher, relaunch_reason
from herd_operator.runtime.handlers import AllocatorOps, BatchHandler
from herd_operator.runtime.process_table import is_process_of_job
from herd_operator.runtime.store import Event, GrantChange, Store, UnreadableSpecError
from herd_operator.specs import (
    Condition,
    ConditionStatus,
    ConditionType,
    HerdJob,
    PolicyRef,
    get_condition,
    is_true,
)
from herd_operator.specs.status import GpuCounts, HerdJobStatus, ResizeCost
from herd_operator.specs.values import Pool, Report, ResizeMode
from tests.unit.plugin_policy import LegacyPolicy, RecordingPolicy

RESYNC_S = 5.0
WORKER_LOST_GRACE_S = 30.0
REPORT_DEADLINE_S = 120.0
STOP_POLL_S = 0.5
T0 = 1000.0
COMMAND = ["python", "train.py"]


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeSpecs:
    """The spec directory as a dict: name -> what the file says now."""

    def __init__(self) -> None:
        self.views: dict[str, SpecView] = {}

    def view(self, name: str) -> SpecView | None:
        return self.views.get(name)

    def put(self, job: HerdJob) -> None:
        self.views[job.name] = SpecView(job.name, f"jobs/{job.name}.yaml", job)

    def put_invalid(self, name: str, *errors: str) -> None:
        self.views[name] = SpecView(name, f"jobs/{name}.yaml", None, errors)

    def delete(self, name: str) -> None:
        del self.views[name]


@dataclass
class FakeLauncher:
    """Records what the reconciler asks; the test decides how the processes behave."""

    clock: FakeClock
    starts: list[tuple[str, int, int]] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    states: dict[str, ProcessState] = field(default_factory=dict)
    start_error: Exception | None = None
    attempts: list[float] = field(default_factory=list)
    """The clock's time at each call of start, successful or not."""

    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo:
        self.attempts.append(self.clock())
        if self.start_error is not None:
            raise self.start_error
        # The real launcher refuses a second process for a job; a double start is a bug.
        assert job.name not in self.states, f"{job.name} started while it has a process"
        self.starts.append((job.name, generation, np))
        launch = LaunchInfo(
            launch_id=f"{job.name}-launch-{len(self.starts)}",
            pid=4000 + len(self.starts),
            started_at=self.clock(),
            generation=generation,
            command="horovodrun",
            spec=job.spec,
        )
        self.states[job.name] = ProcessState(ProcessPhase.RUNNING, launch=launch)
        return launch

    def state(self, name: str) -> ProcessState:
        return self.states.get(name, ProcessState(ProcessPhase.ABSENT))

    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        # The real launcher asks the job's engine; these jobs run on Horovod.
        return relaunch_reason(launch.spec, job.spec)

    def resize_mode(self, kind: str) -> ResizeMode | None:
        # The real launcher asks the engine of the kind (test_engines checks each engine's).
        return {"horovod": ResizeMode.LIVE, "torchrun": ResizeMode.RESTART}.get(kind)

    def stop(self, name: str) -> None:
        self.stops.append(name)
        state = self.states[name]
        self.states[name] = replace(state, phase=ProcessPhase.STOPPING, stopped_by_us=True)

    def forget(self, name: str) -> None:
        # Like the real launcher: only an exited process's record is dropped.
        if self.state(name).phase == ProcessPhase.EXITED:
            del self.states[name]

    def exit(self, name: str, code: int) -> None:
        """The job's horovodrun ends with `code` (stopped by us if stop() was called)."""
        self.states[name] = replace(self.states[name], phase=ProcessPhase.EXITED, exit_code=code)

    def vanish(self, name: str) -> None:
        self.states.pop(name, None)


@dataclass
class World:
    store: Store
    allocator: Allocator
    specs: FakeSpecs
    launcher: FakeLauncher
    clock: FakeClock
    reconciler: JobReconciler

    def reconcile(self, name: str) -> Result:
        return self.reconciler.reconcile(name)

    def status(self, name: str) -> HerdJobStatus:
        record = self.store.get_job(name)
        assert record is not None, f"{name} is not in the store"
        return record.status

    def condition(self, name: str, condition_type: ConditionType) -> Condition:
        found = get_condition(self.status(name).conditions, condition_type)
        assert found is not None, f"{name} has no {condition_type} condition"
        return found

    def events(self, name: str) -> list[tuple[str, str, str]]:
        return [(event.type, event.reason, event.message) for event in self.raw_events(name)]

    def raw_events(self, name: str) -> list[Event]:
        return self.store.events(name)

    def granted(self, name: str) -> int:
        grant = self.allocator.grant(name)
        return grant.placement.size if grant is not None else 0

    def grant_reason(self, name: str) -> str:
        grant = self.allocator.grant(name)
        assert grant is not None, f"{name} has no grant"
        return grant.reason


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    layout = StateLayout(tmp_path)
    layout.create()
    clock = FakeClock()
    # No draining here: these tests are about the reconciler (tests/unit/test_allocator.py
    # covers how given-back GPUs drain before they are granted again).
    allocator = Allocator(
        Pool.from_counts({"localhost": 4}), GrantPublisher(layout), virtual=True, drain_seconds=0
    )
    specs = FakeSpecs()
    launcher = FakeLauncher(clock)
    with Store(tmp_path / "state.db") as store:
        reconciler = JobReconciler(
            specs,
            store,
            allocator,
            launcher,
            clock=clock,
            resync_seconds=RESYNC_S,
            stop_poll_seconds=STOP_POLL_S,
            report_deadline_seconds=REPORT_DEADLINE_S,
        )
        yield World(store, allocator, specs, launcher, clock, reconciler)


def herd_job(
    name: str = "a",
    *,
    gpus: tuple[int, int] = (1, 4),
    command: list[str] = COMMAND,
    priority: int = 0,
    restart: dict[str, Any] | None = None,
    policy: str = "static",
) -> HerdJob:
    spec: dict[str, Any] = {
        "command": command,
        "gpus": {"min": gpus[0], "max": gpus[1]},
        "priority": priority,
        "policy": {"name": policy},
    }
    if restart is not None:
        spec["restartPolicy"] = restart
    return HerdJob.model_validate(
        {"apiVersion": "herd/v1alpha1", "kind": "HerdJob", "metadata": {"name": name}, "spec": spec}
    )


def started(world: World, job: HerdJob) -> None:
    """Declare `job` and reconcile it once, so it runs."""
    world.specs.put(job)
    world.reconcile(job.name)
    assert world.launcher.state(job.name).phase == ProcessPhase.RUNNING


def facts(condition: Condition) -> tuple[str, str, str]:
    return (condition.status, condition.reason, condition.message)


# ---- 1, 2: a new job starts, once ----


def test_new_valid_spec_starts_with_the_granted_size(world: World) -> None:
    world.specs.put(herd_job(gpus=(1, 4)))

    result = world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4)]
    assert result == Result(requeue_after=RESYNC_S, keep_backoff=True)
    record = world.store.get_job("a")
    assert record is not None and record.generation == 1
    status = world.status("a")
    assert status.observed_generation == 1
    assert facts(world.condition("a", ConditionType.SpecValid)) == ("True", "Valid", "")
    assert facts(world.condition("a", ConditionType.Admitted)) == (
        "True",
        "Admitted",
        world.grant_reason("a"),
    )
    assert facts(world.condition("a", ConditionType.Running)) == (
        "True",
        "Started",
        "waiting for the workers' first report",
    )
    assert facts(world.condition("a", ConditionType.Resizing)) == ("False", "Stable", "")
    assert status.gpus == GpuCounts(min=1, max=4, desired=4, allocated=4, active=None)
    assert status.placement == [("localhost", [0, 1, 2, 3])]
    assert (status.launch_id, status.started_at) == ("a-launch-1", T0)
    assert world.events("a") == [("Normal", "Started", "horovodrun pid 4001 with 4 workers")]
    assert world.store.grant_history("a") == [GrantChange("a", T0, 4, world.grant_reason("a"))]


def test_reconciling_again_without_change_starts_nothing_and_adds_no_event(world: World) -> None:
    started(world, herd_job())
    before = world.status("a")
    world.clock.advance(7.0)

    results = [world.reconcile("a") for _ in range(3)]

    assert results == [Result(requeue_after=RESYNC_S)] * 3
    assert world.launcher.starts == [("a", 1, 4)]
    (event,) = world.raw_events("a")
    assert (event.reason, event.count) == ("Started", 1)
    after = world.status("a")
    assert after.conditions == before.conditions  # transition times did not move
    assert after.gpus == before.gpus
    assert len(world.store.grant_history("a")) == 1


def test_a_status_written_by_someone_else_is_read_again(world: World) -> None:
    # The store keeps the status it wrote, parsed; a different stored text (another
    # writer: the operator's shutdown, an older version) must win over that copy.
    started(world, herd_job())
    world.reconcile("a")
    changed = world.status("a").model_copy(update={"epoch": 41, "restarts": 2})
    world.store.put_status("a", changed, now=T0)
    world.clock.advance(1.0)

    world.reconcile("a")

    status = world.status("a")
    assert (status.epoch, status.restarts) == (41, 2)


# ---- 3: spec changes ----


def test_priority_change_bumps_the_generation_without_a_relaunch(world: World) -> None:
    started(world, herd_job())
    world.specs.put(herd_job(priority=5))

    world.reconcile("a")

    record = world.store.get_job("a")
    assert record is not None and record.generation == 2
    assert world.status("a").observed_generation == 2
    assert world.condition("a", ConditionType.Running).observed_generation == 2
    assert world.launcher.stops == []
    assert world.launcher.starts == [("a", 1, 4)]


def test_command_change_while_running_stops_the_job(world: World) -> None:
    started(world, herd_job())
    world.specs.put(herd_job(command=["python", "train_v2.py"]))

    result = world.reconcile("a")

    assert result == Result(requeue_after=STOP_POLL_S)
    assert world.launcher.stops == ["a"]
    reason = "command, env, training, workingDir, gpus.min or horovod options changed"
    assert world.events("a")[-1] == ("Normal", "Relaunching", reason)
    assert facts(world.condition("a", ConditionType.Running)) == ("False", "Stopping", reason)
    assert world.status("a").observed_generation == 2


def test_job_stopped_for_a_relaunch_is_polled_and_keeps_its_gpus(world: World) -> None:
    started(world, herd_job())
    world.specs.put(herd_job(command=["python", "train_v2.py"]))
    world.reconcile("a")

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)

    assert world.launcher.stops == ["a"]  # stop is asked once, then only waited for
    assert world.launcher.starts == [("a", 1, 4)]
    assert world.granted("a") == 4
    assert [reason for _, reason, _ in world.events("a")] == ["Started", "Relaunching"]


def test_job_stopped_for_a_relaunch_starts_again_with_the_new_generation(world: World) -> None:
    started(world, herd_job())
    world.specs.put(herd_job(command=["python", "train_v2.py"]))
    world.reconcile("a")
    world.launcher.exit("a", -15)

    result = world.reconcile("a")

    assert result == Result(requeue_after=RESYNC_S, keep_backoff=True)
    assert world.launcher.starts == [("a", 1, 4), ("a", 2, 4)]
    status = world.status("a")
    assert status.restarts == 0  # our own stop is not a failure
    assert status.launch_id == "a-launch-2"
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")
    assert get_condition(status.conditions, ConditionType.Failed) is None
    assert [reason for _, reason, _ in world.events("a")] == ["Started", "Relaunching", "Started"]


def test_lowering_max_shrinks_the_grant_without_a_relaunch(world: World) -> None:
    started(world, herd_job(gpus=(1, 4)))
    world.specs.put(herd_job(gpus=(1, 2)))

    result = world.reconcile("a")

    assert result == Result(requeue_after=RESYNC_S)
    assert world.launcher.stops == []
    assert world.launcher.starts == [("a", 1, 4)]
    assert world.granted("a") == 2
    status = world.status("a")
    assert status.gpus == GpuCounts(min=1, max=2, desired=2, allocated=2, active=None)
    assert status.placement == [("localhost", [0, 1])]  # shrunk from the tail
    # The job now has what its policy asks for, so the event gives the policy's reason.
    assert world.events("a")[-1] == ("Normal", "Resized", "4 -> 2 GPUs: static: max 2")


def test_raising_max_above_the_launched_max_relaunches(world: World) -> None:
    started(world, herd_job(gpus=(1, 2)))
    world.specs.put(herd_job(gpus=(1, 4)))

    world.reconcile("a")
    world.launcher.exit("a", -15)
    world.reconcile("a")

    reason = "gpus.max raised above the launched --max-np 2"
    assert world.launcher.stops == ["a"]
    assert ("Normal", "Relaunching", reason) in world.events("a")
    assert world.launcher.starts == [("a", 1, 2), ("a", 2, 4)]


def test_raising_max_back_up_to_the_launched_max_does_not_relaunch(world: World) -> None:
    started(world, herd_job(gpus=(1, 4)))
    world.specs.put(herd_job(gpus=(1, 2)))
    world.reconcile("a")
    world.specs.put(herd_job(gpus=(1, 4)))

    world.reconcile("a")

    assert world.launcher.stops == []
    assert world.granted("a") == 4


# ---- 4, 5: invalid specs ----


def test_invalid_view_keeps_acting_on_the_last_good_spec(world: World) -> None:
    started(world, herd_job())
    world.specs.put_invalid("a", "jobs/a.yaml: spec.gpus.min: field required")

    result = world.reconcile("a")

    assert result == Result(requeue_after=RESYNC_S)
    assert world.launcher.stops == []
    assert world.launcher.starts == [("a", 1, 4)]
    assert world.granted("a") == 4
    record = world.store.get_job("a")
    assert record is not None and record.generation == 1
    assert facts(world.condition("a", ConditionType.SpecValid)) == (
        "False",
        "InvalidSpec",
        "jobs/a.yaml: spec.gpus.min: field required (keeping the last good spec)",
    )
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")


def test_valid_view_again_sets_spec_valid_true(world: World) -> None:
    started(world, herd_job())
    world.specs.put_invalid("a", "jobs/a.yaml: not YAML")
    world.reconcile("a")
    world.specs.put(herd_job())

    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.SpecValid)) == ("True", "Valid", "")
    record = world.store.get_job("a")
    assert record is not None and record.generation == 1  # same content: same generation
    assert world.launcher.starts == [("a", 1, 4)]


def test_a_known_jobs_spec_turning_invalid_and_valid_again_is_an_event_each_time(
    world: World,
) -> None:
    """The condition alone once told it: `events` showed nothing of an invalid edit (nor of
    a file moved over the job's that is not read) of a job that had run."""
    started(world, herd_job())
    problem = "jobs/a.yaml: (file): not read: not a regular file (a FIFO)"
    world.specs.put_invalid("a", problem)
    world.reconcile("a")
    world.reconcile("a")  # the same problem: no second event
    world.specs.put_invalid("a", "jobs/a.yaml: spec.gpus.min: field required")
    world.reconcile("a")
    world.specs.put(herd_job())
    world.reconcile("a")
    world.reconcile("a")

    assert [event for event in world.events("a") if event[1] != "Started"] == [
        ("Warning", "InvalidSpec", f"{problem} (keeping the last good spec)"),
        (
            "Warning",
            "InvalidSpec",
            "jobs/a.yaml: spec.gpus.min: field required (keeping the last good spec)",
        ),
        ("Normal", "ValidSpec", "the spec is valid again"),
    ]
    assert world.launcher.starts == [("a", 1, 4)] and world.launcher.stops == []


def test_invalid_view_for_a_name_never_seen_records_nothing(world: World) -> None:
    world.specs.put_invalid("ghost", "jobs/ghost.yaml: spec: field required")

    result = world.reconcile("ghost")

    assert result == Result()
    assert world.store.get_job("ghost") is None
    assert world.store.list_jobs() == []
    assert world.events("ghost") == [
        ("Warning", "InvalidSpec", "jobs/ghost.yaml: spec: field required")
    ]
    assert world.launcher.starts == []
    assert world.allocator.grant("ghost") is None


def test_unknown_policy_in_a_first_spec_is_not_started(world: World) -> None:
    world.specs.put(herd_job(policy="nosuch"))

    result = world.reconcile("a")

    assert result == Result()
    assert world.launcher.starts == []
    assert world.store.get_job("a") is None
    ((kind, reason, message),) = world.events("a")
    assert (kind, reason) == ("Warning", "InvalidSpec")
    assert message.startswith("jobs/a.yaml: spec.policy.name: unknown policy 'nosuch'")


def test_unknown_policy_in_a_later_spec_keeps_the_last_good_one(world: World) -> None:
    started(world, herd_job())
    world.specs.put(herd_job(command=["python", "other.py"], policy="nosuch"))

    world.reconcile("a")

    assert world.launcher.stops == []
    spec_valid = world.condition("a", ConditionType.SpecValid)
    assert (spec_valid.status, spec_valid.reason) == ("False", "InvalidSpec")
    assert "spec.policy.name: unknown policy 'nosuch'" in spec_valid.message
    assert spec_valid.message.endswith("(keeping the last good spec)")


def test_a_module_reference_in_a_later_spec_is_refused_and_imports_nothing(
    world: World, plugins_installed: Path
) -> None:
    """A policy is a built-in or an installed plug-in's entry point: a spec naming a module
    (here one that runs unittest when imported) no longer makes the operator import it."""
    started(world, herd_job(policy="half"))
    assert world.granted("a") == 2
    world.specs.put(herd_job(command=["python", "other.py"], policy="unittest.__main__:Main"))

    world.reconcile("a")

    assert "unittest.__main__" not in sys.modules
    assert world.launcher.stops == []
    spec_valid = world.condition("a", ConditionType.SpecValid)
    assert (spec_valid.status, spec_valid.reason) == ("False", "InvalidSpec")
    assert (
        "spec.policy.name: 'unittest.__main__:Main' is a module:Class reference, which is not"
        " loaded" in spec_valid.message
    )
    assert "half" in spec_valid.message  # what is allowed
    assert spec_valid.message.endswith("(keeping the last good spec)")


# ---- 6: admission ----


def test_params_naming_more_gpus_than_max_are_a_warning_event_once_per_spec(
    world: World,
) -> None:
    """Issue 28.5: allowed (the job runs, at max), but said, as `validate` says it."""
    job = herd_job(gpus=(1, 4))
    greedy = job.model_copy(
        update={
            "spec": job.spec.model_copy(
                update={
                    "policy": PolicyRef.model_validate({"name": "static", "params": {"gpus": 8}})
                }
            )
        }
    )
    world.specs.put(greedy)
    world.reconcile("a")
    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4)]
    warnings = [event for event in world.raw_events("a") if event.reason == "PolicyParams"]
    assert [(e.type, e.message, e.count) for e in warnings] == [
        (
            "Warning",
            "spec.policy.params.gpus: 8 GPUs is more than spec.gpus.max (4): the job runs on 4"
            " at most",
            1,
        )
    ]


def test_job_whose_min_does_not_fit_is_pending(world: World) -> None:
    started(world, herd_job("a", gpus=(2, 2)))
    world.specs.put(herd_job("b", gpus=(3, 3)))

    result = world.reconcile("b")

    assert result == Result()  # the allocator's change callback wakes it
    assert world.launcher.starts == [("a", 1, 2)]
    reason = world.grant_reason("b")
    assert reason == "pending: needs 3 GPUs, 2 free"
    assert facts(world.condition("b", ConditionType.Admitted)) == ("False", "Pending", reason)
    assert world.status("b").gpus == GpuCounts(min=3, max=3, desired=3, allocated=0, active=None)
    assert world.events("b") == [("Normal", "Pending", reason)]
    world.reconcile("b")
    assert world.raw_events("b")[-1].count == 1  # still pending for the same reason: no event


def test_pending_job_starts_once_the_blocking_job_is_deleted(world: World) -> None:
    started(world, herd_job("a", gpus=(2, 2)))
    world.specs.put(herd_job("b", gpus=(3, 3)))
    world.reconcile("b")
    world.specs.delete("a")
    world.launcher.vanish("a")

    world.reconcile("a")
    world.reconcile("b")

    assert world.launcher.starts == [("a", 1, 2), ("b", 1, 3)]
    assert facts(world.condition("b", ConditionType.Admitted)) == (
        "True",
        "Admitted",
        world.grant_reason("b"),
    )


# ---- 7: success ----


def test_exit_zero_succeeds_and_releases_the_gpus(world: World) -> None:
    started(world, herd_job())
    world.clock.advance(60.0)
    world.launcher.exit("a", 0)

    result = world.reconcile("a")

    assert result == Result()
    now = T0 + 60.0
    assert facts(world.condition("a", ConditionType.Succeeded)) == (
        "True",
        "Completed",
        "horovodrun exited with status 0",
    )
    assert facts(world.condition("a", ConditionType.Running)) == ("False", "Completed", "")
    assert world.condition("a", ConditionType.Running).last_transition_time == now
    status = world.status("a")
    assert status.finished_at == now
    assert status.gpus is not None and status.gpus.allocated == 0
    assert world.allocator.grant("a") is None
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT  # forgotten
    assert world.events("a")[-1] == ("Normal", "Completed", "all workers finished")


def test_a_job_that_exits_after_its_last_report_shows_its_last_epoch(world: World) -> None:
    """Rank 0 reports its last epoch and the job exits before a reconcile ran it: the
    finished job's status (get's EPOCH, the demo's summary) still counts that epoch."""
    started(world, herd_job())
    world.store.add_report("a", 0, 4, 0, {}, T0 + 10.0)
    world.reconcile("a")
    assert world.status("a").epoch == 0
    world.store.add_report("a", 1, 4, 0, {}, T0 + 20.0)
    world.launcher.exit("a", 0)

    world.reconcile("a")

    assert is_true(world.status("a").conditions, ConditionType.Succeeded)
    assert world.status("a").epoch == 1


def test_succeeded_job_is_not_started_again(world: World) -> None:
    started(world, herd_job())
    world.launcher.exit("a", 0)
    world.reconcile("a")
    events = world.events("a")

    results = [world.reconcile("a") for _ in range(2)]

    assert results == [Result(), Result()]
    assert world.launcher.starts == [("a", 1, 4)]
    assert world.allocator.grant("a") is None
    assert world.events("a") == events


def test_spec_change_after_success_runs_the_job_again(world: World) -> None:
    started(world, herd_job())
    world.launcher.exit("a", 0)
    world.reconcile("a")
    world.specs.put(herd_job(priority=1))

    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4), ("a", 2, 4)]
    succeeded = world.condition("a", ConditionType.Succeeded)
    assert (succeeded.status, succeeded.reason, succeeded.observed_generation) == (
        "False",
        "SpecChanged",
        2,
    )
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")
    assert world.status("a").finished_at is None
    assert world.granted("a") == 4


def test_finished_job_shows_no_placement(world: World) -> None:
    started(world, herd_job())
    world.launcher.exit("a", 0)

    world.reconcile("a")

    assert world.allocator.grant("a") is None
    assert world.status("a").placement == []


def test_exit_racing_a_command_change_still_runs_the_new_command(world: World) -> None:
    started(world, herd_job())
    # The old command finishes and the user's edit lands before the next reconcile.
    world.launcher.exit("a", 0)
    world.specs.put(herd_job(command=["python", "train_v2.py"]))

    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4), ("a", 2, 4)]


# ---- 8: failure and restarts ----


def test_failure_with_restart_policy_backs_off_before_restarting(world: World) -> None:
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 2}))
    world.launcher.exit("a", 3)

    result = world.reconcile("a")

    assert result == Result(requeue_after=restart_delay(1))
    assert world.launcher.starts == [("a", 1, 4)]
    assert world.events("a")[-1] == (
        "Warning",
        "BackOff",
        "horovodrun exited with status 3; restart 1/2 in 1s",
    )
    status = world.status("a")
    assert (status.restarts, status.retry_at) == (1, T0 + 1.0)
    assert facts(world.condition("a", ConditionType.Running)) == (
        "False",
        "BackOff",
        "horovodrun exited with status 3",
    )
    assert world.granted("a") == 4  # held through the backoff

    world.clock.advance(0.5)
    assert world.reconcile("a") == Result(requeue_after=0.5)
    assert world.launcher.starts == [("a", 1, 4)]

    world.clock.advance(0.5)
    assert world.reconcile("a") == Result(requeue_after=RESYNC_S, keep_backoff=True)
    assert world.launcher.starts == [("a", 1, 4), ("a", 1, 4)]
    status = world.status("a")
    assert (status.restarts, status.retry_at) == (1, None)


@pytest.mark.parametrize("code", [0, 3])
def test_an_exit_whose_record_outlived_its_recorded_status_is_not_acted_on_twice(
    world: World, code: int
) -> None:
    """An operator killed after committing the status of an exit but before removing the
    launch record: its successor adopts the same exit again, which must neither count
    another restart nor say the job ended twice."""
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 2}))
    ended = replace(world.launcher.states["a"], phase=ProcessPhase.EXITED, exit_code=code)
    world.launcher.states["a"] = ended
    world.reconcile("a")
    recorded, events = world.status("a"), world.raw_events("a")

    world.launcher.states["a"] = ended  # adopted from the record by the next operator
    world.reconcile("a")

    assert world.status("a") == recorded
    assert world.raw_events("a") == events
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT, "its record is dropped"


def test_an_adopted_launch_whose_start_was_never_committed_is_recorded_once(
    world: World,
) -> None:
    """The operator was killed after the launch and before the store's commit; the launch
    ended while none ran, and the next operator adopted it from its record. Its start is
    recorded (one `Started`) before its exit, so the status names the launch and a record
    that outlives this commit is not acted on twice."""
    job = herd_job()
    world.specs.put(job)
    launch = LaunchInfo("a-adopted", 4321, T0 - 5, 1, "horovodrun", job.spec)
    ended = ProcessState(ProcessPhase.EXITED, exit_code=0, launch=launch)
    world.launcher.states["a"] = ended

    world.reconcile("a")

    status = world.status("a")
    assert (status.launch_id, status.started_at) == ("a-adopted", T0 - 5)
    assert is_true(status.conditions, ConditionType.Succeeded)
    assert [reason for _, reason, _ in world.events("a")] == ["Started", "Completed"]
    assert world.launcher.starts == []
    events = world.raw_events("a")
    world.launcher.states["a"] = ended  # its record outlived the commit: adopted again
    world.reconcile("a")
    assert world.raw_events("a") == events and world.status("a") == status


def test_failure_past_the_backoff_limit_fails_and_releases_the_gpus(world: World) -> None:
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 2}))
    for restarts in (1, 2):
        world.launcher.exit("a", 1)
        world.reconcile("a")
        world.clock.advance(restart_delay(restarts))
        world.reconcile("a")
    assert len(world.launcher.starts) == 3
    world.launcher.exit("a", 1)

    result = world.reconcile("a")

    assert result == Result()
    assert facts(world.condition("a", ConditionType.Failed)) == (
        "True",
        "BackoffLimitExceeded",
        "horovodrun exited with status 1",
    )
    assert facts(world.condition("a", ConditionType.Running)) == (
        "False",
        "Failed",
        "horovodrun exited with status 1",
    )
    assert world.status("a").restarts == 2
    assert world.allocator.grant("a") is None
    assert world.events("a")[-1] == ("Warning", "Failed", "horovodrun exited with status 1")
    world.clock.advance(600.0)
    world.reconcile("a")
    assert len(world.launcher.starts) == 3


def test_a_worker_out_of_gpu_memory_is_said_as_such_not_as_a_bare_exit(world: World) -> None:
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 1}))
    world.launcher.exit("a", 1)
    world.launcher.states["a"] = replace(world.launcher.states["a"], out_of_memory=("rank 1",))

    world.reconcile("a")

    said = "rank 1 of job a ran out of GPU memory (CUDA out of memory)"
    assert world.events("a")[-2:] == [
        ("Warning", "OutOfMemory", said),
        ("Warning", "BackOff", f"horovodrun exited with status 1: {said}; restart 1/1 in 1s"),
    ]
    assert facts(world.condition("a", ConditionType.Running)) == (
        "False",
        "BackOff",
        f"horovodrun exited with status 1: {said}",
    )


def test_a_failure_is_said_with_the_error_its_driver_printed(world: World) -> None:
    # The exit status alone (1) does not name the cause: the driver's last error line does,
    # in the BackOff and then in the Failed (exit_cause.driver_error reads it from the log).
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 1}))
    error = "the workers' first meeting failed: rank 0 (localhost[0]) failed, and ..."
    for _ in range(2):
        world.launcher.exit("a", 1)
        world.launcher.states["a"] = replace(world.launcher.states["a"], error=error)
        world.reconcile("a")
        world.clock.advance(restart_delay(1))
        world.reconcile("a")

    said = f"horovodrun exited with status 1: {error}"
    reasons = [(reason, message) for _, reason, message in world.events("a")]
    assert ("BackOff", f"{said}; restart 1/1 in 1s") in reasons
    assert reasons[-1] == ("Failed", said)
    assert facts(world.condition("a", ConditionType.Failed)) == (
        "True",
        "BackoffLimitExceeded",
        said,
    )


def test_failure_without_restart_policy_fails_directly(world: World) -> None:
    started(world, herd_job(restart={"onFailure": False}))
    world.launcher.exit("a", 2)

    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Failed)) == (
        "True",
        "Failed",
        "horovodrun exited with status 2",
    )
    assert [reason for _, reason, _ in world.events("a")] == ["Started", "Failed"]
    assert world.status("a").restarts == 0
    assert world.allocator.grant("a") is None
    assert world.launcher.starts == [("a", 1, 4)]


def test_spec_change_after_failure_runs_the_job_again_with_fresh_restarts(world: World) -> None:
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 0}))
    world.launcher.exit("a", 1)
    world.reconcile("a")
    world.specs.put(herd_job(command=["python", "fixed.py"], restart={"onFailure": True}))

    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 4), ("a", 2, 4)]
    assert facts(world.condition("a", ConditionType.Failed))[:2] == ("False", "SpecChanged")
    assert world.status("a").restarts == 0


@pytest.mark.parametrize(
    ("code", "restart", "ended"),
    [
        (1, {"onFailure": False}, "Failed"),
        (1, {"onFailure": True, "backoffLimit": 0}, "Failed"),
        (1, {"onFailure": True, "backoffLimit": 3}, "BackOff"),
        (0, None, "Completed"),
    ],
)
def test_a_job_whose_processes_exited_is_not_resizing(
    world: World, code: int, restart: dict[str, Any] | None, ended: str
) -> None:
    """`describe` showed `Resizing=True` on a Failed job: it kept the condition of its last
    reconcile while running (workers reporting fewer than granted)."""
    started(world, herd_job(restart=restart))
    world.clock.advance(1.0)
    world.store.add_report("a", 0, 3, 0, {}, world.clock())
    world.reconcile("a")
    assert facts(world.condition("a", ConditionType.Resizing))[:2] == ("True", "Resizing")
    world.launcher.exit("a", code)

    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Running))[1] == ended
    assert facts(world.condition("a", ConditionType.Resizing))[0] == "False"
    assert world.status("a").summary() != "Resizing"


def test_a_finished_job_recorded_as_resizing_is_shown_stable(world: World) -> None:
    """A status an older operator stored with `Resizing=True` on a Failed job is mended by
    the next reconcile of the finished job."""
    started(world, herd_job(restart={"onFailure": False}))
    world.launcher.exit("a", 1)
    world.reconcile("a")
    status = world.status("a")
    stale = tuple(
        c.model_copy(update={"status": ConditionStatus.TRUE, "reason": "Resizing"})
        if c.type == ConditionType.Resizing
        else c
        for c in status.conditions
    )
    world.store.put_status("a", status.model_copy(update={"conditions": stale}), world.clock())

    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Resizing))[0] == "False"
    assert world.status("a").summary() == "Failed"


@pytest.mark.parametrize(
    ("code", "finished"), [(0, ConditionType.Succeeded), (3, ConditionType.Failed)]
)
def test_finished_at_is_when_the_launch_ended_not_when_the_operator_saw_it(
    world: World, code: int, finished: ConditionType
) -> None:
    """A job that ended while no operator ran was recorded as finished at the restart: its
    keeper's exit record knows when it ended, and the launcher passes that on."""
    started(world, herd_job(restart={"onFailure": False}))
    ended = world.clock() + 60.0
    world.clock.advance(900.0)  # the operator was down; this reconcile is its successor's
    state = world.launcher.states["a"]
    world.launcher.states["a"] = replace(
        state, phase=ProcessPhase.EXITED, exit_code=code, ended_at=ended
    )

    world.reconcile("a")

    assert is_true(world.status("a").conditions, finished)
    assert world.status("a").finished_at == ended


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Real processes for a job's workers (the allocator checks their pids); stopped after."""
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for process in made:
        process.kill()
        process.wait()


def bound_workers(
    world: World, made: list[subprocess.Popen[bytes]], job: str, count: int
) -> list[subprocess.Popen[bytes]]:
    """`count` workers of `job`, each bound to its GPU as the shim binds one."""
    # Each carries its job's name, as every process the operator starts for a job does.
    env = {**os.environ, "HERD_JOB": job}
    new = [subprocess.Popen(["sleep", "600"], env=env) for _ in range(count)]
    made.extend(new)
    for process in new:
        # Popen returns once exec has begun, a moment before the kernel shows the new
        # environment in /proc (a shim binds from inside a process that runs long since).
        deadline = time.monotonic() + 10.0
        while not is_process_of_job(job, process.pid):
            assert time.monotonic() < deadline, "the worker's environment never showed"
            time.sleep(0.01)
    for rank, process in enumerate(new):
        AllocatorOps(world.allocator).bind(
            {"job": job, "host": "localhost", "local_rank": rank, "pid": process.pid}
        )
    return new


def end(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait()  # reaped: its pid is gone


def worker_lost_events(world: World, name: str) -> list[str]:
    return [message for _, reason, message in world.events(name) if reason == "WorkerLost"]


def test_a_worker_lost_by_a_job_that_does_not_report_is_shown_after_a_grace(
    world: World, workers: list[subprocess.Popen[bytes]]
) -> None:
    """Its script never reports: ACTIVE showed `-` and nothing said a worker was gone until
    the 600 s report deadline. Its workers' bindings show it: a live bound worker is
    active, and one gone for WORKER_LOST_GRACE_S while the job's driver runs is lost."""
    started(world, herd_job(gpus=(4, 4)))
    procs = bound_workers(world, workers, "a", 4)
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and (gpus.allocated, gpus.active) == (4, 4)

    end(procs[2])
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and (gpus.allocated, gpus.active) == (4, 3)
    assert worker_lost_events(world, "a") == []  # maybe the job is ending: not yet
    assert world.status("a").summary() == "Running"  # not Resizing: no report said so
    world.clock.advance(WORKER_LOST_GRACE_S - 1.0)
    world.reconcile("a")
    assert worker_lost_events(world, "a") == []

    world.clock.advance(1.0)
    world.reconcile("a")
    (lost,) = worker_lost_events(world, "a")
    assert lost == (
        "1 worker gone for 30s while horovodrun pid 4001 runs: 3 of the 4 granted GPUs"
        " have a live worker (none on localhost:2)"
    )
    for _ in range(3):  # said once
        world.clock.advance(RESYNC_S)
        world.reconcile("a")
    assert len(worker_lost_events(world, "a")) == 1
    for process in procs:  # every worker gone while the driver runs: ACTIVE 0, not `-`
        end(process)
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    world.clock.advance(WORKER_LOST_GRACE_S)
    world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and gpus.active == 0
    assert worker_lost_events(world, "a")[-1].startswith("3 workers gone for 30s")
    assert ("Warning", "WorkerLost") in [event[:2] for event in world.events("a")]


def test_workers_that_end_one_by_one_as_their_job_succeeds_are_not_called_lost(
    world: World, workers: list[subprocess.Popen[bytes]]
) -> None:
    """Horovod's workers exit one by one when a job succeeds (rank 0 may save a checkpoint
    after the others left): a gone worker while the driver runs is lost only after a
    grace, which the driver's own exit ends."""
    started(world, herd_job(gpus=(4, 4)))
    procs = bound_workers(world, workers, "a", 4)
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    for process in reversed(procs[1:]):
        end(process)
        world.clock.advance(RESYNC_S)
        world.reconcile("a")
    world.clock.advance(WORKER_LOST_GRACE_S - 3 * RESYNC_S - 1.0)
    world.reconcile("a")
    end(procs[0])
    world.launcher.exit("a", 0)

    world.reconcile("a")

    assert world.status("a").summary() == "Succeeded"
    assert worker_lost_events(world, "a") == []


def test_a_relaunch_watches_only_its_own_workers(
    world: World, workers: list[subprocess.Popen[bytes]]
) -> None:
    """The bindings of a launch's workers outlive it (dead pids, the same slots): the next
    launch's watch starts over and counts only workers that started since it did."""
    started(world, herd_job(gpus=(2, 2), restart={"onFailure": True, "backoffLimit": 3}))
    for process in bound_workers(world, workers, "a", 2):
        end(process)
    world.launcher.exit("a", 1)
    world.reconcile("a")
    world.clock.advance(restart_delay(1))
    world.reconcile("a")  # launched again: no worker of it has bound yet
    assert len(world.launcher.starts) == 2
    for _ in range(int(WORKER_LOST_GRACE_S / RESYNC_S) + 2):
        world.clock.advance(RESYNC_S)
        world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and gpus.active is None  # none of its workers has bound yet
    assert worker_lost_events(world, "a") == []
    procs = bound_workers(world, workers, "a", 2)  # they bind, on the same GPUs
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and gpus.active == 2
    end(procs[1])
    world.clock.advance(RESYNC_S)
    world.reconcile("a")
    gpus = world.status("a").gpus
    assert gpus is not None and gpus.active == 1


Look = tuple[float, int, int]
"""(seconds since the last look, workers found running, GPUs granted)"""
looks = st.lists(
    st.tuples(st.sampled_from([0.0, 1.0, 5.0, 29.0, 30.0, 31.0]), st.integers(0, 6)).flatmap(
        lambda look: st.tuples(st.just(look[0]), st.just(look[1]), st.integers(look[1], 6))
    ),
    max_size=25,
)


def watched(sequence: Sequence[Look]) -> list[tuple[float, int, float]]:
    """(time, workers called lost, for how long gone) at each look of `sequence`."""
    watch, now, calls = None, T0, []
    for elapsed, alive, granted in sequence:
        now += elapsed
        watch, lost, gone_for = watch_workers(watch, alive, granted, now, WORKER_LOST_GRACE_S)
        calls.append((now, lost, gone_for))
    return calls


@given(looks)
def test_a_loss_is_called_only_after_a_grace_and_never_more_than_dropped(
    sequence: list[Look],
) -> None:
    calls = watched(sequence)
    # Called only once fewer than seen have run for the grace, and no worker twice: never
    # more in all than the falls in the number running (a shrink of the grant is no fall).
    falls, previous = 0, 0
    for _, alive, granted in sequence:
        falls += max(0, min(previous, granted) - alive)
        previous = alive
    assert sum(lost for _, lost, _ in calls) <= falls
    times = [now for now, _, _ in calls]
    for index, (now, lost, gone_for) in enumerate(calls):
        if not lost:
            continue
        assert gone_for >= WORKER_LOST_GRACE_S
        # Fewer ran at every look since the shortage began than at some look before it.
        began = max(look for look, time in enumerate(times) if time == now - gone_for)
        peak = max((alive for _, alive, _ in sequence[:began]), default=0)
        assert all(alive < peak for _, alive, _ in sequence[began : index + 1])


@given(looks)
def test_workers_that_only_start_or_come_back_are_never_lost(sequence: list[Look]) -> None:
    """Starting (none seen yet), growing, or a grant that shrinks with its workers."""
    rising = sorted(alive for _, alive, _ in sequence)
    steady = [
        (elapsed, alive, alive) for (elapsed, _, _), alive in zip(sequence, rising, strict=True)
    ]
    assert all(lost == 0 for _, lost, _ in watched(steady))
    shrinking = [
        (elapsed, alive, alive)
        for (elapsed, _, _), alive in zip(sequence, rising[::-1], strict=True)
    ]
    assert all(lost == 0 for _, lost, _ in watched(shrinking))


@given(st.integers(1, 6), st.integers(0, 5), st.sampled_from([1.0, 5.0, 10.0]))
def test_a_lasting_shortage_is_called_once_when_the_grace_is_over(
    seen: int, left: int, every: float
) -> None:
    left = min(left, seen - 1)
    sequence = [(0.0, seen, seen)] + [(every, left, seen)] * int(3 * WORKER_LOST_GRACE_S / every)
    calls = watched(sequence)
    ((when, lost, gone_for),) = [call for call in calls if call[1]]
    assert lost == seen - left
    first_short = T0 + every
    assert (
        gone_for == when - first_short
        and WORKER_LOST_GRACE_S <= gone_for < WORKER_LOST_GRACE_S + every
    )


def test_restart_delay_doubles_up_to_the_cap() -> None:
    assert [restart_delay(n) for n in range(0, 9)] == [1, 1, 2, 4, 8, 16, 32, 60, 60]


def test_launch_error_is_a_condition_and_an_event_retried_with_backoff(world: World) -> None:
    world.specs.put(herd_job())
    world.launcher.start_error = OSError("horovodrun: not found")

    with pytest.raises(LaunchError, match="cannot launch a: horovodrun: not found"):
        world.reconcile("a")  # the queue retries it (tests/unit/test_control_loop.py)

    assert world.launcher.starts == []
    # Shown where people look, not only in the operator's log, within this one reconcile.
    running = world.condition("a", ConditionType.Running)
    assert facts(running) == (
        "False",
        "LaunchFailed",
        "cannot launch a: horovodrun: not found (attempt 1; next in 1s)",
    )
    assert world.status("a").summary() == "LaunchFailed"
    assert facts(world.condition("a", ConditionType.Admitted))[:2] == ("True", "Admitted")
    assert world.events("a") == [
        ("Warning", "LaunchFailed", "cannot launch a: horovodrun: not found")
    ]

    # The n-th failure in a row (the queue's count, handed to the reconcile) says when the
    # next try comes: the queue's backoff for launch failures, 1, 2, 4 ... 60 s.
    said = []
    for failures in range(1, 9):
        world.clock.advance(1.0)
        with pytest.raises(LaunchError):
            world.reconciler.reconcile("a", failures)
        said.append(world.condition("a", ConditionType.Running).message.rsplit("; ", 1)[1])
    assert said == [f"next in {delay}s)" for delay in (2, 4, 8, 16, 32, 60, 60, 60)]
    (event,) = world.raw_events("a")  # one event, counted: no row per attempt
    assert (event.reason, event.count) == ("LaunchFailed", 9)
    assert len(world.store.grant_history("a")) == 1  # one decision, not one per attempt

    world.launcher.start_error = None  # fixed without touching the spec: the retry starts it
    world.clock.advance(60.0)
    assert world.reconciler.reconcile("a", 9).keep_backoff  # not known to run yet
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")


def test_a_command_the_keeper_cannot_execute_is_a_launch_failure_not_an_exit(
    world: World,
) -> None:
    """The keeper started, but the command in it could not be executed: the job did not
    fail (it never ran), so it is not marked Failed; it is tried again with backoff."""
    started(world, herd_job())
    state = world.launcher.states["a"]
    world.launcher.states["a"] = replace(
        state,
        phase=ProcessPhase.EXITED,
        exit_code=127,
        launch_error="cannot run 'horovodrun': No such file or directory",
    )

    with pytest.raises(LaunchError):
        world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Running))[:2] == ("False", "LaunchFailed")
    assert get_condition(world.status("a").conditions, ConditionType.Failed) is None
    assert (
        "Warning",
        "LaunchFailed",
        "cannot launch a: cannot run 'horovodrun': No such file or directory",
    ) in world.events("a")
    world.clock.advance(1.0)
    world.reconciler.reconcile("a", 1)
    assert world.launcher.starts == [("a", 1, 4), ("a", 1, 4)]


def test_an_exit_that_could_not_execute_the_command_is_recorded_once(world: World) -> None:
    """The status recording a launch error outlived the launch's record (the operator was
    killed between the commit and the record's removal): it is not a second failure."""
    started(world, herd_job())
    state = replace(
        world.launcher.states["a"],
        phase=ProcessPhase.EXITED,
        exit_code=127,
        launch_error="cannot run 'horovodrun': Permission denied",
    )
    world.launcher.states["a"] = state
    with pytest.raises(LaunchError):
        world.reconcile("a")
    world.launcher.states["a"] = state  # the record is still there

    world.reconcile("a")  # launches again, and says nothing of the old exit

    (event,) = [e for e in world.raw_events("a") if e.reason == "LaunchFailed"]
    assert event.count == 1
    assert world.launcher.starts == [("a", 1, 4), ("a", 1, 4)]


def test_workers_that_never_report_get_a_condition_and_one_event(world: World) -> None:
    started(world, herd_job(restart={"onFailure": True, "backoffLimit": 3}))
    world.clock.advance(REPORT_DEADLINE_S - 1)
    world.reconcile("a")
    assert get_condition(world.status("a").conditions, ConditionType.Reporting) is None

    world.clock.advance(2)
    world.reconcile("a")
    world.clock.advance(RESYNC_S)
    world.reconcile("a")  # still silent: no second event

    reporting = world.condition("a", ConditionType.Reporting)
    assert (reporting.status, reporting.reason) == ("False", "ReportDeadlineExceeded")
    assert "no worker has reported in 120s since the launch" in reporting.message
    assert "herd-operator logs a" in reporting.message
    assert [e[1] for e in world.events("a")].count("ReportDeadlineExceeded") == 1
    assert world.status("a").summary() == "Running"  # it runs; the condition says the rest

    world.store.add_report("a", 0, 4, 0, {}, world.clock())
    world.reconcile("a")
    assert facts(world.condition("a", ConditionType.Reporting))[:2] == ("True", "Reported")

    world.launcher.exit("a", 1)  # a new launch has not reported yet: nothing said of it
    world.reconcile("a")
    world.clock.advance(10)
    world.reconcile("a")
    assert world.launcher.starts == [("a", 1, 4), ("a", 1, 4)]
    assert get_condition(world.status("a").conditions, ConditionType.Reporting) is None


def test_status_is_not_running_while_the_spec_is_invalid(world: World) -> None:
    started(world, herd_job())
    world.specs.put_invalid("a", "jobs/a.yaml: spec.gpus.min: must be at least 1")
    world.reconcile("a")
    assert is_true(world.status("a").conditions, ConditionType.Running)  # on its last good spec
    assert world.status("a").summary() == "InvalidSpec"


# ---- 9: deletion ----


def test_deletion_while_running_stops_the_job_and_keeps_its_gpus(world: World) -> None:
    started(world, herd_job("a", gpus=(4, 4)))
    world.specs.delete("a")

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)
    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)

    assert world.launcher.stops == ["a"]
    assert world.events("a")[-1] == ("Normal", "Stopping", "spec deleted: stopping the job")
    assert world.store.get_job("a") is not None
    assert world.granted("a") == 4
    world.specs.put(herd_job("b", gpus=(1, 1)))
    world.reconcile("b")
    assert world.granted("b") == 0
    assert world.launcher.starts == [("a", 1, 4)]


def corrupt_stored_spec(world: World, name: str) -> None:
    """What a damaged row looks like: the spec text no longer parses (written by sqlite3)."""
    raw = sqlite3.connect(world.store.path)
    raw.execute("UPDATE jobs SET spec_json = 'garbage{' WHERE name = ?", (name,))
    raw.commit()
    raw.close()


def test_deleting_a_job_whose_stored_spec_is_unreadable_still_stops_it(world: World) -> None:
    started(world, herd_job("a", gpus=(4, 4)))
    corrupt_stored_spec(world, "a")
    world.specs.delete("a")

    assert world.reconcile("a") == Result(requeue_after=STOP_POLL_S)

    assert world.launcher.stops == ["a"]
    assert world.granted("a") == 4  # held until its processes are gone
    world.launcher.exit("a", -15)
    assert world.reconcile("a") == Result()
    assert world.store.get_job("a") is None


def test_an_unreadable_stored_spec_is_recorded_again_from_the_file(world: World) -> None:
    job = herd_job("a", gpus=(2, 2))
    started(world, job)
    before = world.store.get_job("a")
    assert before is not None
    corrupt_stored_spec(world, "a")
    with pytest.raises(UnreadableSpecError):
        world.store.get_job("a").spec  # type: ignore[union-attr]  # noqa: B018

    world.reconcile("a")

    after = world.store.get_job("a")
    assert after is not None and after.spec == job
    assert (after.generation, after.fingerprint) == (before.generation, before.fingerprint)
    assert world.launcher.starts == [("a", 1, 2)]  # the same spec: the job runs on


def test_stopping_elastic_job_keeps_all_its_gpus(world: World) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    world.specs.delete("a")
    world.reconcile("a")
    world.specs.put(herd_job("b", gpus=(1, 1)))

    world.reconcile("b")

    assert (world.granted("a"), world.granted("b")) == (4, 0)


def test_deleted_job_is_removed_once_its_processes_exit(world: World) -> None:
    started(world, herd_job("a"))
    world.specs.delete("a")
    world.reconcile("a")
    world.specs.put(herd_job("b", gpus=(1, 1)))
    world.reconcile("b")
    world.launcher.exit("a", -15)

    result = world.reconcile("a")

    assert result == Result()
    assert world.store.get_job("a") is None
    assert world.allocator.grant("a") is None
    assert world.launcher.state("a").phase == ProcessPhase.ABSENT
    assert world.events("a")[-1] == (
        "Normal",
        "Deleted",
        "spec deleted: job removed, GPUs freed",
    )
    world.reconcile("b")
    assert world.launcher.starts == [("a", 1, 4), ("b", 1, 1)]
    world.reconcile("a")
    assert [reason for _, reason, _ in world.events("a")].count("Deleted") == 1


# ---- 10: resizing ----


def test_resizing_while_the_reported_world_size_differs_from_the_grant(world: World) -> None:
    started(world, herd_job(gpus=(1, 2)))
    world.clock.advance(1.0)
    world.store.add_report("a", 0, 2, 0, {}, world.clock())
    world.specs.put(herd_job(gpus=(1, 1)))

    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Resizing)) == (
        "True",
        "Resizing",
        "2 -> 1 workers",
    )
    assert facts(world.condition("a", ConditionType.Running)) == (
        "True",
        "Training",
        "world size 2",
    )
    status = world.status("a")
    assert status.gpus is not None and (status.gpus.allocated, status.gpus.active) == (1, 2)
    assert status.epoch == 0

    world.clock.advance(1.0)
    world.store.add_report("a", None, 1, 0, {}, world.clock())
    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.Resizing)) == ("False", "Stable", "")
    status = world.status("a")
    assert status.gpus is not None and (status.gpus.allocated, status.gpus.active) == (1, 1)
    assert status.epoch == 0  # a world-size report carries no epoch


@pytest.mark.parametrize(
    ("engine", "told", "mode"),
    [
        ("horovod", "2 -> 1 workers in 2.5 s (no worker restarted)", ResizeMode.LIVE),
        ("torchrun", "2 -> 1 workers in 2.5 s (every worker restarted)", ResizeMode.RESTART),
        ("gone", "2 -> 1 workers in 2.5 s", None),
    ],
)
def test_a_finished_resize_says_what_it_cost_in_an_event_and_the_status(
    world: World, engine: str, told: str, mode: ResizeMode | None
) -> None:
    """A resize's cost (from the grant change to the new world size reported) and what it
    did to the workers, as the engine the launch runs on says (the launcher port): in the
    event, in the status (`describe`'s Last resize) and to the observer (the metrics).
    Before, the event guessed the restart from a list of engine names in the controllers,
    and nothing but the events (the newest 20 in `describe`) kept it."""
    observer = RecordingObserver()
    world.reconciler.observer = observer

    def on_engine(job: HerdJob) -> HerdJob:
        engine_spec = job.spec.engine.model_copy(update={"kind": engine})
        return job.model_copy(update={"spec": job.spec.model_copy(update={"engine": engine_spec})})

    started(world, on_engine(herd_job(gpus=(1, 2))))
    world.clock.advance(1.0)
    world.store.add_report("a", 0, 2, 0, {}, world.clock())
    world.specs.put(on_engine(herd_job(gpus=(1, 1))))
    world.reconcile("a")  # the grant change: Resizing from here
    world.clock.advance(2.5)
    world.reconcile("a")  # the workers have not said their new size yet
    assert [r for _, r, _ in world.events("a")].count("ResizeCompleted") == 0
    assert world.status("a").last_resize is None

    world.store.add_report("a", None, 1, 0, {}, world.clock())
    world.reconcile("a")

    completed = [(kind, msg) for kind, r, msg in world.events("a") if r == "ResizeCompleted"]
    assert completed == [("Normal", told)]
    cost = world.status("a").last_resize
    assert cost is not None and cost.seconds == pytest.approx(2.5)
    assert cost == ResizeCost(
        before=2, after=1, seconds=cost.seconds, engine=engine, mode=mode,
        completed_at=world.clock(),
    )  # fmt: skip
    assert observer.completed == [("a", cost)]
    world.clock.advance(1.0)
    world.reconcile("a")
    assert [r for _, r, _ in world.events("a")].count("ResizeCompleted") == 1, "said once"
    assert world.status("a").last_resize == cost, "kept until the next resize finishes"


@dataclass
class RecordingObserver:
    completed: list[tuple[str, ResizeCost]] = field(default_factory=list)

    def resized(self, job: str, before: int, after: int) -> None:
        pass

    def resize_completed(self, job: str, cost: ResizeCost) -> None:
        self.completed.append((job, cost))


def test_a_resize_cost_without_the_old_size_in_the_reports_says_the_new_one() -> None:
    reports = [Report(epoch=None, time=1.0, world_size=3)]
    cost = resize_cost(reports, 7.06, "torchrun", ResizeMode.RESTART, 9.0)
    assert (cost.before, cost.after, cost.direction) == (None, 3, "unknown")
    assert cost.message() == "to 3 workers in 7.1 s (every worker restarted)"


def test_a_resize_cost_takes_the_last_other_size_reported_as_the_one_before() -> None:
    sizes = [1, 1, 3, 2, 2]  # 1 -> 3, then 3 -> 2: the last resize is from 3
    reports = [Report(epoch=i, time=float(i), world_size=size) for i, size in enumerate(sizes)]
    cost = resize_cost(reports, 0.31, "horovod", ResizeMode.LIVE, 9.0)
    assert (cost.before, cost.after, cost.direction, cost.completed_at) == (3, 2, "shrink", 9.0)
    assert cost.message() == "3 -> 2 workers in 0.3 s (no worker restarted)"


def test_reports_from_before_the_launch_are_ignored(world: World) -> None:
    started(world, herd_job(gpus=(1, 2)))
    world.clock.advance(1.0)
    world.store.add_report("a", 7, 2, 0, {}, world.clock())
    world.specs.put(herd_job(gpus=(1, 2), command=["python", "train_v2.py"]))
    world.reconcile("a")
    world.launcher.exit("a", -15)
    world.clock.advance(1.0)
    world.reconcile("a")  # the relaunch: the report above belongs to the first launch

    world.reconcile("a")

    assert world.launcher.starts == [("a", 1, 2), ("a", 2, 2)]
    assert facts(world.condition("a", ConditionType.Running)) == (
        "True",
        "Started",
        "waiting for the workers' first report",
    )
    assert facts(world.condition("a", ConditionType.Resizing)) == ("False", "Stable", "")
    status = world.status("a")
    assert status.gpus is not None and status.gpus.active is None
    assert status.epoch is None


# ---- 11: grants changed by other jobs ----


def test_grant_shrunk_to_admit_another_job_is_a_resized_event(world: World) -> None:
    started(world, herd_job("a", gpus=(1, 4)))
    first_reason = world.grant_reason("a")
    world.clock.advance(10.0)
    started(world, herd_job("b", gpus=(2, 2)))
    world.clock.advance(1.0)

    world.reconcile("a")

    reason = world.grant_reason("a")
    assert reason == "shrunk 4 -> 2: admitting b (min 2)"
    assert world.events("a")[-1] == ("Normal", "Resized", f"4 -> 2 GPUs: {reason}")
    assert world.store.grant_history("a") == [
        GrantChange("a", T0, 4, first_reason),
        GrantChange("a", T0 + 11.0, 2, reason),
    ]
    status = world.status("a")
    assert status.placement == [("localhost", [0, 1])]
    assert status.grant_reason == reason
    assert status.last_resize_at == T0 + 11.0
    assert world.launcher.stops == []
    assert world.launcher.starts == [("a", 1, 4), ("b", 1, 2)]


# ---- what the policy is shown ----


def test_the_policy_is_shown_the_epochs_it_observes_as_the_store_returned_them(
    world: World, plugins_installed: Path
) -> None:
    RecordingPolicy.seen.clear()
    started(world, herd_job(policy="recording"))
    world.clock.advance(1.0)
    world.store.add_report("a", 0, 4, 1, {"loss": 0.5}, world.clock())
    world.store.add_report("a", None, 3, 0, {}, world.clock() + 0.5)
    metrics = {"step_seconds": 0.2}
    world.store.add_report("a", None, 3, 0, metrics, world.clock() + 0.7, measurement=True)
    world.store.add_usage("a", 4, 100, 1000, world.clock())
    world.clock.advance(1.0)

    world.reconcile("a")

    observed = RecordingPolicy.seen[-1]
    assert (observed.started_at, observed.allocated, observed.world_size) == (T0, 4, 3)
    # The store's own values, rank and metrics included: nothing is copied field by field.
    assert list(observed.epochs) == [Report(0, T0 + 1.0, 4, {"loss": 0.5}, rank=1)]
    assert list(observed.measurements) == [Report(None, T0 + 1.7, 3, metrics, measurement=True)]
    assert list(observed.usage) == []  # not observed: not even read
    assert get_condition(world.status("a").conditions, ConditionType.MetricsStale) is None


def test_a_policy_that_observes_usage_gets_samples_and_a_metrics_stale_condition(
    world: World,
) -> None:
    started(world, herd_job(policy="memory"))
    world.clock.advance(1.0)
    world.store.add_usage("a", 4, 100, 1000, world.clock())
    world.reconcile("a")
    assert facts(world.condition("a", ConditionType.MetricsStale)) == ("False", "Fresh", "")

    world.clock.advance(60.0)
    world.reconcile("a")

    assert facts(world.condition("a", ConditionType.MetricsStale)) == (
        "True",
        "NoRecentSamples",
        "no GPU memory sample for 60s; the policy holds the job's size",
    )


def test_an_older_plugin_that_declares_nothing_is_shown_what_it_was_shown_before(
    world: World, plugins_installed: Path
) -> None:
    LegacyPolicy.seen.clear()
    started(world, herd_job(policy="legacy"))
    world.specs.put(herd_job("b", policy="legacy-usage"))
    world.reconcile("b")
    world.clock.advance(1.0)
    for name in ("a", "b"):
        world.store.add_report(name, 0, 4, 0, {}, world.clock())
        world.store.add_usage(name, 4, 100, 1000, world.clock())
    world.clock.advance(1.0)
    LegacyPolicy.seen.clear()

    world.reconcile("a")
    world.reconcile("b")

    plain, with_usage = LegacyPolicy.seen
    assert (len(plain.epochs), len(plain.usage)) == (1, 0)
    assert (len(with_usage.epochs), len(with_usage.usage)) == (1, 1)
    assert get_condition(world.status("a").conditions, ConditionType.MetricsStale) is None
    assert world.condition("b", ConditionType.MetricsStale).reason == "Fresh"


def test_an_unchanged_status_is_not_written_again(world: World) -> None:
    started(world, herd_job())
    world.clock.advance(RESYNC_S)
    world.reconcile("a")  # settles (Resizing and the like are set once)
    record = world.store.get_job("a")
    assert record is not None

    world.clock.advance(RESYNC_S)
    world.reconcile("a")

    again = world.store.get_job("a")
    assert again is not None
    assert again.updated_at == record.updated_at  # nothing was written
    assert again.status is record.status  # and nothing was parsed again


def test_a_policy_that_vanished_is_raised_before_an_exit_is_consumed(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The exit stays to be seen once the policy is back (it was once forgotten unrecorded)."""
    from herd_operator.controllers.errors import PermanentError
    from herd_operator.policies.base import PolicyError

    started(world, herd_job("a", restart={"onFailure": True, "backoffLimit": 3}))
    world.launcher.exit("a", 3)

    def vanished(ref: object) -> object:
        raise PolicyError("spec.policy.name", "gone")

    monkeypatch.setattr("herd_operator.controllers.reconciler.load_policy", vanished)
    with pytest.raises(PermanentError):
        world.reconcile("a")
    assert world.launcher.state("a").phase == ProcessPhase.EXITED  # not forgotten
    assert world.status("a").restarts == 0
    monkeypatch.undo()
    world.reconcile("a")
    assert world.status("a").restarts == 1
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("False", "BackOff")


# ---- the grant history logs every end: `report` integrates it ----


def grants(world: World, name: str) -> list[tuple[float, int, str]]:
    return [(change.time, change.gpus, change.reason) for change in world.store.grant_history(name)]


@pytest.mark.parametrize(
    ("code", "restart", "reason"),
    [(0, None, "job succeeded"), (1, {"onFailure": False}, "job failed")],
)
def test_a_finished_job_logs_its_drop_to_0_gpus_once(
    world: World, code: int, restart: dict[str, Any] | None, reason: str
) -> None:
    started(world, herd_job(restart=restart))
    world.clock.advance(20.0)
    world.launcher.exit("a", code)

    world.reconcile("a")
    world.clock.advance(RESYNC_S)
    world.reconcile("a")  # a resync of the finished job logs nothing more

    (admitted_at, admitted, _), *rest = grants(world, "a")
    assert (admitted_at, admitted) == (T0, 4)
    assert rest == [(T0 + 20.0, 0, reason)]


def test_a_deleted_job_logs_its_drop_to_0_gpus_when_its_processes_are_gone(world: World) -> None:
    started(world, herd_job())
    world.specs.delete("a")
    world.clock.advance(3.0)
    world.reconcile("a")  # stopping: it still holds its GPUs
    assert [gpus for _, gpus, _ in grants(world, "a")] == [4]
    world.clock.advance(2.0)
    world.launcher.exit("a", -15)

    world.reconcile("a")

    assert grants(world, "a")[1:] == [(T0 + 5.0, 0, "spec deleted")]  # the log outlives the job


def test_the_shutdown_logs_the_drop_to_0_gpus_of_running_and_waiting_jobs(world: World) -> None:
    started(world, herd_job("a", gpus=(2, 2)))
    started(world, herd_job("b", gpus=(2, 2), restart={"onFailure": True, "backoffLimit": 3}))
    world.launcher.exit("b", 1)
    world.reconcile("b")  # BackOff: not running, and still holding its 2 GPUs
    world.specs.put(herd_job("c", gpus=(4, 4)))
    world.reconcile("c")  # pending: holds nothing
    world.clock.advance(30.0)

    for name in ("a", "b", "c"):
        world.reconciler.record_shutdown(name)

    assert grants(world, "a")[-1] == (T0 + 30.0, 0, "operator shut down")
    assert grants(world, "b")[-1] == (T0 + 30.0, 0, "operator shut down")
    assert grants(world, "c") == []
    for name in ("a", "b"):
        status = world.status(name)
        assert status.gpus is not None and status.gpus.allocated == 0
    assert [reason for _, reason, _ in world.events("b")].count("Stopped") == 0


@pytest.mark.parametrize(("spare_by_gain", "granted"), [(False, 3), (True, 4)])
def test_the_gains_a_policy_reports_reach_the_allocator(
    world: World, spare_by_gain: bool, granted: int
) -> None:
    # goodput at minGain 0.8 and its prior serial share 0.05 stops at 3 of 4 GPUs (the 4th
    # adds 0.75 of a GPU); it reports that gain, which an allocator lending spare GPUs by gain
    # acts on and a plain one ignores.
    world.allocator.spare_by_gain = spare_by_gain
    spec = {
        "command": COMMAND,
        "gpus": {"min": 1, "max": 4},
        "policy": {"name": "goodput", "params": {"minGain": 0.8}},
    }
    started(
        world,
        HerdJob.model_validate(
            {
                "apiVersion": "herd/v1alpha1",
                "kind": "HerdJob",
                "metadata": {"name": "a"},
                "spec": spec,
            }
        ),
    )
    assert world.granted("a") == granted


def test_the_batch_a_policy_picks_is_recorded_for_the_workers(world: World) -> None:
    # goodput, once the workers report the adaptive metrics, picks a batch for the GPUs
    # granted; the status keeps it with that count, and the `batch` RPC answers it.
    spec = {
        "command": COMMAND,
        "gpus": {"min": 2, "max": 2},
        "policy": {"name": "goodput"},
        "training": {"batchPolicy": "adaptive", "maxBatch": 4096},
    }
    job = HerdJob.model_validate(
        {"apiVersion": "herd/v1alpha1", "kind": "HerdJob", "metadata": {"name": "a"}, "spec": spec}
    )
    started(world, job)
    assert world.status("a").batch is None  # nothing measured: no choice
    metrics = {"gradient_noise_scale": 5000.0, "batch_size": 32.0, "step_seconds": 0.5}
    world.store.add_report("a", 0, 2, 0, metrics, world.clock())
    world.clock.advance(1.0)
    world.reconcile("a")
    choice = world.status("a").batch
    assert choice is not None and choice.gpus == 2 and choice.size > 32
    answer = BatchHandler(world.store)({"job": "a"})
    assert answer == {"gpus": 2, "batch_size": choice.size}
    with pytest.raises(NotFound):
        BatchHandler(world.store)({"job": "nobody"})
