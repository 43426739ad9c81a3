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

Under the torchrun engine (torch.distributed, no Horovod) `herd.distributed_batches(len(
dataset), settings, state=snapshot.get("batches"))` gives the same steps, noise scale and
`batch` channel over torch.distributed's all_reduce and broadcast; torchrun restarts the
workers on every resize, so the script keeps `sampler.state_dict()` in its snapshot and
calls `sampler.set_epoch` at each epoch's end as above. `herd.sum_gradients` sums over
whichever of the two engines this process joined.

Gradients are summed, not averaged, over the ranks and divided by the step's global
sample count: ranks with unequal shares (a batch that does not divide, the short last
step of an epoch) then give exactly the mean gradient of the global batch.

torch and Horovod are imported when first needed: importing this module stays light.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from herd_operator.agent.batching import (
    MEASURE_RETRIES,
    BatchPlan,
    BatchSettings,
    BatchState,
    Step,
    after_gradients,
    after_step,
    epoch_order,
    epoch_over,
    measure_action,
    next_epoch,
    next_pass,
    next_step,
    on_decision,
    on_world,
    plan_batches,
    step_gain,
    trained_epochs,
)
from herd_operator.agent.worker import decided_batch, report_measurement
from herd_operator.environment import (
    WORKER_HOST_ENV,
)
from herd_operator.specs.values import (
    BASE_BATCH_METRIC,
    BATCH_SIZE_METRIC,
    COMPUTE_SECONDS_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    NODES_METRIC,
    STEP_SECONDS_METRIC,
)


def machine_name() -> str:
    """The machine this worker runs on: the host of the torchrun engine's GPU slot name
    (HERD_WORKER_HOST, `host:gpuN`), else the system's host name. Not Horovod's names: the
    operator shows one machine's slots under several of them (`runtime/engines/horovod.py`),
    so `hvd.cross_size()` counts those aliases."""
    slot = os.environ.get(WORKER_HOST_ENV, "")
    host, sep, _ = slot.rpartition(":gpu")
    return host if sep else (slot or socket.gethostname())


def squared_norm(tensors: Iterable[Any]) -> float:
    """The sum of the squares of every element of `tensors` (float64), as a float."""
    total = 0.0
    for tensor in tensors:
        total += float(tensor.detach().double().pow(2).sum())
    return total


def _hvd() -> Any:
    import horovod.torch as hvd

    return hvd


def _torch_distributed() -> Any:
    """torch.distributed if this process joined a group of more than one (the torchrun
    engine), else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist if int(dist.get_world_size()) > 1 else None


def sum_gradients(parameters: Iterable[Any]) -> None:
    """Sum every parameter's gradient over the workers, in place (one grouped allreduce
    under Horovod; under torch.distributed, the torchrun engine, one all_reduce of the
    gradients laid end to end).

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
        dist = _torch_distributed()
        if dist is not None and params:
            flat = torch.cat([param.grad.reshape(-1) for param in params])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for param in params:
                size = param.grad.numel()
                param.grad.copy_(flat[offset : offset + size].view_as(param.grad))
                offset += size
        return
    summed = hvd.grouped_allreduce([param.grad for param in params], op=hvd.Sum, name="herd.grads")
    for param, total in zip(params, summed, strict=True):
        param.grad.copy_(total)


