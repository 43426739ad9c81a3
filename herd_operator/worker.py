"""The worker API for training scripts: `from herd_operator import worker as herd`.

The public face of `herd_operator.agent.worker`, `herd_operator.agent.settings` and
`herd_operator.agent.training` (see there for what each call does). Scripts import this
name, so it stays where it is when the internals move.
"""

from __future__ import annotations

from herd_operator.agent.batching import BATCH_POLICIES, BatchPlan, BatchSettings, Step
from herd_operator.agent.settings import batch_settings
from herd_operator.agent.training import (
    DistributedBatches,
    distributed_batches,
    elastic_batches,
    sum_gradients,
)
from herd_operator.agent.worker import (
    DeviceBinding,
    apply_memory_limit,
    bind_device,
    decided_batch,
    memory_fraction,
    memory_limit_bytes,
    report_epoch,
    report_measurement,
    report_reset,
    under_operator,
)

__all__ = [
    "BATCH_POLICIES",
    "BatchPlan",
    "BatchSettings",
    "DeviceBinding",
    "DistributedBatches",
    "Step",
    "apply_memory_limit",
    "batch_settings",
    "bind_device",
    "decided_batch",
    "distributed_batches",
    "elastic_batches",
    "memory_fraction",
    "memory_limit_bytes",
    "report_epoch",
    "report_measurement",
    "report_reset",
    "sum_gradients",
    "under_operator",
]
