"""`schedule`: resize a job on a fixed plan, for controlled up/downscaling experiments.

Example: run on 2 GPUs, on 4 from epoch 3 and on 2 again from epoch 6::

    policy:
      name: schedule
      params:
        initial: 2
        steps: [{atEpoch: 3, gpus: 4}, {atEpoch: 6, gpus: 2}]
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.specs import HerdJob
from herd_operator.specs.models import SCHEMA_CONFIG

_CAMEL_CONFIG = ConfigDict(
    extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True, **SCHEMA_CONFIG
)


class ScheduleStep(BaseModel):
    """From a point of the run on, run at `gpus`; the point is an epoch or a time."""

    model_config = _CAMEL_CONFIG

    at_epoch: int | None = Field(default=None, ge=0, strict=True)
    """The step starts once the workers report this epoch (give this or afterSeconds)."""
    after_seconds: float | None = Field(default=None, ge=0, strict=True, allow_inf_nan=False)
    """The step starts this many seconds after the job started (or this or atEpoch)."""
    gpus: int = Field(ge=1, strict=True)
    """GPUs to run on from this step on."""

    @model_validator(mode="after")
    def _one_trigger(self) -> ScheduleStep:
        if (self.at_epoch is None) == (self.after_seconds is None):
            got = "neither" if self.at_epoch is None else "both"
            raise PydanticCustomError(
                "schedule_step_trigger",
                "a step needs exactly one of atEpoch or afterSeconds, got {got}",
                {"got": got},
            )
        return self


class ScheduleParams(BaseModel):
    """Parameters of the `schedule` policy (camelCase in YAML)."""

    model_config = _CAMEL_CONFIG

    initial: int | None = Field(default=None, ge=1, strict=True)
    """GPUs to run on before the first step (default: the job's min)."""
    steps: list[ScheduleStep] = Field(min_length=1)
    """The plan: each step's count holds from its epoch or time on."""

    def gpu_counts(self) -> list[tuple[str, int]]:
        """The GPU counts the params name, by field."""
        counts = [] if self.initial is None else [("initial", self.initial)]
        return counts + [(f"steps[{i}].gpus", step.gpus) for i, step in enumerate(self.steps)]

    @field_validator("steps")
    @classmethod
    def _each_kind_increases(cls, steps: list[ScheduleStep]) -> list[ScheduleStep]:
        last_of_kind: dict[str, tuple[int, float]] = {}
        for index, step in enumerate(steps):
            kind, point = _trigger_point(step)
            if kind in last_of_kind and point <= last_of_kind[kind][1]:
                before, before_point = last_of_kind[kind]
                raise PydanticCustomError(
                    "schedule_step_order",
                    f"steps[{index}]: {kind} {_number(point)} must be greater than the "
                    f"{_number(before_point)} of steps[{before}] (steps of one kind must be "
                    "strictly increasing)",
                )
            last_of_kind[kind] = (index, point)
        return steps


def _trigger_point(step: ScheduleStep) -> tuple[str, float]:
    if step.after_seconds is not None:
        return "afterSeconds", step.after_seconds
    return "atEpoch", float(step.at_epoch or 0)


class SchedulePolicy:
    """Asks for the `gpus` of the last step that applies, else `initial` (default: min)."""

    observes = frozenset({Signal.EPOCHS})
    """The epochs, for `atEpoch` steps."""

    Params = ScheduleParams

    def __init__(self, params: ScheduleParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        # (when the step's trigger happened, its index): the latest wins, ties by list order.
        latest: tuple[float, int] | None = None
        for index, step in enumerate(self.params.steps):
            triggered = _triggered_at(step, observed, now)
            if triggered is not None and (latest is None or (triggered, index) > latest):
                latest = (triggered, index)
        if latest is None:
            asked = self.params.initial or job.spec.gpus.min
            label = f"schedule: initial {_gpu_count(asked)}"
        else:
            step = self.params.steps[latest[1]]
            asked = step.gpus
            label = f"schedule: {_gpu_count(asked)} {_trigger_label(step)}"
        gpus = clamp(job, asked)
        if gpus == asked:
            return Decision(gpus, label)
        return Decision(gpus, f"{label}, at {'min' if asked < gpus else 'max'} {gpus}")


def _triggered_at(step: ScheduleStep, observed: JobObservations, now: float) -> float | None:
    """When the step's trigger happened, or None if it has not yet."""
    if step.after_seconds is not None:
        due = observed.started_at + step.after_seconds
        return due if now - observed.started_at >= step.after_seconds else None
    if not step.at_epoch:
        return observed.started_at
    # Epoch N begins when the workers report the end of epoch N-1.
    return next(
        (
            end.time
            for end in observed.epochs
            if end.epoch is not None and end.epoch >= step.at_epoch - 1
        ),
        None,
    )


def _trigger_label(step: ScheduleStep) -> str:
    if step.after_seconds is None:
        return f"from epoch {step.at_epoch}"
    return f"after {_number(step.after_seconds)}s"


def _number(value: float) -> str:
    """`120` for 120.0, `1.5` for 1.5, without exponents for large values."""
    return str(int(value)) if value.is_integer() else str(value)


def _gpu_count(gpus: int) -> str:
    return "1 GPU" if gpus == 1 else f"{gpus} GPUs"