class _BatchSteps:
    """What both engines' batch samplers do alike: cut the steps, measure the noise scale,
    count the progress, take the operator's batch. The engine's part is four hooks: the
    world size, the sum of the gradients, the mean of a float and the broadcast of rank
    0's object over the workers."""

    _measured: tuple[int, int] | None = None  # adaptive: the (world, batch) reported on
    _reported = False  # adaptive: that report was made since the batch's last refresh
    _asked = 0  # adaptive: refreshes since that report that left the batch as it was

    settings: BatchSettings
    batch_state: BatchState
    rank: int
    seed: int
    shuffle: bool
    processed_num: int
    _epoch_size: int
    _order: list[int]
    _step_seconds: list[float]
    _step_started: float | None
    _compute_seconds: list[float]
    _sync_seconds: float

    def _world(self) -> int:
        raise NotImplementedError

    def _nodes(self) -> int:
        """The nodes (hosts) this job's workers span now."""
        raise NotImplementedError

    def _sum_all(self, params: list[Any]) -> None:
        raise NotImplementedError

    def _mean_all(self, value: float) -> float:
        raise NotImplementedError

    def _from_rank0(self, value: Any) -> Any:
        raise NotImplementedError

    def _ask(self) -> tuple[int, int] | None:
        return decided_batch()

    def _report_measurement(self, metrics: dict[str, float], world_size: int) -> None:
        report_measurement(metrics, world_size=world_size)

    def refresh_batch(self) -> None:
        """adaptive: take the batch the operator picked last (rank 0 asks, all ranks
        get its answer, so they cut steps alike); at a step boundary on every rank (the
        start, a reset, an epoch's end, after a measurement). The step times restart."""
        self._step_seconds, self._step_started = [], None
        self._compute_seconds, self._sync_seconds = [], 0.0
        self._reported = False
        if self.settings.policy != "adaptive":
            return
        decided = self._ask() if self.rank == 0 else None
        if self._world() > 1:
            decided = self._from_rank0(decided)
        self.batch_state = on_decision(self.settings, self.batch_state, decided)

    @property
    def plan(self) -> BatchPlan:
        return plan_batches(
            self.settings, self.batch_state.world_size, self.batch_state.global_batch
        )

    @property
    def trained_epochs(self) -> float:
        """Epochs trained so far, fractional; under the adaptive policy, AdaScale's
        progress in base epochs (`batching.trained_epochs`)."""
        return trained_epochs(self.settings, self.batch_state, self._epoch_size)

    def sum_gradients(self, parameters: Iterable[Any], step: Step) -> None:
        """`sum_gradients`, measuring the gradient noise scale on the way (adaptive):
        each rank's squared norm of its own mean gradient, averaged over the ranks,
        against the squared norm of the step's mean gradient. Only full steps with
        equal shares count (the estimate assumes one local batch size). The time spent in
        the two all-reduces is the step's sync, which `record_step` takes off its time."""
        params = [param for param in parameters if param.requires_grad]
        plan = self.plan
        shares = set(plan.worker_batches)
        measure = (
            self.settings.policy == "adaptive"
            and plan.world_size > 1
            and step.count == plan.global_batch
            and len(shares) == 1
        )
        local_sqr = 0.0
        if measure:
            (share,) = shares
            # The local gradient is (share / count) x the mean over the rank's samples.
            grads = [p.grad for p in params if p.grad is not None]
            local_sqr = squared_norm(grads) * (step.count / share) ** 2
        started = time.monotonic()
        self._sum_all(params)
        if not measure:
            self._sync_seconds += time.monotonic() - started
            return
        mean_local = self._mean_all(local_sqr)
        self._sync_seconds += time.monotonic() - started
        global_sqr = squared_norm(p.grad for p in params)
        self.batch_state = after_gradients(
            self.settings, self.batch_state, mean_local, global_sqr, share, step.count
        )

    def adaptive_metrics(self) -> dict[str, float]:
        """What the operator's goodput policy reads, for `report_epoch`: the noise scale
        (once measured), the global batch and the mean seconds of a step since the last
        reset or epoch end (the first step after either, which waits for the others or
        warms up, is left out), with the mean of those steps' time apart from the all-reduce
        wait in the sampler's `sum_gradients` (the forward and backward passes, the optimizer
        step and whatever else the script does each step: all of it is what Pollux's model
        counts as compute, fixed or growing with the local batch) and the nodes the workers
        span (`specs.values.PLACEMENT_METRICS`)."""
        metrics: dict[str, float] = {
            BATCH_SIZE_METRIC: float(self.plan.global_batch),
            BASE_BATCH_METRIC: float(self.settings.reference_batch),
            NODES_METRIC: float(self._nodes()),
        }
        noise = self.batch_state.noise.noise_scale()
        if noise is not None:
            metrics[GRADIENT_NOISE_SCALE_METRIC] = noise
        if self._step_seconds:
            mean = sum(self._step_seconds) / len(self._step_seconds)
            metrics[STEP_SECONDS_METRIC] = mean
        if self._compute_seconds:
            mean = sum(self._compute_seconds) / len(self._compute_seconds)
            metrics[COMPUTE_SECONDS_METRIC] = mean
        return metrics

    def _set_order(self) -> None:
        self._order = epoch_order(
            self._epoch_size, self.seed, self.batch_state.data_pass, shuffle=self.shuffle
        )

    def steps(self) -> Iterator[Step]:
        """This rank's steps for the rest of the epoch; `record_step` each one. Under
        the adaptive policy the epoch ends where its progress does, which may be
        within a pass over the data or after several."""
        while not epoch_over(self.settings, self.batch_state, self._epoch_size):
            if self.batch_state.cursor >= self._epoch_size:  # adaptive: the next pass
                self.batch_state = next_pass(self.batch_state)
                self.processed_num = 0
                self._set_order()
                continue
            step = next_step(self.settings, self.batch_state, self._order, self.rank)
            if step is None:
                return
            yield step

    def apply_lr(self, optimizer: Any, step: Step) -> None:
        for group in optimizer.param_groups:
            group["lr"] = step.lr

    def record_step(self, step: Step) -> None:
        gain = step_gain(self.settings, self.batch_state, step.count)
        self.batch_state = after_step(self.batch_state, step.count, step.lr, gain)
        self.processed_num = self.batch_state.cursor
        now = time.monotonic()
        started, self._step_started = self._step_started, now
        sync, self._sync_seconds = self._sync_seconds, 0.0
        if started is not None and step.count == self.plan.global_batch:
            self._step_seconds.append(now - started)
            self._compute_seconds.append(max(now - started - sync, 0.0))
            self._measure()

    def _measure(self) -> None:
        """adaptive, after a timed step: rank 0 reports the metrics `measure_steps` steps
        into a configuration not reported on yet, and as many steps later every rank takes
        the batch the operator picked (`measure_action`; all ranks time the same steps); if
        that is the batch it had, it asks again after twice the steps, `MEASURE_RETRIES`
        times at most (an operator that kept the batch costs a few questions, one that had
        not decided yet is heard before the epoch's end)."""
        if self.settings.policy != "adaptive":
            return
        configuration = (self.batch_state.world_size, self.plan.global_batch)
        measured, steps = self._measured == configuration, len(self._step_seconds)
        action = measure_action(
            self.settings.measure_steps, steps, measured, self._reported, self._asked
        )
        if action == "report":
            self._measured, self._reported, self._asked = configuration, True, 0
            if self.rank == 0:
                self._report_measurement(self.adaptive_metrics(), configuration[0])
        elif action == "refresh":
            self.refresh_batch()
            if configuration == (self.batch_state.world_size, self.plan.global_batch):
                # The same batch: kept, or not decided yet. Ask again later, a few times.
                self._reported = self._asked < MEASURE_RETRIES
                self._asked += 1


