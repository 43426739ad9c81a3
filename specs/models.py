"""The HerdJob API (herd/v1alpha1): what a user declares in a job's YAML file."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from herd_operator.specs.api_model import SCHEMA_CONFIG as SCHEMA_CONFIG
from herd_operator.specs.api_model import ApiModel
from herd_operator.specs.json_data import json_problem
from herd_operator.specs.labels import (
    LABEL_KEY_MAX_LENGTH,
    LABEL_KEY_PATTERN,
    LABEL_NAME_MAX_LENGTH,
    LABEL_VALUE_PATTERN,
    label_problem,
)
from herd_operator.specs.quantity import Quantity, parse_quantity
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS, MODULE_NAME_PATTERN

API_VERSION = "herd/v1alpha1"
KIND = "HerdJob"


DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_LABEL_MAX_LENGTH = 63
DNS_LABEL_MESSAGE = (
    "must be a DNS-1123 label (lowercase letters, digits and '-', starting and ending "
    "with a letter or digit, at most 63 characters)"
)
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A policy name ("memory"). A module reference ("my_pkg.policies:Greedy") is well formed
# here only so that the policy registry, which knows the installed plug-ins, refuses it
# saying what is allowed: no policy is imported by such a name.
POLICY_NAME_PATTERN = (
    r"^([A-Za-z][A-Za-z0-9_-]*"
    r"|[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*)$"
)
MAX_REFERENCE_CHARS = 253
"""The longest policy name or plug-in reference (`pkg.module:Class`): an unknown one is
named in the error, which events, conditions and log lines carry, so it is bounded."""
# An engine kind names an entry of the runtime's engine registry ("horovod").
ENGINE_KIND_PATTERN = r"^[a-z][a-z0-9-]*$"
HOROVOD_ENGINE = "horovod"

# Upper bounds on every integer a spec holds: far above any real value, low enough that no
# arithmetic, JSON encoding or Prometheus sample on them can overflow or fail.
MAX_GPUS = 65_536
"""GPUs of one job: 16,384 nodes of 4 GPUs."""
MAX_PRIORITY = 1_000_000
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
MAX_COUNT = 1_000_000
"""Restarts and resets."""
MAX_EPOCHS = 2**31 - 1
"""The most epochs a spec may expect: the largest epoch a worker may report."""
MAX_DEADLINE_SECONDS = 366 * 24 * 3600
"""The longest time limit: a year (Slurm sites allow weeks at most)."""
MAX_DEPENDENCIES = 64


class GpuRange(ApiModel):
    """How many GPUs the job can run on; the operator keeps it within [min, max]."""

    # Strict so that YAML like `min: "2"` or `min: true` is an error, not a silent coercion.
    min: int = Field(strict=True, ge=1, le=MAX_GPUS)
    """Fewest GPUs the job can train on. The job starts only when this many are free
    together, and is never shrunk below it."""
    max: int = Field(strict=True, ge=1, le=MAX_GPUS)
    """Most GPUs the job may be given."""
    share: bool = Field(default=False, strict=True)
    """Share GPUs by memory with other sharing jobs' workers (under `run --share-gpus`)."""
    memory: Quantity | None = None
    """GPU memory one worker needs (`8Gi`, `512Mi`; at `min` GPUs with `memorySplit`): what a
    sharing job is packed by until its measured peak (+ the operator's margin) is larger;
    unset: a whole GPU until measured."""
    memory_split: Quantity | None = None
    """Of `memory`, what the workers split in total (a global batch's activations): at `n`
    GPUs a worker counts `memory - memorySplit/min + memorySplit/n`; at most `memory` x `min`."""

    @property
    def memory_bytes(self) -> int | None:
        """`memory` in bytes (None: unset): the allocator's packing and the worker's limit."""
        return None if self.memory is None else parse_quantity(self.memory)

    @property
    def memory_split_bytes(self) -> int | None:
        """`memorySplit` in bytes (None: unset)."""
        return None if self.memory_split is None else parse_quantity(self.memory_split)

    @field_validator("memory_split")
    @classmethod
    def _split_within_the_memory(cls, split: str | None, info: ValidationInfo) -> str | None:
        memory, low = info.data.get("memory", ""), info.data.get("min")
        if split is None or memory == "" or low is None:
            return split  # unset, or memory or min is wrong itself: its own error says so
        if memory is None:
            raise ValueError("needs spec.gpus.memory (what one worker needs at min GPUs)")
        if parse_quantity(split) > parse_quantity(memory) * low:
            raise ValueError(f"{split} is more than spec.gpus.memory ({memory}) times min ({low})")
        return split

    @model_validator(mode="after")
    def _min_not_above_max(self) -> GpuRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class PolicyRef(ApiModel):
    """Which policy decides the job's GPU count, and its parameters."""

    name: str = Field(
        default="static",
        min_length=1,
        max_length=MAX_REFERENCE_CHARS,
        json_schema_extra={"pattern": POLICY_NAME_PATTERN},
    )
    """The policy: a built-in's name (`herd-operator schema` lists each) or an installed
    plug-in policy's."""
    # Factories, not shared default objects: pydantic deep-copies an unhashable default on
    # every validation (a third of validating 10,000 specs).
    params: dict[str, Any] = Field(default_factory=dict)
    """The policy's parameters; which ones depends on `name` (see docs/policies.md)."""

    @field_validator("name")
    @classmethod
    def _name_is_policy_reference(cls, name: str) -> str:
        if name and not re.fullmatch(POLICY_NAME_PATTERN, name):
            raise ValueError(
                f"{name!r} is not a policy name: a built-in's or an installed plug-in's"
                " name, letters, digits, '-' and '_' (like 'memory')"
            )
        return name

    @field_validator("params")
    @classmethod
    def _params_are_json(cls, params: dict[str, Any]) -> dict[str, Any]:
        # The fingerprint hashes params as JSON; YAML dates, sets or non-string keys would
        # make it fail or depend on the process's hash seed.
        problem = json_problem(params)
        if problem is not None:
            raise ValueError(problem)
        return params


