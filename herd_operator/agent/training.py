"""Training quality across resizes: the batch policy as a training script uses it.

    from herd_operator import worker as herd

    settings = herd.batch_settings(worker_batch=32, lr=0.05)   # the spec picks the policy
    sampler = herd.elastic_batches(len(dataset), settings, seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler)
    state.register_reset_callbacks([sampler.on_reset])

    for step in sampler.steps():                     # inside @hvd.elastic.run
        optimizer.zero_grad()
        for micro in step.micro_batches:             # gradient accumulation
            loss = loss_fn(model(x[list(micro)]), y[list(micro)], reduction="sum")
            (loss / step.count).backward()           # the step's mean over all ranks
        herd.sum_gradients(model.parameters())       # allreduce with Sum
        sampler.apply_lr(optimizer, step)
        optimizer.step()
        sampler.record_step(step)
        state.commit()
    sampler.set_epoch(sampler.epoch + 1)

The sampler is a Horovod `ElasticSampler`, so `TorchState` saves, restores and
broadcasts it with the model; its state is `BatchState` (the epoch, the cursor in the
epoch's order, the warm-up). The arithmetic lives in `batching.py`, pure, so the same
plan serves any engine and the in-process simulation of the accuracy study.

Gradients are summed, not averaged, over the ranks and divided by the step's global
sample count: ranks with unequal shares (a batch that does not divide, the short last
step of an epoch) then give exactly the mean gradient of the global batch.

torch and Horovod are imported when first needed: importing this module stays light.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from herd_operator.agent.batching import (
    BatchPlan,
    BatchPolicyName,
    BatchSettings,
    BatchState,
    Step,
    after_step,
    epoch_order,
    next_epoch,
    next_step,
    on_world,
    plan_batches,
    policy_name,
)
from herd_operator.environment import BATCH_POLICY_ENV, MAX_WORKER_BATCH_ENV, WARMUP_STEPS_ENV


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
) -> BatchSettings:
    """The script's batch settings, with what the job's spec chose on top.

    `spec.training` reaches the workers as HERD_BATCH_POLICY, HERD_WARMUP_STEPS and
    HERD_MAX_WORKER_BATCH; each one set there wins over the argument here, so one
    script runs in any mode. Without either, the policy is `naive`.
    """
    chosen = os.environ.get(BATCH_POLICY_ENV)
    warmup = _env_int(WARMUP_STEPS_ENV)
    limit = _env_int(MAX_WORKER_BATCH_ENV)
    return BatchSettings(
        policy=policy_name(chosen) if chosen else (policy or "naive"),
        worker_batch=worker_batch,
        lr=lr,
        reference_workers=reference_workers,
        warmup_steps=warmup_steps if warmup is None else warmup,
        max_worker_batch=max_worker_batch if limit is None else limit,
    )


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def sum_gradients(parameters: Iterable[Any]) -> None:
    """Sum every parameter's gradient over the workers, in place (one grouped allreduce).

    A parameter without a gradient counts as zeros, so every rank sends the same tensors.
    """
    import torch

    hvd = sys.modules.get("horovod.torch")
    params = [param for param in parameters if param.requires_grad]
    for param in params:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
    try:
        workers = 1 if hvd is None else int(hvd.size())
    except ValueError:  # Horovod imported but not initialized: a single process
        workers = 1
    if hvd is None or workers == 1:
        return
    summed = hvd.grouped_allreduce([param.grad for param in params], op=hvd.Sum, name="herd.grads")
    for param, total in zip(params, summed, strict=True):
        param.grad.copy_(total)


_sampler_class: type | None = None


def _elastic_batch_sampler_class() -> type:
    """The ElasticSampler subclass, defined on first use so that Horovod loads late."""
    global _sampler_class
    if _sampler_class is not None:
        return _sampler_class
    from horovod.torch.elastic.sampler import ElasticSampler

    hvd = _hvd()

    class ElasticBatchSampler(ElasticSampler):  # type: ignore[misc]
        """Horovod's ElasticSampler, cut in global batches by a batch policy.

        Horovod's own sampler pads the end of an epoch with repeated samples when the
        rest does not divide by the world size, and assumes equal per-worker batches;
        this one cuts each global step by `batching.next_step` instead.
        """

        def __init__(self, epoch_size: int, settings: BatchSettings, seed: int, shuffle: bool):
            self.settings = settings
            self.batch_state = BatchState()
            self._epoch_size = epoch_size
            self._order: list[int] = []
            super().__init__(range(epoch_size), shuffle=shuffle, seed=seed)

        # ElasticSampler's interface, on BatchState.
        def reset(self) -> None:
            self.num_replicas = int(hvd.size())
            self.rank = int(hvd.rank())
            self.batch_state = on_world(self.settings, self.batch_state, self.num_replicas)
            self.epoch = self.batch_state.epoch
            self.processed_num = self.batch_state.cursor
            self._order = epoch_order(self._epoch_size, self.seed, self.epoch, shuffle=self.shuffle)

        def state_dict(self) -> dict[str, float | int]:
            return self.batch_state.to_dict()

        def load_state_dict(self, state_dict: dict[str, float | int]) -> None:
            self.batch_state = BatchState.from_dict(state_dict)
            self.reset()

        def set_epoch(self, epoch: int) -> None:
            """Start epoch `epoch` (call it at the end of the previous one)."""
            state = self.batch_state
            while state.epoch < epoch:
                state = next_epoch(state)
            self.batch_state = state
            self.reset()

        def record_batch(self, batch_idx: int, batch_size: int) -> None:
            raise TypeError("ElasticBatchSampler counts whole steps: call record_step(step)")

        def __iter__(self) -> Iterator[int]:
            for step in self.steps():
                yield from step.indices
                self.record_step(step)

        def __len__(self) -> int:
            return self._epoch_size - self.batch_state.cursor

        # The batch policy.
        def on_reset(self) -> None:
            """Reset callback (`state.register_reset_callbacks`): the new world's plan."""
            self.reset()

        @property
        def plan(self) -> BatchPlan:
            return plan_batches(self.settings, self.batch_state.world_size)

        def steps(self) -> Iterator[Step]:
            """This rank's steps for the rest of the epoch; `record_step` each one."""
            while True:
                step = next_step(self.settings, self.batch_state, self._order, self.rank)
                if step is None:
                    return
                yield step

        def apply_lr(self, optimizer: Any, step: Step) -> None:
            for group in optimizer.param_groups:
                group["lr"] = step.lr

        def record_step(self, step: Step) -> None:
            self.batch_state = after_step(self.batch_state, step.count, step.lr)
            self.processed_num = self.batch_state.cursor

    _sampler_class = ElasticBatchSampler
    return ElasticBatchSampler


def elastic_batches(
    epoch_size: int, settings: BatchSettings, *, seed: int = 0, shuffle: bool = True
) -> Any:
    """A Horovod ElasticSampler over `epoch_size` samples that cuts steps by `settings`
    (after `hvd.init()`); see the module's example."""
    return _elastic_batch_sampler_class()(epoch_size, settings, seed, shuffle)
