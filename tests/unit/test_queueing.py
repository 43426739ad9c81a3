"""The allocator's queue (`policies/queueing.py`): the order by attained service or work left,
and preemption with its hysteresis and starvation bound, on hand-made cases and as
properties; then through the real `Allocator` and the simulator."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.queueing import QueueConfig, Service, plan, rank, work_left
from herd_operator.runtime.allocator import Allocator
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import JobModel
from herd_operator.simulate.runner import parse_allocator_options
from herd_operator.simulate.workload import perlmutter_mix
from herd_operator.specs import PolicyRef
from herd_operator.specs.values import Demand, Placement, Pool
from tests.unit.sinks import RecordingSink

HOUR = 3600.0
LAS = QueueConfig("las", min_run_seconds=600.0, max_preemptions=2, starvation_seconds=8 * HOUR)


def demand(
    name: str, gpus: int, arrival: float = 0.0, done: float | None = None, resumable: bool = True
) -> Demand:
    return Demand(name, gpus, gpus, gpus, arrival=arrival, done_fraction=done, resumable=resumable)


def running(since: float, attained: float, preemptions: int = 0) -> Service:
    return Service(attained, running_since=since, preemptions=preemptions)


def test_las_puts_a_new_job_before_one_that_ran_long_and_keeps_arrival_within_a_queue() -> None:
    now = 10 * HOUR
    new, long_run, other_long = demand("new", 4, 5.0), demand("old", 4, 1.0), demand("o", 4, 2.0)
    assert rank(new, Service(), LAS, now) < rank(long_run, running(0, 20 * HOUR), LAS, now)
    # Both past 16 GPU-hours: one queue, so arrival (the caller's tie-break) decides.
    assert rank(long_run, running(0, 20 * HOUR), LAS, now) == rank(
        other_long, running(0, 90 * HOUR), LAS, now
    )


def test_srpt_orders_by_estimated_work_left_and_unknown_by_attained() -> None:
    srpt = QueueConfig("srpt")
    nearly_done = demand("a", 4, done=0.9)  # 9 GPU-h attained, 1 left
    barely_started = demand("b", 4, done=0.1)  # 1 GPU-h attained, 9 left
    assert work_left(nearly_done, Service(9 * HOUR)) == pytest.approx(1 * HOUR)
    assert rank(nearly_done, Service(9 * HOUR), srpt, 0) < rank(
        barely_started, Service(1 * HOUR), srpt, 0
    )
    unknown = demand("c", 4)
    assert rank(unknown, Service(0.5 * HOUR), srpt, 0) < rank(
        nearly_done, Service(9 * HOUR), srpt, 0
    )


def test_a_job_waiting_past_the_bound_goes_first_whatever_it_attained() -> None:
    starving = Service(100 * HOUR, waiting_since=0.0)
    assert rank(demand("s", 4), starving, LAS, 8 * HOUR) < rank(
        demand("n", 4), Service(), LAS, 8 * HOUR
    )


def test_a_long_running_job_is_preempted_for_a_new_one() -> None:
    jobs = [demand("old", 8), demand("new", 4, arrival=5.0)]
    services = {"old": running(0, 20 * HOUR), "new": Service(waiting_since=HOUR)}
    result = plan(jobs, {"old": 8}, services, LAS, HOUR, 8)
    assert list(result.preempted) == ["old"]
    assert result.admitted_by == {"new": ["old"]}
    assert result.order["new"] < result.order["old"]


def test_hysteresis_a_job_in_its_minimum_run_or_at_its_preemption_bound_is_kept() -> None:
    jobs = [demand("old", 8), demand("new", 4, arrival=5.0)]
    fresh = {"old": running(HOUR - 60, 20 * HOUR), "new": Service(waiting_since=HOUR)}
    assert plan(jobs, {"old": 8}, fresh, LAS, HOUR, 8).preempted == {}
    worn = {"old": running(0, 20 * HOUR, preemptions=2), "new": Service(waiting_since=HOUR)}
    assert plan(jobs, {"old": 8}, worn, LAS, HOUR, 8).preempted == {}
    assert plan(jobs, {"old": 8}, fresh | {"old": running(0, 20 * HOUR)}, LAS, HOUR, 8,
                frozen={"old"}).preempted == {}  # fmt: skip


def test_nobody_is_preempted_for_a_job_that_would_still_not_fit() -> None:
    # 8 GPUs: `kept` (in its minimum run) holds 4, `old` holds 4; `big` needs all 8.
    jobs = [demand("kept", 4), demand("old", 4), demand("big", 8, arrival=9.0)]
    services = {
        "kept": running(HOUR - 60, 20 * HOUR),
        "old": running(0, 20 * HOUR),
        "big": Service(waiting_since=HOUR),
    }
    assert plan(jobs, {"kept": 4, "old": 4}, services, LAS, HOUR, 8).preempted == {}


def test_no_preemption_when_the_queue_does_not_preempt() -> None:
    jobs = [demand("old", 8), demand("new", 4, arrival=5.0)]
    services = {"old": running(0, 20 * HOUR), "new": Service(waiting_since=HOUR)}
    quiet = QueueConfig("las", preempt=False)
    assert plan(jobs, {"old": 8}, services, quiet, HOUR, 8).preempted == {}


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[Demand], dict[str, int], dict[str, Service], int]:
    pool = draw(st.integers(1, 16))
    count = draw(st.integers(1, 8))
    demands, sizes, services = [], {}, {}
    for i in range(count):
        name = f"j{i}"
        gpus = draw(st.integers(1, pool))
        demands.append(
            Demand(name, gpus, gpus, gpus, priority=draw(st.integers(0, 1)), arrival=float(i),
                   done_fraction=draw(st.none() | st.floats(0.01, 1.0)),
                   resumable=draw(st.booleans()))
        )  # fmt: skip
        attained = draw(st.floats(0, 40 * HOUR))
        if draw(st.booleans()) and gpus <= pool - sum(sizes.values()):
            sizes[name] = gpus
            since = draw(st.floats(0, 2 * HOUR))
            services[name] = Service(attained, running_since=since,
                                     preemptions=draw(st.integers(0, 3)))  # fmt: skip
        else:
            services[name] = Service(attained, waiting_since=draw(st.floats(0, 2 * HOUR)))
    return demands, sizes, services, pool


PROPERTY_NOW = 2 * HOUR
"""When the property tests decide: after every drawn run and wait began (`_cases`)."""


def _property_config(mode: str) -> QueueConfig:
    """The queue the property tests decide with: `_cases` draws runs and waits around its
    10-minute minimum run, 2 preemptions and 1-hour starvation bound."""
    return QueueConfig(mode, min_run_seconds=600.0, max_preemptions=2, starvation_seconds=HOUR)


@settings(max_examples=150, deadline=None)
@given(_cases(), st.sampled_from(["las", "srpt", "fifo"]))
def test_preemption_only_of_eligible_lower_ranked_jobs_and_only_to_make_room(
    case: tuple[list[Demand], dict[str, int], dict[str, Service], int], mode: str
) -> None:
    demands, sizes, services, pool = case
    config, now = _property_config(mode), PROPERTY_NOW
    result = plan(demands, sizes, services, config, now, pool)
    by_name = {d.name: d for d in demands}
    victims = [v for taken in result.admitted_by.values() for v in taken]
    assert sorted(victims) == sorted(result.preempted)  # each preempted for someone
    for winner, taken in result.admitted_by.items():
        assert sizes.get(winner, 0) == 0
        for victim in taken:
            service = services[victim]
            assert by_name[victim].resumable  # a job that would start from zero never is
            assert sizes.get(victim, 0) >= by_name[victim].min
            assert service.preemptions < config.max_preemptions
            assert service.running_since is not None
            assert now - service.running_since >= config.min_run_seconds
            assert result.order[victim][1] > result.order[winner][1]  # ranked after it
    # The jobs left running and the ones preempted for fit at their mins together.
    kept = sum(by_name[j].min for j, size in sizes.items() if j not in result.preempted)
    assert kept + sum(by_name[w].min for w in result.admitted_by) <= pool


@settings(max_examples=150, deadline=None)
@given(_cases(), st.sampled_from(["las", "srpt", "fifo"]))
def test_the_starvation_bound_puts_every_starving_job_before_the_others_of_its_tier(
    case: tuple[list[Demand], dict[str, int], dict[str, Service], int], mode: str
) -> None:
    demands, sizes, services, pool = case
    config, now = _property_config(mode), PROPERTY_NOW
    result = plan(demands, sizes, services, config, now, pool)

    def starving(d: Demand) -> bool:
        since = services[d.name].waiting_since
        return since is not None and now - since >= config.starvation_seconds

    keys = {d.name: rank(d, services[d.name], config, now) for d in demands}
    for first in filter(starving, demands):
        assert first.name not in result.preempted
        for other in demands:
            if other.priority == first.priority and not starving(other):
                assert keys[first.name] < keys[other.name]
                # Within the part that should run, and within the rest, the order keeps it.
                if result.order[first.name][0] == result.order[other.name][0]:
                    assert result.order[first.name] < result.order[other.name]
    # Nothing starves once admitted: the oldest starving job of the highest tier, if its
    # min fits the pool with the starving jobs before it, is in the part that should run.
    top = max((d.priority for d in demands), default=0)
    hungry = sorted((d for d in demands if d.priority == top and starving(d)),
                    key=lambda d: (keys[d.name], d.arrival, d.name))  # fmt: skip
    budget = pool
    for d in hungry:
        if d.min > budget:
            break
        budget -= d.min
        assert result.order[d.name][0] == 0.0


def test_a_job_that_does_not_resume_is_ordered_but_never_preempted() -> None:
    jobs = [demand("old", 8, resumable=False), demand("new", 4, arrival=5.0)]
    services = {"old": running(0, 20 * HOUR), "new": Service(waiting_since=HOUR)}
    result = plan(jobs, {"old": 8}, services, LAS, HOUR, 8)
    assert result.preempted == {}
    assert result.order["new"] < result.order["old"]  # ordered by the queue all the same
    resumable = [demand("old", 8), demand("new", 4, arrival=5.0)]
    assert list(plan(resumable, {"old": 8}, services, LAS, HOUR, 8).preempted) == ["old"]


def test_the_allocator_preempts_drains_then_readmits_with_the_queue_and_says_why() -> None:
    clock = [0.0]
    pool = Pool.from_counts({"n0": 4})
    allocator = Allocator(pool, RecordingSink(), virtual=True, clock=lambda: clock[0], queue=LAS)
    assert allocator.request(demand("old", 4)).placement.size == 4
    clock[0] = 5 * HOUR  # 20 GPU-hours attained: past both LAS thresholds
    grant = allocator.request(demand("new", 2, arrival=clock[0]))
    old = allocator.grant("old")
    assert old is not None and old.placement == Placement.EMPTY
    assert old.reason.startswith("preempted for new")
    # Its GPUs drain as any given back: nobody gets them while its workers may be on them.
    assert grant is not None and grant.placement.size == 0
    assert "old gave back to drain" in grant.reason
    assert set(allocator.draining()) == {("n0", gpu) for gpu in range(4)}
    allocator.observe_world_size("old", 0)  # its workers stopped
    admitted = allocator.grant("new")
    assert admitted is not None and admitted.placement.size == 2
    allocator.release("new")
    readmitted = allocator.grant("old")
    assert readmitted is not None and readmitted.placement.size == 4


def test_without_a_queue_the_allocator_never_preempts() -> None:
    clock = [0.0]
    allocator = Allocator(
        Pool.from_counts({"n0": 4}), RecordingSink(), virtual=True, clock=lambda: clock[0]
    )
    allocator.request(demand("old", 4))
    clock[0] = 5 * HOUR
    assert allocator.request(demand("new", 2, arrival=clock[0])).placement.size == 0


def _stream(count: int, resumable: bool = True) -> list[JobModel]:
    """A long job first, then a stream of short ones (each 20 min on the whole pool) arriving
    every 15 min: under LAS the long one loses to every newcomer."""

    def job(name: str, arrival: float, work: float, resumable: bool = True) -> JobModel:
        return JobModel(name, arrival, 2, 2, 2, work, 4, 0.0, 0.1, 0.1, start_seconds=0.0,
                        resumable=resumable)  # fmt: skip

    jobs = [job("long", 0.0, 2 * 4 * HOUR, resumable)]
    jobs += [job(f"short{i}", HOUR + 900.0 * i, 2 * 1200.0) for i in range(count)]
    return jobs


def _long_job_finished(starvation: float) -> tuple[float, float]:
    """When the long job of `_stream` finished, and when the last job did; it was preempted
    at least once and at most as often as the bound allows."""
    config = SimConfig(
        Pool.from_counts({"n0": 2}), PolicyRef(name="static"), min_resize_interval=0.0,
        drain_seconds=0.0,
        queue=QueueConfig("las", (HOUR,), min_run_seconds=0.0, max_preemptions=2,
                          starvation_seconds=starvation),
    )  # fmt: skip
    result = Simulation(_stream(32), config).run()
    by_name = {job.name: job for job in result.jobs}
    assert 1 <= by_name["long"].preemptions <= 2
    return by_name["long"].finished, max(job.finished for job in result.jobs)


def test_the_starvation_bound_gets_a_preempted_job_back_before_the_stream_ends() -> None:
    starved, last = _long_job_finished(starvation=1000 * HOUR)
    assert starved == last  # without a bound the long job waits out the whole stream
    bounded, last = _long_job_finished(starvation=HOUR)
    assert bounded < last - HOUR


def test_a_simulated_job_that_does_not_resume_runs_through_the_stream() -> None:
    config = SimConfig(
        Pool.from_counts({"n0": 2}), PolicyRef(name="static"), min_resize_interval=0.0,
        drain_seconds=0.0, queue=QueueConfig("las", (HOUR,), min_run_seconds=0.0),
    )  # fmt: skip
    result = Simulation(_stream(8, resumable=False), config).run()
    long_job = next(job for job in result.jobs if job.name == "long")
    assert long_job.preemptions == 0
    assert long_job.finished == pytest.approx(4 * HOUR)  # its run, alone, from its arrival
    # The generated mix's jobs (and the traces', by the same default) resume from an epoch.
    assert all(job.resumable for job in perlmutter_mix(50, 16, 1))


def test_simulate_names_the_queue_as_a_policy_option_or_takes_the_default() -> None:
    policy, flags, queue = parse_allocator_options("static+small+srpt")
    assert (policy, flags, queue) == ("static", {"smallest_first": True}, QueueConfig("srpt"))
    assert parse_allocator_options("static", "las")[2] == QueueConfig("las")
    assert parse_allocator_options("static+fifo", "las")[2] is None
    with pytest.raises(ValueError, match="more than one queue"):
        parse_allocator_options("static+las+srpt")