MAX_PRELOAD_MODULES = 64
HorovodLauncher = Literal["driver", "horovodrun"]
DEFAULT_HOROVOD_LAUNCHER: HorovodLauncher = "driver"
DEFAULT_GLOO_TIMEOUT_SECONDS = 30
"""Horovod's own default, made explicit: a crashed worker stalls the others for up to this
long (measured: 30.1 s for rank 0 of 4 after rank 2's SIGKILL), so it stays short."""
DEFAULT_GROW_TIMEOUT_SECONDS = 120
"""A worker that a grow starts on a loaded node can take more than 30 s to import torch and
reach `hvd.init()`; the running workers wait for it at the barrier, where Gloo's timeout
does not run."""


class HorovodOptions(ApiModel):
    """Options passed through to `horovodrun` for elastic training."""

    elastic_timeout_seconds: int = Field(default=600, strict=True, gt=0, le=MAX_TIMEOUT_SECONDS)
    """How long Horovod waits for enough workers after a resize before it gives up
    (`horovodrun --elastic-timeout`)."""
    gloo_timeout_seconds: int = Field(
        default=DEFAULT_GLOO_TIMEOUT_SECONDS, strict=True, gt=0, le=MAX_TIMEOUT_SECONDS
    )
    """How long a worker waits for another (`horovodrun --gloo-timeout-seconds`, given to the
    workers as `HOROVOD_GLOO_TIMEOUT_SECONDS`; the default is Horovod's own): at a rendezvous,
    and in a collective whose peer hangs, crashed or is on a node that is gone, which is how
    long such a loss stalls the job. Under `horovodrun` it is also all the time a worker that
    a grow starts has to reach `hvd.init()`; under the `driver`, `growTimeoutSeconds` is.
    Under the `driver`, a first meeting where a worker failed waits this long for the
    workers that are not there, then the launch fails (`restartPolicy` applies)."""
    grow_timeout_seconds: int = Field(
        default=DEFAULT_GROW_TIMEOUT_SECONDS, strict=True, gt=0, le=MAX_TIMEOUT_SECONDS
    )
    """Under the `driver` launcher, how long the running workers wait for the new workers of
    a grow to start and reach the rendezvous (`hvd.init()`). A grow not joined by then is
    given up: the new workers are stopped, the job goes on at its old size with its
    progress, and the grow is tried again later."""
    reset_limit: int | None = Field(default=None, strict=True, ge=0, le=MAX_COUNT)
    """How many times Horovod may reset the job (each resize is one) before it fails
    (`horovodrun --reset-limit`); none: no limit."""
    extra_args: list[str] = Field(default_factory=list)
    """More arguments for `horovodrun`, placed before the command."""
    launcher: HorovodLauncher = DEFAULT_HOROVOD_LAUNCHER
    """What runs Horovod's elastic driver: `driver`, the operator's in-process driver
    (`python -m herd_operator.runtime.engines.hvd_driver`: reads the grant file directly,
    sees a grant change within ~50 ms, starts workers without a middleman process), or
    `horovodrun`, the bare `horovodrun --host-discovery-script` (a script run every second).
    Both take the same horovodrun arguments."""
    preload: list[str] = Field(default_factory=list, max_length=MAX_PRELOAD_MODULES)
    """Modules (like `torch`, `horovod.torch`, `torch._dynamo`) that a per-job zygote imports
    once, under the `driver` launcher: the job's local workers are then forked from it,
    ready, instead of starting an interpreter and importing them (seconds per scale-up).
    List `torch._dynamo` with torch: torch 2.x's optimizers import it on their first call,
    which otherwise every forked worker does (half of its start). Only for a command
    `python SCRIPT ...` run by the operator's Python; other commands start as usual. Empty
    (the default): no zygote."""

    @field_validator("preload")
    @classmethod
    def _preload_are_module_names(cls, preload: list[str]) -> list[str]:
        for name in preload:
            if not re.fullmatch(MODULE_NAME_PATTERN, name):
                raise ValueError(
                    f"{name!r} is not a module name: dotted Python identifiers, like 'torch' "
                    "or 'horovod.torch'"
                )
        return preload


