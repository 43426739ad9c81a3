"""The settings of one simulation (`SimConfig`): the pool, the policy, and the operator's and
allocator's options the simulated run uses, each as the `run` flag of the same name."""

from __future__ import annotations

from dataclasses import dataclass

from herd_operator.policies.queueing import QueueConfig
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.simulate.colocation import SIMULATED_SHARING
from herd_operator.specs import PolicyRef
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS, Pool


@dataclass(frozen=True)
class SimConfig:
    pool: Pool
    policy: PolicyRef
    tick: float = 0.0
    """0: decide at each event's instant; > 0: at the next multiple of `tick` seconds."""
    min_resize_interval: float = 30.0
    """The operator's `--min-resize-interval` default."""
    drain_seconds: float = 30.0
    resync: float = 0.0
    """> 0: every job is reconciled again every `resync` seconds, as the operator's periodic
    resync does (5 s by default there); 0: only at its events. Each resync is a reconcile per
    running job, so at scale it costs what it does in the operator."""
    spare_by_gain: bool = False
    """The allocator lends GPUs nobody wants by the gain policies report (`Allocator`)."""
    smallest_first: bool = False
    """The allocator admits pending jobs smallest min first (`Allocator`)."""
    share_by_gain: bool = False
    """The allocator divides the GPUs above the mins by the gain policies report (`Allocator`)."""
    share_by_speedup: bool = False
    """... by the harmonic mean of the jobs' speedups (`Allocator`, `policies/power_mean.py`)."""
    max_wait_seconds: float = DEFAULT_MAX_WAIT_SECONDS
    """With `smallest_first`: the wait after which a pending job goes first."""
    queue: QueueConfig | None = None
    """The allocator's queue: order by service attained or work left, and preemption
    (`policies/queueing.py`); None: arrival order, no preemption."""
    pack: bool = False
    """Jobs may share GPUs (`simulate --policy NAME+pack`): the allocator packs those that opt
    in by their memory per worker, each runs slower by `colocation.interference_slowdown`,
    and the GPUs counted as allocated are those holding at least one job."""
    share_utilization: float = 1.0
    """Under `pack`, the jobs whose GPU utilization is at most this opt in (1.0: all)."""
    sharing: SharingLimits = SIMULATED_SHARING
    """Under `pack`, the allocator's sharing settings (jobs per GPU, utilization cap...)."""
    adaptive_batch: bool = False
    """Jobs with a noise profile (`JobModel.batching`) report the adaptive metrics at each
    epoch end and train at the batch the policy's decision carries (`simulate/batching.py`);
    False: every job keeps its trace's batch."""
    measure_steps: int = DEFAULT_MEASURE_STEPS
    """With `adaptive_batch`: the workers also report the adaptive metrics this many steps
    into each new configuration (a start, a resize, a new batch) when the epoch is not over
    by then, as the worker API does (`training.measureSteps`); 0: at epoch ends only."""
    record: bool = False
    """Keep every request, release and report given to the allocator, batch by batch
    (for replaying them on another allocator)."""
