"""A training worker's CPU from its start to its first optimizer step: a new interpreter
against workers forked by a job's zygote, with and without `torch._dynamo` preloaded.

    python -m devtools.worker_start [--repeat 5] [--script examples/train_digits.py]

Each worker runs the example script alone (no horovodrun: `hvd.init()` makes a world of
one) behind a small wrapper that registers a global optimizer step hook: at the end of
the first step it writes its CPU time (user + system from `os.times()`, which a forked
child starts at zero) and exits. Modes, rotated each round so that none always goes first:

- `plain`: `python WRAPPER SCRIPT ...` as a new process, as a worker that no zygote forks
  starts (the interpreter, the imports, the optimizer, the data, the first step);
- `zygote`: forked by a zygote that preloaded `torch,horovod.torch` (what the bench's
  resize-stall preloaded until 2026-12-02);
- `zygote+dynamo`: forked by a zygote that also preloaded `torch._dynamo`, which torch
  2.13's `torch.optim.Optimizer` imports on its first call (`torch._disable_dynamo`).

Each zygote forks `--repeat` workers one after the other (a grow forks its new workers
from one zygote too); its own CPU up to ready (the imports) is printed once. Prints one
line per worker (CPU and wall seconds to the first step, the load average) and the
medians with their spreads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from herd_operator.runtime.engines.forkserver import Zygote

REPO = Path(__file__).resolve().parents[1]
HANG_GUARD_S = 300.0
PRELOADS = {
    "zygote": ("torch", "horovod.torch"),
    "zygote+dynamo": ("torch", "horovod.torch", "torch._dynamo"),
}
WRAPPER = """
import os, runpy, sys
from torch.optim.optimizer import register_optimizer_step_post_hook

RESULT = sys.argv[1]

def first_step(optimizer, args, kwargs):
    times = os.times()
    with open(RESULT, "w") as out:
        out.write(f"{times.user + times.system:.3f}\\n")
    os._exit(0)

register_optimizer_step_post_hook(first_step)
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.realpath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def load() -> str:
    return " ".join(f"{value:.1f}" for value in os.getloadavg())


def wait_for(result: Path, started: float, ended: Callable[[], bool]) -> tuple[float, float]:
    """(the worker's CPU-s, wall seconds since `started`) once it wrote its result."""

    def written() -> bool:
        return result.exists() and result.read_text().endswith("\n")

    while not written():
        gone = ended()  # before the look at the file: a worker writes it, then exits
        if (gone and not written()) or time.monotonic() - started > HANG_GUARD_S:
            raise SystemExit(f"no first step (ended or hung): {result.with_suffix('.log')}")
        time.sleep(0.01)
    return float(result.read_text()), time.monotonic() - started


def plain_worker(argv: Sequence[str], result: Path, log: Path) -> tuple[float, float]:
    with log.open("wb") as out:
        started = time.monotonic()
        worker = subprocess.Popen(
            [sys.executable, *argv], cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
        measured = wait_for(result, started, lambda: worker.poll() is not None)
    worker.wait(60)
    return measured


def forked_worker(
    zygote: Zygote, argv: Sequence[str], result: Path, log: Path
) -> tuple[float, float]:
    with log.open("wb") as out, open(os.devnull, "rb") as stdin:
        started = time.monotonic()
        worker = zygote.fork(
            argv, dict(os.environ), str(REPO), False, [stdin.fileno(), *[out.fileno()] * 2]
        )
        if worker is None:
            raise SystemExit(f"the zygote did not fork the worker: {log}")
        measured = wait_for(result, started, lambda: not psutil.pid_exists(worker.pid))
    worker.wait()
    return measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--script", default="examples/train_digits.py")
    parser.add_argument("--script-args", default="--epochs 1")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="worker-start-"))
    wrapper = root / "first_step.py"
    wrapper.write_text(WRAPPER)
    zygotes: dict[str, Zygote] = {}
    for mode, preload in PRELOADS.items():
        zygote = Zygote(preload, dict(os.environ))
        if not zygote.ready(wait=HANG_GUARD_S):
            raise SystemExit(f"the {mode} zygote did not get ready")
        imports = psutil.Process(zygote.process.pid).cpu_times()
        print(f"{mode} ready: {imports.user + imports.system:.2f} CPU-s of imports, load {load()}")
        zygotes[mode] = zygote
    modes = ["plain", *PRELOADS]
    results: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for run in range(args.repeat):
        for mode in modes[run % len(modes) :] + modes[: run % len(modes)]:
            result = root / f"{mode}-{run}.cpu"
            argv = [str(wrapper), str(result), args.script, *args.script_args.split()]
            log = root / f"{mode}-{run}.log"
            if mode == "plain":
                cpu, wall = plain_worker(argv, result, log)
            else:
                cpu, wall = forked_worker(zygotes[mode], argv, result, log)
            results[mode].append((cpu, wall))
            print(
                f"run {run} {mode}: {cpu:.2f} CPU-s, {wall:.2f} s to the first step, load {load()}"
            )
    for zygote in zygotes.values():
        zygote.close()
    for mode, runs in results.items():
        cpus, walls = [cpu for cpu, _ in runs], [wall for _, wall in runs]
        print(
            f"{mode}: median {statistics.median(cpus):.2f} CPU-s ({min(cpus):.2f}-{max(cpus):.2f}),"
            f" {statistics.median(walls):.2f} s ({min(walls):.2f}-{max(walls):.2f}), n={len(runs)}"
        )
    plain = [cpu for cpu, _ in results["plain"]]
    for mode in PRELOADS:
        ratios = [cpu / base for (cpu, _), base in zip(results[mode], plain, strict=True)]
        print(
            f"{mode} / plain, per round: median {statistics.median(ratios):.2f}"
            f" ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
