"""Tests for controllers.loop: results and errors to queue actions, bursts, wake-ups, shutdown.

Four tests here guard against mutations that once survived every unit test, when this
code lived in the operator's wiring file:
- `test_a_permanent_error_is_not_retried_and_shows_as_stalled`: a permanent error retried
  like a temporary one.
- `test_a_grant_change_wakes_the_other_jobs_it_touched`: other jobs not requeued when a
  decision changed their grant (they would keep running at the old size until a resync).
- `test_shutdown_writes_every_running_jobs_status`: the shutdown not written to the jobs'
  status (they would say Running after the operator stopped them).
- `test_a_report_of_the_smaller_world_frees_a_draining_gpu_at_once`: a worker's report not
  passed to the allocator (a shrink's GPUs would drain for the full timeout).
"""

from __future__ import annotations

import errno
import itertools
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from herd_operator.controllers.errors import (
    STALL_AFTER_FAILURES,
    PermanentError,
    TemporaryError,
)
from herd_operator.controllers.loop import ControlLoop, Outcome
from herd_operator.controllers.ports import ProcessPhase, Result
from herd_operator.controllers.workqueue import WorkQueue
from herd_operator.layout import StateLayout
from herd_operator.policies.base import PolicyError
from herd_operator.rpc.protocol import BadRequest, NotFound
from herd_operator.runtime import store as store_module
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import ReportHandler
from herd_operator.runtime.metrics import OperatorMetrics
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs import ConditionType, get_condition
from herd_operator.specs.values import Allocation, Demand, Grant, Pool
from tests.unit.full_disk import (
    cap_at_present_size,
    fail_commits,
    fill_up,
    make_room,
    refuse_writes,
)
from tests.unit.test_reconciler import (
    RESYNC_S,
    T0,
    FakeClock,
    World,
    facts,
    herd_job,
    started,
)

SPEC = herd_job(gpus=(1, 1))


class FunctionReconciler:
    """A reconciler that runs a test's function for each key."""

    def __init__(self, body: Callable[[str], Result | None]) -> None:
        self.body = body
        self.shut_down: list[str] = []

    def reconcile(self, name: str, failures: int) -> Result:
        return self.body(name) or Result()

    def record_shutdown(self, name: str) -> None:
        self.shut_down.append(name)

    def known_jobs(self) -> list[str]:
        return ["x", "y"]


class Outcomes:
    def __init__(self) -> None:
        self.seen: list[Outcome] = []

    def reconciled(self, outcome: Outcome, seconds: float) -> None:
        self.seen.append(outcome)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def layout(tmp_path: Path) -> StateLayout:
    state = StateLayout(tmp_path / "state")
    state.create()
    return state


@pytest.fixture
def store(layout: StateLayout) -> Iterator[Store]:
    with Store(layout.database) as opened:
        yield opened


def loop_for(
    body: Callable[[str], Result | None],
    allocator: Allocator,
    store: Store,
    queue: WorkQueue | None = None,
    **options: float,
) -> tuple[ControlLoop, WorkQueue, Outcomes]:
    queue = WorkQueue() if queue is None else queue
    outcomes = Outcomes()
    loop = ControlLoop(
        queue, FunctionReconciler(body), allocator, store, observer=outcomes, **options
    )
    return loop, queue, outcomes


def one_gpu(layout: StateLayout) -> Allocator:
    return Allocator(Pool.from_counts({"localhost": 1}), GrantPublisher(layout), virtual=True)


def taken(queue: WorkQueue, *keys: str) -> list[str]:
    """Put `keys` on the queue and take them off, as the loop does before it handles them."""
    for key in keys:
        queue.add(key)
    got = [queue.get(timeout=0) for _ in keys]
    assert got == list(keys)
    return list(keys)


def handle(loop: ControlLoop, key: str) -> Outcome:
    taken(loop.queue, key)
    return loop.handle(key)


def ready(queue: WorkQueue) -> list[str]:
    keys = []
    while (key := queue.get(timeout=0)) is not None:
        keys.append(key)
        queue.done(key)
    return keys


# ---- one key: results and errors to queue actions ----


def test_success_forgets_the_backoff_and_requeues_only_when_asked(
    layout: StateLayout, store: Store
) -> None:
    clock = Clock()
    queue = WorkQueue(base_delay=1.0, clock=clock)
    answers = {"a": Result(requeue_after=5.0), "b": Result()}
    loop, queue, _ = loop_for(answers.get, one_gpu(layout), store, queue)
    queue.backoff("a")  # an earlier failure
    assert [handle(loop, "a"), handle(loop, "b")] == [Outcome.SUCCESS, Outcome.SUCCESS]
    assert queue.failures("a") == 0
    clock.now += 4.9
    assert ready(queue) == []
    clock.now += 0.2
    assert ready(queue) == ["a"]  # b waits for an event


