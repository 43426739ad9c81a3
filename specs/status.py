"""The observed state of a HerdJob, as the operator records and shows it.

Status can always be rebuilt by observation; conditions are the source of
truth (there is no `phase`). `ready` and `summary` are derived for display.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from herd_operator.specs.conditions import Condition, ConditionType, get_condition, is_true
from herd_operator.specs.values import ResizeMode

MAX_JOB_METRICS = 16
"""The most metric names a job's status (and /metrics) keeps of what its workers report:
a script that reports a new name every epoch cannot grow the series without bound."""


class StatusModel(BaseModel):
    # Frozen: a status is changed by model_copy, never in place, so the store can hand the
    # same parsed status to every reader of the same stored text.
    # Built on first use, like the spec models (specs.models.ApiModel).
    model_config = ConfigDict(
        extra="ignore",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        defer_build=True,
    )


class GpuCounts(StatusModel):
    min: int
    max: int
    desired: int | None = None
    """What the policy asks for."""
    allocated: int = 0
    """What the allocator granted."""
    active: int | None = None
    """The world size the workers last reported (None: nothing reported yet)."""


class WorkerWatch(StatusModel):
    """A running launch whose workers have not reported, as their GPU bindings show it:
    what tells a lost worker from workers that end one by one as the job succeeds."""

    seen: int = 0
    """The most workers of the launch found running at once (at most the GPUs it holds)."""
    short_since: float | None = None
    """When fewer than `seen` were first found running (None: all of them run)."""


class Progress(StatusModel):
    """How far a job with expected epochs (`spec.training.epochs`) is, and when it should end."""

    epochs: int
    """The epochs the spec expects."""
    completed: int = 0
    """Epochs done: the last epoch the workers reported, plus one (epochs count from 0)."""
    epoch_seconds: float | None = None
    """One epoch's time at the current world size, as measured (None: not measured yet at
    this size); see `controllers.progress.estimate_progress`."""
    world_size: int | None = None
    """The world size `epoch_seconds` was measured at: the workers' last report's."""
    estimated_completion: float | None = None
    """When the expected epochs should be done (Unix time; None: unknown)."""


class BatchChoice(StatusModel):
    """The global batch a policy picked for a job (`Decision.batch_size`), and for how
    many GPUs: the workers of an adaptive-batch job take it (the `batch` RPC)."""

    gpus: int
    size: int


RESIZE_MODE_WORDS = {
    ResizeMode.RESTART: "every worker restarted",
    ResizeMode.LIVE: "no worker restarted",
}
"""What a resize's event and `describe` say it did to the workers."""


class ResizeCost(StatusModel):
    """What a finished resize of a running job cost: from the grant change to the workers
    reporting the new world size (the `ResizeCompleted` event, `describe`'s "Last resize",
    `herd_resize_duration_seconds`)."""

    before: int | None = None
    """The world size the workers reported before (None: the kept reports no longer hold
    it)."""
    after: int
    """The world size they reported at the end: the grant's size."""
    seconds: float
    """From the grant change to the report of the new world size. A worker that reports
    once it trains (Horovod's reset callback, `examples/train_torchrun.py` after its first
    step) makes it the time to training at the new size; one that reports at epoch ends
    only adds the rest of that epoch."""
    engine: str
    """The engine the job ran on (`spec.engine.kind`)."""
    mode: ResizeMode | None = None
    """What the resize did to the workers, as the engine says (None: this operator has no
    such engine)."""
    completed_at: float
    """When the new world size was seen (Unix time)."""

    @property
    def direction(self) -> str:
        """`grow`, `shrink`, or `unknown` when the size before is not known."""
        if self.before is None or self.before == self.after:
            return "unknown"
        return "grow" if self.after > self.before else "shrink"

    def message(self) -> str:
        """What the event and `describe` say: `1 -> 3 workers in 30.8 s (every worker
        restarted)`."""
        sizes = f"{self.before} -> {self.after}" if self.before is not None else f"to {self.after}"
        how = f" ({RESIZE_MODE_WORDS[self.mode]})" if self.mode is not None else ""
        return f"{sizes} workers in {self.seconds:.1f} s{how}"


class HerdJobStatus(StatusModel):
    observed_generation: int = 0
    conditions: tuple[Condition, ...] = ()
    gpus: GpuCounts | None = None
    placement: list[tuple[str, list[int]]] = Field(default_factory=list)
    """Host -> GPU indices in local-rank order."""
    epoch: int | None = None
    """Last epoch the workers reported."""
    restarts: int = 0
    preemptions: int = 0
    """How often the allocator's queue stopped the job for another (not failures: they
    count against no `backoffLimit`)."""
    launch_id: str | None = None
    started_at: float | None = None
    finished_at: float | None = None
    retry_at: float | None = None
    """When a run that failed is started again (`BackOff`, under `restartPolicy`). A launch
    that could not be started keeps no retry time here: the work queue retries it (statuses
    stored before say `launchFailures` too, which is read past)."""
    last_resize_at: float | None = None
    """When the grant of the running job last changed size."""
    last_resize: ResizeCost | None = None
    """What the last resize the workers finished cost (None: none finished yet)."""
    workers: WorkerWatch | None = None
    """The running launch's workers, while none has reported (None otherwise)."""
    policy_reason: str = ""
    grant_reason: str = ""
    run_started_at: float | None = None
    """When the job's run first started: its first launch since it was declared or its spec
    last changed after it finished, kept across relaunches (BackOff, a lost node, a spec edit
    that relaunches it). `activeDeadlineSeconds` counts from it; stored, so an operator
    restart counts on from it."""
    progress: Progress | None = None
    """Progress against `spec.training.epochs` (None: the spec expects no number)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """The latest value of each metric the workers reported with an epoch end
    (`report_epoch(epoch, {"loss": ...})`), at most `MAX_JOB_METRICS` names: the first
    ones reported keep their place."""
    batch: BatchChoice | None = None
    """The global batch the job's policy picked last (None: it picks none)."""

    def summary(self) -> str:
        """One word for a table's STATUS column, derived from the conditions."""
        for condition_type, word in (
            (ConditionType.Succeeded, "Succeeded"),
            (ConditionType.Failed, "Failed"),
            (ConditionType.Stalled, "Stalled"),
            (ConditionType.Suspended, "Suspended"),
            (ConditionType.Preempted, "Preempted"),
        ):
            if is_true(self.conditions, condition_type):
                return word
        spec_valid = get_condition(self.conditions, ConditionType.SpecValid)
        if spec_valid is not None and spec_valid.status == "False":
            # It may run on its last good spec, but the file needs the user's attention first.
            return spec_valid.reason
        for condition_type, word in (
            (ConditionType.Resizing, "Resizing"),
            (ConditionType.Running, "Running"),
        ):
            if is_true(self.conditions, condition_type):
                return word
        admitted = get_condition(self.conditions, ConditionType.Admitted)
        if admitted is not None and admitted.status != "True":
            return admitted.reason
        running = get_condition(self.conditions, ConditionType.Running)
        return running.reason if running is not None else "Unknown"

    def spec_valid(self) -> bool:
        condition = get_condition(self.conditions, ConditionType.SpecValid)
        return condition is None or condition.status == "True"
