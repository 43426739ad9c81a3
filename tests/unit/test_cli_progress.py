"""What `get`, `describe`, `get -o json|yaml` and /metrics show of issue 28's progress,
reported metrics, time limit and dependencies, from a store as the operator leaves it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.cli.main import main
from herd_operator.layout import StateLayout
from herd_operator.runtime.metrics import StateCollector, metric_label
from herd_operator.runtime.store import Store
from herd_operator.specs import ConditionStatus, ConditionType, HerdJob, set_condition
from herd_operator.specs.fingerprint import spec_fingerprint
from herd_operator.specs.status import MAX_JOB_METRICS, GpuCounts, HerdJobStatus, Progress
from herd_operator.specs.values import Pool

NOW = time.time()
"""When the module was imported: the fixture's times are its own `time.time()`, since a
loaded machine may take minutes between an import and a test."""


def herd_job(name: str, **spec: object) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 2}, **spec},
        }
    )


def running(epoch: int, now: float = NOW, **fields: object) -> HerdJobStatus:
    conditions = set_condition(
        (), ConditionType.Admitted, ConditionStatus.TRUE, "Admitted", "", 1, now - 100
    )
    conditions = set_condition(
        conditions, ConditionType.Running, ConditionStatus.TRUE, "Training", "", 1, now - 100
    )
    return HerdJobStatus(
        observed_generation=1,
        conditions=conditions,
        gpus=GpuCounts(min=1, max=2, desired=2, allocated=2, active=2),
        epoch=epoch,
        **fields,  # type: ignore[arg-type]
    )


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state_dir = tmp_path / "state"
    now = time.time()
    (tmp_path / "now").write_text(repr(now))
    with Store(StateLayout(state_dir).database) as store:
        jobs = {
            "train": herd_job("train", training={"epochs": 10}, activeDeadlineSeconds=3600),
            "after": herd_job("after", dependsOn=["train"]),
        }
        for name, job in jobs.items():
            store.record_spec(name, f"/jobs/{name}.yaml", job, spec_fingerprint(job), now - 200)
        progress = Progress(
            epochs=10, completed=4, epoch_seconds=12.5, world_size=2,
            estimated_completion=now + 3000,
        )  # fmt: skip
        store.put_status(
            "train",
            running(3, now, progress=progress, metrics={"loss": 0.25, "val/acc": 0.875},
                    run_started_at=now - 130),
            now,
        )  # fmt: skip
    return state_dir


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_get_shows_progress_and_wide_an_eta(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header, after, train = run_cli(capsys, "get", "--state-dir", str(state)).splitlines()
    assert header.split()[7] == "PROGRESS"
    assert train.split()[7] == "4/10"
    assert after.split()[7] == "-"  # expects no number of epochs
    header, _, train = run_cli(capsys, "get", "-o", "wide", "--state-dir", str(state)).splitlines()
    titles, cells = header.split(), train.split()
    # EPOCH counts epochs completed, as PROGRESS does (the last reported epoch was 3).
    assert cells[titles.index("EPOCH")] == cells[titles.index("PROGRESS")].split("/")[0] == "4"
    # 50 minutes after the fixture wrote it, less the time this test took to come here.
    eta = re.fullmatch(r"(\d+)m", cells[titles.index("ETA")])
    assert eta is not None and 40 <= int(eta.group(1)) <= 50


def test_describe_shows_progress_metrics_limit_and_dependencies(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = run_cli(capsys, "describe", "train", "--state-dir", str(state))
    progress = next(line for line in out.splitlines() if line.startswith("Progress:"))
    assert progress.startswith(
        "Progress:     4/10 epochs (40%), 12.5s per epoch at this size, ETA "
    )
    assert "Metrics:      loss=0.25, val/acc=0.875 (the last reported)" in out
    assert re.search(
        r"^Time limit:   3600s, 2m used since the first start \(reached at [-0-9T:]+Z\)$", out, re.M
    )
    out = run_cli(capsys, "describe", "after", "--state-dir", str(state))
    assert "Depends on:   train (must succeed first)" in out
    assert "Time limit:" not in out and "Progress:" not in out and "Metrics:" not in out


def test_json_status_has_progress_metrics_and_the_run_start(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = json.loads(run_cli(capsys, "get", "train", "-o", "json", "--state-dir", str(state)))
    status = shown["status"]
    assert status["progress"]["epochs"] == 10 and status["progress"]["completed"] == 4
    assert status["progress"]["epochSeconds"] == 12.5
    assert status["progress"]["estimatedCompletion"].endswith("Z")
    assert status["metrics"] == {"loss": 0.25, "val/acc": 0.875}
    assert status["runStartedAt"].endswith("Z")
    assert shown["spec"]["activeDeadlineSeconds"] == 3600
    assert shown["spec"]["training"]["epochs"] == 10
    other = json.loads(run_cli(capsys, "get", "after", "-o", "json", "--state-dir", str(state)))
    assert "progress" not in other["status"] and "metrics" not in other["status"]
    assert other["spec"]["dependsOn"] == ["train"]


@pytest.mark.parametrize(
    ("name", "label"),
    [("loss", "loss"), ("val/acc", "val_acc"), ("1cycle", "_1cycle"), ("top-5 err", "top_5_err"),
     ("é", "_")],
)  # fmt: skip
def test_metric_label(name: str, label: str) -> None:
    assert metric_label(name) == label


def scrape(store: Store, now: float) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(
        StateCollector(
            store, lambda: Pool.from_counts({"n": 4}), dict, dict, clock=lambda: now,
        )
    )  # fmt: skip
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_show_progress_eta_and_reported_values(state: Path) -> None:
    now = float((state.parent / "now").read_text())
    with Store.open_readonly(StateLayout(state).database) as store:
        got = scrape(store, now + 25)
    job = (("herd_job", "train"),)
    assert got[("herd_job_expected_epochs", job)] == 10
    assert got[("herd_job_progress_ratio", job)] == 0.4
    assert got[("herd_job_epoch_duration_seconds", job)] == 12.5
    assert got[("herd_job_eta_seconds", job)] == pytest.approx(2975.0)
    assert got[("herd_job_reported_metric", (("herd_job", "train"), ("metric", "loss")))] == 0.25
    assert got[("herd_job_reported_metric", (("herd_job", "train"), ("metric", "val_acc")))] == (
        0.875
    )
    assert not any(name == "herd_job_eta_seconds" and labels == (("herd_job", "after"),)
                   for name, labels in got)  # fmt: skip


def test_metrics_are_bounded_and_names_made_one_are_shown_once(tmp_path: Path) -> None:
    many = {f"m{index}": float(index) for index in range(MAX_JOB_METRICS + 5)}
    clashing = {"val/acc": 1.0, "val_acc": 2.0}
    with Store(tmp_path / "state.db") as store:
        for name, metrics in (("many", many), ("clash", clashing)):
            job = herd_job(name)
            store.record_spec(name, f"/jobs/{name}.yaml", job, spec_fingerprint(job), NOW)
            store.put_status(name, running(1, metrics=metrics), NOW)
        got = scrape(store, NOW)
    reported = [labels for name, labels in got if name == "herd_job_reported_metric"]
    assert sum(1 for labels in reported if ("herd_job", "many") in labels) == MAX_JOB_METRICS
    clash = [dict(labels) for labels in reported if ("herd_job", "clash") in labels]
    assert clash == [{"herd_job": "clash", "metric": "val_acc"}]
    assert got[("herd_job_reported_metric", (("herd_job", "clash"), ("metric", "val_acc")))] == 1.0


def test_a_pending_job_shows_its_progress_but_no_eta(tmp_path: Path) -> None:
    progress = Progress(
        epochs=10, completed=4, epoch_seconds=12.5, world_size=2, estimated_completion=NOW + 75
    )
    with Store(tmp_path / "state.db") as store:
        job = herd_job("lost", training={"epochs": 10})
        store.record_spec("lost", "/jobs/lost.yaml", job, spec_fingerprint(job), NOW)
        # Back in the queue (its node was lost): Running is False, its last run's ETA stale.
        status = running(3, progress=progress)
        conditions = set_condition(
            status.conditions, ConditionType.Admitted, ConditionStatus.FALSE, "Pending", "",
            1, NOW,
        )  # fmt: skip
        conditions = set_condition(
            conditions, ConditionType.Running, ConditionStatus.FALSE, "NodeLost", "", 1, NOW
        )
        store.put_status("lost", status.model_copy(update={"conditions": conditions}), NOW)
        got = scrape(store, NOW)
    job_labels = (("herd_job", "lost"),)
    assert got[("herd_job_progress_ratio", job_labels)] == 0.4
    assert ("herd_job_eta_seconds", job_labels) not in got
    assert ("herd_job_epoch_duration_seconds", job_labels) not in got