def test_a_temporary_error_is_retried_with_growing_backoff(
    layout: StateLayout, store: Store
) -> None:
    clock = Clock()
    queue = WorkQueue(base_delay=1.0, clock=clock)

    def fail(name: str) -> Result:
        raise StoreError("disk full")  # the store's errors are temporary to the loop

    loop, queue, outcomes = loop_for(fail, one_gpu(layout), store, queue)
    assert handle(loop, "a") == Outcome.TEMPORARY_ERROR
    clock.now += 1.0
    assert ready(queue) == ["a"]
    assert handle(loop, "a") == Outcome.TEMPORARY_ERROR
    clock.now += 1.5
    assert ready(queue) == []  # the second retry waits 2 s
    clock.now += 0.5
    assert ready(queue) == ["a"]
    assert outcomes.seen == [Outcome.TEMPORARY_ERROR, Outcome.TEMPORARY_ERROR]


def test_a_bug_is_retried_with_backoff_and_does_not_end_the_loop(
    layout: StateLayout, store: Store
) -> None:
    clock = Clock()
    queue = WorkQueue(base_delay=1.0, clock=clock)

    def bug(name: str) -> Result:
        raise KeyError(name)

    loop, queue, _ = loop_for(bug, one_gpu(layout), store, queue)
    assert handle(loop, "a") == Outcome.UNEXPECTED_ERROR
    assert queue.failures("a") == 1
    clock.now += 1.0
    assert ready(queue) == ["a"]


