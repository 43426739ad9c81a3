"""One training run of the accuracy study, and its in-process simulation of k workers.

The model, the loss and the cut of every step are the ones `train_quality.py` uses under
`horovodrun`; only the world differs. Simulated, the k workers of a step run one after
another in this process: each computes the gradient of the sum of its micro-batches'
losses divided by the step's global sample count, and the gradients add up in `.grad`,
which is what `herd.sum_gradients` (an allreduce with Sum) gives k real workers. So the
update is the same function of the same samples; what differs is the order of float
additions (a few ulps) and that real resizes happen when Horovod notices them, not at
an exact sample count.

The `adaptive` batch policy needs two things the other policies do not. The noise scale:
each simulated worker's gradient is kept apart from the others' (the difference of `.grad`
around its part), which is what the worker API's `sum_gradients` measures before and after
the allreduce. And the operator's choice of batch: at the start of every epoch (where the
real operator's decision, made on the last epoch's report, reaches the workers), the batch
is the one the `goodput` policy's `choose_batch` picks for the world size, from the
measured noise scale and `STUDY_STEP_TIME`, within `max_batch`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from examples.experiments.data import Split
from examples.experiments.memory_schedule import MEMORY_SCHEDULE, memory_phases
from herd_operator.agent.batching import (
    BatchPolicyName,
    BatchSettings,
    BatchState,
    Step,
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
)
from herd_operator.policies.goodput import BatchProfile, StepTime, choose_batch

STUDY_STEP_TIME = StepTime(fixed=0.02, per_sample=0.00025)
"""The step time the adaptive runs' batch choice assumes (the study measures no time): 20 ms
per step whatever its size (synchronization, the optimizer) and 0.25 ms per sample per GPU,
so that a larger batch has something to gain and the noise scale decides how much."""


@dataclass(frozen=True)
class Schedule:
    """World sizes over a run: `(fraction of the sample budget, workers from there on)`."""

    name: str
    phases: tuple[tuple[float, int], ...]

    def world_at(self, fraction: float) -> int:
        world = self.phases[0][1]
        for start, workers in self.phases:
            if fraction >= start:
                world = workers
        return world

    @property
    def max_workers(self) -> int:
        return max(workers for _, workers in self.phases)


SCHEDULES = {
    schedule.name: schedule
    for schedule in [
        Schedule("static-1", ((0.0, 1),)),
        Schedule("static-2", ((0.0, 2),)),
        Schedule("static-4", ((0.0, 4),)),
        Schedule("up-1-2-4", ((0.0, 1), (1 / 3, 2), (2 / 3, 4))),
        Schedule("down-4-2-1", ((0.0, 4), (1 / 3, 2), (2 / 3, 1))),
        Schedule("bounce-2-1-2", ((0.0, 2), (1 / 3, 1), (2 / 3, 2))),
    ]
}
SCHEDULE_NAMES = (*SCHEDULES, MEMORY_SCHEDULE)
"""Every schedule a run can name: the fixed ones, and `memory`, whose world sizes the
operator's memory policy chooses for each configuration (`schedule_for`)."""


@dataclass(frozen=True)
class RunConfig:
    dataset: str = "blobs"
    policy: BatchPolicyName = "naive"
    schedule: str = "static-1"
    seed: int = 0
    epochs: int = 6
    """The training budget, in epochs of the training split: the same for every run. Passes
    over the data, but under the adaptive policy, whose epochs are AdaScale progress (the
    fixed-batch run's optimizer steps; `batching.trained_epochs`)."""
    worker_batch: int = 32
    lr: float = 0.05
    reference_workers: int = 1
    warmup_steps: int = 20
    max_worker_batch: int | None = None
    max_batch: int | None = None
    """adaptive: the largest global batch the policy may pick."""
    momentum: float = 0.9
    decay: bool = True
    """Cosine decay of the rate over the sample budget, on top of the batch policy's rate:
    without it the last evaluation of a noisy task depends on where it falls."""
    hidden: int = 128
    evaluations: int = 12
    """Test-set evaluations over the run (the curve's points), the last one at the end."""

    def settings(self) -> BatchSettings:
        return BatchSettings(
            self.policy,
            self.worker_batch,
            self.lr,
            reference_workers=self.reference_workers,
            warmup_steps=self.warmup_steps,
            max_worker_batch=self.max_worker_batch,
            max_batch=self.max_batch,
        )


