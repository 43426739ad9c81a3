"""`herd-operator report --format json|csv` (issue 28.4): the text summary's numbers for
programs, and the three forms agreeing on one state."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from herd_operator.cli.report.command import output_format
from herd_operator.cli.report.tabular import CSV_COLUMNS
from herd_operator.cli.report.text import format_duration
from tests.unit.test_report import run_cli, two_jobs

EXIT_OK, EXIT_USAGE = 0, 2


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return two_jobs(tmp_path / "state")


def report(capsys: pytest.CaptureFixture[str], state: Path, *argv: str) -> str:
    code, out, err = run_cli(capsys, "report", "--state-dir", str(state), *argv)
    assert code == EXIT_OK, err
    return out


def test_the_json_report_has_its_documented_shape(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = json.loads(report(capsys, state_dir, "--format", "json"))
    assert list(shown) == [
        "kind",
        "version",
        "stateDir",
        "start",
        "startUnixSeconds",
        "durationSeconds",
        "poolGpus",
        "poolInferred",
        "jobs",
        "grantChanges",
        "sharedGpus",
    ]
    assert (shown["kind"], shown["version"]) == ("HerdReport", 1)
    assert shown["start"] == "2023-11-14T22:13:20Z"
    assert shown["durationSeconds"] == 400.0
    alpha, beta = shown["jobs"]
    assert alpha == {
        "name": "alpha",
        "status": "Succeeded",
        "policy": "memory",
        "minGpus": 1,
        "maxGpus": 4,
        # 4 GPUs from 10 s to 130 s, 2 until 300 s.
        "gpuSeconds": 4 * 120.0 + 2 * 170.0,
        "epochs": 3,
        "resizes": 1,
        "pendingSeconds": 10.0,
        "historyTrimmedThroughSeconds": None,
    }
    assert beta["gpuSeconds"] == 2 * 270.0
    assert shown["grantChanges"][:2] == [
        {"offsetSeconds": 10.0, "job": "alpha", "gpusBefore": 0, "gpusAfter": 4,
         "reason": "admitted"},
        {"offsetSeconds": 130.0, "job": "alpha", "gpusBefore": 4, "gpusAfter": 2,
         "reason": "memory 0.12 < 0.3: 4 -> 2"},
    ]  # fmt: skip


def test_text_json_and_csv_say_the_same_numbers(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = report(capsys, state_dir, "--format", "text")
    shown = json.loads(report(capsys, state_dir, "--format", "json"))
    rows = list(csv.DictReader(io.StringIO(report(capsys, state_dir, "--format", "csv"))))
    table = text.split("\n\n")[1].splitlines()
    header, body = table[0].split(), [line.split() for line in table[1:]]
    assert len(body) == len(shown["jobs"]) == len(rows) == 2
    for cells, job, row in zip(body, shown["jobs"], rows, strict=True):
        by_title = dict(zip(header, cells, strict=True))
        assert by_title["JOB"] == job["name"] == row["job"]
        assert by_title["STATUS"] == job["status"] == row["status"]
        assert by_title["GPU-SECONDS"] == f"{job['gpuSeconds']:.0f}"
        assert float(row["gpu_seconds"]) == job["gpuSeconds"]
        assert by_title["EPOCHS"] == str(job["epochs"]) == row["epochs"]
        assert by_title["RESIZES"] == str(job["resizes"]) == row["resizes"]
        assert by_title["PENDING"] == format_duration(job["pendingSeconds"])
        assert float(row["pending_seconds"]) == job["pendingSeconds"]
        assert by_title["GPUS"] == f"{job['minGpus']}-{job['maxGpus']}"
        assert (row["min_gpus"], row["max_gpus"]) == (str(job["minGpus"]), str(job["maxGpus"]))
    log = text.split("Grant changes:")[1].strip().splitlines()[1:]
    assert len(log) == len(shown["grantChanges"])
    for line, change in zip(log, shown["grantChanges"], strict=True):
        time_, job, gpus = line.split()[:3]
        assert time_ == format_duration(change["offsetSeconds"])
        assert (job, gpus) == (change["job"], f"{change['gpusBefore']}->{change['gpusAfter']}")


def test_the_csv_has_a_header_row_and_one_row_per_job(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = report(capsys, state_dir, "--format", "csv", "--jobs", "beta")
    assert out.splitlines() == [",".join(CSV_COLUMNS), "beta,Running,static,2,2,540.0,0,0,125.0,,"]


def test_a_json_or_csv_output_file_picks_its_format(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("r.json", "r.csv"):
        output = tmp_path / name
        code, out, _ = run_cli(
            capsys, "report", "--state-dir", str(state_dir), "--output", str(output)
        )
        assert (code, out) == (EXIT_OK, "")
        if name.endswith(".json"):
            assert json.loads(output.read_text())["kind"] == "HerdReport"
        else:
            assert output.read_text().startswith("job,status,")


@pytest.mark.parametrize(
    ("requested", "output", "expected"),
    [("json", None, "json"), ("csv", "r.csv", "csv"), (None, "R.JSON", "json")],
)
def test_output_format_of_data(requested: str | None, output: str | None, expected: str) -> None:
    assert output_format(requested, None if output is None else Path(output)) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "json", "--output", "r.csv"], "--format json, but --output r.csv says"),
        (["--format", "csv", "--output", "r.png"], "--format csv, but --output r.png says"),
        (["--format", "text", "--output", "r.json"], "--format text, but --output r.json says"),
    ],
)
def test_a_format_the_output_contradicts_is_a_usage_error(
    state_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run_cli(capsys, "report", "--state-dir", str(state_dir), *argv)
    assert (code, out) == (EXIT_USAGE, "")
    assert err.startswith(f"error: {message} otherwise\n") or err.startswith(f"error: {message}")
    assert err.endswith("See 'herd-operator report --help'.\n")
