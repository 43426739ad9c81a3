"""`Reconcile(name)`: read the world for one job and move it one step closer to its spec.

Level-triggered and idempotent: it never relies on which event woke it. It reads
the spec (or the last good one), the job's process, the workers' reports and
the allocator's grant, then acts at most once on each (launch, stop, release)
and writes the status. Errors are sorted in two kinds: a `TemporaryError` is
retried with backoff by the queue; a `PermanentError` is shown as a condition
and not retried until the spec changes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from herd_operator.controllers.errors import PermanentError, TemporaryError
from herd_operator.controllers.ports import (
    AllocatorPort,
    EventType,
    LauncherPort,
    LaunchInfo,
    NodesPort,
    NodeVerdict,
    NoNodes,
    NoObserver,
    ProcessPhase,
    ProcessState,
    ReconcileObserver,
    Result,
    SpecSource,
    SpecView,
    StorePort,
    Workers,
)
from herd_operator.policies.base import JobObservations, Policy, PolicyError, Signal
from herd_operator.policies.registry import load_policy
from herd_operator.specs import (
    Condition,
    ConditionStatus,
    ConditionType,
    HerdJob,
    get_condition,
    is_true,
    set_condition,
    spec_fingerprint,
)
from herd_operator.specs.conditions import REPORT_DEADLINE_SECONDS
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import GpuCounts, HerdJobStatus, WorkerWatch
from herd_operator.specs.values import Demand, Grant, Report

log = logging.getLogger(__name__)

TRUE, FALSE = ConditionStatus.TRUE, ConditionStatus.FALSE
NODE_VERDICT_POLL_SECONDS = 0.5
"""How soon to look again at a failed job's exit while its nodes are not heard from yet."""
USAGE_HISTORY_SECONDS = 3600.0
"""GPU usage samples older than this are not read for a policy (an epoch longer than an hour
is averaged over its last hour)."""
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