def test_a_permanent_error_is_not_retried_and_shows_as_stalled(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards: permanent errors retried (they would spin with backoff forever)."""
    clock = Clock()
    queue = WorkQueue(base_delay=1.0, clock=clock)
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store)
    started(world, herd_job("a", policy="static"))
    queue.backoff("a")

    def vanished(ref: object) -> object:
        raise PolicyError("spec.policy.name", "plug-in 'gone:Policy' cannot be imported")

    monkeypatch.setattr("herd_operator.controllers.reconciler.load_policy", vanished)
    assert handle(loop, "a") == Outcome.PERMANENT_ERROR
    assert queue.failures("a") == 0
    clock.now += 3600.0
    assert ready(queue) == []  # never retried by the queue
    stalled = world.condition("a", ConditionType.Stalled)
    assert facts(stalled) == (
        "True",
        "PolicyUnavailable",
        "spec.policy.name: plug-in 'gone:Policy' cannot be imported",
    )
    assert world.status("a").summary() == "Stalled"
    assert ("Warning", "PolicyUnavailable") in [e[:2] for e in world.events("a")]

    monkeypatch.undo()  # the plug-in is back: the next reconcile recovers
    assert handle(loop, "a") == Outcome.SUCCESS
    assert facts(world.condition("a", ConditionType.Stalled))[:2] == ("False", "Recovered")
    assert world.status("a").summary() != "Stalled"


def test_a_permanent_error_on_a_job_without_a_record_raises_without_status(
    layout: StateLayout, store: Store
) -> None:
    def fail(name: str) -> Result:
        raise PermanentError("no way", reason="Nope")

    loop, _queue, outcomes = loop_for(fail, one_gpu(layout), store)
    assert handle(loop, "ghost") == Outcome.PERMANENT_ERROR
    assert outcomes.seen == [Outcome.PERMANENT_ERROR]


def test_each_outcome_is_counted_in_the_operator_metrics(layout: StateLayout, store: Store) -> None:
    metrics = OperatorMetrics(CollectorRegistry())
    errors: dict[str, Exception] = {
        "t": TemporaryError("later"),
        "p": PermanentError("never"),
        "u": ValueError("bug"),
    }

    def body(name: str) -> Result:
        if name in errors:
            raise errors[name]
        return Result()

    loop = ControlLoop(
        WorkQueue(), FunctionReconciler(body), one_gpu(layout), store, observer=metrics
    )
    for name in ["ok", "ok", "t", "p", "u"]:
        handle(loop, name)

    def count(outcome: str) -> float:
        value = metrics.registry.get_sample_value("herd_reconcile_total", {"outcome": outcome})
        assert value is not None
        return value

    assert [count(o) for o in Outcome] == [2, 1, 1, 1, 0]
    assert metrics.registry.get_sample_value("herd_reconcile_duration_seconds_count") == 5
    assert (
        metrics.registry.get_sample_value("herd_reconcile_errors_total", {"kind": "temporary"})
        is None
    ), "one counter for the outcomes"


# ---- wake-ups ----


def test_a_grant_change_wakes_the_other_jobs_it_touched(layout: StateLayout, store: Store) -> None:
    """Guards: other jobs not requeued on a grant change."""
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}), GrantPublisher(layout), virtual=True, drain_seconds=0
    )
    low = Demand("low", 1, 2, 2, priority=0, arrival=1.0)
    high = Demand("high", 1, 1, 1, priority=5, arrival=2.0)
    _loop, queue, _ = loop_for(lambda name: None, allocator, store)
    grant = allocator.request(low)
    assert grant is not None and grant.placement.size == 2
    assert ready(queue) == []  # the asker gets its grant as the answer: no wake-up
    allocator.request(high)  # takes one of low's GPUs
    assert allocator.placements()["low"].size == 1
    assert ready(queue) == ["low"]


def test_a_burst_is_decided_once_after_every_job_asked(layout: StateLayout, store: Store) -> None:
    allocator = Allocator(Pool.from_counts({"localhost": 2}), GrantPublisher(layout), virtual=True)
    answers: dict[str, Grant | None] = {}

    def ask(name: str) -> None:
        answers[name] = allocator.request(Demand(name, 1, 1, 1, arrival=float(len(answers))))

    loop, queue, _ = loop_for(ask, allocator, store)
    assert loop.reconcile_burst(taken(loop.queue, "a", "b", "c")) == []

    assert answers == {"a": None, "b": None, "c": None}  # nobody decided alone
    assert sorted(ready(queue)) == ["a", "b", "c"]  # each is woken to act on the one decision
    sizes = {name: placement.size for name, placement in allocator.placements().items()}
    assert sizes == {"a": 1, "b": 1, "c": 0}  # first come, first served on 2 GPUs


def test_run_once_takes_every_ready_key_as_one_burst(layout: StateLayout, store: Store) -> None:
    allocator = Allocator(Pool.from_counts({"localhost": 2}), GrantPublisher(layout), virtual=True)
    asked: list[str] = []

    def ask(name: str) -> None:
        asked.append(name)
        allocator.request(Demand(name, 1, 1, 1, arrival=float(len(asked))))

    loop, queue, _ = loop_for(ask, allocator, store, max_batch=2)
    for name in ["a", "b", "c"]:
        queue.add(name)
    assert loop.run_once(timeout=0) == 2
    assert loop.run_once(timeout=0) >= 1  # c, then the woken ones
    assert loop.run_once(timeout=0.01) >= 0
    assert asked[:3] == ["a", "b", "c"]


# ---- store groups ----


@pytest.mark.parametrize(
    ("group_seconds", "seen_by_others"),
    [
        (3600.0, [[], [], []]),  # one group: nothing visible before the end
        (0.0, [[], ["j0"], ["j0", "j1"]]),  # a commit after every job
    ],
)
def test_a_burst_commits_its_writes_in_groups(
    layout: StateLayout,
    store: Store,
    group_seconds: float,
    seen_by_others: list[list[str]],
) -> None:
    seen: list[list[str]] = []
    with Store.open_readonly(store.path) as reader:

        def record(name: str) -> None:
            seen.append([job.name for job in reader.list_jobs()])
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)

        loop, _, _ = loop_for(record, one_gpu(layout), store, group_seconds=group_seconds)
        loop.reconcile_burst(taken(loop.queue, "j0", "j1", "j2"))

        assert seen == seen_by_others
        assert [job.name for job in reader.list_jobs()] == ["j0", "j1", "j2"]


def test_a_failing_job_does_not_stop_the_burst(layout: StateLayout, store: Store) -> None:
    allocator = one_gpu(layout)

    def record(name: str) -> None:
        if name == "bad":
            raise RuntimeError("reconcile bug")
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        allocator.request(Demand(name, 1, 1, 1, arrival=float(len(store.list_jobs()))))

    loop, queue, outcomes = loop_for(record, allocator, store)
    assert loop.reconcile_burst(taken(loop.queue, "ok", "bad", "after")) == []

    assert [job.name for job in store.list_jobs()] == ["after", "ok"]
    assert outcomes.seen == [Outcome.SUCCESS, Outcome.UNEXPECTED_ERROR, Outcome.SUCCESS]
    assert queue.failures("bad") == 1  # retried with backoff
    grant = allocator.grant("ok")  # the batch decided on the way out
    assert grant is not None and grant.placement.size == 1
    assert allocator.request(Demand("later", 1, 1, 1)) is not None  # not batching any more


def test_a_group_the_store_cannot_begin_is_handed_back(
    layout: StateLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BUSY_TIMEOUT_MS", 50)
    processed: list[str] = []
    with Store(layout.database) as store:
        loop, queue, outcomes = loop_for(processed.append, one_gpu(layout), store)
        # Another process holds the write lock: our group cannot even begin.
        other = sqlite3.connect(layout.database, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            assert (loop.reconcile_burst(taken(loop.queue, "a", "b")), processed) == (
                ["a", "b"],
                [],
            )
            other.execute("ROLLBACK")
        finally:
            other.close()
        assert outcomes.seen == [Outcome.LOST, Outcome.LOST]
        assert queue.failures("a") == queue.failures("b") == 1  # back with backoff
        again = sorted(key for key in (queue.get(timeout=2), queue.get(timeout=2)) if key)
        assert loop.reconcile_burst(again) == []  # once their backoff passed
        assert processed == ["a", "b"]


def test_a_store_error_raised_by_a_job_is_its_own_temporary_error(
    layout: StateLayout, store: Store
) -> None:
    def broken(name: str) -> None:
        if name == "a":
            raise StoreError(f"{name}: cannot write")
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)

    loop, _queue, outcomes = loop_for(broken, one_gpu(layout), store)
    assert loop.reconcile_burst(taken(loop.queue, "a", "b")) == []  # the group itself committed
    assert outcomes.seen == [Outcome.TEMPORARY_ERROR, Outcome.SUCCESS]
    assert [job.name for job in store.list_jobs()] == ["b"]


def test_a_decision_the_store_cannot_record_is_recorded_once_it_can(
    layout: StateLayout, store: Store
) -> None:
    """The burst's decision stands (its grants are published, its jobs proceed) when the
    store refuses it; the allocator records it at the next request that finds the store
    working, not never (a burst handed back decided nothing new, so it wrote nothing)."""
    for name in ("a", "b"):
        store.record_spec(name, f"{name}.yaml", herd_job(name, gpus=(1, 1)), f"f{name}", 1.0)
    refusing = True

    def record(decision: Allocation) -> None:
        if refusing:
            raise StoreError("disk full")
        store.replace_allocations(decision.placements, 2.0, decision.draining)

    allocator = Allocator(
        Pool.from_counts({"localhost": 2}),
        GrantPublisher(layout),
        virtual=True,
        on_decision=record,
    )

    def ask(name: str) -> None:
        allocator.request(Demand(name, 1, 1, 1))

    loop, _, outcomes = loop_for(ask, allocator, store)
    assert loop.reconcile_burst(taken(loop.queue, "a", "b")) == []
    assert outcomes.seen == [Outcome.SUCCESS, Outcome.SUCCESS]
    assert store.allocations() == {}
    refusing = False
    allocator.request(Demand("a", 1, 1, 1))  # nothing changes: only the record is written
    assert {job: p.size for job, p in store.allocations().items()} == {"a": 1, "b": 1}


def test_a_lost_group_makes_the_allocator_record_its_decision_again(
    layout: StateLayout, store: Store
) -> None:
    """A decision written inside a store group that is then rolled back (a full disk at its
    commit) is not in the store: the allocator hears of the rollback and writes it again."""
    store.record_spec("a", "a.yaml", herd_job("a", gpus=(1, 1)), "fa", 1.0)
    allocator = Allocator(
        Pool.from_counts({"localhost": 1}),
        GrantPublisher(layout),
        virtual=True,
        on_decision=lambda d: store.replace_allocations(d.placements, 2.0, d.draining),
    )
    store.on_rollback(allocator.mark_unrecorded)
    with pytest.raises(StoreError), store.transaction():
        allocator.request(Demand("a", 1, 1, 1))
        store._conn.execute("ROLLBACK")  # what SQLite does to a group that hit a full disk
    assert store.allocations() == {}
    allocator.request(Demand("a", 1, 1, 1))
    assert {job: p.size for job, p in store.allocations().items()} == {"a": 1}


# ---- shutdown ----


def test_shutdown_writes_every_running_jobs_status(world: World) -> None:
    """Guards: the shutdown not written to the jobs' status."""
    loop = ControlLoop(WorkQueue(), world.reconciler, world.allocator, world.store)
    started(world, herd_job("a", gpus=(1, 2)))
    started(world, herd_job("b", gpus=(1, 2)))
    world.specs.put(herd_job("done"))
    world.reconcile("done")
    world.launcher.exit("done", 0)
    world.reconcile("done")  # finished: not running, its status stays as it is
    finished = world.status("done")

    loop.record_shutdown()

    for name in ("a", "b"):
        status = world.status(name)
        running = get_condition(status.conditions, ConditionType.Running)
        assert running is not None
        assert facts(running) == ("False", "OperatorStopped", "the operator shut down")
        assert status.gpus is not None and status.gpus.allocated == 0
        assert status.placement == []
        assert ("Normal", "Stopped", "operator shut down") in world.events(name)
    assert world.status("done") == finished


def test_a_full_disk_keeps_the_jobs_running_and_the_loop_catches_up_when_space_returns(
    world: World,
) -> None:
    """Writes fail for real (see tests/unit/full_disk.py): the new jobs' specs need room."""
    loop = ControlLoop(WorkQueue(), world.reconciler, world.allocator, world.store)
    started(world, herd_job("a", gpus=(1, 2)))
    cap_at_present_size(world.store)
    big = ["python", "train.py", "x" * 50_000]
    world.specs.put(herd_job("b", gpus=(1, 2), command=big))
    world.specs.put(herd_job("c", gpus=(1, 2), command=big))

    lost = loop.reconcile_burst(taken(loop.queue, "a", "b", "c"))

    assert not world.store.writable
    assert world.launcher.stops == []  # the running job is left alone
    assert world.store.get_job("b") is None  # not recorded, so not started either
    assert [name for name, _, _ in world.launcher.starts] == ["a"]
    make_room(world.store)
    # Each job comes back once its backoff passed (lost with its group or failed itself: 1 s
    # at first); the new ones start once the allocator's decision wakes them. The guard is
    # for a hang only: a loaded machine may take a while.
    guard = time.monotonic() + 60.0
    while len(world.launcher.starts) < 3 and time.monotonic() < guard:
        loop.run_once(timeout=0.5)
    assert set(lost) == {"a", "b", "c"}
    assert world.store.writable
    assert sorted(name for name, _, _ in world.launcher.starts) == ["a", "b", "c"]
    assert world.launcher.stops == []
    assert [event.reason for event in world.store.events() if event.job is None] == [
        "StoreWritable"
    ]


def run_until(loop: ControlLoop, clock: FakeClock, until: float) -> None:
    """Run the loop on a fake clock: each ready key at once, then on to the next due one."""
    while clock.now < until:
        if loop.run_once(timeout=0):
            continue
        due = min(loop.queue._due.values(), default=until)
        clock.now = min(max(due, clock.now), until)


NOTHING_STORED = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0] + [60.0] * 8
"""The queue's 1, 2, 4 ... 60 s for the job, its count going on through the lost writes
(when a launch failure's retry was kept in its status, a lost status started it over:
1, 1, 2, 4 ...)."""
STATUS_STORED = NOTHING_STORED
"""The same backoff, whether or not small writes still store the statuses."""


