"""The spec fields of issue 28's progress, limits and order: `training.epochs`,
`activeDeadlineSeconds`, `dependsOn`. Validated with errors naming the field, in the
schema alike, refused across files when they make a cycle, and invisible to specs that do
not use them (their fingerprint, their workers, their relaunches)."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from herd_operator.cli.spec_commands import checked_sources
from herd_operator.environment import BATCH_POLICY_ENV
from herd_operator.runtime.dispatch import training_env
from herd_operator.runtime.engines.horovod import relaunch_reason
from herd_operator.specs import (
    HerdJob,
    SpecError,
    index_specs,
    json_schema,
    load_spec_text,
    scan_spec_dir,
    spec_fingerprint,
)
from herd_operator.specs.dependencies import cycle_message, dependency_cycles

HEADER = "apiVersion: herd/v1alpha1\nkind: HerdJob\n"


def job(name: str = "train", **spec: Any) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "t.py"], "gpus": {"min": 1, "max": 4}, **spec},
        }
    )


def spec_text(name: str, **extra: Any) -> str:
    spec = {"command": ["x"], "gpus": {"min": 1, "max": 1}, **extra}
    return HEADER + f"metadata: {{name: {name}}}\nspec: {json.dumps(spec)}\n"


def problems(name: str, **extra: Any) -> list[tuple[str, str]]:
    loaded = load_spec_text(spec_text(name, **extra), "t.yaml")
    assert loaded.job is None
    return [(error.field, error.message) for error in loaded.errors]


def test_the_fields_load() -> None:
    loaded = load_spec_text(
        spec_text("b", training={"epochs": 10}, activeDeadlineSeconds=3600, dependsOn=["a", "c"]),
        "t.yaml",
    )
    assert loaded.job is not None
    spec = loaded.job.spec
    assert spec.training is not None and spec.training.epochs == 10
    assert (spec.active_deadline_seconds, spec.depends_on) == (3600, ["a", "c"])


@pytest.mark.parametrize(
    ("extra", "field", "message"),
    [
        ({"training": {"epochs": 0}}, "spec.training.epochs", "must be at least 1, got integer 0"),
        ({"training": {"epochs": "10"}}, "spec.training.epochs", "expected an integer, got"),
        ({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds", "must be at least 1"),
        ({"activeDeadlineSeconds": 1.5}, "spec.activeDeadlineSeconds", "expected an integer, got"),
        ({"activeDeadlineSeconds": "1h"}, "spec.activeDeadlineSeconds", "expected an integer, got"),
        ({"dependsOn": "a"}, "spec.dependsOn", "expected a list, got string"),
        ({"dependsOn": ["Bad Name"]}, "spec.dependsOn[0]", "'Bad Name' is not a job name"),
        ({"dependsOn": ["a", "a"]}, "spec.dependsOn", "names 'a' more than once"),
        ({"dependsOn": ["me"]}, "spec.dependsOn", "names the job itself ('me')"),
    ],
)
def test_bad_values_name_their_field(extra: dict[str, Any], field: str, message: str) -> None:
    found = problems("me", **extra)
    assert len(found) == 1, found
    assert found[0][0] == field
    assert message in found[0][1], found


def test_the_schema_agrees_with_validation() -> None:
    schema = json_schema()
    validator = jsonschema.Draft202012Validator(schema)
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"training": {"epochs": 10}}, True),
        ({"training": {"epochs": 0}}, False),
        ({"activeDeadlineSeconds": 60}, True),
        ({"activeDeadlineSeconds": 0}, False),
        ({"activeDeadlineSeconds": "60"}, False),
        ({"dependsOn": ["a", "b"]}, True),
        ({"dependsOn": ["a", "a"]}, False),
        ({"dependsOn": ["Bad Name"]}, False),
    ]
    for extra, valid in cases:
        document = {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "me"},
            "spec": {"command": ["x"], "gpus": {"min": 1, "max": 1}, **extra},
        }
        assert validator.is_valid(document) is valid, extra
        assert load_spec_text(spec_text("me", **extra), "t.yaml").valid is valid, extra


def test_specs_without_the_fields_keep_their_fingerprint() -> None:
    # Computed by main before these fields (dce5640): an operator upgrade bumps no
    # generation, so no finished job runs again and no running one is relaunched.
    assert spec_fingerprint(job()) == (
        "e2d81d3ee2a4c883185615f3ed5c4924b136bfd861b2cab4de53a2b0834a31f6"
    )
    assert spec_fingerprint(job(training={})) == (
        "3030f3ca1bfc8b066b49e48dbe1e08122685471cf41718a972ddcf275f5ae200"
    )
    assert spec_fingerprint(job(training={"batchPolicy": "linear-lr", "warmupSteps": 20})) == (
        "fe013e57a8a6c09cbe2a92bd2c03caa24e269fae0669b7de4e8d669a3ffe61a1"
    )
    assert spec_fingerprint(job()) != spec_fingerprint(job(activeDeadlineSeconds=60))
    assert spec_fingerprint(job()) != spec_fingerprint(job(dependsOn=["a"]))
    assert spec_fingerprint(job()) != spec_fingerprint(job(training={"epochs": 3}))
    assert spec_fingerprint(job(training={})) != spec_fingerprint(job(training={"maxBatch": 512}))


def test_epochs_alone_tell_the_workers_nothing() -> None:
    assert training_env(job(training={"epochs": 10})) == {}
    assert training_env(job(training={"epochs": 10, "batchPolicy": "linear-lr"})) == {
        BATCH_POLICY_ENV: "linear-lr"
    }
    assert training_env(job(training={})) == {BATCH_POLICY_ENV: "naive"}


def test_changing_what_only_the_operator_reads_relaunches_nothing() -> None:
    launched = job().spec
    for changed in (
        job(training={"epochs": 10}),
        job(activeDeadlineSeconds=60),
        job(dependsOn=["a"]),
    ):
        assert relaunch_reason(launched, changed.spec) == ""
    with_batch = job(training={"epochs": 10, "batchPolicy": "linear-lr"}).spec
    assert (
        relaunch_reason(with_batch, job(training={"epochs": 20, "batchPolicy": "linear-lr"}).spec)
        == ""
    )
    assert relaunch_reason(launched, with_batch) != ""


@pytest.mark.parametrize(
    ("graph", "cycles"),
    [
        ({}, {}),
        ({"a": ["b"]}, {}),  # b is not declared here: ends the path
        ({"a": ["b"], "b": ["c"], "c": []}, {}),
        ({"a": ["a"]}, {"a": ["a", "a"]}),
        ({"a": ["b"], "b": ["a"]}, {"a": ["a", "b", "a"], "b": ["b", "a", "b"]}),
        (
            {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]},
            {"a": ["a", "b", "c", "a"], "b": ["b", "c", "a", "b"], "c": ["c", "a", "b", "c"]},
        ),
        # b reaches the cycle r <-> a only through a, found after a was done with.
        (
            {"r": ["a", "b"], "a": ["r"], "b": ["a"]},
            {"a": ["a", "r", "a"], "b": ["b", "a", "r", "b"], "r": ["r", "a", "r"]},
        ),
    ],
)
def test_dependency_cycles(graph: dict[str, list[str]], cycles: dict[str, list[str]]) -> None:
    assert dependency_cycles(graph) == cycles


def test_a_long_chain_is_no_cycle_and_no_recursion() -> None:
    chain = {f"j{index}": [f"j{index + 1}"] for index in range(1000)}
    assert dependency_cycles(chain) == {}
    chain["j1000"] = ["j0"]
    cycles = dependency_cycles(chain)
    assert len(cycles) == 1001
    assert cycle_message(cycles["j0"]) == (
        "a dependency cycle (j0 -> j1 -> j2 -> j3 -> ... 994 more -> j998 -> j999"
        " -> j1000 -> j0): none of these jobs could ever start"
    )


def test_a_cycle_across_files_makes_each_of_them_invalid(tmp_path: Path) -> None:
    for name, after in (("a", ["b"]), ("b", ["a"]), ("c", ["a"])):
        (tmp_path / f"{name}.yaml").write_text(spec_text(name, dependsOn=after))
    index = index_specs(scan_spec_dir(tmp_path))
    assert list(index.jobs) == ["c"]  # waits for a (which cannot run: it fails for that)
    assert index.invalid == {
        "a": (
            SpecError(
                str(tmp_path / "a.yaml"),
                "spec.dependsOn",
                "a dependency cycle (a -> b -> a): none of these jobs could ever start",
            ),
        ),
        "b": (
            SpecError(
                str(tmp_path / "b.yaml"),
                "spec.dependsOn",
                "a dependency cycle (b -> a -> b): none of these jobs could ever start",
            ),
        ),
    }
    _, found = checked_sources([str(p) for p in sorted(tmp_path.iterdir())], io.StringIO())
    assert [problem.split(": ", 1)[1] for problem in found] == [
        "spec.dependsOn: a dependency cycle (a -> b -> a): none of these jobs could ever start",
        "spec.dependsOn: a dependency cycle (b -> a -> b): none of these jobs could ever start",
    ]
