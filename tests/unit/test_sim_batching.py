"""Adaptive batch in the simulator: the efficiency and step-time model on hand-made cases,
its derivation from trace files, and that a job kept at its trace's batch runs as before."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from herd_operator.simulate.batching import POLLUX_BATCHING, BatchModel, derive_batching
from herd_operator.simulate.calibration import POLLUX_CALIBRATIONS
from herd_operator.simulate.engine import SimConfig, SimResult, Simulation
from herd_operator.simulate.model import JobModel
from herd_operator.simulate.runner import parse_allocator_options, parse_pool
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
    # Noise: initial batch 16 x var / sqr at epochs 0, 2, 4, ..., 18.
    assert row.noise == pytest.approx(tuple(16 * 2.0 * (2 * k + 1) for k in range(10)))


def test_every_calibrated_trace_batch_has_a_noise_profile() -> None:
    assert set(POLLUX_BATCHING) == set(POLLUX_CALIBRATIONS)
    for (_, batch), row in POLLUX_BATCHING.items():
        assert row.max_batch >= batch
        assert all(math.isfinite(n) and n > 0 for n in row.noise)
    assert POLLUX_BATCHING["ncf", 32768].max_batch == 32768