@pytest.mark.parametrize(
    ("unwritable", "gaps_between_tries"),
    [
        (fail_commits, NOTHING_STORED),  # what a full disk does: the commits fail
        (refuse_writes, NOTHING_STORED),  # no group can even begin
        (fill_up, STATUS_STORED),  # the file is full, yet small writes fit
    ],
    ids=["commits-fail", "read-only", "file-full"],
)
def test_a_launch_failing_on_a_full_disk_is_retried_after_1_2_4_to_60_s_and_said_boundedly(
    world: World,
    caplog: pytest.LogCaptureFixture,
    unwritable: Callable[[Store], None],
    gaps_between_tries: list[float],
) -> None:
    """Seen on a full disk: one job's launch tried about ten times a second, two log lines
    each. A success forgot the key's backoff before its group's commit failed, and the
    lost group came back after the queue's 50 ms; the launch's own 1, 2, 4 ... 60 s lived in
    a status the disk did not take (it is the queue's now, and goes on)."""
    tries: list[float] = []  # when the loop took the job (reconciled, or its group lost)

    class Tries:
        def reconciled(self, outcome: Outcome, seconds: float) -> None:
            if not tries or tries[-1] != world.clock.now:
                tries.append(world.clock.now)

    queue = WorkQueue(clock=world.clock)
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store, observer=Tries())
    world.specs.put(herd_job("a"))
    world.launcher.start_error = OSError(errno.ENOSPC, "No space left on device")
    queue.add("a")
    run_until(loop, world.clock, T0 + 0.5)  # recorded: LaunchFailed, attempt 1, next in 1 s
    assert world.launcher.attempts == tries == [T0]
    unwritable(world.store)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        run_until(loop, world.clock, T0 + 600.0)
    assert not world.store.writable
    # No retry storm: 1, 2, 4 ... 32 s apart, then a minute.
    assert [later - earlier for earlier, later in itertools.pairwise(tries)] == gaps_between_tries
    assert set(world.launcher.attempts) <= set(tries)  # (none when no group can begin)
    said = [r for r in caplog.records if r.levelno >= logging.WARNING]
    # The store says writes fail (once a minute at most); each try may say why it failed
    # (a LaunchFailed line); nothing says it once per job and retry on top.
    assert len(said) <= len(tries) + 10, [r.getMessage() for r in said]
    assert not [r for r in said if r.exc_info]