_sampler_class: type | None = None


def _elastic_batch_sampler_class() -> type:
    """The ElasticSampler subclass, defined on first use so that Horovod loads late."""
    global _sampler_class
    if _sampler_class is not None:
        return _sampler_class
    from horovod.torch.elastic.sampler import ElasticSampler

    hvd = _hvd()

    class ElasticBatchSampler(_BatchSteps, ElasticSampler):  # type: ignore[misc]
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
            self._step_seconds: list[float] = []
            self._step_started: float | None = None
            self._compute_seconds: list[float] = []
            self._sync_seconds = 0.0
            super().__init__(range(epoch_size), shuffle=shuffle, seed=seed)
            self._node_count = self._count_machines()
            self.refresh_batch()

        # The engine's hooks.
        def _world(self) -> int:
            return int(hvd.size())

        def _nodes(self) -> int:
            return self._node_count

        def _count_machines(self) -> int:
            """The distinct machines of the workers (one allgather, at the start and at
            each reset: on every rank)."""
            if int(hvd.size()) == 1:
                return 1
            return len(set(hvd.allgather_object(machine_name(), name="herd.hosts")))

        def _sum_all(self, params: list[Any]) -> None:
            sum_gradients(params)

        def _mean_all(self, value: float) -> float:
            import torch

            tensor = torch.tensor(value, dtype=torch.float64)
            return float(hvd.allreduce(tensor, op=hvd.Average, name="herd.gns"))

        def _from_rank0(self, value: Any) -> Any:
            return hvd.broadcast_object(value, root_rank=0, name="herd.batch")

        # ElasticSampler's interface, on BatchState.
        def reset(self) -> None:
            self.num_replicas = int(hvd.size())
            self.rank = int(hvd.rank())
            self.batch_state = on_world(self.settings, self.batch_state, self.num_replicas)
            self.epoch = self.batch_state.epoch
            self.processed_num = self.batch_state.cursor
            self._set_order()

        def state_dict(self) -> dict[str, float | int]:
            return self.batch_state.to_dict()

        def load_state_dict(self, state_dict: dict[str, float | int]) -> None:
            self.batch_state = BatchState.from_dict(state_dict)
            self.reset()

        def set_epoch(self, epoch: int) -> None:
            """Start epoch `epoch` (call it at the end of the previous one)."""
            state = self.batch_state
            while state.epoch < epoch:
                state = next_epoch(state, self.settings)
            self.batch_state = state
            self.reset()
            self.refresh_batch()

        def record_batch(self, batch_idx: int, batch_size: int) -> None:
            raise TypeError("ElasticBatchSampler counts whole steps: call record_step(step)")

        def __iter__(self) -> Iterator[int]:
            for step in self.steps():
                yield from step.indices
                self.record_step(step)

        def __len__(self) -> int:
            return self._epoch_size - self.batch_state.cursor

        def on_reset(self) -> None:
            """Reset callback (`state.register_reset_callbacks`): the new world's plan."""
            self.reset()
            self._node_count = self._count_machines()
            self._measured = None  # a new world: measured again
            self.refresh_batch()

    _sampler_class = ElasticBatchSampler
    return ElasticBatchSampler