def restart_delay(restarts: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Backoff before relaunching a failed job: 1 s, 2 s, 4 s ... up to a minute."""
    return min(cap, base * 2.0 ** max(0, restarts - 1))


class JobReconciler:
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
    ) -> None:
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

    def reconcile(self, name: str) -> Result:
        """One step towards the spec. A `PermanentError` is shown as `Stalled`, then raised."""
        try:
            result = self._reconcile(name)
        except PermanentError as err:
            self._record_stalled(name, err)
            raise
        return result

    def known_jobs(self) -> list[str]:
        return [record.name for record in self.store.list_jobs()]

    def record_shutdown(self, name: str) -> None:
        """The operator stopped the job with itself: it no longer runs or holds GPUs."""
        record = self.store.get_job(name)
        if record is None:
            return
        status = record.status
        running = is_true(status.conditions, ConditionType.Running)
        if not running and not _allocated(status):
            return  # nothing ran and nothing was held (a job waiting in BackOff may hold GPUs)
        now = self.clock()
        self._record_release(name, status, "operator shut down", now)
        conditions = status.conditions
        if running:
            self._event(name, "Normal", "Stopped", "operator shut down", now)
            for condition_type in (ConditionType.Running, ConditionType.Resizing):
                conditions = set_condition(
                    conditions,
                    condition_type,
                    FALSE,
                    "OperatorStopped",
                    "the operator shut down",
                    status.observed_generation,
                    now,
                )
        gpus = (
            status.gpus.model_copy(update={"allocated": 0, "active": None}) if status.gpus else None
        )
        status = status.model_copy(update={"conditions": conditions, "gpus": gpus, "placement": []})
        self._write(name, status, now)

    def _record_stalled(self, name: str, err: PermanentError) -> None:
        record = self.store.get_job(name)
        if record is None:
            return
        now = self.clock()
        status = record.status
        conditions = set_condition(
            status.conditions,
            ConditionType.Stalled,
            TRUE,
            err.reason,
            str(err),
            record.generation,
            now,
        )
        if conditions is not status.conditions:
            self._event(name, "Warning", err.reason, str(err), now)
        self._write(name, status.model_copy(update={"conditions": conditions}), now)

    def _reconcile(self, name: str) -> Result:
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

        process = self.launcher.state(name)
        if process.launch is not None and process.launch.launch_id != status.launch_id:
            status = self._record_start(name, status, process.launch, now)
        if process.phase == ProcessPhase.EXITED:
            after = self._after_exit(name, job, status, process, generation, now)
            if after is None:  # its nodes are not heard from yet: whose end it is is not known
                self._save(name, status, generation, now)
                return Result(requeue_after=NODE_VERDICT_POLL_SECONDS)
            status = after
            process = ProcessState(ProcessPhase.ABSENT)

        if _finished(status):
            if status.observed_generation == generation:
                return self._stay_finished(name, job, status, generation, now)
            status = self._restart_fresh(status, generation, now)  # the spec changed since

        if process.phase in (ProcessPhase.RUNNING, ProcessPhase.STOPPING):
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
            )
        )
        status = status.model_copy(update={"policy_reason": decision.reason})
        if grant is None:  # the allocator decides for a batch of jobs and wakes this one after
            self._save(name, status, generation, now)
            return Result()
        status = self._note_grant_change(name, status, grant, decision.gpus, now)

        if process.phase == ProcessPhase.ABSENT:
            return self._start_or_wait(name, job, status, grant, decision.gpus, generation, now)
        return self._running(
            name, job, status, grant, decision.gpus, reports, observed, policy, launch,
            generation, now,
        )  # fmt: skip

    # ---- steps ----

    def _after_exit(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        process: ProcessState,
        generation: int,
        now: float,
    ) -> HerdJobStatus | None:
        """The job's processes exited: a success, a failure to retry or give up on, a run
        that ended with a node of its, or a run the spec had already moved past. None while
        a failure cannot be told from a node's loss yet (its nodes are being asked)."""
        if _exit_recorded(status, process):
            # The status already says how this launch ended: its record outlived the commit
            # of that status (the operator was killed before removing it). Acting again
            # would count a failure twice.
            self.launcher.forget(name)
            return status
        if process.launch_error:
            # The command never ran (the keeper could not execute it): not the job's exit.
            self.launcher.forget(name)
            return self._launch_failed(name, status, process.launch_error, generation, now)
        superseded = self._relaunch_reason(process, job)
        if not superseded:
            lost: tuple[str, ...] = ()
            if not process.stopped_by_us and process.exit_code != 0:
                verdict = self._node_verdict(name, status, process)
                if verdict.waiting:
                    log.info(
                        "%s: %s; waiting to hear from %s, where its workers ran, before"
                        " recording it", name, _exit_message(process), ", ".join(verdict.waiting),
                    )  # fmt: skip
                    return None
                lost = verdict.lost
            if lost:
                return self._after_node_loss(name, status, process, lost, generation, now)
            return self._on_exit(name, job, status, process, generation, now)
        # It exited while the spec moved on to something it could not have run: that exit
        # says nothing about the new spec, which runs from scratch.
        self.launcher.forget(name)
        self._event(name, "Normal", "Relaunching", superseded, now)
        return self._restart_fresh(status, generation, now)

    def _node_verdict(self, name: str, status: HerdJobStatus, process: ProcessState) -> NodeVerdict:
        """Whether the nodes the failed launch ran on were lost: those of its grant (it is
        released only after this) and of its recorded placement."""
        grant = self.allocator.grant(name)
        hosts = {host for host, _ in grant.placement.hosts} if grant is not None else set()
        hosts.update(host for host, _ in status.placement)
        key = process.launch.launch_id if process.launch is not None else name
        return self.nodes.exit_verdict(key, name, sorted(hosts))

    def _after_node_loss(
        self,
        name: str,
        status: HerdJobStatus,
        process: ProcessState,
        lost: Sequence[str],
        generation: int,
        now: float,
    ) -> HerdJobStatus:
        """The job ended with a node it ran on: not a failure of its code. It is launched
        again at once, on the nodes left (its grant, which named the lost node, is given
        back and asked for anew), without counting a restart against `backoffLimit` and
        whatever `restartPolicy.onFailure` says. Elastic Horovod's state lives in the
        workers, so the new launch starts the script again: from its own checkpoint, if
        it keeps one."""
        self.launcher.forget(name)
        nodes = ", ".join(lost)
        message = (
            f"{_exit_message(process)} after node(s) {nodes}, where its workers ran, were lost:"
            " launched again on the nodes left (not counted as a failure of the job)"
        )
        self._event(name, "Warning", "NodeLost", message, now)
        self.allocator.release(name)
        conditions = set_condition(
            status.conditions, ConditionType.Running, FALSE, "NodeLost", message, generation, now
        )
        return status.model_copy(
            update={"conditions": conditions, "launch_failures": 0, "retry_at": now}
        )

    def _record_start(
        self, name: str, status: HerdJobStatus, launch: LaunchInfo, now: float
    ) -> HerdJobStatus:
        """Record a launch the status does not name: it was started, but the status and the
        `Started` event of its start were never committed (the operator was killed before
        the store's commit, or the group was lost on a full disk), and a restarted operator
        adopted it from its launch record. Recorded now, once: the status names it from
        this commit on, so the next reconcile does not come here again. Without this the
        status kept the previous launch's id and start, and its exit would not be seen as
        recorded (`_exit_recorded`)."""
        self._event(
            name, "Normal", "Started",
            f"{launch.command} pid {launch.pid} (recorded late: the status of its start was"
            " never committed; an operator restart or a lost store write)",
            now,
        )  # fmt: skip
        conditions = tuple(c for c in status.conditions if c.type != ConditionType.Reporting)
        return status.model_copy(
            update={
                "conditions": conditions,
                "launch_id": launch.launch_id,
                "started_at": launch.started_at,
                "retry_at": None,
                "epoch": None,
                "workers": None,
            }
        )

    def _stay_finished(
        self, name: str, job: HerdJob, status: HerdJobStatus, generation: int, now: float
    ) -> Result:
        """A job that succeeded or failed for this spec holds nothing and waits for an edit."""
        self.allocator.release(name)
        outcome = "succeeded" if is_true(status.conditions, ConditionType.Succeeded) else "failed"
        self._record_release(name, status, f"job {outcome}", now)
        status = status.model_copy(
            update={
                # Mends a status stored while an exit left Resizing as the run had it.
                "conditions": _not_resizing(status.conditions, generation, now),
                "gpus": _counts(job, status, None, 0, None),
                "placement": [],
                "grant_reason": "",
            }
        )
        self._save(name, status, generation, now)
        return Result()

    def _stop_if_superseded(
        self,
        name: str,
        job: HerdJob,
        record: JobRecord,
        status: HerdJobStatus,
        process: ProcessState,
        now: float,
    ) -> Result | None:
        """Stop processes the spec has moved past; while they stop, hold their GPUs.

        None when the running processes can follow the spec.
        """
        reason = self._relaunch_reason(process, job)
        if reason and process.phase == ProcessPhase.RUNNING:
            self.launcher.stop(name)
            self._event(name, "Normal", "Relaunching", reason, now)
            process = ProcessState(ProcessPhase.STOPPING, launch=process.launch)
        if process.phase != ProcessPhase.STOPPING:
            return None
        self._hold_gpus(name, job.spec.priority, record.created_at)
        conditions = set_condition(
            status.conditions,
            ConditionType.Running,
            FALSE,
            "Stopping",
            reason or "waiting for the job's processes to exit",
            record.generation,
            now,
        )
        self._save(
            name, status.model_copy(update={"conditions": conditions}), record.generation, now
        )
        return Result(requeue_after=self.stop_poll_seconds)

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
            allocated=_allocated(status),
            world_size=reports[-1].world_size if reports else None,
            last_resize=status.last_resize_at
            if status.last_resize_at and status.last_resize_at >= since
            else None,
            epochs=[report for report in reports if report.epoch is not None]
            if Signal.EPOCHS in observes
            else (),
            usage=self.store.usage(name, since=max(since, now - USAGE_HISTORY_SECONDS))
            if Signal.USAGE in observes
            else (),
        )

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
        was_resizing = get_condition(status.conditions, ConditionType.Resizing)
        if not resizing and was_resizing is not None and was_resizing.status == TRUE and reported:
            self.observer.resize_completed(name, now - was_resizing.last_transition_time)
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
                "gpus": _counts(job, status, desired, grant.placement.size, active),
                "epoch": epoch,
                "workers": watch,
                # Workers that report got past the launch: a later failure to launch starts
                # its backoff over.
                **({"launch_failures": 0} if reports else {}),
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
            return view.job, "", record, policy
        problem = "; ".join(errors)
        record = self.store.get_job(view.name)
        if record is None:
            # Never valid: like an object the API server refused, it does not exist.
            self._event(view.name, "Warning", "InvalidSpec", problem, now)
            log.warning("%s: invalid spec, not started: %s", view.name, problem)
            return None, problem, None, None
        return record.spec, f"{problem} (keeping the last good spec)", record, None

    def _on_exit(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        process: ProcessState,
        generation: int,
        now: float,
    ) -> HerdJobStatus:
        self.launcher.forget(name)
        status = status.model_copy(update={"launch_failures": 0, "workers": None})  # it ran
        # When it ended: a launch that ended while no operator ran is seen at the restart.
        ended = min(process.ended_at, now) if process.ended_at is not None else now
        # No process of the launch is left to resize (a failed job showed Resizing=True).
        conditions = _not_resizing(status.conditions, generation, now)
        code = process.exit_code
        if process.stopped_by_us:
            conditions = set_condition(
                conditions,
                ConditionType.Running,
                FALSE,
                "Stopped",
                "stopped to relaunch",
                generation,
                now,
            )
            return status.model_copy(update={"conditions": conditions})
        if code == 0:
            self._event(name, "Normal", "Completed", "all workers finished", now)
            conditions = set_condition(
                conditions, ConditionType.Running, FALSE, "Completed", "", generation, now
            )
            conditions = set_condition(
                conditions,
                ConditionType.Succeeded,
                TRUE,
                "Completed",
                f"{_command(process)} exited with status 0",
                generation,
                now,
            )
            return status.model_copy(
                update={
                    "conditions": conditions,
                    "finished_at": ended,
                    "observed_generation": generation,
                }
            )
        restart = job.spec.restart_policy
        message = _exit_message(process)
        if restart.on_failure and status.restarts < restart.backoff_limit:
            restarts = status.restarts + 1
            delay = restart_delay(restarts)
            self._event(
                name,
                "Warning",
                "BackOff",
                f"{message}; restart {restarts}/{restart.backoff_limit} in {delay:.0f}s",
                now,
            )
            conditions = set_condition(
                conditions, ConditionType.Running, FALSE, "BackOff", message, generation, now
            )
            return status.model_copy(
                update={"conditions": conditions, "restarts": restarts, "retry_at": now + delay}
            )
        self._event(name, "Warning", "Failed", message, now)
        conditions = set_condition(
            conditions, ConditionType.Running, FALSE, "Failed", message, generation, now
        )
        conditions = set_condition(
            conditions,
            ConditionType.Failed,
            TRUE,
            "BackoffLimitExceeded" if restart.on_failure else "Failed",
            message,
            generation,
            now,
        )
        return status.model_copy(
            update={
                "conditions": conditions,
                "finished_at": ended,
                "observed_generation": generation,
            }
        )

    def _restart_fresh(self, status: HerdJobStatus, generation: int, now: float) -> HerdJobStatus:
        conditions = status.conditions
        for condition_type in (ConditionType.Succeeded, ConditionType.Failed):
            if get_condition(conditions, condition_type) is not None:
                conditions = set_condition(
                    conditions,
                    condition_type,
                    FALSE,
                    "SpecChanged",
                    "the spec changed after the job finished: running it again",
                    generation,
                    now,
                )
        return status.model_copy(
            update={
                "conditions": conditions,
                "restarts": 0,
                "launch_failures": 0,
                "retry_at": None,
                "finished_at": None,
            }
        )

    def _start_or_wait(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        grant: Grant,
        desired: int,
        generation: int,
        now: float,
    ) -> Result:
        conditions = status.conditions
        size = grant.placement.size
        if not grant.admitted:
            conditions = set_condition(
                conditions, ConditionType.Admitted, FALSE, "Pending", grant.reason, generation, now
            )
            if get_condition(conditions, ConditionType.Admitted) != get_condition(
                status.conditions, ConditionType.Admitted
            ):
                self._event(name, "Normal", "Pending", grant.reason, now)
            status = status.model_copy(
                update={"conditions": conditions, "gpus": _counts(job, status, desired, 0, None)}
            )
            self._save(name, status, generation, now)
            return Result()  # the allocator wakes the job when its grant changes
        retry_at = status.retry_at
        if retry_at is not None and retry_at > now:
            status = status.model_copy(update={"gpus": _counts(job, status, desired, size, None)})
            self._save(name, status, generation, now)
            return Result(requeue_after=retry_at - now)
        conditions = set_condition(
            conditions, ConditionType.Admitted, TRUE, "Admitted", grant.reason, generation, now
        )
        status = status.model_copy(update={"conditions": conditions})
        try:
            launch = self.launcher.start(job, generation, size)
        except (OSError, RuntimeError) as err:
            status = self._launch_failed(name, status, str(err), generation, now)
            status = status.model_copy(update={"gpus": _counts(job, status, desired, size, None)})
            self._save(name, status, generation, now)
            assert status.retry_at is not None
            return Result(requeue_after=status.retry_at - now)
        self._event(
            name, "Normal", "Started", f"{launch.command} pid {launch.pid} with {size} workers", now
        )
        # Whether the workers report is a fact about a launch: this one has not said yet.
        conditions = tuple(c for c in conditions if c.type != ConditionType.Reporting)
        conditions = set_condition(
            conditions,
            ConditionType.Running,
            TRUE,
            "Started",
            "waiting for the workers' first report",
            generation,
            now,
        )
        conditions = set_condition(
            conditions, ConditionType.Resizing, FALSE, "Stable", "", generation, now
        )
        status = status.model_copy(
            update={
                "conditions": conditions,
                "gpus": _counts(job, status, desired, size, None),
                "launch_id": launch.launch_id,
                "started_at": launch.started_at,
                "retry_at": None,
                "epoch": None,
                "workers": None,
            }
        )
        self._save(name, status, generation, now)
        return Result(requeue_after=self.resync_seconds)

    def _launch_failed(
        self, name: str, status: HerdJobStatus, error: str, generation: int, now: float
    ) -> HerdJobStatus:
        """The job's command could not be started (no horovodrun on PATH, a missing
        workingDir, an executable that cannot be run): shown where people look, then tried
        again after a growing delay, since the cause may be fixed without touching the spec.

        The event's text stays the same from one attempt to the next, so that the store
        counts the attempts on one event instead of adding a row for each.
        """
        failures = status.launch_failures + 1
        delay = restart_delay(failures)
        message = f"cannot launch {name}: {error}"
        self._event(name, "Warning", "LaunchFailed", message, now)
        conditions = set_condition(
            status.conditions,
            ConditionType.Running,
            FALSE,
            "LaunchFailed",
            f"{message} (attempt {failures}; next in {delay:.0f}s)",
            generation,
            now,
        )
        return status.model_copy(
            update={"conditions": conditions, "launch_failures": failures, "retry_at": now + delay}
        )

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

    def _note_grant_change(
        self, name: str, status: HerdJobStatus, grant: Grant, desired: int, now: float
    ) -> HerdJobStatus:
        before = _allocated(status)
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

    def _record_release(self, name: str, status: HerdJobStatus, reason: str, now: float) -> None:
        """Log the drop to 0 GPUs of a job that ends (succeeded, failed, stopped, deleted).

        The grant history is what `report` integrates: without this row a finished job would
        count as holding its last grant until the end of the run. ``status.gpus.allocated``
        is the level the history last logged (``_note_grant_change`` keeps them in step), so
        a job that held nothing, or whose drop is logged already, gets no second row.
        """
        if _allocated(status):
            self.store.add_grant_change(name, 0, reason, now)

    def _finalize_deletion(self, name: str, now: float) -> Result:
        process = self.launcher.state(name)
        if process.phase in (ProcessPhase.RUNNING, ProcessPhase.STOPPING):
            if process.phase == ProcessPhase.RUNNING:
                self.launcher.stop(name)
                self._event(name, "Normal", "Stopping", "spec deleted: stopping the job", now)
            record = self.store.get_job(name)
            if record is not None:
                try:
                    priority = record.spec.spec.priority
                except TemporaryError:  # its stored spec is unreadable and the file is gone
                    priority = 0  # the spec's default: the job only needs to finish stopping
                self._hold_gpus(name, priority, record.created_at)
            return Result(requeue_after=self.stop_poll_seconds)
        self.launcher.forget(name)
        self.allocator.release(name)
        record = self.store.get_job(name)
        if record is not None:
            self._record_release(name, record.status, "spec deleted", now)
        if self.store.delete_job(name):
            self._event(name, "Normal", "Deleted", "spec deleted: job removed, GPUs freed", now)
        return Result()

    # ---- helpers ----

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

    def _relaunch_reason(self, process: ProcessState, job: HerdJob) -> str:
        """Why the running processes cannot follow this spec without a relaunch ('' if they can)."""
        if process.launch is None:
            return ""
        return self.launcher.relaunch_reason(process.launch, job)

    def _hold_gpus(self, name: str, priority: int, arrival: float) -> None:
        """A stopping job keeps every GPU it holds until its processes are gone.

        Its demand is pinned to its current size, so no other job is placed on a GPU
        that a dying worker still uses.
        """
        grant = self.allocator.grant(name)
        size = grant.placement.size if grant is not None else 0
        if size:
            self.allocator.request(Demand(name, size, size, size, priority, arrival))

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
        (log.warning if type == "Warning" else log.info)("%s: %s: %s", job, reason, message)


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