def test_the_shutdown_on_a_full_disk_stops_nothing_less_and_says_what_it_could_not_record(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    loop = ControlLoop(WorkQueue(), world.reconciler, world.allocator, world.store)
    started(world, herd_job("a", gpus=(1, 2)))
    fill_up(world.store)

    assert loop.record_shutdown() is False

    assert any("cannot record the shutdown" in r.getMessage() for r in caplog.records)
    assert facts(get_condition(world.status("a").conditions, ConditionType.Running))[0] == "True"


def test_shutdown_goes_on_past_a_job_whose_status_cannot_be_written(
    layout: StateLayout, store: Store
) -> None:
    reconciler = FunctionReconciler(lambda name: None)
    failing = {"x"}

    def record(name: str) -> None:
        if name in failing:
            raise RuntimeError("broken")
        reconciler.shut_down.append(name)

    reconciler.record_shutdown = record  # type: ignore[method-assign]
    loop = ControlLoop(WorkQueue(), reconciler, one_gpu(layout), store)
    loop.record_shutdown()
    assert reconciler.shut_down == ["y"]


# ---- the report handler ----


def test_a_report_of_the_smaller_world_frees_a_draining_gpu_at_once(
    layout: StateLayout, store: Store
) -> None:
    """Guards: a report not passed to the allocator."""
    allocator = Allocator(
        Pool.from_counts({"remote": 2}), GrantPublisher(layout), virtual=True, drain_seconds=600
    )
    woken: list[str] = []
    handler = ReportHandler(store, allocator, woken.append, clock=lambda: 50.0)
    for name in ("a", "b"):
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    allocator.request(Demand("a", 1, 2, 2, arrival=1.0))
    allocator.request(Demand("a", 1, 2, 1, arrival=1.0))  # a shrinks: one GPU drains
    b = allocator.request(Demand("b", 1, 1, 1, arrival=2.0))
    assert b is not None and not b.admitted  # waiting for the drain

    assert handler({"job": "a", "epoch": None, "world_size": 1}) == {}

    assert woken == ["a"]
    b = allocator.request(Demand("b", 1, 1, 1, arrival=2.0))
    assert b is not None and b.admitted  # freed by the report, not by the 600 s timeout
    report = store.reports("a")[-1]
    assert (report.epoch, report.world_size, report.time) == (None, 1, 50.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"world_size": 1}, "'job' must be a non-empty string"),
        ({"job": "a", "world_size": 0}, "'world_size' must be an integer from 1 to 65536"),
        ({"job": "a", "world_size": 65537}, "'world_size' must be an integer from 1 to 65536"),
        ({"job": "a", "world_size": 1, "epoch": -1}, "'epoch' must be an integer from 0 to"),
        ({"job": "a", "world_size": 1, "epoch": 10**30}, "'epoch' must be an integer from 0 to"),
        ({"job": "a", "world_size": 1, "rank": "0"}, "'rank' must be an integer from 0 to"),
        ({"job": "a", "world_size": 1, "metrics": {"loss": 10**400}}, "'metrics' must map"),
        ({"job": "a", "world_size": 1, "metrics": {"loss": float("nan")}}, "'metrics' must map"),
        ({"job": "a", "world_size": 1, "metrics": {"x" * 129: 1.0}}, "'metrics' must map"),
        ({"job": "a", "world_size": 1, "metrics": {"loss": True}}, "'metrics' must map"),
        ({"job": "a", "world_size": 1, "measurement": 1}, "'measurement' must be true or false"),
        (
            {"job": "a", "world_size": 1, "epoch": 3, "measurement": True},
            "'epoch' must be null in a measurement",
        ),
    ],
)
def test_a_bad_report_names_the_field(
    layout: StateLayout, store: Store, args: dict[str, object], message: str
) -> None:
    handler = ReportHandler(store, one_gpu(layout), lambda name: None)
    with pytest.raises(BadRequest, match=message):
        handler(dict(args))


