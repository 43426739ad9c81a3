"""The JSON Schema (`herd-operator schema`) and the validator (`validate`, the operator's
loader) agree (issue 28.5): label syntax, `engine.kind`, the policy names the schema
describes; and the warning for a policy's GPU count outside [min, max]."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from herd_operator.cli.main import main
from herd_operator.cli.selectors import parse_selector
from herd_operator.policies.registry import BUILTIN_POLICIES, builtin_summaries, params_warnings
from herd_operator.runtime.engines import ENGINES
from herd_operator.runtime.specdir import with_known_references
from herd_operator.specs import load_spec_text

EXIT_OK, EXIT_FAILURE = 0, 1


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == EXIT_OK
    loaded: dict[str, Any] = json.loads(out.getvalue())
    return loaded


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def job(**changes: Any) -> dict[str, Any]:
    """A good spec document, with `metadata.labels`, `engine` or `policy` as given."""
    document: dict[str, Any] = {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "x"},
        "spec": {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}},
    }
    if "labels" in changes:
        document["metadata"]["labels"] = changes.pop("labels")
    document["spec"].update(changes)
    return document


def validator_errors(document: dict[str, Any]) -> list[str]:
    """What `validate` says of the document (the operator's loader and its registries)."""
    loaded = with_known_references(load_spec_text(yaml.safe_dump(document), "x.yaml"))
    return [f"{error.field}: {error.message}" for error in loaded.errors]


LONG = "a" * 63
GOOD = [
    job(),
    job(labels={"team": "vision", "tier": ""}),
    job(labels={"example.com/team": "vision", "a.b-c.d/x_y.z": "A-1_b.2"}),
    job(labels={LONG: LONG, f"{'p' * 253}/{LONG}": ""}),
    job(engine={"kind": "horovod"}),
    job(engine={"kind": "horovod", "options": {"glooTimeoutSeconds": 60}}),
    job(policy={"name": "static", "params": {"gpus": 2}}),
]
BAD = [
    # (document, the field the validator names, words of its message)
    (job(labels={"Team Name": "x"}), "metadata.labels", "'Team Name' is not a label key"),
    (job(labels={"team": "a b"}), "metadata.labels", "'a b' is not a label value"),
    (job(labels={"-team": "x"}), "metadata.labels", "'-team' is not a label key"),
    (job(labels={"team-": "x"}), "metadata.labels", "is not a label key"),
    (job(labels={"a" * 64: "x"}), "metadata.labels", "is not a label key"),
    (job(labels={"team": "v" * 64}), "metadata.labels", "is not a label value"),
    (job(labels={"Example.com/team": "x"}), "metadata.labels", "is not a label key"),
    (job(labels={f"{'p' * 254}/team": "x"}), "metadata.labels", "is not a label key"),
    (job(labels={"a/b/c": "x"}), "metadata.labels", "is not a label key"),
    (job(labels={"": "x"}), "metadata.labels", "'' is not a label key"),
    (job(labels={"team": "-x"}), "metadata.labels", "is not a label value"),
    (job(engine={"kind": "slurm"}), "spec.engine.kind", "slurm"),
    (job(engine={"kind": "Horovod"}), "spec.engine.kind", "'Horovod' is not an engine kind"),
    (job(policy={"name": "static", "params": {"gpus": 0}}), "spec.policy.params.gpus", ""),
]


@pytest.mark.parametrize("document", GOOD)
def test_a_good_spec_passes_both(
    validator: jsonschema.Draft202012Validator, document: dict[str, Any]
) -> None:
    assert [e.message for e in validator.iter_errors(document)] == []
    assert validator_errors(document) == []


@pytest.mark.parametrize(("document", "field", "words"), BAD)
def test_a_bad_spec_fails_both_naming_the_field(
    validator: jsonschema.Draft202012Validator, document: dict[str, Any], field: str, words: str
) -> None:
    assert list(validator.iter_errors(document)), "the schema lets it through"
    errors = validator_errors(document)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{field}: ") and words in errors[0], errors


def test_every_label_a_spec_accepts_can_be_selected() -> None:
    for document in GOOD:
        for key, value in document["metadata"].get("labels", {}).items():
            selector = parse_selector(f"{key}={value}")
            assert selector.matches({key: value})


def test_engine_kind_is_the_enum_of_the_engines_there_are(schema: dict[str, Any]) -> None:
    kind = schema["$defs"]["EngineRef"]["properties"]["kind"]
    assert kind["enum"] == sorted(ENGINES)
    assert kind["default"] in kind["enum"]


def test_the_policy_name_description_lists_every_built_in(schema: dict[str, Any]) -> None:
    """Generated from the registry: a built-in added there shows here with its one line."""
    description = schema["$defs"]["PolicyRef"]["properties"]["name"]["description"]
    assert set(builtin_summaries()) == set(BUILTIN_POLICIES)
    for name, summary in builtin_summaries().items():
        assert f"`{name}` (" in description
        assert summary.rstrip(".") in description
    assert "`static` (the default: " in description
    assert "plug-in" in description


@pytest.mark.parametrize(
    ("policy", "warnings"),
    [
        ({"name": "static", "params": {"gpus": 8}}, ["spec.policy.params.gpus: 8 GPUs is more"
                                                     " than spec.gpus.max (4): the job runs on"
                                                     " 4 at most"]),
        ({"name": "static", "params": {"gpus": 4}}, []),
        ({"name": "static", "params": {}}, []),
        ({"name": "memory", "params": {"initial": 6}}, ["spec.policy.params.initial: 6 GPUs"
                                                        " is more than spec.gpus.max (4): the"
                                                        " job runs on 4 at most"]),
        ({"name": "memory", "params": {"initial": "max"}}, []),
        (
            {"name": "schedule",
             "params": {"initial": 1, "steps": [{"atEpoch": 1, "gpus": 2},
                                                {"atEpoch": 2, "gpus": 16}]}},
            ["spec.policy.params.steps[1].gpus: 16 GPUs is more than spec.gpus.max (4): the"
             " job runs on 4 at most"],
        ),
        ({"name": "static", "params": {"gpus": 1}}, ["spec.policy.params.gpus: 1 GPUs is fewer"
                                                     " than spec.gpus.min (2): the job runs on"
                                                     " 2 at least"]),
        ({"name": "no-such-policy", "params": {"gpus": 99}}, []),  # an error, said elsewhere
    ],
)  # fmt: skip
def test_params_that_name_more_gpus_than_max_are_warned_of(
    policy: dict[str, Any], warnings: list[str]
) -> None:
    document = job(policy=policy)
    if "fewer" in "".join(warnings):
        document["spec"]["gpus"] = {"min": 2, "max": 4}
    spec_file = load_spec_text(yaml.safe_dump(document), "x.yaml")
    assert spec_file.job is not None
    assert params_warnings(spec_file.job.spec) == warnings


def test_validate_warns_and_still_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(job(policy={"name": "static", "params": {"gpus": 8}})))
    assert main(["validate", str(path)]) == EXIT_OK
    captured = capsys.readouterr()
    assert captured.out == f"{path}: ok (x)\n"
    assert captured.err == (
        f"warning: {path}: spec.policy.params.gpus: 8 GPUs is more than spec.gpus.max (4):"
        " the job runs on 4 at most\n"
    )


def test_validate_refuses_a_label_no_selector_can_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(job(labels={"Team Name": "vision"})))
    assert main(["validate", str(path)]) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith(f"{path}: metadata.labels: 'Team Name' is not a label key (letters,")
