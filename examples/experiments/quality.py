"""One training run of the accuracy study, and its in-process simulation of k workers.

The model, the loss and the cut of every step are the ones `train_quality.py` uses under
`horovodrun`; only the world differs. Simulated, the k workers of a step run one after
another in this process: each computes the gradient of the sum of its micro-batches'
losses divided by the step's global sample count, and the gradients add up in `.grad`,
which is what `herd.sum_gradients` (an allreduce with Sum) gives k real workers. So the
update is the same function of the same samples; what differs is the order of float
additions (a few ulps) and that real resizes happen when Horovod notices them, not at
an exact sample count.
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
    after_step,
    epoch_order,
    next_epoch,
    next_step,
    on_world,
)


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
    """The sample budget, in epochs of the training split: the same for every run."""
    worker_batch: int = 32
    lr: float = 0.05
    reference_workers: int = 1
    warmup_steps: int = 20
    max_worker_batch: int | None = None
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

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "config": asdict(self.config)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RunResult:
        values = dict(data)
        values["config"] = RunConfig(**values["config"])  # type: ignore[arg-type]
        values["curve"] = [tuple(point) for point in values["curve"]]  # type: ignore[attr-defined]
        values["worlds"] = [tuple(point) for point in values["worlds"]]  # type: ignore[attr-defined]
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


def decay_factor(config: RunConfig, seen: int, budget: int) -> float:
    """The cosine decay's factor after `seen` of `budget` samples (1 without decay)."""
    if not config.decay:
        return 1.0
    return 0.5 * (1.0 + math.cos(math.pi * min(seen, budget) / budget))


def checkpoints(budget: int, evaluations: int) -> list[int]:
    return [round(budget * (index + 1) / evaluations) for index in range(evaluations)]


def simulate(
    config: RunConfig,
    data: Split,
    *,
    world_at: Callable[[int], int] | None = None,
) -> RunResult:
    """Train `config` with its schedule's world sizes simulated in this process."""
    started = time.monotonic()
    torch.set_num_threads(1)
    settings = config.settings()
    epoch_size = len(data.y_train)
    budget = config.epochs * epoch_size
    schedule = schedule_for(config)
    if world_at is None:

        def world_at(seen: int) -> int:
            return schedule.world_at(seen / budget)

    model = make_model(data.features, data.classes, config.hidden, config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    result = RunResult(config, "simulated", 0.0)
    marks = checkpoints(budget, config.evaluations)
    state, seen = BatchState(), 0
    while state.epoch < config.epochs:
        order = epoch_order(epoch_size, config.seed, state.epoch)
        while True:
            world = world_at(seen)
            if world != state.world_size:
                result.worlds.append((seen, world))
            state = on_world(settings, state, world)
            parts = [next_step(settings, state, order, rank) for rank in range(world)]
            if parts[0] is None:
                break
            optimizer.zero_grad()
            for part in parts:
                assert part is not None
                accumulate(model, data, part)
            step = parts[0]
            for group in optimizer.param_groups:
                group["lr"] = step.lr * decay_factor(config, seen, budget)
            optimizer.step()
            state = after_step(state, step.count, step.lr)
            seen += step.count
            result.steps += 1
            while marks and seen >= marks[0]:
                result.curve.append((marks.pop(0), accuracy(model, data)))
        state = next_epoch(state)
    result.final_accuracy = result.curve[-1][1]
    result.seconds = time.monotonic() - started
    return result


def gap(values: Sequence[float]) -> float:
    return max(values) - min(values) if values else 0.0
