"""The `herd-operator` command line: validate, schema, the reading commands and bad flags."""

from __future__ import annotations

import importlib.metadata
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import jsonschema
import pytest
import yaml

from herd_operator.cli import main
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.specs import (
    ConditionStatus,
    ConditionType,
    HerdJob,
    json_schema,
    load_spec_file,
    set_condition,
    spec_fingerprint,
)
from herd_operator.specs.status import GpuCounts, HerdJobStatus, ResizeCost
from herd_operator.specs.values import ResizeMode
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


LABELS = {"train": {"team": "vision", "tier": "gpu"}, "idle": {"team": "nlp"}}


def make_job(name: str, low: int, high: int) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name, "labels": LABELS.get(name, {})},
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
        "PROGRESS",
        "AGE",
    ]
    assert idle.split() == ["idle", "Unknown", "2", "2", "-", "0", "-", "-", "5h"]
    assert train.split() == ["train", "Running", "1", "4", "3", "2", "2", "-", "5h"]
    for title, cell in [("STATUS", "Unknown"), ("DESIRED", "-"), ("AGE", "5h")]:
        assert header.index(title) == idle.index(cell)


def test_get_wide_and_one_name(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "get", "train", "-o", "wide", "--state-dir", str(state))
    assert code == EXIT_OK
    header, train = out.splitlines()
    assert header.split()[-6:] == ["EPOCH", "ETA", "RESTARTS", "GEN", "POLICY", "PLACEMENT"]
    # Epoch 5 (counted from 0) was the last reported: 6 done.
    assert train.split()[-6:] == ["6", "-", "0", "1/2", "static", "localhost:0+1"]


def test_get_missing_name(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "get", "nope", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == f"herd-operator: no job 'nope' in {state}\n"


def test_get_name_json_is_one_herdjob_object(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "get", "train", "-o", "json", "--state-dir", str(state))
    assert code == EXIT_OK
    train = json.loads(out)
    assert (train["apiVersion"], train["kind"]) == ("herd/v1alpha1", "HerdJob")
    assert list(train) == ["apiVersion", "kind", "metadata", "spec", "status"]
    metadata = train["metadata"]
    assert (metadata["name"], metadata["generation"]) == ("train", 2)
    assert metadata["labels"] == {"team": "vision", "tier": "gpu"}
    created = datetime.fromisoformat(metadata["creationTimestamp"])
    assert metadata["creationTimestamp"].endswith("Z") and created.tzinfo is not None
    assert abs(created.timestamp() - (time.time() - HOURS_AGO)) < 5
    assert train["spec"]["gpus"] == {"min": 1, "max": 4}
    status = train["status"]
    assert status["observedGeneration"] == 1
    assert status["gpus"] == {"desired": 3, "allocated": 2, "active": 2}
    assert status["placement"] == [{"host": "localhost", "gpus": [0, 1]}]
    assert status["logFile"] == str(StateLayout(state).log_file("train"))
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Admitted", "True", "Admitted"),
        ("Running", "True", "Running"),
    ]
    condition = status["conditions"][0]
    assert set(condition) == {
        "type",
        "status",
        "reason",
        "message",
        "lastTransitionTime",
        "observedGeneration",
    }
    assert datetime.fromisoformat(condition["lastTransitionTime"]).tzinfo is not None

    code, out, _ = run_cli(capsys, "get", "train", "-o", "yaml", "--state-dir", str(state))
    assert code == EXIT_OK
    assert yaml.safe_load(out) == train


def test_get_yaml_validates_against_the_schema_and_loads_back_as_the_same_spec(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "get", "train", "-o", "yaml", "--state-dir", str(state))
    assert code == EXIT_OK
    jsonschema.validate(yaml.safe_load(out), json_schema())
    saved = tmp_path / "train.yaml"
    saved.write_text(out)
    loaded = load_spec_file(saved)
    assert loaded.errors == ()
    assert loaded.job is not None
    assert loaded.job == make_job("train", 1, 4)
    assert spec_fingerprint(loaded.job) == spec_fingerprint(make_job("train", 1, 4))