def test_a_measurement_is_stored_as_one_and_wakes_the_job(
    layout: StateLayout, store: Store
) -> None:
    woken: list[str] = []
    handler = ReportHandler(store, one_gpu(layout), woken.append, clock=lambda: 7.0)
    store.record_spec("a", "/jobs/a.yaml", SPEC, "fp", now=1.0)
    metrics = {"step_seconds": 0.25, "batch_size": 64.0}
    assert handler({"job": "a", "world_size": 1, "metrics": metrics, "measurement": True}) == {}
    assert handler({"job": "a", "world_size": 1, "epoch": None}) == {}
    assert woken == ["a", "a"]
    measured, reset = store.reports("a")
    assert (measured.epoch, measured.measurement, dict(measured.metrics)) == (None, True, metrics)
    assert (reset.epoch, reset.measurement) == (None, False)


def test_a_report_of_no_job_is_not_found_and_wakes_nothing(
    layout: StateLayout, store: Store
) -> None:
    woken: list[str] = []
    allocator = one_gpu(layout)
    handler = ReportHandler(store, allocator, woken.append)
    with pytest.raises(NotFound, match="no job 'ghost'"):
        handler({"job": "ghost", "epoch": 1, "world_size": 1})
    assert woken == []
    assert "ghost" not in allocator._world  # the allocator never heard of it


