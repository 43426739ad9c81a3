"""The simulator: its event loop, job model and workloads, the goodput policy, and that it
decides what the real allocator decides."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace
from pathlib import Path

import pytest

from herd_operator.policies.base import JobObservations
from herd_operator.policies.goodput import (
    GoodputParams,
    GoodputPolicy,
    fit_serial,
    knee,
    rates_by_size,
    speedup,
)
from herd_operator.policies.power_mean import GROW_STALL_SECONDS
from herd_operator.runtime.allocator import Allocator
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import (
    SHRINK_STALL_SECONDS,
    START_SECONDS,
    JobModel,
    feasible_min,
    resize_stall,
)
from herd_operator.simulate.report import summarize, write
from herd_operator.simulate.results import SimResult
from herd_operator.simulate.runner import Workload, parse_pool, simulate
from herd_operator.simulate.workload import MixParams, load_trace, perlmutter_mix, rigid
from herd_operator.specs import HerdJob, PolicyRef
from herd_operator.specs.values import Pool, Report
from tests.unit.sinks import RecordingSink


def job(name: str = "a", **changes: object) -> JobModel:
    fields: dict[str, object] = {
        "name": name, "arrival": 0.0, "requested": 4, "min_gpus": 1, "max_gpus": 4,
        "work": 4000.0, "epochs": 4, "serial_fraction": 0.1, "mem_fixed": 0.1, "mem_batch": 0.4,
    }  # fmt: skip
    fields.update(changes)
    return JobModel(**fields)  # type: ignore[arg-type]


def run(
    jobs: list[JobModel], pool: str = "2x4", policy: str = "static", **config: object
) -> SimResult:
    return Simulation(jobs, SimConfig(parse_pool(pool), PolicyRef(name=policy), **config)).run()  # type: ignore[arg-type]


# ---- the job model ----


def test_speedup_is_amdahl_and_work_counts_in_single_gpu_seconds() -> None:
    model = job(serial_fraction=0.2)
    assert model.speedup(1) == 1.0
    gains = [model.speedup(n + 1) - model.speedup(n) for n in range(1, 8)]
    assert all(gain > 0 for gain in gains) and gains == sorted(gains, reverse=True)
    assert model.run_seconds(1) == model.work
    assert job(serial_fraction=0.0).run_seconds(4) == pytest.approx(model.work / 4)


def test_memory_per_gpu_rises_as_the_job_shrinks_and_sets_its_feasible_min() -> None:
    model = job(mem_fixed=0.2, mem_batch=1.5)
    assert [model.memory_fraction(n) for n in (4, 2)] == [0.2 + 1.5 / 4, 0.2 + 1.5 / 2]
    assert model.memory_fraction(1) == 1.0  # capped: it would not fit
    low = feasible_min(0.2, 1.5)
    assert model.memory_fraction(low) <= 0.95 < model.memory_fraction(low - 1)


def test_resize_stalls_come_from_the_measured_resizes() -> None:
    assert resize_stall(0, 4) == START_SECONDS
    assert resize_stall(2, 4) == GROW_STALL_SECONDS
    assert resize_stall(4, 2) == SHRINK_STALL_SECONDS
    assert resize_stall(4, 4) == resize_stall(4, 0) == 0.0


# ---- the event loop ----


def test_a_lone_job_starts_at_once_and_runs_its_work_at_its_size() -> None:
    model = job(arrival=5.0)
    result = run([model])
    (outcome,) = result.jobs
    assert outcome.admitted == 5.0
    expected = START_SECONDS + model.work / model.speedup(model.max_gpus)
    assert outcome.finished - outcome.admitted == pytest.approx(expected)
    assert outcome.gpu_seconds == pytest.approx(expected * model.max_gpus)
    assert outcome.resizes == 0


def test_a_gang_waits_for_its_whole_min_and_starts_when_gpus_come_back() -> None:
    first = job("first", min_gpus=4, max_gpus=4)
    second = job("second", arrival=1.0, min_gpus=4, max_gpus=4)
    result = run([first, second], pool="1x4")
    by_name = {outcome.name: outcome for outcome in result.jobs}
    assert by_name["second"].admitted == pytest.approx(by_name["first"].finished)
    assert by_name["second"].queueing > 0


def test_time_never_goes_back_and_every_job_keeps_its_order_of_life() -> None:
    jobs = perlmutter_mix(60, 16, seed=3)
    result = run(jobs, pool="4x4", policy="memory", tick=0.0)
    times = [at for at, _, _ in result.timeline]
    assert times == sorted(times)
    assert not result.unfinished and len(result.jobs) == 60
    for outcome in result.jobs:
        assert outcome.arrival <= outcome.admitted < outcome.finished <= times[-1]


def test_an_event_in_the_past_is_refused() -> None:
    simulation = Simulation([job()], SimConfig(parse_pool("1x4"), PolicyRef(name="static")))
    simulation.now = 10.0
    with pytest.raises(RuntimeError, match="before now"):
        simulation._push(9.0, simulation_kind_arrival(), "a")


def simulation_kind_arrival():  # type: ignore[no-untyped-def]
    from herd_operator.simulate.engine import Kind

    return Kind.ARRIVAL


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    def outcomes(seed: int) -> list[object]:
        return run(perlmutter_mix(40, 16, seed=seed), pool="4x4", policy="goodput").jobs

    assert outcomes(7) == outcomes(7)
    assert outcomes(7) != outcomes(8)


def test_a_tick_delays_decisions_to_its_multiples() -> None:
    result = run([job(arrival=5.0)], tick=60.0)
    assert result.jobs[0].admitted == 60.0
    assert all(at % 60.0 == 0 for at, _, _ in result.timeline)


@pytest.mark.timeout(20)
def test_an_event_just_past_a_tick_waits_for_the_next_one() -> None:
    # Rounding the division down once made such an event due at a tick before its own time:
    # no event was ever due, and the loop spun at that instant for ever.
    result = run([job(arrival=60.00000001)], tick=60.0)
    assert result.jobs[0].admitted == 120.0


# ---- policies in the simulator ----


def test_the_memory_policy_shrinks_a_job_that_uses_little_memory() -> None:
    model = job(mem_fixed=0.02, mem_batch=0.2, epochs=20, work=40_000.0)
    static = run([model], policy="static").jobs[0]
    memory = run([model], policy="memory").jobs[0]
    assert static.resizes == 0
    assert memory.resizes >= 1
    assert memory.gpu_seconds < static.gpu_seconds


def test_the_goodput_policy_runs_a_badly_scaling_job_on_fewer_gpus() -> None:
    model = job(serial_fraction=0.5, requested=8, max_gpus=8, epochs=20, work=40_000.0)
    static = run([model], policy="static").jobs[0]
    goodput = run([model], policy="goodput").jobs[0]
    assert goodput.gpu_seconds < static.gpu_seconds / 2


# ---- the same decisions as the real allocator ----


@pytest.mark.parametrize("policy", ["static", "memory", "goodput"])
def test_the_real_allocator_given_the_same_calls_decides_the_same(policy: str) -> None:
    pool = parse_pool("3x4")
    jobs = perlmutter_mix(40, pool.size, seed=5)
    result = Simulation(jobs, SimConfig(pool, PolicyRef(name=policy), record=True)).run()
    assert result.steps
    clock = [0.0]
    allocator = Allocator(
        pool, RecordingSink(), virtual=True, min_resize_interval=30.0, drain_seconds=30.0,
        clock=lambda: clock[0],
    )  # fmt: skip
    moved = 0
    for at, calls, placements in result.steps:
        clock[0] = at
        before = allocator.placements()
        with allocator.batch():  # as the operator's loop runs a burst of reconciles
            for call in calls:
                if call[0] == "request":
                    allocator.request(call[1])  # type: ignore[arg-type]
                elif call[0] == "release":
                    allocator.release(call[1])  # type: ignore[arg-type]
                else:
                    allocator.observe_world_size(call[1], call[2])  # type: ignore[arg-type, misc]
        assert allocator.placements() == placements, f"at {at}"
        moved += allocator.placements() != before
    assert moved > len(jobs)  # admissions, resizes and releases were all compared


# ---- a small simulation as CI runs it ----


def test_a_small_simulation_writes_its_outputs_and_they_add_up(tmp_path: Path) -> None:
    pool = parse_pool("8x4")
    workload = Workload("test mix", perlmutter_mix(200, pool.size, seed=2))
    results = simulate(workload, pool, ["fcfs", "static", "memory", "goodput"], tick=0.0)
    paths = write(results, tmp_path, "test")
    for name in ["summary.md", "summary.json", "utilization.png", "jct-cdf.png", "jobs-fcfs.csv"]:
        assert (tmp_path / name) in paths and (tmp_path / name).stat().st_size > 0
    report = json.loads((tmp_path / "summary.json").read_text())
    assert [row["policy"] for row in report["policies"]] == ["fcfs", "static", "memory", "goodput"]
    for result in results:
        summary = summarize(result)
        assert summary.jobs == 200 and not result.unfinished
        assert all(0 <= allocated <= pool.size for _, allocated, _ in result.timeline)
        # The timeline's integral is the jobs' GPU-seconds, and never more than the pool.
        integral = sum(
            allocated * (later - at)
            for (at, allocated, _), (later, _, _) in itertools.pairwise(result.timeline)
        )
        assert integral == pytest.approx(summary.gpu_seconds, rel=1e-6)
        assert summary.gpu_seconds <= pool.size * summary.makespan
        assert 0 < summary.allocation <= 1 and 0 < summary.memory <= summary.allocation
    fcfs = results[0]
    assert all(job.resizes == 0 for job in fcfs.jobs)


# ---- workloads ----


def test_the_mix_is_seeded_and_half_its_jobs_use_a_quarter_of_memory_or_less() -> None:
    jobs = perlmutter_mix(2000, 7168, seed=1)
    assert jobs == perlmutter_mix(2000, 7168, seed=1)
    low = sum(job.memory_fraction(job.requested) <= 0.25 for job in jobs) / len(jobs)
    assert 0.45 < low < 0.55
    arrivals = [job.arrival for job in jobs]
    assert arrivals == sorted(arrivals)
    assert all(job.min_gpus <= job.max_gpus == job.requested for job in jobs)
    assert all(job.memory_fraction(job.min_gpus) <= 0.95 for job in jobs)
    # The offered load sets the arrival rate: asked GPU-seconds per second over the pool.
    asked = sum(job.requested * job.run_seconds(job.requested) for job in jobs)
    assert asked / arrivals[-1] / 7168 == pytest.approx(MixParams().load, rel=0.15)


def test_rigid_jobs_ask_for_exactly_their_size() -> None:
    assert all(j.min_gpus == j.max_gpus == j.requested for j in rigid(perlmutter_mix(50, 64, 1)))


def test_a_pollux_format_trace_loads_and_a_bad_row_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "workload.csv"
    trace.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "cifar10-0,107,cifar10,6,2048\n"
        "ncf-1,135,ncf,1,32768\n"
        "imagenet-2,90,imagenet,128,6400\n"
    )
    jobs = load_trace(trace, pool_gpus=64)
    assert [j.name for j in jobs] == ["imagenet-2", "cifar10-0", "ncf-1"]
    assert [j.requested for j in jobs] == [64, 6, 1]  # cut to the pool
    trace.write_text("name,time,application,num_replicas\nx,1,resnet,2\n")
    with pytest.raises(ValueError, match=r"workload.csv:2: unknown application 'resnet'"):
        load_trace(trace, pool_gpus=64)


def test_a_job_that_cannot_fit_the_pool_is_refused() -> None:
    with pytest.raises(ValueError, match="min above the pool"):
        Simulation(
            [job(min_gpus=8, max_gpus=8)], SimConfig(Pool.from_counts({"h": 4}), PolicyRef())
        )


# ---- the goodput policy ----


def spec(low: int, high: int) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "j"},
            "spec": {
                "command": ["x"],
                "gpus": {"min": low, "max": high},
                "policy": {"name": "goodput"},
            },
        }
    )


@pytest.mark.parametrize("serial", [0.0, 0.01, 0.05, 0.2, 0.6])
@pytest.mark.parametrize("gain", [0.3, 0.5, 0.9])
def test_the_knee_is_the_last_gpu_that_adds_enough(serial: float, gain: float) -> None:
    size = knee(serial, gain, 1, 64)
    if size > 1:
        assert speedup(serial, size) - speedup(serial, size - 1) >= gain
    if size < 64:
        assert speedup(serial, size + 1) - speedup(serial, size) < gain


def epochs_at(serial: float, sizes: list[int], per_size: int = 3) -> list[Report]:
    reports, clock, epoch = [], 0.0, 0
    for size in sizes:
        for _ in range(per_size):
            clock += 100.0 / speedup(serial, size)
            reports.append(Report(epoch, clock, size))
            epoch += 1
    return reports


def test_the_serial_share_is_fitted_from_epochs_at_two_sizes() -> None:
    reports = epochs_at(0.12, [2, 6])
    rates = rates_by_size(reports, "throughput")
    assert sorted(rates) == [2, 6]
    assert fit_serial(rates) == pytest.approx(0.12)
    assert fit_serial(rates_by_size(epochs_at(0.12, [4]), "throughput")) is None


def test_a_reported_throughput_metric_counts_as_the_rate() -> None:
    reports = [Report(0, 10.0, 1, {"throughput": 100.0}), Report(1, 20.0, 4, {"throughput": 250.0})]
    # 1 / 250 = a / 4 + b and 1 / 100 = a + b: b / (a + b) = 0.2
    assert fit_serial(rates_by_size(reports, "throughput")) == pytest.approx(0.2)


def test_the_goodput_policy_starts_from_its_prior_then_follows_the_fit() -> None:
    policy = GoodputPolicy(GoodputParams(min_gain=0.5, prior_serial=0.05))
    pending = policy.desired(spec(1, 32), JobObservations(started_at=0.0, allocated=0), 0.0)
    assert pending.gpus == knee(0.05, 0.5, 1, 32)
    assert pending.reason.startswith("goodput: prior serial share 0.05")
    observed = JobObservations(started_at=0.0, allocated=6, epochs=epochs_at(0.3, [8, 6]))
    fitted = policy.desired(spec(1, 32), observed, 1000.0)
    assert fitted.gpus == knee(0.3, 0.5, 1, 32) < pending.gpus
    assert "fitted on sizes 6, 8" in fitted.reason
    assert policy.desired(spec(4, 32), observed, 1000.0).gpus == 4  # never below min


def test_the_goodput_policy_reports_what_each_gpu_above_its_min_adds() -> None:
    policy = GoodputPolicy(GoodputParams(min_gain=0.5, prior_serial=0.05))
    decision = policy.desired(spec(1, 32), JobObservations(started_at=0.0, allocated=0), 0.0)
    gains = decision.gains  # from the min (1) to the max (32)
    assert len(gains) == 32 - 1
    knee_at = decision.gpus
    assert gains[knee_at - 1] == pytest.approx(speedup(0.05, knee_at + 1) - speedup(0.05, knee_at))
    assert all(0 < later < earlier for earlier, later in itertools.pairwise(gains))
    assert gains[knee_at - 2] >= 0.5 > gains[knee_at - 1]  # the knee: the last GPU adding 0.5


def test_spare_gpus_lent_by_gain_run_a_lone_goodput_job_past_its_knee() -> None:
    # Alone on 8 GPUs, the job's knee leaves GPUs idle; lent by gain, it uses them.
    model = job(serial_fraction=0.2, requested=8, max_gpus=8, epochs=20, work=40_000.0)
    alone = run([model], policy="goodput").jobs[0]
    lent = run([model], policy="goodput", spare_by_gain=True).jobs[0]
    assert lent.completion < alone.completion
    assert lent.gpu_seconds / (lent.completion - lent.admitted) > (
        alone.gpu_seconds / (alone.completion - alone.admitted)
    )


@pytest.mark.parametrize("option", ["spare_by_gain", "share_by_gain", "share_by_speedup"])
def test_the_real_allocator_dividing_by_gain_decides_as_the_simulation(option: str) -> None:
    pool = parse_pool("3x4")
    # A mix where spare GPUs are lent often (246 decisions; seed 5 lent none once GPUs being
    # given back count for the jobs waiting for them).
    jobs = perlmutter_mix(40, pool.size, seed=6)
    config = SimConfig(pool, PolicyRef(name="goodput"), record=True, **{option: True})
    result = Simulation(jobs, config).run()
    clock = [0.0]
    allocator = Allocator(
        pool, RecordingSink(), virtual=True, min_resize_interval=30.0, drain_seconds=30.0,
        clock=lambda: clock[0], **{option: True},
    )  # fmt: skip
    lent = 0
    wanted: dict[str, int] = {}
    for at, calls, placements in result.steps:
        clock[0] = at
        with allocator.batch():
            for call in calls:
                if call[0] == "request":
                    wanted[call[1].name] = call[1].wanted  # type: ignore[union-attr]
                    allocator.request(call[1])  # type: ignore[arg-type]
                elif call[0] == "release":
                    allocator.release(call[1])  # type: ignore[arg-type]
                else:
                    allocator.observe_world_size(call[1], call[2])  # type: ignore[arg-type, misc]
        assert allocator.placements() == placements, f"at {at}"
        lent += sum(placement.size > wanted[job] for job, placement in placements.items())
    assert lent > 0  # GPUs past a wish were given by gain at some point


# ---- replaying a recorded run ----


def recorded_store(path: Path, *, b_epoch_seconds: float = 8.0) -> Path:
    """A store as the operator would leave it: a (1..2 GPUs) runs 10 epochs of 10 s on 2 GPUs
    from t=100; b (1 GPU) arrives at t=120 and runs 5 epochs on the third GPU; each launch
    takes 12 s to its first progress and 3 s to exit after its last epoch."""
    from herd_operator.runtime.store import Store
    from herd_operator.specs.status import HerdJobStatus

    store = Store(path)
    store.record_pool_size(3, 100.0)
    jobs = {"a": (100.0, 1, 2, 2, 10, 10.0), "b": (120.0, 1, 1, 1, 5, b_epoch_seconds)}
    for name, (arrival, low, high, size, epochs, seconds) in jobs.items():
        spec = HerdJob.model_validate(
            {
                "apiVersion": "herd/v1alpha1",
                "kind": "HerdJob",
                "metadata": {"name": name},
                "spec": {"command": ["train"], "gpus": {"min": low, "max": high}},
            }
        )
        store.record_spec(name, f"/specs/{name}.yaml", spec, f"fp-{name}", arrival)
        store.add_grant_change(name, size, "admitted", arrival)
        for epoch in range(epochs):
            for rank in range(size):
                store.add_report(
                    name, epoch, size, rank, {}, arrival + 12.0 + seconds * (epoch + 1)
                )
        finished = arrival + 12.0 + seconds * epochs + 3.0
        store.add_grant_change(name, 0, "released", finished)
        store.put_status(name, HerdJobStatus(finished_at=finished), finished)
    store.close()
    return path


def test_a_recorded_run_is_read_back_and_its_jobs_modelled(tmp_path: Path) -> None:
    from herd_operator.simulate.replay import job_model, read_store

    run = read_store(recorded_store(tmp_path / "state.db"))
    assert run.pool_gpus == 3
    a, b = run.jobs
    assert (a.name, a.arrival, b.arrival) == ("a", 0.0, 20.0)
    assert [report.epoch for report in a.epochs] == list(range(10))  # one report per epoch
    assert a.grants == ((0.0, 2), (115.0, 0))
    model = job_model(a)
    # One size only: the prior serial share; 10 s per epoch on 2 GPUs.
    assert model.epochs == 10
    assert model.work / model.epochs / model.speedup(2) == pytest.approx(10.0)
    assert model.start_seconds == pytest.approx(12.0)
    assert job_model(a, measured_start=False).start_seconds is None


def test_a_replay_of_a_run_the_model_fits_matches_it(tmp_path: Path) -> None:
    from herd_operator.simulate.replay import read_store, replay

    run = read_store(recorded_store(tmp_path / "state.db"))
    comparisons = replay(run, min_resize_interval=30.0)
    for comparison in comparisons:
        assert comparison.end_error == pytest.approx(0.0, abs=1e-9), comparison
        assert comparison.size_agreement == pytest.approx(1.0)
        assert comparison.teardown == pytest.approx(3.0)
    a = comparisons[0]
    assert (a.real_end, a.real_grants, a.simulated_grants) == (112.0, ((0.0, 2),), ((0.0, 2),))
    # The simulator's own launch time instead of the recorded 12 s: off by the difference.
    constant = replay(run, min_resize_interval=30.0, measured_start=False)
    assert constant[0].simulated_end == pytest.approx(112.0 - 12.0 + START_SECONDS)


def test_a_replay_says_which_jobs_ran_slower_than_their_model(tmp_path: Path) -> None:

    from herd_operator.simulate.replay import read_store, replay

    run = read_store(recorded_store(tmp_path / "state.db"))
    a, b = run.jobs
    # b's third epoch took 28 s instead of 8 (a hiccup the model does not have): its recent
    # epochs still say 8 s each, so the simulation ends 20 s before the real run did.
    ends = [12.0 + 8.0, 12.0 + 16.0, 12.0 + 44.0, 12.0 + 52.0, 12.0 + 60.0]
    slow = replace(b, epochs=tuple(Report(e, b.arrival + end, 1) for e, end in enumerate(ends)))
    compared = replay(replace(run, jobs=(a, slow)), min_resize_interval=30.0)[1]
    assert (compared.real_end, compared.simulated_end) == (72.0, 52.0)
    assert compared.end_error == pytest.approx(-20.0 / 72.0)


def test_a_replay_refuses_an_unfinished_job_and_mixed_policies(tmp_path: Path) -> None:

    from herd_operator.simulate.replay import read_store, replay

    run = read_store(recorded_store(tmp_path / "state.db"))
    a, b = run.jobs
    with pytest.raises(ValueError, match="jobs not finished in the recorded run: b"):
        replay(replace(run, jobs=(a, replace(b, finished=None))), min_resize_interval=30.0)
    other = replace(b, policy=PolicyRef(name="memory"))
    with pytest.raises(
        ValueError, match="one policy for all jobs; this run has a: static, b: memory"
    ):
        replay(replace(run, jobs=(a, other)), min_resize_interval=30.0)


def test_a_periodic_resync_asks_every_running_job_again_and_ends_with_the_run() -> None:
    models = [job("a"), job("b", arrival=50.0, requested=2, max_gpus=2)]
    plain = run(models)
    resynced = run(models, resync=5.0)
    # `static` does not depend on time: the same run, with a reconcile per job every 5 s.
    assert [j.finished for j in resynced.jobs] == [j.finished for j in plain.jobs]
    span = max(j.finished for j in plain.jobs)
    assert resynced.policy_calls >= plain.policy_calls + span / 5.0
    assert resynced.policy_calls <= plain.policy_calls + 2 * (span / 5.0 + 2)


def test_the_stalls_of_a_recorded_launch_grow_and_shrink_are_measured_from_its_epochs() -> None:
    """Epochs of 10 s on 2 GPUs, 5 s on 4 (no serial share): launched at 0 and first epoch end
    at 22 (a 12 s start); grown at 45, 30% into an epoch, resumed at 53 (8 s), so the epoch
    ends at 53 + 0.7 x 5; shrunk at 73, 30% in, resumed at 74 (1 s), ends at 74 + 0.7 x 10.
    An epoch end at the old size after the grant change (the workers had not seen it yet)
    only moves where the stall is counted from."""
    from herd_operator.simulate.replay import RecordedJob, measured_stalls

    ends = [(22.0, 2), (32.0, 2), (42.0, 2), (56.5, 4), (61.5, 4), (66.5, 4), (71.5, 4)]
    ends += [(81.0, 2), (91.0, 2)]
    recorded = RecordedJob(
        name="a", arrival=0.0, finished=95.0, min_gpus=2, max_gpus=4, priority=0,
        policy=PolicyRef(name="static"),
        epochs=tuple(Report(epoch, when, size) for epoch, (when, size) in enumerate(ends)),
        grants=((0.0, 2), (45.0, 4), (73.0, 2), (95.0, 0)),
    )  # fmt: skip
    stalls = measured_stalls(recorded)
    assert [(s.kind, s.old, s.new) for s in stalls] == [
        ("start", 0, 2), ("grow", 2, 4), ("shrink", 4, 2)
    ]  # fmt: skip
    assert [s.seconds for s in stalls] == pytest.approx([12.0, 8.0, 1.0])
    # The shrink's grant came at 70 instead, the workers ended an epoch at 4 at 71.5 after
    # it, and the first at 2 at 83: the stall counts from 71.5, where that epoch began.
    shifted = [Report(r.epoch, r.time + 2.0 if r.time > 80 else r.time, r.world_size)
               for r in recorded.epochs]  # fmt: skip
    late = replace(recorded, epochs=tuple(shifted), grants=((0.0, 2), (45.0, 4), (70.0, 2)))
    assert measured_stalls(late)[2].seconds == pytest.approx(83.0 - 71.5 - 10.0)


def test_policy_plus_small_runs_under_an_allocator_that_admits_the_smallest_first() -> None:
    """On 4 GPUs, r holds 3 (rigid); big (min 2) then small (min 1) arrive: in arrival order
    small waits behind big until r ends; with +small it runs on the free GPU at once."""
    models = [
        job("r", requested=3, min_gpus=3, max_gpus=3, work=30000.0),
        job("big", arrival=10.0, requested=2, min_gpus=2, max_gpus=2),
        job("small", arrival=20.0, requested=1, min_gpus=1, max_gpus=1, work=1000.0),
    ]
    workload = Workload("three jobs", models)
    plain, small = simulate(workload, parse_pool("1x4"), ["static", "static+small"], tick=0.0)
    admitted = {p.policy: {j.name: j.admitted for j in p.jobs} for p in (plain, small)}
    r_end = next(j.finished for j in plain.jobs if j.name == "r")
    assert admitted["static"]["small"] >= r_end
    assert admitted["static+small"]["small"] == 20.0
    with pytest.raises(
        ValueError,
        match=r"unknown allocator option \+fast \(\+spare, \+share, \+speedup, \+small, \+pack\)",
    ):
        simulate(workload, parse_pool("1x4"), ["static+fast"], tick=0.0)
    with pytest.raises(ValueError, match=r"already lend spare GPUs; drop \+spare"):
        simulate(workload, parse_pool("1x4"), ["goodput+share+spare"], tick=0.0)
    with pytest.raises(ValueError, match=r"already lend spare GPUs; drop \+spare"):
        simulate(workload, parse_pool("1x4"), ["goodput+speedup+spare"], tick=0.0)
    with pytest.raises(ValueError, match=r"\+share and \+speedup are two divisions; keep one"):
        simulate(workload, parse_pool("1x4"), ["goodput+share+speedup"], tick=0.0)


def test_goodput_plus_share_divides_the_gpus_by_gain_in_a_short_simulation() -> None:
    """Two goodput jobs that both want more than half of 8 GPUs: by default they share them
    evenly while both run; with +share the one that scales well (serial share 0.01) holds
    more GPUs than the one that scales badly (0.3), and finishes sooner than by default.
    (Its mean JCT is not lower here: the bad one has less work, and finishing it first would
    be worth more; the summed speedup that +share maximises does not see the work left.)"""
    models = [
        job("good", requested=8, min_gpus=1, max_gpus=8, serial_fraction=0.01, work=80_000.0,
            epochs=40),
        job("bad", arrival=1.0, requested=8, min_gpus=1, max_gpus=8, serial_fraction=0.3,
            work=20_000.0, epochs=40),
    ]  # fmt: skip
    workload = Workload("two jobs", models)
    plain, shared = simulate(
        workload, parse_pool("2x4"), ["goodput:minGain=0.1", "goodput:minGain=0.1+share"], 0.0
    )
    held = {j.name: j.gpu_seconds / (j.finished - j.admitted) for j in shared.jobs}
    assert held["good"] > held["bad"] + 1  # GPUs held on average while running
    end = {p.policy: {j.name: j.finished for j in p.jobs} for p in (plain, shared)}
    assert end["goodput:minGain=0.1+share"]["good"] < end["goodput:minGain=0.1"]["good"]


def test_share_decides_as_the_default_for_policies_that_report_no_gains() -> None:
    """`static` and `memory` report no gains: each GPU up to the wish counts as a whole one,
    so the division by gain is the fair share, tie for tie, and the runs are the same."""
    pool = parse_pool("4x4")
    workload = Workload(
        "test mix", perlmutter_mix(60, pool.size, seed=4, params=MixParams(load=2.0))
    )
    results = simulate(workload, pool, ["static", "static+share", "memory", "memory+share"], 0.0)
    static, static_share, memory, memory_share = results
    assert static.jobs == static_share.jobs and memory.jobs == memory_share.jobs
    assert any(job.resizes for job in static.jobs)  # the fair share did resize jobs
