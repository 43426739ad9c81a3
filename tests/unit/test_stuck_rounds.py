"""A Horovod round that a failed worker left unfinished: the driver's rule (pure), and
`RoundWatch` on Horovod's own ElasticDriver and worker registry, with threads standing in
for the worker processes (the whole launch: tests/integration/test_first_meeting.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from horovod.runner.elastic import driver as horovod_elastic_driver
from horovod.runner.elastic.discovery import FixedHosts
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.runtime.engines.hvd_rounds import (
    RoundWatch,
    round_formed,
    round_overdue,
    stuck_round_message,
)

GUARD_S = 30.0
"""How long a test waits for a thread: far longer than any step here takes."""

# ---- the rule ----


@given(
    failed_for=st.one_of(st.none(), st.floats(0, 2000)),
    missing=st.integers(0, 8),
    formed=st.booleans(),
    forming=st.floats(1, 1000),
    formed_limit=st.floats(1, 1000),
)
def test_a_round_is_overdue_once_it_was_quiet_for_its_limit_with_a_worker_missing(
    failed_for: float | None, missing: int, formed: bool, forming: float, formed_limit: float
) -> None:
    now = 5000.0
    since = None if failed_for is None else now - failed_for
    overdue = round_overdue(since, now, missing, formed, forming, formed_limit)
    if failed_for is None or missing == 0:
        # No failure holds it, or every worker recorded: Horovod's barrier decides.
        assert not overdue
    else:
        assert since is not None
        assert overdue == (now - since >= (formed_limit if formed else forming))


@given(
    put=st.frozensets(st.integers(0, 7), max_size=8),
    size=st.integers(0, 8),
    registered=st.booleans(),
)
def test_workers_have_met_once_every_rank_put_its_address_or_one_got_past_init(
    put: frozenset[int], size: int, registered: bool
) -> None:
    formed = round_formed(put, size, registered)
    assert formed == (registered or (size > 0 and all(rank in put for rank in range(size))))


def test_the_message_names_who_failed_who_never_came_and_the_limit() -> None:
    message = stuck_round_message(
        False, ["rank 0 (localhost[0])"], ["rank 2 (host[0])"], 5.2, "glooTimeoutSeconds"
    )
    assert message.startswith("the workers' first meeting failed: rank 0 (localhost[0]) failed")
    assert "rank 2 (host[0]) neither came to the rendezvous nor ended in the 5 s since" in message
    assert "(glooTimeoutSeconds)" in message and "\n" not in message
    later = stuck_round_message(True, [], [], 600, "elasticTimeoutSeconds")
    assert later.startswith("a round after a failure did not end: a worker failed")


# ---- on Horovod's driver ----


class Rendezvous:
    """What Horovod's driver asks of its rendezvous server: no HTTP here."""

    def init(self, host_assignments: Any) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass
class Workers:
    """Stand-ins for worker processes: each runs until told how it ends (`end`) or until
    one of its stop events is set (the driver stopping it: then 143, as SIGTERM)."""

    started: dict[str, threading.Event] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def create(self, slot: Any, events: list[threading.Event]) -> tuple[int, float]:
        name = f"{slot.hostname}[{slot.local_rank}]"
        ended = threading.Event()
        with self.lock:
            self.started[name] = ended
        while not ended.wait(0.01):
            if any(event.is_set() for event in events):
                with self.lock:
                    self.stopped.add(name)
                return 143, time.time()
        return self.codes[name], time.time()

    def end(self, name: str, code: int) -> None:
        self.codes[name] = code
        self.started[name].set()


@dataclass
class Job:
    driver: Any
    workers: Workers
    watch: RoundWatch | None
    results: list[Any]
    """Horovod's results, once `get_results` returned (the driver's main thread)."""
    main: threading.Thread


@contextmanager
def job(
    hosts: Mapping[str, int], watched: bool, forming: float = 0.3, formed: float = 600
) -> Iterator[Job]:
    """Horovod's ElasticDriver starting `hosts`' workers (rank order: as given), under a
    `RoundWatch` when `watched`; its main thread waits for the results as `run_elastic`'s."""
    horovod_elastic_driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.05
    driver = horovod_elastic_driver.ElasticDriver(
        Rendezvous(), FixedHosts(dict(hosts)), sum(hosts.values()), sum(hosts.values())
    )
    watch = RoundWatch(driver, forming, formed, period=0.05) if watched else None
    workers, results = Workers(), []
    if watch is not None:
        watch.start()

    def main() -> None:
        driver.start(sum(hosts.values()), workers.create)
        results.append(driver.get_results())

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(workers.started) == sum(hosts.values()))
        yield Job(driver, workers, watch, results, thread)
    finally:
        if not driver.finished():
            driver.stop()
            barrier = driver._worker_registry._barrier
            if barrier is not None:
                barrier.abort()  # lets the threads a failed test left at the barrier go
        thread.join(GUARD_S)


