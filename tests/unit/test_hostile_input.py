"""Hostile or broken input ends a command with one line naming the file, never a traceback
(issue 27.8): a bad `allocator.token`, a job name that would leave the logs directory, an
overlong name, and a state directory that is missing, damaged or a file."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.auth import TokenFileError, read_token_file
from herd_operator.cli.views import format_events, format_table
from herd_operator.layout import StateLayout
from herd_operator.runtime.launch_records import LaunchRecords
from herd_operator.runtime.specdir import SpecDirectory, with_known_references
from herd_operator.runtime.store import Event, Store
from herd_operator.specs import load_spec_text
from herd_operator.specs.models import is_job_name
from tests.unit.test_cli import EXIT_FAILURE, EXIT_USAGE, make_job, record, run_cli
from tests.unit.test_specdir import spec_text, write
from tests.unit.test_store import corrupt_a_table_page

GOOD_TOKEN = "ab" * 32
OTHER_UID = 65534  # nobody


def error_lines(err: str) -> list[str]:
    """What a command said besides the operator's log lines (which start with a time)."""
    return [line for line in err.splitlines() if not line[:2].isdigit()]


def assert_one_line(err: str, *parts: str) -> str:
    lines = error_lines(err)
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


# ---- the operator's token file ----


@pytest.fixture
def started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]]:
    """`herd-operator run` in this process, told to stop as soon as it has started (a good
    token starts it, and it ends at once), on a state dir of the test's."""
    stop = threading.Event()
    stop.set()
    monkeypatch.setattr("herd_operator.cli.run.stop_on_signals", lambda: stop)
    monkeypatch.setattr("herd_operator.runtime.operator.tune_gc", lambda: None)
    (tmp_path / "jobs").mkdir()

    def run(capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        return run_cli(
            capsys, "run", "--hosts", "localhost:1", "--virtual-gpus", "1",
            "--specs-dir", str(tmp_path / "jobs"), "--state-dir", str(tmp_path / "state"),
            "--runtime-dir", str(tmp_path / "runtime"), "--port", "0", "--metrics-port", "0",
            "--no-watch", "--log-level", "ERROR",
        )  # fmt: skip

    return run


def token_file(tmp_path: Path, content: bytes, mode: int = 0o600) -> Path:
    path = StateLayout(tmp_path / "state").token_file
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize(
    ("content", "mode", "problem"),
    [
        (b"", 0o600, "is empty"),
        (b"\x00\xff\xfe\x80" * 16 + b"\n", 0o600, "expected 64 hex characters"),
        (b"ab" * 16 + b"\n", 0o600, "too short"),
        # Two lines that together are 64 hex characters: read as one token before.
        (GOOD_TOKEN[:32].encode() + b"\n" + GOOD_TOKEN[32:].encode() + b"\n", 0o600, "2 lines"),
        (GOOD_TOKEN.encode() + b"\n" + b"cd" * 32 + b"\n", 0o600, "2 lines"),
        (b"ab " * 32 + b"\n", 0o600, "expected 64 hex characters"),
        (GOOD_TOKEN.encode() + b"\n", 0o644, "chmod 600"),
    ],
    ids=["empty", "binary", "short", "split", "two-tokens", "spaced", "0644"],
)
def test_run_refuses_a_bad_token_file_with_one_line_and_exit_2(
    tmp_path: Path,
    started: Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]],
    capsys: pytest.CaptureFixture[str],
    content: bytes,
    mode: int,
    problem: str,
) -> None:
    path = token_file(tmp_path, content, mode)
    code, out, err = started(capsys)
    assert (code, out) == (EXIT_USAGE, "")
    line = assert_one_line(err, f"herd-operator: token file {path}", problem)
    if mode == 0o600:  # what to do about a damaged one
        assert "remove it" in line
    for secret in {GOOD_TOKEN[:16], GOOD_TOKEN[32:48], "cd" * 8}:
        assert secret not in err
    assert path.read_bytes() == content  # not replaced behind the user's back


