"""The `herd-operator` command line: validate, schema, the reading commands and bad flags."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from herd_operator.cli import main
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from specs import ConditionStatus, ConditionType, HerdJob, set_condition, spec_fingerprint
from specs.status import GpuCounts, HerdJobStatus
from tests.unit.test_store import corrupt_a_table_page

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
HOURS_AGO = 5 * 3600


def spec_yaml(name: str, *, low: int = 1, high: int = 4, policy: str = "") -> str:
    return (
        "apiVersion: herd/v1alpha1\n"
        "kind: HerdJob\n"
        f"metadata:\n  name: {name}\n"
        "spec:\n"
        "  command: [python, train.py]\n"
        f"  gpus:\n    min: {low}\n    max: {high}\n"
        f"{policy}"
    )


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run a command argparse must refuse; returns its stderr."""
    with pytest.raises(SystemExit) as caught:
        main(list(argv))
    assert caught.value.code == EXIT_USAGE
    return capsys.readouterr().err


# ---- validate ----


def test_validate_good_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yml"
    first.write_text(spec_yaml("alpha"))
    second.write_text(spec_yaml("beta", policy="  policy:\n    name: static\n"))
    code, out, err = run_cli(capsys, "validate", str(first), str(second))
    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == [f"{first}: ok (alpha)", f"{second}: ok (beta)"]


def test_validate_reports_one_line_per_problem(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(spec_yaml("good"))
    bad.write_text(spec_yaml("bad", low=0).replace("[python, train.py]", "[]"))
    code, out, err = run_cli(capsys, "validate", str(good), str(bad))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err.splitlines() == [
        f"{bad}: spec.command: must not be empty",
        f"{bad}: spec.gpus.min: must be at least 1, got integer 0",
    ]


def test_validate_unreadable_and_broken_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, broken = tmp_path / "missing.yaml", tmp_path / "broken.yaml"
    broken.write_text("kind: [HerdJob\n")
    code, _, err = run_cli(capsys, "validate", str(missing), str(broken))
    assert code == EXIT_FAILURE
    first, second = err.splitlines()
    assert first == f"{missing}: (file): cannot read file: No such file or directory"
    assert second.startswith(f"{broken}: (file): YAML syntax error at line 2")


def test_validate_duplicate_names_across_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text(spec_yaml("same"))
    second.write_text(spec_yaml("same", high=2))
    code, out, err = run_cli(capsys, "validate", str(first), str(second))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err.splitlines() == [
        f"{first}: metadata.name: 'same' is also declared in b.yaml",
        f"{second}: metadata.name: 'same' is also declared in a.yaml",
    ]


def test_validate_unknown_policy_names_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(spec_yaml("job", policy="  policy:\n    name: nope\n"))
    code, _, err = run_cli(capsys, "validate", str(path))
    assert code == EXIT_FAILURE
    (line,) = err.splitlines()
    assert line.startswith(f"{path}: spec.policy.name: unknown policy 'nope'; allowed: ")
    assert "static" in line


def test_validate_bad_policy_params(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(spec_yaml("job", policy="  policy:\n    params: {gpus: 0}\n"))
    code, _, err = run_cli(capsys, "validate", str(path))
    assert code == EXIT_FAILURE
    assert err == f"{path}: spec.policy.params.gpus: must be at least 1, got integer 0\n"


# ---- schema ----


def test_schema_prints_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "schema")
    assert (code, err) == (EXIT_OK, "")
    schema = json.loads(out)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == "HerdJob (herd/v1alpha1)"
    assert {"apiVersion", "kind", "metadata", "spec"} <= set(schema["properties"])


# ---- reading commands ----


@pytest.mark.parametrize("argv", [["get"], ["get", "train"], ["describe", "train"], ["events"]])
def test_reading_commands_without_state(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    state = tmp_path / "nowhere"
    code, out, err = run_cli(capsys, *argv, "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == (
        f"herd-operator: no operator state in {state} (run `herd-operator run --state-dir "
        f"{state}` first, or pass the --state-dir it used)\n"
    )
    assert not state.exists()


def make_job(name: str, low: int, high: int) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": low, "max": high}},
        }
    )


