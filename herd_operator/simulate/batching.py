"""Adaptive batch in the simulated jobs: statistical efficiency and the step time at any batch.

Apart from `model.py` because only jobs that carry a noise profile (Pollux's applications)
use it, and only under `+adaptive`: without it every job trains at its trace's batch at
Amdahl's speedup (`model.py`), as before.

Source: petuum/adaptdl, branch `osdi21-artifact`, `simulator/traces/<application>/` and
`simulator/applications.py`, `simulator.py` (Apache-2.0; Qiao et al., OSDI 2021). As in
`calibration.py`, nothing of those files is kept: `POLLUX_BATCHING` is a table derived
from them by `derive_batching` (`scripts/fit_pollux.py` prints it again from a clone), and
this module's code is ours (the table is in `pollux_profiles.py`). A job under `+adaptive` is
the job Pollux's simulator runs under
Pollux: it declares the application's smallest validated batch B0 as its base batch (the one
its learning rate is tuned for, Pollux's `init_batch_size`) and may be given any batch from
B0 to the largest validated (ncf: 32768 only, as there); until a policy picks one it trains
at its trace row's batch (Pollux's simulator starts at B0 and picks another after a minute;
our workers report `measure_steps` steps into each new size or batch, and at epoch ends).
What is derived, per application:

- progress, counted as Pollux's simulator counts it: a step of batch B in epoch k is worth
  `gain = (B / B0) x (noise + B0) / (noise + B)` steps of B0 (Pollux's eq. 6), and the job
  is done when its progress reaches `progress`, the least any validated batch made in the
  application's epochs (Pollux's completion rule); each of our epochs is one `progress /
  epochs` of it. `noise`, the gradient noise scale in samples, is `B0 x grad_var /
  grad_sqr` of epoch k in `validation-<b>.csv`, kept per epoch for each validated batch b,
  and at a batch between two validated ones interpolated linearly in the batch (Pollux's
  simulator interpolates the two statistics so; the noise measured at a larger batch is
  larger, up to 26 times for bert's first epoch);
- the step time: `steptime.StepModel` of the application, by GPUs and local batch (fitted
  to Pollux's measured steps, with gradient accumulation past the largest local batch);
- the smallest local batch measured (Pollux's `min_local_bsz`): a job on n GPUs trains at
  `n x` that at least, and the max batch over it is the most GPUs Pollux's simulator lets the
  job grow to (`widest`); ncf's is its whole batch (one GPU), as there.

Progress is kept in the job's work units (`JobModel.work`, single-GPU seconds at the trace
batch): `seconds_per_progress` is the work over `progress`, so the time of epoch k on n GPUs
at batch B is `(progress / epochs) x t(n, B) / gain`, whatever the work's unit.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from herd_operator.simulate.calibration import Calibration
from herd_operator.simulate.steptime import (
    POLLUX_STEP_MODELS,
    StepModel,
    packed_nodes,
    trace_rows,
)
from herd_operator.specs.values import (
    BASE_BATCH_METRIC,
    BATCH_SIZE_METRIC,
    COMPUTE_SECONDS_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    NODES_METRIC,
    STEP_SECONDS_METRIC,
)

Noise = tuple[tuple[int, tuple[float, ...]], ...]
"""(batch, the noise scale in samples at each epoch) per validated batch, batches rising."""
NOISE_FLOOR = 1e-3
"""The least noise scale kept (samples): an epoch whose gradient variance was measured as 0
would make every batch above B0 worthless."""


def check_noise(noise: Noise) -> None:
    """Raises ValueError unless `noise` has a batch, batches rise and every scale is > 0."""
    batches = [batch for batch, _ in noise]
    if not noise or batches != sorted(set(batches)) or batches[0] < 1:
        raise ValueError(f"noise: need batches >= 1 in increasing order, got {batches}")
    for batch, scales in noise:
        if not scales or any(not (math.isfinite(n) and n > 0) for n in scales):
            raise ValueError(f"noise at batch {batch}: scales must be finite and > 0")


def _epoch_value(points: tuple[float, ...], fraction: float) -> float:
    index = int(min(max(fraction, 0.0), 1.0) * len(points) + 1e-9)
    return points[min(index, len(points) - 1)]


@dataclass(frozen=True)
class BatchCalibration:
    """One application at one trace batch (the table's key): what adapting its batch
    changes."""

    base_batch: int
    """The smallest validated batch (Pollux's `init_batch_size`): progress is counted in
    its steps, and the job declares it as its base batch."""
    min_batch: int
    """The smallest batch the job may train at: the base batch, ncf's 32768."""
    max_batch: int
    min_local_batch: int
    """The smallest local batch its throughput was measured at (Pollux's `min_local_bsz`)."""
    progress: float
    """Steps of the base batch's worth of progress that complete the job."""
    noise: Noise
    """Per validated batch, in increasing order, its gradient noise scale in samples per
    epoch."""


@dataclass(frozen=True)
class BatchModel:
    """What a simulated job needs to train at another batch than its trace's."""

    base_batch: int
    min_batch: int
    max_batch: int
    min_local_batch: int
    start_batch: int
    """What it trains at until a policy picks a batch: its trace row's (the batch its
    script was set to run at)."""
    seconds_per_progress: float
    """The job's work (single-GPU seconds at its trace batch) per step of progress."""
    step: StepModel
    noise: Noise
    """Per batch, per epoch (or at evenly spaced fractions of the epochs): as
    `BatchCalibration.noise`."""

    def __post_init__(self) -> None:
        if not 1 <= self.base_batch <= self.min_batch <= self.max_batch:
            raise ValueError("need 1 <= base batch <= min batch <= max batch")
        if not self.min_batch <= self.start_batch <= self.max_batch:
            raise ValueError("need min batch <= start batch <= max batch")
        if not 1 <= self.min_local_batch <= self.max_batch:
            raise ValueError("need 1 <= min local batch <= max batch")
        if not (math.isfinite(self.seconds_per_progress) and self.seconds_per_progress > 0):
            raise ValueError("seconds per progress must be finite and > 0")
        check_noise(self.noise)

    def widest(self) -> int:
        """The most GPUs its batch can be spread over: its max batch at its smallest local
        batch (Pollux's simulator bounds a job's replicas by it)."""
        return self.max_batch // self.min_local_batch

    def max_worker_batch(self) -> int:
        """The most samples one GPU computes at once (its step model's largest local batch,
        the largest Pollux measured): what the job declares as `maxWorkerBatch`, past which
        its step is micro-batched (`StepModel.seconds`)."""
        return max(1, math.floor(self.step.max_local_batch + 1e-9))

    def clamp(self, batch: int | None) -> int:
        """The batch the job trains at when asked for `batch` (None: its start batch)."""
        if batch is None:
            return self.start_batch
        return max(self.min_batch, min(self.max_batch, batch))

    def batch_on(self, gpus: int, batch: int) -> int:
        """The batch it takes on `gpus` GPUs when asked for `batch`: at least the smallest
        local batch on each (as Pollux's simulator), within its max batch."""
        return min(self.max_batch, max(self.clamp(batch), self.min_local_batch * gpus))

    def noise_at(self, fraction: float, batch: int) -> float:
        """The noise scale at `fraction` (0..1) of the epochs (that epoch's: a step per
        epoch) when training at `batch` (linear between the validated batches around it)."""
        below = above = self.noise[0]
        for point in self.noise:
            if point[0] <= batch:
                below = point
            if point[0] >= batch:
                above = point
                break
        else:
            above = self.noise[-1]
        low, high = _epoch_value(below[1], fraction), _epoch_value(above[1], fraction)
        if above[0] <= below[0]:
            return low
        share = (batch - below[0]) / (above[0] - below[0])
        return low + share * (high - low)

    def efficiency(self, batch: int, fraction: float) -> float:
        """Progress per sample at `batch` relative to the base batch (Pollux's eq. 6)."""
        noise = self.noise_at(fraction, batch)
        return (noise + self.base_batch) / (noise + batch)

    def step_seconds(self, gpus: int, batch: int) -> float:
        """One step on `gpus` GPUs when asked for global batch `batch`."""
        return self.step.seconds(gpus, self.batch_on(gpus, batch))

    def rate(self, gpus: int, batch: int, fraction: float) -> float:
        """Work per second (the job's units) on `gpus` at `batch`, `fraction` of its epochs
        done."""
        if gpus <= 0:
            return 0.0
        taken = self.batch_on(gpus, batch)
        gain = taken / self.base_batch * self.efficiency(taken, fraction)
        return self.seconds_per_progress * gain / self.step.seconds(gpus, taken)

    def metrics(self, gpus: int, batch: int | None, fraction: float) -> dict[str, float]:
        """What its workers attach to an epoch end at `gpus` and `batch` (None: the base),
        `fraction` of its epochs done: the adaptive metrics (`specs/values.ADAPTIVE_METRICS`)
        and the step's compute and nodes (`PLACEMENT_METRICS`: the step model packs a job on
        whole nodes, so its nodes are the fewest its GPUs fill)."""
        taken = self.batch_on(gpus, self.clamp(batch))
        return {
            GRADIENT_NOISE_SCALE_METRIC: self.noise_at(fraction, taken),
            BATCH_SIZE_METRIC: float(taken),
            STEP_SECONDS_METRIC: self.step.seconds(gpus, taken),
            BASE_BATCH_METRIC: float(self.min_batch),
            COMPUTE_SECONDS_METRIC: self.step.compute_seconds(gpus, taken),
            NODES_METRIC: float(packed_nodes(gpus)),
        }


def batch_model(
    calibration: Calibration, batching: BatchCalibration, step: StepModel | None = None
) -> BatchModel:
    """The job's model from its application's rows (`step`: its step model, by default
    `POLLUX_STEP_MODELS`' for the application)."""
    return BatchModel(
        base_batch=batching.base_batch,
        min_batch=batching.min_batch,
        max_batch=max(batching.max_batch, calibration.batch_size),
        min_local_batch=batching.min_local_batch,
        start_batch=max(batching.min_batch, min(calibration.batch_size, batching.max_batch)),
        seconds_per_progress=calibration.work / batching.progress,
        step=POLLUX_STEP_MODELS[calibration.application] if step is None else step,
        noise=batching.noise,
    )


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


FIXED_BATCH: Mapping[str, int] = {"ncf": 32768}
"""Applications Pollux's simulator keeps at one batch under Pollux too (on one GPU)."""


def derive_batching(
    application: str, epochs: int, validated: list[int], read: Callable[[str], str]
) -> BatchCalibration:
    """The table row of one application; `validated`: the batches of its `validation-*.csv`
    files, `read(name)` the text of one of its trace files."""
    base = min(validated)
    files = {batch: _rows(read(f"validation-{batch}.csv")) for batch in sorted(validated)}
    progress = min(float(rows[epochs - 1]["progress"]) for rows in files.values())
    noise = []
    for batch, rows in files.items():
        scales = []
        for row in rows[:epochs]:
            sqr, var = float(row["grad_sqr"]), float(row["grad_var"])
            scales.append(max(base * var / sqr, NOISE_FLOOR) if sqr > 0 else NOISE_FLOOR)
        noise.append((batch, tuple(scales)))
    fixed = FIXED_BATCH.get(application)
    smallest_local = min(math.ceil(local) for _, _, local, _ in trace_rows(read))
    return BatchCalibration(
        base_batch=base,
        min_batch=fixed or base,
        max_batch=fixed or max(validated),
        min_local_batch=fixed or smallest_local,
        progress=progress,
        noise=tuple(noise),
    )


def series(text: str) -> tuple[float, ...]:
    """Numbers written one after the other (the table keeps each noise profile so)."""
    return tuple(float(word) for word in text.split())
