"""Pollux's six applications, calibrated from the throughput Pollux measured for them.

Source: petuum/adaptdl, branch `osdi21-artifact`, `simulator/traces/<application>/`
(Apache-2.0; Qiao et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized
Deep Learning", OSDI 2021). Nothing of those files is kept here: `POLLUX_CALIBRATIONS` is a
small table derived from them by `derive` (run `scripts/fit_pollux.py` on a clone to make it
again), and this module's code is ours.

How, for each application and each global batch size its jobs use in Pollux's workloads
(`simulator/workloads*/`, the `batch_size` column):

- the time of one iteration on n GPUs at that global batch (batch-preserving, as our
  accuracy modes: each GPU takes batch / n samples): from `placements.csv` for 1-4 GPUs on
  one node and 8, 12, 16 on 2-4 full nodes ("44", "444", "4444"), from `scalability.csv` for
  24, 32, 48 and 64 GPUs on 6, 8, 12 and 16 nodes of 4; the step time interpolated linearly
  in the local batch between the measured ones, as Pollux's simulator does; a local batch
  above the largest measured is run in several steps (gradient accumulation, each extra step
  costing the step time less the synchronisation, Pollux's rule); sizes whose local batch
  would be below the smallest measured are left out (the batch cannot be split that far);
- Amdahl's law fitted to those times, `t(n) = t1 * (serial + (1 - serial) / n)`, by least
  squares of the relative error (so that 64 GPUs weigh as much as one), on the sizes up to
  the fastest: past it more GPUs only slow a job (its communication grows, which Amdahl's
  law does not model), and no job of Pollux's workloads asks for more than that size;
- the work: the iterations Pollux's simulator runs the application for at that batch (its
  `max_epochs` epochs, from `validation-<batch>.csv`) times `t1`, in single-GPU seconds.

Statistical efficiency is not modelled here: at the trace's batch the global batch does not
change with the size; `batching.py` models other batches (`simulate POLICY+adaptive`).
Memory is not in the traces; `POLLUX_MEMORY` keeps our earlier guesses.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

POLLUX_EPOCHS: Mapping[str, int] = {
    "bert": 2,
    "cifar10": 100,
    "deepspeech2": 80,
    "imagenet": 90,
    "ncf": 10,
    "yolov3": 50,
}
"""The epochs Pollux's simulator runs each application for (its `max_epochs`)."""
POLLUX_MAX_LOCAL_BATCH: Mapping[str, int] = {"yolov3": 8}
"""Local batches Pollux's simulator caps below the largest measured (its `max_local_bsz`)."""
POLLUX_MEMORY: Mapping[str, float] = {
    "bert": 0.60,
    "cifar10": 0.20,
    "deepspeech2": 0.50,
    "imagenet": 0.80,
    "ncf": 0.10,
    "yolov3": 0.70,
}
"""Per-GPU memory share at the trace's replica count: our guesses (no trace measures it)."""
SIZES: tuple[tuple[int, str | tuple[int, int]], ...] = (
    (1, "1"),
    (2, "2"),
    (3, "3"),
    (4, "4"),
    (8, "44"),
    (12, "444"),
    (16, "4444"),
    (24, (6, 24)),
    (32, (8, 32)),
    (48, (12, 48)),
    (64, (16, 64)),
)
"""GPUs, and where their step times are: a `placements.csv` placement (GPUs per node), or
the `(num_nodes, num_replicas)` of a `scalability.csv` row; 4 GPUs a node throughout."""
FIT_TOLERANCE = 0.25
"""The most the fitted time of one iteration may be off the measured one, relative."""


@dataclass(frozen=True)
class Calibration:
    """One application at one global batch size, as fitted."""

    application: str
    batch_size: int
    serial_fraction: float
    iteration_seconds: float
    """One iteration on one GPU (Amdahl's t1; fitted, also where one GPU was not measured)."""
    iterations: int
    """Iterations of the whole run (Pollux's epochs at this batch)."""
    epochs: int
    measured: tuple[tuple[int, float], ...]
    """(GPUs, seconds per iteration) derived from the traces, up to the fastest size: what
    the fit was made on."""

    @property
    def work(self) -> float:
        """The whole run in single-GPU seconds."""
        return self.iterations * self.iteration_seconds

    def seconds_per_iteration(self, gpus: int) -> float:
        serial = self.serial_fraction
        return self.iteration_seconds * (serial + (1.0 - serial) / gpus)

    def worst_error(self) -> float:
        """The largest relative error of the fit on the measured points."""
        return max(
            abs(self.seconds_per_iteration(gpus) / seconds - 1.0) for gpus, seconds in self.measured
        )