def test_run_refuses_a_token_file_of_another_user(
    tmp_path: Path,
    started: Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    path = token_file(tmp_path, GOOD_TOKEN.encode() + b"\n")
    os.chown(path, OTHER_UID, OTHER_UID)
    code, out, err = started(capsys)
    assert (code, out) == (EXIT_USAGE, "")
    assert_one_line(err, f"herd-operator: token file {path}", f"owned by uid {OTHER_UID}")
    assert GOOD_TOKEN[:16] not in err


def test_run_refuses_a_directory_where_the_token_file_is_due(
    tmp_path: Path,
    started: Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = StateLayout(tmp_path / "state").token_file
    path.mkdir(mode=0o700, parents=True)
    code, out, err = started(capsys)
    assert (code, out) == (EXIT_USAGE, "")
    assert_one_line(err, f"herd-operator: token file {path}", "not a regular file (directory)")


def test_run_with_a_good_token_starts_and_keeps_it(
    tmp_path: Path,
    started: Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The bad files above are refused, not this one: the start ends only by its stop."""
    path = token_file(tmp_path, GOOD_TOKEN.encode() + b"\n")
    code, _, err = started(capsys)
    assert code == 0, err
    assert path.read_text() == GOOD_TOKEN + "\n"


@pytest.mark.parametrize(
    "content", [b"", b"\x00\xff" * 40, GOOD_TOKEN[:32].encode() + b"\n" + GOOD_TOKEN[32:].encode()]
)
def test_agent_key_refuses_a_bad_master_token_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes
) -> None:
    """The CLI's other reader of the operator's token. (The readers of the keys derived from
    it: the shim says one line, test_worker_api; a worker's report logs one warning; the
    node exporter logs one and serves without job labels.)"""
    path = token_file(tmp_path, content)
    code, out, err = run_cli(
        capsys, "agent-key", "--state-dir", str(tmp_path / "state"), "--host", "nid001"
    )
    assert (code, out) == (EXIT_FAILURE, "")
    assert_one_line(err, f"herd-operator agent-key: token file {path}")
    assert GOOD_TOKEN[:16] not in err and GOOD_TOKEN[32:48] not in err


# ---- paths built from a job's name ----


def _path_builders(root: Path) -> list[Callable[[str], Path]]:
    layout = StateLayout(root, root / "runtime")
    records = LaunchRecords(layout.launches_dir)
    return [
        layout.log_file,
        layout.grant_file,
        layout.discovery_script,
        layout.job_token_file,
        layout.job_env_file,
        records.record_file,
        lambda job: records.exit_file(job, "0123abcd"),
    ]


NOT_NAMES = ["../x", "a/../../b", "/etc/passwd", "..", ".", "", "A", "a" * 64, "a\nb", "a.b"]


@pytest.mark.parametrize("name", NOT_NAMES)
def test_no_path_is_built_from_a_name_that_is_not_a_job_name(tmp_path: Path, name: str) -> None:
    for build in _path_builders(tmp_path):
        with pytest.raises(ValueError, match="is not a job name"):
            build(name)


def test_paths_of_job_names_stay_in_their_directories(tmp_path: Path) -> None:
    for build in _path_builders(tmp_path):
        for name in ("a", "job-1", "a" * 63):
            path = build(name)
            assert path.name.startswith((name, f"job-{name}")), path


@settings(max_examples=300, deadline=None)
@given(name=st.text(max_size=80) | st.from_regex(r"[a-z0-9./-]{1,70}", fullmatch=True))
def test_any_name_gives_a_path_in_its_directory_or_is_refused(name: str) -> None:
    """The fuzz that would have found `logs ../x`: every path builder, every name."""
    root = Path("/state")
    for build in _path_builders(root):
        try:
            path = build(name)
        except ValueError as err:
            assert not is_job_name(name)
            assert "is not a job name" in str(err) and len(str(err)) < 300
            continue
        assert is_job_name(name)
        assert path.parent in {root / "logs", root / "runtime" / "grants", root / "secrets",
                               root / "launches"}  # fmt: skip
        assert ".." not in path.parts


@settings(max_examples=300, deadline=None)
@given(
    content=st.binary(max_size=200)
    | st.from_regex(rb"\s*[0-9a-fA-F \n]{0,140}\s*")
    | st.builds(  # a token with a blank or a line break inside
        lambda token, at, blank: token[:at] + blank + token[at:],
        st.binary(min_size=32, max_size=32).map(lambda raw: raw.hex().encode()),
        st.integers(min_value=1, max_value=63),
        st.sampled_from([b"\n", b" ", b"\t", b"\r\n", b"\n\n"]),
    )
)
def test_any_token_file_is_a_token_of_one_line_or_refused_without_its_content(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    path = tmp_path_factory.mktemp("token") / "allocator.token"
    path.write_bytes(content)
    path.chmod(0o600)
    try:
        token = read_token_file(path)
    except TokenFileError as err:
        hex_runs = re.findall(rb"[0-9a-fA-F]{12,}", content)
        assert all(run.decode() not in str(err).replace(str(path), "") for run in hex_runs)
        return
    assert re.fullmatch(rb"[0-9a-fA-F]{64}", content.strip()) is not None
    assert token == bytes.fromhex(content.strip().decode())


@pytest.fixture
def state_with_job(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    with Store(StateLayout(state).database) as store:
        record(store, make_job("x", 1, 2), time.time())
    return state


@pytest.mark.parametrize("name", ["../x", "../../etc/passwd", "/etc/passwd", "A", "a" * 64])
def test_logs_refuses_a_name_that_is_not_a_job_name(
    state_with_job: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    (state_with_job / "x.log").write_text("not the logs directory's\n")  # where ../x led
    code, out, err = run_cli(capsys, "logs", name, "--state-dir", str(state_with_job))
    assert (code, out) == (EXIT_USAGE, "")
    assert_one_line(err, "herd-operator logs: error: ", "is not a job name")


# ---- overlong names and values ----


def test_a_name_of_5000_characters_names_no_job_and_the_error_says_the_limit() -> None:
    text = (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\n"
        f"metadata:\n  name: {'a' * 5000}\n"
        "spec:\n  command: [python, train.py]\n  gpus: {min: 1, max: 2}\n"
    )
    spec_file = load_spec_text(text, "jobs/long.yaml")
    assert spec_file.name is None  # no job (nor an event, a log line, a key) goes by it
    errors = [(error.field, "at most 63 characters" in error.message) for error in spec_file.errors]
    assert errors == [("metadata.name", True)]
    assert all("a" * 64 not in str(error) for error in spec_file.errors)


def test_a_5000_character_name_in_a_directory_names_no_job_and_keeps_a_running_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A new file with such a name starts nothing and is said once under its path; the
    file of a running job edited to such a name keeps its job (SpecValid=False), as any
    invalid name does."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    specs = SpecDirectory(jobs)
    write(jobs / "a.yaml", spec_text("alpha"))
    assert specs.relist() == {"alpha"}
    with caplog.at_level(logging.WARNING):
        write(jobs / "long.yaml", spec_text("b" * 5000))
        write(jobs / "a.yaml", spec_text("a" * 5000))
        assert specs.relist() == {"alpha"}
        specs.relist()
    view = specs.view("alpha")
    assert view is not None and view.job is None and view.errors
    assert all(len(error) < 300 for error in view.errors), view.errors
    said = [record.getMessage() for record in caplog.records]
    assert [message for message in said if "long.yaml" in message] != []
    assert all("b" * 64 not in message and len(message) < 1000 for message in said), said
    assert len([message for message in said if "long.yaml" in message]) == 1  # said once


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [("policy", "{name: %s}", 253), ("engine", "{kind: %s}", 63)],
)
def test_an_overlong_reference_is_refused_naming_the_field_and_the_limit(
    field: str, value: str, limit: int
) -> None:
    """An unknown policy or engine is named in its error, which events, conditions and log
    lines carry: one of 5,000 characters was, in full."""
    text = (
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata:\n  name: a\n"
        "spec:\n  command: [python, train.py]\n  gpus: {min: 1, max: 2}\n"
        f"  {field}: {value % ('x' * 5000)}\n"
    )
    spec_file = with_known_references(load_spec_text(text, "jobs/a.yaml"))
    assert [str(error) for error in spec_file.errors] == [
        f"jobs/a.yaml: spec.{field}.{'name' if field == 'policy' else 'kind'}:"
        f" String should have at most {limit} characters"
    ]


def test_tables_cut_an_overlong_cell_instead_of_padding_every_row() -> None:
    rows = [["NAME", "REASON", "MESSAGE"], ["a" * 5000, "Why", "m"], ["b", "Why", "x" * 300]]
    lines = format_table(rows).splitlines()
    assert lines[2].index("x") < 100  # not padded to the long cell
    assert lines[1].startswith("a" * 20) and "…" in lines[1]
    assert lines[2].endswith("x" * 300)  # the last column is not padded: kept whole


def test_events_of_an_overlong_job_name_keep_their_rows_short() -> None:
    now = 1_000.0
    events = [
        Event(1, now, "a" * 5000, "Warning", "InvalidSpec", "metadata.name: too long", 1, now),
        Event(2, now, "short", "Normal", "Started", "started", 1, now),
    ]
    lines = format_events(events, now, with_object=True).splitlines()
    assert max(len(line) for line in lines) < 200
    assert "herdjob/short" in lines[2]


# ---- a broken state directory, for every reading command ----


def _missing(state: Path) -> Path:
    return state


def _a_file(state: Path) -> Path:
    state.write_text("")
    return state


def _damaged(state: Path) -> Path:
    state.mkdir()
    StateLayout(state).database.write_bytes(b"not SQLite " * 1000)
    return state


def _empty_store_file(state: Path) -> Path:
    state.mkdir()
    StateLayout(state).database.write_bytes(b"")
    return state


def _store_is_a_directory(state: Path) -> Path:
    StateLayout(state).database.mkdir(parents=True)
    return state


def _corrupt_page(state: Path) -> Path:
    with Store(StateLayout(state).database) as store:
        for index in range(20):
            record(store, make_job(f"job-{index}", 1, 2), time.time())
        record(store, make_job("x", 1, 2), time.time())
    corrupt_a_table_page(StateLayout(state).database)
    return state


def _logs_is_a_file(state: Path) -> Path:
    with Store(StateLayout(state).database) as store:
        record(store, make_job("x", 1, 2), time.time())
    StateLayout(state).logs_dir.write_text("")
    return state


def _log_is_a_directory(state: Path) -> Path:
    with Store(StateLayout(state).database) as store:
        record(store, make_job("x", 1, 2), time.time())
    StateLayout(state).log_file("x").mkdir(parents=True)
    return state


BROKEN_STATES = {
    "missing": (_missing, "no operator state in"),
    "a-file": (_a_file, "not a directory"),
    "damaged": (_damaged, "state.db"),
    "empty-store": (_empty_store_file, "state.db"),
    "store-is-a-directory": (_store_is_a_directory, "state.db"),
    "corrupt-page": (_corrupt_page, "state.db"),
    "logs-is-a-file": (_logs_is_a_file, "logs"),
    "log-is-a-directory": (_log_is_a_directory, "x.log"),
}

READING_COMMANDS = {
    "get": ["get"],
    "get-name": ["get", "x", "-o", "yaml"],
    "describe": ["describe", "x"],
    "events": ["events"],
    "logs": ["logs", "x"],
    "logs-follow": ["logs", "x", "-f", "--timeout", "0.01"],
    "report": ["report", "--format", "text"],
    "check-state": ["check-state"],
    "replay": ["replay", "STATE"],
}
"""Each command's arguments; STATE stands for the state dir where a command takes it as an
argument, else `--state-dir` is added."""


@pytest.mark.parametrize("broken", BROKEN_STATES)
@pytest.mark.parametrize("command", READING_COMMANDS)
def test_reading_commands_on_a_broken_state_dir_say_one_line_naming_the_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], broken: str, command: str
) -> None:
    make, named = BROKEN_STATES[broken]
    state = make(tmp_path / "state")
    argv = [str(state) if arg == "STATE" else arg for arg in READING_COMMANDS[command]]
    if "STATE" not in READING_COMMANDS[command]:
        argv += ["--state-dir", str(state)]
    code, _, err = run_cli(capsys, *argv)
    if code == 0:
        # A damage this command does not read (the logs to `get`, a page of the jobs table
        # to `events`) is not its to report.
        assert "Traceback" not in err
        return
    if command == "replay":  # its own words for a store it cannot use, exit 1 or 2
        assert code in (EXIT_FAILURE, EXIT_USAGE)
        assert_one_line(err, str(state))
        return
    assert code == EXIT_FAILURE
    assert_one_line(err, str(state), named)


def test_run_on_a_state_dir_that_is_a_file_says_so(
    tmp_path: Path,
    started: Callable[[pytest.CaptureFixture[str]], tuple[int, str, str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    state = _a_file(tmp_path / "state")
    code, _, err = started(capsys)
    assert code == EXIT_FAILURE
    assert_one_line(err, f"herd-operator: the state dir {state} is not a directory")
