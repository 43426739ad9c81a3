"""Adaptive batch in the simulated jobs: statistical efficiency and the step time at any batch.

Apart from `model.py` because only jobs that carry a noise profile (Pollux's applications)
use it: a job without one, or one kept at its trace's batch, progresses exactly as before.

Source: petuum/adaptdl, branch `osdi21-artifact`, `simulator/traces/<application>/` and
`simulator/applications.py`, `simulator.py` (Apache-2.0; Qiao et al., OSDI 2021). As in
`calibration.py`, nothing of those files is kept: `POLLUX_BATCHING` is a small table derived
from them by `derive_batching` (`scripts/fit_pollux.py` prints it again from a clone), and
this module's code is ours. What is derived, per application and trace batch:

- the gradient noise scale as training goes: Pollux's simulator reads `grad_sqr` and
  `grad_var` of the epoch from `validation-<batch>.csv` and counts a step of batch B as
  `(var + sqr) / (var / scale + sqr)` steps of its initial batch B0 (the smallest validated;
  scale = B / B0). That is Pollux's eq. 6 with the noise scale `B0 x var / sqr` samples.
  `noise` keeps it at 0%, 10%, ..., 90% of the epochs (the epoch at that fraction of
  `max_epochs`, from the trace batch's file); between them it is interpolated geometrically;
- the cost of a sample: the slope of one GPU's step time over its local batch
  (`placements.csv`, placement "1", up to the application's `max_local_bsz`), least squares;
- the largest batch: the largest validated (Pollux's `max_batch_size`); ncf stays at its
  32768, which Pollux's simulator fixes for it under Pollux too.
- the smallest local batch measured (`placements.csv`, Pollux's `min_local_bsz`): the max
  batch over it is the most GPUs Pollux's simulator lets the job grow to (`widest`); ncf's
  is its whole batch, since that simulator keeps ncf on one GPU under Pollux.

The job's progress, in single-GPU seconds of work at the trace's batch `Bt` (`JobModel.work`),
per second on n GPUs at batch B: `t1 x B / Bt x E / t(n, B)`, with `E = (noise + Bt) /
(noise + B)` (efficiency relative to the trace's batch, so 1 at Bt) and the step time
`t(n, B) = t(n, Bt) + per_sample x (B - Bt) / n` (the trace batch's fitted Amdahl time, plus
or minus the samples each GPU computes more or less). At B = Bt it is Amdahl's speedup,
which the engine then uses as it is.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from herd_operator.simulate.calibration import POLLUX_MAX_LOCAL_BATCH, Calibration
from herd_operator.specs.values import (
    BASE_BATCH_METRIC,
    BATCH_SIZE_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    STEP_SECONDS_METRIC,
)

NOISE_POINTS = 10
"""Fractions of the epochs the noise scale is kept at: 0, 1/10, ..., 9/10."""


@dataclass(frozen=True)
class BatchCalibration:
    """One application at one trace batch (the table's key): what adapting its batch
    changes."""

    max_batch: int
    min_local_batch: int
    """The smallest local batch its throughput was measured at (Pollux's `min_local_bsz`)."""
    per_sample_seconds: float
    """Seconds one GPU's step takes per sample more (placement "1"'s slope)."""
    noise: tuple[float, ...]
    """Gradient noise scale in samples at 0, 1/10, ..., 9/10 of the epochs."""


@dataclass(frozen=True)
class BatchModel:
    """What a simulated job needs to train at another batch than its trace's."""

    trace_batch: int
    max_batch: int
    iteration_seconds: float
    """One iteration on one GPU at the trace batch (Amdahl's t1)."""
    serial_fraction: float
    per_sample_seconds: float
    noise: tuple[float, ...]
    min_local_batch: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.trace_batch <= self.max_batch:
            raise ValueError("need 1 <= trace batch <= max batch")
        if not 1 <= self.min_local_batch <= self.max_batch:
            raise ValueError("need 1 <= min local batch <= max batch")
        if self.iteration_seconds <= 0 or self.per_sample_seconds < 0:
            raise ValueError("iteration seconds must be > 0 and per-sample seconds >= 0")
        if not self.noise or any(not (math.isfinite(n) and n > 0) for n in self.noise):
            raise ValueError("noise scales must be finite and > 0, at least one")

    def widest(self) -> int:
        """The most GPUs its batch can be spread over: its max batch at its smallest local
        batch (Pollux's simulator bounds a job's replicas by it)."""
        return self.max_batch // self.min_local_batch

    def clamp(self, batch: int | None) -> int:
        """The batch the job trains at when asked for `batch` (None: the trace's)."""
        if batch is None:
            return self.trace_batch
        return max(1, min(self.max_batch, batch))

    def noise_at(self, fraction: float) -> float:
        """The noise scale at `fraction` (0..1) of the epochs, geometric between points."""
        points = self.noise
        position = min(max(fraction, 0.0), 1.0) * len(points)
        low = min(int(position), len(points) - 1)
        if low + 1 >= len(points):
            return points[-1]
        share = position - low
        return math.exp((1 - share) * math.log(points[low]) + share * math.log(points[low + 1]))

    def step_seconds(self, gpus: int, batch: int) -> float:
        """One step of global batch `batch` on `gpus` GPUs."""
        t1, serial = self.iteration_seconds, self.serial_fraction
        at_trace = t1 * (serial + (1.0 - serial) / gpus)
        return max(at_trace + self.per_sample_seconds * (batch - self.trace_batch) / gpus, 1e-9)

    def efficiency(self, batch: int, fraction: float) -> float:
        """Progress per sample at `batch` relative to the trace batch (Pollux's eq. 6)."""
        noise = self.noise_at(fraction)
        return (noise + self.trace_batch) / (noise + batch)

    def rate(self, gpus: int, batch: int, fraction: float) -> float:
        """Work per second (single-GPU seconds at the trace batch) on `gpus` at `batch`."""
        if gpus <= 0:
            return 0.0
        samples = batch / self.trace_batch * self.efficiency(batch, fraction)
        return self.iteration_seconds * samples / self.step_seconds(gpus, batch)

    def metrics(self, gpus: int, batch: int | None, fraction: float) -> dict[str, float]:
        """What its workers attach to an epoch end at `gpus` and `batch` (None: the trace's),
        `fraction` of its epochs done: the adaptive metrics (`specs/values.ADAPTIVE_METRICS`)."""
        chosen = self.clamp(batch)
        return {
            GRADIENT_NOISE_SCALE_METRIC: self.noise_at(fraction),
            BATCH_SIZE_METRIC: float(chosen),
            STEP_SECONDS_METRIC: self.step_seconds(gpus, chosen),
            BASE_BATCH_METRIC: float(self.trace_batch),
        }


def batch_model(calibration: Calibration, batching: BatchCalibration) -> BatchModel:
    return BatchModel(
        trace_batch=calibration.batch_size,
        max_batch=max(batching.max_batch, calibration.batch_size),
        iteration_seconds=calibration.iteration_seconds,
        serial_fraction=calibration.serial_fraction,
        per_sample_seconds=batching.per_sample_seconds,
        noise=batching.noise,
        min_local_batch=batching.min_local_batch,
    )


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def derive_batching(
    application: str,
    batch_size: int,
    epochs: int,
    validated: list[int],
    read: Callable[[str], str],
) -> BatchCalibration:
    """The table row of one application at one trace batch; `validated`: the batches of its
    `validation-*.csv` files, `read(name)` the text of one of its trace files."""
    cap = POLLUX_MAX_LOCAL_BATCH.get(application, 1 << 30)
    placements = _rows(read("placements.csv"))
    ones = [
        (float(r["local_bsz"]), float(r["step_time"]))
        for r in placements
        if r["placement"] == "1" and float(r["local_bsz"]) <= cap
    ]
    mean_x = sum(x for x, _ in ones) / len(ones)
    mean_y = sum(y for _, y in ones) / len(ones)
    spread = sum((x - mean_x) ** 2 for x, _ in ones)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in ones) / spread if spread else 0.0
    initial = min(validated)
    rows = _rows(read(f"validation-{batch_size}.csv"))
    noise = []
    for point in range(NOISE_POINTS):
        row = rows[min(epochs * point // NOISE_POINTS, len(rows) - 1)]
        sqr, var = float(row["grad_sqr"]), float(row["grad_var"])
        noise.append(initial * var / sqr)
    largest = batch_size if application == "ncf" else max(validated)
    smallest_local = (
        batch_size
        if application == "ncf"
        else min(math.ceil(float(r["local_bsz"])) for r in placements)
    )
    return BatchCalibration(largest, smallest_local, max(slope, 0.0), tuple(noise))


POLLUX_BATCHING: Mapping[tuple[str, int], BatchCalibration] = {
    ("bert", 384): BatchCalibration(
        384,
        4,
        0.05783,
        (
            1.122e04,
            1.122e04,
            1.122e04,
            1.122e04,
            1.122e04,
            1.279e04,
            1.279e04,
            1.279e04,
            1.279e04,
            1.279e04,
        ),
    ),
    ("cifar10", 2048): BatchCalibration(
        4096,
        32,
        0.0006643,
        (65.42, 2860, 5242, 7838, 1.203e04, 1.79e04, 3.524e04, 6.055e04, 1.295e05, 6e04),
    ),
    ("cifar10", 4096): BatchCalibration(
        4096,
        32,
        0.0006643,
        (105.8, 2993, 5821, 7932, 1.159e04, 1.909e04, 3.118e04, 9.625e04, 1.385e05, 1.71e05),
    ),
    ("deepspeech2", 320): BatchCalibration(
        640,
        10,
        0.02905,
        (12.28, 834, 2906, 4968, 1.529e04, 1.734e05, 8.607e04, 2.597e05, 4.624e04, 4.483e04),
    ),
    ("deepspeech2", 640): BatchCalibration(
        640,
        10,
        0.02905,
        (12.75, 824.1, 1872, 4107, 5675, 2.869e04, 8.728e04, 1.218e07, 7.095e04, 6.67e04),
    ),
    ("imagenet", 3200): BatchCalibration(
        12800,
        20,
        0.004208,
        (678.2, 8436, 9781, 1.027e04, 4.147e04, 3.426e04, 3.261e04, 1.624e05, 1.397e05, 1.281e05),
    ),
    ("imagenet", 6400): BatchCalibration(
        12800,
        20,
        0.004208,
        (
            637.9,
            9160,
            1.069e04,
            1.129e04,
            4.531e04,
            3.626e04,
            3.531e04,
            2.012e05,
            1.662e05,
            1.61e05,
        ),
    ),
    ("ncf", 32768): BatchCalibration(
        32768,
        32768,
        4.337e-07,
        (
            2.072e05,
            1.867e06,
            1.697e06,
            1.684e06,
            4.193e06,
            8.124e06,
            7.095e06,
            5.701e07,
            6.502e07,
            6.369e07,
        ),
    ),
    ("yolov3", 64): BatchCalibration(
        512,
        4,
        0.0148,
        (0.3988, 323.6, 343.4, 368.7, 437.2, 440.5, 878.1, 792.5, 1506, 3046),
    ),
}
"""Each key of `POLLUX_CALIBRATIONS`, as `scripts/fit_pollux.py` prints it from
`osdi21-artifact`."""
