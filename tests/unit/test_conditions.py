"""Status conditions: transition-time semantics, ordering, lookups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from herd_operator.specs import (
    Condition,
    ConditionStatus,
    ConditionType,
    get_condition,
    is_true,
    set_condition,
)

TRUE, FALSE, UNKNOWN = ConditionStatus.TRUE, ConditionStatus.FALSE, ConditionStatus.UNKNOWN


def test_status_values_are_the_kubernetes_strings() -> None:
    assert [str(status) for status in ConditionStatus] == ["True", "False", "Unknown"]
    assert [str(t) for t in ConditionType] == [
        "SpecValid",
        "DependenciesMet",
        "Admitted",
        "Running",
        "Reporting",
        "Resizing",
        "Succeeded",
        "Failed",
        "Suspended",
        "Preempted",
        "Stalled",
        "MetricsStale",
    ]


def test_first_set_records_everything() -> None:
    conditions = set_condition((), ConditionType.Admitted, TRUE, "Fits", "2 GPUs", 3, now=10.0)
    assert conditions == (
        Condition(
            type="Admitted",
            status=TRUE,
            reason="Fits",
            message="2 GPUs",
            last_transition_time=10.0,
            observed_generation=3,
        ),
    )
    assert type(conditions[0].type) is str


def test_same_status_keeps_the_transition_time_but_updates_the_rest() -> None:
    first = set_condition((), "Running", TRUE, "Started", "np=2", 1, now=10.0)
    second = set_condition(first, "Running", TRUE, "Resized", "np=4", 2, now=20.0)
    (running,) = second
    assert running.last_transition_time == 10.0
    assert (running.reason, running.message, running.observed_generation) == ("Resized", "np=4", 2)


def test_setting_the_same_facts_again_returns_the_same_conditions() -> None:
    conditions = set_condition((), "Running", TRUE, "Started", "np=2", 1, now=10.0)
    conditions = set_condition(conditions, "Admitted", TRUE, "Fits", "", 1, now=10.0)
    again = set_condition(conditions, "Running", TRUE, "Started", "np=2", 1, now=99.0)
    assert again == conditions
    assert all(new is old for new, old in zip(again, conditions, strict=True))
    # Any differing fact builds a new condition (the time only moves with the status).
    for changed in (
        set_condition(conditions, "Running", TRUE, "Started", "np=3", 1, now=99.0),
        set_condition(conditions, "Running", TRUE, "Resized", "np=2", 1, now=99.0),
        set_condition(conditions, "Running", TRUE, "Started", "np=2", 2, now=99.0),
    ):
        running = get_condition(changed, "Running")
        assert running is not None and running != get_condition(conditions, "Running")
        assert running.last_transition_time == 10.0


def test_the_same_facts_on_unordered_or_duplicated_input_still_give_canonical_output() -> None:
    running = set_condition((), "Running", TRUE, "Started", "", 1, now=10.0)[0]
    admitted = set_condition((), "Admitted", TRUE, "Fits", "", 1, now=10.0)[0]
    for stored in ((running, admitted), (admitted, running, running)):
        assert set_condition(stored, "Running", TRUE, "Started", "", 1, now=20.0) == (
            admitted,
            running,
        )


def test_status_change_moves_the_transition_time() -> None:
    conditions = set_condition((), "Running", TRUE, "Started", "", 1, now=10.0)
    conditions = set_condition(conditions, "Running", FALSE, "Exited", "", 1, now=20.0)
    assert conditions[0].last_transition_time == 20.0
    conditions = set_condition(conditions, "Running", UNKNOWN, "Lost", "", 1, now=30.0)
    assert conditions[0].last_transition_time == 30.0


def test_set_condition_is_pure() -> None:
    original = set_condition((), "Running", TRUE, "Started", "", 1, now=10.0)
    updated = set_condition(original, "Running", FALSE, "Exited", "", 1, now=20.0)
    assert original[0].status == TRUE
    assert updated[0].status == FALSE


def test_other_conditions_are_kept_and_the_order_is_stable() -> None:
    conditions: tuple[Condition, ...] = ()
    for condition_type in ["Zeta", "Failed", "Alpha", "Running", "SpecValid", "Admitted"]:
        conditions = set_condition(conditions, condition_type, FALSE, "Initial", "", 1, now=1.0)
    conditions = set_condition(conditions, "Running", TRUE, "Started", "", 1, now=2.0)
    assert [c.type for c in conditions] == [
        "SpecValid",
        "Admitted",
        "Running",
        "Failed",
        "Alpha",
        "Zeta",
    ]
    assert [c.type for c in conditions if c.last_transition_time == 2.0] == ["Running"]


def test_a_duplicated_input_type_collapses_to_one() -> None:
    stale = Condition(
        type="Running",
        status=TRUE,
        reason="Started",
        last_transition_time=1.0,
        observed_generation=1,
    )
    conditions = set_condition((stale, stale), "Running", TRUE, "Started", "", 2, now=5.0)
    assert len(conditions) == 1
    assert conditions[0].last_transition_time == 1.0


def test_reason_must_be_one_upper_camel_case_word() -> None:
    with pytest.raises(ValidationError) as exc:
        set_condition((), "Running", TRUE, "not started", "", 1, now=1.0)
    (error,) = exc.value.errors(include_url=False)
    assert error["loc"] == ("reason",)
    assert str(error["ctx"]["error"]) == (
        "reason must be one UpperCamelCase word (like 'SpecInvalid'), got 'not started'"
    )


def test_get_condition_and_is_true() -> None:
    conditions = set_condition((), "SpecValid", TRUE, "Valid", "", 1, now=1.0)
    conditions = set_condition(conditions, "Admitted", FALSE, "WaitingForGpus", "", 1, now=1.0)
    conditions = set_condition(conditions, "Running", UNKNOWN, "Adopting", "", 1, now=1.0)
    spec_valid = get_condition(conditions, ConditionType.SpecValid)
    assert spec_valid is not None
    assert spec_valid.reason == "Valid"
    assert get_condition(conditions, "Failed") is None
    assert is_true(conditions, "SpecValid")
    assert not is_true(conditions, "Admitted")
    assert not is_true(conditions, "Running")
    assert not is_true(conditions, "Failed")


def test_json_round_trip_uses_camel_case() -> None:
    (condition,) = set_condition((), "Failed", TRUE, "BackoffLimitExceeded", "3 restarts", 4, 9.5)
    dumped = condition.model_dump(mode="json", by_alias=True)
    assert dumped == {
        "type": "Failed",
        "status": "True",
        "reason": "BackoffLimitExceeded",
        "message": "3 restarts",
        "lastTransitionTime": 9.5,
        "observedGeneration": 4,
    }
    assert Condition.model_validate_json(condition.model_dump_json(by_alias=True)) == condition


_steps = st.lists(
    st.tuples(
        st.sampled_from(["SpecValid", "Running", "Custom"]),
        st.sampled_from(list(ConditionStatus)),
        st.sampled_from(["ReasonA", "ReasonB"]),
    ),
    max_size=30,
)


# No deadline: what is checked is the answer, not its time (the machine is shared).
@settings(deadline=None)
@given(_steps)
def test_transition_time_is_the_time_of_the_last_status_change(
    steps: list[tuple[str, ConditionStatus, str]],
) -> None:
    conditions: tuple[Condition, ...] = ()
    last_change: dict[str, tuple[ConditionStatus, float]] = {}
    for now, (condition_type, status, reason) in enumerate(steps):
        conditions = set_condition(conditions, condition_type, status, reason, "", now, now)
        previous = last_change.get(condition_type)
        if previous is None or previous[0] != status:
            last_change[condition_type] = (status, float(now))
    assert sorted(c.type for c in conditions) == sorted(last_change)
    for condition in conditions:
        assert (condition.status, condition.last_transition_time) == last_change[condition.type]
