"""Statistical efficiency: how much of a step's progress a larger batch keeps.

Pollux (OSDI'21, eq. 6) models the progress per sample of a batch of `batch` samples,
relative to a base batch `base_batch`, from the gradient noise scale `noise_scale` (in
samples) as `(noise_scale + base_batch) / (noise_scale + batch)`: a batch far below the
noise scale loses nothing, one far above it wastes most of its samples. Goodput is then
throughput times this efficiency. Pure functions: no I/O.
"""

from __future__ import annotations

import math


def statistical_efficiency(noise_scale: float, batch: int, base_batch: int) -> float:
    """Progress per sample at `batch` relative to `base_batch` (1.0 at the base batch)."""
    if batch < 1 or base_batch < 1:
        raise ValueError(f"batch sizes must be at least 1, got {batch} and {base_batch}")
    if not (math.isfinite(noise_scale) and noise_scale >= 0):
        raise ValueError(f"noise scale must be finite and >= 0, got {noise_scale}")
    return (noise_scale + base_batch) / (noise_scale + batch)