def schedule_for(config: RunConfig) -> Schedule:
    """The world sizes `config` trains at: a fixed schedule, or the `memory` policy's
    decisions for its batch mode (`memory_schedule.memory_phases`)."""
    if config.schedule == MEMORY_SCHEDULE:
        return Schedule(MEMORY_SCHEDULE, memory_phases(config.settings(), config.epochs))
    schedule = SCHEDULES.get(config.schedule)
    if schedule is None:
        raise ValueError(
            f"unknown schedule {config.schedule!r}: one of {', '.join(SCHEDULE_NAMES)}"
        )
    return schedule


@dataclass
class RunResult:
    config: RunConfig
    engine: str
    final_accuracy: float
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(samples seen, test accuracy)."""
    steps: int = 0
    worlds: list[tuple[int, int]] = field(default_factory=list)
    """(samples seen, world size) at each change of world size."""
    seconds: float = 0.0
    batches: list[tuple[int, int]] = field(default_factory=list)
    """adaptive: (samples seen, global batch) at each change of global batch."""
    samples: int = 0
    """Samples trained on (0 in a record made before it was kept)."""

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "config": asdict(self.config)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RunResult:
        values = dict(data)
        values["config"] = RunConfig(**values["config"])  # type: ignore[arg-type]
        values["curve"] = [tuple(point) for point in values["curve"]]  # type: ignore[attr-defined]
        values["worlds"] = [tuple(point) for point in values["worlds"]]  # type: ignore[attr-defined]
        values["batches"] = [tuple(p) for p in values.get("batches", [])]  # type: ignore[attr-defined]
        return cls(**values)  # type: ignore[arg-type]


def make_model(features: int, classes: int, hidden: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


def accumulate_measured(
    model: nn.Module, data: Split, settings: BatchSettings, state: BatchState, parts: list[Step]
) -> BatchState:
    """`accumulate` every simulated worker's part; under the adaptive policy, with the
    noise scale measured as the worker API does (full steps with equal shares only)."""
    plan = plan_batches(settings, state.world_size, state.global_batch)
    shares = {len(part.indices) for part in parts}
    measure = (
        settings.policy == "adaptive"
        and len(parts) > 1
        and parts[0].count == plan.global_batch
        and len(shares) == 1
    )
    params = [param for param in model.parameters() if param.requires_grad]
    local_sqr = 0.0
    for part in parts:
        before = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params]
        accumulate(model, data, part)
        if measure:
            own = sum(
                float((p.grad - b).double().pow(2).sum())
                for p, b in zip(params, before, strict=True)
            )
            local_sqr += own * (part.count / len(part.indices)) ** 2
    if not measure:
        return state
    (share,) = shares
    global_sqr = sum(float(p.grad.double().pow(2).sum()) for p in params)
    return after_gradients(
        settings, state, local_sqr / len(parts), global_sqr, share, parts[0].count
    )


def study_decision(config: RunConfig, state: BatchState) -> BatchState:
    """adaptive: the batch the goodput policy picks for the world size, from the noise
    scale measured so far (none before a measurement)."""
    settings = config.settings()
    noise = state.noise.noise_scale()
    if settings.policy != "adaptive" or noise is None:
        return state
    profile = BatchProfile(
        base_batch=settings.reference_batch,
        noise_scale=noise,
        step_time=STUDY_STEP_TIME,
        max_batch=settings.max_batch,
        max_worker_batch=settings.max_worker_batch,
    )
    decided = (state.world_size, choose_batch(state.world_size, profile))
    return on_decision(settings, state, decided)


def accumulate(model: nn.Module, data: Split, step: Step) -> float:
    """Add this rank's part of the step's mean-loss gradient to `.grad`; its summed loss."""
    total = 0.0
    for micro in step.micro_batches:
        index = torch.tensor(micro, dtype=torch.long)
        loss = F.cross_entropy(model(data.x_train[index]), data.y_train[index], reduction="sum")
        (loss / step.count).backward()
        total += float(loss.detach())
    return total


@torch.no_grad()
def accuracy(model: nn.Module, data: Split) -> float:
    model.eval()
    predicted = model(data.x_test).argmax(dim=1)
    model.train()
    return float((predicted == data.y_test).float().mean())


def decay_factor(config: RunConfig, done: float) -> float:
    """The cosine decay's factor once the share `done` of the training budget is trained
    (1 without decay). The share is `position / budget` of the run's position and budget."""
    if not config.decay:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))