def fit_amdahl(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """(serial share, single-GPU time) of `t(n) = a / n + b` fitted to (n, t) points by least
    squares of the relative error; b is kept >= 0 (refit as `a / n` alone if it came out
    below); with a <= 0 (no speedup) the share is 1. Raises ValueError with fewer than two
    sizes."""
    if len({n for n, _ in points}) < 2:
        raise ValueError(f"need times at two sizes at least, got {list(points)}")
    # Weighted least squares with weights 1 / t^2: minimise sum ((a x + b) / t - 1)^2.
    sw = swx = swxx = swy = swxy = 0.0
    for n, t in points:
        w, x = 1.0 / (t * t), 1.0 / n
        sw += w
        swx += w * x
        swxx += w * x * x
        swy += w * t
        swxy += w * x * t
    det = sw * swxx - swx * swx
    a = (sw * swxy - swx * swy) / det
    b = (swy - a * swx) / sw
    if b < 0:
        a, b = swxy / swxx, 0.0
    if a <= 0:  # no faster with more GPUs: all of it serial, at the mean relative time
        return 1.0, swy / sw
    return b / (a + b), a + b


def _rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(text)))


def _interpolate(curve: Sequence[tuple[float, float, float]], local: float) -> tuple[float, float]:
    """(step, sync) time at `local` samples per GPU from (local, step, sync) points."""
    if len(curve) == 1 and curve[0][0] == local:
        return curve[0][1], curve[0][2]
    for (x0, s0, y0), (x1, s1, y1) in itertools.pairwise(curve):
        if x0 <= local <= x1:
            share = (local - x0) / (x1 - x0) if x1 > x0 else 0.0
            return s0 + share * (s1 - s0), y0 + share * (y1 - y0)
    raise ValueError(f"local batch {local} outside {curve[0][0]}..{curve[-1][0]}")


def iteration_time(curve: Sequence[tuple[float, float, float]], local: float, cap: int) -> float:
    """One iteration at `local` samples per GPU on a placement whose measured steps are
    `curve` (local batch, step time, sync time), local batches above `cap` in several steps."""
    steps = max(1, math.ceil(local / min(cap, curve[-1][0]) - 1e-9))
    step, sync = _interpolate(curve, local / steps)
    return step + (steps - 1) * (step - sync)


def derive(
    application: str, batch_size: int, read: Callable[[str], str], epochs: int | None = None
) -> Calibration:
    """Fit one application at one global batch; `read(name)` returns the text of one of its
    trace files (`placements.csv`, `scalability.csv`, `validation-<batch>.csv`); `epochs`
    defaults to Pollux's for the application (`POLLUX_EPOCHS`)."""
    placements = _rows(read("placements.csv"))
    scalability = _rows(read("scalability.csv"))
    cap = POLLUX_MAX_LOCAL_BATCH.get(application, 1 << 30)
    measured: list[tuple[int, float]] = []
    for gpus, where in SIZES:
        if isinstance(where, str):
            rows = [r for r in placements if r["placement"] == where]
        else:
            nodes, replicas = where
            rows = [
                r
                for r in scalability
                if (int(r["num_nodes"]), int(r["num_replicas"])) == (nodes, replicas)
            ]
        curve = sorted(
            (float(r["local_bsz"]), float(r["step_time"]), float(r["sync_time"])) for r in rows
        )
        local = batch_size / gpus
        if not curve or local < curve[0][0]:
            continue
        measured.append((gpus, iteration_time(curve, local, cap)))
    # Past the fastest size a job only slows (communication grows with the GPUs, which
    # Amdahl's law does not model); Pollux's workloads ask at most that size of each.
    fastest = min(range(len(measured)), key=lambda index: measured[index][1])
    measured = measured[: fastest + 1]
    serial, single = fit_amdahl(measured)
    epochs = POLLUX_EPOCHS[application] if epochs is None else epochs
    validation = _rows(read(f"validation-{batch_size}.csv"))
    iterations = int(float(validation[epochs - 1]["iteration"]))
    return Calibration(
        application,
        batch_size,
        serial,
        single,
        iterations,
        epochs,
        tuple((gpus, seconds) for gpus, seconds in measured),
    )


