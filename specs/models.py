"""The HerdJob API (herd/v1alpha1): what a user declares in a job's YAML file."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

API_VERSION = "herd/v1alpha1"
KIND = "HerdJob"

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

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
MAX_JSON_INT = 2**63
"""Integers in policy params: what JSON readers everywhere take exactly."""


class ApiModel(BaseModel):
    """Base of every API model: camelCase in YAML, snake_case in Python, immutable."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True
    )


class GpuRange(ApiModel):
    """How many GPUs the job can run on; the operator keeps it within [min, max]."""

    # Strict so that YAML like `min: "2"` or `min: true` is an error, not a silent coercion.
    min: int = Field(strict=True, ge=1, le=MAX_GPUS)
    max: int = Field(strict=True, ge=1, le=MAX_GPUS)

    @model_validator(mode="after")
    def _min_not_above_max(self) -> GpuRange:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class PolicyRef(ApiModel):
    """Which policy decides the job's GPU count, and its parameters."""

    name: str = Field(
        default="static", min_length=1, json_schema_extra={"pattern": POLICY_NAME_PATTERN}
    )
    # Factories, not shared default objects: pydantic deep-copies an unhashable default on
    # every validation (a third of validating 10,000 specs).
    params: dict[str, Any] = Field(default_factory=dict)

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
        problem = _json_problem(params)
        if problem is not None:
            raise ValueError(problem)
        return params


class HorovodOptions(ApiModel):
    """Options passed through to `horovodrun` for elastic training."""

    elastic_timeout_seconds: int = Field(default=600, strict=True, gt=0, le=MAX_TIMEOUT_SECONDS)
    reset_limit: int | None = Field(default=None, strict=True, ge=0, le=MAX_COUNT)
    extra_args: list[str] = Field(default_factory=list)


class EngineRef(ApiModel):
    """Which engine runs the job (launches it, makes its placement reach it), and its options.

    The kinds are the runtime's engine registry, checked where specs are loaded; `specs`
    knows only the built-in `horovod`, whose options are `HorovodOptions` (the same as the
    top-level `horovod` field; an empty `options` gives none). Other kinds' options are
    plain JSON data that their engine reads.
    """

    kind: str = Field(
        default=HOROVOD_ENGINE, min_length=1, json_schema_extra={"pattern": ENGINE_KIND_PATTERN}
    )
    options: dict[str, Any] = Field(default_factory=dict)

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
        problem = _json_problem(options)
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
    backoff_limit: int = Field(default=3, strict=True, ge=0, le=MAX_COUNT)


BatchPolicyName = Literal["naive", "linear-lr", "preserve-batch"]
MAX_BATCH = 1 << 24


