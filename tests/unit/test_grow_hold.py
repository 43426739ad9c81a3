"""A grow whose new workers start late: the driver's decision (pure), the slots it withholds,
and `GrowHold` on a stand-in for Horovod's ElasticDriver (its real use: test_driver.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pydantic
import pytest
from horovod.runner.common.util.hosts import SlotInfo
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.layout import StateLayout
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.engines.horovod import HorovodEngine
from herd_operator.runtime.engines.hvd_grow import (
    MAX_GROW_RETRY_SECONDS,
    GrowHold,
    GrowOutcome,
    WithheldSlots,
    grow_outcome,
    grow_retry_seconds,
    kept_slots,
    rendezvous_rank,
    withhold,
)
from herd_operator.specs.fingerprint import spec_fingerprint
from herd_operator.specs.models import DEFAULT_GLOO_TIMEOUT_SECONDS, DEFAULT_GROW_TIMEOUT_SECONDS
from tests.unit.test_horovod_engine import make_job

GUARD_S = 30.0
"""How long a test waits for a thread it started: far longer than any answer takes."""

# ---- the decision ----

ranks = st.frozensets(st.integers(0, 5), max_size=6)


@given(
    new=ranks,
    arrived=ranks,
    exited=ranks,
    waited=st.floats(0, 2000),
    timeout=st.floats(1, 1000),
    elastic=st.floats(1, 1000),
    enough=st.booleans(),
    stopping=st.booleans(),
)
def test_a_held_grow_is_decided_by_who_arrived_who_ended_and_how_long_it_waited(
    new: frozenset[int],
    arrived: frozenset[int],
    exited: frozenset[int],
    waited: float,
    timeout: float,
    elastic: float,
    enough: bool,
    stopping: bool,
) -> None:
    outcome = grow_outcome(new, arrived, exited, waited, timeout, elastic, enough, stopping)
    ended = bool(new & exited)
    if stopping:
        assert outcome is GrowOutcome.LET_GO  # a stopping job is not held
    elif ended:  # a new worker that ended never joins: never wait for it
        assert outcome is (GrowOutcome.GIVE_UP if enough else GrowOutcome.LET_GO)
    elif new <= arrived:
        assert outcome is GrowOutcome.JOINED
    elif waited < (timeout if enough else elastic):
        assert outcome is GrowOutcome.WAIT
    else:  # waited long enough: give up if they can go on alone, else do as Horovod does
        assert outcome is (GrowOutcome.GIVE_UP if enough else GrowOutcome.LET_GO)
    # Workers too few to make --min-np alone are never left alone.
    assert not (outcome is GrowOutcome.GIVE_UP and not enough)


def test_keys_put_at_glooss_rendezvous_name_the_rank_that_put_them() -> None:
    assert rendezvous_rank("global", "rank_3") == 3
    assert rendezvous_rank("global", "12") == 12
    for scope, key in [
        ("local_localhost", "rank_1"),  # after the global context: not the first sign
        ("global_process_set_hash_ab", "rank_1"),
        ("worker_addresses", "localhost:0"),
        ("global", "rank_x"),
        ("global", "rank_"),
        ("global", "-1"),
        ("global", "\u0661"),  # an Arabic-Indic digit: str.isdigit, but no rank
    ]:
        assert rendezvous_rank(scope, key) is None, (scope, key)


def test_a_given_up_grow_keeps_each_host_below_its_lowest_new_slot() -> None:
    assert kept_slots([("a", 2), ("a", 3), ("b", 0), ("b", 1)]) == {"a": 2, "b": 0}
    assert kept_slots([]) == {}
    grant = {"a": 4, "b": 2, "c": 1}
    assert withhold(grant, {"a": 2, "b": 0}) == {"a": 2, "c": 1}  # b as if not granted
    assert withhold(grant, {}) == grant
    assert withhold({"a": 1}, {"a": 3}) == {"a": 1}  # a grant that shrank since stays as is


@pytest.mark.parametrize(
    ("failures", "first", "seconds"),
    [
        *[(1, 30, 30), (2, 30, 60), (3, 30, 120), (6, 30, 600), (60, 30, 600), (0, 30, 30)],
        *[(1, 1, 1), (4, 1, 8), (3, 900, 900)],
    ],
)
def test_a_grow_given_up_again_and_again_is_retried_less_and_less_often(
    failures: int, first: float, seconds: float
) -> None:
    assert grow_retry_seconds(failures, first) == seconds
    assert grow_retry_seconds(failures, first) <= max(first, MAX_GROW_RETRY_SECONDS)


# ---- the spec's knob ----


@pytest.mark.parametrize(
    ("field", "default", "flag"),
    [
        ("glooTimeoutSeconds", DEFAULT_GLOO_TIMEOUT_SECONDS, "--gloo-timeout-seconds"),
        ("growTimeoutSeconds", DEFAULT_GROW_TIMEOUT_SECONDS, "--grow-timeout-seconds"),
    ],
)
def test_the_timeouts_are_spec_options_with_documented_defaults(
    field: str, default: int, flag: str, tmp_path: Path
) -> None:
    assert (DEFAULT_GLOO_TIMEOUT_SECONDS, DEFAULT_GROW_TIMEOUT_SECONDS) == (30, 120)
    engine = HorovodEngine(EngineContext(StateLayout(tmp_path), ("localhost",)))
    for options, value in [({}, default), ({field: 45}, 45)]:
        argv = engine.launch_argv(make_job(engine={"options": options}), 1)
        assert argv[argv.index(flag) + 1] == str(value)
    # A spec that does not set it keeps its fingerprint (and generation) across the upgrade.
    assert spec_fingerprint(make_job(horovod={field: default})) == spec_fingerprint(make_job())
    assert spec_fingerprint(make_job(horovod={field: 45})) != spec_fingerprint(make_job())
    for bad in [0, "45"]:
        with pytest.raises(pydantic.ValidationError, match=field):
            make_job(horovod={field: bad})


# ---- the slots withheld ----


class Grant:
    """A discovery whose answer a test sets."""

    def __init__(self, slots: dict[str, int]) -> None:
        self.slots = slots

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        return dict(self.slots)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_withheld_slots_come_back_after_the_delay_once_their_workers_have_ended() -> None:
    grant, clock = Grant({"a": 2}), Clock()
    discovery = WithheldSlots(grant, clock)
    assert discovery.find_available_hosts_and_slots() == {"a": 2}
    discovery.withhold({"a": 1}, 30.0, workers=1)
    assert discovery.find_available_hosts_and_slots() == {"a": 1}
    clock.now += 30
    # The worker of the grow given up has not ended yet: a retry would meet it.
    assert discovery.find_available_hosts_and_slots() == {"a": 1}
    discovery.worker_ended()
    assert discovery.find_available_hosts_and_slots() == {"a": 2}
    assert not discovery.withholding


def test_withheld_slots_come_back_when_the_grant_changes() -> None:
    grant, clock = Grant({"a": 2}), Clock()
    discovery = WithheldSlots(grant, clock)
    discovery.find_available_hosts_and_slots()
    discovery.withhold({"a": 1}, 30.0, workers=1)
    discovery.worker_ended()
    grant.slots = {"a": 2, "b": 1}  # the operator decided again
    assert discovery.find_available_hosts_and_slots() == {"a": 2, "b": 1}
    assert not discovery.withholding


# ---- GrowHold on a stand-in for Horovod's driver ----


class FakeDriver:
    """The parts of Horovod's ElasticDriver that `GrowHold` uses: assignments per host follow
    the discovery, new slots are the local ranks above those a host had."""

    def __init__(self, discovery: WithheldSlots, running: dict[str, int], min_np: int) -> None:
        self.discovery = discovery
        self.hosts = dict(running)
        self._min_num_proc = min_np
        self._wait_hosts_cond = threading.Condition()
        self._shutdown = threading.Event()
        self.started: list[SlotInfo] = []
        self.recorded: list[tuple[str, int, int]] = []
        """Exits Horovod's own handling recorded."""
        self.registry_sizes: list[int] = []
        self._host_manager = SimpleNamespace(
            update_available_hosts=self._discover, current_hosts={}
        )
        self._worker_registry = SimpleNamespace(reset=self.registry_sizes.append)

    def _discover(self) -> None:
        self._host_manager.current_hosts = self.discovery.find_available_hosts_and_slots()

    def world_size(self) -> int:
        return sum(self.hosts.values())

    def finished(self) -> bool:
        return self._shutdown.is_set()

    def _update_host_assignments(self, hosts: dict[str, int]) -> list[SlotInfo]:
        before, self.hosts = self.hosts, dict(hosts)
        size = self.world_size()
        ranks = iter(range(size))
        slots = [
            (
                SlotInfo(host, next(ranks), local_rank, 0, size, count, 1),
                local_rank >= before.get(host, 0),
            )
            for host, count in self.hosts.items()
            for local_rank in range(count)
        ]
        return [slot for slot, new in slots if new]

    def _start_worker_processes(self, pending: list[SlotInfo]) -> None:
        self.started.extend(pending)

    def _handle_worker_exit(self, slot: SlotInfo, code: int, timestamp: float) -> None:
        self.recorded.append((slot.hostname, slot.local_rank, code))


