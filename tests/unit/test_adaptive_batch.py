"""The adaptive batch policy's arithmetic on the worker's side (herd_operator/agent/adaptive.py
and its use in batching.py): the noise-scale estimator, AdaScale's gain ratio, the batch a
worker takes from the operator's choice, and that steps stay whole across changes of batch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.agent.adaptive import (
    MAX_NOISE_SCALE,
    NoiseEstimate,
    batch_for_world,
    gain_ratio,
    step_moments,
    update_noise,
)
from herd_operator.agent.batching import (
    BatchSettings,
    BatchState,
    after_gradients,
    after_step,
    base_epoch_steps,
    epoch_order,
    epoch_over,
    next_epoch,
    next_pass,
    next_step,
    on_decision,
    on_world,
    plan_batches,
    step_gain,
    step_lr,
    trained_epochs,
)
from herd_operator.policies.efficiency import statistical_efficiency


def test_two_single_sample_workers_give_the_sample_variance_and_the_unbiased_norm() -> None:
    # One dimension, per-sample gradients 3 and 1: mean 2, sample variance (n - 1) 2; the
    # unbiased |G|^2 is mean^2 - variance / n = 4 - 1 = 3.
    local_sqr = (3.0**2 + 1.0**2) / 2
    global_sqr = 2.0**2
    assert step_moments(local_sqr, global_sqr, 1, 2) == pytest.approx((3.0, 2.0))


def test_hand_made_vectors_of_four_workers() -> None:
    # Four workers of 2 samples each; their mean gradients in 2 dimensions:
    local = [(1.0, 2.0), (3.0, 0.0), (-1.0, 2.0), (1.0, 0.0)]
    mean = (1.0, 1.0)
    local_sqr = sum(x * x + y * y for x, y in local) / 4  # (5 + 9 + 5 + 1) / 4 = 5
    global_sqr = mean[0] ** 2 + mean[1] ** 2  # 2
    sqr, var = step_moments(local_sqr, global_sqr, 2, 8)  # type: ignore[misc]
    # |G|^2 = (8 x 2 - 2 x 5) / 6 = 1; S = (5 - 2) / (1/2 - 1/8) = 8
    assert sqr == pytest.approx(1.0)
    assert var == pytest.approx(8.0)


def test_one_worker_tells_nothing() -> None:
    assert step_moments(4.0, 4.0, 32, 32) is None
    assert update_noise(NoiseEstimate(), 4.0, 4.0, 32, 32, 32) == NoiseEstimate()


def test_the_first_measurement_is_taken_whole_by_the_bias_correction() -> None:
    estimate = update_noise(NoiseEstimate(), 5.0, 2.0, 2, 8, 8)
    assert estimate.gradient_sqr == pytest.approx(1.0)
    assert estimate.variance == pytest.approx(8.0)
    assert estimate.noise_scale() == pytest.approx(8.0)


def test_a_gradient_norm_estimated_at_zero_or_less_reads_as_all_noise() -> None:
    # Local 10 at 2 samples, global 6 at 8: |G|^2 = (48 - 20) / 6 > 0; local 10, global 2:
    # |G|^2 = (16 - 20) / 6 < 0, floored at 0, with S = 8 / (3 / 8) > 0.
    assert update_noise(NoiseEstimate(), 10.0, 2.0, 2, 8, 8).noise_scale() == MAX_NOISE_SCALE
    assert NoiseEstimate().noise_scale() is None
    assert NoiseEstimate(0.0, 0.0, 1.0).noise_scale() is None


def test_a_step_that_is_not_finite_leaves_the_estimate() -> None:
    before = update_noise(NoiseEstimate(), 5.0, 2.0, 2, 8, 8)
    assert update_noise(before, float("inf"), 2.0, 2, 8, 8) == before
    assert update_noise(before, 5.0, float("nan"), 2, 8, 8) == before


def test_the_smoothed_estimate_finds_a_known_noise_scale() -> None:
    # Per-sample gradients G + noise, G = (1, 0) and each coordinate's noise of variance
    # 4: S = 8, |G|^2 = 1, so the noise scale is 8 samples. 4 workers of 4 samples.
    rng = random.Random(7)
    workers, local, dims = 4, 4, 2
    estimate = NoiseEstimate()
    for _ in range(2000):
        means = []
        for _ in range(workers):
            samples = [
                [(1.0 if d == 0 else 0.0) + rng.gauss(0.0, 2.0) for d in range(dims)]
                for _ in range(local)
            ]
            means.append([sum(s[d] for s in samples) / local for d in range(dims)])
        local_sqr = sum(sum(v * v for v in m) for m in means) / workers
        overall = [sum(m[d] for m in means) / workers for d in range(dims)]
        global_sqr = sum(v * v for v in overall)
        estimate = update_noise(estimate, local_sqr, global_sqr, local, local * workers, 16)
    assert estimate.noise_scale() == pytest.approx(8.0, rel=0.1)


def test_gain_ratio_known_answer_and_pollux_efficiency() -> None:
    # S = 100, |G|^2 = 1: noise scale 100. Base 10, batch 100: r = (10 + 1) / (1 + 1).
    estimate = NoiseEstimate(sqr_biased=1.0, var_biased=100.0, weight=1.0)
    assert gain_ratio(estimate, 100, 10) == pytest.approx(5.5)
    assert gain_ratio(estimate, 10, 10) == pytest.approx(1.0)
    assert gain_ratio(estimate, 100, 10) / (100 / 10) == pytest.approx(
        statistical_efficiency(100.0, 100, 10)
    )
    assert gain_ratio(NoiseEstimate(), 100, 10) == 1.0  # nothing measured: no scaling up


@settings(max_examples=100, deadline=None)
@given(
    sqr=st.floats(0, 1e6),
    var=st.floats(0, 1e6),
    base=st.integers(1, 4096),
    extra=st.integers(0, 4096),
)
def test_gain_ratio_is_between_one_and_the_scale(
    sqr: float, var: float, base: int, extra: int
) -> None:
    estimate = NoiseEstimate(sqr_biased=sqr, var_biased=var, weight=1.0)
    gain = gain_ratio(estimate, base + extra, base)
    assert 1.0 - 1e-9 <= gain <= (base + extra) / base + 1e-9


@pytest.mark.parametrize(
    ("world", "decided", "limits", "expected"),
    [
        (2, None, (None, None), 32),  # no choice yet: the base batch
        (2, (2, 96), (1000, None), 96),  # the choice at its own GPUs
        (2, (2, 96), (None, None), 64),  # without limits, at most the base batch per GPU
        (4, (2, 96), (None, None), 128),  # per GPU at another size: 192, capped at base x 4
        (4, (2, 96), (1000, None), 192),  # the same with a max batch that allows it
        (1, (2, 96), (1000, None), 48),  # a shrink keeps the per-GPU share
        (2, (2, 500), (300, None), 300),  # at most max_batch
        (2, (2, 500), (None, 64), 128),  # without a max batch, max_worker_batch per worker
        (2, (2, 500), (1000, 64), 500),  # with one, past it by accumulation
        (2, (4, 40), (None, None), 32),  # never below the base batch
        (64, None, (None, None), 64),  # one sample per worker at least
    ],
)
def test_batch_for_world(
    world: int,
    decided: tuple[int, int] | None,
    limits: tuple[int | None, int | None],
    expected: int,
) -> None:
    assert batch_for_world(world, 32, decided, *limits) == expected


def adaptive(max_worker_batch: int | None = 32, max_batch: int | None = 1024) -> BatchSettings:
    return BatchSettings(
        "adaptive", 16, 0.1, reference_workers=2, max_worker_batch=max_worker_batch,
        max_batch=max_batch,
    )  # fmt: skip


def test_adaptive_starts_at_the_base_batch_then_takes_the_operators() -> None:
    settings = adaptive(max_worker_batch=None)
    state = on_world(settings, BatchState(), 2)
    assert plan_batches(settings, 2, state.global_batch).global_batch == 32
    state = on_decision(settings, state, (2, 96))
    plan = plan_batches(settings, 2, state.global_batch)
    assert plan.global_batch == 96
    assert plan.worker_batches == (48, 48)
    # A resize to 3 before the operator decides again: the same batch per GPU.
    state = on_world(settings, state, 3)
    assert state.global_batch == 144
    # With a memory limit of 32 per worker and no max batch, the choice is held to 32 per
    # worker; with a max batch, it is taken in micro-batches of at most 32.
    limited = adaptive(max_worker_batch=32, max_batch=None)
    assert on_decision(limited, on_world(limited, BatchState(), 2), (2, 96)).global_batch == 64
    bounded = adaptive(max_worker_batch=32)
    state = on_decision(bounded, on_world(bounded, BatchState(), 2), (2, 96))
    plan = plan_batches(bounded, 2, state.global_batch)
    assert (plan.global_batch, plan.worker_batches, plan.accumulation_steps) == (96, (48, 48), 2)


def test_adaptive_base_batch_runs_with_accumulation_past_the_memory_limit() -> None:
    settings = adaptive(max_worker_batch=8, max_batch=None)
    state = on_decision(settings, on_world(settings, BatchState(), 2), (2, 500))
    plan = plan_batches(settings, 2, state.global_batch)
    assert plan.global_batch == 32  # the base batch: without a max batch, no more
    assert plan.worker_batches == (16, 16)
    assert plan.accumulation_steps == 2
    # Under a max batch the operator's choice is taken, in micro-batches of at most 8.
    bounded = adaptive(max_worker_batch=8, max_batch=1024)
    state = on_decision(bounded, on_world(bounded, BatchState(), 2), (2, 500))
    plan = plan_batches(bounded, 2, state.global_batch)
    assert plan.global_batch == 500
    assert (plan.worker_batches, plan.accumulation_steps) == ((250, 250), 32)
    # The other policies ignore the operator's choice.
    fixed = BatchSettings("preserve-batch", 16, 0.1, reference_workers=2)
    assert on_decision(fixed, on_world(fixed, BatchState(), 2), (2, 96)).global_batch == 0


def test_adaptive_rate_is_lr_times_the_gain_and_progress_counts_gains() -> None:
    settings = adaptive(max_worker_batch=None)
    state = on_decision(settings, on_world(settings, BatchState(), 2), (2, 128))
    assert step_lr(settings, state) == pytest.approx(0.1)  # nothing measured yet
    # One step's norms: |G|^2 = 1 and S = 32 x 4 = 128 (noise scale 128, base 32, batch 128)
    # from local batches of 64: local_sqr = 1 + 128 / 64 = 3, global_sqr = 1 + 128 / 128 = 2.
    state = after_gradients(settings, state, 3.0, 2.0, 64, 128)
    assert state.noise.noise_scale() == pytest.approx(128.0)
    gain = (128 / 32 + 1) / (128 / 128 + 1)  # 2.5
    assert step_gain(settings, state) == pytest.approx(gain)
    assert step_lr(settings, state) == pytest.approx(0.1 * gain)
    state = after_step(state, 128, step_lr(settings, state), step_gain(settings, state))
    assert state.progress == pytest.approx(gain)


def test_state_round_trips_and_reads_states_saved_before_adaptive() -> None:
    state = BatchState(
        epoch=3, cursor=64, world_size=2, lr=0.2, ramp_from=0.1, steps_since_resize=5,
        global_batch=96, decided=(2, 96), noise=NoiseEstimate(1.5, 30.0, 0.4), progress=7.5,
        data_pass=5,
    )  # fmt: skip
    assert BatchState.from_dict(state.to_dict()) == state
    old = {k: v for k, v in state.to_dict().items() if k in BatchState.__dataclass_fields__}
    old.pop("global_batch")
    old.pop("data_pass")
    assert BatchState.from_dict(old).data_pass == 3  # saved before passes: the epoch's
    assert BatchState.from_dict(old).global_batch == 0
    assert BatchState.from_dict(old).decided is None


@settings(max_examples=30, deadline=None)
@given(
    events=st.lists(
        st.one_of(
            st.tuples(st.just("world"), st.integers(1, 6)),
            st.tuples(st.just("batch"), st.integers(1, 6), st.integers(1, 400)),
        ),
        max_size=8,
    ),
    seed=st.integers(0, 3),
)
def test_every_sample_once_per_epoch_as_the_batch_and_the_world_change(
    events: list[tuple[int | str, ...]], seed: int
) -> None:
    settings = adaptive(max_batch=300)
    epoch_size = 250
    state = on_world(settings, BatchState(), 2)
    pending = list(events)
    for epoch in range(2):
        order = epoch_order(epoch_size, seed, epoch)
        seen: list[int] = []
        while True:
            if pending and random.Random(len(seen)).random() < 0.5:
                event = pending.pop(0)
                if event[0] == "world":
                    state = on_world(settings, state, int(event[1]))
                else:
                    state = on_decision(settings, state, (int(event[1]), int(event[2])))
            steps = [next_step(settings, state, order, r) for r in range(state.world_size)]
            if steps[0] is None:
                break
            plan = plan_batches(settings, state.world_size, state.global_batch)
            assert 32 <= plan.global_batch <= 300
            for step in steps:
                assert step is not None
                seen += step.indices
            state = after_step(state, steps[0].count, steps[0].lr)
        assert sorted(seen) == list(range(epoch_size))
        state = next_epoch(state)


def test_an_adaptive_epoch_is_one_epoch_of_the_fixed_runs_progress() -> None:
    # Base batch 32, 96 samples: an epoch is 3 base steps of progress. |G|^2 = 1, S = 64
    # (local 32 each: 1 + 64 / 32 = 3; global 64: 1 + 64 / 64 = 2), so a step of 64 gains
    # (64 / 32 + 1) / (64 / 64 + 1) = 1.5, and the short last step of a pass (32) gains 1.
    settings = adaptive(max_worker_batch=None)
    assert base_epoch_steps(settings, 96) == 3
    state = on_decision(settings, on_world(settings, BatchState(), 2), (2, 64))
    state = after_gradients(settings, state, 3.0, 2.0, 32, 64)
    passes: dict[int, list[int]] = {}
    counts: list[list[int]] = []
    for _ in range(2):
        counts.append([])
        while not epoch_over(settings, state, 96):
            if state.cursor >= 96:  # the epoch goes on in the next pass over the data
                state = next_pass(state)
            order = epoch_order(96, 0, state.data_pass)
            steps = [next_step(settings, state, order, rank) for rank in range(2)]
            assert steps[0] is not None and steps[1] is not None
            passes.setdefault(state.data_pass, []).extend(steps[0].indices + steps[1].indices)
            count = steps[0].count
            assert steps[0].lr == pytest.approx(0.1 * (1.5 if count == 64 else 1.0))
            counts[-1].append(count)
            state = after_step(state, count, steps[0].lr, step_gain(settings, state, count))
        state = next_epoch(state, settings)
    # Epoch 0: 64 (1.5), 32 (2.5: the pass ends short of the epoch), 64 of pass 1 (4.0).
    # Epoch 1 goes on in pass 1: 32 (5.0), then 64 of pass 2 (6.5 >= 6).
    assert counts == [[64, 32, 64], [32, 64]]
    assert state.progress == pytest.approx(6.5)
    assert trained_epochs(settings, state, 96) == pytest.approx(6.5 / 3)
    assert (state.epoch, state.data_pass, state.cursor) == (2, 2, 64)
    assert sorted(passes[0]) == sorted(passes[1]) == list(range(96))  # every sample once
    assert len(set(passes[2])) == 64
    # The other policies' epochs are passes.
    fixed = BatchSettings("preserve-batch", 16, 0.1, reference_workers=2)
    moved = next_epoch(BatchState(epoch=1, data_pass=1, cursor=96), fixed)
    assert (moved.epoch, moved.data_pass, moved.cursor) == (2, 2, 0)
    assert trained_epochs(fixed, BatchState(data_pass=1, cursor=48), 96) == 1.5
    assert epoch_over(fixed, BatchState(cursor=96), 96)
    assert not epoch_over(fixed, BatchState(cursor=95, progress=100.0), 96)
