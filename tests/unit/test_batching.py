"""The batch arithmetic of elastic training (herd_operator/agent/batching.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from herd_operator.agent.batching import (
    BATCH_POLICIES,
    BatchSettings,
    BatchState,
    after_step,
    epoch_order,
    micro_batches,
    next_epoch,
    next_step,
    on_world,
    plan_batches,
    policy_name,
    rank_span,
    split_evenly,
    step_count,
    step_lr,
    warmup_lr,
)

WORLD_SIZES = range(1, 65)


@pytest.mark.parametrize("parts", WORLD_SIZES)
def test_split_evenly_adds_up_and_differs_by_at_most_one(parts: int) -> None:
    for total in [0, 1, parts - 1, parts, parts + 1, 7 * parts + 3, 1000]:
        sizes = split_evenly(total, parts)
        assert len(sizes) == parts
        assert sum(sizes) == total
        assert max(sizes) - min(sizes) <= 1
        assert list(sizes) == sorted(sizes, reverse=True), "the larger shares come first"


def test_split_evenly_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        split_evenly(3, 0)
    with pytest.raises(ValueError):
        split_evenly(-1, 2)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("reference_workers", [1, 2, 3, 8])
def test_preserve_batch_keeps_the_global_batch_and_lr_at_every_world_size(
    world: int, reference_workers: int
) -> None:
    settings = BatchSettings("preserve-batch", 100, 0.1, reference_workers=reference_workers)
    plan = plan_batches(settings, world)
    assert plan.global_batch == 100 * reference_workers
    assert sum(plan.worker_batches) == plan.global_batch
    assert len(plan.worker_batches) == world
    assert max(plan.worker_batches) - min(plan.worker_batches) <= 1
    assert plan.lr == 0.1
    assert plan.accumulation_steps == 1


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("limit", [1, 7, 16, 64, 1000])
def test_preserve_batch_accumulates_when_a_share_exceeds_the_micro_batch_limit(
    world: int, limit: int
) -> None:
    settings = BatchSettings("preserve-batch", 256, 0.1, max_worker_batch=limit)
    plan = plan_batches(settings, world)
    largest = plan.worker_batches[0]
    # The fewest micro-batches that keep every one within the limit.
    assert (plan.accumulation_steps - 1) * limit < largest <= plan.accumulation_steps * limit
    for share in plan.worker_batches:
        micros = micro_batches(share, plan.accumulation_steps)
        assert sum(micros) == share
        assert max(micros) <= limit


def test_preserve_batch_refuses_more_workers_than_samples() -> None:
    settings = BatchSettings("preserve-batch", 4, 0.1, reference_workers=2)
    assert plan_batches(settings, 8).worker_batches == (1,) * 8
    with pytest.raises(ValueError, match="cannot give each of 9 workers"):
        plan_batches(settings, 9)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_naive_keeps_the_worker_batch_and_the_lr(world: int) -> None:
    plan = plan_batches(BatchSettings("naive", 32, 0.05, reference_workers=2), world)
    assert plan.worker_batches == (32,) * world
    assert plan.global_batch == 32 * world
    assert plan.lr == 0.05
    assert plan.accumulation_steps == 1


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("reference_workers", [1, 4])
def test_linear_lr_scales_the_lr_with_the_global_batch(world: int, reference_workers: int) -> None:
    settings = BatchSettings("linear-lr", 32, 0.05, reference_workers=reference_workers)
    plan = plan_batches(settings, world)
    assert plan.global_batch == 32 * world
    assert plan.lr == pytest.approx(0.05 * world / reference_workers)
    assert plan.lr / plan.global_batch == pytest.approx(settings.lr / settings.reference_batch)


@pytest.mark.parametrize(
    "bad",
    [
        {"policy": "elastic"},
        {"worker_batch": 0},
        {"lr": 0.0},
        {"lr": float("nan")},
        {"reference_workers": 0},
        {"warmup_steps": -1},
        {"max_worker_batch": 0},
        {"max_batch": 0},
    ],
)
def test_settings_refuse_nonsense(bad: dict[str, object]) -> None:
    values: dict[str, object] = {"policy": "naive", "worker_batch": 8, "lr": 0.1, **bad}
    with pytest.raises(ValueError):
        BatchSettings(**values)  # type: ignore[arg-type]


def test_policy_names() -> None:
    assert [policy_name(name) for name in BATCH_POLICIES] == list(BATCH_POLICIES)
    with pytest.raises(ValueError, match="naive, linear-lr, preserve-batch"):
        policy_name("Naive")


def test_warmup_lr_is_a_straight_line_to_the_target() -> None:
    assert [warmup_lr(0.1, 0.5, step, 4) for step in range(6)] == pytest.approx(
        [0.2, 0.3, 0.4, 0.5, 0.5, 0.5]
    )
    assert [warmup_lr(0.4, 0.1, step, 3) for step in range(4)] == pytest.approx(
        [0.3, 0.2, 0.1, 0.1]
    )
    assert warmup_lr(0.1, 0.5, 0, 0) == 0.5, "no warm-up: the target at once"
    assert warmup_lr(0.1, 0.5, 0, 1) == 0.5
    with pytest.raises(ValueError):
        warmup_lr(0.1, 0.5, -1, 4)


def test_linear_lr_after_each_reset_ramps_from_the_rate_in_effect() -> None:
    settings = BatchSettings("linear-lr", 10, 0.1, warmup_steps=4)
    state = on_world(settings, BatchState(), 2)
    # The first start is not a resize: the target at once.
    assert step_lr(settings, state) == pytest.approx(0.2)
    for _ in range(5):
        state = after_step(state, 20, step_lr(settings, state))
    assert state.lr == pytest.approx(0.2)
    state = on_world(settings, state, 4)  # 2 -> 4 workers: 0.2 -> 0.4 over 4 steps
    seen = []
    for _ in range(6):
        seen.append(step_lr(settings, state))
        state = after_step(state, 40, seen[-1])
    assert seen == pytest.approx([0.25, 0.3, 0.35, 0.4, 0.4, 0.4])
    # A resize in the middle of a warm-up starts the next one from where the rate is.
    state = on_world(settings, state, 1)
    first = step_lr(settings, state)
    state = after_step(state, 10, first)
    state = on_world(settings, state, 3)
    assert state.ramp_from == pytest.approx(first)
    ramp = []
    for _ in range(4):
        ramp.append(step_lr(settings, state))
        state = after_step(state, 30, ramp[-1])
    assert first == pytest.approx(0.4 + (0.1 - 0.4) / 4)
    assert ramp == pytest.approx([first + (0.3 - first) * k / 4 for k in range(1, 5)])
    # A restart at the same size (a failed worker replaced) is no resize.
    before = state
    assert on_world(settings, state, 3) == before


@pytest.mark.parametrize("policy", ["naive", "preserve-batch"])
def test_naive_and_preserve_batch_never_ramp(policy: str) -> None:
    settings = BatchSettings(policy_name(policy), 16, 0.1, reference_workers=4, warmup_steps=50)
    state = on_world(settings, BatchState(), 4)
    for world in [1, 2, 8, 3]:
        state = on_world(settings, state, world)
        assert step_lr(settings, state) == plan_batches(settings, world).lr


def test_step_count_ends_the_epoch_with_the_rest() -> None:
    assert step_count(0, 100, 32) == 32
    assert step_count(96, 100, 32) == 4
    assert step_count(100, 100, 32) == 0
    with pytest.raises(ValueError):
        step_count(101, 100, 32)


def test_rank_spans_tile_the_step() -> None:
    for world in WORLD_SIZES:
        shares = split_evenly(100 + world, world)
        spans = [rank_span(shares, rank) for rank in range(world)]
        assert spans[0][0] == 0
        assert spans[-1][1] == 100 + world
        assert all(spans[i][1] == spans[i + 1][0] for i in range(world - 1))
    with pytest.raises(ValueError):
        rank_span((1, 2), 2)


def test_epoch_order_is_a_permutation_that_depends_on_seed_and_epoch() -> None:
    order = epoch_order(50, seed=3, epoch=0)
    assert sorted(order) == list(range(50))
    assert order == epoch_order(50, seed=3, epoch=0)
    assert order != epoch_order(50, seed=3, epoch=1)
    assert order != epoch_order(50, seed=4, epoch=0)
    assert epoch_order(5, seed=1, epoch=0, shuffle=False) == [0, 1, 2, 3, 4]


def run_epochs(
    settings: BatchSettings, epoch_size: int, worlds: list[int], epochs: int, seed: int = 0
) -> tuple[list[Counter[int]], list[tuple[int, int, int, float]]]:
    """Every rank's steps as the workers compute them, the world size taken from `worlds`
    one step after another (cycling): per epoch, how often each sample was trained on, and
    (world size, global samples, accumulation micro-batches, lr) per step."""
    seen: list[Counter[int]] = []
    steps: list[tuple[int, int, int, float]] = []
    state = BatchState()
    position = 0
    for _ in range(epochs):
        order = epoch_order(epoch_size, seed, state.epoch)
        counts: Counter[int] = Counter()
        while True:
            state = on_world(settings, state, worlds[position % len(worlds)])
            position += 1
            parts = [next_step(settings, state, order, rank) for rank in range(state.world_size)]
            if parts[0] is None:
                assert all(part is None for part in parts)
                break
            assert all(part is not None for part in parts)
            ranks = [part for part in parts if part is not None]
            assert len({(p.count, p.lr, p.cursor) for p in ranks}) == 1, "the ranks agree"
            assert sum(len(p.indices) for p in ranks) == ranks[0].count
            for part in ranks:
                counts.update(part.indices)
            steps.append(
                (state.world_size, ranks[0].count, len(ranks[0].micro_batches), ranks[0].lr)
            )
            state = after_step(state, ranks[0].count, ranks[0].lr)
        seen.append(counts)
        state = next_epoch(state)
    return seen, steps


@pytest.mark.parametrize("policy", BATCH_POLICIES)
@pytest.mark.parametrize("seed", range(8))
def test_no_sample_of_an_epoch_is_skipped_or_repeated_across_resizes(
    policy: str, seed: int
) -> None:
    rng = random.Random(seed)
    epoch_size = rng.randrange(200, 700)
    settings = BatchSettings(
        policy_name(policy),
        worker_batch=rng.randrange(8, 40),
        lr=0.1,
        reference_workers=rng.randrange(1, 5),
        warmup_steps=rng.randrange(0, 5),
        max_worker_batch=rng.choice([None, 5, 13]),
    )
    worlds = [rng.randrange(1, 9) for _ in range(rng.randrange(1, 30))]
    seen, _ = run_epochs(settings, epoch_size, worlds, epochs=3, seed=seed)
    for counts in seen:
        assert counts == Counter(range(epoch_size)), "each sample exactly once per epoch"


@pytest.mark.parametrize("worlds", [[2, 1, 2], [4, 2, 1], [1, 2, 4], [3, 5, 64, 7]])
def test_preserve_batch_steps_are_the_same_at_every_world_size(worlds: list[int]) -> None:
    settings = BatchSettings(
        "preserve-batch", 32, 0.1, reference_workers=2, warmup_steps=3, max_worker_batch=20
    )
    epoch_size = 1000
    _, steps = run_epochs(settings, epoch_size, worlds, epochs=2)
    full = [step for step in steps if step[1] == 64]
    # Full steps everywhere but the last of each epoch (1000 = 15 * 64 + 40).
    assert len(full) == 2 * 15
    assert [step[1] for step in steps if step[1] != 64] == [40, 40]
    assert {step[3] for step in steps} == {0.1}
    # Accumulation follows the world size: a 64-sample share needs 4 micro-batches of
    # at most 20, a 32-sample one 2, 16 one.
    expected = {1: 4, 2: 2, 3: 2, 4: 1, 5: 1, 7: 1, 64: 1}
    for world, _, micros, _ in full:
        assert micros == expected[world]


def test_naive_global_batch_follows_the_world() -> None:
    settings = BatchSettings("naive", 10, 0.1)
    _, steps = run_epochs(settings, 100, [1, 2, 4], epochs=1)
    assert [(world, count) for world, count, _, _ in steps] == [
        (1, 10),
        (2, 20),
        (4, 40),
        (1, 10),
        (2, 20),
    ]
