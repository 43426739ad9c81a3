"""The Policy protocol: how a job's wanted GPU count is decided.

A policy is a pure function of data: the job's spec, what has been observed of
its current run (`JobObservations`) and the time. It does no I/O, so every policy can be tested
exhaustively without processes. The allocator turns the wish into a grant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from specs import HerdJob
from specs.values import Report, UsageSample


@dataclass(frozen=True)
class JobObservations:
    """What has been observed of one run of a job, oldest first. Plain data: no I/O."""

    started_at: float
    """When this run was launched."""
    allocated: int
    """GPUs granted now."""
    world_size: int | None = None
    """The world size the workers last reported (None: they report nothing)."""
    last_resize: float | None = None
    """When the job's grant last changed (None: not since it started)."""
    epochs: Sequence[Report] = ()
    """Reports of completed epochs (epoch set), oldest first."""
    usage: Sequence[UsageSample] = ()


@dataclass(frozen=True)
class Decision:
    """What a policy wants, and why, in words a person reads in events."""

    gpus: int
    reason: str


class Policy(Protocol):
    """A scaling policy. Implementations must be deterministic and side-effect free."""

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        """Return the GPU count this job should run at, within [min, max], and why."""
        ...


class PolicyError(ValueError):
    """A policy reference or its parameters are invalid; names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def clamp(job: HerdJob, gpus: int) -> int:
    """Bound a wish by the job's own min and max."""
    return max(job.spec.gpus.min, min(job.spec.gpus.max, gpus))