class DistributedBatches(_BatchSteps):
    """The batch policy under torch.distributed (the torchrun engine): the Horovod
    sampler's steps, noise scale and batch channel, with torch.distributed's all_reduce
    and broadcast. torchrun restarts every worker on a resize, so the state lives in the
    script's snapshot: save `state_dict()` with it, pass it back as `state` on a restart.
    Create it after `dist.init_process_group` (or without a group: one worker). `ask`: how
    rank 0 learns the operator's batch (the `batch` RPC; a test gives its own)."""

    def __init__(
        self,
        epoch_size: int,
        settings: BatchSettings,
        *,
        seed: int = 0,
        shuffle: bool = True,
        state: dict[str, float | int] | None = None,
        ask: Callable[[], tuple[int, int] | None] = decided_batch,
    ) -> None:
        if epoch_size < 1:
            raise ValueError(f"epoch_size must be >= 1, got {epoch_size}")
        dist = _torch_distributed()
        self.settings, self.seed, self.shuffle, self._asker = settings, seed, shuffle, ask
        self.rank = 0 if dist is None else int(dist.get_rank())
        self._epoch_size = epoch_size
        self._step_seconds, self._step_started = [], None
        self._compute_seconds, self._sync_seconds = [], 0.0
        self._node_count = self._count_hosts()
        restored = BatchState() if state is None else BatchState.from_dict(state)
        self.batch_state = on_world(settings, restored, self._world())
        self.processed_num = self.batch_state.cursor
        self._set_order()
        self.refresh_batch()

    @property
    def epoch(self) -> int:
        return self.batch_state.epoch

    def state_dict(self) -> dict[str, float | int]:
        return self.batch_state.to_dict()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` (call it at the end of the previous one)."""
        state = self.batch_state
        while state.epoch < epoch:
            state = next_epoch(state, self.settings)
        self.batch_state = state
        self.processed_num = state.cursor
        self._set_order()
        self.refresh_batch()

    def _ask(self) -> tuple[int, int] | None:
        return self._asker()

    def _world(self) -> int:
        dist = _torch_distributed()
        return 1 if dist is None else int(dist.get_world_size())

    @staticmethod
    def _count_hosts() -> int:
        """The distinct host names of the workers (one all_gather, at the start: torchrun
        starts the workers again at every resize)."""
        dist = _torch_distributed()
        if dist is None:
            return 1
        hosts: list[Any] = [None] * int(dist.get_world_size())
        dist.all_gather_object(hosts, machine_name())
        return len(set(hosts))

    def _nodes(self) -> int:
        return self._node_count

    def _sum_all(self, params: list[Any]) -> None:
        sum_gradients(params)

    def _mean_all(self, value: float) -> float:
        dist = _torch_distributed()
        if dist is None:
            return value
        import torch

        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return float(tensor[0]) / int(dist.get_world_size())

    def _from_rank0(self, value: Any) -> Any:
        dist = _torch_distributed()
        if dist is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


distributed_batches = DistributedBatches
"""The batch sampler of the torchrun engine, named as `elastic_batches` is: the class
itself, so that its arguments are said once (see `DistributedBatches`)."""


def elastic_batches(
    epoch_size: int, settings: BatchSettings, *, seed: int = 0, shuffle: bool = True
) -> Any:
    """A Horovod ElasticSampler over `epoch_size` samples that cuts steps by `settings`
    (after `hvd.init()`); see the module's example."""
    return _elastic_batch_sampler_class()(epoch_size, settings, seed, shuffle)