class TrainingOptions(ApiModel):
    """How the job's workers keep training quality when the world resizes.

    The operator passes these to the workers (HERD_BATCH_POLICY, HERD_WARMUP_STEPS,
    HERD_MAX_WORKER_BATCH); a script that uses `herd_operator.worker.batch_settings`
    follows them, any other script ignores them.
    """

    batch_policy: BatchPolicyName = Field(
        default="naive",
        description=(
            "naive: each worker keeps its batch, so the global batch and the effective "
            "learning rate change with the world size (Elastic Horovod's behaviour). "
            "linear-lr: as naive, with the learning rate scaled with the global batch and "
            "ramped over warmupSteps after each resize. preserve-batch: the global batch and "
            "the learning rate stay fixed; each resize recomputes the per-worker batch and "
            "the gradient-accumulation steps."
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
    max_worker_batch: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_BATCH,
        description=(
            "preserve-batch: the most samples one worker computes at once; a larger share of "
            "the global batch is split into gradient-accumulation micro-batches (for workers "
            "whose memory holds less than the whole share). Unset: the script's own choice."
        ),
    )


def _check_env_name(name: str) -> str:
    if not re.fullmatch(ENV_NAME_PATTERN, name):
        raise ValueError(
            f"invalid environment variable name {name!r}: must match {ENV_NAME_PATTERN[1:-1]}"
        )
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
    working_dir: LaunchStr | None = None
    env: dict[EnvName, LaunchStr] = Field(
        default_factory=dict,
        json_schema_extra={"propertyNames": {"pattern": ENV_NAME_PATTERN}},
    )
    gpus: GpuRange
    priority: int = Field(default=0, strict=True, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    policy: PolicyRef = Field(default_factory=PolicyRef)
    engine: EngineRef = Field(default_factory=EngineRef)
    horovod: HorovodOptions = Field(default_factory=HorovodOptions)
    """The horovod engine's options: the spelling from before `engine`, still read. After
    validation it holds the options in effect for a horovod job, whichever field gave them."""
    restart_policy: RestartPolicy = Field(default_factory=RestartPolicy)
    training: TrainingOptions | None = Field(
        default=None,
        description=(
            "How the workers keep training quality across resizes (batch policy); unset: "
            "the workers are told nothing and the script decides."
        ),
    )

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


class ObjectMeta(ApiModel):
    """Identity of a job: its name is the key everywhere (queue, allocator, store)."""

    name: str = Field(
        json_schema_extra={"pattern": DNS_LABEL_PATTERN, "maxLength": DNS_LABEL_MAX_LENGTH}
    )
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name_is_dns_label(cls, name: str) -> str:
        if not is_job_name(name):
            raise ValueError(DNS_LABEL_MESSAGE)
        return name


class HerdJob(ApiModel):
    """One job as declared in a YAML file."""

    api_version: Literal["herd/v1alpha1"]
    kind: Literal["HerdJob"]
    metadata: ObjectMeta
    spec: HerdJobSpec

    @property
    def name(self) -> str:
        return self.metadata.name


def spec_fingerprint(job: HerdJob) -> str:
    """sha256 of the spec's canonical JSON; labels and formatting do not change it."""
    # A horovod job's engine options are said again by `horovod`: leaving `engine` out keeps
    # the fingerprint (and generation) of specs written before it, and makes both spellings
    # the same spec.
    horovod = job.spec.engine.kind == HOROVOD_ENGINE
    # Likewise an unset `training` leaves the fingerprint of specs from before it as it was.
    excluded = ({"engine"} if horovod else set()) | (
        {"training"} if job.spec.training is None else set()
    )
    spec = job.spec.model_dump(mode="json", by_alias=True, exclude=excluded or None)
    canonical = json.dumps(
        spec,
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def json_schema() -> dict[str, Any]:
    """JSON Schema of a HerdJob file, for editors (yaml-language-server) and docs."""
    schema = HerdJob.model_json_schema(by_alias=True)
    # The horovod engine's options are described where they are given; an absent `kind`
    # means horovod too (`properties` only constrains what is there).
    schema["$defs"]["EngineRef"].update(
        {
            "if": {"properties": {"kind": {"const": HOROVOD_ENGINE}}},
            "then": {"properties": {"options": {"$ref": "#/$defs/HorovodOptions"}}},
        }
    )
    return {
        "$schema": JSON_SCHEMA_DIALECT,
        **schema,
        "title": f"{KIND} ({API_VERSION})",
    }


def _dump_horovod(options: HorovodOptions) -> dict[str, Any]:
    return options.model_dump(mode="json", by_alias=True)


def _json_problem(params: dict[str, Any]) -> str | None:
    """Say why `params` is not plain JSON data (str keys, no dates, sets or cycles), or None."""
    # Iterative, so deeply nested YAML cannot exhaust the interpreter's stack.
    on_path: set[int] = set()
    pending: list[tuple[str, object, bool]] = [(key, child, False) for key, child in params.items()]
    while pending:
        path, item, leaving = pending.pop()
        if leaving:
            on_path.discard(id(item))
            continue
        if isinstance(item, dict | list):
            if id(item) in on_path:
                return f"{path}: refers to itself (a YAML alias cycle)"
            on_path.add(id(item))
            pending.append((path, item, True))
        if isinstance(item, dict):
            for key, child in item.items():
                if not isinstance(key, str):
                    return f"{path}: mapping keys must be strings, got {key!r}"
                pending.append((f"{path}.{key}", child, False))
        elif isinstance(item, list):
            pending.extend((f"{path}[{index}]", child, False) for index, child in enumerate(item))
        elif isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_JSON_INT:
            return f"{path}: integers must be within +-2^63, got one of {item.bit_length()} bits"
        elif item is not None and not isinstance(item, str | int | float | bool):
            return (
                f"{path}: must be a string, number, boolean, null, list or mapping, "
                f"got {type(item).__name__} {item}"
            )
    return None