def record(store: Store, job: HerdJob, now: float) -> None:
    path = f"/jobs/{job.name}.yaml"
    store.record_spec(job.name, path, job, spec_fingerprint(job), now)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A store as the operator leaves it: a running job at generation 2, an idle one, events."""
    state_dir = tmp_path / "state"
    created = time.time() - HOURS_AGO
    with Store(StateLayout(state_dir).database) as store:
        record(store, make_job("train", 1, 2), created)
        record(store, make_job("train", 1, 4), created)  # the spec changed: generation 2
        record(store, make_job("idle", 2, 2), created)
        conditions = set_condition(
            (), ConditionType.Admitted, ConditionStatus.TRUE, "Admitted", "min 1 fits", 1, created
        )
        conditions = set_condition(
            conditions,
            ConditionType.Running,
            ConditionStatus.TRUE,
            "Running",
            "2 workers running",
            1,
            created,
        )
        status = HerdJobStatus(
            observed_generation=1,
            conditions=conditions,
            gpus=GpuCounts(min=1, max=4, desired=3, allocated=2, active=2),
            placement=[("localhost", [0, 1])],
            epoch=5,
            policy_reason="static: max 4",
            grant_reason="admitted 0 -> 2: min 1 fits",
        )
        store.put_status("train", status, created)
        store.add_grant_change("train", 2, "admitted 0 -> 2: min 1 fits", created)
        now = time.time()
        store.add_event(None, "Normal", "OperatorStarted", "pool localhost:4", now - 1200)
        store.add_event("train", "Normal", "Scaled", "grown 0 -> 2", now - 660)
        store.add_event("train", "Normal", "Scaled", "grown 0 -> 2", now - 600)
        store.add_event("idle", "Warning", "Pending", "needs 2 GPUs, 0 free", now - 540)
    return state_dir


def test_get_table(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "get", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    header, idle, train = out.splitlines()
    assert header.split() == [
        "NAME",
        "STATUS",
        "MIN",
        "MAX",
        "DESIRED",
        "ALLOCATED",
        "ACTIVE",
        "AGE",
    ]
    assert idle.split() == ["idle", "Unknown", "2", "2", "-", "0", "-", "5h"]
    assert train.split() == ["train", "Running", "1", "4", "3", "2", "2", "5h"]
    for title, cell in [("STATUS", "Unknown"), ("DESIRED", "-"), ("AGE", "5h")]:
        assert header.index(title) == idle.index(cell)


def test_get_wide_and_one_name(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "get", "train", "-o", "wide", "--state-dir", str(state))
    assert code == EXIT_OK
    header, train = out.splitlines()
    assert header.split()[-5:] == ["EPOCH", "RESTARTS", "GEN", "POLICY", "PLACEMENT"]
    assert train.split()[-5:] == ["5", "0", "1/2", "static", "localhost:0+1"]


def test_get_missing_name(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "get", "nope", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == f"herd-operator: no job 'nope' in {state}\n"


def test_get_json_and_yaml_agree(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "get", "-o", "json", "--state-dir", str(state))
    assert code == EXIT_OK
    objects: list[dict[str, Any]] = json.loads(out)
    assert [obj["name"] for obj in objects] == ["idle", "train"]
    idle, train = objects
    assert (train["generation"], train["observedGeneration"]) == (2, 1)
    assert train["status"] == "Running"
    assert train["gpus"] == {"min": 1, "max": 4, "desired": 3, "allocated": 2, "active": 2}
    assert train["placement"] == {"localhost": [0, 1]}
    assert [(c["type"], c["status"], c["reason"]) for c in train["conditions"]] == [
        ("Admitted", "True", "Admitted"),
        ("Running", "True", "Running"),
    ]
    assert set(train["conditions"][0]) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert (idle["generation"], idle["observedGeneration"], idle["conditions"]) == (1, 0, [])
    assert idle["gpus"] == {"min": 2, "max": 2, "desired": None, "allocated": 0, "active": None}

    code, out, _ = run_cli(capsys, "get", "-o", "yaml", "--state-dir", str(state))
    assert code == EXIT_OK
    assert yaml.safe_load(out) == objects


def section(lines: list[str], title: str) -> list[str]:
    """The indented lines under a `describe` heading."""
    start = lines.index(title) + 1
    end = start
    while end < len(lines) and lines[end].startswith("  "):
        end += 1
    return lines[start:end]


def test_describe_running_job(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "describe", "train", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    lines = out.splitlines()
    for expected in [
        "Name:         train",
        "Spec file:    /jobs/train.yaml",
        "Generation:   2 (observed 1)",
        "Status:       Running",
        "Policy:       static (static: max 4)",
        "GPUs:         min 1, max 4, desired 3, allocated 2, active 2",
        "Epoch:        5",
        "Placement:",
        "  localhost -> GPUs 0, 1 (local ranks 0..1)",
        "Last decision: admitted 0 -> 2: min 1 fits",
    ]:
        assert expected in lines
    assert [line.split()[:4] for line in section(lines, "Conditions:")] == [
        ["TYPE", "STATUS", "REASON", "AGE"],
        ["Admitted", "True", "Admitted", "5h"],
        ["Running", "True", "Running", "5h"],
    ]
    assert section(lines, "Conditions:")[2].endswith("2 workers running")
    assert [line.split(maxsplit=2) for line in section(lines, "Decisions:")] == [
        ["AGE", "GPUS", "REASON"],
        ["5h", "2", "admitted 0 -> 2: min 1 fits"],
    ]
    assert [line.split() for line in section(lines, "Events:")] == [
        ["LAST", "SEEN", "TYPE", "REASON", "MESSAGE"],
        ["10m", "Normal", "Scaled", "grown", "0", "->", "2", "(x2)"],
    ]


def test_describe_idle_and_missing_jobs(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "describe", "idle", "--state-dir", str(state))
    assert code == EXIT_OK
    lines = out.splitlines()
    assert "GPUs:         min 2, max 2, desired -, allocated 0, active -" in lines
    assert "Placement:    none" in lines
    assert "Conditions:" in lines
    assert section(lines, "Conditions:") == []
    assert [line.split()[1:3] for line in section(lines, "Events:")[1:]] == [["Warning", "Pending"]]

    with Store(StateLayout(state).database) as store:
        record(store, make_job("quiet", 1, 1), time.time())
    code, out, _ = run_cli(capsys, "describe", "quiet", "--state-dir", str(state))
    assert code == EXIT_OK
    assert out.splitlines()[-1] == "Events:       none"

    code, out, err = run_cli(capsys, "describe", "nope", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == f"herd-operator: no job 'nope' in {state}\n"


def test_events_of_all_jobs(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "events", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    header, *rows = out.splitlines()
    assert header.split() == ["LAST", "SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert [row.split()[:4] for row in rows] == [
        ["20m", "Normal", "OperatorStarted", "-"],
        ["10m", "Normal", "Scaled", "herdjob/train"],
        ["9m", "Warning", "Pending", "herdjob/idle"],
    ]
    assert rows[1].endswith("grown 0 -> 2 (x2)")
    assert header.index("OBJECT") == rows[1].index("herdjob/train")


def test_events_of_one_job_and_limit(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "events", "idle", "--state-dir", str(state))
    assert code == EXIT_OK
    assert [row.split()[3] for row in out.splitlines()[1:]] == ["herdjob/idle"]
    code, out, _ = run_cli(capsys, "events", "--limit", "1", "--state-dir", str(state))
    assert code == EXIT_OK
    assert [row.split()[2] for row in out.splitlines()[1:]] == ["Pending"]
    code, out, _ = run_cli(capsys, "events", "ghost", "--state-dir", str(state))
    assert (code, out) == (EXIT_OK, "No events.\n")


# ---- bad flags ----


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--virtual-gpus", "0"], "argument --virtual-gpus: must be at least 1, got 0"),
        (["run", "--virtual-gpus", "four"], "argument --virtual-gpus: 'four' is not an integer"),
        (["run", "--resync-seconds", "0"], "argument --resync-seconds: must be positive, got 0"),
        (["run", "--grace-seconds", "soon"], "argument --grace-seconds: 'soon' is not a number"),
        (["events", "--limit", "0"], "argument --limit: must be at least 1, got 0"),
        (["get", "-o", "csv"], "argument -o/--output: invalid choice: 'csv'"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = cli_usage_error(capsys, *argv)
    assert f"error: {message}" in err


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "error: the following arguments are required: COMMAND" in cli_usage_error(capsys)


def test_run_with_bad_hosts_starts_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, specs = tmp_path / "state", tmp_path / "jobs"
    code, out, err = run_cli(
        capsys, "run", "--hosts", "bad", "--specs-dir", str(specs), "--state-dir", str(state)
    )
    assert (code, out) == (EXIT_USAGE, "")
    assert err == (
        "herd-operator: --hosts: 'bad' is not HOST:GPUS"
        " (for example localhost:4 or nid001:4,nid002:4)\n"
    )
    assert not state.exists()
    assert not specs.exists()


def test_get_and_describe_show_a_job_whose_stored_spec_is_unreadable(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The row is corrupted with sqlite3 while the other job's stays good."""
    raw = sqlite3.connect(StateLayout(state).database)
    raw.execute("UPDATE jobs SET spec_json = 'garbage{' WHERE name = 'train'")
    raw.commit()
    raw.close()
    code, out, err = run_cli(capsys, "get", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    _, idle, train = out.splitlines()
    assert idle.split() == ["idle", "Unknown", "2", "2", "-", "0", "-", "5h"]
    assert train.split() == ["train", "Running", "-", "-", "3", "2", "2", "5h"]
    code, out, _ = run_cli(capsys, "get", "train", "-o", "json", "--state-dir", str(state))
    (shown,) = json.loads(out)
    assert shown["spec"] is None and "the stored spec of job 'train'" in shown["specError"]
    code, out, _ = run_cli(capsys, "describe", "train", "--state-dir", str(state))
    assert code == EXIT_OK
    assert "Spec:         state store" in out and "is unreadable" in out
    assert "Status:       Running" in out and "Priority:     -" in out


def test_check_state_passes_a_sound_store_and_names_the_damage_of_another(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = StateLayout(state).database
    code, out, err = run_cli(capsys, "check-state", "--full", "--state-dir", str(state))
    assert (code, out, err) == (EXIT_OK, f"state store {database}: no damage found (2 jobs)\n", "")
    corrupt_a_table_page(database)  # bytes overwritten behind SQLite's back
    code, out, err = run_cli(capsys, "check-state", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err.startswith(f"herd-operator: state store {database} is damaged: ")
    assert "move the file aside" in err
