"""The reconcile's step for a job whose processes run: its conditions and GPU counts.

`RunningSteps._running` shows a running launch as its grant and its workers' reports
have it (`Running`, `Resizing`, the report deadline's `Reporting`, `MetricsStale`); until a
worker reports, `_watch_workers` counts the workers bound to its GPUs and calls a worker
lost after a grace (`watch_workers`, a pure function). Apart from the launch and stop steps:
it changes no process, only what the status says of them.
"""

from __future__ import annotations

from collections.abc import Sequence

from herd_operator.controllers.job_status import FALSE, TRUE, ReconcilerBase, gpu_counts
from herd_operator.controllers.ports import LaunchInfo, Result, Workers
from herd_operator.controllers.progress import estimate_progress, latest_metrics
from herd_operator.policies.base import JobObservations, Policy, Signal
from herd_operator.specs import Condition, ConditionType, HerdJob, get_condition, set_condition
from herd_operator.specs.status import HerdJobStatus, Progress, ResizeCost, WorkerWatch
from herd_operator.specs.values import Grant, Report, ResizeMode

WORKER_LOST_GRACE_SECONDS = 30.0
"""How long fewer workers than were seen may run, while the job's driver still runs, before
the missing ones are lost (`watch_workers`). Horovod's workers end one by one when a job
succeeds, and its driver exits once the last has: within seconds, unless rank 0 saves for
longer. Lost workers of a reporting job are noticed about as late, after Gloo's 30 s."""


def watch_workers(
    watch: WorkerWatch | None, alive: int, granted: int, now: float, grace: float
) -> tuple[WorkerWatch, int, float]:
    """A look at a running launch that does not report: `alive` of its workers run on its
    `granted` GPUs. Returns the watch to keep, how many workers to call lost now, and for
    how long fewer than seen have run.

    Fewer than the most seen (`watch.seen`, at most `granted`: a shrink takes workers away
    on purpose; from 0: workers still starting are not missing) for `grace` seconds in a row
    are lost. Not at once: workers also end one by one when the job succeeds, and the
    driver's exit, which ends the watch, follows within that. Once called, the lost ones are
    forgotten (`seen` drops to `alive`), so a loss is said once; a worker Horovod starts
    again on the GPU counts as seen again.
    """
    seen = min(max(watch.seen if watch is not None else 0, alive), granted)
    if alive >= seen:
        return WorkerWatch(seen=seen), 0, 0.0
    since = watch.short_since if watch is not None and watch.short_since is not None else now
    if now - since < grace:
        return WorkerWatch(seen=seen, short_since=since), 0, now - since
    return WorkerWatch(seen=alive), seen - alive, now - since


def resize_cost(
    reports: Sequence[Report], seconds: float, engine: str, mode: ResizeMode | None, now: float
) -> ResizeCost:
    """What a resize that just finished cost: the world size before (the last one the
    workers reported that differs from the latest, when the reports still hold one), the
    new one, how long it took, and what it did to the workers (`mode`, the engine's word)."""
    after = reports[-1].world_size
    before = next(
        (report.world_size for report in reversed(reports) if report.world_size != after), None
    )
    return ResizeCost(
        before=before, after=after, seconds=seconds, engine=engine, mode=mode, completed_at=now
    )


