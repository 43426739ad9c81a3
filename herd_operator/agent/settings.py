"""The batch settings a training script declares, with what the job's spec chose on top
(`batch_settings`): the `HERD_*` variables the operator sets from `spec.training` win over
the script's own arguments, so one script runs in any mode. Apart from `training.py`, which
cuts the steps by them, because it is the one part of the worker API read once, at start.
"""

from __future__ import annotations

import os

from herd_operator.agent.batching import BatchPolicyName, BatchSettings, policy_name
from herd_operator.environment import (
    BATCH_POLICY_ENV,
    MAX_BATCH_ENV,
    MAX_WORKER_BATCH_ENV,
    MEASURE_STEPS_ENV,
    WARMUP_STEPS_ENV,
)
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None


def batch_settings(
    worker_batch: int,
    lr: float,
    *,
    policy: BatchPolicyName | None = None,
    reference_workers: int = 1,
    warmup_steps: int = 0,
    max_worker_batch: int | None = None,
    max_batch: int | None = None,
    measure_steps: int = DEFAULT_MEASURE_STEPS,
) -> BatchSettings:
    """The script's batch settings, with what the job's spec chose on top.

    `spec.training` reaches the workers as HERD_BATCH_POLICY, HERD_WARMUP_STEPS,
    HERD_MAX_WORKER_BATCH, HERD_MAX_BATCH and HERD_MEASURE_STEPS; each one set there wins
    over the argument here, so one script runs in any mode. Without either, the policy is
    `naive`.
    """
    chosen = os.environ.get(BATCH_POLICY_ENV)
    warmup = _env_int(WARMUP_STEPS_ENV)
    limit = _env_int(MAX_WORKER_BATCH_ENV)
    largest = _env_int(MAX_BATCH_ENV)
    measure = _env_int(MEASURE_STEPS_ENV)
    return BatchSettings(
        policy=policy_name(chosen) if chosen else (policy or "naive"),
        worker_batch=worker_batch,
        lr=lr,
        reference_workers=reference_workers,
        warmup_steps=warmup_steps if warmup is None else warmup,
        max_worker_batch=max_worker_batch if limit is None else limit,
        max_batch=max_batch if largest is None else largest,
        measure_steps=measure_steps if measure is None else measure,
    )
