"""`Reconcile(name)`: read the world for one job and move it one step closer to its spec.

Level-triggered and idempotent: it never relies on which event woke it. It reads
the spec (or the last good one), the job's process, the workers' reports and
the allocator's grant, then acts at most once on each (launch, stop, release)
and writes the status. Errors are sorted in two kinds: a `TemporaryError` is
retried with backoff by the queue (a launch that cannot be started is one,
`LaunchError`, shown in the status first); a `PermanentError` is shown as a
condition and not retried until the spec changes. Any other error is a bug: the
`STALL_AFTER_FAILURES`-th failed reconcile in a row that ends in one shows the job
`Stalled` with it too.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from herd_operator.controllers.errors import STALL_AFTER_FAILURES, PermanentError, TemporaryError
from herd_operator.controllers.gating import GateSteps
from herd_operator.controllers.job_status import (
    FALSE,
    TRUE,
    GpuUtilization,
    PeakMemory,
    allocated_gpus,
    is_finished,
    no_gpu_utilization,
    no_peak_memory,
)
from herd_operator.controllers.launching import LaunchSteps
from herd_operator.controllers.limits import deadline_at, sooner
from herd_operator.controllers.ports import (
    AllocatorPort,
    LauncherPort,
    NodesPort,
    NoNodes,
    NoObserver,
    ProcessPhase,
    ProcessState,
    ReconcileObserver,
    Result,
    SpecSource,
    SpecView,
    StorePort,
)
from herd_operator.controllers.progress import done_fraction
from herd_operator.controllers.running import WORKER_LOST_GRACE_SECONDS, RunningSteps
from herd_operator.controllers.stopping import StopSteps
from herd_operator.policies.base import Decision, JobObservations, Policy, PolicyError, Signal
from herd_operator.policies.registry import load_policy, params_warnings
from herd_operator.specs import ConditionType, HerdJob, set_condition, spec_fingerprint
from herd_operator.specs.conditions import REPORT_DEADLINE_SECONDS, get_condition
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import BatchChoice, HerdJobStatus
from herd_operator.specs.values import Demand, Grant, Report

log = logging.getLogger(__name__)

NODE_VERDICT_POLL_SECONDS = 0.5
"""How soon to look again at a failed job's exit while its nodes are not heard from yet."""
USAGE_HISTORY_SECONDS = 3600.0
"""GPU usage samples older than this are not read for a policy (an epoch longer than an hour
is averaged over its last hour)."""