@dataclass
class Grow:
    driver: FakeDriver
    hold: GrowHold
    clock: Clock
    thread: threading.Thread
    """Horovod's barrier action, starting the new workers (held in it)."""
    pending: list[SlotInfo]
    """The new workers' slots."""


@contextmanager
def grown(granted: dict[str, int], running: dict[str, int], min_np: int = 1) -> Iterator[Grow]:
    """A driver running `running` whose grant became `granted`, in Horovod's barrier action:
    the grow's start runs (and is held) in a thread of its own."""
    grant, clock = Grant(dict(running)), Clock()
    discovery = WithheldSlots(grant, clock)
    discovery.find_available_hosts_and_slots()
    driver = FakeDriver(discovery, running, min_np)
    hold = GrowHold(driver, discovery, timeout=60, elastic_timeout=600, clock=clock, period=0.01)
    grant.slots = dict(granted)
    driver._discover()
    pending = driver._update_host_assignments(driver._host_manager.current_hosts)
    start: Callable[[list[SlotInfo]], None] = driver._start_worker_processes
    thread = threading.Thread(target=start, args=(pending,), daemon=True)
    thread.start()
    try:
        yield Grow(driver, hold, clock, thread, pending)
    finally:
        driver._shutdown.set()  # lets a hold a failed test left go
        thread.join(GUARD_S)


