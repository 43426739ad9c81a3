"""The lifecycle (herd_operator/lifecycle.py): the manager's order, its reverse stop with
timeouts and its once-only clean-ups; a periodic loop's error handling, backoff and
liveness. Clocks are injected and threads are waited on through events, never timed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.lifecycle import Hooks, LoopHealth, Manager, Periodic, backoff
from herd_operator.runtime.metrics import OperatorMetrics

GUARD_S = 30.0
"""Hang guard for waiting on a thread; never a performance expectation."""


class Part:
    """A runnable that writes down what happens to it."""

    def __init__(self, name: str, said: list[str], *, fails_to_start: bool = False) -> None:
        self.name = name
        self.said = said
        self.fails_to_start = fails_to_start
        self.timeouts: list[float] = []

    def start(self) -> None:
        if self.fails_to_start:
            raise OSError(f"{self.name} cannot start")
        self.said.append(f"start {self.name}")

    def stop(self, timeout: float) -> None:
        self.timeouts.append(timeout)
        self.said.append(f"stop {self.name}")


def test_the_manager_starts_in_order_and_stops_in_reverse_with_the_clean_ups_between() -> None:
    said: list[str] = []
    manager = Manager(stop_timeout=7.0)
    manager.defer("lock", lambda: said.append("release lock"))
    store = Part("store", said)
    manager.add(store)
    manager.defer("endpoint", lambda: said.append("remove endpoint"))
    manager.add(Part("server", said), stop_timeout=2.0)
    manager.add(Part("loop", said))
    assert manager.started() == ["store", "server", "loop"]
    assert said == ["start store", "start server", "start loop"]

    manager.stop()

    assert said[3:] == [
        "stop loop", "stop server", "remove endpoint", "stop store", "release lock"
    ]  # fmt: skip
    assert store.timeouts == [7.0]
    assert manager.stopped and manager.started() == []


def test_a_start_that_fails_half_way_is_undone_by_the_same_stop_exactly_once() -> None:
    said: list[str] = []
    cleaned: list[str] = []
    manager = Manager()
    manager.defer("runtime dir", lambda: cleaned.append("runtime dir"))
    manager.add(Part("server", said))
    broken = Part("metrics", said, fails_to_start=True)
    with pytest.raises(OSError, match="metrics cannot start"):
        manager.add(broken)
    assert manager.started() == ["server"]

    manager.stop()
    manager.stop()  # the operator's refused start and its caller may both stop it

    assert said == ["start server", "stop server"], "a part whose start failed is not stopped"
    assert cleaned == ["runtime dir"], "each clean-up runs once"
    with pytest.raises(RuntimeError, match="has stopped"):
        manager.add(Part("late", said))


def test_an_error_in_one_stop_or_clean_up_leaves_the_rest_of_the_teardown_running(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said: list[str] = []
    manager = Manager()
    manager.defer("first", lambda: said.append("first clean-up"))
    manager.add(Hooks("broken-stop", stop=lambda: 1 / 0))
    manager.defer("broken clean-up", lambda: [][0])
    manager.add(Part("last", said))

    manager.stop()

    assert said == ["start last", "stop last", "first clean-up"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "clean-up 'broken clean-up' failed", "stopping broken-stop failed"
    ]  # fmt: skip
    assert all(r.exc_info is not None for r in errors), "each with its traceback"


def test_a_stop_past_its_timeout_is_left_behind_and_the_next_parts_still_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said: list[str] = []
    release = threading.Event()
    manager = Manager(stop_timeout=0.01, grace=0.0)
    manager.add(Part("store", said))
    manager.add(Hooks("stuck", stop=lambda: release.wait(GUARD_S)))
    try:
        manager.stop()
        assert said == ["start store", "stop store"]
        assert "stuck did not stop within 0.01 s; going on without it" in caplog.messages
    finally:
        release.set()


# ---- Periodic ----


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Steps:
    """A step that raises `error` while it is set."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None:
            raise self.error


def periodic(
    step: Callable[[], object],
    clock: Clock,
    *,
    health: LoopHealth | None = None,
    expected: tuple[type[Exception], ...] = (),
) -> Periodic:
    """Every 10 s, backed off up to a minute."""
    return Periodic(
        "pruner", step, 10.0, what="pruning", clock=clock, max_backoff=60.0, health=health,
        expected=expected,
    )  # fmt: skip


