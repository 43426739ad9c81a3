"""The small interfaces through which the controllers reach the world.

`herd_operator` implements them (SQLite store, central allocator, a launcher that
starts each job as its engine says, spec directory) and hands them in, so the
control loop never imports the runtime and is tested with in-memory parts.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from specs import HerdJob, HerdJobSpec
from specs.values import Demand, Grant

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


class SpecSource(Protocol):
    def view(self, name: str) -> SpecView | None:
        """None when no file declares the name any more (the job was deleted)."""
        ...


class JobRecordLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def spec_path(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def spec_json(self) -> str: ...
    @property
    def generation(self) -> int: ...
    @property
    def status_json(self) -> str: ...
    @property
    def created_at(self) -> float: ...


class ReportLike(Protocol):
    @property
    def epoch(self) -> int | None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def time(self) -> float: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...


class UsageLike(Protocol):
    @property
    def time(self) -> float: ...
    @property
    def gpus(self) -> int: ...
    @property
    def used_bytes(self) -> int: ...
    @property
    def total_bytes(self) -> int: ...


class StorePort(Protocol):
    def get_job(self, name: str) -> JobRecordLike | None: ...
    def list_jobs(self) -> Sequence[JobRecordLike]: ...
    def record_spec(
        self, name: str, spec_path: str, spec_json: str, fingerprint: str, now: float
    ) -> JobRecordLike: ...
    def put_status(self, name: str, status_json: str, now: float) -> None: ...
    def delete_job(self, name: str) -> bool: ...
    def reports(
        self, job: str, since: float | None = None, limit: int = 1000
    ) -> Sequence[ReportLike]: ...
    def usage(
        self, job: str, since: float | None = None, limit: int = 10_000
    ) -> Sequence[UsageLike]: ...
    def add_grant_change(self, job: str, gpus: int, reason: str, now: float) -> None: ...
    def add_event(
        self, job: str | None, type: EventType, reason: str, message: str, now: float
    ) -> object: ...


class AllocatorPort(Protocol):
    def request(self, demand: Demand) -> Grant | None:
        """The job's grant; None when the decision is deferred (the job is woken after)."""
        ...

    def grant(self, job: str) -> Grant | None: ...
    def release(self, job: str) -> None: ...


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


class LauncherPort(Protocol):
    def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo: ...
    def state(self, name: str) -> ProcessState: ...
    def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
        """Why the running `launch` cannot follow this spec without a relaunch ('' if it can).

        The job's engine decides: what it fixes at launch differs by engine.
        """
        ...

    def stop(self, name: str) -> None: ...
    def forget(self, name: str) -> None: ...


class ReconcileObserver(Protocol):
    """Hears about resizes, for metrics; the controllers do not know who listens."""

    def resized(self, job: str, before: int, after: int) -> None: ...
    def resize_completed(self, job: str, seconds: float) -> None: ...


class NoObserver:
    def resized(self, job: str, before: int, after: int) -> None:
        pass

    def resize_completed(self, job: str, seconds: float) -> None:
        pass
