"""What every step of the reconcile shares: the parts it acts through, the writes it makes,
and the pure helpers over a job's status.

`ReconcilerBase` names the parts and settings `JobReconciler` is built with (each step's
mixin reads them from it) and holds the writes every step makes: the status (`_save`
clears `Stalled` once a reconcile goes through), the job's events, the grant history's drop
to 0 GPUs, and the demand that holds a stopping job's GPUs. Apart from the steps because
each step module builds on it, and none of it decides anything.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypedDict

from herd_operator.controllers.ports import (
    AllocatorPort,
    EventType,
    LauncherPort,
    NodesPort,
    ProcessState,
    ReconcileObserver,
    SpecSource,
    StorePort,
)
from herd_operator.specs import (
    Condition,
    ConditionStatus,
    ConditionType,
    HerdJob,
    get_condition,
    is_true,
    set_condition,
)
from herd_operator.specs.status import GpuCounts, HerdJobStatus
from herd_operator.specs.values import Demand

log = logging.getLogger("herd_operator.controllers.reconciler")

TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE

PeakMemory = Callable[[str], int | None]
"""job -> the largest GPU memory (bytes) one of its workers was seen to use, None until
measured. The entry point of the measurement side (NVML per-process memory attributed to
jobs): the operator passes it to `JobReconciler(peak_memory=...)`, and each demand of a
sharing job carries it (`Demand.measured_bytes`): `PeakGpuMemory.peak` in the operator."""


GpuUtilization = Callable[[str], float | None]
"""job -> its measured GPU utilization per worker (0-1), None until measured: what the
packing's cap on a GPU's summed utilization counts (`Demand.utilization`):
`PeakGpuMemory.utilization` in the operator."""


class Measures(TypedDict):
    """The measurement side's inputs of a `JobReconciler` (its keyword arguments)."""

    peak_memory: PeakMemory
    gpu_utilization: GpuUtilization


class SharingFields(TypedDict, total=False):
    """`Demand`'s fields of a job that shares GPUs by memory."""

    share: bool
    memory_bytes: int | None
    memory_split_bytes: int | None
    measured_bytes: int | None
    utilization: float | None


def no_gpu_utilization(job: str) -> float | None:
    """No measurement: a sharing job counts as a busy one under a utilization cap."""
    return None


def no_peak_memory(job: str) -> int | None:
    """No measurement: a sharing job is packed by its request."""
    return None


class ReconcilerBase:
    """The parts and settings of a `JobReconciler` (set by its constructor), and the
    writes every step of its reconcile makes."""

    specs: SpecSource
    store: StorePort
    allocator: AllocatorPort
    launcher: LauncherPort
    nodes: NodesPort
    observer: ReconcileObserver
    clock: Callable[[], float]
    resync_seconds: float
    stop_poll_seconds: float
    metrics_stale_seconds: float
    report_deadline_seconds: float
    worker_lost_grace_seconds: float
    peak_memory: PeakMemory
    gpu_utilization: GpuUtilization

    def _record_release(self, name: str, status: HerdJobStatus, reason: str, now: float) -> None:
        """Log the drop to 0 GPUs of a job that ends (succeeded, failed, stopped, deleted).

        The grant history is what `report` integrates: without this row a finished job would
        count as holding its last grant until the end of the run. ``status.gpus.allocated``
        is the level the history last logged (``_note_grant_change`` keeps them in step), so
        a job that held nothing, or whose drop is logged already, gets no second row.
        """
        if allocated_gpus(status):
            self.store.add_grant_change(name, 0, reason, now)

    def _relaunch_reason(self, process: ProcessState, job: HerdJob) -> str:
        """Why the running processes cannot follow this spec without a relaunch ('' if they can)."""
        if process.launch is None:
            return ""
        return self.launcher.relaunch_reason(process.launch, job)

    def _sharing(self, name: str, job: HerdJob | None) -> SharingFields:
        """The sharing fields of the job's demand (`spec.gpus.share`, its memory request,
        its measured peak and utilization); none if it does not share GPUs."""
        if job is None or not job.spec.gpus.share:
            return {}
        return {
            "share": True,
            "memory_bytes": job.spec.gpus.memory_bytes,
            "memory_split_bytes": job.spec.gpus.memory_split_bytes,
            "measured_bytes": self.peak_memory(name),
            "utilization": self.gpu_utilization(name),
        }

    def _hold_gpus(
        self, name: str, priority: int, arrival: float, job: HerdJob | None = None
    ) -> None:
        """A stopping job keeps every GPU it holds until its processes are gone.

        Its demand is pinned to its current size, so no other job is placed on a GPU
        that a dying worker still uses (a sharing job keeps its share and memory: `job`).
        """
        grant = self.allocator.grant(name)
        size = grant.placement.size if grant is not None else 0
        if size:
            sharing = self._sharing(name, job)
            self.allocator.request(Demand(name, size, size, size, priority, arrival, **sharing))

    def _save(self, name: str, status: HerdJobStatus, generation: int, now: float) -> None:
        """Write the status of a reconcile that went through: a `Stalled` job has recovered."""
        conditions = status.conditions
        if is_true(conditions, ConditionType.Stalled):
            conditions = set_condition(
                conditions, ConditionType.Stalled, FALSE, "Recovered", "", generation, now
            )
        self._write(
            name,
            status.model_copy(update={"observed_generation": generation, "conditions": conditions}),
            now,
        )

    def _write(self, name: str, status: HerdJobStatus, now: float) -> None:
        # Most resyncs change nothing: the store then writes nothing.
        self.store.put_status(name, status, now)

    def _event(self, job: str, type: EventType, reason: str, message: str, now: float) -> None:
        self.store.add_event(job, type, reason, message, now)
        # The event's parts as fields too, for `run --log-format json`.
        (log.warning if type == "Warning" else log.info)(
            "%s: %s: %s", job, reason, message, extra={"job": job, "reason": reason}
        )


def not_resizing(
    conditions: tuple[Condition, ...], generation: int, now: float
) -> tuple[Condition, ...]:
    """`Resizing=False`: what a job with no running process shows, whatever its last run
    was doing (unchanged, and no transition, when it says so already)."""
    if not is_true(conditions, ConditionType.Resizing) and (
        get_condition(conditions, ConditionType.Resizing) is not None
    ):
        return conditions
    return set_condition(conditions, ConditionType.Resizing, FALSE, "Stable", "", generation, now)


def preempted_for(conditions: tuple[Condition, ...]) -> str | None:
    """Why the job's workers are stopped (or being stopped) for another job: the message of
    its `Preempted=True` condition, the queue's `preempted for X (attained ...)`; None when
    it shows no preemption. What a preempted job's stop, its exit and its relaunch read."""
    preempted = get_condition(conditions, ConditionType.Preempted)
    return preempted.message if preempted is not None and preempted.status == TRUE else None


def allocated_gpus(status: HerdJobStatus) -> int:
    return status.gpus.allocated if status.gpus else 0


def is_finished(status: HerdJobStatus) -> bool:
    return is_true(status.conditions, ConditionType.Succeeded) or is_true(
        status.conditions, ConditionType.Failed
    )


def gpu_counts(
    job: HerdJob, status: HerdJobStatus, desired: int | None, allocated: int, active: int | None
) -> GpuCounts:
    return GpuCounts(
        min=job.spec.gpus.min,
        max=job.spec.gpus.max,
        desired=desired if desired is not None else (status.gpus.desired if status.gpus else None),
        allocated=allocated,
        active=active,
    )
