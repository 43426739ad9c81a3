"""Tests for controllers.workqueue."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.controllers.errors import Backoff
from herd_operator.controllers.workqueue import WorkQueue

# Only a guard against a hang; never an assertion about speed.
HANG_GUARD_S = 10.0


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(clock: FakeClock) -> WorkQueue:
    return WorkQueue(clock=clock)


def drain(queue: WorkQueue) -> list[str]:
    """Take every ready key without blocking, marking each done."""
    keys = []
    while (key := queue.get(timeout=0)) is not None:
        keys.append(key)
        queue.done(key)
    return keys


def test_add_dedups_waiting_keys_and_keeps_fifo_order(queue: WorkQueue) -> None:
    for key in ["a", "b", "a", "c", "b"]:
        queue.add(key)
    assert len(queue) == 3
    assert drain(queue) == ["a", "b", "c"]
    assert len(queue) == 0


def test_get_times_out_with_none_when_empty(queue: WorkQueue) -> None:
    assert queue.get(timeout=0) is None
    assert queue.get(timeout=0.01) is None


def test_key_added_while_processing_is_requeued_once_on_done(queue: WorkQueue) -> None:
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add("a")
    queue.add("a")
    # Not handed out a second time while the first worker still holds it.
    assert queue.get(timeout=0) is None
    assert len(queue) == 0
    queue.done("a")
    assert len(queue) == 1
    assert queue.get(timeout=0) == "a"
    queue.done("a")
    assert queue.get(timeout=0) is None


def test_done_without_get_is_refused(queue: WorkQueue) -> None:
    queue.add("a")
    with pytest.raises(ValueError, match=r"^done\('a'\): key is not being processed$"):
        queue.done("a")


def test_add_after_becomes_ready_when_due_in_due_order(queue: WorkQueue, clock: FakeClock) -> None:
    queue.add_after("late", 5.0)
    queue.add_after("early", 1.0)
    queue.add("now")
    assert len(queue) == 3
    assert drain(queue) == ["now"]
    clock.advance(1.0)
    assert drain(queue) == ["early"]
    clock.advance(3.9)
    assert drain(queue) == []
    clock.advance(0.1)
    assert drain(queue) == ["late"]
    assert len(queue) == 0


def test_later_add_after_does_not_postpone_earlier_one(queue: WorkQueue, clock: FakeClock) -> None:
    queue.add_after("a", 1.0)
    queue.add_after("a", 10.0)
    assert len(queue) == 1
    clock.advance(1.0)
    assert drain(queue) == ["a"]
    clock.advance(20.0)
    assert drain(queue) == []


def test_earlier_add_after_brings_a_pending_key_forward(queue: WorkQueue, clock: FakeClock) -> None:
    queue.add_after("a", 10.0)
    queue.add_after("a", 2.0)
    clock.advance(2.0)
    assert drain(queue) == ["a"]
    clock.advance(10.0)
    assert drain(queue) == []


def test_immediate_add_wins_over_pending_delay(queue: WorkQueue, clock: FakeClock) -> None:
    queue.add_after("a", 5.0)
    queue.add("a")
    assert len(queue) == 1
    assert drain(queue) == ["a"]
    clock.advance(5.0)
    assert drain(queue) == []


def test_add_after_of_a_ready_key_changes_nothing(queue: WorkQueue, clock: FakeClock) -> None:
    queue.add("a")
    queue.add_after("a", 1.0)
    assert drain(queue) == ["a"]
    clock.advance(1.0)
    assert drain(queue) == []


def test_delayed_key_falling_due_while_processing_waits_for_done(
    queue: WorkQueue, clock: FakeClock
) -> None:
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add_after("a", 1.0)
    clock.advance(1.0)
    assert queue.get(timeout=0) is None
    queue.done("a")
    assert drain(queue) == ["a"]


def test_add_after_with_nonpositive_delay_is_an_add(queue: WorkQueue) -> None:
    queue.add_after("a", 0)
    queue.add_after("b", -1.0)
    assert drain(queue) == ["a", "b"]


def test_blocked_get_wakes_when_delayed_key_is_due_on_real_clock() -> None:
    real_queue = WorkQueue()
    real_queue.add_after("a", 0.05)
    assert real_queue.get(timeout=HANG_GUARD_S) == "a"


def test_blocked_get_wakes_on_add_from_another_thread() -> None:
    real_queue = WorkQueue()
    got: list[str | None] = []
    getter = threading.Thread(target=lambda: got.append(real_queue.get(timeout=HANG_GUARD_S)))
    getter.start()
    real_queue.add("a")
    getter.join(HANG_GUARD_S)
    assert got == ["a"]


def test_backoff_doubles_from_base_up_to_cap() -> None:
    queue = WorkQueue(base_delay=0.05, max_delay=1.0)
    delays = [queue.backoff("a") for _ in range(7)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert queue.failures("a") == 7
    assert queue.failures("b") == 0


def test_backoff_may_take_its_own_base_and_cap_and_counts_the_same_failures() -> None:
    queue = WorkQueue(base_delay=0.05, max_delay=1.0)
    slow = [queue.backoff("a", base_delay=1.0, max_delay=60.0) for _ in range(8)]
    assert slow == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert queue.backoff("a") == 1.0  # the queue's own schedule, at the key's 9th failure
    assert queue.failures("a") == 9


@settings(deadline=None)  # a loaded machine: no timing in unit tests
@given(
    base=st.floats(min_value=1e-3, max_value=10.0),
    spread=st.floats(min_value=1.0, max_value=1e4),
    tries=st.integers(min_value=1, max_value=80),
)
def test_a_backoff_schedule_says_the_delay_the_queue_gives(
    base: float, spread: float, tries: int
) -> None:
    """What a launch failure's status says of its next try (`Backoff.delay` of the attempt)
    is what the queue waits on that schedule, failure after failure."""
    schedule = Backoff(base, base * spread)
    queue = WorkQueue()
    for attempt in range(1, tries + 1):
        waited = queue.backoff("a", base_delay=base, max_delay=base * spread)
        assert schedule.delay(attempt) == waited
    assert queue.max_delay == 30.0


def test_backoff_stays_at_cap_after_very_many_failures() -> None:
    queue = WorkQueue()
    for _ in range(2000):
        delay = queue.backoff("a")
    assert delay == 30.0


def test_forget_resets_only_that_key() -> None:
    queue = WorkQueue()
    for _ in range(3):
        queue.backoff("a")
        queue.backoff("b")
    queue.forget("a")
    assert queue.failures("a") == 0
    assert queue.backoff("a") == 0.05
    assert queue.failures("b") == 3


def test_add_rate_limited_requeues_after_the_backoff(clock: FakeClock) -> None:
    # Binary-exact delays keep the fake clock's float sums exact.
    queue = WorkQueue(base_delay=0.25, clock=clock)
    queue.add_rate_limited("a")
    assert queue.failures("a") == 1
    assert drain(queue) == []
    clock.advance(0.25)
    assert drain(queue) == ["a"]
    queue.add_rate_limited("a")
    clock.advance(0.25)
    assert drain(queue) == []
    clock.advance(0.25)
    assert drain(queue) == ["a"]


def test_constructor_rejects_bad_delays() -> None:
    with pytest.raises(ValueError, match=r"^base_delay must be positive, got 0$"):
        WorkQueue(base_delay=0)
    with pytest.raises(ValueError, match=r"^max_delay \(0.01\) must be >= base_delay \(0.05\)$"):
        WorkQueue(max_delay=0.01)


def test_shutdown_unblocks_a_waiting_get_and_ignores_later_adds() -> None:
    queue = WorkQueue()
    got: list[str | None] = ["sentinel"]
    started = threading.Event()

    def wait_for_key() -> None:
        started.set()
        got[0] = queue.get()

    getter = threading.Thread(target=wait_for_key)
    getter.start()
    started.wait(HANG_GUARD_S)
    queue.shutdown()
    getter.join(HANG_GUARD_S)
    assert not getter.is_alive()
    assert got == [None]
    queue.add("a")
    queue.add_after("b", 0.01)
    assert len(queue) == 0
    assert queue.get(timeout=0) is None


def test_shutdown_drops_dirty_requeue_but_done_still_works(queue: WorkQueue) -> None:
    queue.add("a")
    assert queue.get(timeout=0) == "a"
    queue.add("a")
    queue.shutdown()
    queue.done("a")
    assert len(queue) == 0


def test_waiting_for_a_far_delayed_key_does_not_poll(clock: FakeClock) -> None:
    calls = 0

    def counting_clock() -> float:
        nonlocal calls
        calls += 1
        return clock()

    queue = WorkQueue(clock=counting_clock)
    queue.add_after("a", 3600.0)
    calls = 0
    assert queue.get(timeout=0.2) is None
    # One wait on the condition for the whole timeout, not a loop of short sleeps.
    assert calls <= 10


def test_no_key_is_processed_by_two_workers_at_once() -> None:
    queue = WorkQueue()
    keys = ["job-a", "job-b"]
    lock = threading.Lock()
    in_flight: set[str] = set()
    overlaps: list[str] = []
    processed: Counter[str] = Counter()

    def worker() -> None:
        while (key := queue.get(timeout=HANG_GUARD_S)) is not None:
            with lock:
                if key in in_flight:
                    overlaps.append(key)
                in_flight.add(key)
            # Let the adders run while this key is held.
            for _ in range(20):
                time.sleep(0)
            with lock:
                in_flight.discard(key)
                processed[key] += 1
            queue.done(key)

    def adder(offset: int) -> None:
        for i in range(300):
            queue.add(keys[(i + offset) % len(keys)])
            time.sleep(0)

    workers = [threading.Thread(target=worker) for _ in range(2)]
    adders = [threading.Thread(target=adder, args=(n,)) for n in range(3)]
    for thread in workers + adders:
        thread.start()
    for thread in adders:
        thread.join(HANG_GUARD_S)
    deadline = time.monotonic() + HANG_GUARD_S
    while len(queue) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.shutdown()
    for thread in workers:
        thread.join(HANG_GUARD_S)
    assert not any(thread.is_alive() for thread in workers)
    assert overlaps == []
    assert set(processed) == set(keys)