def wait_until(probe: Callable[[], bool]) -> None:
    event = threading.Event()
    for _ in range(int(GUARD_S / 0.01)):
        if probe():
            return
        event.wait(0.01)
    raise AssertionError("timed out")


def test_the_running_workers_are_held_until_every_new_one_is_at_the_rendezvous() -> None:
    with grown({"a": 3}, {"a": 1}) as g:
        assert [(s.hostname, s.local_rank, s.rank) for s in g.pending] == [("a", 1, 1), ("a", 2, 2)]
        wait_until(lambda: len(g.driver.started) == 2)
        g.hold.put_seen("global", "rank_1")
        g.hold.put_seen("local_a", "rank_2")  # not the global rendezvous
        g.clock.now += 59
        g.thread.join(0.2)
        assert g.thread.is_alive(), "let go with a new worker still starting"
        g.hold.put_seen("global", "rank_2")
        g.thread.join(GUARD_S)
        assert not g.thread.is_alive()
        assert g.driver.hosts == {"a": 3} and g.driver.registry_sizes == []  # Horovod's own
        assert not g.driver.discovery.withholding and g.hold.failures == 0
        # A new worker that fails once the grow joined is Horovod's usual failure.
        g.driver._handle_worker_exit(g.pending[0], 1, 0.0)
        assert g.driver.recorded == [("a", 1, 1)]


