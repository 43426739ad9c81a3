"""The `memory` schedule: the world sizes the operator's `memory` policy picks for a run.

The policy (`policies/memory.py`, loaded through the policy registry with its params
validated as a spec's are) decides on the job's GPU memory utilization averaged over its
last epoch. The study's MLP uses kilobytes of a GPU, which would never move it, so the
signal comes from a stated memory model instead (`MemoryModel`): each GPU holds a fixed
part (weights, gradients, optimizer state, workspace) plus a part per sample in flight,
times the largest micro-batch that GPU computes. That depends only on the batch policy's
plan at each world size, not on the training, so the whole schedule is known before the
run starts: `memory_decisions` replays the operator's loop at each epoch end (an epoch
report and that epoch's memory samples in, a decision out) and `memory_phases` turns the
decisions into the study's `(fraction of the budget, workers)` phases. A resize takes
effect at the epoch boundary where it is decided (the operator's takes some seconds more).
The model and the policy's params are constants here, not part of a run's configuration:
a study that changes them needs a new `--out`, or its runs.jsonl would mix the two.

What the batch mode does to the signal: under `naive` and `linear-lr` each worker keeps
its batch, so the memory one GPU uses is the same at every world size and a resize never
changes the policy's input; under `preserve-batch` each worker's share, and with it its
memory, falls as the job grows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from herd_operator.agent.batching import BatchPlan, BatchSettings, micro_batches, plan_batches
from herd_operator.policies.base import JobObservations
from herd_operator.policies.registry import load_policy
from herd_operator.specs import HerdJob
from herd_operator.specs.values import Report, UsageSample

GIB = 1 << 30
MEMORY_SCHEDULE = "memory"


@dataclass(frozen=True)
class MemoryModel:
    """Bytes in use on one GPU: `fixed_bytes + bytes_per_sample x micro-batch`.

    The defaults describe a large model on a 40 GiB GPU (the A100s of the thesis's
    Perlmutter nodes): 23 GiB that do not depend on the batch and 0.5 GiB per sample in
    flight, so a micro-batch of 32 fills 97.5% of the GPU, 16 fills 77.5%, 11 fills 71%
    and 8 fills 67.5%. With the policy's default thresholds (0.25, 0.75) that makes a job
    that trains 32 samples per step on one GPU ask for more GPUs, and lets a
    preserve-batch job settle where its shares fit (3 workers, shares 11/11/10)."""

    gpu_bytes: int = 40 * GIB
    fixed_bytes: int = 23 * GIB
    bytes_per_sample: int = GIB // 2

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "fixed_bytes", "bytes_per_sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"MemoryModel.{name} must be >= 0, got {getattr(self, name)}")
        if self.gpu_bytes == 0:
            raise ValueError("MemoryModel.gpu_bytes must be > 0")

    def gpu_used(self, micro_batch: int) -> int:
        """Bytes in use on a GPU whose largest micro-batch is `micro_batch` samples."""
        used = self.fixed_bytes + self.bytes_per_sample * micro_batch
        if used > self.gpu_bytes:
            raise ValueError(
                f"a micro-batch of {micro_batch} needs {used / GIB:.2f} GiB, more than the "
                f"{self.gpu_bytes / GIB:.2f} GiB GPU"
            )
        return used

    def usage(self, plan: BatchPlan) -> tuple[int, int]:
        """(bytes used, bytes in all) summed over the job's GPUs, as the operator samples it."""
        used = sum(
            self.gpu_used(max(micro_batches(share, plan.accumulation_steps)))
            for share in plan.worker_batches
        )
        return used, self.gpu_bytes * plan.world_size

    def utilization(self, plan: BatchPlan) -> float:
        used, total = self.usage(plan)
        return used / total


MEMORY_POLICY_PARAMS: Mapping[str, Any] = MappingProxyType({"initial": "min"})
"""The `memory` policy's params in the study (camelCase, as in a spec): its defaults
(low 0.25, high 0.75, step 1, cooldownEpochs 1, cooldownSeconds 30), but starting at the
job's minimum, so that the policy has room to grow it."""
MEMORY_GPUS = (1, 4)
"""The job's `spec.gpus` min and max: the study's world sizes."""
EPOCH_SECONDS = 600.0
"""The virtual length of an epoch: longer than `cooldownSeconds`, so the epoch cooldown is
the one that waits (the decision comes at every epoch end)."""
SAMPLE_SECONDS = 1.0
"""How often the GPUs' memory is sampled: every second, as the operator does
(`sample_seconds`, docs/observability.md)."""


