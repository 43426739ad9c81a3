"""A policy outside the built-ins, loaded by `module:Class` in the registry tests."""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from policies.base import Decision, JobObservations, Signal, clamp
from specs import HerdJob


class HalfParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    round_up: bool = Field(default=False, strict=True)


class HalfPolicy:
    """Asks for half of the job's max, clamped into [min, max]."""

    observes: frozenset[Signal] = frozenset()

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        most = job.spec.gpus.max
        half = (most + 1) // 2 if self.params.round_up else most // 2
        gpus = clamp(job, half)
        return Decision(gpus, f"half: {gpus} of max {most}")


class RecordingPolicy:
    """Asks for max and keeps what it was shown, for the reconciler's tests."""

    observes = frozenset({Signal.EPOCHS})
    seen: ClassVar[list[JobObservations]] = []

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        self.seen.append(observed)
        return Decision(job.spec.gpus.max, "recording")


class LegacyPolicy:
    """A plug-in written before policies declared what they observe: it sees the epochs."""

    seen: ClassVar[list[JobObservations]] = []

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        self.seen.append(observed)
        return Decision(job.spec.gpus.max, f"legacy: {len(observed.epochs)} epochs")


class LegacyUsagePolicy(LegacyPolicy):
    """A plug-in of that time that asked for GPU usage the way the reconciler then looked."""

    needs_usage = True


class SlottedLegacyPolicy:
    """An older plug-in whose instances take no new attributes."""

    __slots__ = ("params",)

    Params = HalfParams

    def __init__(self, params: HalfParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        return Decision(job.spec.gpus.max, "slotted")


class BadObservesPolicy(LegacyPolicy):
    observes = frozenset({"temperature"})


class NoParamsPolicy:
    """Looks like a policy but has no `Params` model, so the registry must refuse it."""

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        return Decision(job.spec.gpus.min, "no params")