class JobReconciler(LaunchSteps, RunningSteps, StopSteps, GateSteps):
    """The reconcile of one job: this class reads the spec, asks the policy and the allocator,
    and orders the steps; each step lives with its concern (`launching`, `running`,
    `stopping`, `gating`), on the parts and writes of `job_status.ReconcilerBase`."""

    def __init__(
        self,
        specs: SpecSource,
        store: StorePort,
        allocator: AllocatorPort,
        launcher: LauncherPort,
        *,
        clock: Callable[[], float] = time.time,
        resync_seconds: float = 5.0,
        stop_poll_seconds: float = 0.5,
        metrics_stale_seconds: float = 15.0,
        report_deadline_seconds: float = REPORT_DEADLINE_SECONDS,
        worker_lost_grace_seconds: float = WORKER_LOST_GRACE_SECONDS,
        observer: ReconcileObserver | None = None,
        nodes: NodesPort | None = None,
        peak_memory: PeakMemory = no_peak_memory,
        gpu_utilization: GpuUtilization = no_gpu_utilization,
    ) -> None:
        """`peak_memory(job)`: the most GPU memory one worker of the job was seen to use
        (bytes, NVML per process), None until measured: what a sharing job is packed by
        when it is above its request (`job_status.PeakMemory`); `gpu_utilization(job)`: its
        measured GPU utilization per worker, None until measured (`job_status.GpuUtilization`)."""
        self.peak_memory = peak_memory
        self.gpu_utilization = gpu_utilization
        self.nodes: NodesPort = nodes or NoNodes()
        self.metrics_stale_seconds = metrics_stale_seconds
        self.report_deadline_seconds = report_deadline_seconds
        self.worker_lost_grace_seconds = worker_lost_grace_seconds
        self.observer: ReconcileObserver = observer or NoObserver()
        self.specs = specs
        self.store = store
        self.allocator = allocator
        self.launcher = launcher
        self.clock = clock
        self.resync_seconds = resync_seconds
        self.stop_poll_seconds = stop_poll_seconds

    # ---- entry points ----

    def reconcile(self, name: str, failures: int = 0) -> Result:
        """One step towards the spec. ``failures``: how many reconciles of the job failed in
        a row just before this one (the work queue's count behind the job's backoff).

        A `PermanentError` is shown as `Stalled`, then raised; so is an unexpected error
        (a bug) that makes `STALL_AFTER_FAILURES` failures in a row, with reason
        `ReconcileError` and the error's text. The next reconcile that goes through shows
        `Stalled=False` (`_save`)."""
        try:
            return self._reconcile(name, failures)
        except PermanentError as err:
            self._record_stalled(name, err.reason, str(err))
            raise
        except TemporaryError:
            raise
        except (Exception, SystemExit) as err:
            if failures + 1 >= STALL_AFTER_FAILURES:
                self._record_stalled(name, "ReconcileError", _stalled_by(err))
            raise

    def known_jobs(self) -> list[str]:
        return [record.name for record in self.store.list_jobs()]

    def _record_stalled(self, name: str, reason: str, message: str) -> None:
        record = self.store.get_job(name)
        if record is None:
            return
        now = self.clock()
        status = record.status
        conditions = set_condition(
            status.conditions,
            ConditionType.Stalled,
            TRUE,
            reason,
            message,
            record.generation,
            now,
        )
        if conditions is not status.conditions:
            self._event(name, "Warning", reason, message, now)
        self._write(name, status.model_copy(update={"conditions": conditions}), now)

    def _reconcile(self, name: str, failures: int) -> Result:
        now = self.clock()
        view = self.specs.view(name)
        if view is None:
            return self._finalize_deletion(name, now)
        job, problem, record, policy = self._accept_spec(view, now)
        if job is None or record is None:
            return Result()
        if policy is None:  # acting on the last good spec; raised before any side effect
            policy = self._policy(job)
        generation = record.generation
        status = _with_spec_validity(record.status, problem, generation, now)
        self._say_spec_validity(name, record.status, problem, now)

        process = self.launcher.state(name)
        status = self._with_launch_recorded(name, status, process, now)
        if process.phase == ProcessPhase.EXITED:
            status = self._with_last_epoch(name, status, process)
            after = self._after_exit(name, job, status, process, generation, now, failures)
            if after is None:  # its nodes are not heard from yet: whose end it is is not known
                self._save(name, status, generation, now)
                return Result(requeue_after=NODE_VERDICT_POLL_SECONDS)
            status = after
            process = ProcessState(ProcessPhase.ABSENT)

        if is_finished(status):
            # A suspension changes the generation, not what the job ran: it stays finished.
            if status.observed_generation == generation or job.spec.suspend:
                return self._stay_finished(name, job, status, generation, now)
            status = self._restart_fresh(status, generation, now)  # the spec changed since
            status = status.model_copy(update={"run_started_at": None})  # a new run

        past_deadline = self._deadline_gate(name, job, record, status, process, generation, now)
        if past_deadline is not None:
            return past_deadline
        if process.phase == ProcessPhase.ABSENT:
            status, waiting = self._dependencies_gate(name, job, record, status, generation, now)
            if waiting is not None:
                return waiting

        if job.spec.suspend:
            return self._suspend(name, job, record, status, process, now)
        status = self._resumed(name, status, generation, now)

        if process.phase in (ProcessPhase.RUNNING, ProcessPhase.STOPPING):
            stopping = self._stop_if_preempted(name, job, status, process, generation, now)
            if stopping is None:
                stopping = self._stop_if_superseded(name, job, record, status, process, now)
            if stopping is not None:
                return stopping

        launch = process.launch
        since = launch.started_at if launch else now
        reports = self.store.reports(name, since=since, limit=1000)
        observed = self._observe(name, policy, status, reports, since, now)
        decision = policy.desired(job, observed, now)
        grant = self.allocator.request(
            Demand(
                name=name,
                min=job.spec.gpus.min,
                max=job.spec.gpus.max,
                desired=decision.gpus,
                priority=job.spec.priority,
                arrival=record.created_at,
                gains=decision.gains,
                min_speedup=decision.min_speedup,
                done_fraction=done_fraction(status.progress),
                resumable=_resumable(job),
                **self._sharing(name, job),
            )
        )
        status = status.model_copy(
            update={"policy_reason": decision.reason, "batch": _batch_choice(decision, observed)}
        )
        if grant is None:  # the allocator decides for a batch of jobs and wakes this one after
            self._save(name, status, generation, now)
            return Result()
        status = self._note_grant_change(name, status, grant, decision.gpus, now)

        if process.phase == ProcessPhase.ABSENT:
            result = self._start_or_wait(
                name, job, status, grant, decision.gpus, generation, now, failures
            )
            # A run waiting for GPUs again (after a lost node) is woken by its grant only.
            deadline = deadline_at(job.spec.active_deadline_seconds, status.run_started_at)
            return dataclasses.replace(
                result, requeue_after=sooner(result.requeue_after, deadline, now)
            )
        return self._running(
            name, job, status, grant, decision.gpus, reports, observed, policy, launch,
            generation, now,
        )  # fmt: skip

    def _with_launch_recorded(
        self, name: str, status: HerdJobStatus, process: ProcessState, now: float
    ) -> HerdJobStatus:
        """`status` with the launch the launcher reports recorded, if it is a new one."""
        if process.launch is not None and process.launch.launch_id != status.launch_id:
            return self._record_start(name, status, process.launch, now)
        return status

    def _accept_spec(
        self, view: SpecView, now: float
    ) -> tuple[HerdJob | None, str, JobRecord | None, Policy | None]:
        """Record a good spec (bumping the generation on change); else fall back to the last good.

        Returns the spec to act on, why the file is invalid now ('' if it is not), the
        job's record, and the policy of a good spec (built to check it: the reconcile uses
        it rather than building it again).
        """
        errors = list(view.errors)
        policy: Policy | None = None
        if view.job is not None:
            try:
                policy = load_policy(view.job.spec.policy)
            except PolicyError as err:
                errors.append(f"{view.path}: {err}")
        if view.job is not None and not errors:
            fingerprint = view.fingerprint or spec_fingerprint(view.job)
            record = self.store.get_job(view.name)
            if record is None or record.fingerprint != fingerprint or record.spec_path != view.path:
                record = self.store.record_spec(view.name, view.path, view.job, fingerprint, now)
                # Said once per spec recorded, as `validate` says it: allowed, but not what
                # the file seems to ask for.
                for warning in params_warnings(view.job.spec):
                    self._event(view.name, "Warning", "PolicyParams", warning, now)
            return view.job, "", record, policy
        problem = "; ".join(errors)
        record = self.store.get_job(view.name)
        if record is None:
            # Never valid: like an object the API server refused, it does not exist.
            self._event(view.name, "Warning", "InvalidSpec", problem, now)
            log.warning(
                "%s: invalid spec, not started: %s", view.name, problem, extra={"job": view.name}
            )
            return None, problem, None, None
        return record.spec, f"{problem} (keeping the last good spec)", record, None

    def _with_last_epoch(
        self, name: str, status: HerdJobStatus, process: ProcessState
    ) -> HerdJobStatus:
        """The epoch the exited launch's workers reported last: a job ends right after its
        last epoch's report, often before a reconcile took it in (then the finished job
        showed one epoch fewer than it ran)."""
        if process.launch is None:
            return status
        reports = self.store.reports(name, since=process.launch.started_at, limit=1000)
        epochs = [report.epoch for report in reports if report.epoch is not None]
        if not epochs or epochs[-1] == status.epoch:
            return status
        return status.model_copy(update={"epoch": epochs[-1]})

    def _say_spec_validity(
        self, name: str, before: HerdJobStatus, problem: str, now: float
    ) -> None:
        """An event when a known job's spec becomes invalid (or invalid for another reason),
        and when it is valid again: `events` shows what the condition shows, as it does for
        a job that never ran."""
        previous = get_condition(before.conditions, ConditionType.SpecValid)
        if problem and (
            previous is None or (previous.status, previous.message) != (FALSE, problem)
        ):
            self._event(name, "Warning", "InvalidSpec", problem, now)
        elif not problem and previous is not None and previous.status == FALSE:
            self._event(name, "Normal", "ValidSpec", "the spec is valid again", now)

    def _policy(self, job: HerdJob) -> Policy:
        try:
            return load_policy(job.spec.policy)
        except PolicyError as err:  # validated in _accept_spec; a plug-in can still vanish
            raise PermanentError(str(err), reason="PolicyUnavailable") from err

    def _observe(
        self,
        name: str,
        policy: Policy,
        status: HerdJobStatus,
        reports: Sequence[Report],
        since: float,
        now: float,
    ) -> JobObservations:
        """What the policy sees of this run; only what it declares it observes is gathered
        (usage costs a query)."""
        observes = policy.observes
        return JobObservations(
            started_at=since,
            allocated=allocated_gpus(status),
            world_size=reports[-1].world_size if reports else None,
            last_resize=status.last_resize_at
            if status.last_resize_at and status.last_resize_at >= since
            else None,
            epochs=[report for report in reports if report.epoch is not None]
            if Signal.EPOCHS in observes
            else (),
            measurements=[report for report in reports if report.measurement]
            if Signal.EPOCHS in observes
            else (),
            usage=self.store.usage(name, since=max(since, now - USAGE_HISTORY_SECONDS))
            if Signal.USAGE in observes
            else (),
        )

    def _note_grant_change(
        self, name: str, status: HerdJobStatus, grant: Grant, desired: int, now: float
    ) -> HerdJobStatus:
        before = allocated_gpus(status)
        after = grant.placement.size
        update: dict[str, object] = {
            "placement": [(host, list(gpus)) for host, gpus in grant.placement.hosts],
            "grant_reason": grant.reason,
        }
        if before != after:
            self.store.add_grant_change(name, after, grant.reason, now)
            if before and after:
                update["last_resize_at"] = now
                self.observer.resized(name, before, after)
                # Say why in the words of whoever caused it: the policy when the job now has
                # what it asked for, else the allocator (another job, the pool, the max).
                cause = status.policy_reason if after == desired else grant.reason
                self._event(name, "Normal", "Resized", f"{before} -> {after} GPUs: {cause}", now)
        return status.model_copy(update=update)


