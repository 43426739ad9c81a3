"""A third-party HERD policy: give a job one more GPU when its loss stops improving.

Install this folder into the operator's environment (`pip install examples/plugins`): its
pyproject.toml registers the class under the `herd_operator.policies` entry point group as
`loss-plateau`, the name a job spec uses (see docs/policies.md).

The workers report a `loss` metric with each epoch end (`Report.metrics`). When the best
loss of the last `patience` epochs is not lower than the best before them by more than
`minDelta`, the job has plateaued at its size: ask for `step` more GPUs.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from herd_operator.policies.base import Decision, JobObservations, Signal, clamp
from herd_operator.specs import HerdJob


class LossPlateauParams(BaseModel):
    """`spec.policy.params` of the policy; a bad value names its field in the job's status."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )

    metric: str = Field(default="loss", min_length=1)
    patience: int = Field(default=3, ge=1, strict=True)
    min_delta: float = Field(default=0.01, ge=0, strict=True, allow_inf_nan=False)
    step: int = Field(default=1, ge=1, strict=True)


class LossPlateauPolicy:
    """Starts at min and grows by `step` each time the loss plateaus at the current size."""

    observes = frozenset({Signal.EPOCHS})
    """It decides on the metrics the workers report with each epoch end."""

    Params = LossPlateauParams

    def __init__(self, params: LossPlateauParams) -> None:
        self.params = params

    def desired(self, job: HerdJob, observed: JobObservations, now: float) -> Decision:
        params = self.params
        allocated = observed.allocated
        if allocated == 0:
            return Decision(job.spec.gpus.min, f"loss plateau: starting at {job.spec.gpus.min}")
        current = clamp(job, allocated)
        # Only epochs run at the current size say whether this size has plateaued; that also
        # keeps one plateau from growing the job again on every reconcile.
        since = observed.last_resize if observed.last_resize is not None else observed.started_at
        losses = [
            end.metrics[params.metric]
            for end in observed.epochs
            if end.time >= since and params.metric in end.metrics
        ]
        if len(losses) <= params.patience:
            return Decision(
                current,
                f"loss plateau: {len(losses)} of {params.patience + 1} epochs "
                f"with {params.metric!r} at {allocated} GPUs (holding)",
            )
        best_before = min(losses[: -params.patience])
        best_recent = min(losses[-params.patience :])
        improvement = best_before - best_recent
        if improvement > params.min_delta:
            return Decision(
                current,
                f"loss plateau: {params.metric} improved by {improvement:.4g} "
                f"over {params.patience} epochs (holding {current})",
            )
        gpus = clamp(job, allocated + params.step)
        change = f"{allocated} -> {gpus}" if gpus != allocated else f"at max {gpus}"
        return Decision(
            gpus,
            f"loss plateau: {params.metric} improved by only {improvement:.4g} "
            f"over {params.patience} epochs: {change}",
        )