class EngineRef(ApiModel):
    """Which engine runs the job (launches it, tells it of its GPUs), and its options."""

    # The kinds are the runtime's engine registry, checked where specs are loaded; `specs`
    # knows only the built-in `horovod`, whose options are `HorovodOptions` (the same as the
    # top-level `horovod` field; an empty `options` gives none). Other kinds' options are
    # plain JSON data that their engine reads.

    kind: str = Field(
        default=HOROVOD_ENGINE,
        min_length=1,
        max_length=DNS_LABEL_MAX_LENGTH,
        json_schema_extra={"pattern": ENGINE_KIND_PATTERN},
    )
    """The engine: one of the runtime's engines (`herd-operator schema` lists them)."""
    options: dict[str, Any] = Field(default_factory=dict)
    """The engine's options; for `horovod`, the same fields as `spec.horovod`."""

    @field_validator("kind")
    @classmethod
    def _kind_is_a_name(cls, kind: str) -> str:
        if kind and not re.fullmatch(ENGINE_KIND_PATTERN, kind):
            raise ValueError(
                f"{kind!r} is not an engine kind (lowercase letters, digits and '-', "
                "like 'horovod')"
            )
        return kind

    @field_validator("options")
    @classmethod
    def _options_fit_the_kind(cls, options: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        problem = json_problem(options)
        if problem is not None:
            raise ValueError(problem)
        if options and info.data.get("kind") == HOROVOD_ENGINE:
            # Raised as is, pydantic keeps each error's place: spec.engine.options.<field>.
            # Kept in their full form, so that a dumped spec reads back the same.
            return _dump_horovod(HorovodOptions.model_validate(options))
        return options


class RestartPolicy(ApiModel):
    """Whether a failed job is started again, and how many times."""

    on_failure: bool = Field(default=False, strict=True)
    """Start the job again when it exits with an error."""
    backoff_limit: int = Field(default=3, strict=True, ge=0, le=MAX_COUNT)
    """How many times it is started again before it is marked Failed."""


BatchPolicyName = Literal["naive", "linear-lr", "preserve-batch", "adaptive"]
MAX_BATCH = 1 << 24


def _batch_limit(description: str) -> Any:
    """An optional limit of `training` in samples per step (1 to MAX_BATCH)."""
    return Field(default=None, strict=True, ge=1, le=MAX_BATCH, description=description)


class TrainingOptions(ApiModel):
    """How the job's workers keep training quality when the world resizes.

    The operator passes these to the workers (HERD_BATCH_POLICY, HERD_WARMUP_STEPS,
    HERD_MAX_WORKER_BATCH, HERD_MAX_BATCH); a script that uses
    `herd_operator.worker.batch_settings` follows them, any other script ignores them.
    """

    batch_policy: BatchPolicyName = Field(
        default="naive",
        description=(
            "naive: each worker keeps its batch, so the global batch and the effective "
            "learning rate change with the world size (Elastic Horovod's behaviour). "
            "linear-lr: as naive, with the learning rate scaled with the global batch and "
            "ramped over warmupSteps after each resize. preserve-batch: the global batch and "
            "the learning rate stay fixed; each resize recomputes the per-worker batch and "
            "the gradient-accumulation steps. adaptive: goodput's batch, AdaScale's rate."
        ),
    )
    warmup_steps: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=MAX_COUNT,
        description=(
            "linear-lr: optimizer steps over which the learning rate moves to its new value "
            "after a resize (0: at once). Unset: the script's own choice."
        ),
    )
    max_worker_batch: int | None = _batch_limit(
        "preserve-batch, adaptive: the most samples one worker computes at once; a larger "
        "share is split into gradient-accumulation micro-batches (for workers whose memory "
        "holds less than the whole share). Unset: the script's own choice."
    )
    max_batch: int | None = _batch_limit(
        "adaptive: the largest global batch the job may train at. Unset: maxWorkerBatch per "
        "GPU bounds it, or, without either, the base batch per GPU."
    )
    measure_steps: int | None = Field(
        default=None,
        strict=True,
        ge=0,
        le=MAX_COUNT,
        description=(
            "adaptive: the workers report what they measured (step time, noise scale, "
            "batch) this many full steps into each new configuration (a start, a resize, a "
            "new batch), so that the policy sizes the job without waiting for the epoch's "
            f"end; 0: at epoch ends only. Unset: {DEFAULT_MEASURE_STEPS}."
        ),
    )
    epochs: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_EPOCHS,
        description=(
            "How many epochs the job is expected to run (epochs 0 to epochs-1, as the script "
            "reports them with report_epoch): what `get`, `describe` and /metrics show its "
            "progress and ETA against. The operator does not end the job there: the script "
            "does, as it does without this field. Given alone, it tells the workers nothing "
            "(their batch policy stays the script's own choice). Unset: no progress is shown."
        ),
    )

    resumable: bool = Field(
        default=False,
        strict=True,
        description=(
            "true: the script saves a checkpoint and goes on from it when started again, so "
            "a queue that preempts (`run --queue srpt` or `las`) may stop the job for one "
            "that should go first. false (default): the job is never preempted; such a queue "
            "only orders it. The operator cannot check it: a job that says true and keeps no "
            "checkpoint starts again from zero at each preemption."
        ),
    )

    def tells_workers(self) -> bool:
        """Whether the workers are given the batch fields (HERD_BATCH_POLICY ...): unless
        only `epochs` and `resumable` are said, which are the operator's to read, not theirs."""
        said_for_the_operator = self.epochs is not None or self.resumable
        return (
            not said_for_the_operator
            or self.model_copy(update=OPERATOR_ONLY_TRAINING) != TrainingOptions()
        )


