"""The HerdJob models: defaults, validation messages, fingerprint and JSON Schema."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from herd_operator.specs import (
    API_VERSION,
    KIND,
    GpuRange,
    HerdJob,
    HerdJobSpec,
    HorovodOptions,
    ObjectMeta,
    PolicyRef,
    RestartPolicy,
    json_schema,
    load_spec_text,
    spec_fingerprint,
)

DNS_MESSAGE = (
    "must be a DNS-1123 label (lowercase letters, digits and '-', starting and ending "
    "with a letter or digit, at most 63 characters)"
)


def good_document() -> dict[str, Any]:
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "resnet", "labels": {"team": "vision"}},
        "spec": {
            "command": ["python", "train.py"],
            "gpus": {"min": 1, "max": 4},
        },
    }


def only_error(exc: pytest.ExceptionInfo[ValidationError]) -> tuple[tuple[int | str, ...], str]:
    errors = exc.value.errors(include_url=False)
    assert len(errors) == 1, errors
    error = errors[0]
    message = str(error["ctx"]["error"]) if error["type"] == "value_error" else error["msg"]
    return error["loc"], message


def load_yaml(text: str) -> HerdJob:
    loaded = load_spec_text(text, "job.yaml")
    assert loaded.job is not None, loaded.errors
    return loaded.job


def test_constants_match_the_literal_fields() -> None:
    assert API_VERSION == "herd/v1alpha1"
    assert KIND == "HerdJob"
    job = HerdJob.model_validate(good_document())
    assert (job.api_version, job.kind) == (API_VERSION, KIND)


def test_defaults_and_name_property() -> None:
    job = HerdJob.model_validate(good_document())
    assert job.name == "resnet"
    assert job.spec.policy == PolicyRef(name="static", params={})
    assert job.spec.horovod == HorovodOptions(
        elastic_timeout_seconds=600, reset_limit=None, extra_args=[]
    )
    assert job.spec.restart_policy == RestartPolicy(on_failure=False, backoff_limit=3)
    assert job.spec.priority == 0
    assert job.spec.env == {}
    assert job.spec.working_dir is None


def test_yaml_uses_camel_case_and_python_snake_case() -> None:
    document = good_document()
    document["spec"]["restartPolicy"] = {"onFailure": True, "backoffLimit": 5}
    document["spec"]["horovod"] = {"elasticTimeoutSeconds": 30, "resetLimit": 2}
    job = HerdJob.model_validate(document)
    assert job.spec.restart_policy.on_failure is True
    assert job.spec.horovod.elastic_timeout_seconds == 30
    dumped = job.model_dump(by_alias=True)
    assert set(dumped) == {"apiVersion", "kind", "metadata", "spec"}
    assert dumped["spec"]["restartPolicy"] == {"onFailure": True, "backoffLimit": 5}
    assert "workingDir" in dumped["spec"]
    assert HerdJob.model_validate(dumped) == job


def test_python_construction_by_field_name() -> None:
    spec = HerdJobSpec(
        command=["python", "train.py"],
        gpus=GpuRange(min=2, max=2),
        restart_policy=RestartPolicy(on_failure=True),
    )
    assert spec.restart_policy.backoff_limit == 3
    assert spec.gpus.min == spec.gpus.max == 2


def test_models_are_frozen() -> None:
    job = HerdJob.model_validate(good_document())
    with pytest.raises(ValidationError, match="Instance is frozen"):
        job.spec.gpus.min = 2  # type: ignore[misc]


def test_gpu_range_min_above_max_has_exact_message() -> None:
    with pytest.raises(ValidationError) as exc:
        GpuRange(min=3, max=2)
    assert only_error(exc) == ((), "min (3) must not exceed max (2)")


@pytest.mark.parametrize(
    ("field", "value"), [("min", 0), ("max", 0), ("min", -1), ("min", "2"), ("min", True)]
)
def test_gpu_range_rejects_non_positive_and_non_integer_counts(field: str, value: object) -> None:
    values: dict[str, object] = {"min": 1, "max": 1, field: value}
    with pytest.raises(ValidationError) as exc:
        GpuRange.model_validate(values)
    assert only_error(exc)[0] == (field,)


def test_gpu_range_min_equal_max_is_allowed() -> None:
    assert GpuRange(min=4, max=4).max == 4


@pytest.mark.parametrize("name", ["a", "resnet", "resnet-50", "0abc", "a" * 63, "x-1-y"])
def test_valid_job_names(name: str) -> None:
    assert ObjectMeta(name=name).name == name


@pytest.mark.parametrize("name", ["My_Job", "-a", "a-", "", "a" * 64, "a.b", "Resnet", "a b"])
def test_invalid_job_names_have_the_dns_message(name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        ObjectMeta(name=name)
    assert only_error(exc) == (("name",), DNS_MESSAGE)


def test_env_keys_must_be_shell_names_and_the_message_names_the_key() -> None:
    with pytest.raises(ValidationError) as exc:
        HerdJobSpec(command=["x"], gpus=GpuRange(min=1, max=1), env={"OK_1": "a", "1BAD": "b"})
    assert only_error(exc) == (
        ("env", "1BAD", "[key]"),
        "invalid environment variable name '1BAD': must match [A-Za-z_][A-Za-z0-9_]*",
    )


def test_command_needs_non_empty_items() -> None:
    with pytest.raises(ValidationError) as exc:
        HerdJobSpec(command=[], gpus=GpuRange(min=1, max=1))
    assert only_error(exc)[0] == ("command",)
    with pytest.raises(ValidationError) as exc:
        HerdJobSpec(command=["python", ""], gpus=GpuRange(min=1, max=1))
    assert only_error(exc)[0] == ("command", 1)


@pytest.mark.parametrize("name", ["static", "memory", "my-policy", "pkg.mod:Greedy", "mod:Cls"])
def test_policy_names_accepted(name: str) -> None:
    assert PolicyRef(name=name).name == name


@pytest.mark.parametrize("name", ["a b", "mod:", ":Cls", "pkg..mod:Cls", "mod:Cls:x"])
def test_policy_names_rejected(name: str) -> None:
    with pytest.raises(ValidationError) as exc:
        PolicyRef(name=name)
    assert only_error(exc) == (
        ("name",),
        f"{name!r} is not a policy name: a built-in's or an installed plug-in's"
        " name, letters, digits, '-' and '_' (like 'memory')",
    )


def test_empty_policy_name_rejected() -> None:
    with pytest.raises(ValidationError) as exc:
        PolicyRef(name="")
    assert only_error(exc)[0] == ("name",)


def test_policy_params_accept_plain_json_data() -> None:
    params = {"threshold": 0.25, "steps": [1, 2], "nested": {"on": True, "off": None}}
    assert PolicyRef(name="memory", params=params).params == params


def test_policy_params_reject_yaml_dates_with_their_path() -> None:
    job = load_spec_text(
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {name: a}\n"
        "spec: {command: [x], gpus: {min: 1, max: 1},"
        " policy: {name: memory, params: {schedule: [{at: 2024-01-01}]}}}\n",
        "job.yaml",
    )
    assert [(e.field, e.message) for e in job.errors] == [
        (
            "spec.policy.params",
            "schedule[0].at: must be a string, number, boolean, null, list or mapping, "
            "got date 2024-01-01",
        )
    ]


def test_policy_params_reject_non_string_keys_and_cycles() -> None:
    with pytest.raises(ValidationError) as exc:
        PolicyRef(params={"levels": {1: "low"}})
    assert only_error(exc) == (("params",), "levels: mapping keys must be strings, got 1")
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(ValidationError) as exc:
        PolicyRef(params={"loop": cycle})
    assert only_error(exc) == (("params",), "loop[0]: refers to itself (a YAML alias cycle)")


def test_a_shared_but_acyclic_alias_is_not_a_cycle() -> None:
    shared = {"lr": 0.1}
    assert PolicyRef(params={"a": shared, "b": [shared, shared]}).params["b"][1] == shared


def test_unknown_fields_are_rejected_at_every_level() -> None:
    document = good_document()
    document["spec"]["gpus"]["maximum"] = 8
    with pytest.raises(ValidationError) as exc:
        HerdJob.model_validate(document)
    assert only_error(exc)[0] == ("spec", "gpus", "maximum")


def test_strict_integers_for_timeouts_priority_and_limits() -> None:
    models: list[tuple[type[BaseModel], str]] = [
        (HorovodOptions, "elasticTimeoutSeconds"),
        (HorovodOptions, "resetLimit"),
        (RestartPolicy, "backoffLimit"),
    ]
    for model, field in models:
        with pytest.raises(ValidationError):
            model.model_validate({field: "5"})
    with pytest.raises(ValidationError):
        HorovodOptions(elastic_timeout_seconds=0)
    with pytest.raises(ValidationError):
        RestartPolicy.model_validate({"onFailure": "yes"})


FORMATTED_A = """
apiVersion: herd/v1alpha1
kind: HerdJob
metadata:
  name: resnet
  labels: {team: vision}
