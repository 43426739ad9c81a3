"""The reconcile's steps around a launch: start it or wait, and act on how it ended.

`LaunchSteps._start_or_wait` starts the job's processes once it is admitted (or shows why
it waits); `_after_exit` reads an exit: a success, a failure to retry under the spec's
`restartPolicy` (`BackOff`, then `Failed`), a launch that ended with a lost node (launched
again, not counted), a command that never ran (`LaunchFailed`), or a run the spec had moved
past. Apart from the running job's step and the stopping ones: these change what runs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NoReturn

from herd_operator.controllers.errors import LAUNCH_BACKOFF, LaunchError
from herd_operator.controllers.job_status import (
    FALSE,
    TRUE,
    ReconcilerBase,
    gpu_counts,
    not_resizing,
    preempted_for,
)
from herd_operator.controllers.ports import (
    LaunchInfo,
    NodeVerdict,
    ProcessState,
    Result,
)
from herd_operator.specs import (
    Condition,
    ConditionType,
    HerdJob,
    get_condition,
    is_true,
    set_condition,
)
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Grant

# The reconcile's lines keep the logger name they had when it was one module.
log = logging.getLogger("herd_operator.controllers.reconciler")


def restart_delay(restarts: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Backoff before relaunching a failed job: 1 s, 2 s, 4 s ... up to a minute."""
    return min(cap, base * 2.0 ** max(0, restarts - 1))


class LaunchSteps(ReconcilerBase):
    """Starting a job's launch and acting on its exit."""

    def _start_or_wait(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        grant: Grant,
        desired: int,
        generation: int,
        now: float,
        failures: int,
    ) -> Result:
        """Start the job's launch once it is admitted (and a failed run's `BackOff` is over);
        else show why it waits. A launch that cannot be started raises `LaunchError` after
        the status shows it (see `_launch_failed`)."""
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
                update={"conditions": conditions, "gpus": gpu_counts(job, status, desired, 0, None)}
            )
            self._save(name, status, generation, now)
            if is_true(conditions, ConditionType.Preempted):
                # Its GPUs drain until its workers are seen gone, which a request looks at:
                # the job it yielded to waits on that, and no other job may be asking.
                return Result(requeue_after=self.resync_seconds)
            return Result()  # the allocator wakes the job when its grant changes
        retry_at = status.retry_at  # a failed run restarts after its BackOff
        if retry_at is not None and retry_at > now:
            status = status.model_copy(
                update={"gpus": gpu_counts(job, status, desired, size, None)}
            )
            self._save(name, status, generation, now)
            return Result(requeue_after=retry_at - now)
        conditions = set_condition(
            conditions, ConditionType.Admitted, TRUE, "Admitted", grant.reason, generation, now
        )
        status = status.model_copy(update={"conditions": conditions})
        try:
            launch = self.launcher.start(job, generation, size)
        except (OSError, RuntimeError) as err:
            status = status.model_copy(
                update={"gpus": gpu_counts(job, status, desired, size, None)}
            )
            self._launch_failed(name, status, str(err), generation, now, failures)
        self._event(
            name, "Normal", "Started", f"{launch.command} pid {launch.pid} with {size} workers", now
        )
        # Whether the workers report is a fact about a launch: this one has not said yet.
        conditions = tuple(c for c in conditions if c.type != ConditionType.Reporting)
        conditions = self._readmitted(name, conditions, size, generation, now)
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
                "gpus": gpu_counts(job, status, desired, size, None),
                **_launch_fields(status, launch),
            }
        )
        self._save(name, status, generation, now)
        # Whether the command runs shows only when the keeper executes it: a launch failure
        # then must back off from where the last one left (`Result.keep_backoff`).
        return Result(requeue_after=self.resync_seconds, keep_backoff=True)

    def _readmitted(
        self,
        name: str,
        conditions: tuple[Condition, ...],
        size: int,
        generation: int,
        now: float,
    ) -> tuple[Condition, ...]:
        """A preempted job launched again: `Preempted=False Readmitted` and an event (a
        script that keeps a checkpoint goes on from it)."""
        if preempted_for(conditions) is None:
            return conditions
        message = f"granted {size} GPU(s) again: launched again after its preemption"
        self._event(name, "Normal", "Readmitted", message, now)
        return set_condition(
            conditions, ConditionType.Preempted, FALSE, "Readmitted", message, generation, now
        )

    def _launch_failed(
        self,
        name: str,
        status: HerdJobStatus,
        error: str,
        generation: int,
        now: float,
        failures: int,
    ) -> NoReturn:
        """The job's command could not be started (no horovodrun on PATH, a missing
        workingDir, an executable that cannot be run): shown where people look, then tried
        again after a growing delay, since the cause may be fixed without touching the spec.

        The retry is the work queue's, as for any temporary error: `LaunchError` is raised
        once the status is saved, and the loop requeues the job on `LAUNCH_BACKOFF` from the
        job's count of failed reconciles in a row (`failures`, before this one), which is
        how this status knows when the next try comes. A retry time kept in the status as
        well (as before) was a second backoff: it held back a spec edit that mended the
        command for up to a minute, and the loop had to stand in for it when the store lost
        the status. The event's text stays the same from one attempt to the next, so that
        the store counts the attempts on one event instead of adding a row for each.
        """
        attempt = failures + 1
        delay = LAUNCH_BACKOFF.delay(attempt)
        message = f"cannot launch {name}: {error}"
        self._event(name, "Warning", "LaunchFailed", message, now)
        conditions = set_condition(
            status.conditions,
            ConditionType.Running,
            FALSE,
            "LaunchFailed",
            f"{message} (attempt {attempt}; next in {delay:.0f}s)",
            generation,
            now,
        )
        self._save(name, status.model_copy(update={"conditions": conditions}), generation, now)
        raise LaunchError(message)

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
                **_launch_fields(status, launch),
            }
        )

    def _after_exit(
        self,
        name: str,
        job: HerdJob,
        status: HerdJobStatus,
        process: ProcessState,
        generation: int,
        now: float,
        failures: int,
    ) -> HerdJobStatus | None:
        """The job's processes exited: a success, a failure to retry or give up on, a run
        that ended with a node of its, or a run the spec had already moved past. None while
        a failure cannot be told from a node's loss yet (its nodes are being asked). A
        command that never ran raises `LaunchError` (see `_launch_failed`)."""
        if _exit_recorded(status, process):
            # The status already says how this launch ended: its record outlived the commit
            # of that status (the operator was killed before removing it). Acting again
            # would count a failure twice.
            self.launcher.forget(name)
            return status
        if process.launch_error:
            # The command never ran (the keeper could not execute it): not the job's exit.
            self.launcher.forget(name)
            self._launch_failed(name, status, process.launch_error, generation, now, failures)
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
        # retry_at: the exit is recorded (`_exit_recorded`), and the relaunch waits for nothing.
        return status.model_copy(update={"conditions": conditions, "retry_at": now})

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
        status = status.model_copy(update={"workers": None})
        # When it ended: a launch that ended while no operator ran is seen at the restart.
        ended = min(process.ended_at, now) if process.ended_at is not None else now
        # No process of the launch is left to resize (a failed job showed Resizing=True).
        conditions = not_resizing(status.conditions, generation, now)
        code = process.exit_code
        stopped_for = preempted_for(conditions) or ""
        # A launch adopted while it stopped for a preemption no longer says it was stopped.
        if process.stopped_by_us or (stopped_for and code != 0):
            if stopped_for:
                # Not a failure: no restart counted; launched again when granted again.
                reason, message = "Preempted", f"workers stopped: {stopped_for}"
            else:
                reason, message = "Stopped", "stopped to relaunch"
            conditions = set_condition(
                conditions, ConditionType.Running, FALSE, reason, message, generation, now
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
        if process.out_of_memory:
            # Said apart from the exit: on a shared GPU it means the job outgrew its share.
            out_of_memory = out_of_memory_message(name, process.out_of_memory)
            message = f"{message}: {out_of_memory}"
            self._event(name, "Warning", "OutOfMemory", out_of_memory, now)
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
                "retry_at": None,
                "finished_at": None,
            }
        )