def test_a_grow_not_joined_within_the_timeout_is_given_up_and_the_job_keeps_its_size() -> None:
    with grown({"a": 2, "b": 1}, {"a": 1}) as g:
        wait_until(lambda: len(g.driver.started) == 2)
        g.hold.put_seen("global", "rank_2")  # b's worker made it, a's second did not
        g.clock.now += 60
        g.thread.join(GUARD_S)
        assert not g.thread.is_alive()
        # The running worker is answered from the old assignment; the barrier is its own.
        assert g.driver.hosts == {"a": 1} and g.driver.registry_sizes == [1]
        stops = [g.hold.stop_events(s.hostname, s.local_rank) for s in g.pending]
        assert all(len(events) == 1 and events[0].is_set() for events in stops)
        assert g.driver.discovery.find_available_hosts_and_slots() == {"a": 1}
        # The stopped workers' exits are not failures of the job.
        for slot in g.pending:
            g.driver._handle_worker_exit(slot, 143, 0.0)
        assert g.driver.recorded == []
        g.clock.now += 30  # the retry delay after a first failure
        assert g.driver.discovery.find_available_hosts_and_slots() == {"a": 2, "b": 1}
        assert g.hold.failures == 1


def test_a_new_worker_that_ends_while_starting_gives_the_grow_up_at_once() -> None:
    with grown({"a": 2}, {"a": 1}) as g:
        wait_until(lambda: len(g.driver.started) == 1)
        (slot,) = g.pending
        ended = threading.Thread(target=g.driver._handle_worker_exit, args=(slot, 1, 0.0))
        ended.start()
        g.thread.join(GUARD_S)
        ended.join(GUARD_S)
        assert not g.thread.is_alive() and not ended.is_alive()
        assert g.driver.hosts == {"a": 1} and g.driver.registry_sizes == [1]
        assert g.driver.recorded == []  # no blacklisting of the name the running worker has
        assert g.driver.discovery.withholding


def test_workers_too_few_to_go_on_alone_are_held_as_long_as_horovod_waits() -> None:
    with grown({"a": 2}, {"a": 1}, min_np=2) as g:
        wait_until(lambda: len(g.driver.started) == 1)
        g.clock.now += 60
        g.thread.join(0.2)
        assert g.thread.is_alive(), "given up with fewer workers than --min-np"
        g.clock.now += 540
        g.thread.join(GUARD_S)
        assert not g.thread.is_alive()
        assert g.driver.hosts == {"a": 2} and g.driver.registry_sizes == []  # as Horovod left it
        (slot,) = g.pending
        g.driver._handle_worker_exit(slot, 1, 0.0)
        assert g.driver.recorded == [("a", 1, 1)]  # then Horovod handles its failure


def test_the_first_start_is_not_held() -> None:
    with grown({"a": 2}, {}) as g:
        g.thread.join(GUARD_S)  # nobody running: nothing to hold
        assert not g.thread.is_alive() and len(g.driver.started) == 2
        g.driver._handle_worker_exit(g.pending[1], 1, 0.0)
        assert g.driver.recorded == [("a", 1, 1)]


def test_an_exit_of_a_running_worker_during_the_hold_is_recorded_as_horovod_would() -> None:
    with grown({"a": 2}, {"a": 1}) as g:
        wait_until(lambda: len(g.driver.started) == 1)
        running: Any = SlotInfo("a", 0, 0, 0, 2, 2, 1)
        g.driver._handle_worker_exit(running, 1, 0.0)
        assert g.driver.recorded == [("a", 0, 1)]
        g.hold.put_seen("global", "1")
        g.thread.join(GUARD_S)
        assert not g.thread.is_alive()
