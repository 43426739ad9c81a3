"""Resize stall of a torchrun job: our driver against bare `torchrun` agents resized by hand.

    python -m devtools.torchrun_resize [--repeat 1]

Both run `examples/train_torchrun.py --step-log` (rank 0 logs each step's wall time and
world size) with the same torchrun arguments as the engine gives its agents (one process
per agent, c10d, `last_call_timeout=3`, `keep_alive_interval=2`, the agents' store sharing
off, as the driver sets it). Each starts at 2 agents, trains 20 steps at 2, grows to 4 and
shrinks back to 2. The stall of a resize is from its trigger to the first step at the new
world size. Ours: the trigger is the grant file's replacement (what the operator writes),
and the driver starts or stops the agents. Bare: the trigger is starting two more agents,
or SIGTERM to the two newest (the first agent hosts the store, as bare torchrun does).
The operator's own part (a decision, the grant write, each worker's bind) is not in
either. Prints one line per resize and mode, with the load average.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from herd_operator.layout import write_atomically
from herd_operator.runtime.engines.torchrun import DRIVER_MODULE, KEEP_ALIVE_ATTEMPTS

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "train_torchrun.py"
HANG_GUARD_S = 300.0
STEADY_STEPS = 20
CONF = (
    f"join_timeout=600,last_call_timeout=3,keep_alive_interval=2,"
    f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}"
)
AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def agent_args(run_id: str, root: Path) -> list[str]:
    return [
        "--nnodes=1:4", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-id={run_id}",
        "--max-restarts=100", "--monitor-interval=0.5", "--no-python", sys.executable,
        str(SCRIPT), "--epochs", "100000", "--snapshot", str(root / "snap.pt"),
        "--step-log", str(root / "steps"),
    ]  # fmt: skip


def steps(root: Path) -> list[tuple[float, int]]:
    try:
        lines = (root / "steps").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [
        (float(a), int(b)) for a, b in (line.split() for line in lines if len(line.split()) == 2)
    ]


def first_step(root: Path, world: int, after: float, count: int = 1) -> float:
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        times = [at for at, size in steps(root) if size == world and at > after]
        if len(times) >= count:
            return times[count - 1]
        if time.monotonic() > deadline:
            raise SystemExit(f"no step at world size {world} after {HANG_GUARD_S:.0f} s: {root}")
        time.sleep(0.01)


def gap(root: Path, new_world_at: float) -> float:
    """Seconds without a step before the first step at the new size: the last step at the
    old size to the first at the new one (the job trains on while new agents start)."""
    before = [at for at, _ in steps(root) if at < new_world_at]
    return new_world_at - max(before)


TORCH_LOG = re.compile(r"^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) +(\d+) \S+\] (.*)$")
"""One line of torch's own log (`LOGLEVEL=INFO`): month, day, UTC time, pid, message."""


def agent_parts(root: Path) -> str:
    """Where the grow's `agents` part went, from torch's log (`--agent-log`): seconds after
    the trigger at which each new agent logged `Starting elastic_operator` (its interpreter
    and torch's import done), the old agents saw them (`Detected`), and the new round was
    complete; '' without the log."""
    grown_at = float((root / "grown_at").read_text())
    old: set[int] = set()
    started: list[float] = []
    detected: list[float] = []
    complete: list[float] = []
    for line in (root / "log").read_text(errors="replace").splitlines():
        match = TORCH_LOG.match(line)
        if match is None:
            continue
        month, day, hour, minute, second, pid, message = match.groups()
        day_start = datetime.datetime(
            datetime.datetime.now(datetime.UTC).year, int(month), int(day), int(hour),
            int(minute), tzinfo=datetime.UTC,
        )  # fmt: skip
        at = day_start.timestamp() + float(second) - grown_at
        if at < 0:
            old.add(int(pid))
        elif "Starting elastic_operator" in message and int(pid) not in old:
            started.append(at)
        elif "new nodes from group_rank" in message and not complete:
            detected.append(at)
        elif "Rendezvous complete" in message:
            complete.append(at)
    if not (started and detected and complete):
        return ""
    firsts = ", ".join(f"{at:.2f}" for at in started)
    return (
        f"; grow: new agents started at {firsts} s, seen at {max(detected):.2f} s, "
        f"round complete at {min(complete):.2f} s"
    )


