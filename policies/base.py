"""The Policy protocol: how a job's wanted GPU count is decided.

A policy is a pure function of data: the job's spec, what has been observed of
its current run (`JobObservations`) and the time. It does no I/O, so every policy can be tested
exhaustively without processes. The allocator turns the wish into a grant.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from herd_operator.specs import HerdJob
from herd_operator.specs.values import Report, UsageSample


class Signal(enum.StrEnum):
    """What a policy can observe of a job beyond its grant and world size."""

    EPOCHS = "epochs"
    """The workers' epoch-end reports (`JobObservations.epochs`)."""
    USAGE = "usage"
    """GPU memory samples (`JobObservations.usage`); the job's `MetricsStale` condition
    then says when they stop coming."""


@dataclass(frozen=True)
class JobObservations:
    """What has been observed of one run of a job, oldest first. Plain data: no I/O.

    `epochs` and `usage` are filled only for a policy that observes them (`Policy.observes`).
    """

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
    """GPU memory samples of the last hour at most."""
    gpus_per_node: int | None = None
    """The most GPUs one node of the pool holds (None: not known; the simulator knows it,
    the operator leaves it to what the job's reports show)."""
    measurements: Sequence[Report] = ()
    """Reports made within an epoch (`Report.measurement`: the adaptive metrics a few steps
    into a new configuration), oldest first; filled with `epochs`. Last, so that
    the fields before keep their places for callers that pass them by position."""

    def measured(self) -> list[Report]:
        """The epoch ends and the measurements within epochs, oldest first: every report
        whose metrics say how the job trains now."""
        return sorted([*self.epochs, *self.measurements], key=lambda report: report.time)


@dataclass(frozen=True)
class Decision:
    """What a policy wants, and why, in words a person reads in events."""

    gpus: int
    reason: str
    gains: tuple[float, ...] = ()
    """What each GPU above the job's min would add, in share of one GPU's throughput, in
    order (the first is GPU `min + 1`'s), at most one per GPU up to max: with them an
    allocator that divides GPUs by gain (`Allocator(spare_by_gain=True)` for the GPUs nobody
    wants, `share_by_gain=True` for all above the mins) gives each next GPU to the job it
    adds most to."""
    batch_size: int | None = None
    """The global batch (samples) the policy picked for the job at the GPUs it is granted
    (None: the job keeps the batch its spec and batch policy give it)."""
    min_speedup: float | None = None
    """The job's goodput at its min in share of one GPU's, the level `gains` start from
    (None: its min); read by an allocator dividing by speedup (`share_by_speedup`)."""


class Policy(Protocol):
    """A scaling policy. Implementations must be deterministic and side-effect free."""

    observes: frozenset[Signal]
    """What the policy decides on (a class attribute): the reconciler gathers only these.
    The registry gives a plug-in written before this existed its old view (see
    `herd_operator.policies.registry`)."""

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        """Return the GPU count this job should run at, within [min, max], and why."""
        ...


class PolicyError(ValueError):
    """A policy reference or its parameters are invalid; names the offending field.

    `problems` holds every (field, message) found, the first being `field` and `message`:
    a spec's params can be wrong in several places, and each is said once."""

    def __init__(self, field: str, message: str, *, more: Sequence[tuple[str, str]] = ()) -> None:
        self.problems: tuple[tuple[str, str], ...] = ((field, message), *more)
        super().__init__("; ".join(f"{where}: {what}" for where, what in self.problems))
        self.field = field
        self.message = message


def clamp(job: HerdJob, gpus: int) -> int:
    """Bound a wish by the job's own min and max."""
    return max(job.spec.gpus.min, min(job.spec.gpus.max, gpus))