spec:
  command: [python, train.py]
  gpus: {min: 1, max: 4}
  env: {A: "1", B: "2"}
"""

FORMATTED_B = """# same job, other layout
kind: "HerdJob"
spec:
  env:
    B: '2'   # order does not matter
    A: '1'
  gpus:
    max: 4
    min: 1
  command:
    - python
    - "train.py"
  priority: 0          # the default, spelled out
  policy: {name: static}
metadata: {name: resnet, labels: {team: vision}}
apiVersion: 'herd/v1alpha1'
"""


def test_fingerprint_is_stable_under_reformatting_and_explicit_defaults() -> None:
    fingerprint = spec_fingerprint(load_yaml(FORMATTED_A))
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    assert spec_fingerprint(load_yaml(FORMATTED_B)) == fingerprint


def test_fingerprint_follows_the_spec_but_not_the_labels() -> None:
    fingerprint = spec_fingerprint(load_yaml(FORMATTED_A))
    relabelled = FORMATTED_A.replace("team: vision", "team: nlp")
    assert spec_fingerprint(load_yaml(relabelled)) == fingerprint
    resized = FORMATTED_A.replace("max: 4", "max: 8")
    assert spec_fingerprint(load_yaml(resized)) != fingerprint
    reparametrised = FORMATTED_A + "  policy: {name: static, params: {x: 1}}\n"
    assert spec_fingerprint(load_yaml(reparametrised)) != fingerprint


def test_json_schema_structure() -> None:
    schema = json_schema()
    json.dumps(schema)  # editors read it as JSON
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "HerdJob (herd/v1alpha1)"
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert sorted(schema["required"]) == ["apiVersion", "kind", "metadata", "spec"]
    assert schema["properties"]["apiVersion"]["const"] == "herd/v1alpha1"
    assert schema["properties"]["kind"]["const"] == "HerdJob"
    definitions = schema["$defs"]
    spec = definitions["HerdJobSpec"]
    assert sorted(spec["required"]) == ["command", "gpus"]
    assert spec["additionalProperties"] is False
    assert set(spec["properties"]) == {
        "command",
        "workingDir",
        "env",
        "gpus",
        "priority",
        "policy",
        "engine",
        "horovod",
        "restartPolicy",
        "training",
        "suspend",
        "activeDeadlineSeconds",
        "dependsOn",
    }
    assert spec["properties"]["command"]["minItems"] == 1
    assert spec["properties"]["env"]["propertyNames"]["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"
    gpus_min = definitions["GpuRange"]["properties"]["min"]
    assert gpus_min.pop("description").startswith("Fewest GPUs the job can train on.")
    assert gpus_min == {"minimum": 1, "maximum": 65536, "title": "Min", "type": "integer"}
    name = definitions["ObjectMeta"]["properties"]["name"]
    assert name["maxLength"] == 63
    assert name["pattern"] == "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


# No deadline: what is checked is the answer, not its time (the machine is shared).
@settings(deadline=None)
@given(st.text(alphabet="abzAZ09-_.", max_size=70))
def test_schema_name_rule_agrees_with_the_validator(name: str) -> None:
    rule = json_schema()["$defs"]["ObjectMeta"]["properties"]["name"]
    schema_accepts = len(name) <= rule["maxLength"] and re.search(rule["pattern"], name) is not None
    try:
        ObjectMeta(name=name)
        model_accepts = True
    except ValidationError:
        model_accepts = False
    assert model_accepts == schema_accepts


def test_json_schema_validates_examples_with_jsonschema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    assert list(validator.iter_errors(good_document())) == []
    bad = good_document()
    bad["spec"]["gpus"] = {"min": 0}
    bad["spec"]["extra"] = True
    messages = sorted(error.message for error in validator.iter_errors(bad))
    assert messages == [
        "'max' is a required property",
        "0 is less than the minimum of 1",
        "Additional properties are not allowed ('extra' was unexpected)",
    ]
