"""The JSON Schema editors use (`herd-operator schema`), checked with the jsonschema package,
and `validate`, which must say every problem of a spec."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from herd_operator.cli.main import main
from herd_operator.cli.views import EXIT_FAILURE
from herd_operator.policies.base import PolicyError
from herd_operator.policies.registry import BUILTIN_POLICIES, load_policy
from herd_operator.specs import PolicyRef

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples" / "specs").glob("*.yaml"))


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    """What `herd-operator schema` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == 0
    loaded: dict[str, Any] = json.loads(out.getvalue())
    return loaded


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def document(policy: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}}
    if policy is not None:
        spec["policy"] = policy
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "x"},
        "spec": spec,
    }


def properties(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(definition, property name, property schema) for every model property."""
    found = [("HerdJob", name, prop) for name, prop in schema["properties"].items()]
    for definition, body in schema["$defs"].items():
        found += [(definition, name, prop) for name, prop in body.get("properties", {}).items()]
    return found


def test_the_schema_has_an_id_and_the_2020_12_dialect(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == "urn:herd-operator:herd/v1alpha1:HerdJob"


def test_every_field_has_a_description_and_a_title_of_words(schema: dict[str, Any]) -> None:
    every = properties(schema)
    assert len(every) > 30  # the spec's fields and the built-in policies' params
    missing = [f"{d}.{n}" for d, n, p in every if not p.get("description", "").strip()]
    assert not missing, f"fields without a description: {missing}"
    for definition, name, prop in every:
        # A property titled like the model it refers to takes its title from there.
        target = prop.get("$ref", "#/$defs/-").split("/")[-1]
        title = prop.get("title") or schema["$defs"][target]["title"]
        words = [word.lower() for word in re.findall(r"[A-Z]?[a-z0-9]+", name)]
        # `elasticTimeoutSeconds` -> "Elastic timeout seconds", not "Elastictimeoutseconds"
        assert title.lower().split() == words, (definition, name, title)
        assert title[0].isupper(), (definition, name, title)
        assert "\n" not in prop["description"].split("\n\n")[0], (definition, name)
    assert schema["$defs"]["HorovodOptions"]["title"] == "Horovod options"
    assert schema["$defs"]["GpuRange"]["title"] == "GPU range"
    assert schema["$defs"]["HerdJobSpec"]["properties"]["gpus"]["title"] == "GPUs"


def test_the_examples_validate(validator: jsonschema.Draft202012Validator) -> None:
    assert EXAMPLES
    for path in EXAMPLES:
        errors = [e.message for e in validator.iter_errors(yaml.safe_load(path.read_text()))]
        assert errors == [], path


@pytest.mark.parametrize(
    ("policy", "wrong"),
    [
        ({"name": "memory", "params": {"lowww": 0.1}}, "'lowww' was unexpected"),
        ({"name": "memory", "params": {"low": "0.1"}}, "is not of type 'number'"),
        ({"name": "memory", "params": {"high": 1.5}}, "greater than the maximum of 1"),
        ({"name": "schedule", "params": {}}, "'steps' is a required property"),
        ({"name": "schedule", "params": {"steps": [{"atEpok": 1, "gpus": 2}]}}, "'atEpok'"),
        (
            {"name": "static", "params": {"gpus": 0}},
            "0 is not valid under any of the given schemas",
        ),
        ({"params": {"gpu": 2}}, "'gpu' was unexpected"),  # no name: the static policy's
    ],
)
def test_bad_params_of_a_built_in_policy_fail(
    validator: jsonschema.Draft202012Validator, policy: dict[str, Any], wrong: str
) -> None:
    messages = [e.message for e in validator.iter_errors(document(policy))]
    assert any(wrong in m for m in messages), messages
    # ... and the operator refuses them too.
    with pytest.raises(PolicyError):
        load_policy(PolicyRef.model_validate(policy))


@pytest.mark.parametrize(
    "policy",
    [
        {"name": "memory", "params": {"low": 0.1, "high": 0.9, "cooldownSeconds": 0}},
        {"name": "memory", "params": {"initial": "min"}},
        {"name": "schedule", "params": {"initial": 2, "steps": [{"afterSeconds": 30, "gpus": 1}]}},
        {"name": "static", "params": {"gpus": 2}},
        {"params": {}},
        None,
    ],
)
def test_good_params_pass_in_the_schema_and_the_operator(
    validator: jsonschema.Draft202012Validator, policy: dict[str, Any] | None
) -> None:
    assert [e.message for e in validator.iter_errors(document(policy))] == []
    load_policy(PolicyRef.model_validate(policy or {}))


def test_plug_in_params_stay_open(validator: jsonschema.Draft202012Validator) -> None:
    policy = {"name": "my-site-policy", "params": {"anything": [1, {"goes": True}]}}
    assert [e.message for e in validator.iter_errors(document(policy))] == []


def test_each_built_in_policy_has_its_params_in_the_schema(schema: dict[str, Any]) -> None:
    branches = schema["$defs"]["PolicyRef"]["allOf"]
    named = {branch["if"]["properties"]["name"]["const"] for branch in branches}
    assert named == set(BUILTIN_POLICIES)


def test_validate_says_every_params_problem_on_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = copy.deepcopy(
        document({"name": "memory", "params": {"lowww": 0.1, "high": 2, "step": 0}})
    )
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(bad))

    code = main(["validate", str(path)])

    err = capsys.readouterr().err
    assert code == EXIT_FAILURE
    assert sorted(err.splitlines()) == [
        f"{path}: spec.policy.params.high: Input should be less than or equal to 1",
        f"{path}: spec.policy.params.lowww: unknown field (allowed: low, high, step,"
        " cooldownEpochs, cooldownSeconds, windowSeconds, initial)",
        f"{path}: spec.policy.params.step: must be at least 1, got integer 0",
    ]
