"""`herd-operator logs`: tail, follow across truncation and rotation, unknown jobs."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from herd_operator.cli.logs import LogFollower, tail_offset
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.specs import ConditionStatus, ConditionType, set_condition
from herd_operator.specs.status import HerdJobStatus
from tests.unit.test_cli import EXIT_FAILURE, EXIT_OK, make_job, record, run_cli


@pytest.mark.parametrize(
    ("text", "lines", "expected"),
    [
        (b"a\nb\nc\n", 2, b"b\nc\n"),
        (b"a\nb\nc", 2, b"b\nc"),  # a last line without its newline yet counts
        (b"a\nb\nc\n", 3, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 10, b"a\nb\nc\n"),
        (b"a\nb\nc\n", 0, b""),
        (b"", 5, b""),
        (b"\n\n", 1, b"\n"),
    ],
)
def test_tail_offset(text: bytes, lines: int, expected: bytes) -> None:
    handle = io.BytesIO(text)
    assert text[tail_offset(handle, lines) :] == expected


def test_tail_offset_across_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("herd_operator.cli.logs.TAIL_BLOCK_BYTES", 4)
    text = b"".join(f"line {i}\n".encode() for i in range(20))
    assert text[tail_offset(io.BytesIO(text), 3) :] == b"line 17\nline 18\nline 19\n"


class Collect:
    def __init__(self) -> None:
        self.out = b""
        self.notices: list[str] = []

    def write(self, chunk: bytes) -> None:
        self.out += chunk

    def notice(self, text: str) -> None:
        self.notices.append(text)


def test_follower_reads_appends_truncation_and_rotation(tmp_path: Path) -> None:
    path = tmp_path / "job.log"
    seen = Collect()
    follower = LogFollower(path, seen.write, seen.notice)
    follower.pump()  # no file yet: nothing, no error
    path.write_bytes(b"one\n")
    follower.pump()
    with path.open("ab") as log:
        log.write(b"two\n")
    follower.pump()
    assert seen.out == b"one\ntwo\n"

    path.write_bytes(b"")  # truncated (`: > job.log`), then written again
    with path.open("ab") as log:
        log.write(b"3\n")
    follower.pump()
    assert seen.out == b"one\ntwo\n3\n"
    assert seen.notices == [f"{path} was truncated: reading it again from its start"]

    with path.open("ab") as log:
        log.write(b"last of the old file\n")
    os.replace(path, tmp_path / "job.log.1")  # rotated, as logrotate does
    follower.pump()  # renamed away, not created again yet: the old file's end shows
    path.write_bytes(b"first of the new file\n")
    follower.pump()
    follower.close()
    assert seen.out == b"one\ntwo\n3\nlast of the old file\nfirst of the new file\n"
    assert seen.notices[-1] == f"{path} was replaced (rotated): reading the new file"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state_dir = tmp_path / "state"
    with Store(StateLayout(state_dir).database) as store:
        record(store, make_job("train", 1, 2), time.time())
        record(store, make_job("fresh", 1, 2), time.time())
    log = StateLayout(state_dir).log_file("train")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("".join(f"epoch {i}\n" for i in range(5)))
    return state_dir


def test_logs_prints_the_log_or_its_tail(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "logs", "train", "--state-dir", str(state))
    assert (code, err) == (EXIT_OK, "")
    assert out.splitlines() == [f"epoch {i}" for i in range(5)]
    code, out, _ = run_cli(capsys, "logs", "train", "--tail", "2", "--state-dir", str(state))
    assert out.splitlines() == ["epoch 3", "epoch 4"]


def test_logs_of_an_unknown_job_or_one_not_started(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "logs", "ghost", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    assert err == f"herd-operator: no job 'ghost' in {state}\n"
    code, out, err = run_cli(capsys, "logs", "fresh", "--state-dir", str(state))
    assert (code, out) == (EXIT_FAILURE, "")
    log = StateLayout(state).log_file("fresh")
    assert err == f"herd-operator: job 'fresh' has no log yet ({log}): it has not started\n"


def test_logs_follow_ends_when_the_job_ends(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The job succeeded: `-f` prints what is there and returns instead of waiting."""
    with Store(StateLayout(state).database) as store:
        conditions = set_condition(
            (), ConditionType.Succeeded, ConditionStatus.TRUE, "Completed", "", 1, time.time()
        )
        store.put_status("train", HerdJobStatus(conditions=conditions), time.time())
    started = time.monotonic()
    code, out, _ = run_cli(capsys, "logs", "train", "-f", "--state-dir", str(state))
    assert code == EXIT_OK
    assert out.splitlines()[-1] == "epoch 4"
    assert time.monotonic() - started < 5


def test_logs_follow_stops_at_its_timeout(state: Path, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    code, out, _ = run_cli(
        capsys, "logs", "train", "-f", "--timeout", "0.5", "--state-dir", str(state)
    )
    assert code == EXIT_OK
    assert len(out.splitlines()) == 5
    assert 0.5 <= time.monotonic() - started < 5
