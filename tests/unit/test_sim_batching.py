"""Adaptive batch in the simulator: the efficiency and step-time model on hand-made cases,
its derivation from trace files, and that a job kept at its trace's batch runs as before."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from herd_operator.policies.base import JobObservations
from herd_operator.policies.goodput import GoodputParams, GoodputPolicy, accumulation_steps
from herd_operator.simulate.batching import (
    NOISE_FLOOR,
    BatchModel,
    batch_model,
    check_noise,
    derive_batching,
)
from herd_operator.simulate.calibration import POLLUX_CALIBRATIONS
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import START_SECONDS, JobModel
from herd_operator.simulate.pollux_profiles import POLLUX_BATCHING
from herd_operator.simulate.results import SimResult
from herd_operator.simulate.runner import Workload, parse_allocator_options, parse_pool
from herd_operator.simulate.runner import simulate as runner_simulate
from herd_operator.simulate.steptime import StepModel
from herd_operator.simulate.workload import batch_widened
from herd_operator.specs import HerdJob, PolicyRef
from herd_operator.specs.values import (
    ADAPTIVE_METRICS,
    BASE_BATCH_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    Report,
)

SIMPLE_STEP = StepModel(0.5, 0.005, 0.0, 0.0, 0.0, 0.0, 1.0, 1000.0)
"""0.5 s + 5 ms a sample, no synchronisation cost: steps of known length."""


def profile(noise: tuple[object, ...] = (300.0,), **changes: object) -> BatchModel:
    """A job whose noise scale per epoch is `noise` at every batch (or, given as (batch,
    scales) pairs, per batch)."""
    fields: dict[str, object] = {
        "base_batch": 100, "min_batch": 100, "max_batch": 800, "min_local_batch": 10,
        "start_batch": 200, "seconds_per_progress": 1.0, "step": SIMPLE_STEP,
        "noise": ((1, noise),),
    }  # fmt: skip
    if noise and isinstance(noise[0], tuple):  # already per batch
        fields["noise"] = noise
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
    # 100 samples a GPU on each of 2: 0.5 s + 100 x 5 ms.
    assert model.step_seconds(2, 200) == pytest.approx(1.0)
    # Efficiency relative to the base batch: (300 + 100) / (300 + 200) = 0.8.
    assert model.efficiency(200, 0.0) == pytest.approx(0.8)
    # A step of 200 is worth 2 x 0.8 base steps, in 1 s, at 1 work-second a base step.
    assert model.rate(2, 200, 0.0) == pytest.approx(1.6)
    # At the base batch on one GPU: one base step in 0.5 + 0.5 s.
    assert model.rate(1, 100, 0.0) == pytest.approx(1.0)
    assert model.rate(0, 200, 0.0) == 0.0
    # Below the base batch it is not taken: 50 asked is 100.
    assert model.rate(1, 50, 0.0) == model.rate(1, 100, 0.0)


def test_each_gpu_takes_its_smallest_local_batch_at_least() -> None:
    model = profile(min_local_batch=10)
    assert model.batch_on(16, 100) == 160  # 16 GPUs x 10 samples
    assert model.batch_on(2, 100) == 100
    assert model.batch_on(100, 100) == 800  # never past the max batch
    assert model.metrics(16, 100, 0.0)["batch_size"] == 160.0
    assert model.metrics(16, 100, 0.0)["step_seconds"] == pytest.approx(0.5 + 0.05)


def test_the_noise_scale_is_each_epochs_and_linear_between_validated_batches() -> None:
    model = profile(noise=(1.0, 100.0))
    assert model.noise_at(0.0, 100) == 1.0
    assert model.noise_at(0.25, 100) == 1.0  # epoch 0 of 2
    assert model.noise_at(0.5, 100) == 100.0
    assert model.noise_at(1.0, 100) == 100.0
    assert model.efficiency(100, 0.25) == 1.0
    per_epoch = profile(noise=(3.0, 5.0, 7.0))
    assert [per_epoch.noise_at(k / 3, 100) for k in range(3)] == [3.0, 5.0, 7.0]
    # Validated at 100 and 400: at 200 a third of the way; outside them the nearest.
    by_batch = profile(noise=((100, (10.0, 20.0)), (400, (40.0, 80.0))))
    assert by_batch.noise_at(0.0, 200) == pytest.approx(20.0)
    assert by_batch.noise_at(0.5, 200) == pytest.approx(40.0)
    assert by_batch.noise_at(0.5, 50) == 20.0
    assert by_batch.noise_at(0.5, 800) == 80.0
    assert by_batch.metrics(1, 400, 0.0)[GRADIENT_NOISE_SCALE_METRIC] == 40.0


def test_the_batch_is_bounded_by_the_min_and_max_and_none_is_the_base_batch() -> None:
    model = profile(base_batch=50)
    assert model.clamp(None) == 200  # the start batch
    assert model.clamp(5000) == 800
    assert model.clamp(300) == 300
    assert model.clamp(60) == 100
    with pytest.raises(ValueError, match="min batch <= max batch"):
        profile(max_batch=50)
    with pytest.raises(ValueError, match="base batch <= min batch"):
        profile(base_batch=200)
    with pytest.raises(ValueError, match="start batch"):
        profile(start_batch=50)
    with pytest.raises(ValueError, match="noise"):
        profile(noise=(0.0,))
    with pytest.raises(ValueError, match="increasing order"):
        profile(noise=((400, (1.0,)), (100, (1.0,))))


@settings(max_examples=200, deadline=None)
@given(
    gpus=st.integers(1, 64),
    base=st.integers(1, 512),
    spread=st.integers(1, 256),
    min_local=st.integers(1, 64),
    noise=st.floats(1e-3, 1e8),
    asked=st.one_of(st.none(), st.integers(1, 1 << 20)),
)
def test_the_batch_a_job_takes_keeps_to_its_min_and_max(
    gpus: int, base: int, spread: int, min_local: int, noise: float, asked: int | None
) -> None:
    model = profile(
        base_batch=base, min_batch=base, max_batch=base * spread, start_batch=base,
        min_local_batch=min(min_local, base * spread), noise=(noise,),
    )  # fmt: skip
    taken = model.batch_on(gpus, model.clamp(asked))
    assert base <= taken <= base * spread
    assert model.rate(gpus, model.clamp(asked), 0.5) > 0


def test_a_job_without_a_batch_progresses_at_its_speedup_exactly() -> None:
    model = job(profile())
    for gpus in (1, 2, 3, 4):
        assert model.rate(gpus, None, 0.3) == model.speedup(gpus)
    assert model.rate(4, 400, 0.0) != model.speedup(4)


def test_jobs_with_a_profile_run_as_before_unless_they_adapt() -> None:
    with_profile = [job(profile(), name=f"j{i}", arrival=30.0 * i) for i in range(3)]
    without = [replace(j, batching=None) for j in with_profile]
    reference = simulate(without, "goodput").jobs
    # Without +adaptive nothing moves.
    assert simulate(with_profile, "goodput").jobs == reference
    assert simulate(with_profile, "static").jobs == simulate(without, "static").jobs
    # With it, a policy that picks no batch leaves each job at its start batch.
    run = Simulation(
        with_profile,
        SimConfig(parse_pool("1x4"), PolicyRef(name="static"), adaptive_batch=True),
    )
    run.run()
    assert {r.batch for r in run._runs.values()} == {200}


def test_an_adaptive_job_reports_the_metrics_and_a_large_noise_scale_pays() -> None:
    # A noise scale far above any batch: a larger batch loses nothing, and it amortizes
    # each step's fixed 0.5 s over more samples: the job finishes sooner.
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
        "1,10,0.2,0.01\n1,20,0.3,0.01\n1,40,0.5,0.01\n2,12,9.0,0.01\n",
        "scalability.csv": "num_nodes,num_replicas,local_bsz,step_time,sync_time\n2,8,11,0.9,0.3\n",
    }
    for batch, progress, var in ((16, 30.0, 1.0), (64, 29.0, 2.0), (256, 31.0, 0.0)):
        files[f"validation-{batch}.csv"] = (
            "progress,iteration,metric,grad_sqr,grad_var\n"
            + "".join(
                f"{progress * (i + 1) / 20},{i},0.5,{1.0 / (i + 1)},{var}\n" for i in range(20)
            )
        )
    row = derive_batching("toy", 20, [64, 16, 256], files.__getitem__)
    assert (row.base_batch, row.min_batch, row.max_batch) == (16, 16, 256)
    assert row.min_local_batch == 10  # the smallest local batch of any measured step
    assert row.progress == 29.0  # the least any validated batch made in 20 epochs
    # Noise per validated batch, rising, per epoch: base batch 16 x var / sqr, floored.
    assert [batch for batch, _ in row.noise] == [16, 64, 256]
    assert row.noise[1][1] == pytest.approx(tuple(16 * 2.0 * (k + 1) for k in range(20)))
    assert row.noise[2][1] == (NOISE_FLOOR,) * 20
    files["validation-32768.csv"] = files["validation-64.csv"]
    ncf = derive_batching("ncf", 20, [16, 32768, 256], files.__getitem__)
    assert (ncf.base_batch, ncf.min_batch, ncf.max_batch, ncf.min_local_batch) == (
        16, 32768, 32768, 32768,
    )  # fmt: skip


def test_every_application_of_the_traces_has_a_noise_profile() -> None:
    assert set(POLLUX_BATCHING) == {app for app, _ in POLLUX_CALIBRATIONS}
    for (application, batch), fit in POLLUX_CALIBRATIONS.items():
        row = POLLUX_BATCHING[application]
        assert row.min_batch <= batch <= row.max_batch
        check_noise(row.noise)
        assert all(len(scales) == fit.epochs for _, scales in row.noise)  # one per epoch
    assert POLLUX_BATCHING["ncf"].max_batch == 32768
    assert POLLUX_BATCHING["ncf"].min_batch == 32768
    assert POLLUX_BATCHING["ncf"].min_local_batch == 32768  # one GPU, as Pollux's
    # Pollux's `init_batch_size`: the smallest validated batch.
    assert POLLUX_BATCHING["deepspeech2"].base_batch == 20
    assert POLLUX_BATCHING["cifar10"].min_batch == 128
    # Pollux's `max_batch_size // min_local_bsz`: deepspeech2 spreads 640 over 64 GPUs.
    assert POLLUX_BATCHING["deepspeech2"].min_local_batch == 10
    assert (
        batch_model(POLLUX_CALIBRATIONS["deepspeech2", 320], POLLUX_BATCHING["deepspeech2"])
    ).widest() == 64


def test_the_widest_size_is_the_max_batch_at_the_smallest_local_batch() -> None:
    assert profile(max_batch=800, min_local_batch=25).widest() == 32
    assert profile(max_batch=800, min_local_batch=30).widest() == 26  # 26 x 30 <= 800
    assert profile(min_local_batch=1).widest() == 800  # one sample a GPU
    with pytest.raises(ValueError, match="min local batch"):
        profile(min_local_batch=0)
    with pytest.raises(ValueError, match="min local batch"):
        profile(min_local_batch=801)


def test_batch_widened_bounds_by_max_batch_and_pool_never_below_the_ask() -> None:
    adaptive = profile(max_batch=800, min_local_batch=25)  # widest 32
    jobs = [
        job(adaptive, name="measured-to-4", min_gpus=2, max_gpus=4, scale_limit=4),
        job(adaptive, name="unmeasured", max_gpus=4),
        job(adaptive, name="asks-more", requested=40, min_gpus=10, max_gpus=40, scale_limit=48),
        job(None, name="no-profile", min_gpus=2, max_gpus=4, scale_limit=16),
    ]
    widened = {j.name: j for j in batch_widened(jobs, pool_gpus=20)}
    # Its steps come from the step model: the Amdahl fit's sizes (4) do not bound it.
    assert widened["measured-to-4"].max_gpus == 20  # the pool (32 would spread the max batch)
    assert widened["unmeasured"].max_gpus == 20
    assert widened["asks-more"].max_gpus == 40  # never below its trace's ask
    assert widened["no-profile"] == jobs[3]  # no batch to spread: as it was
    # Its base batch fits one GPU in micro-batches: its min is 1 (the others as they were).
    assert [widened[j.name].min_gpus for j in jobs] == [1, 1, 1, 2]
    on_64 = batch_widened(jobs, pool_gpus=64)
    assert [j.max_gpus for j in on_64[:3]] == [32, 32, 40]  # the max batch spread


def test_adaptive_jobs_grow_past_their_trace_ask_on_an_idle_pool() -> None:
    # A trace row asking 2 GPUs, a profile whose max batch spreads over 32 and throughput
    # measured up to 4: alone on 4 GPUs, `+adaptive` lets it take all 4 and it ends sooner.
    asked = job(
        profile(noise=(1e9,), min_local_batch=25),
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


@settings(max_examples=100, deadline=None)
@given(
    gpus=st.integers(1, 64),
    base=st.integers(1, 512),
    spread=st.integers(1, 64),
    noise=st.floats(1e-3, 1e8),
    worker=st.one_of(st.none(), st.integers(1, 4096)),
    ran=st.lists(st.tuples(st.integers(1, 64), st.integers(1, 1 << 16)), min_size=1, max_size=3),
)
def test_the_goodput_policy_keeps_a_simulated_job_within_its_declared_batches(
    gpus: int, base: int, spread: int, noise: float, worker: int | None,
    ran: list[tuple[int, int]],
) -> None:  # fmt: skip
    # The job reports what `BatchModel.metrics` says at the sizes and batches it ran at; the
    # policy's batch for its GPUs is never below its base (the smallest validated batch),
    # never above its max batch, nor above what its GPUs' memory holds in micro-batches.
    assume(gpus <= base * spread)
    model = profile(
        base_batch=base, min_batch=base, max_batch=base * spread, start_batch=base,
        min_local_batch=1, noise=(noise,),
    )  # fmt: skip
    reports = [
        Report(i, 10.0 * (i + 1), size, model.metrics(size, model.clamp(batch), 0.0))
        for i, (size, batch) in enumerate(ran)
    ]
    training: dict[str, object] = {"batchPolicy": "adaptive", "maxBatch": base * spread}
    if worker is not None:
        training["maxWorkerBatch"] = worker
    spec = HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1", "kind": "HerdJob", "metadata": {"name": "t"},
            "spec": {"command": ["t"], "gpus": {"min": 1, "max": 64}, "training": training},
        }
    )  # fmt: skip
    observed = JobObservations(0.0, allocated=gpus, epochs=reports)
    chosen = GoodputPolicy(GoodputParams()).desired(spec, observed, 60.0).batch_size
    assert chosen is not None
    assert base <= chosen <= base * spread
    if worker is not None:  # no GPU computes more than `worker` at once: micro-batches
        assert -(-chosen // gpus) <= worker * accumulation_steps(gpus, chosen, worker)
    assert base <= model.batch_on(gpus, model.clamp(chosen)) <= base * spread


def test_an_adaptive_job_trains_below_its_trace_batch_when_the_noise_is_small() -> None:
    # Noise of 1 sample: a batch above the base loses nearly all its extra samples, so the
    # policy takes the job from its trace row's 200 down to its base batch, 100 (before this
    # change the trace's batch was the floor), and it ends sooner than kept at 200.
    quiet = job(profile(noise=(1.0,), min_local_batch=1), min_gpus=1, max_gpus=1)
    run = Simulation(
        [quiet], SimConfig(parse_pool("1x4"), PolicyRef(name="goodput"), adaptive_batch=True)
    )
    adapted = run.run().jobs[0]
    assert run._runs["a"].reports[-1].metrics["batch_size"] == 100.0
    kept = (
        Simulation(
            [quiet], SimConfig(parse_pool("1x4"), PolicyRef(name="static"), adaptive_batch=True)
        )
        .run()
        .jobs[0]
    )
    assert adapted.completion < kept.completion


def test_a_measurement_some_steps_into_the_first_epoch_lets_the_policy_act_before_its_end() -> None:
    # Two long epochs at a noise scale of 1 sample: the base batch (100) is the best, the
    # trace row's 200 loses half its samples. Measured 20 steps in, the policy moves the job
    # to 100 within its first epoch; measured at epoch ends only, after the first one.
    slow = job(profile(noise=(1.0,), min_local_batch=1), min_gpus=1, max_gpus=1, epochs=2)

    def run(steps: int) -> Simulation:
        config = SimConfig(
            parse_pool("1x4"), PolicyRef(name="goodput"), adaptive_batch=True, measure_steps=steps
        )
        simulation = Simulation([slow], config)
        simulation.run()
        return simulation

    measured, at_ends = run(20), run(0)
    assert slow.batching is not None
    reports = measured._runs["a"].reports
    first = reports[0]
    assert first.measurement and first.epoch is None
    assert first.metrics["batch_size"] == 200.0  # the start batch, 20 steps in
    assert first.time == pytest.approx(START_SECONDS + 20 * slow.batching.step_seconds(1, 200))
    assert reports[1].measurement and reports[1].metrics["batch_size"] == 100.0  # the new batch
    assert [r.epoch for r in reports if not r.measurement] == [0, 1]
    assert not any(r.measurement for r in at_ends._runs["a"].reports)
    assert measured._runs["a"].finished < at_ends._runs["a"].finished