POLLUX_CALIBRATIONS: Mapping[tuple[str, int], Calibration] = {
    ("bert", 384): Calibration(
        "bert",
        384,
        0.0490,
        26.625,
        480,
        2,
        (
            (1, 29.064),
            (2, 13.885),
            (3, 9.4418),
            (4, 7.0069),
            (8, 5.1673),
            (12, 3.2551),
            (16, 2.781),
            (24, 2.4469),
            (32, 2.0448),
            (48, 1.8843),
        ),
    ),
    ("cifar10", 2048): Calibration(
        "cifar10",
        2048,
        0.0484,
        1.4701,
        3178,
        100,
        (
            (1, 1.4036),
            (2, 0.83797),
            (3, 0.54582),
            (4, 0.39446),
            (8, 0.25993),
            (12, 0.18937),
            (16, 0.1544),
        ),
    ),
    ("cifar10", 4096): Calibration(
        "cifar10",
        4096,
        0.0240,
        2.9362,
        2011,
        100,
        (
            (1, 2.8067),
            (2, 1.6748),
            (3, 1.0328),
            (4, 0.78988),
            (8, 0.44936),
            (12, 0.28463),
            (16, 0.22349),
            (24, 0.22349),
        ),
    ),
    ("deepspeech2", 320): Calibration(
        "deepspeech2",
        320,
        0.0916,
        8.6742,
        2264,
        80,
        (
            (1, 10.158),
            (2, 5.1958),
            (3, 3.1842),
            (4, 2.6229),
            (8, 1.5463),
            (12, 1.3859),
            (16, 1.2707),
            (24, 1.2424),
            (32, 1.1392),
        ),
    ),
    ("deepspeech2", 640): Calibration(
        "deepspeech2",
        640,
        0.0415,
        17.587,
        1423,
        80,
        (
            (1, 20.314),
            (2, 10.323),
            (3, 6.577),
            (4, 5.1877),
            (8, 2.7286),
            (12, 1.7864),
            (16, 1.4776),
            (24, 1.3228),
            (32, 1.3899),
            (48, 1.1989),
            (64, 1.194),
        ),
    ),
    ("imagenet", 3200): Calibration(
        "imagenet",
        3200,
        0.0213,
        14.037,
        42123,
        90,
        (
            (1, 14.758),
            (2, 7.4519),
            (3, 5.2804),
            (4, 3.9975),
            (8, 2.0234),
            (12, 1.3587),
            (16, 1.0463),
            (24, 0.74266),
            (32, 0.6945),
            (48, 0.63392),
            (64, 0.6256),
        ),
    ),
    ("imagenet", 6400): Calibration(
        "imagenet",
        6400,
        0.0050,
        30.543,
        23972,
        90,
        (
            (1, 29.516),
            (2, 14.888),
            (3, 10.614),
            (4, 7.9875),
            (8, 4.0404),
            (12, 2.6389),
            (16, 2.0844),
            (24, 1.4253),
            (32, 1.0933),
            (48, 0.78571),
        ),
    ),
    ("ncf", 32768): Calibration(
        "ncf",
        32768,
        0.9196,
        0.022733,
        1548,
        10,
        ((1, 0.021316), (2, 0.026584), (3, 0.027408), (4, 0.017749)),
    ),
    ("yolov3", 64): Calibration(
        "yolov3",
        64,
        0.1574,
        2.5181,
        14577,
        50,
        ((1, 2.5918), (2, 1.3298), (3, 1.3027), (4, 0.88289)),
    ),
}
"""Each application of Pollux's workloads at each global batch its jobs use there, as
`scripts/fit_pollux.py` prints it from `osdi21-artifact` (the fit's worst relative error per
row: docs/simulation.md)."""
DEFAULT_BATCH: Mapping[str, int] = {
    "bert": 384,
    "cifar10": 2048,
    "deepspeech2": 320,
    "imagenet": 6400,
    "ncf": 32768,
    "yolov3": 64,
}
"""The batch of a trace row without a `batch_size`: the application's most frequent one in
Pollux's workloads."""
