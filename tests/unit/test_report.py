"""`herd-operator report`: series extracted from the store, the PNG, the text summary, errors."""

from __future__ import annotations

import math
import shutil
import sqlite3
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.cli import main
from herd_operator.cli.report.command import ReportError, output_format
from herd_operator.cli.report.figure import figure_title
from herd_operator.cli.report.figure_data import (
    grant_steps,
    label_lifts,
    resize_label,
    resize_seconds,
    threshold_lines,
    time_unit,
    world_size_steps,
)
from herd_operator.cli.report.series import GrantStep, JobSeries, job_sources, load_run
from herd_operator.cli.report.text import format_duration
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.runtime.store.history import GRANT_ROW_PROBLEMS, checked_grant_changes
from herd_operator.specs import (
    ConditionStatus,
    ConditionType,
    HerdJob,
    set_condition,
    spec_fingerprint,
)
from herd_operator.specs.models import is_job_name
from herd_operator.specs.status import HerdJobStatus

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
T0 = 1_700_000_000.0  # 2023-11-14 22:13:20 UTC
GIB = 1 << 30


def spec_json(name: str, low: int, high: int, policy: str = "") -> str:
    text = (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
        f"metadata:\n  name: {name}\n"
        f"spec:\n  command: [python, train.py]\n  gpus:\n    min: {low}\n    max: {high}\n"
        f"{policy}"
    )
    return HerdJob.model_validate(yaml.safe_load(text)).model_dump_json(by_alias=True)


def add_job(store: Store, name: str, spec: str, created: float, condition: str, at: float) -> None:
    job = HerdJob.model_validate_json(spec)
    store.record_spec(name, f"jobs/{name}.yaml", job, spec_fingerprint(job), created)
    conditions = set_condition((), condition, ConditionStatus.TRUE, condition, "", 1, at)
    status = HerdJobStatus(observed_generation=1, conditions=conditions)
    store.put_status(name, status, at)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return two_jobs(tmp_path / "state")


def two_jobs(directory: Path) -> Path:
    """Two jobs: `alpha` (memory policy) shrinks 4->2 and ends; `beta` waits, then runs on 2."""
    memory = "  policy:\n    name: memory\n    params: {low: 0.3, high: 0.8}\n"
    with Store(StateLayout(directory).database) as store:
        add_job(
            store, "alpha", spec_json("alpha", 1, 4, memory), T0, ConditionType.Succeeded, T0 + 300
        )
        add_job(store, "beta", spec_json("beta", 2, 2), T0 + 5, ConditionType.Running, T0 + 400)
        store.add_grant_change("alpha", 4, "admitted", T0 + 10)
        store.add_report("alpha", None, 4, 0, {}, T0 + 20)
        store.add_report("alpha", 0, 4, 0, {"loss": 1.0}, T0 + 70)
        store.add_report("alpha", 0, 4, 1, {"loss": 1.0}, T0 + 71)
        store.add_report("alpha", 1, 4, 0, {}, T0 + 120)
        store.add_grant_change("alpha", 2, "memory 0.12 < 0.3: 4 -> 2", T0 + 130)
        store.add_grant_change("beta", 2, "admitted", T0 + 130)
        store.add_report("alpha", None, 2, 0, {}, T0 + 140)
        store.add_report("alpha", 2, 2, 0, {}, T0 + 200)
        store.add_grant_change("alpha", 0, "finished", T0 + 300)
        store.add_usage("alpha", 4, GIB, 8 * GIB, T0 + 30)
        store.add_usage("alpha", 2, 2 * GIB, 4 * GIB, T0 + 150)
        store.add_usage("beta", 2, 3 * GIB, 4 * GIB, T0 + 200)
        store.add_usage("beta", 2, 0, 0, T0 + 210)  # a GPU reporting no memory: skipped
    return directory


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def read_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    length, kind = struct.unpack(">I4s", data[8:16])
    assert (length, kind) == (13, b"IHDR")
    assert zlib.crc32(data[12:29]) == struct.unpack(">I", data[29:33])[0]
    assert data.endswith(b"IEND\xaeB`\x82")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


# ---- extraction ----


