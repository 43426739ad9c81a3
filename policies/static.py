"""`static`: a fixed GPU count (by default the job's max)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.specs import HerdJob
from herd_operator.specs.models import SCHEMA_CONFIG


class StaticParams(BaseModel):
    """Parameters of the `static` policy."""

    model_config = ConfigDict(extra="forbid", frozen=True, **SCHEMA_CONFIG)

    gpus: int | None = Field(default=None, ge=1)
    """GPU count to run at, kept within the job's min and max (default: its max)."""

    def gpu_counts(self) -> list[tuple[str, int]]:
        """The GPU counts the params name, by field (the registry warns of any outside the
        job's [min, max], which the decisions are clamped to)."""
        return [] if self.gpus is None else [("gpus", self.gpus)]


class StaticPolicy:
    """Always asks for the same count, clamped into the job's [min, max]."""

    observes: frozenset[Signal] = frozenset()
    """Nothing: the count is fixed."""

    Params = StaticParams

    def __init__(self, params: StaticParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        if self.params.gpus is None:
            return Decision(job.spec.gpus.max, f"static: max {job.spec.gpus.max}")
        gpus = clamp(job, self.params.gpus)
        return Decision(gpus, f"static: {self.params.gpus} GPUs asked, {gpus} within min/max")