def _launch_fields(status: HerdJobStatus, launch: LaunchInfo) -> dict[str, object]:
    """What a status says of a launch it now names: its id and start, nothing reported yet,
    and the run's clock (activeDeadlineSeconds), which starts at the run's first launch."""
    return {
        "launch_id": launch.launch_id,
        "started_at": launch.started_at,
        "retry_at": None,
        "epoch": None,
        "workers": None,
        "run_started_at": status.run_started_at
        if status.run_started_at is not None
        else launch.started_at,
    }


def _exit_recorded(status: HerdJobStatus, process: ProcessState) -> bool:
    """Whether ``status`` already records the end of the exited launch ``process``: it
    names that launch, and is finished or waits to retry, or shows that its command could
    not be executed (what recording an exit sets; a new launch changes the launch id and
    clears the retry time)."""
    launch = process.launch
    if launch is None or status.launch_id != launch.launch_id:
        return False
    if status.finished_at is not None or status.retry_at is not None:
        return True
    running = get_condition(status.conditions, ConditionType.Running)
    return bool(process.launch_error) and running is not None and running.reason == "LaunchFailed"


def _exit_message(process: ProcessState) -> str:
    if process.exit_code is None:
        # Only a launch adopted after an operator restart lacks one: it ended while no
        # operator ran, and its keeper was killed with it.
        return f"{_command(process)} ended while no operator ran; its exit status is unknown"
    exited = f"{_command(process)} exited with status {process.exit_code}"
    # What its driver said of the failure, where it said something: the status alone (1)
    # does not name the cause.
    return f"{exited}: {process.error}" if process.error else exited


def out_of_memory_message(name: str, workers: tuple[str, ...]) -> str:
    """`rank 1 of job a ran out of GPU memory`, for the workers whose output said so."""
    who = ", ".join(workers)
    verb = "ran" if len(workers) == 1 else "each ran"
    return f"{who} of job {name} {verb} out of GPU memory (CUDA out of memory)"


def _command(process: ProcessState) -> str:
    """What the launch started ("horovodrun"), for messages about its exit."""
    return process.launch.command if process.launch is not None else "the job's process"
