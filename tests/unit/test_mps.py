"""The opt-in MPS control daemon (`run --mps`, issue 30): its command, its directories, its
stop, and a node without MPS. No MPS here: the control binary is a stand-in script that
records how it was called (the real one needs the NVIDIA driver)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from herd_operator.agent.mps import (
    LOG_DIRECTORY_ENV,
    MPS_CONTROL,
    PIPE_DIRECTORY_ENV,
    MpsDaemon,
    MpsError,
    mps_environment,
    start_argv,
)
from herd_operator.cli.main import main

RECORDING_CONTROL = """#!{python}
import json, os, sys
with open({calls!r}, "a") as calls:
    calls.write(json.dumps({{
        "argv": sys.argv[1:],
        "stdin": "" if "-d" in sys.argv else sys.stdin.read(),
        "pipe": os.environ.get("CUDA_MPS_PIPE_DIRECTORY"),
        "log": os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
    }}) + "\\n")
sys.exit(int(os.environ.get("FAKE_MPS_EXIT", "0")))
"""


def stand_in(tmp_path: Path) -> tuple[Path, Path]:
    calls = tmp_path / "calls.jsonl"
    binary = tmp_path / "bin" / MPS_CONTROL
    binary.parent.mkdir()
    binary.write_text(RECORDING_CONTROL.format(python=sys.executable, calls=str(calls)))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary, calls


def test_the_daemon_s_command_and_its_own_directories(tmp_path: Path) -> None:
    assert start_argv("/usr/bin/nvidia-cuda-mps-control") == [
        "/usr/bin/nvidia-cuda-mps-control",
        "-d",
    ]
    assert mps_environment(tmp_path / "mps") == {
        PIPE_DIRECTORY_ENV: str(tmp_path / "mps" / "pipe"),
        LOG_DIRECTORY_ENV: str(tmp_path / "mps" / "log"),
    }


def test_started_in_its_directories_and_quit_at_teardown(tmp_path: Path) -> None:
    binary, calls = stand_in(tmp_path)
    daemon = MpsDaemon(tmp_path / "mps", environ={"PATH": str(binary.parent)})

    daemon.start()
    daemon.stop(timeout=10)
    daemon.stop(timeout=10)  # once only

    pipe, log = str(tmp_path / "mps" / "pipe"), str(tmp_path / "mps" / "log")
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        {"argv": ["-d"], "stdin": "", "pipe": pipe, "log": log},
        {"argv": [], "stdin": "quit\n", "pipe": pipe, "log": log},
    ]
    assert stat.S_IMODE((tmp_path / "mps" / "pipe").stat().st_mode) == 0o700
    assert daemon.environment() == {PIPE_DIRECTORY_ENV: pipe}


def test_a_node_without_mps_says_so(tmp_path: Path) -> None:
    daemon = MpsDaemon(tmp_path / "mps", environ={"PATH": str(tmp_path)})
    with pytest.raises(MpsError, match=f"{MPS_CONTROL} is not on PATH"):
        daemon.start()
    daemon.stop(timeout=1)  # nothing started, nothing to stop


def test_a_daemon_that_fails_to_start_names_its_log(tmp_path: Path) -> None:
    binary, _ = stand_in(tmp_path)
    daemon = MpsDaemon(tmp_path / "mps", environ={"PATH": str(binary.parent), "FAKE_MPS_EXIT": "1"})
    with pytest.raises(MpsError, match=r"-d failed: .*its log: .*mps/log"):
        daemon.start()


def test_run_mps_without_mps_refuses_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code = main(
        [
            "run",
            "--mps",
            "--specs-dir",
            str(tmp_path / "jobs"),
            "--state-dir",
            str(tmp_path / "state"),
            "--virtual-gpus",
            "1",
        ]
    )
    assert code == 1
    assert f"--mps: {MPS_CONTROL} is not on PATH" in capsys.readouterr().err
    assert not (tmp_path / "state" / "state.db").exists()