def _not_resizing(
    conditions: tuple[Condition, ...], generation: int, now: float
) -> tuple[Condition, ...]:
    """`Resizing=False`: what a job with no running process shows, whatever its last run
    was doing (unchanged, and no transition, when it says so already)."""
    if not is_true(conditions, ConditionType.Resizing) and (
        get_condition(conditions, ConditionType.Resizing) is not None
    ):
        return conditions
    return set_condition(conditions, ConditionType.Resizing, FALSE, "Stable", "", generation, now)


def _allocated(status: HerdJobStatus) -> int:
    return status.gpus.allocated if status.gpus else 0


def _exit_recorded(status: HerdJobStatus, process: ProcessState) -> bool:
    """Whether ``status`` already records the end of the exited launch ``process``: it
    names that launch, and is finished or waits to retry (what recording an exit sets; a
    new launch changes the launch id and clears the retry time)."""
    launch = process.launch
    return (
        launch is not None
        and status.launch_id == launch.launch_id
        and (status.finished_at is not None or status.retry_at is not None)
    )


def _finished(status: HerdJobStatus) -> bool:
    return is_true(status.conditions, ConditionType.Succeeded) or is_true(
        status.conditions, ConditionType.Failed
    )


def _counts(
    job: HerdJob, status: HerdJobStatus, desired: int | None, allocated: int, active: int | None
) -> GpuCounts:
    return GpuCounts(
        min=job.spec.gpus.min,
        max=job.spec.gpus.max,
        desired=desired if desired is not None else (status.gpus.desired if status.gpus else None),
        allocated=allocated,
        active=active,
    )


def _lost(lost: int, gone_for: float, launch: LaunchInfo, workers: Workers, granted: int) -> str:
    idle = ", ".join(f"{host}:{gpu}" for host, gpu in workers.idle)
    return (
        f"{lost} worker{'s' if lost > 1 else ''} gone for {gone_for:.0f}s while {launch.command}"
        f" pid {launch.pid} runs: {workers.alive} of the {granted} granted GPUs have a live"
        f" worker (none on {idle})"
    )


def _exit_message(process: ProcessState) -> str:
    if process.exit_code is None:
        # Only a launch adopted after an operator restart lacks one: it ended while no
        # operator ran, and its keeper was killed with it.
        return f"{_command(process)} ended while no operator ran; its exit status is unknown"
    return f"{_command(process)} exited with status {process.exit_code}"


def _command(process: ProcessState) -> str:
    """What the launch started ("horovodrun"), for messages about its exit."""
    return process.launch.command if process.launch is not None else "the job's process"
