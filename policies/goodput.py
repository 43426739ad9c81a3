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

When the workers report the adaptive metrics (`specs.values.ADAPTIVE_METRICS`: the gradient
noise scale, the global batch and the seconds per step, as the worker API's `adaptive` batch
policy does), the policy models goodput as Pollux does: throughput times statistical
efficiency (`policies/efficiency.py`), with the batch chosen per size (`choose_batch`). The
time of a step is fitted as `fixed + per_sample x batch / gpus` on the reported steps
(before two per-GPU batches are measured, half of the one measured step is taken as fixed,
as Pollux's agent assumes: optimistic about a larger batch, so that the job tries one and
the next fit has two points; a `priorSerial` above a half, more); where the reports also
carry the compute seconds and nodes (`specs.values.PLACEMENT_METRICS`), by default it is
Pollux's form instead, compute and synchronisation within and across nodes overlapped
(`policies/stepfit.py`, `stepModel`). Each size's goodput is at
its best batch within the job's max batch and per-GPU memory (`spec.training.maxBatch`,
`maxWorkerBatch`); the gains are in share of the job's goodput on one GPU (its speedup: the
weight every job's GPUs are compared by, whatever its absolute rate), and the decision
carries the batch for the GPUs granted now (`Decision.batch_size`). Such a goodput need not
be concave in the size (Pollux's form across a node's edge): the knee is then read on its
least concave majorant (`goodput_knee`, `policies/concave.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.policies.concave import majorant_knee, running_max
from herd_operator.policies.efficiency import statistical_efficiency
from herd_operator.policies.stepfit import fit_sync_step_time
from herd_operator.specs import HerdJob
from herd_operator.specs.models import SCHEMA_CONFIG
from herd_operator.specs.values import (
    BASE_BATCH_METRIC,
    BATCH_SIZE_METRIC,
    COMPUTE_SECONDS_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    STEP_SECONDS_METRIC,
    Report,
)

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
    """The serial fraction (Amdahl's law) assumed until the job has run at two sizes; with
    the adaptive metrics, the share of a step taken as fixed until two per-GPU batches are
    measured, if above `ONE_POINT_FIXED_SHARE` (a half)."""
    throughput_metric: str = Field(default="throughput", min_length=1)
    """The name of the metric in the workers' reports that holds samples per second; without
    it, the rate of epochs is used."""
    step_model: Literal["line", "pollux"] = "pollux"
    """With the adaptive metrics, the step time's form: `pollux`, compute and synchronisation
    within and across nodes, overlapped (`policies/stepfit.py`), fitted where the reports
    carry the compute seconds (`specs.values.PLACEMENT_METRICS`), else the line; `line`,
    `fixed + perSample x batch / gpus` always (the default until issue 31's session 8: the
    `pollux` form measured 0.911 h against 0.921 h on Pollux's workloads, docs/simulation.md)."""


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


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step: `fixed + per_sample x batch / gpus`."""

    fixed: float
    per_sample: float

    def seconds(self, gpus: int, batch: int) -> float:
        return self.fixed + self.per_sample * batch / gpus

    def repeated_seconds(self, gpus: int, batch: int, once_share: float) -> float:
        return self.seconds(gpus, batch) - once_share * self.fixed


class StepSeconds(Protocol):
    """A step-time model: `StepTime` or `stepfit.SyncStepTime`."""

    def seconds(self, gpus: int, batch: int) -> float: ...

    def repeated_seconds(self, gpus: int, batch: int, once_share: float) -> float:
        """A gradient-accumulation micro-batch of `batch` past a step's first: what of a
        step is done again for each (`once_share`: of a step's fixed part, the share run
        once per step, for a model that cannot tell compute from synchronisation)."""
        ...


@dataclass(frozen=True)
class BatchProfile:
    """What the batch choice knows of a job: its base batch, noise scale, step time and
    limits (None: no limit of that kind)."""

    base_batch: int
    noise_scale: float
    step_time: StepSeconds
    max_batch: int | None = None
    max_worker_batch: int | None = None
    once_share: float = 0.0
    """Of the fitted step's fixed part, the share run once per optimizer step (the
    synchronisation of the gradients), not once per gradient-accumulation micro-batch."""


ONCE_SHARE = 0.5
"""`BatchProfile.once_share` of a job that declares `maxWorkerBatch`: the reports give one
step time, which the line cannot split into compute (repeated by each micro-batch) and
synchronisation (once per step), so half of its fixed part is taken as run once, an
optimistic prior as `ONE_POINT_FIXED_SHARE` is (with none, a micro-batch costs a whole step
and accumulation never pays; in the simulated steps yolov3's synchronisation is a third of
its step on 4 GPUs and two thirds across nodes, and bert's across nodes is longer than its
compute)."""


_CANDIDATES = 64
"""Batches tried between the bounds (geometrically spaced, with both bounds)."""


def batch_bounds(gpus: int, profile: BatchProfile) -> tuple[int, int]:
    """[lower, upper] of the batches `choose_batch` picks from at `gpus` GPUs.

    The rules: never below the base batch (the one the rate was tuned for; at most
    `max_worker_batch` per GPU is not asked of it, it runs with gradient accumulation as
    preserve-batch does) nor below one sample per GPU; above it, at most `max_batch`, which
    a GPU may reach past `max_worker_batch` by gradient accumulation (`step_seconds` charges
    the micro-batches, so the goodput decides whether that pays); without a max batch, at
    most `max_worker_batch` per GPU, or, with neither, the base batch per GPU (what Elastic
    Horovod would train at)."""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    lower = max(profile.base_batch, gpus)
    if profile.max_batch is not None:
        upper = profile.max_batch
    elif profile.max_worker_batch is not None:
        upper = profile.max_worker_batch * gpus
    else:
        upper = profile.base_batch * gpus
    return lower, max(lower, upper)


def accumulation_steps(gpus: int, batch: float, max_worker_batch: int | None) -> int:
    """Micro-batches of one optimizer step of `batch` on `gpus` GPUs: the largest worker's
    share (`ceil(batch / gpus)`, as `agent.batching.plan_batches` cuts it) over
    `max_worker_batch`, rounded up; 1 without that limit."""
    if gpus < 1:
        raise ValueError(f"gpus must be at least 1, got {gpus}")
    if max_worker_batch is None:
        return 1
    share = math.ceil(batch / gpus - 1e-9)
    return max(1, -(-share // max_worker_batch))


def step_seconds(gpus: int, batch: int, profile: BatchProfile) -> float:
    """Seconds of one optimizer step of `batch` on `gpus` GPUs: one fitted step of a
    micro-batch's size (`accumulation_steps`), and for each other micro-batch what the model
    says is done again (`StepSeconds.repeated_seconds`: its compute, or for the line a step
    less the share of its fixed part that runs once, `once_share`)."""
    steps = accumulation_steps(gpus, batch, profile.max_worker_batch)
    if steps == 1:
        return profile.step_time.seconds(gpus, batch)
    micro = math.ceil(batch / steps)
    again = profile.step_time.repeated_seconds(gpus, micro, profile.once_share)
    return profile.step_time.seconds(gpus, micro) + (steps - 1) * again


def goodput(gpus: int, batch: int, profile: BatchProfile) -> float:
    """Base-batch samples of progress per second: throughput x statistical efficiency."""
    seconds = step_seconds(gpus, batch, profile)
    if seconds <= 0:
        return 0.0
    efficiency = statistical_efficiency(profile.noise_scale, batch, profile.base_batch)
    return batch / seconds * efficiency


def choose_batch(gpus: int, profile: BatchProfile) -> int:
    """The global batch of most goodput at `gpus` GPUs within `batch_bounds` (the smaller
    one of equal goodput). Tried: the bounds, batches spaced geometrically between them and,
    with a `max_worker_batch`, the batches that fill every micro-batch (the largest without
    accumulation, and the first one at or above the lower bound)."""
    lower, upper = batch_bounds(gpus, profile)
    candidates = {lower, upper}
    if upper > lower:
        ratio = (upper / lower) ** (1.0 / (_CANDIDATES - 1))
        candidates.update(min(upper, round(lower * ratio**i)) for i in range(_CANDIDATES))
    if profile.max_worker_batch is not None:
        full = profile.max_worker_batch * gpus
        filled = (full, full * -(-lower // full))
        candidates.update(batch for batch in filled if lower <= batch <= upper)
    return max(sorted(candidates), key=lambda batch: goodput(gpus, batch, profile))


ONE_POINT_FIXED_SHARE = 0.5
"""Of a step measured at one per-GPU batch only, the share taken as fixed. Pollux's agent
takes half (adaptdl's `fit_perf_params` with one atomic batch): a model that credits a larger
batch with amortizing it, so the job is given one and the next fit sees two batches. A small
share (the Amdahl prior's 5%) says nearly all of a step grows with the batch, which keeps
the job at its smallest batch, whose steps alone it then ever measures."""


def fit_step_time(
    epochs: Sequence[Report], fixed_share: float = ONE_POINT_FIXED_SHARE
) -> StepTime | None:
    """The step-time model from the reported (world size, batch, step seconds), the latest
    few per point; None without any. Least squares over two per-GPU batches or more, else
    `fixed_share` of the one measured step is fixed."""
    points: dict[tuple[int, float], list[float]] = {}
    for report in epochs:
        seconds = report.metrics.get(STEP_SECONDS_METRIC)
        batch = report.metrics.get(BATCH_SIZE_METRIC)
        if seconds is None or batch is None or seconds <= 0 or batch <= 0:
            continue
        if report.world_size > 0:
            points.setdefault((report.world_size, batch), []).append(seconds)
    samples = [
        (batch / size, statistics.median(times[-_RECENT:]))
        for (size, batch), times in points.items()
    ]
    if not samples:
        return None
    xs = {x for x, _ in samples}
    if len(xs) >= 2:
        mean_x = sum(x for x, _ in samples) / len(samples)
        mean_y = sum(y for _, y in samples) / len(samples)
        spread = sum((x - mean_x) ** 2 for x, _ in samples)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in samples) / spread
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept >= 0:
            return StepTime(intercept, slope)
    # One per-GPU batch, or a fit that says nothing sensible: split the mean step.
    x, y = max(samples)
    return StepTime(fixed_share * y, (1.0 - fixed_share) * y / x)


def per_micro_batch(epochs: Sequence[Report], max_worker_batch: int | None) -> list[Report]:
    """The reports as the fit of one micro-batch sees them: a step reported at a batch that
    took `k` micro-batches (`accumulation_steps`) is a step of `batch / k` samples: its
    batch divided by `k`, and its seconds too where it carries no compute seconds; where it
    does, its compute divided by `k` and its step less the compute of the `k - 1` other
    micro-batches (what `stepfit` fits the synchronisation from). The others, and every
    report without a `max_worker_batch`, as they are."""
    if max_worker_batch is None:
        return list(epochs)
    seen: list[Report] = []
    for report in epochs:
        seconds = report.metrics.get(STEP_SECONDS_METRIC)
        batch = report.metrics.get(BATCH_SIZE_METRIC)
        steps = 1
        if seconds is not None and batch is not None and batch > 0 and report.world_size > 0:
            steps = accumulation_steps(report.world_size, batch, max_worker_batch)
        if steps > 1 and seconds is not None and batch is not None:
            metrics = {**report.metrics, STEP_SECONDS_METRIC: seconds / steps}
            metrics[BATCH_SIZE_METRIC] = batch / steps
            compute = report.metrics.get(COMPUTE_SECONDS_METRIC)
            if compute is not None and 0 < compute <= seconds:
                # The compute measured is every micro-batch's; all but one ran alone, the
                # last one under the synchronisation: one micro-batch's step is the step
                # less the compute of the others.
                metrics[COMPUTE_SECONDS_METRIC] = compute / steps
                metrics[STEP_SECONDS_METRIC] = seconds - compute * (steps - 1) / steps
            report = dataclasses.replace(report, metrics=metrics)
        seen.append(report)
    return seen


def batch_profile(
    job: HerdJob,
    epochs: Sequence[Report],
    prior_serial: float = 0.0,
    step_model: Literal["line", "pollux"] = "pollux",
    gpus_per_node: int | None = None,
) -> BatchProfile | None:
    """The job's profile from its reports: None until one reports the noise scale, the
    batch and the step time (then the policy works as without them). `prior_serial`: the
    share of a step measured at one per-GPU batch taken as fixed, if above a half;
    `step_model`: the step time's form (`GoodputParams.step_model`), `gpus_per_node` what
    the `pollux` form packs a size on."""
    noise = next(
        (
            r.metrics[GRADIENT_NOISE_SCALE_METRIC]
            for r in reversed(epochs)
            if GRADIENT_NOISE_SCALE_METRIC in r.metrics
        ),
        None,
    )
    training = job.spec.training
    max_worker_batch = None if training is None else training.max_worker_batch
    seen = per_micro_batch(epochs, max_worker_batch)
    fixed_share = max(ONE_POINT_FIXED_SHARE, prior_serial)
    step_time: StepSeconds | None = None
    if step_model == "pollux":
        step_time = fit_sync_step_time(seen, gpus_per_node, fixed_share)
    if step_time is None:
        step_time = fit_step_time(seen, fixed_share)
    batches = [
        r.metrics[BATCH_SIZE_METRIC] for r in epochs if r.metrics.get(BATCH_SIZE_METRIC, 0) >= 1
    ]
    if noise is None or step_time is None or not batches or not math.isfinite(noise) or noise < 0:
        return None
    bases = [
        r.metrics[BASE_BATCH_METRIC] for r in epochs if r.metrics.get(BASE_BATCH_METRIC, 0) >= 1
    ]
    base = int(bases[-1]) if bases else int(min(batches))
    return BatchProfile(
        base_batch=base,
        noise_scale=float(noise),
        step_time=step_time,
        max_batch=None if training is None else training.max_batch,
        max_worker_batch=max_worker_batch,
        once_share=0.0 if max_worker_batch is None else ONCE_SHARE,
    )


def goodput_knee(
    profile: BatchProfile, min_gain: float, low: int, high: int
) -> tuple[int, tuple[float, ...], float]:
    """The size to ask for, the gains of GPUs `low + 1` to `high` and the goodput at `low`:
    each in share of the job's goodput on one GPU, each size at its own best batch.

    The goodput need not be concave in the size: across a node's edge (`stepfit`'s sync
    across nodes) a GPU may add nothing while the next node's GPUs together add much. A gain
    is what the GPU adds to the best goodput of any size up to it (`concave.running_max`:
    >= 0, and the GPUs past a dip are counted from the best point before it, so the sum of
    the gains up to a size never exceeds a goodput some size reaches). The size is the knee
    of the least concave majorant (`concave.majorant_knee`): the largest size reached from
    `low` by GPUs that add at least `min_gain` each on average over each hull segment, a size
    past a dip when the GPUs across it pay on average; where the goodput is concave, the
    largest size reached by GPUs that each add at least `min_gain`."""
    best = [goodput(n, choose_batch(n, profile), profile) for n in range(low, high + 1)]
    one = best[0] if low == 1 else goodput(1, choose_batch(1, profile), profile)
    scale = one if one > 0 else 1.0
    curve = running_max([value / scale for value in best])
    gains = tuple(after - before for before, after in itertools.pairwise(curve))
    return low + majorant_knee(curve, min_gain), gains, best[0] / scale


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
        profile = batch_profile(
            job, observed.measured(), params.prior_serial, params.step_model, observed.gpus_per_node
        )
        if profile is not None:
            return _adaptive_decision(job, observed, profile, params.min_gain)
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
            min_speedup=speedup(serial, low),
        )


def _adaptive_decision(
    job: HerdJob, observed: JobObservations, profile: BatchProfile, min_gain: float
) -> Decision:
    low, high = job.spec.gpus.min, job.spec.gpus.max
    knee_size, gains, at_min = goodput_knee(profile, min_gain, low, high)
    size = clamp(job, knee_size)
    granted = observed.allocated if observed.allocated > 0 else size
    batch = choose_batch(granted, profile)
    return Decision(
        size,
        f"goodput: noise scale {profile.noise_scale:.0f} samples, base batch "
        f"{profile.base_batch}: knee at {size} for a gain of {min_gain:g}; "
        f"batch {batch} at {granted} GPUs",
        gains=gains,
        batch_size=batch,
        min_speedup=at_min if at_min > 0 else None,
    )