def test_jobs_a_decision_moved_are_woken_even_when_the_store_refuses_it(
    layout: StateLayout, store: Store
) -> None:
    refusing = False

    def record(placements: object) -> None:
        if refusing:
            raise StoreError("disk full")

    allocator = Allocator(
        Pool.from_counts({"localhost": 1}),
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=0,
        on_decision=record,
    )
    _, queue, _ = loop_for(lambda name: None, allocator, store)
    allocator.request(Demand("first", 1, 1, 1, arrival=1.0))
    waiting = allocator.request(Demand("second", 1, 1, 1, arrival=2.0))
    assert waiting is not None and not waiting.admitted
    refusing = True
    allocator.release("first")  # frees the GPU: second is admitted in this decision
    grant = allocator.grant("second")
    assert grant is not None and grant.admitted
    assert ready(queue) == ["second"]


def test_a_reconcile_that_calls_sys_exit_does_not_end_the_loop(
    layout: StateLayout, store: Store
) -> None:
    def exits(name: str) -> Result:
        raise SystemExit(1)  # a plug-in policy's desired() calling sys.exit

    loop, queue, _ = loop_for(exits, one_gpu(layout), store)
    assert handle(loop, "a") == Outcome.UNEXPECTED_ERROR
    assert queue.failures("a") == 1


# ---- one error taxonomy: launch failures, bugs that last, a damaged store ----


class TriesAt:
    """When the loop took each key (one call per reconcile, and one per key of a lost group)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.times: list[float] = []
        self.outcomes: list[Outcome] = []

    def reconciled(self, outcome: Outcome, seconds: float) -> None:
        self.times.append(self.clock.now)
        self.outcomes.append(outcome)


def gaps(times: list[float]) -> list[float]:
    return [later - earlier for earlier, later in itertools.pairwise(times)]


def test_a_launch_failure_is_retried_by_the_queue_after_1_2_4_to_60_s_as_its_status_says(
    world: World,
) -> None:
    """The next try of a launch that failed comes from the queue's backoff for the job (no
    second backoff kept in its status): the status says when it comes, the queue counts the
    tries, and an edit of the spec that mends the launch is tried at once, not a minute on."""
    tries = TriesAt(world.clock)
    queue = WorkQueue(clock=world.clock)
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store, observer=tries)
    world.specs.put(herd_job("a"))
    world.launcher.start_error = OSError("horovodrun: not found")
    queue.add("a")

    run_until(loop, world.clock, T0 + 300.0)

    assert gaps(world.launcher.attempts) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0]
    assert world.launcher.attempts == tries.times  # one reconcile a try, no wake-up between
    running = world.condition("a", ConditionType.Running)
    assert facts(running) == (
        "False",
        "LaunchFailed",
        "cannot launch a: horovodrun: not found (attempt 10; next in 60s)",
    )
    (event,) = world.raw_events("a")
    assert (event.type, event.reason, event.count) == ("Warning", "LaunchFailed", 10)
    assert queue.failures("a") == 10  # the queue's count is the one behind the delays
    run_until(loop, world.clock, T0 + 303.5)
    assert world.launcher.attempts[-1] == T0 + 303.0  # when the status said it would be

    # The user mends the command: the edit wakes the job (the spec watcher adds its key),
    # and the launch is tried at once.
    world.clock.advance(10.0)
    world.launcher.start_error = None
    world.specs.put(herd_job("a", command=["python3", "train.py"]))
    queue.add("a")
    loop.run_once(timeout=0)
    assert world.launcher.starts == [("a", 2, 4)]
    assert facts(world.condition("a", ConditionType.Running))[:2] == ("True", "Started")
    run_until(loop, world.clock, world.clock.now + RESYNC_S + 0.5)
    assert queue.failures("a") == 0  # it runs: the backoff is forgotten


def test_launches_the_keeper_cannot_execute_back_off_further_though_each_one_started(
    world: World,
) -> None:
    """The keeper starts (so the reconcile that launched went through) and then cannot
    execute the command: each such launch failure waits twice as long as the one before,
    not 1 s again after every start."""
    queue = WorkQueue(clock=world.clock)
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store)
    world.specs.put(herd_job("a"))
    queue.add("a")
    said: list[str] = []
    for launches in range(1, 8):
        while len(world.launcher.starts) < launches:  # on to the next launch, and no further
            if not loop.run_once(timeout=0):
                world.clock.now = max(min(queue._due.values()), world.clock.now)
        state = world.launcher.states["a"]
        world.launcher.states["a"] = replace(
            state,
            phase=ProcessPhase.EXITED,
            exit_code=127,
            launch_error="cannot run 'horovodrun': Permission denied",
        )
        queue.add("a")  # the launcher wakes the job when its process exits
        loop.run_once(timeout=0)
        said.append(world.condition("a", ConditionType.Running).message)
    assert [message.rsplit("(", 1)[1] for message in said] == [
        f"attempt {n}; next in {delay}s)"
        for n, delay in enumerate([1, 2, 4, 8, 16, 32, 60], start=1)
    ]
    assert gaps(world.launcher.attempts) == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]


def test_a_bug_that_lasts_shows_the_job_stalled_after_10_tries_and_is_retried_at_the_cap(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error is retried with backoff; the tenth failed reconcile in a row
    shows the job `Stalled=True ReconcileError` with the error, where people look, and from
    then on it is tried at the queue's longest delay (30 s), never forgotten, with one
    traceback in the log and one line a try. The next reconcile that goes through clears it."""
    assert STALL_AFTER_FAILURES == 10  # the tries below are counted for it
    tries = TriesAt(world.clock)
    queue = WorkQueue(clock=world.clock)  # 50 ms doubling to 30 s
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store, observer=tries)
    started(world, herd_job("a"))

    def bug(demand: Demand) -> Grant | None:
        raise KeyError(demand.name)

    monkeypatch.setattr(world.allocator, "request", bug)
    queue.add("a")
    with caplog.at_level(logging.INFO):
        run_until(loop, world.clock, T0 + 25.0)  # 9 tries: 50 ms, 100 ms ... 12.8 s apart
        assert len(tries.times) == 9
        assert get_condition(world.status("a").conditions, ConditionType.Stalled) is None
        run_until(loop, world.clock, T0 + 26.0)  # the tenth
        assert len(tries.times) == 10
        stalled = world.condition("a", ConditionType.Stalled)
        assert facts(stalled)[:2] == ("True", "ReconcileError")
        assert stalled.message.startswith("KeyError: 'a' (")
        assert world.status("a").summary() == "Stalled"
        run_until(loop, world.clock, T0 + 200.0)
    assert set(tries.outcomes) == {Outcome.UNEXPECTED_ERROR}
    assert gaps(tries.times)[9:] == pytest.approx([30.0] * 5)  # at the cap, still tried
    assert queue.failures("a") == len(tries.times) == 15
    assert [e[:2] for e in world.events("a")].count(("Warning", "ReconcileError")) == 1
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == 10  # then one line a try, not a traceback every 30 s

    monkeypatch.undo()  # the bug is gone: the next try goes through
    run_until(loop, world.clock, T0 + 231.0)
    assert facts(world.condition("a", ConditionType.Stalled))[:2] == ("False", "Recovered")
    assert world.status("a").summary() != "Stalled"
    assert queue.failures("a") == 0