def test_load_run_extracts_exact_series(state_dir: Path) -> None:
    with Store.open_readonly(StateLayout(state_dir).database) as store:
        run = load_run(store, state_dir, job_sources(store), since=None)
    assert (run.origin, run.end) == (T0, 400.0)
    alpha, beta = run.jobs
    assert (alpha.name, alpha.status, alpha.policy, alpha.created) == (
        "alpha",
        "Succeeded",
        "memory",
        0.0,
    )
    assert alpha.grants == (
        GrantStep(10.0, 0, 4, "admitted"),
        GrantStep(130.0, 4, 2, "memory 0.12 < 0.3: 4 -> 2"),
        GrantStep(300.0, 2, 0, "finished"),
    )
    assert alpha.world_sizes == ((20.0, 4), (140.0, 2))
    assert alpha.epoch_ends == ((70.0, 0), (120.0, 1), (200.0, 2))
    assert alpha.memory == ((30.0, 0.125), (150.0, 0.5))
    assert alpha.thresholds == (0.3, 0.8)
    assert (beta.status, beta.policy, beta.created, beta.initial_gpus) == (
        "Running",
        "static",
        5.0,
        0,
    )
    assert beta.grants == (GrantStep(130.0, 0, 2, "admitted"),)
    assert beta.memory == ((200.0, 0.75),)
    assert (beta.thresholds, beta.world_sizes, beta.epoch_ends) == (None, (), ())


def test_load_run_since_starts_at_the_window_with_the_grant_then_in_force(state_dir: Path) -> None:
    with Store.open_readonly(StateLayout(state_dir).database) as store:
        run = load_run(store, state_dir, job_sources(store), since=T0 + 135)
    assert (run.origin, run.end) == (T0 + 135, 265.0)
    alpha, beta = run.jobs
    assert (alpha.initial_gpus, alpha.grants) == (2, (GrantStep(165.0, 2, 0, "finished"),))
    assert alpha.world_sizes == ((5.0, 2),)
    assert alpha.epoch_ends == ((65.0, 2),)
    assert alpha.memory == ((15.0, 0.5),)
    assert (beta.initial_gpus, beta.grants, beta.created) == (2, (), -130.0)
    assert beta.pending_seconds(run.end) == 0.0
    assert beta.gpu_seconds(run.end) == 2 * 265.0


def test_memory_thresholds_default_to_the_policy_defaults(tmp_path: Path) -> None:
    refused = "  policy:\n    name: memory\n    params: {low: 0.9, high: 0.1}\n"
    with Store(tmp_path / "state.db") as store:
        add_job(
            store,
            "plain",
            spec_json("plain", 1, 2, "  policy:\n    name: memory\n"),
            T0,
            ConditionType.Running,
            T0,
        )
        # Parameters the policy refuses (the reconciler reports them): no threshold lines.
        add_job(
            store, "refused", spec_json("refused", 1, 2, refused), T0, ConditionType.Running, T0
        )
        run = load_run(store, tmp_path, job_sources(store), since=None)
    assert {job.name: job.thresholds for job in run.jobs} == {
        "plain": (0.25, 0.75),
        "refused": None,
    }


# ---- pure helpers ----


def series(**changes: object) -> JobSeries:
    base: dict[str, object] = dict(
        name="j",
        status="Running",
        policy="static",
        min_gpus=1,
        max_gpus=4,
        created=0.0,
        initial_gpus=0,
        grants=(),
        world_sizes=(),
        epoch_ends=(),
        memory=(),
        thresholds=None,
    )
    base.update(changes)
    return JobSeries(**base)  # type: ignore[arg-type]


def test_grant_and_world_size_steps_hold_the_last_value() -> None:
    job = series(
        grants=(GrantStep(10, 0, 4, "a"), GrantStep(50, 4, 2, "b"), GrantStep(90, 2, 0, "c")),
        world_sizes=((12.0, 4), (55.0, 2)),
    )
    # From creation (pending at 0) to the release: nothing drawn after the job let go.
    assert grant_steps(job, 100.0) == ([0.0, 10, 50, 90], [0, 4, 2, 0])
    admitted_before_window = series(
        created=-30.0, initial_gpus=2, grants=(GrantStep(50, 2, 3, "a"),)
    )
    assert grant_steps(admitted_before_window, 100.0) == ([0.0, 50, 100.0], [2, 3, 3])
    assert grant_steps(series(created=40.0), 100.0) == ([40.0, 100.0], [0, 0])
    # The workers' size ends where the grant went to 0, not at the end of the run.
    assert world_size_steps(job, 100.0) == ([12.0, 55.0, 90], [4, 2, 2])
    running = series(world_sizes=((12.0, 4),))
    assert world_size_steps(running, 100.0) == ([12.0, 100.0], [4, 4])
    assert world_size_steps(series(), 100.0) == ([], [])


