"""The accuracy study's `memory` schedule: the memory model's arithmetic, and that the world
sizes come from the operator's own `memory` policy (its thresholds, step, cooldown)."""

from __future__ import annotations

from typing import Any

import pytest

from examples.experiments.memory_schedule import (
    GIB,
    MemoryModel,
    memory_decisions,
    memory_job,
    memory_phases,
)
from herd_operator.agent.batching import BatchPolicyName, BatchSettings, plan_batches
from herd_operator.policies.base import PolicyError

EPOCHS = 6  # the study's sample budget


def settings(policy: BatchPolicyName, max_worker_batch: int | None = None) -> BatchSettings:
    return BatchSettings(policy, 32, 0.05, warmup_steps=20, max_worker_batch=max_worker_batch)


def test_one_gpu_holds_the_fixed_part_and_its_largest_micro_batch() -> None:
    model = MemoryModel()
    assert model.gpu_used(32) == 39 * GIB
    assert model.gpu_used(16) == 31 * GIB
    assert model.gpu_used(0) == 23 * GIB
    # preserve-batch at 3 workers: shares 11, 11, 10 of the global 32.
    assert model.usage(plan_batches(settings("preserve-batch"), 3)) == (
        3 * 23 * GIB + 32 * GIB // 2,
        3 * 40 * GIB,
    )
    # Accumulation: a share of 32 in micro-batches of at most 12 is 3 of 11, 11, 10.
    accumulated = plan_batches(settings("preserve-batch", max_worker_batch=12), 1)
    assert model.usage(accumulated) == (23 * GIB + 11 * GIB // 2, 40 * GIB)


def test_only_preserve_batch_frees_memory_per_gpu_as_the_job_grows() -> None:
    model = MemoryModel()
    for policy in ("naive", "linear-lr"):
        levels = {
            model.utilization(plan_batches(settings(policy), world)) for world in (1, 2, 3, 4)
        }
        assert levels == {39 / 40}, policy
    preserved = [
        model.utilization(plan_batches(settings("preserve-batch"), world)) for world in (1, 2, 3, 4)
    ]
    assert preserved == [39 / 40, 31 / 40, 85 / 120, 27 / 40]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fixed_bytes": -1}, "MemoryModel.fixed_bytes must be >= 0, got -1"),
        ({"bytes_per_sample": -5}, "MemoryModel.bytes_per_sample must be >= 0, got -5"),
        ({"gpu_bytes": 0}, "MemoryModel.gpu_bytes must be > 0"),
    ],
)
def test_a_bad_memory_model_is_refused_by_field(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MemoryModel(**fields)


def test_a_micro_batch_that_does_not_fit_is_an_error_not_a_utilization_above_one() -> None:
    message = r"a micro-batch of 40 needs 43\.00 GiB, more than the 40\.00 GiB GPU"
    with pytest.raises(ValueError, match=message):
        MemoryModel().gpu_used(40)


def test_naive_grows_to_max_because_its_memory_per_gpu_never_falls() -> None:
    decisions = memory_decisions(settings("naive"), EPOCHS)
    assert [(d.epoch, d.world, d.gpus) for d in decisions] == [
        (-1, 0, 1),
        (0, 1, 2),
        (1, 2, 3),
        (2, 3, 4),
        (3, 4, 4),
        (4, 4, 4),
    ]
    # The policy's own words, so the policy (not a copy of its rule) decided.
    assert decisions[1].reason == "memory 0.98 > 0.75 over epoch 0: 1 -> 2"
    assert decisions[-1].reason == "memory 0.98 > 0.75 over epoch 4: at max 4"
    assert memory_phases(settings("naive"), EPOCHS) == (
        (0.0, 1),
        (1 / 6, 2),
        (2 / 6, 3),
        (3 / 6, 4),
    )


def test_preserve_batch_settles_where_its_shares_fit() -> None:
    decisions = memory_decisions(settings("preserve-batch"), EPOCHS)
    assert [d.gpus for d in decisions] == [1, 2, 3, 3, 3, 3]
    assert decisions[2].reason == "memory 0.77 > 0.75 over epoch 1: 2 -> 3"
    assert decisions[3].reason == "memory 0.71 within [0.25, 0.75] over epoch 2: holding 3"
    assert memory_phases(settings("preserve-batch"), EPOCHS) == ((0.0, 1), (1 / 6, 2), (2 / 6, 3))


@pytest.mark.parametrize(
    ("params", "policy", "phases"),
    [
        # A high threshold above 0.975: the full GPU is "fine", the job never grows.
        ({"initial": "min", "high": 0.98}, "naive", ((0.0, 1),)),
        # A band that holds 0.775: preserve-batch stops at 2 workers.
        ({"initial": "min", "low": 0.72, "high": 0.9}, "preserve-batch", ((0.0, 1), (1 / 6, 2))),
        # A low threshold above 0.71: at 3 workers it gives one back, at 2 it asks again.
        (
            {"initial": "min", "low": 0.72},
            "preserve-batch",
            ((0.0, 1), (1 / 6, 2), (2 / 6, 3), (3 / 6, 2), (4 / 6, 3), (5 / 6, 2)),
        ),
        # Two full epochs between decisions; steps of 2 GPUs; a start at the max.
        ({"initial": "min", "cooldownEpochs": 2}, "naive", ((0.0, 1), (2 / 6, 2), (4 / 6, 3))),
        ({"initial": "min", "step": 2}, "naive", ((0.0, 1), (1 / 6, 3), (2 / 6, 4))),
        ({}, "naive", ((0.0, 4),)),
    ],
)
def test_the_policys_params_decide(
    params: dict[str, Any], policy: BatchPolicyName, phases: tuple[tuple[float, int], ...]
) -> None:
    job = memory_job(params=params)
    assert memory_phases(settings(policy), EPOCHS, job=job) == phases


def test_bad_policy_params_name_the_field() -> None:
    with pytest.raises(PolicyError, match=r"spec.policy.params: low \(0.9\) must be below high"):
        memory_decisions(settings("naive"), EPOCHS, job=memory_job(params={"low": 0.9}))
