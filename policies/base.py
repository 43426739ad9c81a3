"""The Policy protocol: how a job's wanted GPU count is decided.

A policy is a pure function of data: the job's spec, what has been observed of
it (oldest first) and the time. It does no I/O, so every policy can be tested
exhaustively without processes. The allocator turns the wish into a grant.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specs import HerdJob


@dataclass(frozen=True)
class Observation:
    """One look at a running job, as the controller saw it."""

    time: float
    allocated: int
    """GPUs granted to the job when this was observed."""
    world_size: int | None = None
    """Horovod world size the workers last reported (None: they report nothing)."""
    epoch: int | None = None
    """Last completed epoch the workers reported."""
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    """What a policy wants, and why, in words a person reads in events."""

    gpus: int
    reason: str


class Policy(Protocol):
    """A scaling policy. Implementations must be deterministic and side-effect free."""

    def desired(self, job: HerdJob, history: Sequence[Observation], now: float) -> Decision:
        """Return the GPU count this job should run at, within [min, max]."""
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