def test_a_failing_step_is_said_with_its_traceback_then_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    clock, health = Clock(), LoopHealth(clock=lambda: 5.0)
    steps = Steps(RuntimeError("a bug"))
    loop = periodic(steps, clock, health=health)
    assert [loop.run_step() for _ in range(3)] == [False, False, False]
    clock.now += 59.0
    loop.run_step()
    clock.now += 2.0
    loop.run_step()  # a minute after the first word: said again, without a traceback
    steps.error = None
    assert loop.run_step()

    said = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("ERROR", "pruning failed; trying again in 20 s", True),
        ("WARNING", "pruning still fails (5 times in a row; the last: RuntimeError: a bug);"
         " trying again in 60 s", False),
        ("INFO", "pruning works again after 5 failure(s)", False),
    ]  # fmt: skip
    state = health.snapshot()["pruner"]
    assert (state.errors, state.last_success) == (5, 5.0)
    assert loop.failures == 0 and loop.next_delay() == 10.0


def test_an_expected_error_is_said_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    loop = periodic(Steps(OSError("disk full")), Clock(), expected=(OSError,))
    loop.run_step()
    [record] = caplog.records
    assert record.getMessage() == "pruning failed: disk full; trying again in 20 s"
    assert record.levelname == "WARNING" and record.exc_info is None


def test_failures_back_off_by_doubling_up_to_the_cap() -> None:
    loop = periodic(Steps(RuntimeError("a bug")), Clock())
    delays = [loop.next_delay()]
    for _ in range(4):
        loop.run_step()
        delays.append(loop.next_delay())
    assert delays == [10.0, 20.0, 40.0, 60.0, 60.0]


@given(
    interval=st.floats(min_value=1e-3, max_value=1e4),
    failures=st.integers(min_value=0, max_value=10_000),
    cap=st.floats(min_value=0.0, max_value=1e5),
)
def test_the_backoff_is_never_shorter_than_the_interval_nor_longer_than_the_cap(
    interval: float, failures: int, cap: float
) -> None:
    delay = backoff(interval, failures, cap)
    assert interval <= delay <= max(cap, interval)
    assert backoff(interval, failures + 1, cap) >= delay
    if failures == 0:
        assert delay == interval


class Fatal(BaseException):
    """What no loop may catch (KeyboardInterrupt, SystemExit and the like)."""


def test_a_loop_that_dies_says_so_once_and_its_liveness_shows_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    health = LoopHealth()
    ran, die = threading.Event(), threading.Event()

    def step() -> None:
        ran.set()
        die.wait(GUARD_S)
        raise Fatal("out of the loop")

    loop = Periodic("dcgm-job-mapping", step, 3600.0, immediately=True, health=health)
    loop.start()
    assert ran.wait(GUARD_S)
    assert health.snapshot()["dcgm-job-mapping"].running
    die.set()
    assert loop.stop(GUARD_S)
    assert not loop.alive
    state = health.snapshot()["dcgm-job-mapping"]
    assert (state.running, state.died) == (False, True)
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.levelname == "CRITICAL"
    assert record.getMessage() == (
        "loop dcgm-job-mapping died (Fatal: out of the loop): dcgm-job-mapping no longer"
        " runs until the operator restarts"
    )


def test_wake_runs_the_next_step_at_once_and_stop_ends_the_loop() -> None:
    health = LoopHealth()
    stepped = threading.Event()
    loop = Periodic("spec-relist", stepped.set, 3600.0, health=health)
    assert loop.stop(GUARD_S), "stopping a loop never started is a no-op"
    loop = Periodic("spec-relist", stepped.set, 3600.0, health=health)
    loop.start()
    with pytest.raises(RuntimeError, match="started already"):
        loop.start()
    loop.wake()
    assert stepped.wait(GUARD_S), "woken, the step ran without waiting an hour"
    assert loop.stop(GUARD_S) and loop.stopping.is_set()
    state = health.snapshot()["spec-relist"]
    assert (state.running, state.died) == (False, False)
    assert state.last_success is not None


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pruner: interval must be positive, not 0"):
        Periodic("pruner", lambda: None, 0)


def test_the_operators_metrics_show_each_loops_liveness() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    for name in ("node-watch", "pruner"):
        metrics.loops.started(name)
    metrics.loops.succeeded("node-watch")
    metrics.loops.failed("pruner")
    metrics.loops.failed("pruner")
    metrics.loops.ended("pruner", died=True)
    samples = {
        (sample.name, sample.labels.get("loop")): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        if family.name.startswith("herd_loop")
        for sample in family.samples
    }
    assert samples.pop(("herd_loop_last_success_timestamp_seconds", "node-watch")) > 0
    assert samples == {
        ("herd_loop_up", "node-watch"): 1.0,
        ("herd_loop_up", "pruner"): 0.0,
        ("herd_loop_errors_total", "node-watch"): 0.0,
        ("herd_loop_errors_total", "pruner"): 2.0,
    }
