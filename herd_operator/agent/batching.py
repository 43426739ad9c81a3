"""Batch arithmetic of elastic training: pure functions, no torch, no Horovod.

Elastic Horovod keeps each worker's batch when the world resizes, so the global batch,
and with it the effective learning rate, changes with every resize. Four policies:

- ``naive``: the per-worker batch and the learning rate stay as given; the global batch
  is ``worker_batch * world_size`` (what Elastic Horovod does by itself).
- ``linear-lr``: as naive, but the learning rate follows the global batch linearly
  (Goyal et al. 2017), ramped from the rate in effect to the new one over
  ``warmup_steps`` optimizer steps after each resize.
- ``preserve-batch``: the global batch and the learning rate never change; each resize
  recomputes every worker's share of the global batch (uneven when it does not divide)
  and, past ``max_worker_batch``, the number of gradient-accumulation micro-batches.
- ``adaptive``: the global batch is the one the operator picked for the job's GPUs (Pollux's
  goodput), cut as preserve-batch cuts it; the rate is ``lr`` times AdaScale's gain ratio
  at that batch, from the gradient noise scale the workers measure (``adaptive.py``).

Every worker computes the same answers from the same inputs, so they agree without
talking. The position in an epoch is a global cursor into that epoch's permutation:
each optimizer step takes the next ``global_batch`` samples (fewer at the end of an
epoch), and worker ``r`` of ``k`` takes a contiguous share of them. A resize only changes
how the next step is cut, so no sample of an epoch is skipped or taken twice.

Under ``adaptive`` an epoch is not a pass over the data: it is one base epoch of AdaScale
progress, ``ceil(epoch_size / base batch)`` optimizer steps at the base batch's gain of 1
(`base_epoch_steps`). A step at a larger batch counts its gain ratio r (in [1, batch /
base]), so a run of ``epochs`` epochs trains until its progress equals the step count of
the fixed-batch run (Johnson et al. 2020, Pollux), whatever samples that takes. The data
is still drawn pass after pass (`BatchState.data_pass`, `next_pass`); an epoch's end falls
within a pass and the next epoch goes on from there.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from herd_operator.agent.adaptive import (
    NoiseEstimate,
    batch_for_world,
    gain_ratio,
    update_noise,
)
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS

BatchPolicyName = Literal["naive", "linear-lr", "preserve-batch", "adaptive"]
BATCH_POLICIES: Final[tuple[BatchPolicyName, ...]] = (
    "naive",
    "linear-lr",
    "preserve-batch",
    "adaptive",
)
MAX_WORLD_SIZE: Final = 1 << 20


def policy_name(text: str) -> BatchPolicyName:
    """`text` as a batch policy name, or ValueError saying which names there are."""
    for name in BATCH_POLICIES:
        if text == name:
            return name
    raise ValueError(f"unknown batch policy {text!r}: one of {', '.join(BATCH_POLICIES)}")


@dataclass(frozen=True)
class BatchSettings:
    """What a training script declares once; the policy decides the rest per world size."""

    policy: BatchPolicyName
    worker_batch: int
    """Samples per worker and optimizer step at `reference_workers` workers."""
    lr: float
    """The learning rate tuned for the reference global batch."""
    reference_workers: int = 1
    """The world size `worker_batch` and `lr` were tuned at."""
    warmup_steps: int = 0
    """linear-lr: optimizer steps over which the rate moves to its new value after a resize."""
    max_worker_batch: int | None = None
    """preserve-batch, adaptive: the largest micro-batch one worker computes at once; a bigger
    share is cut into gradient-accumulation micro-batches. None: no limit (no accumulation)."""
    max_batch: int | None = None
    """adaptive: the largest global batch the job may train at (None: the operator's choice,
    or the base batch per worker when it made none)."""
    measure_steps: int = DEFAULT_MEASURE_STEPS
    """adaptive: the full steps into each new configuration (a start, a reset, a new batch)
    after which rank 0 reports the adaptive metrics (`measure_action`); 0: at epoch ends only."""

    def __post_init__(self) -> None:
        policy_name(self.policy)
        if self.worker_batch < 1:
            raise ValueError(f"worker_batch must be >= 1, got {self.worker_batch}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if not 1 <= self.reference_workers <= MAX_WORLD_SIZE:
            raise ValueError(f"reference_workers must be >= 1, got {self.reference_workers}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.max_worker_batch is not None and self.max_worker_batch < 1:
            raise ValueError(f"max_worker_batch must be >= 1, got {self.max_worker_batch}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {self.max_batch}")
        if self.measure_steps < 0:
            raise ValueError(f"measure_steps must be >= 0, got {self.measure_steps}")

    @property
    def reference_batch(self) -> int:
        """The global batch `lr` was tuned for."""
        return self.worker_batch * self.reference_workers


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step is cut at one world size."""

    world_size: int
    global_batch: int
    worker_batches: tuple[int, ...]
    """Each rank's samples of a full step, in rank order; they add up to `global_batch`."""
    accumulation_steps: int
    """Micro-batches per worker and optimizer step (1: no accumulation)."""
    lr: float
    """The learning rate this world size calls for, once any warm-up is over."""


