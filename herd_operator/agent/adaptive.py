"""What the `adaptive` batch policy measures and how it scales the rate: pure arithmetic.

The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", the "simple" estimate Pollux's agent uses) from two squared gradient norms each
step: the workers' own gradients, each the mean over its `local` samples, and the summed
one, the mean over the step's `global` samples. With G the true gradient and S the trace of
the per-sample gradient covariance, E|g_b|^2 = |G|^2 + S / b for a mean over b samples, so
the two norms give unbiased estimates of both:

    |G|^2 = (global * |g_global|^2 - local * |g_local|^2) / (global - local)
    S     = (|g_local|^2 - |g_global|^2) / (1 / local - 1 / global)

and the noise scale is S / |G|^2, in samples. One step's estimates are very noisy, so each
is smoothed with an exponential moving average (with the usual bias correction, so the
first steps are not pulled towards zero); the ratio is taken of the averages, not averaged.

AdaScale (Johnson et al. 2020) then scales the rate of a batch `batch` tuned at `base` by
the gain ratio r = (S / base + |G|^2) / (S / batch + |G|^2): r is 1 at the base batch and
at most batch / base, reached only where the gradient is all noise. Each step at gain r
makes r base steps of progress (`progress` in `BatchState`), which is what a schedule over
a fixed training budget should count. r / (batch / base) is Pollux's statistical
efficiency; the operator's `goodput` policy has its own copy of that formula (the worker
imports no decision code).

No torch, no Horovod: the worker API (`training.py`) feeds it floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.999
"""The moving average's factor per `base`-sample step (a step of k base batches decays it
k times as much): about a thousand base steps of memory, as adaptdl."""
_TINY = 1e-30
MAX_NOISE_SCALE = 1e9
"""The largest noise scale reported, in samples: far above any batch, so a policy reads it
as "a larger batch loses nothing", and finite, so it can be sent and stored."""


@dataclass(frozen=True)
class NoiseEstimate:
    """Bias-corrected moving averages of |G|^2 and S (0 weight: nothing measured yet)."""

    sqr_biased: float = 0.0
    var_biased: float = 0.0
    weight: float = 0.0
    """1 - (product of the decay factors so far): what the biased averages are divided by."""

    @property
    def measured(self) -> bool:
        return self.weight > 0.0

    @property
    def gradient_sqr(self) -> float:
        """|G|^2, floored at 0 (the unbiased estimate of a small norm can be negative)."""
        return max(self.sqr_biased / self.weight, 0.0) if self.measured else 0.0

    @property
    def variance(self) -> float:
        """S, the trace of the per-sample gradient covariance, floored at 0."""
        return max(self.var_biased / self.weight, 0.0) if self.measured else 0.0

    def noise_scale(self) -> float | None:
        """S / |G|^2 in samples, at most `MAX_NOISE_SCALE` (late in training the estimate of
        a small |G|^2 can read 0 or less: all noise); None before a measurement."""
        sqr, var = self.gradient_sqr, self.variance
        if not self.measured or (sqr <= 0.0 and var <= 0.0):
            return None
        if sqr * MAX_NOISE_SCALE <= var:
            return MAX_NOISE_SCALE
        return var / sqr


def step_moments(
    local_sqr: float, global_sqr: float, local: int, global_: int
) -> tuple[float, float] | None:
    """One step's unbiased (|G|^2, S) from the mean squared norm of the workers' mean
    gradients over `local` samples each and the squared norm of the mean over `global_`
    samples; None when the two batches are the same (one worker: nothing to compare)."""
    if local < 1 or global_ < 1:
        raise ValueError(f"batch sizes must be at least 1, got {local} and {global_}")
    if global_ <= local:
        return None
    sqr = (global_ * global_sqr - local * local_sqr) / (global_ - local)
    var = (local_sqr - global_sqr) / (1.0 / local - 1.0 / global_)
    return sqr, var


def update_noise(
    estimate: NoiseEstimate,
    local_sqr: float,
    global_sqr: float,
    local: int,
    global_: int,
    base: int,
    smoothing: float = SMOOTHING,
) -> NoiseEstimate:
    """`estimate` after one step's norms (unchanged when the step tells nothing or a norm is
    not finite: a diverging step must not poison the average)."""
    if base < 1:
        raise ValueError(f"base batch must be at least 1, got {base}")
    if not (math.isfinite(local_sqr) and math.isfinite(global_sqr)):
        return estimate
    moments = step_moments(local_sqr, global_sqr, local, global_)
    if moments is None:
        return estimate
    sqr, var = moments
    decay = smoothing ** (global_ / base)
    return NoiseEstimate(
        sqr_biased=decay * estimate.sqr_biased + (1.0 - decay) * sqr,
        var_biased=decay * estimate.var_biased + (1.0 - decay) * var,
        weight=decay * estimate.weight + (1.0 - decay),
    )


def gain_ratio(estimate: NoiseEstimate, batch: int, base: int) -> float:
    """AdaScale's r for `batch` against `base`: 1 before a measurement (no scaling up on a
    guess), else in [1, batch / base] for batch >= base (and [batch / base, 1] below it)."""
    if batch < 1 or base < 1:
        raise ValueError(f"batch sizes must be at least 1, got {batch} and {base}")
    if not estimate.measured:
        return 1.0
    var, sqr = estimate.variance, estimate.gradient_sqr
    if var + sqr <= _TINY:
        return 1.0
    return (var / base + sqr) / (var / batch + sqr)


def batch_for_world(
    world_size: int,
    base: int,
    decided: tuple[int, int] | None,
    max_batch: int | None = None,
    max_worker_batch: int | None = None,
) -> int:
    """The global batch at `world_size` workers, from the operator's last choice `decided`
    (gpus, batch): that batch at those GPUs; at another world size (a resize the operator
    has not decided on yet) the same batch per GPU. Without a choice, the base batch.

    Bounded as the operator's choice is (`policies.goodput.batch_bounds`): at most
    `max_batch` (past `max_worker_batch` per worker by gradient accumulation), without it at
    most `max_worker_batch` per worker, without either the base batch per worker; never below
    the base batch (which runs with accumulation if it must), and at least one sample per
    worker."""
    if world_size < 1 or base < 1:
        raise ValueError(f"world size and base batch must be >= 1, got {world_size}, {base}")
    if decided is None:
        wanted = base
    else:
        gpus, batch = decided
        wanted = batch if gpus == world_size else round(batch * world_size / max(gpus, 1))
    lower = max(base, world_size)
    if max_batch is not None:
        upper = max_batch
    elif max_worker_batch is not None:
        upper = max_worker_batch * world_size
    else:
        upper = base * world_size
    return max(lower, min(max(lower, upper), wanted))
