"""The reconcile's steps that end what a job runs or holds.

`StopSteps` stops processes the spec has moved past (holding their GPUs until they are
gone), suspends a job (`spec.suspend`: stopped the same way, then holding nothing) and
shows its resume, keeps a finished job holding nothing, finishes a deleted job once its
processes have exited, and records the operator's own shutdown in each status (a
reconcile step the loop runs). Apart from the launch and running steps: each ends with no
process of the job left, or waits for that.
"""

from __future__ import annotations

from herd_operator.controllers.errors import TemporaryError
from herd_operator.controllers.job_status import (
    FALSE,
    TRUE,
    ReconcilerBase,
    allocated_gpus,
    gpu_counts,
    not_resizing,
    preempted_for,
)
from herd_operator.controllers.ports import ProcessPhase, ProcessState, Result
from herd_operator.policies.queueing import is_preemption
from herd_operator.specs import ConditionType, HerdJob, get_condition, is_true, set_condition
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus


class StopSteps(ReconcilerBase):
    """Stopping, finishing and deleting a job."""

    def record_shutdown(self, name: str) -> None:
        """The operator stopped the job with itself: it no longer runs or holds GPUs."""
        record = self.store.get_job(name)
        if record is None:
            return
        status = record.status
        running = is_true(status.conditions, ConditionType.Running)
        if not running and not allocated_gpus(status):
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
        self._hold_gpus(name, job.spec.priority, record.created_at, job)
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

    def _stop_if_preempted(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        process: ProcessState,
        generation: int,
        now: float,
    ) -> Result | None:
        """The allocator's queue took the job's GPUs for another (its grant is empty, with a
        reason `preempted for X (attained ...)`): stop its workers. Their GPUs drain as any
        given back, so no other job is placed on a GPU a dying worker still uses. The job
        keeps its demand (and the service it attained, which ranks it): it is launched again
        when granted GPUs again. Not a failure: its restarts and backoff stay as they are.

        None when the job is not preempted."""
        grant = self.allocator.grant(name)
        shown = preempted_for(status.conditions)
        stopping = shown is not None
        if grant is not None and grant.placement.size:
            return None
        if grant is not None and is_preemption(grant.reason):
            why = grant.reason
        elif shown is not None:
            why = shown  # its stop was under way when the operator restarted
        else:
            return None
        if process.phase == ProcessPhase.RUNNING:
            self.launcher.stop(name)
            if not stopping:
                self._event(name, "Normal", "Preempted", why, now)
                self.store.add_grant_change(name, 0, why, now)
                status = status.model_copy(update={"preemptions": status.preemptions + 1})
        conditions = not_resizing(status.conditions, generation, now)
        for condition_type in (ConditionType.Preempted, ConditionType.Admitted):
            preempted = condition_type == ConditionType.Preempted
            conditions = set_condition(
                conditions, condition_type, TRUE if preempted else FALSE, "Preempted", why,
                generation, now,
            )  # fmt: skip
        conditions = set_condition(
            conditions,
            ConditionType.Running,
            FALSE,
            "Preempted",
            f"stopping the job's workers: {why}",
            generation,
            now,
        )
        status = status.model_copy(
            update={
                "conditions": conditions,
                "gpus": gpu_counts(job, status, None, 0, None),
                "placement": [],
                "grant_reason": why,
            }
        )
        self._save(name, status, generation, now)
        return Result(requeue_after=self.stop_poll_seconds)

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
                "conditions": not_resizing(status.conditions, generation, now),
                "gpus": gpu_counts(job, status, None, 0, None),
                "placement": [],
                "grant_reason": "",
                # An ended run has no ETA (its epochs done stay shown).
                "progress": status.progress.model_copy(update={"estimated_completion": None})
                if status.progress is not None
                else None,
            }
        )
        self._save(name, status, generation, now)
        return Result()

    def _finalize_deletion(self, name: str, now: float) -> Result:
        process = self.launcher.state(name)
        if process.phase in (ProcessPhase.RUNNING, ProcessPhase.STOPPING):
            if process.phase == ProcessPhase.RUNNING:
                self.launcher.stop(name)
                self._event(name, "Normal", "Stopping", "spec deleted: stopping the job", now)
            record = self.store.get_job(name)
            if record is not None:
                stored: HerdJob | None = None
                try:
                    stored = record.spec
                    priority = stored.spec.priority
                except TemporaryError:  # its stored spec is unreadable and the file is gone
                    priority = 0  # the spec's default: the job only needs to finish stopping
                self._hold_gpus(name, priority, record.created_at, stored)
            return Result(requeue_after=self.stop_poll_seconds)
        self.launcher.forget(name)
        self.allocator.release(name)
        record = self.store.get_job(name)
        if record is not None:
            self._record_release(name, record.status, "spec deleted", now)
        if self.store.delete_job(name):
            self._event(name, "Normal", "Deleted", "spec deleted: job removed, GPUs freed", now)
        return Result()

    def _suspend(
        self,
        name: str,
        job: HerdJob,
        record: JobRecord,
        status: HerdJobStatus,
        process: ProcessState,
        now: float,
    ) -> Result:
        """`spec.suspend`: stop the job's processes, holding their GPUs until they are gone
        (as any stop: no other job is placed on a GPU a dying worker uses), then give its
        GPUs back through the allocator's release (each drains as any GPU given back) and
        show `Suspended=True`. The status keeps the last epoch, the restarts and a
        `BackOff`'s retry time; nothing is asked of the allocator until it is resumed."""
        generation = record.generation
        if process.phase == ProcessPhase.RUNNING:
            self.launcher.stop(name)
            self._event(name, "Normal", "Suspending", _SUSPENDING, now)
            process = ProcessState(ProcessPhase.STOPPING, launch=process.launch)
        if process.phase == ProcessPhase.STOPPING:
            self._hold_gpus(name, job.spec.priority, record.created_at, job)
            conditions = set_condition(
                status.conditions,
                ConditionType.Running,
                FALSE,
                "Suspending",
                _SUSPENDING,
                generation,
                now,
            )
            self._save(name, status.model_copy(update={"conditions": conditions}), generation, now)
            return Result(requeue_after=self.stop_poll_seconds)
        self.allocator.release(name)
        self._record_release(name, status, "job suspended", now)
        conditions = not_resizing(status.conditions, generation, now)
        for condition_type in (ConditionType.Admitted, ConditionType.Running):
            conditions = set_condition(
                conditions, condition_type, FALSE, "Suspended", _SUSPENDED, generation, now
            )
        was = get_condition(status.conditions, ConditionType.Suspended)
        conditions = set_condition(
            conditions, ConditionType.Suspended, TRUE, "Suspended", _SUSPENDED, generation, now
        )
        if was is None or was.status != TRUE:
            self._event(name, "Normal", "Suspended", _SUSPENDED, now)
        status = status.model_copy(
            update={
                "conditions": conditions,
                "gpus": gpu_counts(job, status, None, 0, None),
                "placement": [],
                "grant_reason": "",
                "workers": None,
            }
        )
        self._save(name, status, generation, now)
        return Result()

    def _resumed(
        self, name: str, status: HerdJobStatus, generation: int, now: float
    ) -> HerdJobStatus:
        """A suspended job whose spec no longer says `suspend`: `Suspended=False Resumed`
        (and an event), then the usual way: admitted when its min fits, launched anew."""
        if not is_true(status.conditions, ConditionType.Suspended):
            return status
        message = "spec.suspend is false: the job is admitted and launched again"
        self._event(name, "Normal", "Resumed", message, now)
        conditions = set_condition(
            status.conditions, ConditionType.Suspended, FALSE, "Resumed", message, generation, now
        )
        return status.model_copy(update={"conditions": conditions})


_SUSPENDING = "spec.suspend is true: stopping the job's workers"
_SUSPENDED = "spec.suspend is true: the job's workers are stopped and its GPUs released"