def split_evenly(total: int, parts: int) -> tuple[int, ...]:
    """`total` cut into `parts` sizes that differ by at most one, the larger first."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    base, extra = divmod(total, parts)
    return tuple(base + 1 if index < extra else base for index in range(parts))


def plan_batches(settings: BatchSettings, world_size: int, adaptive_batch: int = 0) -> BatchPlan:
    """The plan of a full optimizer step at `world_size` workers (`adaptive_batch`: the
    adaptive policy's global batch, 0 for its base batch; the others ignore it). The
    adaptive policy's rate here is `lr`: `step_lr` applies the gain ratio."""
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise ValueError(f"world_size must be between 1 and {MAX_WORLD_SIZE}, got {world_size}")
    if settings.policy in ("preserve-batch", "adaptive"):
        global_batch = settings.reference_batch
        if settings.policy == "adaptive" and adaptive_batch:
            global_batch = adaptive_batch
        if global_batch < world_size:
            raise ValueError(
                f"{settings.policy}: a global batch of {global_batch} cannot give each of "
                f"{world_size} workers a sample"
            )
        shares = split_evenly(global_batch, world_size)
        limit = settings.max_worker_batch
        accumulation = 1 if limit is None else -(-shares[0] // limit)
        return BatchPlan(world_size, global_batch, shares, accumulation, settings.lr)
    global_batch = settings.worker_batch * world_size
    lr = settings.lr
    if settings.policy == "linear-lr":
        lr = settings.lr * global_batch / settings.reference_batch
    return BatchPlan(world_size, global_batch, (settings.worker_batch,) * world_size, 1, lr)


def step_shares(plan: BatchPlan, count: int) -> tuple[int, ...]:
    """Each rank's samples of a step of `count` samples: the plan's shares for a full step,
    the shorter last step of an epoch cut as evenly (a rank may get none)."""
    if count == plan.global_batch:
        return plan.worker_batches
    if not 0 <= count < plan.global_batch:
        raise ValueError(f"a step holds 0..{plan.global_batch} samples, got {count}")
    return split_evenly(count, plan.world_size)


def rank_span(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s samples within its step: the ranks take contiguous runs."""
    if not 0 <= rank < len(shares):
        raise ValueError(f"rank {rank} is not one of {len(shares)} ranks")
    start = sum(shares[:rank])
    return start, start + shares[rank]


def micro_batches(share: int, accumulation_steps: int) -> tuple[int, ...]:
    """One rank's share of a step cut into its gradient-accumulation micro-batches."""
    return split_evenly(share, accumulation_steps)


def step_count(cursor: int, epoch_size: int, global_batch: int) -> int:
    """Samples in the step that starts at `cursor` of an epoch: a full global batch, or the
    rest of the epoch (0 when it is over)."""
    if not 0 <= cursor <= epoch_size:
        raise ValueError(f"cursor {cursor} is outside an epoch of {epoch_size}")
    return min(global_batch, epoch_size - cursor)


def epoch_order(epoch_size: int, seed: int, epoch: int, *, shuffle: bool = True) -> list[int]:
    """The sample order of one epoch, the same on every worker (Horovod's ElasticSampler
    draws it the same way: `random.Random(seed + epoch)`)."""
    order = list(range(epoch_size))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def warmup_lr(start: float, target: float, step: int, warmup_steps: int) -> float:
    """The rate at the `step`-th optimizer step (0-based) after a resize: a straight line
    from `start` that reaches `target` at step `warmup_steps - 1`, then `target`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps <= 0 or step + 1 >= warmup_steps:
        return target
    return start + (target - start) * (step + 1) / warmup_steps


@dataclass(frozen=True)
class BatchState:
    """What the workers commit and share about batching: the same on every rank."""

    epoch: int = 0
    cursor: int = 0
    """Samples of this epoch's order already trained on."""
    world_size: int = 0
    """The world size of the last reset (0: none yet)."""
    lr: float = 0.0
    """The rate of the last optimizer step (0: none yet)."""
    ramp_from: float = 0.0
    """linear-lr: the rate in effect when the world last changed size."""
    steps_since_resize: int = 0
    global_batch: int = 0
    """adaptive: the global batch at this world size (0: the base batch)."""
    decided: tuple[int, int] | None = None
    """adaptive: the operator's last choice, (gpus, global batch) (None: none heard)."""
    noise: NoiseEstimate = field(default_factory=NoiseEstimate)
    """adaptive: the smoothed gradient moments the workers measured."""
    progress: float = 0.0
    """Optimizer steps counted in base-batch steps: each step adds its gain ratio (1 but
    under the adaptive policy), AdaScale's scale-invariant iterations."""
    data_pass: int = 0
    """The pass over the data the cursor is in: its order is `epoch_order(..., data_pass)`.
    The epoch, but under the adaptive policy, whose epochs are progress (see the module)."""

    def to_dict(self) -> dict[str, float | int]:
        gpus, batch = self.decided or (0, 0)
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "world_size": self.world_size,
            "lr": self.lr,
            "ramp_from": self.ramp_from,
            "steps_since_resize": self.steps_since_resize,
            "global_batch": self.global_batch,
            "decided_gpus": gpus,
            "decided_batch": batch,
            "noise_sqr": self.noise.sqr_biased,
            "noise_var": self.noise.var_biased,
            "noise_weight": self.noise.weight,
            "progress": self.progress,
            "data_pass": self.data_pass,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, float | int]) -> BatchState:
        gpus, batch = int(data.get("decided_gpus", 0)), int(data.get("decided_batch", 0))
        return cls(
            epoch=int(data["epoch"]),
            cursor=int(data["cursor"]),
            world_size=int(data["world_size"]),
            lr=float(data["lr"]),
            ramp_from=float(data["ramp_from"]),
            steps_since_resize=int(data["steps_since_resize"]),
            global_batch=int(data.get("global_batch", 0)),
            decided=(gpus, batch) if gpus > 0 and batch > 0 else None,
            noise=NoiseEstimate(
                float(data.get("noise_sqr", 0.0)),
                float(data.get("noise_var", 0.0)),
                float(data.get("noise_weight", 0.0)),
            ),
            progress=float(data.get("progress", 0.0)),
            data_pass=int(data.get("data_pass", data["epoch"])),
        )


def on_world(settings: BatchSettings, state: BatchState, world_size: int) -> BatchState:
    """The state after a (re)start at `world_size`: a change of size starts a warm-up from
    the rate in effect; the first start and a restart at the same size do not. The adaptive
    policy's global batch is set for the world size from the operator's last choice."""
    if settings.policy == "adaptive":
        batch = batch_for_world(
            world_size,
            settings.reference_batch,
            state.decided,
            settings.max_batch,
            settings.max_worker_batch,
        )
        state = replace(state, global_batch=batch)
    plan_batches(settings, world_size, state.global_batch)  # refuses what it cannot serve
    if state.world_size == world_size:
        return state
    if state.world_size == 0:
        lr = plan_batches(settings, world_size, state.global_batch).lr
        return replace(state, world_size=world_size, lr=lr, ramp_from=lr, steps_since_resize=0)
    return replace(state, world_size=world_size, ramp_from=state.lr, steps_since_resize=0)


def on_decision(
    settings: BatchSettings, state: BatchState, decided: tuple[int, int] | None
) -> BatchState:
    """The state once the operator's choice of (gpus, batch) is heard (the adaptive policy
    takes its batch from it at the current world size; the others keep theirs)."""
    if settings.policy != "adaptive" or decided is None or decided == state.decided:
        return state
    state = replace(state, decided=decided)
    return on_world(settings, state, state.world_size) if state.world_size else state


def step_gain(settings: BatchSettings, state: BatchState, count: int | None = None) -> float:
    """The gain ratio of the next step, of `count` samples (None: a full step; the short
    last step of a pass gains less): AdaScale's under the adaptive policy, else 1."""
    if settings.policy != "adaptive":
        return 1.0
    if count is None or count < 1:
        count = plan_batches(settings, state.world_size, state.global_batch).global_batch
    return gain_ratio(state.noise, count, settings.reference_batch)


def step_lr(settings: BatchSettings, state: BatchState, count: int | None = None) -> float:
    """The rate of the next optimizer step (of `count` samples, None: a full one)."""
    target = plan_batches(settings, state.world_size, state.global_batch).lr
    if settings.policy == "adaptive":
        return target * step_gain(settings, state, count)
    if settings.policy != "linear-lr":
        return target
    return warmup_lr(state.ramp_from, target, state.steps_since_resize, settings.warmup_steps)


def after_step(state: BatchState, count: int, lr: float, gain: float = 1.0) -> BatchState:
    """The state once a step of `count` samples at rate `lr` and gain ratio `gain` is done."""
    return replace(
        state,
        cursor=state.cursor + count,
        lr=lr,
        steps_since_resize=state.steps_since_resize + 1,
        progress=state.progress + gain,
    )


def after_gradients(
    settings: BatchSettings,
    state: BatchState,
    local_sqr: float,
    global_sqr: float,
    local: int,
    global_: int,
) -> BatchState:
    """The state once a step's gradient norms are measured (see `adaptive.update_noise`)."""
    noise = update_noise(
        state.noise, local_sqr, global_sqr, local, global_, settings.reference_batch
    )
    return replace(state, noise=noise)


def base_epoch_steps(settings: BatchSettings, epoch_size: int) -> int:
    """Optimizer steps of one epoch at the base batch: an adaptive epoch's progress."""
    if epoch_size < 1:
        raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
    return -(-epoch_size // settings.reference_batch)


def trained_epochs(settings: BatchSettings, state: BatchState, epoch_size: int) -> float:
    """Epochs trained so far, fractional: under the adaptive policy the progress over
    `base_epoch_steps`, else the passes and the share of this one."""
    if settings.policy == "adaptive":
        return state.progress / base_epoch_steps(settings, epoch_size)
    return state.data_pass + state.cursor / epoch_size


def epoch_over(settings: BatchSettings, state: BatchState, epoch_size: int) -> bool:
    """Whether the epoch `state.epoch` has ended: its pass is done, or (adaptive) its
    progress reached the end of the base epoch (a step that crosses it ends it)."""
    if settings.policy == "adaptive":
        # Progress adds floats; a sum that should be whole may fall short by rounding.
        end = (state.epoch + 1) * base_epoch_steps(settings, epoch_size)
        return state.progress >= end - 1e-9
    return state.cursor >= epoch_size


def next_pass(state: BatchState) -> BatchState:
    """The state at the start of the next pass over the data, in the same epoch."""
    return replace(state, data_pass=state.data_pass + 1, cursor=0)


def next_epoch(state: BatchState, settings: BatchSettings | None = None) -> BatchState:
    """The state at the start of the next epoch: the next pass over the data, but under
    the adaptive policy, whose next epoch goes on in the same pass (the epoch of a
    state restored from one without passes counts as its pass)."""
    if settings is not None and settings.policy == "adaptive":
        return replace(state, epoch=state.epoch + 1)
    return replace(state, epoch=state.epoch + 1, data_pass=state.epoch + 1, cursor=0)


MeasureAction = Literal["report", "refresh"]
MEASURE_RETRIES = 3
"""adaptive: how many times more the workers ask for the operator's batch after a measurement
when the answer has not changed (the operator may not have decided yet: it reconciles the job
after the report, and fast steps can outrun it), each after twice the steps of the last."""


def measure_action(
    measure_steps: int, timed_steps: int, measured: bool, reported: bool, asked: int = 0
) -> MeasureAction | None:
    """adaptive: what the workers do once `timed_steps` full steps are timed since the last
    refresh of the batch. "report": rank 0 reports the metrics (`measure_steps` of them, the
    configuration not `measured` yet); "refresh": every rank takes the batch the operator
    picked since (`measure_steps` more after the `reported` one; after `asked` refreshes
    that left the batch as it was, `2 ** asked` times as many); None: go on."""
    if measure_steps < 1:
        return None
    if not measured and timed_steps == measure_steps:
        return "report"
    if reported and timed_steps == 2 * measure_steps * 2**asked:
        return "refresh"
    return None


@dataclass(frozen=True)
class Step:
    """One optimizer step as one rank sees it."""

    epoch: int
    cursor: int
    """Where the step starts in the epoch's order."""
    count: int
    """Samples of the whole step, over all ranks: the divisor of the summed loss."""
    lr: float
    micro_batches: tuple[tuple[int, ...], ...]
    """This rank's sample indices, one tuple per accumulation micro-batch (may be empty)."""

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(index for micro in self.micro_batches for index in micro)


def next_step(
    settings: BatchSettings, state: BatchState, order: Sequence[int], rank: int
) -> Step | None:
    """`rank`'s part of the next step of the epoch in `order`, or None when it is over."""
    plan = plan_batches(settings, state.world_size, state.global_batch)
    count = step_count(state.cursor, len(order), plan.global_batch)
    if count == 0:
        return None
    start, stop = rank_span(step_shares(plan, count), rank)
    mine = order[state.cursor + start : state.cursor + stop]
    micros: list[tuple[int, ...]] = []
    offset = 0
    for size in micro_batches(len(mine), plan.accumulation_steps):
        micros.append(tuple(mine[offset : offset + size]))
        offset += size
    lr = step_lr(settings, state, count)
    return Step(state.epoch, state.cursor, count, lr, tuple(micros))