class RunningSteps(ReconcilerBase):
    """The running job's step."""

    def _running(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        grant: Grant,
        desired: int,
        reports: Sequence[Report],
        observed: JobObservations,
        policy: Policy,
        launch: LaunchInfo | None,
        generation: int,
        now: float,
    ) -> Result:
        """A running job: its conditions and counts from the grant and the workers' reports
        (until a worker reports, from their GPU bindings: see `_watch_workers`)."""
        reported = reports[-1].world_size if reports else None
        active, watch = reported, None
        if not reports and launch is not None:
            active, watch = self._watch_workers(name, status, grant, launch, now)
        epochs = [report.epoch for report in reports if report.epoch is not None]
        epoch = epochs[-1] if epochs else status.epoch
        conditions = set_condition(
            status.conditions,
            ConditionType.Admitted,
            TRUE,
            "Admitted",
            grant.reason,
            generation,
            now,
        )
        conditions = set_condition(
            conditions,
            ConditionType.Running,
            TRUE,
            "Training" if reports else "Started",
            f"world size {reported}" if reported else "waiting for the workers' first report",
            generation,
            now,
        )
        # What the workers say (Horovod's world): bindings show live processes, not a size.
        resizing = reported is not None and reported != grant.placement.size
        last_resize = status.last_resize
        was_resizing = get_condition(status.conditions, ConditionType.Resizing)
        if not resizing and was_resizing is not None and was_resizing.status == TRUE and reported:
            # One measure for the metric, the event and `describe`: from the grant change
            # (the Resizing condition's start) to the workers reporting the new world size.
            # The engine the running launch was started on (a spec edit relaunches later).
            engine = (launch.spec if launch is not None else job.spec).engine.kind
            last_resize = resize_cost(
                reports,
                now - was_resizing.last_transition_time,
                engine,
                self.launcher.resize_mode(engine),
                now,
            )
            self.observer.resize_completed(name, last_resize)
            self._event(name, "Normal", "ResizeCompleted", last_resize.message(), now)
        conditions = self._reporting_condition(
            name, conditions, bool(reports), observed.started_at, generation, now
        )
        if Signal.USAGE in policy.observes:
            conditions = self._metrics_condition(conditions, observed, generation, now)
        conditions = set_condition(
            conditions,
            ConditionType.Resizing,
            TRUE if resizing else FALSE,
            "Resizing" if resizing else "Stable",
            f"{reported} -> {grant.placement.size} workers" if resizing else "",
            generation,
            now,
        )
        status = status.model_copy(
            update={
                "conditions": conditions,
                "gpus": gpu_counts(job, status, desired, grant.placement.size, active),
                "epoch": epoch,
                "workers": watch,
                "progress": _progress(job, reports, epoch),
                "metrics": latest_metrics(status.metrics, reports),
                "last_resize": last_resize,
            }
        )
        self._save(name, status, generation, now)
        return Result(requeue_after=self.resync_seconds)

    def _watch_workers(
        self, name: str, status: HerdJobStatus, grant: Grant, launch: LaunchInfo, now: float
    ) -> tuple[int | None, WorkerWatch | None]:
        """(active, the watch) of a launch no worker has reported for: active is how many
        of its workers bound to its GPUs run (None until one has bound); one gone for
        `worker_lost_grace_seconds` while the launch runs gets a `WorkerLost` Warning. A
        script that never reports showed ACTIVE `-` and no sign of a lost worker until the
        report deadline (600 s)."""
        workers = self.allocator.workers(name, launch.started_at)
        if workers is None:  # GPUs on another host: their processes cannot be seen here
            return None, None
        granted = grant.placement.size
        watch, lost, gone_for = watch_workers(
            status.workers, workers.alive, granted, now, self.worker_lost_grace_seconds
        )
        if lost:
            message = _lost(lost, gone_for, launch, workers, granted)
            self._event(name, "Warning", "WorkerLost", message, now)
        if status.workers is None and not watch.seen:  # none of this launch's has bound yet
            return None, None
        return workers.alive, watch

    def _reporting_condition(
        self,
        name: str,
        conditions: tuple[Condition, ...],
        reported: bool,
        since: float,
        generation: int,
        now: float,
    ) -> tuple[Condition, ...]:
        """`Reporting=False ReportDeadlineExceeded` (and a Warning) when no worker of this
        launch has reported within the deadline; True again once one does.

        Workers that hang before training (a host Horovod cannot reach, a script stuck at
        import) look like a running job otherwise. A script that never uses
        herd_operator.worker never reports: the condition says so without stopping it.
        """
        previous = get_condition(conditions, ConditionType.Reporting)
        if reported:
            if previous is None or previous.status == TRUE:
                return conditions
            return set_condition(
                conditions,
                ConditionType.Reporting,
                TRUE,
                "Reported",
                "the workers report",
                generation,
                now,
            )
        silent = now - since
        if silent < self.report_deadline_seconds:
            return conditions
        message = (
            f"no worker has reported in {self.report_deadline_seconds:.0f}s since the launch"
            " (scripts report through herd_operator.worker at each epoch end); see"
            f" `herd-operator logs {name}`"
        )
        updated = set_condition(
            conditions,
            ConditionType.Reporting,
            FALSE,
            "ReportDeadlineExceeded",
            message,
            generation,
            now,
        )
        if previous is None or previous.status != FALSE:
            self._event(name, "Warning", "ReportDeadlineExceeded", message, now)
        return updated

    def _metrics_condition(
        self,
        conditions: tuple[Condition, ...],
        observed: JobObservations,
        generation: int,
        now: float,
    ) -> tuple[Condition, ...]:
        """MetricsStale: the policy needs GPU memory samples and none came lately.

        The policy then holds (it never guesses); this says why, where people look.
        """
        last = observed.usage[-1].time if observed.usage else None
        since = last if last is not None else observed.started_at
        if now - since <= self.metrics_stale_seconds:
            return set_condition(
                conditions, ConditionType.MetricsStale, FALSE, "Fresh", "", generation, now
            )
        what = f"no GPU memory sample for {now - since:.0f}s" if last else "no GPU memory samples"
        return set_condition(
            conditions,
            ConditionType.MetricsStale,
            TRUE,
            "NoRecentSamples",
            f"{what}; the policy holds the job's size",
            generation,
            now,
        )


def _progress(job: HerdJob, reports: Sequence[Report], epoch: int | None) -> Progress | None:
    training = job.spec.training
    if training is None or training.epochs is None:
        return None
    return estimate_progress(training.epochs, reports, epoch)


def _lost(lost: int, gone_for: float, launch: LaunchInfo, workers: Workers, granted: int) -> str:
    idle = ", ".join(f"{host}:{gpu}" for host, gpu in workers.idle)
    return (
        f"{lost} worker{'s' if lost > 1 else ''} gone for {gone_for:.0f}s while {launch.command}"
        f" pid {launch.pid} runs: {workers.alive} of the {granted} granted GPUs have a live"
        f" worker (none on {idle})"
    )
