"""What deleted jobs and long-lived jobs leave behind is bounded: the grant history per job,
and a deleted job's history and files after the retention (`herd_operator.runtime.pruner`).
The readers (`describe`, `report`, the demo's summary) say when a job's history was cut.

Real store, real files under a state dir; times are set with `os.utime`, never waited for.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from herd_operator.cli.demo import summary
from herd_operator.layout import StateLayout
from herd_operator.runtime.pruner import Pruner
from herd_operator.runtime.store import Store
from herd_operator.specs import HerdJob
from tests.unit.test_cli import run_cli

NOW = 1_700_000_000.0
DAY = 86_400.0


def job(name: str) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}},
        }
    )


@pytest.fixture
def layout(tmp_path: Path) -> StateLayout:
    state = StateLayout(tmp_path / "state")
    state.create()
    return state


def touch(path: Path, age: float) -> Path:
    path.write_text("x" * 10)
    os.utime(path, (NOW - age, NOW - age))
    return path


def test_a_prune_removes_deleted_jobs_history_and_files_past_the_retention_only(
    layout: StateLayout,
) -> None:
    with Store(layout.database) as store:
        store.record_spec("alive", "/jobs/alive.yaml", job("alive"), "fp", now=NOW - 3 * DAY)
        for name in ("alive", "gone", "running", "fresh"):
            store.add_grant_change(name, 2, "admitted", now=NOW - 3 * DAY)
        store.add_grant_change("fresh", 0, "spec deleted", now=NOW - 60)
        old = {name: touch(layout.log_file(name), 2 * DAY) for name in ("alive", "gone", "running")}
        fresh_log = touch(layout.log_file("fresh"), 60)
        leftovers = [
            touch(layout.job_token_file("gone"), 2 * DAY),
            touch(layout.job_env_file("gone"), 2 * DAY),
            touch(layout.launches_dir / f"gone.{'a' * 32}.exit", 2 * DAY),
        ]
        recorded_exit = touch(layout.launches_dir / f"running.{'b' * 32}.exit", 2 * DAY)
        touch(layout.launches_dir / "running.json", 2 * DAY)
        unrelated = touch(layout.secrets_dir / "agent.token", 2 * DAY)

        pruner = Pruner(
            store, layout, lambda: {"running"}, retention_seconds=DAY, clock=lambda: NOW
        )
        result = pruner.prune_once()

        assert (result.histories, result.files, result.bytes) == (2, 4, 40)
        assert sorted({change.job for change in store.grant_history()}) == ["alive", "fresh"]
        assert not old["gone"].exists() and not any(path.exists() for path in leftovers)
        assert old["alive"].exists(), "a job with a record keeps its log"
        assert old["running"].exists() and recorded_exit.exists(), "a running job keeps its files"
        assert fresh_log.exists(), "deleted, but within the retention"
        assert unrelated.exists()
        assert pruner.prune_once().files == 0, "a second walk finds nothing more"


def test_a_job_declared_again_under_a_deleted_name_keeps_its_history(layout: StateLayout) -> None:
    with Store(layout.database) as store:
        store.add_grant_change("again", 2, "admitted", now=NOW - 3 * DAY)
        store.record_spec("again", "/jobs/again.yaml", job("again"), "fp", now=NOW)
        log = touch(layout.log_file("again"), 2 * DAY)

        Pruner(store, layout, set, retention_seconds=DAY, clock=lambda: NOW).prune_once()

        assert len(store.grant_history("again")) == 1 and log.exists()


@pytest.fixture
def trimmed_state(layout: StateLayout) -> StateLayout:
    """A job `long` whose oldest two grant changes the bound (3 per job) dropped."""
    with Store(layout.database, max_grants_per_job=3) as store:
        store.record_spec("long", "/jobs/long.yaml", job("long"), "fp", now=NOW)
        for step, gpus in enumerate([1, 2, 3, 4, 2]):
            store.add_grant_change("long", gpus, "resized", now=NOW + 10 * step)
    return layout


def test_describe_says_how_much_history_the_bound_dropped(
    trimmed_state: StateLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "describe", "long", "--state-dir", str(trimmed_state.root))
    assert code == 0
    assert "  (2 older change(s) were dropped by the history bound, the newest of them" in out


def test_the_report_says_whose_history_was_trimmed(
    trimmed_state: StateLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(
        capsys, "report", "--state-dir", str(trimmed_state.root), "--format", "text"
    )
    assert code == 0
    assert (
        "Grant history trimmed by the store's bound (run --grant-history-per-job) for long"
        " (up to 10s): their GPU-seconds count only the changes kept."
    ) in out


def test_the_demo_summary_marks_a_trimmed_timeline(trimmed_state: StateLayout) -> None:
    text = summary(trimmed_state.database, started=0.0)
    (row,) = [line for line in text.splitlines() if line.startswith("long")]
    assert "... -> 3 -> 4 -> 2" in row
