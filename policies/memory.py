"""`memory`: resize a job by how much of its GPUs' memory it uses (the HERD thesis policy).

The signal is the job's aggregate GPU memory utilization (used / total over the GPUs it
holds), averaged over its last completed epoch, or over the last `windowSeconds` for jobs
that report no epochs. Below `low` the job gives GPUs back, above `high` it asks for more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.specs import HerdJob
from herd_operator.specs.models import SCHEMA_CONFIG


class MemoryParams(BaseModel):
    """Parameters of the `memory` policy (camelCase in YAML)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        **SCHEMA_CONFIG,
    )

    low: float = Field(default=0.25, gt=0, le=1, strict=True)
    """Below this share of its GPUs' memory in use, the job gives GPUs back (0..1)."""
    high: float = Field(default=0.75, gt=0, le=1, strict=True)
    """Above this share of its GPUs' memory in use, the job asks for more GPUs (0..1)."""
    step: int = Field(default=1, ge=1, strict=True)
    """GPUs added or taken away at each resize."""
    cooldown_epochs: int = Field(default=1, ge=0, strict=True)
    """Full epochs to wait after a start or a resize before the next decision."""
    cooldown_seconds: float = Field(default=30.0, ge=0, strict=True, allow_inf_nan=False)
    """Seconds to wait after a resize before the next decision."""
    window_seconds: float = Field(default=60.0, gt=0, strict=True, allow_inf_nan=False)
    """For jobs that report no epochs: the seconds of memory samples averaged."""
    initial: Literal["max", "min"] | int = "max"
    """GPUs to start with: `max`, `min` or a count."""

    def gpu_counts(self) -> list[tuple[str, int]]:
        """The GPU counts the params name, by field (`step` is a change, not a count)."""
        return [("initial", self.initial)] if isinstance(self.initial, int) else []

    @field_validator("initial", mode="before")
    @classmethod
    def _initial_is_max_min_or_count(cls, value: Any) -> Any:
        # One clear message instead of one error per member of the union.
        is_count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if value in ("max", "min") or is_count:
            return value
        raise PydanticCustomError(
            "memory_initial", f"must be 'max', 'min' or a GPU count of at least 1, got {value!r}"
        )

    @model_validator(mode="after")
    def _low_below_high(self) -> MemoryParams:
        if self.low >= self.high:
            raise PydanticCustomError(
                "memory_thresholds",
                "low ({low}) must be below high ({high})",
                {"low": self.low, "high": self.high},
            )
        return self


@dataclass(frozen=True)
class _Window:
    """The span whose samples make the signal, and how reasons name it."""

    start: float
    end: float
    label: str


class MemoryPolicy:
    """Shrinks a job that uses little of its GPUs' memory and grows one that uses most of it."""

    observes = frozenset({Signal.EPOCHS, Signal.USAGE})
    """GPU memory samples, averaged over the last epoch: the controller reports when the
    samples go stale."""

    Params = MemoryParams

    def __init__(self, params: MemoryParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        params = self.params
        allocated = observed.allocated
        if allocated == 0:
            return self._initial(job)
        if observed.last_resize is not None:
            left = params.cooldown_seconds - (now - observed.last_resize)
            if left > 0:
                return _hold(job, allocated, f"memory: cooldown, {math.ceil(left)}s left")
        window = self._window(observed, now)
        if isinstance(window, str):
            return _hold(job, allocated, window)
        # Samples at another size, or from an earlier stint at this size, describe another run.
        since = window.start
        if observed.last_resize is not None:
            since = max(since, observed.last_resize)
        samples = [
            sample.utilization
            for sample in observed.usage
            if since < sample.time <= window.end and sample.gpus == allocated
        ]
        if not samples:
            return _hold(job, allocated, f"memory: no samples over {window.label} (holding)")
        utilization = sum(samples) / len(samples)
        if utilization < params.low:
            signal = f"memory {_ratio(utilization, params.low)} < {params.low:g}"
            wanted = allocated - params.step
        elif utilization > params.high:
            signal = f"memory {_ratio(utilization, params.high)} > {params.high:g}"
            wanted = allocated + params.step
        else:
            signal = f"memory {utilization:.2f} within [{params.low:g}, {params.high:g}]"
            wanted = allocated
        gpus = clamp(job, wanted)
        return Decision(gpus, f"{signal} over {window.label}: {_change(allocated, wanted, gpus)}")

    def _initial(self, job: HerdJob) -> Decision:
        initial = self.params.initial
        if initial == "max":
            return Decision(job.spec.gpus.max, f"memory: starting at {job.spec.gpus.max}")
        if initial == "min":
            return Decision(job.spec.gpus.min, f"memory: starting at {job.spec.gpus.min}")
        gpus = clamp(job, initial)
        if gpus == initial:
            return Decision(gpus, f"memory: starting at {gpus}")
        return Decision(
            gpus, f"memory: starting at {gpus} ({initial} asked, at {_bound(initial, gpus)})"
        )

    def _window(self, observed: JobObservations, now: float) -> _Window | str:
        """The window the signal is read over, or why there is none yet."""
        # The start counts as a resize from nothing, so `cooldownEpochs` applies to a new run too.
        settled_from, since = observed.started_at, "the start"
        if observed.last_resize is not None:
            settled_from, since = max(settled_from, observed.last_resize), "the resize"
        epochs = observed.epochs
        if not epochs:
            start = now - self.params.window_seconds
            if start < settled_from:
                return f"memory: waiting for a full {self.params.window_seconds:g}s window"
            return _Window(start, now, f"the last {self.params.window_seconds:g}s")
        starts = [observed.started_at, *(epoch.time for epoch in epochs[:-1])]
        full_epochs = sum(1 for start in starts if start >= settled_from)
        needed = self.params.cooldown_epochs
        if full_epochs < needed:
            if needed == 1:
                return f"memory: waiting for a full epoch since {since}"
            return f"memory: waiting for {needed} full epochs since {since} ({full_epochs} so far)"
        last = epochs[-1]
        return _Window(starts[-1], last.time, f"epoch {last.epoch}")


def _hold(job: HerdJob, allocated: int, reason: str) -> Decision:
    """Keep the current count; a spec whose min/max moved past it still wins."""
    gpus = clamp(job, allocated)
    if gpus == allocated:
        return Decision(gpus, reason)
    return Decision(gpus, f"{reason}: {allocated} -> {gpus}, at {_bound(allocated, gpus)}")


def _change(allocated: int, wanted: int, gpus: int) -> str:
    """Say what happens to the count: `4 -> 3`, `holding 2`, `at min 1`, `3 -> 2, at min`."""
    if wanted == gpus:
        return f"holding {gpus}" if gpus == allocated else f"{allocated} -> {gpus}"
    if gpus == allocated:
        return f"at {_bound(wanted, gpus)} {gpus}"
    return f"{allocated} -> {gpus}, at {_bound(wanted, gpus)}"


def _bound(wanted: int, gpus: int) -> str:
    """Which of the job's bounds turned `wanted` into `gpus`."""
    return "min" if wanted < gpus else "max"


def _ratio(utilization: float, threshold: float) -> str:
    """Two decimals, or more where rounding would print `0.25 < 0.25` for 0.2499."""
    text = f"{utilization:.2f}"
    for decimals in range(3, 7):
        if float(text) != threshold:
            break
        text = f"{utilization:.{decimals}f}"
    return text
