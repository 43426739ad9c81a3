"""`spec.training`: validated in the spec, carried to the workers, read by the worker API."""

from __future__ import annotations

import json
from typing import Any

import pytest

from herd_operator.agent.settings import batch_settings
from herd_operator.environment import (
    BATCH_POLICY_ENV,
    MAX_BATCH_ENV,
    MAX_WORKER_BATCH_ENV,
    MEASURE_STEPS_ENV,
    OPERATOR_SET,
    TRAINING_ENV,
    WARMUP_STEPS_ENV,
)
from herd_operator.runtime.dispatch import training_env
from herd_operator.runtime.engines.base import training_at_launch
from herd_operator.specs import HerdJob, json_schema, load_spec_text, spec_fingerprint


def job(**spec: Any) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "train"},
            "spec": {"command": ["python", "t.py"], "gpus": {"min": 1, "max": 4}, **spec},
        }
    )


def test_training_reaches_the_workers_as_herd_variables() -> None:
    assert training_env(job()) == {}
    assert training_env(job(training={})) == {BATCH_POLICY_ENV: "naive"}
    full = job(
        training={"batchPolicy": "linear-lr", "warmupSteps": 20, "maxWorkerBatch": 64},
    )
    assert training_env(full) == {
        BATCH_POLICY_ENV: "linear-lr",
        WARMUP_STEPS_ENV: "20",
        MAX_WORKER_BATCH_ENV: "64",
    }
    assert not TRAINING_ENV & OPERATOR_SET
    adaptive = job(training={"batchPolicy": "adaptive", "maxBatch": 512, "maxWorkerBatch": 64})
    assert training_env(adaptive) == {
        BATCH_POLICY_ENV: "adaptive",
        MAX_WORKER_BATCH_ENV: "64",
        MAX_BATCH_ENV: "512",
    }
    # measureSteps unset: the workers' default; 0 (epoch ends only) is said.
    measured = job(training={"batchPolicy": "adaptive", "measureSteps": 0})
    assert training_env(measured) == {BATCH_POLICY_ENV: "adaptive", MEASURE_STEPS_ENV: "0"}


@pytest.mark.parametrize(
    "training",
    [
        {"batchPolicy": "elastic"},
        {"batchPolicy": "preserve-batch", "warmupSteps": -1},
        {"maxWorkerBatch": 0},
        {"maxWorkerBatch": "64"},
        {"measureSteps": -1},
        {"measureSteps": "20"},
        {"batch": "naive"},
        {"resumable": "yes"},
        {"resumable": 1},
    ],
)
def test_bad_training_options_are_spec_errors(training: dict[str, Any]) -> None:
    text = (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {name: t}\n"
        f"spec: {{command: [x], gpus: {{min: 1, max: 1}}, training: {json.dumps(training)}}}\n"
    )
    loaded = load_spec_text(text, "t.yaml")
    assert loaded.job is None
    assert loaded.errors
    assert all(error.field.startswith("spec.training") for error in loaded.errors), loaded.errors


def test_unset_training_keeps_the_fingerprint_of_older_specs() -> None:
    assert spec_fingerprint(job()) == spec_fingerprint(job(env={}))
    assert spec_fingerprint(job()) != spec_fingerprint(job(training={}))
    assert spec_fingerprint(job(training={})) != spec_fingerprint(
        job(training={"batchPolicy": "preserve-batch"})
    )


def test_resumable_is_the_operators_alone_and_false_keeps_older_fingerprints() -> None:
    said = job(training={"resumable": True})
    assert said.spec.training is not None and said.spec.training.resumable
    assert job(training={}).spec.training.resumable is False  # type: ignore[union-attr]
    # Only the operator reads it: alone it tells the workers nothing, and beside a batch
    # policy it changes nothing they are told (nor what their launch fixed).
    assert training_env(said) == {}
    assert training_env(job(training={"epochs": 3, "resumable": True})) == {}
    batch = {"batchPolicy": "linear-lr", "warmupSteps": 20}
    assert training_env(job(training={**batch, "resumable": True})) == training_env(
        job(training=batch)
    )
    assert training_at_launch(job(training={**batch, "resumable": True}).spec) == (
        training_at_launch(job(training=batch).spec)
    )
    # `resumable: false`, the default, is the spec from before the field.
    assert spec_fingerprint(job(training={"epochs": 3, "resumable": False})) == spec_fingerprint(
        job(training={"epochs": 3})
    )
    assert spec_fingerprint(said) != spec_fingerprint(job(training={}))


