"""The reconcile's gates around a run: its dependencies before it is admitted, its time
limit while it runs.

`GateSteps._dependencies_gate` holds a job that names `spec.dependsOn` out of the
allocator until each of them has Succeeded (`DependenciesMet=False Waiting`), and fails it
(`DependencyFailed`) when one never can; `_deadline_gate` stops a run that has reached
`spec.activeDeadlineSeconds` and marks it Failed (`DeadlineExceeded`) once its processes
are gone, its GPUs released. The rules are `limits.py`'s pure functions; this module reads
the states and times they take from the store and the spec source, and writes the
outcome. Apart from the launch, running and stop steps: it decides whether those run.
"""

from __future__ import annotations

from herd_operator.controllers.job_status import (
    FALSE,
    TRUE,
    ReconcilerBase,
    gpu_counts,
    not_resizing,
)
from herd_operator.controllers.limits import (
    DependencyState,
    Verdict,
    deadline_exceeded,
    deadline_message,
    dependency_verdict,
)
from herd_operator.controllers.ports import ProcessPhase, ProcessState, Result
from herd_operator.specs import (
    Condition,
    ConditionType,
    HerdJob,
    get_condition,
    is_true,
    set_condition,
)
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus

DEADLINE_EXCEEDED = "DeadlineExceeded"
DEPENDENCY_FAILED = "DependencyFailed"
WAITING = "Waiting"


def run_start(status: HerdJobStatus, process: ProcessState) -> float | None:
    """When the job's run first started; a status stored before `runStartedAt` existed
    counts from its running launch's start."""
    if status.run_started_at is not None:
        return status.run_started_at
    return process.launch.started_at if process.launch is not None else None


class GateSteps(ReconcilerBase):
    """A job's dependencies and time limit."""

    def _dependency_states(self, depends_on: list[str]) -> dict[str, DependencyState]:
        states: dict[str, DependencyState] = {}
        for name in depends_on:
            record = self.store.get_job(name)
            declared = self.specs.view(name) is not None
            if record is None:
                if declared:  # its file is there, not recorded yet (or invalid)
                    states[name] = DependencyState.UNFINISHED
                continue  # missing
            if not declared:
                states[name] = DependencyState.DELETED
            elif is_true(record.status.conditions, ConditionType.Succeeded):
                states[name] = DependencyState.SUCCEEDED
            elif is_true(record.status.conditions, ConditionType.Failed):
                states[name] = DependencyState.FAILED
            else:
                states[name] = DependencyState.UNFINISHED
        return states

    def _dependencies_gate(
        self,
        name: str,
        job: HerdJob,
        record: JobRecord,
        status: HerdJobStatus,
        generation: int,
        now: float,
    ) -> tuple[HerdJobStatus, Result | None]:
        """Before a run's first start: whether its dependencies let the job ask for GPUs.

        Returns the status to go on with and None when they do (or it names none, or its
        run has started: a dependency is a condition to start, not to keep running); else
        the status written and the result that ends this reconcile. A waiting job asks the
        allocator for nothing, so it holds no place in the queue, and looks again every
        resync (a dependency's success wakes no one else).
        """
        depends_on = job.spec.depends_on
        if not depends_on or status.run_started_at is not None:
            return status, None
        verdict = dependency_verdict(
            depends_on, self._dependency_states(depends_on), record.created_at, now
        )
        conditions = status.conditions
        if verdict.verdict is Verdict.MET:
            conditions = set_condition(
                conditions, ConditionType.DependenciesMet, TRUE, "Met", verdict.message,
                generation, now,
            )  # fmt: skip
            return status.model_copy(update={"conditions": conditions}), None
        self.allocator.release(name)  # a demand made before dependsOn was added
        before = get_condition(conditions, ConditionType.DependenciesMet)
        if verdict.verdict is Verdict.WAITING:
            conditions = set_condition(
                conditions, ConditionType.DependenciesMet, FALSE, WAITING, verdict.message,
                generation, now,
            )  # fmt: skip
            conditions = set_condition(
                conditions, ConditionType.Admitted, FALSE, WAITING, verdict.message,
                generation, now,
            )  # fmt: skip
            if before is None or before.reason != WAITING:
                self._event(name, "Normal", WAITING, verdict.message, now)
            status = status.model_copy(
                update={"conditions": conditions, "gpus": gpu_counts(job, status, None, 0, None)}
            )
            self._save(name, status, generation, now)
            return status, Result(requeue_after=self.resync_seconds)
        self._event(name, "Warning", DEPENDENCY_FAILED, verdict.message, now)
        for condition_type in (ConditionType.DependenciesMet, ConditionType.Admitted):
            conditions = set_condition(
                conditions, condition_type, FALSE, DEPENDENCY_FAILED, verdict.message,
                generation, now,
            )  # fmt: skip
        status = self._failed(
            job, status, conditions, DEPENDENCY_FAILED, verdict.message, generation, now
        )
        self._save(name, status, generation, now)
        return status, Result()

    def _deadline_gate(
        self,
        name: str,
        job: HerdJob,
        record: JobRecord,
        status: HerdJobStatus,
        process: ProcessState,
        generation: int,
        now: float,
    ) -> Result | None:
        """A run past `activeDeadlineSeconds`: stop its processes (holding their GPUs until
        they are gone), then mark it Failed `DeadlineExceeded` and release its GPUs. None
        while the run is within its limit (or has none)."""
        limit = job.spec.active_deadline_seconds
        started = run_start(status, process)
        if limit is None or started is None or not deadline_exceeded(limit, started, now):
            return None
        message = deadline_message(limit, started, now)
        conditions = status.conditions
        if process.phase in (ProcessPhase.RUNNING, ProcessPhase.STOPPING):
            running = get_condition(conditions, ConditionType.Running)
            if process.phase == ProcessPhase.RUNNING:
                self.launcher.stop(name)
            if running is None or running.reason != DEADLINE_EXCEEDED:
                self._event(name, "Warning", DEADLINE_EXCEEDED, f"{message}: stopping it", now)
                conditions = set_condition(
                    conditions, ConditionType.Running, FALSE, DEADLINE_EXCEEDED,
                    f"{message}: stopping it", generation, now,
                )  # fmt: skip
            self._hold_gpus(name, job.spec.priority, record.created_at, job)
            self._save(name, status.model_copy(update={"conditions": conditions}), generation, now)
            return Result(requeue_after=self.stop_poll_seconds)
        self._event(name, "Warning", DEADLINE_EXCEEDED, f"{message}: failed", now)
        conditions = set_condition(
            conditions, ConditionType.Running, FALSE, DEADLINE_EXCEEDED, message, generation, now
        )
        status = self._failed(job, status, conditions, DEADLINE_EXCEEDED, message, generation, now)
        self._save(name, status, generation, now)
        return Result()

    def _failed(
        self,
        job: HerdJob,
        status: HerdJobStatus,
        conditions: tuple[Condition, ...],
        reason: str,
        message: str,
        generation: int,
        now: float,
    ) -> HerdJobStatus:
        """The job failed for ``reason`` with nothing of it running: it holds no GPU."""
        name = job.name
        self.allocator.release(name)
        self._record_release(name, status, f"job failed: {reason}", now)
        conditions = not_resizing(conditions, generation, now)
        conditions = set_condition(
            conditions, ConditionType.Failed, TRUE, reason, message, generation, now
        )
        return status.model_copy(
            update={
                "conditions": conditions,
                "finished_at": now,
                "observed_generation": generation,
                "gpus": gpu_counts(job, status, None, 0, None),
                "placement": [],
                "retry_at": None,
                "workers": None,
            }
        )