def damage_the_jobs_table(store: Store) -> None:
    """Overwrite the jobs table's root page in the file, under the open store, as a disk
    that damages what it holds would (SQLite reads it as SQLITE_CORRUPT)."""
    raw = sqlite3.connect(store.path)
    raw.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the rows are in the file, not the WAL
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    root = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    raw.close()
    with open(store.path, "r+b") as handle:
        handle.seek((root - 1) * page_size + 8)
        handle.write(b"\xff" * (page_size - 8))


def test_a_damaged_store_is_not_retried_and_the_log_says_what_to_do(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    """Waiting cannot mend a corrupt store: the reconcile is a permanent error (retried
    like a full disk, a damaged store had every job reconciled again every minute, each
    time failing the same way); the log names the check and the way out."""
    clock = Clock()
    queue = WorkQueue(base_delay=1.0, clock=clock)
    tries = Outcomes()
    loop = ControlLoop(queue, world.reconciler, world.allocator, world.store, observer=tries)
    started(world, herd_job("a"))
    damage_the_jobs_table(world.store)

    assert handle(loop, "a") == Outcome.PERMANENT_ERROR
    clock.now += 3600.0
    assert ready(queue) == []  # never retried by the queue
    assert queue.failures("a") == 0
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert "is damaged: database disk image is malformed" in said
    assert "herd-operator check-state" in said and "move the file aside" in said

    world.specs.put(herd_job("b"))  # in a group too: not handed back to be tried again
    assert loop.reconcile_burst(taken(queue, "b")) == []
    assert tries.seen == [Outcome.PERMANENT_ERROR, Outcome.PERMANENT_ERROR]
    clock.now += 3600.0
    assert ready(queue) == []


def test_the_reconciles_of_a_lost_group_are_counted_once(layout: StateLayout, store: Store) -> None:
    """Each key of a group the store could not commit is one reconcile, counted as lost:
    it was counted once by its outcome and once more as lost, so `herd_reconcile_total`
    said 4 reconciles where 2 ran."""
    metrics = OperatorMetrics(CollectorRegistry())

    def record(name: str) -> None:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)

    queue = WorkQueue()
    loop = ControlLoop(queue, FunctionReconciler(record), one_gpu(layout), store, observer=metrics)
    fail_commits(store)

    assert loop.reconcile_burst(taken(queue, "a", "b")) == ["a", "b"]

    def count(outcome: Outcome) -> float:
        value = metrics.registry.get_sample_value(
            "herd_reconcile_total", {"outcome": outcome.value}
        )
        assert value is not None
        return value

    assert {outcome: count(outcome) for outcome in Outcome if count(outcome)} == {Outcome.LOST: 2}
    assert queue.failures("a") == queue.failures("b") == 1  # back after 1 s
