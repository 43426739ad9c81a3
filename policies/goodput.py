"""`goodput`: run a job at the size where one more GPU still adds enough throughput.

From the epochs the workers report (or a throughput metric they attach to each epoch end),
the policy measures the job's rate at each size it ran at and fits Amdahl's law to them:
the time of an epoch on n GPUs is `serial + parallel / n`. Before any epoch it assumes
`priorSerial` for the serial share; with epochs at one size only, it asks for a second size
to measure (half the first, or one more GPU at the min). The job asks for the largest size
whose last GPU adds at least `minGain` of one GPU's throughput: past that knee a GPU does
more for a job that waits than for this one. It reports the gain of each GPU above its min
too, so that an allocator dividing GPUs by gain can lend it GPUs nobody waits for past the
knee (`spare_by_gain`), or weigh each of its GPUs above the min against other jobs'
(`share_by_gain`). With the batch-preserving modes the global batch does not change with the
size, so statistical efficiency is 1 and throughput is goodput.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.specs import HerdJob
from herd_operator.specs.models import SCHEMA_CONFIG
from herd_operator.specs.values import Report

_RECENT = 3
"""Epochs per size that make its rate (the median): a slow epoch does not move the fit."""


class GoodputParams(BaseModel):
    """Parameters of the `goodput` policy (camelCase in YAML)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        **SCHEMA_CONFIG,
    )

    min_gain: float = Field(default=0.5, gt=0, le=1, strict=True)
    """A GPU is asked for only if it adds at least this share of one GPU's throughput
    (0..1): 0.5 stops where the next GPU would run at half speed."""
    prior_serial: float = Field(default=0.05, ge=0, lt=1, strict=True)
    """The serial fraction (Amdahl's law) assumed until the job has run at two sizes."""
    throughput_metric: str = Field(default="throughput", min_length=1)
    """The name of the metric in the workers' reports that holds samples per second; without
    it, the rate of epochs is used."""


def speedup(serial: float, gpus: int) -> float:
    """Amdahl: throughput on `gpus` GPUs relative to one."""
    return gpus / (1.0 + serial * (gpus - 1)) if gpus > 0 else 0.0


def amdahl_gains(serial: float, low: int, high: int) -> tuple[float, ...]:
    """What each GPU from `low + 1` to `high` adds to Amdahl's speedup, in share of one GPU."""
    return tuple(speedup(serial, gpus + 1) - speedup(serial, gpus) for gpus in range(low, high))


def knee(serial: float, min_gain: float, low: int, high: int) -> int:
    """The largest size in [low, high] whose last GPU adds at least `min_gain` of one GPU."""
    if serial <= 0:
        return high
    # The continuous derivative (1 - s) / (1 + s (n - 1))^2 equals min_gain here; the
    # discrete gain of the n-th GPU is near it, so a few steps settle the exact size.
    guess = 1 + (math.sqrt(max(1 - serial, 0.0) / min_gain) - 1) / serial
    size = max(low, min(high, math.floor(guess) if math.isfinite(guess) else high))
    while size < high and speedup(serial, size + 1) - speedup(serial, size) >= min_gain:
        size += 1
    while size > low and speedup(serial, size) - speedup(serial, size - 1) < min_gain:
        size -= 1
    return size


def rates_by_size(epochs: Sequence[Report], metric: str) -> dict[int, list[float]]:
    """Each size's recent rates: the metric if reported, else epochs per second.

    An epoch counts only if the one before ended at the same size: one that spans a resize
    (or the start) includes a stall.
    """
    rates: dict[int, list[float]] = {}
    previous: Report | None = None
    for report in epochs:
        value = report.metrics.get(metric)
        if value is not None and value > 0:
            rates.setdefault(report.world_size, []).append(float(value))
        elif previous is not None and previous.world_size == report.world_size:
            took = report.time - previous.time
            if took > 0:
                rates.setdefault(report.world_size, []).append(1.0 / took)
        previous = report
    return {size: values[-_RECENT:] for size, values in rates.items() if size > 0}


def fit_serial(rates: dict[int, list[float]]) -> float | None:
    """Amdahl's serial share from the rates at two sizes or more (None with fewer).

    Least squares of time per unit of work against 1/n: time = a / n + b, serial = b / (a + b).
    """
    if len(rates) < 2:
        return None
    points = [(1.0 / size, 1.0 / statistics.median(values)) for size, values in rates.items()]
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    intercept = mean_y - slope * mean_x
    if slope <= 0:
        return 1.0  # no faster with more GPUs: all of it is serial
    return min(1.0, max(0.0, intercept / (slope + intercept)))


class GoodputPolicy:
    """Asks for the size past which one more GPU adds less than `minGain` of a GPU."""

    observes = frozenset({Signal.EPOCHS})
    """Epoch ends (with their world size, and a throughput metric if the workers send one)."""

    Params = GoodputParams

    def __init__(self, params: GoodputParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        params = self.params
        low, high = job.spec.gpus.min, job.spec.gpus.max
        rates = rates_by_size(observed.epochs, params.throughput_metric)
        fitted = fit_serial(rates)
        here = observed.allocated
        if fitted is None and rates and here > 0:
            (measured,) = rates
            if here != measured:
                # Probing: hold until an epoch at this size is measured too.
                return Decision(
                    clamp(job, here), f"goodput: measured at {measured} GPUs: measuring {here}"
                )
            # One size tells nothing of the scaling: measure a second one, halfway down
            # (a shrink is granted at once and stalls least), or one up from the min.
            probe = max(low, (here + 1) // 2) if here > low else min(high, here + 1)
            if probe != here:
                return Decision(probe, f"goodput: measured at {here} GPUs only: probing {probe}")
        serial = params.prior_serial if fitted is None else fitted
        size = clamp(job, knee(serial, params.min_gain, low, high))
        source = (
            f"serial share {serial:.3f} fitted on sizes {', '.join(map(str, sorted(rates)))}"
            if fitted is not None
            else f"prior serial share {serial:g}"
        )
        return Decision(
            size,
            f"goodput: {source}: knee at {size} for a gain of {params.min_gain:g}",
            gains=amdahl_gains(serial, low, high),
        )
