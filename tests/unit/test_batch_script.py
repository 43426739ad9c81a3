"""deploy/slurm/herd.sbatch's agent loop, run by bash with stand-ins for Slurm and the CLI.

The script is run as shipped, under its own `set -euo pipefail`, with a PATH that holds
only stand-ins: `scontrol` names one node, `srun` reads the agent's key and fails as a killed
agent's step does (status 137), `sleep` records the delay it was asked for and returns at
once, and `herd-operator run` (the script's last step) returns at once; the agent loops,
left in the background, are then ended with their process group. (The real thing, on a
real Slurm: tests/integration/test_slurm.py.)
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "slurm" / "herd.sbatch"
BASH = shutil.which("bash") or "/bin/bash"
KEY = "ab" * 32


def stand_in(directory: Path, name: str, body: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


@pytest.fixture
def batch(tmp_path: Path) -> Iterator[Path]:
    """The script running on node n1 with stand-ins; yields the state dir."""
    with running_batch(tmp_path, {}) as root:
        yield root


@contextlib.contextmanager
def running_batch(tmp_path: Path, extra: dict[str, str]) -> Iterator[Path]:
    """The script running on node n1 with stand-ins and `extra` in its environment."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (state / "allocator.token").write_text("a master token\n")  # the operator has started
    calls = tmp_path / "calls"
    stand_in(bin_dir, "scontrol", 'echo "$SLURM_JOB_NODELIST"\n')
    stand_in(bin_dir, "srun", f'read key; echo "$key $*" >>{calls}/srun\nexit 137\n')
    stand_in(bin_dir, "sleep", f'echo "$1" >>{calls}/sleep\n')
    herd = bin_dir / "herd-operator"
    stand_in(
        bin_dir,
        "herd-operator",
        f'[ "$1" = agent-key ] && echo {KEY}\n[ "$1" = run ] && echo "$*" >>{calls}/run\nexit 0\n',
    )
    for tool in ("mkdir", "date"):  # and nothing else: no prometheus, whatever is installed
        found = shutil.which(tool)
        assert found is not None, tool
        (bin_dir / tool).symlink_to(found)
    calls.mkdir()
    environ = {
        "PATH": str(bin_dir),
        "SLURM_JOB_NODELIST": "n1",
        "SLURM_JOB_ID": "7",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "HERD": str(herd),
        "HERD_STATE_DIR": str(state),
        "HERD_SPECS_DIR": str(tmp_path / "jobs"),
        **extra,
    }
    process = subprocess.Popen(
        [BASH, str(SCRIPT)], env=environ, cwd=tmp_path, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield tmp_path
    finally:
        # The loops outlive the script's last step (they were its children): end them all.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_for_lines(path: Path, count: int) -> list[str]:
    deadline = time.monotonic() + 30  # generous: 10 quick forks each, on a loaded machine
    while len(found := lines(path)) < count:
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name}: {len(found)} lines after 30 s: {found}")
        time.sleep(0.05)
    return found


def test_an_agent_that_fails_is_started_again_with_a_doubling_bounded_delay(batch: Path) -> None:
    delays = wait_for_lines(batch / "calls" / "sleep", 8)[:8]
    assert delays == ["2", "4", "8", "16", "32", "60", "60", "60"]
    starts = lines(batch / "calls" / "srun")
    assert len(starts) >= 8
    # Each start is one step on its own node, fed that node's key on stdin.
    assert starts[0].split() == [
        KEY, "--overlap", "-N1", "-n1", "-w", "n1", str(batch / "bin" / "herd-operator"),
        "exporter", "--state-dir", str(batch / "state"), "--port", "9411", "--host", "n1",
        "--key-stdin",
    ]  # fmt: skip
    log = lines(batch / "state" / "agents.log")
    assert log, "no line about the agent's end"
    assert re.search(
        r"agent on n1 ended \(status 137\) after [01] s; starting it again in 2 s$", log[0]
    )


def test_the_ports_are_the_sites_to_choose(tmp_path: Path) -> None:
    """A node shared with other users' jobs may have 9411 or 9410 taken: each port comes
    from the environment (`sbatch --export=ALL,HERD_EXPORTER_PORT=...`), the defaults
    otherwise (the test above)."""
    ports = {
        "HERD_EXPORTER_PORT": "19411",
        "HERD_METRICS_PORT": "19410",
        "HERD_ALLOCATOR_PORT": "19412",
        "HERD_PROMETHEUS_PORT": "19090",
    }
    with running_batch(tmp_path, ports) as root:
        (run,) = wait_for_lines(root / "calls" / "run", 1)
        start = wait_for_lines(root / "calls" / "srun", 1)[0].split()
    assert start[start.index("--port") + 1] == "19411"
    argv = run.split()
    assert argv[argv.index("--metrics-port") + 1] == "19410"
    assert argv[argv.index("--port") + 1] == "19412"


def test_without_an_allocator_port_the_operator_picks_its_own(batch: Path) -> None:
    (run,) = wait_for_lines(batch / "calls" / "run", 1)
    argv = run.split()
    assert "--port" not in argv, "the previous operator's port, else a free one"
    assert argv[argv.index("--metrics-port") + 1] == "9410"