def test_a_bad_resumable_names_its_field() -> None:
    text = (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {name: t}\n"
        "spec: {command: [x], gpus: {min: 1, max: 1}, training: {resumable: maybe}}\n"
    )
    loaded = load_spec_text(text, "t.yaml")
    assert [error.field for error in loaded.errors] == ["spec.training.resumable"]
    assert "t.yaml" in str(loaded.errors[0])


def test_schema_describes_the_training_fields() -> None:
    fields = json_schema()["$defs"]["TrainingOptions"]["properties"]
    assert set(fields) == {
        "batchPolicy", "warmupSteps", "maxWorkerBatch", "maxBatch", "measureSteps", "epochs",
        "resumable",
    }  # fmt: skip
    assert fields["batchPolicy"]["enum"] == ["naive", "linear-lr", "preserve-batch", "adaptive"]
    assert all(field.get("description") for field in fields.values())


def test_the_spec_wins_over_the_script(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TRAINING_ENV:
        monkeypatch.delenv(name, raising=False)
    mine = batch_settings(32, 0.1, policy="linear-lr", warmup_steps=5, max_worker_batch=16)
    assert (mine.policy, mine.warmup_steps, mine.max_worker_batch) == ("linear-lr", 5, 16)
    assert batch_settings(32, 0.1).policy == "naive"
    monkeypatch.setenv(BATCH_POLICY_ENV, "preserve-batch")
    monkeypatch.setenv(WARMUP_STEPS_ENV, "0")
    monkeypatch.setenv(MAX_WORKER_BATCH_ENV, "8")
    chosen = batch_settings(32, 0.1, policy="linear-lr", warmup_steps=5, max_worker_batch=16)
    assert (chosen.policy, chosen.warmup_steps, chosen.max_worker_batch) == (
        "preserve-batch",
        0,
        8,
    )
    monkeypatch.setenv(MAX_BATCH_ENV, "512")
    assert batch_settings(32, 0.1, max_batch=64).max_batch == 512
    assert batch_settings(32, 0.1).measure_steps == 20  # DEFAULT_MEASURE_STEPS
    assert batch_settings(32, 0.1, measure_steps=5).measure_steps == 5
    monkeypatch.setenv(MEASURE_STEPS_ENV, "0")
    assert batch_settings(32, 0.1, measure_steps=5).measure_steps == 0
    for bad, said in (
        ("often", "HERD_MEASURE_STEPS=.often. is not"),
        ("-3", "measure_steps must be >= 0"),
    ):
        monkeypatch.setenv(MEASURE_STEPS_ENV, bad)
        with pytest.raises(ValueError, match=said):
            batch_settings(32, 0.1)
    monkeypatch.delenv(MEASURE_STEPS_ENV)
    monkeypatch.setenv(BATCH_POLICY_ENV, "bigger")
    with pytest.raises(ValueError, match="unknown batch policy"):
        batch_settings(32, 0.1)
    monkeypatch.setenv(BATCH_POLICY_ENV, "naive")
    monkeypatch.setenv(WARMUP_STEPS_ENV, "many")
    with pytest.raises(ValueError, match="HERD_WARMUP_STEPS"):
        batch_settings(32, 0.1)


def test_sum_gradients_in_one_process_keeps_gradients_and_fills_missing_ones() -> None:
    torch = pytest.importorskip("torch")
    from herd_operator.agent.training import sum_gradients

    used, unused = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    used(torch.ones(4, 3)).sum().backward()
    before = [param.grad.clone() for param in used.parameters()]
    sum_gradients([*used.parameters(), *unused.parameters()])
    assert all(
        torch.equal(param.grad, grad) for param, grad in zip(used.parameters(), before, strict=True)
    )
    # Every rank must send the same tensors: a parameter without a gradient sends zeros.
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in unused.parameters())
