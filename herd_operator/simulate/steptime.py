"""The step time of Pollux's applications by GPUs and local batch, fitted to what Pollux
measured: what a simulated job's step costs at any batch under `+adaptive`.

Source: petuum/adaptdl, branch `osdi21-artifact`, `simulator/traces/<application>/`
`placements.csv` and `scalability.csv` (Apache-2.0; Qiao et al., OSDI 2021): the step and
synchronisation time of each application by placement (GPUs on each node) and local batch.
Nothing of them is kept: `POLLUX_STEP_MODELS` holds seven numbers per application, derived
by `fit_step_model` (`scripts/fit_pollux.py` prints them again), and this module's code is
ours. The form is the one the Pollux paper describes for its throughput model (section 4.1):

- compute, one GPU's forward and backward pass over `b` samples: `c(b) = fixed + per_sample x b`;
- synchronisation over `n` GPUs, zero on one: `a + r x (n - 2)`, with its own `a`, `r` for
  GPUs on one node and for several nodes (the slowest link bounds a ring all-reduce, and each
  GPU more adds a round);
- the two overlap (the all-reduce of one layer runs during the backward pass of the next):
  the step is `(c^g + s^g)^(1/g)`, `g` from 1 (no overlap: the sum) to 10 (about the max);
- a local batch above the largest one GPU computes at once (`max_local_batch`) is taken in
  several micro-batches, each but the last costing its compute alone (gradient accumulation,
  as Pollux's simulator charges it).

A job on n GPUs is taken to be packed on whole nodes of `GPUS_PER_NODE` (as `calibration.py`
assumes). The fit minimises the squared log error of the step over every measured row whose
local batch one GPU computes at once (Pollux's simulator runs no other): the compute line on
one GPU first, then a pattern search over the six rates for each overlap of a grid.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

GPUS_PER_NODE = 4
OVERLAPS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0)
"""The overlaps `g` the fit tries (Pollux bounds its own to 1-10)."""
_TINY = 1e-9
"""The least a rate may be: the pattern search moves in ratios, so none may reach zero."""


@dataclass(frozen=True)
class StepModel:
    """Seconds of one optimizer step of an application, by GPUs and global batch."""

    compute_fixed: float
    compute_per_sample: float
    node_fixed: float
    """Synchronisation on one node of several GPUs, at 2 GPUs."""
    node_per_gpu: float
    network_fixed: float
    """Synchronisation across nodes, at 2 GPUs."""
    network_per_gpu: float
    overlap: float
    max_local_batch: float
    """The most samples one GPU computes at once; more are accumulated."""

    def __post_init__(self) -> None:
        rates = [getattr(self, f.name) for f in fields(self)]
        if not all(math.isfinite(rate) and rate >= 0 for rate in rates):
            raise ValueError(f"step model rates must be finite and >= 0, got {rates}")
        if self.overlap < 1 or self.max_local_batch <= 0:
            raise ValueError("need overlap >= 1 and max_local_batch > 0")

    def compute(self, local: float) -> float:
        return self.compute_fixed + self.compute_per_sample * local

    def sync(self, nodes: int, gpus: int) -> float:
        if gpus <= 1:
            return 0.0
        if nodes > 1:
            return self.network_fixed + self.network_per_gpu * (gpus - 2)
        return self.node_fixed + self.node_per_gpu * (gpus - 2)

    def micro_step(self, nodes: int, gpus: int, local: float) -> float:
        """One step of `local` samples per GPU on `gpus` GPUs over `nodes` nodes."""
        compute, sync = self.compute(local), self.sync(nodes, gpus)
        if sync <= 0:
            return compute
        g = self.overlap
        return float((compute**g + sync**g) ** (1.0 / g))

    def _micro_batches(self, gpus: int, batch: float) -> tuple[int, float]:
        """(micro-batches past the first, samples of each) of a step of `batch` on `gpus`."""
        if gpus < 1 or batch <= 0:
            raise ValueError(f"need gpus >= 1 and batch > 0, got {gpus} and {batch}")
        local = batch / gpus
        extra = max(math.ceil(local / self.max_local_batch - 1e-9) - 1, 0)
        return extra, local / (extra + 1)

    def seconds(self, gpus: int, batch: float) -> float:
        """One optimizer step of global batch `batch` on `gpus` GPUs packed on nodes."""
        extra, atomic = self._micro_batches(gpus, batch)
        return self.micro_step(packed_nodes(gpus), gpus, atomic) + extra * self.compute(atomic)

    def compute_seconds(self, gpus: int, batch: float) -> float:
        """The compute of that step alone (every micro-batch's), without the sync: what a
        worker measures around its forward and backward passes."""
        extra, atomic = self._micro_batches(gpus, batch)
        return (extra + 1) * self.compute(atomic)


def packed_nodes(gpus: int) -> int:
    """The nodes `gpus` GPUs span when packed on whole nodes of `GPUS_PER_NODE`."""
    return -(-gpus // GPUS_PER_NODE)


Row = tuple[int, int, float, float]
"""A measured step: (nodes, GPUs, local batch, step seconds)."""


def _log_error(model: StepModel, rows: Sequence[Row]) -> float:
    total = 0.0
    for nodes, gpus, local, step in rows:
        total += math.log(model.micro_step(nodes, gpus, local) / step) ** 2
    return total


def _compute_line(rows: Sequence[Row]) -> tuple[float, float]:
    """(fixed, per sample) of one GPU's steps, least squares of the relative error; the
    fixed part kept >= 0."""
    ones = [(local, step) for nodes, gpus, local, step in rows if gpus == 1]
    if len({local for local, _ in ones}) < 2:
        raise ValueError("need one GPU's steps at two local batches at least")
    sw = swx = swxx = swy = swxy = 0.0
    for x, t in ones:
        w = 1.0 / (t * t)
        sw, swx, swxx = sw + w, swx + w * x, swxx + w * x * x
        swy, swxy = swy + w * t, swxy + w * x * t
    slope = (sw * swxy - swx * swy) / (sw * swxx - swx * swx)
    fixed = (swy - slope * swx) / sw
    if fixed < 0:
        fixed, slope = 0.0, swxy / swxx
    return max(fixed, _TINY), max(slope, _TINY)


_FREE = (
    "compute_fixed",
    "compute_per_sample",
    "node_fixed",
    "node_per_gpu",
    "network_fixed",
    "network_per_gpu",
)


def _pattern_search(model: StepModel, rows: Sequence[Row]) -> tuple[StepModel, float]:
    """Each rate in turn times or over (1 + step) while that lowers the error; the step
    halves when none does (a derivative-free search, deterministic)."""
    best = _log_error(model, rows)
    step = 0.5
    while step > 1e-3:
        moved = False
        for name in _FREE:
            for factor in (1.0 + step, 1.0 / (1.0 + step)):
                value = max(getattr(model, name) * factor, _TINY)
                trial = replace(model, **{name: value})
                error = _log_error(trial, rows)
                if error < best - 1e-12:
                    model, best, moved = trial, error, True
                    break
        if not moved:
            step /= 2
    return model, best


def fit_step_model(rows: Sequence[Row], max_local_batch: float) -> StepModel:
    """The model of least squared log error on `rows` (only those whose local batch is at
    most `max_local_batch` are fitted). Raises ValueError without one GPU's steps at two
    local batches."""
    used = [row for row in rows if row[2] <= max_local_batch + 1e-9 and row[3] > 0]
    fixed, per_sample = _compute_line(used)
    # Start each overlap from a sync of the median excess of a multi-GPU step over compute.
    excess = sorted(
        max(step - (fixed + per_sample * local), _TINY) for _, gpus, local, step in used if gpus > 1
    )
    sync = excess[len(excess) // 2] if excess else _TINY
    best: tuple[float, StepModel] | None = None
    for overlap in OVERLAPS:
        start = StepModel(
            fixed, per_sample, sync, sync / 10, sync, sync / 10, overlap, max_local_batch
        )
        model, error = _pattern_search(start, used)
        if best is None or error < best[0] - 1e-12:
            best = (error, model)
    assert best is not None
    return best[1]


def relative_errors(model: StepModel, rows: Sequence[Row]) -> list[float]:
    """`model`'s step over the measured one, less 1, for each row."""
    return [model.micro_step(nodes, gpus, local) / step - 1.0 for nodes, gpus, local, step in rows]


def trace_rows(read: Callable[[str], str]) -> list[Row]:
    """Every measured step of one application: `placements.csv` (a placement "112" is 2
    GPUs on one node and 1 on another: 3 nodes, 4 GPUs) and `scalability.csv`."""
    rows: list[Row] = []
    for row in csv.DictReader(io.StringIO(read("placements.csv"))):
        placement = row["placement"]
        rows.append(
            (
                len(placement),
                sum(int(digit) for digit in placement),
                float(row["local_bsz"]),
                float(row["step_time"]),
            )
        )
    for row in csv.DictReader(io.StringIO(read("scalability.csv"))):
        rows.append(
            (
                int(row["num_nodes"]),
                int(row["num_replicas"]),
                float(row["local_bsz"]),
                float(row["step_time"]),
            )
        )
    return rows


POLLUX_STEP_MODELS: Mapping[str, StepModel] = {
    "bert": StepModel(0.2833, 0.05345, 4.209e-07, 1.42e-07, 1.371, 0.009693, 2, 12),
    "cifar10": StepModel(0.01898, 0.0007654, 4.722e-06, 1.594e-06, 0.1294, 0.002684, 3, 1024),
    "deepspeech2": StepModel(0.167, 0.03116, 0.0006182, 0.0002086, 0.8864, 0.009454, 4, 80),
    "imagenet": StepModel(0.07085, 0.004527, 1.568e-05, 5.291e-06, 0.3127, 0.006721, 3, 200),
    "ncf": StepModel(0.007079, 8.369e-07, 0.002698, 0.001201, 0.01421, 0.00055, 1, 3.277e04),
    "yolov3": StepModel(0.2754, 0.01142, 0.02674, 0.07254, 0.6751, 0.01015, 1, 8),
}
"""Each application of Pollux's workloads, as `scripts/fit_pollux.py` prints it from
`osdi21-artifact` (the fit's error on the measured steps: docs/simulation.md)."""
