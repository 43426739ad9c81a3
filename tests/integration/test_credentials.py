"""A real horovodrun job: its spec's env reaches the workers but no command line, and its
processes hold the job's own key, not the operator's master token."""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import psutil

from herd_operator.auth import read_token_file
from tests.integration.harness import OperatorHarness, spec_document

# Hang guard while the job starts; never a performance expectation.
GUARD_S = 120.0
SHOW = (
    "import os, pathlib, time; "
    "pathlib.Path(os.environ['SEEN_FILE']).write_text("
    "os.environ['HERD_TEST_SECRET'] + '\\n' + os.environ['HERD_TOKEN_FILE']); "
    "time.sleep(300)"
)


def _command_lines_with(needles: list[str]) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if any(needle in line for needle in needles):
            found.append(f"{proc.pid}: {line[:300]}")
    return found


def test_spec_env_reaches_the_worker_and_no_command_line(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    marker = f"secret-{secrets.token_hex(8)}"
    seen_file = tmp_path / "seen.txt"
    env = {"HERD_TEST_SECRET": marker, "SEEN_FILE": str(seen_file)}
    herd.write_spec(spec_document("seer", 1, 1, ["python", "-c", SHOW], env=env))
    master = read_token_file(herd.layout.token_file).hex()

    # Every command line on the machine, again and again from the launch until the worker
    # has started and a while after: Horovod's `env K=V ...` lines live only briefly.
    exposed: list[str] = []
    deadline = time.monotonic() + GUARD_S
    while not seen_file.exists() or not seen_file.read_text().count("\n"):
        exposed += _command_lines_with([marker, master])
        assert time.monotonic() < deadline, herd.diagnostics("seer")
    for _ in range(20):
        exposed += _command_lines_with([marker, master])
    assert exposed == []

    value, token_file = seen_file.read_text().split("\n")
    assert value == marker
    assert Path(token_file) == herd.layout.job_token_file("seer").resolve()
    job_key = read_token_file(Path(token_file)).hex()
    assert job_key != master
    assert _command_lines_with([job_key]) == []