def budget_units(config: RunConfig, epoch_size: int) -> int:
    """The training budget in the unit `position` counts: samples, but under the adaptive
    policy AdaScale progress (base-batch steps), which is what its schedule and its rate's
    decay follow (a step at gain r makes r base steps of progress)."""
    if config.policy == "adaptive":
        return config.epochs * base_epoch_steps(config.settings(), epoch_size)
    return config.epochs * epoch_size


def position(config: RunConfig, state: BatchState, epoch_size: int) -> float:
    """How far a run is, in `budget_units`' unit."""
    if config.policy == "adaptive":
        return state.progress
    return state.data_pass * epoch_size + state.cursor  # whole: the decay as before


def checkpoints(budget: int, evaluations: int) -> list[int]:
    return [round(budget * (index + 1) / evaluations) for index in range(evaluations)]


def simulate(
    config: RunConfig,
    data: Split,
    *,
    world_at: Callable[[float], int] | None = None,
) -> RunResult:
    """Train `config` with its schedule's world sizes simulated in this process (`world_at`:
    the world size at a position, in `budget_units`, instead of the schedule's)."""
    started = time.monotonic()
    torch.set_num_threads(1)
    settings = config.settings()
    epoch_size = len(data.y_train)
    budget = budget_units(config, epoch_size)
    schedule = schedule_for(config)
    if world_at is None:

        def world_at(at: float) -> int:
            return schedule.world_at(at / budget)

    model = make_model(data.features, data.classes, config.hidden, config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    result = RunResult(config, "simulated", 0.0)
    marks = checkpoints(budget, config.evaluations)
    state, seen = BatchState(), 0
    while state.epoch < config.epochs:
        order = epoch_order(epoch_size, config.seed, state.data_pass)
        start = True  # the operator's decision reaches the workers at an epoch's start
        while not epoch_over(settings, state, epoch_size):
            if state.cursor >= epoch_size:  # adaptive: the epoch goes on in the next pass
                state = next_pass(state)
                order = epoch_order(epoch_size, config.seed, state.data_pass)
            at = position(config, state, epoch_size)
            world = world_at(at)
            if world != state.world_size:
                result.worlds.append((seen, world))
            state = on_world(settings, state, world)
            if start:
                state, start = study_decision(config, state), False
            batch = plan_batches(settings, world, state.global_batch).global_batch
            if settings.policy == "adaptive" and (
                not result.batches or result.batches[-1][1] != batch
            ):
                result.batches.append((seen, batch))
            parts = [next_step(settings, state, order, rank) for rank in range(world)]
            steps = [part for part in parts if part is not None]
            optimizer.zero_grad()
            state = accumulate_measured(model, data, settings, state, steps)
            step = steps[0]
            for group in optimizer.param_groups:
                group["lr"] = step.lr * decay_factor(config, at / budget)
            optimizer.step()
            state = after_step(state, step.count, step.lr, step_gain(settings, state, step.count))
            seen += step.count
            result.steps += 1
            at = position(config, state, epoch_size)
            while marks and at >= marks[0] - 1e-9:
                mark = marks.pop(0)  # labelled by its samples (adaptive: those seen)
                label = seen if config.policy == "adaptive" else mark
                result.curve.append((label, accuracy(model, data)))
        state = next_epoch(state, settings)
    result.final_accuracy = result.curve[-1][1]
    result.samples = seen
    result.seconds = time.monotonic() - started
    return result


def gap(values: Sequence[float]) -> float:
    return max(values) - min(values) if values else 0.0