def test_a_resize_is_labelled_with_what_it_cost_when_the_reports_say_it() -> None:
    """The figure's resize marks say what each cost: from the grant change to the first
    report of the new size, before the grant changed again (the ResizeCompleted measure)."""
    never = GrantStep(30, 2, 3, "a")
    grow, shrink, back = (
        GrantStep(50, 3, 4, "b"),
        GrantStep(90, 4, 2, "c"),
        GrantStep(95, 2, 4, "d"),
    )
    job = series(
        grants=(GrantStep(10, 0, 2, "s"), never, grow, shrink, back),
        world_sizes=((12.0, 2), (65.5, 4), (99.0, 2)),
    )
    assert resize_seconds(job, grow) == 15.5
    assert resize_label(job, grow) == "3->4 16s"
    assert (resize_seconds(job, never), resize_label(job, never)) == (None, "2->3")
    assert resize_seconds(job, shrink) is None  # its 2 came after the grant changed again
    assert resize_label(series(grants=(grow,)), grow) == "3->4"  # a script that never reports


def test_gpu_seconds_pending_and_resizes() -> None:
    job = series(
        created=4.0,
        grants=(GrantStep(10, 0, 4, "a"), GrantStep(50, 4, 2, "b"), GrantStep(90, 2, 0, "c")),
    )
    assert job.gpu_seconds(100.0) == 4 * 40 + 2 * 40
    assert job.pending_seconds(100.0) == 6.0
    assert job.resizes() == 1
    never_admitted = series(created=30.0)
    assert (never_admitted.pending_seconds(100.0), never_admitted.gpu_seconds(100.0)) == (70.0, 0.0)


def test_label_lifts_stack_labels_that_would_overlap() -> None:
    points = [(10.0, 2), (11.0, 2), (11.5, 2), (11.5, 3), (30.0, 2), (12.0, 2)]
    assert label_lifts(points, near=5.0) == [0, 1, 2, 0, 0, 3]


def test_threshold_lines_are_shared_between_jobs() -> None:
    jobs = [
        series(name="a", thresholds=(0.25, 0.75)),
        series(name="b"),
        series(name="c", thresholds=(0.25, 0.6)),
    ]
    assert threshold_lines(jobs) == {0.25: ["a", "c"], 0.6: ["c"], 0.75: ["a"]}


@pytest.mark.parametrize(
    ("span", "expected"),
    [(600.0, (1.0, "seconds")), (601.0, (60.0, "minutes")), (4 * 3600.0, (3600.0, "hours"))],
)
def test_time_unit(span: float, expected: tuple[float, str]) -> None:
    assert time_unit(span) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.4, "0s"), (59.0, "59s"), (125.0, "2m05s"), (3599.0, "59m59s"), (3 * 3600 + 150, "3h02m")],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected


@pytest.mark.parametrize(
    ("requested", "output", "expected"),
    [
        (None, None, "png"),
        (None, "t.png", "png"),
        (None, "s.TXT", "text"),
        (None, "s.md", "markdown"),
        ("text", None, "text"),
        ("text", "s.md", "markdown"),
        (None, "t.svg", "svg"),
        (None, "t.PDF", "pdf"),
        (None, "timeline", "png"),
        ("pdf", None, "pdf"),
        ("svg", "t.svg", "svg"),
    ],
)
def test_output_format(requested: str | None, output: str | None, expected: str) -> None:
    assert output_format(requested, None if output is None else Path(output)) == expected


@pytest.mark.parametrize(
    ("requested", "output"),
    [("png", "s.txt"), ("png", "t.pdf"), ("text", "t.svg"), (None, "t.jpg"), ("pdf", "t.eps")],
)
def test_output_format_refuses_a_suffix_that_says_otherwise(
    requested: str | None, output: str
) -> None:
    # Writing PNG bytes into a file named .pdf (the old behaviour) helps no one.
    with pytest.raises(ReportError) as caught:
        output_format(requested, Path(output))
    assert caught.value.exit_code == EXIT_USAGE
    assert output in str(caught.value)