def _with_spec_validity(
    status: HerdJobStatus, problem: str, generation: int, now: float
) -> HerdJobStatus:
    if problem:
        conditions = set_condition(
            status.conditions,
            ConditionType.SpecValid,
            FALSE,
            "InvalidSpec",
            problem,
            generation,
            now,
        )
    else:
        conditions = set_condition(
            status.conditions, ConditionType.SpecValid, TRUE, "Valid", "", generation, now
        )
    return status.model_copy(update={"conditions": conditions})


def _batch_choice(decision: Decision, observed: JobObservations) -> BatchChoice | None:
    """The decision's batch and the GPUs it is for: those granted when it was made (the
    policy chooses for them), or, before any grant, the GPUs it asks for."""
    if decision.batch_size is None:
        return None
    gpus = observed.allocated if observed.allocated > 0 else decision.gpus
    return BatchChoice(gpus=gpus, size=decision.batch_size)


def _stalled_by(err: BaseException) -> str:
    """What `Stalled=True ReconcileError` says of a bug that lasts: the same text at each try,
    so the condition and its Warning event are set once."""
    return (
        f"{type(err).__name__}: {err} ({STALL_AFTER_FAILURES} or more reconciles in a row"
        " failed; tried again at the longest backoff; the operator's log has the traceback)"
    )


def _resumable(job: HerdJob) -> bool:
    """Whether the job says it goes on from a checkpoint (`training.resumable`): a queue may
    preempt only such a job (`Demand.resumable`)."""
    return job.spec.training is not None and job.spec.training.resumable