@dataclass(frozen=True)
class MemoryDecision:
    """The policy's answer at one epoch end (epoch -1: the start)."""

    epoch: int
    world: int
    """Workers during that epoch (0 at the start)."""
    utilization: float | None
    """The epoch's memory utilization, as the policy read it (None at the start)."""
    gpus: int
    """The workers the policy wants for the next epoch."""
    reason: str


def memory_job(
    gpus: tuple[int, int] = MEMORY_GPUS, params: Mapping[str, Any] | None = None
) -> HerdJob:
    """The study's job as the operator would read it from a spec."""
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "accuracy-study"},
            "spec": {
                "command": ["python", "-m", "examples.experiments.train_quality"],
                "gpus": {"min": gpus[0], "max": gpus[1]},
                "policy": {
                    "name": "memory",
                    "params": dict(MEMORY_POLICY_PARAMS if params is None else params),
                },
            },
        }
    )


def memory_decisions(
    settings: BatchSettings,
    epochs: int,
    *,
    model: MemoryModel | None = None,
    job: HerdJob | None = None,
) -> list[MemoryDecision]:
    """The `memory` policy's decision at the start and at each epoch end but the last.

    Each epoch end gives the policy what the operator would have by then: the workers'
    epoch reports and the memory samples of the run, the epoch's all at the epoch's world
    size (the memory model is constant while the world is)."""
    model = model or MemoryModel()
    job = job or memory_job()
    policy = load_policy(job.spec.policy)
    reports: list[Report] = []
    usage: list[UsageSample] = []
    start = policy.desired(job, JobObservations(started_at=0.0, allocated=0), 0.0)
    decisions = [MemoryDecision(-1, 0, None, start.gpus, start.reason)]
    world, last_resize = start.gpus, None
    for epoch in range(epochs - 1):
        begin, end = epoch * EPOCH_SECONDS, (epoch + 1) * EPOCH_SECONDS
        plan = plan_batches(settings, world)
        used, total = model.usage(plan)
        time = begin + SAMPLE_SECONDS
        while time <= end:
            usage.append(UsageSample(time, world, used, total))
            time += SAMPLE_SECONDS
        reports.append(Report(epoch, end, world))
        observed = JobObservations(
            started_at=0.0,
            allocated=world,
            world_size=world,
            last_resize=last_resize,
            epochs=tuple(reports),
            usage=tuple(usage),
        )
        decision = policy.desired(job, observed, end)
        decisions.append(MemoryDecision(epoch, world, used / total, decision.gpus, decision.reason))
        if decision.gpus != world:
            world, last_resize = decision.gpus, end
    return decisions


def memory_phases(
    settings: BatchSettings,
    epochs: int,
    *,
    model: MemoryModel | None = None,
    job: HerdJob | None = None,
) -> tuple[tuple[float, int], ...]:
    """The decisions as the study's phases: `(fraction of the budget, workers from there)`,
    each change at the epoch boundary where it was decided."""
    decisions = memory_decisions(settings, epochs, model=model, job=job)
    phases = [(0.0, decisions[0].gpus)]
    for decision in decisions[1:]:
        if decision.gpus != phases[-1][1]:
            phases.append(((decision.epoch + 1) / epochs, decision.gpus))
    return tuple(phases)


def main() -> None:
    """Print the study's memory schedule for each batch mode, decision by decision."""
    from examples.experiments.quality import RunConfig

    base = RunConfig()
    for policy in ("naive", "linear-lr", "preserve-batch"):
        config = RunConfig(policy=policy, schedule=MEMORY_SCHEDULE)
        settings = config.settings()
        print(f"{policy} ({base.epochs} epochs):")
        for decision in memory_decisions(settings, base.epochs):
            where = "start" if decision.epoch < 0 else f"end of epoch {decision.epoch}"
            print(f"  {where}: {decision.reason}")
        print(f"  phases: {memory_phases(settings, base.epochs)}")


if __name__ == "__main__":
    main()
