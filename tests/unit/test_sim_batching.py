"""Adaptive batch in the simulator: the efficiency and step-time model on hand-made cases,
its derivation from trace files, and that a job kept at its trace's batch runs as before."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from herd_operator.simulate.batching import (
    POLLUX_BATCHING,
    BatchModel,
    batch_model,
    derive_batching,
)
from herd_operator.simulate.calibration import POLLUX_CALIBRATIONS
from herd_operator.simulate.engine import SimConfig, SimResult, Simulation
from herd_operator.simulate.model import JobModel
from herd_operator.simulate.runner import Workload, parse_allocator_options, parse_pool
from herd_operator.simulate.runner import simulate as runner_simulate
from herd_operator.simulate.workload import batch_widened
from herd_operator.specs import PolicyRef
from herd_operator.specs.values import ADAPTIVE_METRICS, BASE_BATCH_METRIC


def profile(**changes: object) -> BatchModel:
    fields: dict[str, object] = {
        "trace_batch": 100, "max_batch": 800, "iteration_seconds": 1.0,
        "serial_fraction": 0.5, "per_sample_seconds": 0.005, "noise": (300.0,),
    }  # fmt: skip
    fields.update(changes)
    return BatchModel(**fields)  # type: ignore[arg-type]


def job(batching: BatchModel | None, **changes: object) -> JobModel:
    fields: dict[str, object] = {
        "name": "a", "arrival": 0.0, "requested": 4, "min_gpus": 1, "max_gpus": 4,
        "work": 4000.0, "epochs": 4, "serial_fraction": 0.5, "mem_fixed": 0.1,
        "mem_batch": 0.4, "batching": batching,
    }  # fmt: skip
    fields.update(changes)
    return JobModel(**fields)  # type: ignore[arg-type]


def simulate(jobs: list[JobModel], policy: str, pool: str = "1x4") -> SimResult:
    name, flags, queue = parse_allocator_options(policy)
    config = SimConfig(parse_pool(pool), PolicyRef(name=name), queue=queue, **flags)  # type: ignore[arg-type]
    return Simulation(jobs, config).run()


def test_step_time_and_rate_on_a_hand_made_profile() -> None:
    model = profile()
    # At the trace batch: Amdahl's time, t1 (s + (1 - s) / n) = 0.5 + 0.25 on 2 GPUs.
    assert model.step_seconds(2, 100) == pytest.approx(0.75)
    # Twice the batch: each of 2 GPUs computes 50 samples more at 5 ms each.
    assert model.step_seconds(2, 200) == pytest.approx(1.0)
    # Efficiency relative to the trace batch: (300 + 100) / (300 + 200) = 0.8.
    assert model.efficiency(200, 0.0) == pytest.approx(0.8)
    # Work per second: 2 trace batches x 0.8 of each, in 1 s, at t1 = 1 s per trace batch.
    assert model.rate(2, 200, 0.0) == pytest.approx(1.6)
    # At the trace batch the rate is Amdahl's speedup (1 / 0.75).
    assert model.rate(2, 100, 0.0) == pytest.approx(2 / (1 + 0.5))
    assert model.rate(0, 200, 0.0) == 0.0


def test_the_noise_scale_is_geometric_between_its_points_and_flat_after_the_last() -> None:
    model = profile(noise=(1.0, 100.0))
    assert model.noise_at(0.0) == 1.0
    assert model.noise_at(0.25) == pytest.approx(10.0)  # halfway from 1 to 100, geometric
    assert model.noise_at(0.5) == 100.0
    assert model.noise_at(1.0) == 100.0
    assert model.efficiency(100, 0.25) == 1.0


def test_the_batch_is_bounded_by_the_max_and_none_is_the_trace_batch() -> None:
    model = profile()
    assert model.clamp(None) == 100
    assert model.clamp(5000) == 800
    assert model.clamp(300) == 300
    with pytest.raises(ValueError, match="trace batch"):
        profile(max_batch=50)
    with pytest.raises(ValueError, match="noise"):
        profile(noise=(0.0,))


def test_a_job_at_its_trace_batch_progresses_at_its_speedup_exactly() -> None:
    model = job(profile())
    for gpus in (1, 2, 3, 4):
        assert model.rate(gpus, None, 0.3) == model.speedup(gpus)
        assert model.rate(gpus, 100, 0.3) == model.speedup(gpus)
    assert model.rate(4, 400, 0.0) != model.speedup(4)


def test_jobs_with_a_profile_run_as_before_unless_they_adapt() -> None:
    with_profile = [job(profile(), name=f"j{i}", arrival=30.0 * i) for i in range(3)]
    without = [replace(j, batching=None) for j in with_profile]
    reference = simulate(without, "goodput").jobs
    # Without +adaptive, and under a policy that picks no batch, nothing moves.
    assert simulate(with_profile, "goodput").jobs == reference
    assert simulate(with_profile, "static+adaptive").jobs == simulate(without, "static").jobs


def test_an_adaptive_job_reports_the_metrics_and_a_large_noise_scale_pays() -> None:
    # A noise scale far above any batch: a larger batch loses nothing, and with a serial
    # share of 0.5 it amortizes the fixed half of each step: the job finishes sooner.
    noisy = job(profile(noise=(1e9,)), min_gpus=4)
    fixed = simulate([noisy], "goodput").jobs[0]
    run = Simulation(
        [noisy],
        SimConfig(parse_pool("1x4"), PolicyRef(name="goodput"), adaptive_batch=True),
    )
    adapted = run.run().jobs[0]
    assert adapted.completion < 0.5 * fixed.completion
    report = run._runs["a"].reports[-1]
    assert set(ADAPTIVE_METRICS) | {BASE_BATCH_METRIC} <= set(report.metrics)
    assert report.metrics[BASE_BATCH_METRIC] == 100.0
    assert report.metrics["batch_size"] == 800.0  # the max batch


def test_derive_batching_from_hand_made_trace_files() -> None:
    files = {
        "placements.csv": "placement,local_bsz,step_time,sync_time\n"
        "1,10,0.2,0.01\n1,20,0.3,0.01\n1,40,0.5,0.01\n2,10,9.0,0.01\n",
        "validation-64.csv": "progress,iteration,metric,grad_sqr,grad_var\n"
        + "".join(f"{i},{i},0.5,{1.0 / (i + 1)},2.0\n" for i in range(20)),
    }
    row = derive_batching("toy", 64, 20, [16, 64, 256], files.__getitem__)
    assert row.per_sample_seconds == pytest.approx(0.01)  # slope of placement "1" only
    assert row.max_batch == 256
    assert row.min_local_batch == 10  # the smallest local batch of any placement
    # Noise: initial batch 16 x var / sqr at epochs 0, 2, 4, ..., 18.
    assert row.noise == pytest.approx(tuple(16 * 2.0 * (2 * k + 1) for k in range(10)))


def test_every_calibrated_trace_batch_has_a_noise_profile() -> None:
    assert set(POLLUX_BATCHING) == set(POLLUX_CALIBRATIONS)
    for (_, batch), row in POLLUX_BATCHING.items():
        assert row.max_batch >= batch
        assert all(math.isfinite(n) and n > 0 for n in row.noise)
    assert POLLUX_BATCHING["ncf", 32768].max_batch == 32768
    assert POLLUX_BATCHING["ncf", 32768].min_local_batch == 32768  # one GPU, as Pollux's
    # Pollux's `max_batch_size // min_local_bsz`: deepspeech2 spreads 640 over 64 GPUs.
    assert POLLUX_BATCHING["deepspeech2", 320].min_local_batch == 10
    assert (
        batch_model(
            POLLUX_CALIBRATIONS["deepspeech2", 320], POLLUX_BATCHING["deepspeech2", 320]
        ).widest()
        == 64
    )


def test_the_widest_size_is_the_max_batch_at_the_smallest_local_batch() -> None:
    assert profile(max_batch=800, min_local_batch=25).widest() == 32
    assert profile(max_batch=800, min_local_batch=30).widest() == 26  # 26 x 30 <= 800
    assert profile().widest() == 800  # one sample a GPU when nothing is known
    with pytest.raises(ValueError, match="min local batch"):
        profile(min_local_batch=0)
    with pytest.raises(ValueError, match="min local batch"):
        profile(min_local_batch=801)


def test_batch_widened_bounds_by_max_batch_measured_sizes_and_pool_never_below_the_ask() -> None:
    adaptive = profile(max_batch=800, min_local_batch=25)  # widest 32
    jobs = [
        job(adaptive, name="measured-to-16", max_gpus=4, scale_limit=16),
        job(adaptive, name="unmeasured", max_gpus=4),
        job(adaptive, name="asks-more", requested=40, max_gpus=40, scale_limit=48),
        job(None, name="no-profile", max_gpus=4, scale_limit=16),
    ]
    widened = {j.name: j for j in batch_widened(jobs, pool_gpus=20)}
    assert widened["measured-to-16"].max_gpus == 16  # its measured sizes
    assert widened["unmeasured"].max_gpus == 20  # the pool (32 would spread the max batch)
    assert widened["asks-more"].max_gpus == 40  # never below its trace's ask
    assert widened["no-profile"] == jobs[3]  # no batch to spread: as it was
    assert all(widened[j.name].min_gpus == j.min_gpus for j in jobs)
    assert batch_widened(jobs, pool_gpus=64)[2].max_gpus == 40


def test_adaptive_jobs_grow_past_their_trace_ask_on_an_idle_pool() -> None:
    # A trace row asking 2 GPUs, a profile whose max batch spreads over 32 and throughput
    # measured up to 4: alone on 4 GPUs, `+adaptive` lets it take all 4 and it ends sooner.
    asked = job(
        profile(serial_fraction=0.05, noise=(1e9,), min_local_batch=25),
        requested=2, max_gpus=2, serial_fraction=0.05, scale_limit=4,
    )  # fmt: skip
    pool = parse_pool("1x4")
    kept = Simulation(
        [asked], SimConfig(pool, PolicyRef(name="goodput"), adaptive_batch=True)
    ).run()
    (widened,) = runner_simulate(Workload("one", [asked]), pool, ["goodput+adaptive"], 0.0)
    held = widened.jobs[0].gpu_seconds / widened.jobs[0].completion
    assert held > 2.5  # GPUs held on average: more than the 2 its trace row asks
    assert widened.jobs[0].completion < 0.8 * kept.jobs[0].completion