def test_get_json_without_a_name_is_a_list(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "get", "-o", "json", "--state-dir", str(state))
    assert code == EXIT_OK
    shown = json.loads(out)
    assert (shown["apiVersion"], shown["kind"]) == ("v1", "List")
    assert [item["metadata"]["name"] for item in shown["items"]] == ["idle", "train"]
    assert all(item["kind"] == "HerdJob" for item in shown["items"])
    idle = shown["items"][0]
    assert idle["status"]["conditions"] == [] and idle["status"]["observedGeneration"] == 0
    code, out, _ = run_cli(capsys, "get", "-o", "yaml", "--state-dir", str(state))
    assert yaml.safe_load(out) == shown
    code, out, _ = run_cli(
        capsys, "get", "-o", "json", "-l", "team=none", "--state-dir", str(state)
    )
    assert (code, json.loads(out)["items"]) == (EXIT_OK, [])


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("team=vision", ["train"]),
        ("team==vision", ["train"]),
        ("team!=vision", ["idle"]),
        ("tier", ["train"]),
        ("!tier", ["idle"]),
        ("team,tier!=cpu", ["idle", "train"]),  # != holds where the label is not set
        ("team in (nlp, vision)", ["idle", "train"]),
        ("team notin (nlp)", ["train"]),
        ("team=vision,!tier", []),
    ],
)
def test_get_label_selector(
    state: Path, capsys: pytest.CaptureFixture[str], selector: str, names: list[str]
) -> None:
    code, out, err = run_cli(capsys, "get", "-l", selector, "-o", "name", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == [f"herdjob/{name}" for name in names]


def test_get_no_headers_and_nothing_selected(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "get", "--no-headers", "--state-dir", str(state))
    assert code == EXIT_OK
    assert [line.split()[0] for line in out.splitlines()] == ["idle", "train"]
    code, out, err = run_cli(capsys, "get", "-l", "team=none", "--state-dir", str(state))
    assert (code, out) == (EXIT_OK, "")
    assert err == f"No jobs in {state}.\n"


def test_state_dir_before_the_command(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--state-dir", str(state), "get", "-o", "name")
    assert (code, out) == (EXIT_OK, "herdjob/idle\nherdjob/train\n")
    # After the command, it wins over one given before (the nearer one).
    code, out, err = run_cli(
        capsys, "--state-dir", str(state), "get", "--state-dir", str(state / "nowhere")
    )
    assert code == EXIT_FAILURE and "no operator state" in err


def watch_rounds(monkeypatch: pytest.MonkeyPatch, *changes: Callable[[], None]) -> None:
    """The watch commands' poll, without its clock: each change is made before one round,
    then one round more (which must print nothing new), then the watch ends."""

    def rounds(timeout: float | None) -> Iterator[None]:
        for change in changes:
            change()
            yield
        yield

    monkeypatch.setattr("herd_operator.cli.reading._ticks", rounds)


def test_get_watch_prints_a_change(
    state: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A status changes while `get -w` watches: its row is printed again, once."""

    def change() -> None:
        with Store(StateLayout(state).database) as store:
            record = store.get_job("train")
            assert record is not None and record.status.gpus is not None
            gpus = record.status.gpus.model_copy(update={"allocated": 3, "active": 3})
            store.put_status("train", record.status.model_copy(update={"gpus": gpus}), time.time())

    watch_rounds(monkeypatch, change)
    code, out, _ = run_cli(capsys, "get", "-w", "--no-headers", "--state-dir", str(state))
    assert code == EXIT_OK
    rows = [line.split() for line in out.splitlines()]
    assert [row[:7] for row in rows] == [
        ["idle", "Unknown", "2", "2", "-", "0", "-"],
        ["train", "Running", "1", "4", "3", "2", "2"],
        ["train", "Running", "1", "4", "3", "3", "3"],
    ]


def test_get_watch_yaml_prints_one_object_per_change(
    state: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def change() -> None:
        with Store(StateLayout(state).database) as store:
            record = store.get_job("idle")
            assert record is not None
            store.put_status("idle", record.status.model_copy(update={"epoch": 1}), time.time())

    watch_rounds(monkeypatch, change)
    code, out, _ = run_cli(capsys, "get", "-w", "-o", "yaml", "--state-dir", str(state))
    assert code == EXIT_OK
    first, changed = list(yaml.safe_load_all(out))
    assert first["kind"] == "List" and len(first["items"]) == 2
    assert (changed["kind"], changed["metadata"]["name"]) == ("HerdJob", "idle")
    assert changed["status"]["epoch"] == 1


def test_events_watch_prints_new_and_repeated_events(
    state: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def add() -> None:
        with Store(StateLayout(state).database) as store:
            now = time.time()
            store.add_event("train", "Warning", "LaunchFailed", "no horovodrun", now)
            store.add_event("idle", "Warning", "Pending", "needs 2 GPUs, 0 free", now)

    watch_rounds(monkeypatch, add)
    code, out, _ = run_cli(capsys, "events", "-w", "--no-headers", "--state-dir", str(state))
    assert code == EXIT_OK
    reasons = [line.split()[2] for line in out.splitlines()]
    assert reasons[:3] == ["OperatorStarted", "Scaled", "Pending"]
    assert sorted(reasons[3:]) == ["LaunchFailed", "Pending"]  # new, and repeated
    assert out.count("needs 2 GPUs, 0 free (x2)") == 1


def test_a_watch_ends_after_its_timeout_with_what_it_printed_first(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["get", "-w", "-o", "name"], ["events", "-w"]):
        code, out, err = run_cli(capsys, *argv, "--timeout", "0.1", "--state-dir", str(state))
        assert (code, err) == (EXIT_OK, ""), argv
        assert out and out == run_cli(capsys, *argv[:1], *argv[2:], "--state-dir", str(state))[1]


def test_watch_ends_quietly_on_ctrl_c(
    state: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", interrupted)
    for argv in (["get", "-w"], ["events", "-w"], ["logs", "train", "-f"]):
        code, _, err = run_cli(capsys, *argv, "--state-dir", str(state))
        assert (code, err) == (EXIT_OK, ""), argv


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["--version"])
    assert caught.value.code == EXIT_OK
    assert (
        capsys.readouterr().out == f"herd-operator {importlib.metadata.version('herd-operator')}\n"
    )


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
        f"Log:          {StateLayout(state).log_file('train')} (herd-operator logs train)",
        "Generation:   2 (observed 1)",
        "Status:       Running",
        "Policy:       static (static: max 4)",
        "GPUs:         min 1, max 4, desired 3, allocated 2, active 2",
        "Epochs done:  6",
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


def test_describe_and_get_show_what_the_last_resize_cost(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last resize's cost stays in `describe` (and the resource) once its event has left
    the newest 20; a job that finished none has no line."""
    finished = time.time() - 240
    cost = ResizeCost(
        before=1, after=3, seconds=30.84, engine="torchrun", mode=ResizeMode.RESTART,
        completed_at=finished,
    )  # fmt: skip
    with Store(StateLayout(state).database) as store:
        current = store.get_job("train")
        assert current is not None
        store.put_status("train", current.status.model_copy(update={"last_resize": cost}), finished)

    code, out, err = run_cli(capsys, "describe", "train", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    told = "1 -> 3 workers in 30.8 s (every worker restarted)"
    assert f"Last resize:  {told}, on torchrun, 4m ago" in out.splitlines()
    code, out, _ = run_cli(capsys, "get", "train", "-o", "json", "--state-dir", str(state))
    shown = json.loads(out)["status"]["lastResize"]
    assert datetime.fromisoformat(shown.pop("completedAt")).timestamp() == pytest.approx(
        finished, abs=1
    )
    assert shown == {
        "before": 1, "after": 3, "seconds": 30.84, "engine": "torchrun", "mode": "restart",
        "message": told,
    }  # fmt: skip
    code, out, _ = run_cli(capsys, "describe", "idle", "--state-dir", str(state))
    assert not [line for line in out.splitlines() if line.startswith("Last resize")]
    code, out, _ = run_cli(capsys, "get", "idle", "-o", "json", "--state-dir", str(state))
    assert "lastResize" not in json.loads(out)["status"]


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
        (["get", "-l", "team=a b"], "argument -l/--selector: 'team=a b': 'a b' is not a label"),
        (["get", "-l", "team in (a"], "argument -l/--selector: 'team in (a': '(' without ')'"),
        (["logs", "x", "--tail", "-1"], "argument --tail: must not be negative, got -1"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    err = cli_usage_error(capsys, *argv)
    assert f"error: {message}" in err


def test_an_unknown_flag_says_where_the_help_of_its_command_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = cli_usage_error(capsys, "get", "--bogus")
    assert err == "error: unrecognized arguments: --bogus\nSee 'herd-operator get --help'.\n"
    err = cli_usage_error(capsys, "--bogus", "events")
    assert err.endswith("See 'herd-operator events --help'.\n")


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
        "error: --hosts: 'bad' is not HOSTS:GPUS"
        " (for example localhost:4, nid001:4,nid002:4, 'nid[001-004]:4' or nodeA:a100:4)\n"
        "See 'herd-operator run --help'.\n"
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
    assert idle.split() == ["idle", "Unknown", "2", "2", "-", "0", "-", "-", "5h"]
    assert train.split() == ["train", "Running", "-", "-", "3", "2", "2", "-", "5h"]
    code, out, _ = run_cli(capsys, "get", "train", "-o", "json", "--state-dir", str(state))
    shown = json.loads(out)
    assert shown["spec"] is None
    assert "the stored spec of job 'train'" in shown["status"]["specError"]
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


def test_agent_key_prints_the_hosts_key_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from herd_operator.auth import agent_key, ensure_token_file

    state = tmp_path / "state"
    code, out, err = run_cli(capsys, "agent-key", "--state-dir", str(state), "--host", "nid001")
    assert code == 1 and out == ""
    assert err.startswith("herd-operator agent-key: cannot open token file ")
    master = ensure_token_file(StateLayout(state).token_file)
    code, out, err = run_cli(capsys, "agent-key", "--state-dir", str(state), "--host", "a b")
    assert (code, out) == (1, "")
    assert "--host 'a b': not a host name (letters, digits" in err
    code, out, err = run_cli(capsys, "agent-key", "--state-dir", str(state), "--host", "nid001")
    assert (code, out, err) == (0, agent_key(master, "nid001").hex() + "\n", "")
