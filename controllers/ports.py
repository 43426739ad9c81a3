"""The small interfaces through which the controllers reach the world.

`herd_operator` implements them (SQLite store, central allocator, a launcher that
starts each job as its engine says, spec directory) and hands them in, so the
control loop never imports the runtime and is tested with in-memory parts.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from herd_operator.specs import HerdJob, HerdJobSpec
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus, ResizeCost
from herd_operator.specs.values import Demand, Grant, Report, ResizeMode, UsageSample

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True)
class SpecView:
    """What the spec directory says of one job name right now."""

    name: str
    path: str
    job: HerdJob | None
    """The spec, or None when the file that declares the name is invalid now."""
    errors: tuple[str, ...] = ()
    fingerprint: str = ""
    """The spec's content hash when the source already computed it ("" otherwise)."""


@dataclass(frozen=True)
class Result:
    """What the queue should do next with a reconciled key (None: nothing until an event)."""

    requeue_after: float | None = None
    keep_backoff: bool = False
    """Keep counting the key's failures in a row rather than forget them: the reconcile
    started a launch whose command is not yet seen to run. A keeper that cannot execute
    it ends a moment later, and that launch failure must wait longer than the last one,
    not 1 s again after every start. (The next reconcile that goes through forgets.)"""


class SpecSource(Protocol):
    def view(self, name: str) -> SpecView | None:
        """None when no file declares the name any more (the job was deleted)."""
        ...


class StorePort(Protocol):
    def get_job(self, name: str) -> JobRecord | None: ...
    def list_jobs(self) -> Sequence[JobRecord]: ...
    def record_spec(
        self, name: str, spec_path: str, job: HerdJob, fingerprint: str, now: float
    ) -> JobRecord:
        """Record a good spec; a new fingerprint bumps the generation."""
        ...

    def put_status(self, name: str, status: HerdJobStatus, now: float) -> bool:
        """Replace the job's status unless it equals the stored one; True if it was written."""
        ...

    def delete_job(self, name: str) -> bool: ...
    def reports(
        self, job: str, since: float | None = None, limit: int = 1000
    ) -> Sequence[Report]: ...

    def usage(
        self, job: str, since: float | None = None, limit: int = 10_000
    ) -> Sequence[UsageSample]: ...
    def add_grant_change(self, job: str, gpus: int, reason: str, now: float) -> None: ...
    def add_event(
        self, job: str | None, type: EventType, reason: str, message: str, now: float
    ) -> object: ...


@dataclass(frozen=True)
class Workers:
    """A launch's workers as their GPU bindings show them (the shim binds each worker with
    its pid): what a script that never reports shows of itself."""

    alive: int
    """Workers bound to a GPU of the job's grant that run, started since the launch did."""
    idle: tuple[tuple[str, int], ...]
    """The granted GPUs (host, index) with no such worker."""


class AllocatorPort(Protocol):
    def request(self, demand: Demand) -> Grant | None:
        """The job's grant; None when the decision is deferred (the job is woken after)."""
        ...

    def grant(self, job: str) -> Grant | None: ...
    def release(self, job: str) -> None: ...
    def workers(self, job: str, since: float) -> Workers | None:
        """The job's workers started since `since` (unix time: the launch's start); None
        when it holds no GPU or one on a host whose processes cannot be seen from here."""
        ...


@dataclass(frozen=True)
class NodeVerdict:
    """Whether a job's failure was its nodes': what `NodesPort.exit_verdict` found."""

    lost: tuple[str, ...] = ()
    """Nodes where the job's workers ran that were lost: the job ended because of them."""
    waiting: tuple[str, ...] = ()
    """Nodes not heard from since the job ended: not known yet (ask again shortly)."""


class NodesPort(Protocol):
    def exit_verdict(self, key: str, job: str, hosts: Sequence[str]) -> NodeVerdict:
        """A launch (`key`) of `job` whose workers ran on `hosts` ended in failure: which of
        those nodes were lost, and which are not heard from yet. Asking makes them suspect
        (none of their free GPUs is granted) until each is heard from."""
        ...


class NoNodes:
    """A pool on one host: no node can be lost from under a job."""

    def exit_verdict(self, key: str, job: str, hosts: Sequence[str]) -> NodeVerdict:
        return NodeVerdict()


class ProcessPhase(enum.Enum):
    ABSENT = "absent"
    RUNNING = "running"
    STOPPING = "stopping"
    EXITED = "exited"


@dataclass(frozen=True)
class LaunchInfo:
    launch_id: str
    pid: int
    started_at: float
    generation: int
    command: str
    """What was started, as messages name it: "horovodrun exited with status 1"."""
    spec: HerdJobSpec
    """The spec it was started for, which the launcher compares with later specs."""


@dataclass(frozen=True)
class ProcessState:
    phase: ProcessPhase
    exit_code: int | None = None
    launch: LaunchInfo | None = None
    stopped_by_us: bool = False
    launch_error: str | None = None
    """Why the command never ran (the keeper could not execute it); None when it ran."""
    ended_at: float | None = None
    """When the launch ended (exited only; unix time, from its keeper's exit record): a
    launch that ended while no operator ran is seen long after. None when unknown."""
    out_of_memory: tuple[str, ...] = ()
    """Exited with a failure only: the workers whose output says they ran out of GPU memory
    ("rank 1"), from the launch's log; () when none did or the log is not known."""
    error: str = ""
    """Exited with a failure only: the error the job's driver printed last (`the workers'
    first meeting failed: ...`), from the launch's log; '' when none or not known."""


class LauncherPort(Protocol):
    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo: ...
    def state(self, name: str) -> ProcessState: ...
    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        """Why the running `launch` cannot follow this spec without a relaunch ('' if it can).

        The job's engine decides: what it fixes at launch differs by engine.
        """
        ...

    def resize_mode(self, kind: str) -> ResizeMode | None:
        """What a resize does to the workers of a job launched on the engine of `kind`
        (`spec.engine.kind`), as that engine says; None when this operator has no such
        engine."""
        ...

    def stop(self, name: str) -> None: ...
    def forget(self, name: str) -> None: ...


class ReconcileObserver(Protocol):
    """Hears about resizes, for metrics; the controllers do not know who listens."""

    def resized(self, job: str, before: int, after: int) -> None: ...
    def resize_completed(self, job: str, cost: ResizeCost) -> None: ...


class NoObserver:
    def resized(self, job: str, before: int, after: int) -> None:
        pass

    def resize_completed(self, job: str, cost: ResizeCost) -> None:
        pass