# ---- the command ----


def test_report_draws_a_png(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "timeline.png"
    code, out, err = run_cli(
        capsys, "report", "--state-dir", str(state_dir), "--output", str(output)
    )
    assert (code, out) == (EXIT_OK, "")
    assert read_png(output) == (1200, 1350)
    assert err.splitlines() == [
        "report: reading 2 jobs...",
        "report: drawing...",
        f"report: wrote {output} (1200x1350 px)",
    ]
    assert output.stat().st_size > 20_000  # lines and text, not a blank canvas


def test_report_defaults_to_timeline_png_in_the_working_directory(
    state_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--jobs", "beta")
    assert code == EXIT_OK
    assert err.splitlines()[0] == "report: reading 1 job..."
    assert read_png(tmp_path / "timeline.png") == (1200, 1350)


def test_report_draws_an_empty_window(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "recent.png"
    code, _, _ = run_cli(
        capsys, "report", "--state-dir", str(state_dir), "--since", "60", "--output", str(output)
    )
    assert code == EXIT_OK
    assert read_png(output) == (1200, 1350)


TEXT_SUMMARY = """\
Run in {state}: 2 jobs, 6m40s from 2023-11-14 22:13:20 UTC

JOB     STATUS      POLICY   GPUS   GPU-SECONDS   EPOCHS   RESIZES   PENDING
alpha   Succeeded   memory   1-4    820           3        1         10s
beta    Running     static   2-2    540           0        0         2m05s

Grant changes:
  TIME    JOB     GPUS   REASON
  10s     alpha   0->4   admitted
  2m10s   alpha   4->2   memory 0.12 < 0.3: 4 -> 2
  2m10s   beta    0->2   admitted
  5m00s   alpha   2->0   finished
"""


def test_report_text_summary_on_stdout(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--format", "text")
    assert (code, err) == (EXIT_OK, "report: reading 2 jobs...\n")
    assert out == TEXT_SUMMARY.format(state=state_dir)


BAD_GRANT_ROWS = [
    (None, T0 + 50, 1, "x"),  # no job
    ("../x", T0 + 50, 1, "x"),  # not a job's name
    ("alpha", None, 1, "x"),
    ("alpha", "soon", 1, "x"),
    ("alpha", -5.0, 1, "x"),  # before 1970: a negative span from the run's start
    ("alpha", float("inf"), 1, "x"),
    ("alpha", T0 + 50, None, "x"),
    ("alpha", T0 + 50, "many", "x"),
    ("alpha", T0 + 50, -2, "x"),
    ("alpha", T0 + 50, 2.5, "x"),
    ("alpha", T0 + 50, 1, None),
    ("alpha", T0 + 200, 1, "late"),  # logged after the change at T0 + 300: time ran back
]


def test_report_skips_bad_grant_history_rows_and_says_how_many_once(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rows are written with sqlite3 into a table without the NOT NULL constraints (a
    store from another program, or mended by hand); the rest of the report is as without
    them."""
    raw = sqlite3.connect(StateLayout(state_dir).database)
    raw.executescript(
        "ALTER TABLE grant_history RENAME TO kept;"
        "CREATE TABLE grant_history (id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT,"
        " time REAL, gpus INTEGER, reason TEXT);"
        "INSERT INTO grant_history SELECT * FROM kept; DROP TABLE kept;"
    )
    raw.executemany(
        "INSERT INTO grant_history (job, time, gpus, reason) VALUES (?, ?, ?, ?)", BAD_GRANT_ROWS
    )
    raw.commit()
    raw.close()
    code, out, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--format", "text")
    assert code == EXIT_OK, err
    assert out == TEXT_SUMMARY.format(state=state_dir)
    database = StateLayout(state_dir).database
    assert err.splitlines() == [
        f"report: skipped 12 bad rows of grant_history in {database}: 2 not a job's name,"
        " 4 time not a number >= 0, 4 gpus not an integer >= 0, 1 reason not text,"
        " 1 time before the job's previous change",
        "report: reading 2 jobs...",
    ]
    code, out, err = run_cli(capsys, "describe", "alpha", "--state-dir", str(state_dir))
    assert (code, err) == (EXIT_OK, "")


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(["alpha", "beta", "../x", ""]),
    st.binary(max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_ANY_VALUE, _ANY_VALUE, _ANY_VALUE, _ANY_VALUE), max_size=30))
def test_any_grant_rows_read_into_changes_a_report_can_add_up(
    rows: list[tuple[object, object, object, object]],
) -> None:
    history = checked_grant_changes(rows)
    assert len(history.changes) + sum(history.skipped.values()) == len(rows)
    assert set(history.skipped) <= set(GRANT_ROW_PROBLEMS)
    latest: dict[str, float] = {}
    for change in history.changes:
        assert is_job_name(change.job) and isinstance(change.reason, str)
        assert math.isfinite(change.time) and change.time >= latest.get(change.job, 0.0)
        assert type(change.gpus) is int and change.gpus >= 0
        latest[change.job] = change.time


def test_report_markdown_file_for_one_job(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "summary.md"
    code, out, err = run_cli(
        capsys, "report", "--state-dir", str(state_dir), "--jobs", "beta", "--output", str(output)
    )
    assert (code, out) == (EXIT_OK, "")
    assert err.splitlines() == ["report: reading 1 job...", f"report: wrote {output}"]
    assert output.read_text() == (
        "# herd-operator report\n\n"
        f"Run in {state_dir}: 1 job, 6m35s from 2023-11-14 22:13:25 UTC\n\n"
        "| JOB | STATUS | POLICY | GPUS | GPU-SECONDS | EPOCHS | RESIZES | PENDING |\n"
        "|---|---|---|---|---|---|---|---|\n"
        "| beta | Running | static | 2-2 | 540 | 0 | 0 | 2m05s |\n\n"
        "## Grant changes\n\n"
        "| TIME | JOB | GPUS | REASON |\n"
        "|---|---|---|---|\n"
        "| 2m05s | beta | 0->2 | admitted |\n"
    )


def test_report_text_file_without_grant_changes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state, output = tmp_path / "state", tmp_path / "summary.txt"
    with Store(StateLayout(state).database) as store:
        add_job(store, "solo", spec_json("solo", 1, 1), T0, ConditionType.Running, T0 + 30)
    code, out, _ = run_cli(capsys, "report", "--state-dir", str(state), "--output", str(output))
    assert (code, out) == (EXIT_OK, "")
    assert output.read_text() == (
        f"Run in {state}: 1 job, 30s from 2023-11-14 22:13:20 UTC\n\n"
        "JOB    STATUS    POLICY   GPUS   GPU-SECONDS   EPOCHS   RESIZES   PENDING\n"
        "solo   Running   static   1-1    0             0        0         30s\n\n"
        "Grant changes: none\n"
    )


# ---- errors ----


def test_missing_state_dir_exits_1_with_the_open_store_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    code, out, err = run_cli(capsys, "report", "--state-dir", str(missing))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == (
        f"herd-operator: no operator state in {missing} (run `herd-operator run --state-dir"
        f" {missing}` first, or pass the --state-dir it used)\n"
    )


def test_no_jobs_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    Store(StateLayout(state).database).close()
    code, out, err = run_cli(capsys, "report", "--state-dir", str(state))
    assert (code, out, err) == (EXIT_FAILURE, "", f"herd-operator: nothing to report in {state}\n")


def test_unknown_job_exits_2_naming_it(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "report", "--state-dir", str(state_dir), "--jobs", "beta,gamma"
    )
    assert (code, out) == (EXIT_USAGE, "")
    assert err == (
        f"error: --jobs: no such job in {state_dir}: 'gamma' (jobs there: alpha, beta)\n"
        "See 'herd-operator report --help'.\n"
    )


def test_jobs_without_names_exits_2(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--jobs", " , ")
    assert (code, err) == (
        EXIT_USAGE,
        "error: --jobs: no job names in ' , '\nSee 'herd-operator report --help'.\n",
    )


def test_unwritable_output_exits_1(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "no" / "such" / "dir" / "t.png"
    code, _, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--output", str(output))
    assert code == EXIT_FAILURE
    assert err.splitlines()[-1].startswith("herd-operator: cannot write the report: ")
    assert str(output.parent) in err


def test_without_matplotlib_the_png_is_refused_and_text_still_works(
    state_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    output = tmp_path / "t.png"
    code, _, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--output", str(output))
    assert code == EXIT_FAILURE
    assert err.splitlines()[-1].startswith("herd-operator: drawing needs matplotlib (")
    assert err.endswith("): pip install 'herd-operator[report]', or use --format text\n")
    assert not output.exists()
    code, out, _ = run_cli(capsys, "report", "--state-dir", str(state_dir), "--format", "text")
    assert (code, out.splitlines()[0]) == (
        EXIT_OK,
        f"Run in {state_dir}: 2 jobs, 6m40s from 2023-11-14 22:13:20 UTC",
    )


# ---- figure formats ----

MAGIC = {"png": b"\x89PNG\r\n\x1a\n", "pdf": b"%PDF-", "svg": b"<?xml"}


@pytest.mark.parametrize("kind", ["png", "svg", "pdf"])
def test_the_output_suffix_picks_the_file_format(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    output = tmp_path / f"timeline.{kind}"
    code, _, err = run_cli(capsys, "report", "--state-dir", str(state_dir), "--output", str(output))
    assert code == EXIT_OK, err
    data = output.read_bytes()
    assert data.startswith(MAGIC[kind])
    if kind == "svg":
        assert b"<svg" in data[:1000] and data.rstrip().endswith(b"</svg>")
    if kind == "pdf":
        assert data.rstrip().endswith(b"%%EOF")
    assert err.splitlines()[-1].startswith(f"report: wrote {output} (")


def test_the_pdf_renders(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """poppler's pdftoppm (Debian's poppler-utils, installed by scripts/bootstrap.sh) draws
    the PDF's page: a page of the figure's size that is not blank."""
    pdftoppm = shutil.which("pdftoppm")
    if pdftoppm is None:
        pytest.skip("pdftoppm is not installed (apt-get install poppler-utils)")
    output = tmp_path / "timeline.pdf"
    code, _, _ = run_cli(capsys, "report", "--state-dir", str(state_dir), "--output", str(output))
    assert code == EXIT_OK
    subprocess.run(
        [pdftoppm, "-png", "-r", "50", "-singlefile", str(output), str(tmp_path / "page")],
        check=True,
        capture_output=True,
        timeout=60,
    )
    # The figure is 8x9 in: 400x450 px at 50 dpi.
    assert read_png(tmp_path / "page.png") == (400, 450)
    assert (tmp_path / "page.png").stat().st_size > 10_000  # lines and text, not a blank page


def test_dpi_sets_the_png_resolution(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    output = tmp_path / "print.png"
    code, _, _ = run_cli(
        capsys, "report", "--state-dir", str(state_dir), "--output", str(output), "--dpi", "300"
    )
    assert code == EXIT_OK
    assert read_png(output) == (2400, 2700)


@pytest.mark.parametrize("dpi", ["0", "5000", "high"])
def test_a_dpi_out_of_range_is_a_usage_error(
    state_dir: Path, capsys: pytest.CaptureFixture[str], dpi: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["report", "--state-dir", str(state_dir), "--dpi", dpi])
    assert exited.value.code == EXIT_USAGE
    assert "--dpi" in capsys.readouterr().err


def test_the_figure_title_names_the_run_not_its_directory(state_dir: Path) -> None:
    with Store.open_readonly(StateLayout(state_dir).database) as store:
        run = load_run(store, state_dir, job_sources(store), since=None)
    title = figure_title(run)
    assert str(state_dir) not in title and "/" not in title
    # No pool size in this store: the most GPUs held at once stands in, and says so.
    assert title == (
        "herd-operator run of 2023-11-14 22:13 UTC: 2 jobs on 4 GPUs (most held at once), 6m40s"
    )


@pytest.mark.parametrize("kind", ["svg", "pdf"])
def test_the_same_run_gives_the_same_file(
    state_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    """A thesis that includes the figure rebuilds unchanged (no dates, no random ids)."""
    first, second = tmp_path / f"first.{kind}", tmp_path / f"second.{kind}"
    for output in (first, second):
        assert main(["report", "--state-dir", str(state_dir), "--output", str(output)]) == 0
    assert first.read_bytes() == second.read_bytes()
