"""How long a torchrun agent takes to reach its rendezvous: started as our driver starts it
against started as a user starts bare torchrun, alternating, on the same store.

    python -m devtools.torchrun_agent_start [--repeat 6]

This process plays the driver: it imports torch and hosts a c10d store (as
`torchrun_driver.start_store` does). Ours: the command `torchrun_driver.Agents` builds
(`--rdzv-endpoint`, `--local-addr`, `is_host=false`), run under `dies_with_parent` (util-linux
`setpriv --pdeathsig`) with the driver's agent environment, as `Agents.start` runs a local
agent. Bare: `python -m torch.distributed.run --rdzv-endpoint=...` with the same other
arguments and no `is_host` (so it first tries to host the store itself, as a bare agent that
joins a running job does). For each start: seconds from `Popen` to torch's log line
`Starting elastic_operator` (the interpreter, torch's import, the arguments) and to
`Rendezvous'ing worker group` (the store connected, the join begins); then the agent is
killed. Each start is a fresh rendezvous id. Prints one line per start and the medians,
with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from herd_operator.runtime.engines.parent_death import dies_with_parent
from herd_operator.runtime.engines.torchrun_driver import AGENT_ENV, Agents, start_store

MARKS = ("Starting elastic_operator", "Rendezvous'ing worker group")
HANG_GUARD_S = 120.0
CONF = "join_timeout=600,last_call_timeout=3,keep_alive_interval=2,keep_alive_max_attempt=3"


def common_args(run_id: str) -> list[str]:
    return [
        "--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-id={run_id}",
        "--max-restarts=100", "--monitor-interval=0.5", "--no-python", "sleep", "600",
    ]  # fmt: skip


def ours_argv(endpoint: str, run_id: str) -> list[str]:
    rdzv = [f"--rdzv-conf=is_host=false,{CONF}", *common_args(run_id)]
    return dies_with_parent(Agents(endpoint, "127.0.0.1", rdzv, frozenset()).argv())


def bare_argv(endpoint: str, run_id: str) -> list[str]:
    rdzv = [f"--rdzv-endpoint={endpoint}", f"--rdzv-conf={CONF}", *common_args(run_id)]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv]


def time_start(argv: Sequence[str], log_path: Path) -> list[float]:
    """Seconds from the start to each of `MARKS` in the agent's log."""
    env = {**os.environ, **AGENT_ENV, "LOGLEVEL": "INFO"}
    with log_path.open("wb") as log:
        started = time.monotonic()
        agent = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    found: list[float] = []
    try:
        while len(found) < len(MARKS):
            if MARKS[len(found)] in log_path.read_text(errors="replace"):
                found.append(time.monotonic() - started)
                continue
            if agent.poll() is not None or time.monotonic() - started > HANG_GUARD_S:
                raise SystemExit(
                    f"the agent ended or hung before {MARKS[len(found)]!r}: {log_path}"
                )
            time.sleep(0.005)
    finally:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(agent.pid).children(recursive=True):
                child.kill()
        agent.kill()
        agent.wait(30)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    store, port = start_store("127.0.0.1")
    endpoint = f"127.0.0.1:{port}"
    root = Path(tempfile.mkdtemp(prefix="torchrun-agent-start-"))
    results: dict[str, list[list[float]]] = {"bare": [], "ours": []}
    for run in range(args.repeat):
        order = ("bare", "ours") if run % 2 == 0 else ("ours", "bare")
        for name in order:
            run_id = f"{name}{run}"
            argv = bare_argv(endpoint, run_id) if name == "bare" else ours_argv(endpoint, run_id)
            marks = time_start(argv, root / f"{run_id}.log")
            results[name].append(marks)
            load = " ".join(f"{value:.1f}" for value in os.getloadavg())
            print(
                f"run {run} {name}: started {marks[0]:.2f} s, joining {marks[1]:.2f} s, load {load}"
            )
    for name, runs in results.items():
        medians = [statistics.median(run[i] for run in runs) for i in range(len(MARKS))]
        spread = [
            (min(run[i] for run in runs), max(run[i] for run in runs)) for i in range(len(MARKS))
        ]
        print(
            f"{name}: median started {medians[0]:.2f} s ({spread[0][0]:.2f}-{spread[0][1]:.2f}), "
            f"joining {medians[1]:.2f} s ({spread[1][0]:.2f}-{spread[1][1]:.2f}), n={len(runs)}"
        )
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
