"""Pollux's step-time model for the `goodput` policy, fitted from the workers' reports.

The line `fixed + per_sample x batch / gpus` (`goodput.StepTime`) knows neither the nodes a
job spans nor how its synchronisation overlaps its compute. This is the form the Pollux paper
gives its throughput model (OSDI'21, section 4.1), with our own fit:

- compute, one GPU's forward and backward passes over its local batch `b`:
  `c(b) = compute_fixed + compute_per_sample x b`;
- synchronisation over `n` GPUs, none on one: `fixed + per_gpu x (n - 2)`, with its own two
  rates within a node and across nodes (the slowest link bounds a ring all-reduce, each GPU
  more adds a round);
- the two overlap (the all-reduce of one layer runs during the backward pass of the next):
  a step takes `(c^g + s^g)^(1/g)`, `g` from 1 (the sum) to 10 (about the larger one).

What it is fitted from: the reports that carry, beside the adaptive metrics, the seconds of a
step's compute apart from the whole step and the nodes the workers spanned
(`specs.values.PLACEMENT_METRICS`). The compute line comes from the compute seconds; the
synchronisation from the step and the compute at each placement seen: for an overlap `g`, a
step `t` with compute `c` says the sync took `(t^g - c^g)^(1/g)`, and each kind of link gets
a least-squares line in `n - 2` through those. Each `g` of a grid is tried and the one of
least error on the steps kept (with Pollux's small penalty on `g` above 1). What was not
seen gets Pollux's agent's priors, which are optimistic so that the job tries it and the next
fit knows: one local batch measured, half its compute is fixed; one GPU count of a kind of
link, no per-GPU rate of its own (the other link's, else none); a job that never ran across
nodes syncs across them as within one, and the reverse; one that ran on one GPU only has no
sync at all. Across nodes is never taken to be faster than within one.

A size's node count, for the predictions: a job of `g` GPUs spans `ceil(g / gpus_per_node)`
nodes, the fewest it can (the allocator packs a job's GPUs where it can; a worse placement
is only measured, not predicted). Pure functions of the reports.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from herd_operator.specs.values import (
    BATCH_SIZE_METRIC,
    COMPUTE_SECONDS_METRIC,
    NODES_METRIC,
    STEP_SECONDS_METRIC,
    Report,
)

OVERLAPS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 10.0)
"""The overlaps `g` the fit tries (Pollux bounds its own to 1-10)."""
OVERLAP_PENALTY = 1e-3
"""Added to the root mean squared log error per `(g - 1)^2`, as Pollux's agent does: of two
overlaps that explain the steps about as well, the smaller (less optimistic) one."""
RECENT = 3
"""Reports per placement and batch whose median makes its point (as the line fit)."""


def overlapped(compute: float, sync: float, overlap: float) -> float:
    """`(compute^g + sync^g)^(1/g)`, computed without overflow."""
    if sync <= 0:
        return compute
    if compute <= 0:
        return sync
    top = max(compute, sync)
    return top * float(((compute / top) ** overlap + (sync / top) ** overlap) ** (1.0 / overlap))


def packed_nodes(gpus: int, gpus_per_node: int | None) -> int:
    """The fewest nodes `gpus` GPUs span (one when the GPUs per node are not known)."""
    if gpus_per_node is None or gpus_per_node < 1:
        return 1
    return max(1, -(-gpus // gpus_per_node))


@dataclass(frozen=True)
class SyncStepTime:
    """Seconds of one optimizer step: compute and synchronisation overlapped, by nodes."""

    compute_fixed: float
    compute_per_sample: float
    node_fixed: float
    """Synchronisation of 2 GPUs on one node."""
    node_per_gpu: float
    network_fixed: float
    """Synchronisation of 2 GPUs across nodes."""
    network_per_gpu: float
    overlap: float
    gpus_per_node: int | None = None
    """What `seconds` packs a size on (None: every size on one node)."""

    def __post_init__(self) -> None:
        rates = (
            self.compute_fixed,
            self.compute_per_sample,
            self.node_fixed,
            self.node_per_gpu,
            self.network_fixed,
            self.network_per_gpu,
        )
        if not all(math.isfinite(rate) and rate >= 0 for rate in rates):
            raise ValueError(f"step-time rates must be finite and >= 0, got {rates}")
        if not 1 <= self.overlap <= max(OVERLAPS):
            raise ValueError(f"overlap must be in [1, {max(OVERLAPS):g}], got {self.overlap}")

    def compute(self, local: float) -> float:
        return self.compute_fixed + self.compute_per_sample * local

    def repeated_seconds(self, gpus: int, batch: int, once_share: float) -> float:
        """A micro-batch past a step's first: its compute alone (the synchronisation runs
        once, with the last); `once_share` is for a model without compute, not this one."""
        del once_share
        return self.compute(batch / gpus)

    def sync(self, nodes: int, gpus: int) -> float:
        if gpus <= 1:
            return 0.0
        if nodes > 1:
            return self.network_fixed + self.network_per_gpu * (gpus - 2)
        return self.node_fixed + self.node_per_gpu * (gpus - 2)

    def step(self, nodes: int, gpus: int, batch: float) -> float:
        """One step of global batch `batch` on `gpus` GPUs over `nodes` nodes."""
        if gpus < 1:
            raise ValueError(f"gpus must be at least 1, got {gpus}")
        return overlapped(self.compute(batch / gpus), self.sync(nodes, gpus), self.overlap)

    def seconds(self, gpus: int, batch: int) -> float:
        """One step at `gpus` GPUs packed on the fewest nodes."""
        return self.step(packed_nodes(gpus, self.gpus_per_node), gpus, batch)


@dataclass(frozen=True)
class StepPoint:
    """What the reports say of one placement and batch (medians of the latest few)."""

    nodes: int
    gpus: int
    local: float
    step: float
    compute: float


def step_points(epochs: Sequence[Report], gpus_per_node: int | None = None) -> list[StepPoint]:
    """The points of the reports that carry the step, its compute and the batch; a report
    without the node count is taken to have been packed (`packed_nodes`)."""
    seen: dict[tuple[int, int, float], tuple[list[float], list[float]]] = {}
    for report in epochs:
        metrics, gpus = report.metrics, report.world_size
        step = metrics.get(STEP_SECONDS_METRIC, 0.0)
        compute = metrics.get(COMPUTE_SECONDS_METRIC, 0.0)
        batch = metrics.get(BATCH_SIZE_METRIC, 0.0)
        if gpus < 1 or not (step > 0 and compute > 0 and batch > 0):
            continue
        nodes = int(metrics.get(NODES_METRIC, 0)) or packed_nodes(gpus, gpus_per_node)
        steps, computes = seen.setdefault((nodes, gpus, batch), ([], []))
        steps.append(step)
        computes.append(compute)
    return [
        StepPoint(
            nodes,
            gpus,
            batch / gpus,
            statistics.median(steps[-RECENT:]),
            statistics.median(computes[-RECENT:]),
        )
        for (nodes, gpus, batch), (steps, computes) in seen.items()
    ]


def reported_gpus_per_node(epochs: Sequence[Report]) -> int | None:
    """The GPUs per node the reports show at least (a job on `g` GPUs over `k` nodes had
    `ceil(g / k)` on one); None when no report says its nodes."""
    seen = [
        -(-report.world_size // int(report.metrics[NODES_METRIC]))
        for report in epochs
        if report.world_size > 0 and report.metrics.get(NODES_METRIC, 0) >= 1
    ]
    return max(seen) if seen else None


def compute_line(points: Sequence[StepPoint], fixed_share: float) -> tuple[float, float]:
    """(fixed, per sample) of the compute: least squares of the relative error over two
    local batches or more (the fixed part kept >= 0); at one local batch, `fixed_share` of
    its compute is fixed (Pollux's agent takes half)."""
    xs = {point.local for point in points}
    if len(xs) >= 2:
        sw = swx = swxx = swy = swxy = 0.0
        for point in points:
            x, y = point.local, point.compute
            w = 1.0 / (y * y)
            sw, swx, swxx = sw + w, swx + w * x, swxx + w * x * x
            swy, swxy = swy + w * y, swxy + w * x * y
        slope = (sw * swxy - swx * swy) / (sw * swxx - swx * swx)
        fixed = (swy - slope * swx) / sw
        if slope > 0 and fixed < 0:
            fixed, slope = 0.0, swxy / swxx
        if slope > 0:
            return fixed, slope
    # One local batch, or a compute that does not grow with it: the largest batch's split.
    latest = max(points, key=lambda point: point.local)
    return fixed_share * latest.compute, (1.0 - fixed_share) * latest.compute / latest.local


def _sync_of(point: StepPoint, overlap: float) -> float:
    """The sync that, overlapped with the point's compute, makes its step."""
    if point.step <= point.compute:
        return 0.0
    ratio = point.compute / point.step
    return point.step * float((1.0 - ratio**overlap) ** (1.0 / overlap))


def _line(pairs: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Least squares `fixed + slope x` over (x, y) of two x or more, both kept >= 0."""
    mean_x = sum(x for x, _ in pairs) / len(pairs)
    mean_y = sum(y for _, y in pairs) / len(pairs)
    spread = sum((x - mean_x) ** 2 for x, _ in pairs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in pairs) / spread
    if slope <= 0:
        return mean_y, 0.0
    fixed = mean_y - slope * mean_x
    if fixed < 0:
        return 0.0, sum(x * y for x, y in pairs) / sum(x * x for x, _ in pairs)
    return fixed, slope


def _link_terms(
    pairs: Sequence[tuple[int, float]], other_slope: float | None
) -> tuple[float, float] | None:
    """(fixed, per GPU) of one kind of link from its (gpus - 2, sync) pairs: a line over two
    GPU counts or more; at one, the other link's per-GPU rate (else none) and the rest
    fixed; None without any pair."""
    if not pairs:
        return None
    if len({x for x, _ in pairs}) >= 2:
        return _line(pairs)
    slope = other_slope or 0.0
    fixed = sum(y - slope * x for x, y in pairs) / len(pairs)
    return max(fixed, 0.0), slope


def sync_terms(points: Sequence[StepPoint], overlap: float) -> tuple[float, float, float, float]:
    """(node fixed, node per GPU, network fixed, network per GPU) at `overlap`, with the
    priors for the links not seen (the module's docstring)."""
    node = [(p.gpus - 2, _sync_of(p, overlap)) for p in points if p.gpus > 1 and p.nodes == 1]
    network = [(p.gpus - 2, _sync_of(p, overlap)) for p in points if p.gpus > 1 and p.nodes > 1]
    spread = {
        "node": len({x for x, _ in node}) >= 2,
        "network": len({x for x, _ in network}) >= 2,
    }
    node_line = _link_terms(node, None) if spread["node"] else None
    network_line = _link_terms(network, None) if spread["network"] else None
    if node_line is None:
        node_line = _link_terms(node, network_line[1] if network_line else None)
    if network_line is None:
        network_line = _link_terms(network, node_line[1] if node_line else None)
    node_line = node_line or network_line or (0.0, 0.0)
    network_line = network_line or node_line
    # Across nodes is never faster than within one.
    return (
        node_line[0],
        node_line[1],
        max(network_line[0], node_line[0]),
        max(network_line[1], node_line[1]),
    )


def _error(model: SyncStepTime, points: Sequence[StepPoint]) -> float:
    """Root mean squared log error of the model's steps, plus the overlap's penalty."""
    total = 0.0
    for p in points:
        total += math.log(model.step(p.nodes, p.gpus, p.local * p.gpus) / p.step) ** 2
    return math.sqrt(total / len(points)) + OVERLAP_PENALTY * (model.overlap - 1.0) ** 2


def fit_sync_step_time(
    epochs: Sequence[Report], gpus_per_node: int | None, fixed_share: float
) -> SyncStepTime | None:
    """The model of least error on the reports' steps (the module's docstring); None when no
    report carries the compute seconds (then the line fit is the policy's). `gpus_per_node`:
    the pool's, else what the reports show (`reported_gpus_per_node`)."""
    per_node = gpus_per_node or reported_gpus_per_node(epochs)
    points = step_points(epochs, per_node)
    if not points:
        return None
    fixed, per_sample = compute_line(points, fixed_share)
    best: tuple[float, SyncStepTime] | None = None
    for overlap in OVERLAPS:
        model = SyncStepTime(fixed, per_sample, *sync_terms(points, overlap), overlap, per_node)
        error = _error(model, points)
        if best is None or error < best[0] - 1e-12:
            best = (error, model)
    assert best is not None
    return best[1]