def wait_until(probe: Callable[[], bool], timeout: float = GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


HOSTS = {"localhost": 1, "127.0.0.1": 1, "host": 1}


def test_without_the_watch_horovod_waits_forever_for_a_worker_that_never_came() -> None:
    # The bug as Horovod has it: ranks 0 and 1 fail their first meeting (Gloo's timeout,
    # status 134), rank 2 was held back before hvd.init() and neither comes nor ends.
    with job(HOSTS, watched=False) as j:
        j.workers.end("localhost[0]", 134)
        j.workers.end("127.0.0.1[0]", 134)
        j.main.join(2.0)
        assert j.main.is_alive() and not j.driver.finished(), "Horovod ended the round"
        assert j.driver._worker_registry._barrier.n_waiting == 2
        # It ends only when the held-back worker ends too ("failure count == 3").
        j.workers.end("host[0]", 134)
        j.main.join(GUARD_S)
        assert not j.main.is_alive() and j.results[0].error_message is None


def test_a_first_meeting_that_a_held_back_worker_missed_fails_the_job_naming_it() -> None:
    with job(HOSTS, watched=True) as j:
        assert j.watch is not None
        rank = {host: infos[0].rank for host, infos in j.driver.host_assignments.items()}
        for host in ("localhost", "127.0.0.1"):  # at the rendezvous, then Gloo's timeout
            j.watch.put_seen("global", f"rank_{rank[host]}")
            j.workers.end(f"{host}[0]", 134)
        j.main.join(GUARD_S)
        assert not j.main.is_alive(), "the driver still waits"
        (results,) = j.results
        assert j.workers.stopped == {"host[0]"}  # stopped with the job
        message = results.error_message
        failed = sorted(f"rank {rank[host]} ({host}[0])" for host in ("localhost", "127.0.0.1"))
        assert message.startswith(
            f"the workers' first meeting failed: {', '.join(failed)} failed, and rank"
            f" {rank['host']} (host[0]) neither came to the rendezvous nor ended in the"
        ), message
        assert "(glooTimeoutSeconds)" in message
        # The failed workers' ends are results (their threads left the broken barrier).
        assert results.worker_results["localhost[0]"][0] == 134


def test_a_worker_that_comes_after_the_first_failure_is_given_its_gloo_timeout() -> None:
    # Killed or crashed before the meeting, one worker fails first; the others are still
    # starting. Each that puts its address later fails on its own within Gloo's timeout
    # (then Horovod ends the round): the quiet counts from the last arrival.
    with job(HOSTS, watched=True, forming=0.5) as j:
        assert j.watch is not None
        rank = {host: infos[0].rank for host, infos in j.driver.host_assignments.items()}
        j.workers.end("host[0]", 137)
        for _ in range(6):  # arrivals 0.2 s apart: never 0.5 s of quiet
            time.sleep(0.2)
            j.watch.put_seen("global", f"rank_{rank['localhost']}")
        assert not j.watch.gave_up.is_set() and j.main.is_alive()
        j.workers.end("localhost[0]", 134)
        j.workers.end("127.0.0.1[0]", 134)
        j.main.join(GUARD_S)
        (results,) = j.results
        assert results.error_message is None and not j.watch.gave_up.is_set()


def test_a_first_meeting_every_worker_failed_is_horovods_to_end() -> None:
    with job(HOSTS, watched=True, forming=0.05) as j:
        assert j.watch is not None
        for name in HOSTS:
            j.workers.end(f"{name}[0]", 134)
        j.main.join(GUARD_S)
        (results,) = j.results
        # "failure count == 3 -> stop running": Horovod's own end, no error of ours.
        assert results.error_message is None and not j.watch.gave_up.is_set()
        assert {code for code, _ in results.worker_results.values()} == {134}


def test_once_the_workers_have_met_a_failure_waits_for_the_others_as_long_as_horovod_does() -> None:
    with job(HOSTS, watched=True, forming=0.05, formed=1.0) as j:
        assert j.watch is not None
        for rank in range(3):
            j.watch.put_seen("global", f"rank_{rank}")  # all met: the job formed
        j.workers.end("localhost[0]", 1)
        j.main.join(0.5)  # ten times the limit before they met
        assert j.main.is_alive() and not j.watch.gave_up.is_set()
        j.main.join(GUARD_S)
        (results,) = j.results
        assert results.error_message.startswith("a round after a failure did not end")
        assert "(elasticTimeoutSeconds)" in results.error_message