def measure(root: Path, grow: Callable[[], float], shrink: Callable[[], float]) -> list[float]:
    """(grow latency, grow gap, shrink latency, shrink gap) in seconds: from the trigger
    to the first step at the new size, and the time without a step before it."""
    first_step(root, 2, 0.0, STEADY_STEPS)
    grown_at = grow()
    (root / "grown_at").write_text(f"{grown_at:.3f}\n")
    at_4 = first_step(root, 4, grown_at)
    first_step(root, 4, grown_at, STEADY_STEPS)
    shrunk_at = shrink()
    at_2 = first_step(root, 2, shrunk_at)
    return [at_4 - grown_at, gap(root, at_4), at_2 - shrunk_at, gap(root, at_2)]


def ours(root: Path) -> list[float]:
    """Our driver, resized through its grant file."""
    grant = root / "grant"
    write_atomically(grant, "localhost 0\nlocalhost 1\n")
    options = ["--grant-file", str(grant), "--store-host", "127.0.0.1", "--"]
    rdzv = [f"--rdzv-conf=is_host=false,{CONF}", *agent_args("ours", root)]
    argv = [sys.executable, "-m", DRIVER_MODULE, *options, *rdzv]
    with (root / "log").open("wb") as log:
        driver = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def resize(text: str) -> float:
        write_atomically(grant, text)
        return grant.stat().st_mtime_ns / 1e9

    try:
        return measure(
            root,
            lambda: resize("".join(f"localhost {gpu}\n" for gpu in range(4))),
            lambda: resize("localhost 0\nlocalhost 1\n"),
        )
    finally:
        os.killpg(driver.pid, signal.SIGTERM)
        driver.wait(60)


def bare(root: Path) -> list[float]:
    """Bare torchrun agents, started and stopped by hand."""
    endpoint = f"--rdzv-endpoint=127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "torch.distributed.run", endpoint, f"--rdzv-conf={CONF}"]
    argv += agent_args("bare", root)
    env = {**os.environ, **AGENT_ENV}
    agents: list[subprocess.Popen[bytes]] = []
    log = (root / "log").open("wb")

    def start(count: int) -> float:
        at = time.time()
        for _ in range(count):
            agents.append(
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
        return at

    def stop_newest() -> float:
        at = time.time()
        for agent in agents[-2:]:
            agent.send_signal(signal.SIGTERM)
        return at

    try:
        start(2)  # the first to bind the endpoint hosts the store, as bare torchrun does
        return measure(root, lambda: start(2), stop_newest)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
        for agent in agents:
            agent.wait(60)
        log.close()


def free_port() -> int:
    """A port free now, for bare torchrun's `--rdzv-endpoint` (as a user picks one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--agent-log", action="store_true", help="split the grow's agents part by torch's log"
    )
    args = parser.parse_args()
    if args.agent_log:
        os.environ["LOGLEVEL"] = "INFO"  # the agents inherit it
    for run in range(args.repeat):
        for name, mode in (("bare", bare), ("ours", ours)):
            root = Path(tempfile.mkdtemp(prefix=f"torchrun-resize-{name}-"))
            grow, grow_gap, shrink, shrink_gap = mode(root)
            load = " ".join(f"{value:.1f}" for value in os.getloadavg())
            print(
                f"run {run} {name}: 2->4 {grow:.2f} s (no step for {grow_gap:.2f} s), "
                f"4->2 {shrink:.2f} s (no step for {shrink_gap:.2f} s) (load {load})"
                f"{agent_parts(root) if args.agent_log else ''}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