OPERATOR_ONLY_TRAINING: dict[str, Any] = {"epochs": None, "resumable": False}
"""The fields of `training` only the operator reads, at their defaults: changing them
relaunches nothing and tells the workers nothing."""


def _check_env_name(name: str) -> str:
    if not re.fullmatch(ENV_NAME_PATTERN, name):
        raise ValueError(
            f"invalid environment variable name {name!r}: must match {ENV_NAME_PATTERN[1:-1]}"
        )
    return name


def _check_job_name(name: str) -> str:
    if not is_job_name(name):
        raise ValueError(f"{name!r} is not a job name: it {DNS_LABEL_MESSAGE}")
    return name


def _check_no_nul(text: str) -> str:
    # The OS cannot pass a NUL byte in an argument, a variable or a path: such a spec could
    # never launch, so it is refused here rather than retried forever.
    if "\x00" in text:
        raise ValueError("must not contain a NUL byte (\\0)")
    return text


EnvName = Annotated[str, AfterValidator(_check_env_name)]
LaunchStr = Annotated[str, AfterValidator(_check_no_nul)]
NonEmptyStr = Annotated[str, Field(min_length=1), AfterValidator(_check_no_nul)]


class HerdJobSpec(ApiModel):
    """Desired state of one elastic training job."""

    command: list[NonEmptyStr] = Field(min_length=1)
    """The training command each worker runs, one list item per argument (no shell),
    e.g. `[python, train.py, --epochs, "10"]`."""
    working_dir: LaunchStr | None = None
    """Directory the command runs in (default: the directory the operator was started in)."""
    env: dict[EnvName, LaunchStr] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": {"pattern": ENV_NAME_PATTERN}},
    )
    """Environment variables for the workers. Passed through a private file, not on
    command lines, so other users of the nodes cannot read them."""
    gpus: GpuRange
    """How many GPUs the job may run on."""
    priority: int = Field(default=0, strict=True, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Jobs of higher priority get spare GPUs first and may take them from jobs of lower
    priority (never below their min)."""
    policy: PolicyRef = Field(default_factory=PolicyRef)
    """What decides the job's GPU count within [min, max] while it runs."""
    engine: EngineRef = Field(default_factory=EngineRef)
    """What launches the job and tells it of its GPUs."""
    # The spelling from before `engine`, still read. After validation it holds the options
    # in effect for a horovod job, whichever field gave them.
    horovod: HorovodOptions = Field(default_factory=HorovodOptions)
    """Options of the horovod engine (the same as `engine.options` when `engine.kind` is
    `horovod`; give them in one place)."""
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    """Whether a job that fails is started again."""
    training: TrainingOptions | None = Field(
        default=None,
        description=(
            "How the workers keep training quality across resizes (batch policy); unset: "
            "the workers are told nothing and the script decides."
        ),
    )
    suspend: bool = Field(default=False, strict=True)
    """Stop the job's workers and release its GPUs while keeping the job, as a Kubernetes
    Job's `spec.suspend`; false again resumes it: it is admitted and launched anew, and a
    script that keeps a checkpoint goes on from it (`herd-operator suspend NAME` and
    `resume NAME` set it)."""

    active_deadline_seconds: int | None = Field(
        default=None, strict=True, ge=1, le=MAX_DEADLINE_SECONDS
    )
    """A time limit, in seconds (Kubernetes Job's `activeDeadlineSeconds`, Slurm's `--time`):
    counted from the job's first start (time queued before it does not count; relaunches,
    BackOff and waits for GPUs after it do). When it is reached the job is stopped and
    marked Failed with reason `DeadlineExceeded`. Unset: no limit."""
    depends_on: list[Annotated[str, AfterValidator(_check_job_name)]] = Field(
        default_factory=list,
        max_length=MAX_DEPENDENCIES,
        json_schema_extra={
            "uniqueItems": True,
            "items": {
                "type": "string",
                "pattern": DNS_LABEL_PATTERN,
                "maxLength": DNS_LABEL_MAX_LENGTH,
            },
        },
    )
    """Jobs that must have Succeeded before this one is admitted (Slurm's
    `--dependency=afterok`). If one of them fails (or is deleted), this job is marked Failed
    with reason `DependencyFailed` instead of waiting forever."""

    @field_validator("depends_on")
    @classmethod
    def _dependencies_unique(cls, names: list[str]) -> list[str]:
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(map(repr, repeated))} more than once")
        return names

    @model_validator(mode="after")
    def _one_set_of_horovod_options(self) -> HerdJobSpec:
        given = self.model_fields_set
        if self.engine.kind != HOROVOD_ENGINE:
            # Compared with the defaults, not by presence: a dumped spec lists every field.
            if self.horovod != HorovodOptions():
                raise ValueError(
                    f"horovod: options of the horovod engine only, but engine.kind is "
                    f"{self.engine.kind!r} (its options go under engine.options)"
                )
            return self
        if not self.engine.options:  # none given there: an empty mapping says nothing
            return self
        options = HorovodOptions.model_validate(self.engine.options)
        if "horovod" in given and options != self.horovod:
            raise ValueError(
                "horovod and engine.options both give the horovod engine's options, "
                f"and they differ: {_dump_horovod(self.horovod)} vs {self.engine.options}; "
                "keep one of them"
            )
        # Frozen model: set in place during validation, before anyone sees it.
        object.__setattr__(self, "horovod", options)
        return self


