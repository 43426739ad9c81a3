"""Restart to serving, no jobs: how long `herd-operator run` takes, from its exec until its
endpoint file names it, started again and again on one state dir (each killed with
SIGKILL once it serves, as the chaos test does).

    python scripts/restart_probe.py --rounds 9 TREE [TREE...]

Each TREE is a checkout of this project; rounds alternate between the trees (so load
that comes and goes hits each alike), each under PYTHONPATH=TREE with this interpreter.
Prints one line per start, then per tree the median and the spread of the wall time and
of the CPU time the operator used until it served (user + system; steadier than the wall
time on a loaded machine), and the load average at the start and the end of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HANG_GUARD_S = 60.0


def start_to_serving(tree: Path, specs: Path, state: Path) -> tuple[float, float]:
    """Wall seconds from exec to serving, and the CPU seconds the operator used by then."""
    argv = [sys.executable, "-m", "herd_operator.cli", "run", "--specs-dir", str(specs),
            "--state-dir", str(state), "--hosts", "localhost:4", "--metrics-port", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    operator = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    wall = None
    try:
        while wall is None:
            with contextlib.suppress(OSError, ValueError):
                if json.loads((state / "allocator.json").read_text())["pid"] == operator.pid:
                    wall = time.monotonic() - started
                    break
            if time.monotonic() - started > HANG_GUARD_S:
                raise RuntimeError(f"{tree}: not serving after {HANG_GUARD_S} s")
            time.sleep(0.005)
    finally:
        operator.send_signal(signal.SIGKILL)
        # wait4, not Popen.wait: its resource usage is the operator's CPU time.
        _, status, usage = os.wait4(operator.pid, 0)
        operator.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime


def stop_cleanly(tree: Path, specs: Path, state: Path) -> None:
    """One last start stopped with SIGTERM, so the runtime dir it made goes too."""
    argv = [sys.executable, "-m", "herd_operator.cli", "run", "--specs-dir", str(specs),
            "--state-dir", str(state), "--hosts", "localhost:4", "--metrics-port", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    operator = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    # Stopped only once it serves (the endpoint names it, not a killed predecessor): a
    # SIGTERM during its imports would leave the runtime dir in /dev/shm behind.
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline and operator.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if json.loads((state / "allocator.json").read_text())["pid"] == operator.pid:
                break
        time.sleep(0.05)
    operator.send_signal(signal.SIGTERM)
    try:
        operator.wait(30)
    except subprocess.TimeoutExpired:
        operator.kill()
        operator.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    load_before = os.getloadavg()
    base = Path(tempfile.mkdtemp(prefix="restart-probe-"))
    times: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    cpu: dict[Path, list[float]] = {tree: [] for tree in args.trees}
    try:
        dirs = {}
        for index, tree in enumerate(args.trees):
            specs, state = base / f"specs-{index}", base / f"state-{index}"
            specs.mkdir()
            dirs[tree] = (specs, state)
            start_to_serving(tree, specs, state)  # the first start creates the state dir
        for round_ in range(args.rounds):
            for tree in args.trees if round_ % 2 == 0 else reversed(args.trees):
                seconds, cpu_seconds = start_to_serving(tree, *dirs[tree])
                times[tree].append(seconds)
                cpu[tree].append(cpu_seconds)
                print(f"{tree}: {seconds:.3f} s, CPU {cpu_seconds:.3f} s", flush=True)
        for tree in args.trees:
            stop_cleanly(tree, *dirs[tree])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load_after = os.getloadavg()
    for tree, walls in times.items():
        used = cpu[tree]
        print(
            f"{tree}: median {statistics.median(walls):.2f} s "
            f"({min(walls):.2f}-{max(walls):.2f}), CPU median "
            f"{statistics.median(used):.2f} s ({min(used):.2f}-{max(used):.2f}), "
            f"{len(walls)} starts"
        )
    print(f"load average (1 min): {load_before[0]:.1f} before, {load_after[0]:.1f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
