"""Kubernetes-style status conditions: the observed state of a job, one fact per type."""

from __future__ import annotations

import re
from collections.abc import Sequence
from enum import StrEnum

from pydantic import Field, field_validator

from herd_operator.specs.api_model import ApiModel

REASON_PATTERN = r"^[A-Z][A-Za-z0-9]*$"


class ConditionType(StrEnum):
    """The condition types the operator sets; their order is the display order."""

    SpecValid = "SpecValid"
    DependenciesMet = "DependenciesMet"
    """Whether every job of `spec.dependsOn` has Succeeded (set only for a job that names
    some): False `Waiting` while one has not, False `DependencyFailed` when one never can."""
    Admitted = "Admitted"
    Running = "Running"
    Reporting = "Reporting"
    """Whether the workers of the running launch report (False: none within the deadline)."""
    Resizing = "Resizing"
    Succeeded = "Succeeded"
    Failed = "Failed"
    Suspended = "Suspended"
    """`spec.suspend` is true and the job's workers are stopped, its GPUs released."""
    Preempted = "Preempted"
    """The allocator's queue (`run --queue las|srpt`) took the job's GPUs for a job ranked
    before it: its workers are stopped, and it is launched again when granted GPUs again."""
    Stalled = "Stalled"
    """The operator cannot make progress with this spec (a permanent error); not retried
    until the spec changes."""
    MetricsStale = "MetricsStale"


REPORT_DEADLINE_SECONDS = 600.0
"""How long a launch may run without any worker's report before `Reporting=False` and a
Warning say so (workers report at each epoch end and reset through herd_operator.worker).
Here, with the condition, so the CLI's, the runtime's and the reconciler's defaults are one
and none of them imports another layer for it."""


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """One observed fact about a job, and when it last flipped."""

    type: str = Field(min_length=1)
    status: ConditionStatus
    reason: str = Field(json_schema_extra={"pattern": REASON_PATTERN})
    message: str = ""
    last_transition_time: float
    observed_generation: int = Field(ge=0)

    @field_validator("reason")
    @classmethod
    def _reason_is_upper_camel_case(cls, reason: str) -> str:
        if not re.fullmatch(REASON_PATTERN, reason):
            raise ValueError(
                f"reason must be one UpperCamelCase word (like 'SpecInvalid'), got {reason!r}"
            )
        return reason


_KNOWN_ORDER = {str(condition_type): index for index, condition_type in enumerate(ConditionType)}


def _order_key(condition: Condition) -> tuple[int, str]:
    return (_KNOWN_ORDER.get(condition.type, len(_KNOWN_ORDER)), condition.type)


def set_condition(
    conditions: Sequence[Condition],
    type: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    generation: int,
    now: float,
) -> tuple[Condition, ...]:
    """Return `conditions` with the one of `type` set; its transition time moves only
    when its status changes."""
    condition_type = str(type)
    previous = get_condition(conditions, condition_type)
    status = ConditionStatus(status)
    if (
        previous is not None
        and previous.status == status
        and previous.reason == reason
        and previous.message == message
        and previous.observed_generation == generation
        and _is_canonical(conditions)
    ):
        return tuple(conditions)  # the common case on a resync: nothing to build
    transition_time = (
        previous.last_transition_time if previous is not None and previous.status == status else now
    )
    updated = Condition(
        type=condition_type,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=transition_time,
        observed_generation=generation,
    )
    others = [condition for condition in conditions if condition.type != condition_type]
    return tuple(sorted([*others, updated], key=_order_key))


def _is_canonical(conditions: Sequence[Condition]) -> bool:
    """One condition per type, in display order: what set_condition returns."""
    keys = [_order_key(condition) for condition in conditions]
    return keys == sorted(keys) and len({key[1] for key in keys}) == len(keys)


def get_condition(conditions: Sequence[Condition], type: str) -> Condition | None:
    """The condition of `type`, or None if it was never set."""
    wanted = str(type)
    return next((condition for condition in conditions if condition.type == wanted), None)


def is_true(conditions: Sequence[Condition], type: str) -> bool:
    """True only if the condition of `type` is set and its status is True."""
    condition = get_condition(conditions, type)
    return condition is not None and condition.status == ConditionStatus.TRUE