def is_job_name(name: str) -> bool:
    """A DNS-1123 label: what `metadata.name` must be."""
    return len(name) <= DNS_LABEL_MAX_LENGTH and re.fullmatch(DNS_LABEL_PATTERN, name) is not None


READ_ONLY_METADATA = frozenset({"uid", "generation", "creationTimestamp"})
"""`metadata` fields the operator sets and shows; a spec file may hold them (they are
ignored), so that `get NAME -o yaml` saved to a file is a spec again."""


class ObjectMeta(ApiModel):
    """Identity of a job: its name is the key everywhere (queue, allocator, store)."""

    name: str = Field(
        json_schema_extra={"pattern": DNS_LABEL_PATTERN, "maxLength": DNS_LABEL_MAX_LENGTH}
    )
    """The job's name, unique among the spec files: lowercase letters, digits and '-'
    (a DNS-1123 label, at most 63 characters)."""
    labels: dict[str, str] = Field(
        default_factory=dict,
        json_schema_extra={
            "propertyNames": {"pattern": LABEL_KEY_PATTERN, "maxLength": LABEL_KEY_MAX_LENGTH},
            "additionalProperties": {
                "type": "string",
                "pattern": LABEL_VALUE_PATTERN,
                "maxLength": LABEL_NAME_MAX_LENGTH,
            },
        },
    )
    """Key/value pairs to select and group jobs by (`get -l team=vision`), in Kubernetes'
    label syntax: a key is a name of at most 63 letters, digits, '-', '_' and '.' (starting
    and ending with a letter or digit), optionally after a DNS prefix and '/'
    (`example.com/team`); a value is empty or such a name."""

    @model_validator(mode="before")
    @classmethod
    def _drop_read_only_fields(cls, data: Any) -> Any:
        """The identity the operator gives a job (`get -o yaml` shows it) is not the user's
        to declare: a spec saved from `get` loads with it ignored."""
        if isinstance(data, dict) and READ_ONLY_METADATA & data.keys():
            return {key: value for key, value in data.items() if key not in READ_ONLY_METADATA}
        return data

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, name: str) -> str:
        if not is_job_name(name):
            raise ValueError(DNS_LABEL_MESSAGE)
        return name

    @field_validator("labels")
    @classmethod
    def _labels_are_selectable(cls, labels: dict[str, str]) -> dict[str, str]:
        # A label no selector can name (`Team Name`) would be kept and never reachable.
        for key, value in labels.items():
            problem = label_problem(key, value)
            if problem is not None:
                raise ValueError(problem)
        return labels


class HerdJob(ApiModel):
    """One job as declared in a YAML file."""

    api_version: Literal["herd/v1alpha1"]
    """The version of this API: `herd/v1alpha1`."""
    kind: Literal["HerdJob"]
    """Always `HerdJob`."""
    metadata: ObjectMeta
    """The job's name and labels."""
    spec: HerdJobSpec
    """What to run and on how many GPUs."""

    @model_validator(mode="before")
    @classmethod
    def _drop_status(cls, data: Any) -> Any:
        """`status` is observed, never declared: a spec saved from `get -o yaml` loads with
        it ignored, as the Kubernetes API server ignores it in an applied object."""
        if isinstance(data, dict) and "status" in data:
            return {key: value for key, value in data.items() if key != "status"}
        return data

    @property
    def name(self) -> str:
        return self.metadata.name


def _dump_horovod(options: HorovodOptions) -> dict[str, Any]:
    return options.model_dump(mode="json", by_alias=True)
