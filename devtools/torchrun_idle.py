"""The idle cost of a torchrun job's launch tree: our driver and its agents, not the workers.

    python -m devtools.torchrun_idle [--gpus 2] [--window 60] [--monitor-interval 0.5]

Runs the torchrun engine's driver on a grant of `--gpus` local slots, each agent's worker a
`sleep`, waits until every worker runs and 10 s more, then prints the driver's and the
agents' unique memory (USS) and their CPU (user + system, children excluded) over
`--window` seconds as a share of one core, with the load average. Not a benchmark of the
suite (no baseline in the same run); docs/mechanisms.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from herd_operator.runtime.engines.torchrun import DRIVER_MODULE

HANG_GUARD_S = 300.0
SLEEP = "import time; time.sleep(3600)"
"""Each worker: idle, so that what is measured is the launch tree's own cost."""


def driver_argv(grant: Path, gpus: int, monitor_interval: float) -> list[str]:
    python = sys.executable
    conf = "is_host=false,join_timeout=600,last_call_timeout=3,keep_alive_interval=2"
    return [python, "-m", DRIVER_MODULE, "--grant-file", str(grant), "--store-host",
            "127.0.0.1", "--", f"--nnodes=1:{gpus}", "--nproc-per-node=1",
            "--rdzv-backend=c10d", "--rdzv-id=idle", f"--rdzv-conf={conf}",
            f"--monitor-interval={monitor_interval}", "--no-python", python, "-m",
            "herd_operator.agent.shim", "--", python, "-c", SLEEP]  # fmt: skip


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in processes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--monitor-interval", type=float, default=0.5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="torchrun-idle-"))
    grant = root / "grant"
    grant.write_text("".join(f"localhost {gpu}\n" for gpu in range(args.gpus)))
    with (root / "log").open("wb") as log:
        driver = subprocess.Popen(
            driver_argv(grant, args.gpus, args.monitor_interval),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            tree = psutil.Process(driver.pid).children(recursive=True)
            workers = [p for p in tree if SLEEP in p.cmdline()]
            if len(workers) == args.gpus:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the workers did not start; see {root / 'log'}")
            time.sleep(1)
        time.sleep(10)
        groups = {
            "driver": [psutil.Process(driver.pid)],
            "agents": psutil.Process(driver.pid).children(),
        }
        before = {name: cpu_seconds(group) for name, group in groups.items()}
        time.sleep(args.window)
        for name, group in groups.items():
            share = (cpu_seconds(group) - before[name]) / args.window * 100
            uss = sum(p.memory_full_info().uss for p in group) / 2**20
            print(
                f"{name}: {len(group)} process(es), USS {uss:.0f} MiB, "
                f"CPU {share:.2f}% of a core over {args.window:.0f} s"
            )
        print("load average: " + " ".join(f"{load:.1f}" for load in os.getloadavg()))
    finally:
        driver.terminate()
        driver.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
