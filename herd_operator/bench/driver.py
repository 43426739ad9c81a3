"""The job driver's own cost while its job is idle: driver-idle-cpu, idle-jobs.

An idle job here is one worker that sleeps (`sleep`, no Horovod in it): what is left is
what the driver spends keeping the job, mostly discovery. The CPU counted is the
driver's process tree without the worker: the driver, horovodrun's middlemen, and every
discovery call (reaped children count in their parent's children times).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import yaml

from herd_operator.bench.harness import Context, Row, Stats, paired_ratio_figures, stop_session
from herd_operator.layout import write_atomically
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.engines.horovod import DRIVER_MODULE, horovodrun_executable
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.specs.values import Pool

IDLE_WORKER = ["sleep", "1000000"]
START_GUARD_S = 120.0
IDLE_JOBS = 32


def _is_worker(proc: psutil.Process) -> bool:
    with contextlib.suppress(psutil.Error):
        return proc.name() == "sleep"
    return False


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU so far of `root` and its live descendants, their reaped children
    included, the idle worker excluded."""
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        if _is_worker(proc):
            continue
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
    return total


def wait_for_workers(roots: list[int], count: int) -> None:
    """Until `count` idle workers run under `roots` (the job has started)."""
    deadline = time.monotonic() + START_GUARD_S
    while True:
        found = 0
        for root in roots:
            with contextlib.suppress(psutil.Error):
                found += sum(_is_worker(p) for p in psutil.Process(root).children(recursive=True))
        if found >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{found} of {count} idle workers started in {START_GUARD_S} s")
        time.sleep(0.2)


@contextlib.contextmanager
def idle_job(root: Path, mode: str, slots: int = 1) -> Iterator[int]:
    """One idle elastic job on `slots` slots, under our driver or bare horovodrun; yields its
    pid once every worker runs."""
    root.mkdir(parents=True)
    grant = root / "grant"
    write_atomically(grant, f"localhost:{slots}\n")
    horovod_args = ["-np", str(slots), "--min-np", "1", "--max-np", str(slots + 1)]
    horovod_args += ["--network-interface", "lo"]
    if mode == "ours":
        argv = [sys.executable, "-m", DRIVER_MODULE, "--grant-file", str(grant), "--"]
        argv += [*horovod_args, *IDLE_WORKER]
    else:
        script = root / "discover.sh"
        write_atomically(script, f"#!/bin/sh\nexec cat {grant}\n", mode=0o755)
        argv = [horovodrun_executable(), "--host-discovery-script", str(script)]
        argv += [*horovod_args, *IDLE_WORKER]
    with driven(argv, root / "driver.log", slots) as pid:
        yield pid


@contextlib.contextmanager
def driven(argv: list[str], log: Path, slots: int) -> Iterator[int]:
    """A launcher (`argv`) in its own session, its output in `log`, until `slots` workers
    run: yields its pid, and stops its whole session afterwards."""
    with open(log, "wb") as output:
        process = subprocess.Popen(
            argv, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        wait_for_workers([process.pid], slots)
        yield process.pid
    finally:
        stop_session(process)


def idle_cpu_share(root: Path, mode: str, window: float) -> float:
    """Share of one core that an idle job's driver uses over `window` seconds."""
    with idle_job(root, mode) as pid:
        time.sleep(2.0)  # past the start: imports, rendezvous server, first discovery
        cpu, wall = tree_cpu_seconds(pid), time.monotonic()
        time.sleep(window)
        return (tree_cpu_seconds(pid) - cpu) / (time.monotonic() - wall)


def run_driver_idle_cpu(ctx: Context) -> list[Row]:
    window = 3.0 if ctx.quick else 20.0
    ours: list[float] = []
    bare: list[float] = []
    for index in range(ctx.repeat):
        for mode in ("bare", "ours") if index % 2 == 0 else ("ours", "bare"):
            ctx.progress(f"driver-idle-cpu: run {index + 1}, {mode}")
            share = idle_cpu_share(ctx.scratch / f"{mode}-{index}", mode, window)
            (ours if mode == "ours" else bare).append(share * 100)
    return [
        Row(
            name="driver-idle-cpu",
            what=f"CPU of an idle 1-worker elastic job's driver tree over {window:.0f} s"
            " (worker excluded); goal ratio <= 0.05",
            unit="% of a core",
            better="lower",
            baseline_label="bare horovodrun --host-discovery-script (cat of a file)",
            baseline=Stats.of(bare),
            ours=Stats.of(ours),
            extra=paired_ratio_figures(ours, bare),
        )
    ]


# ---- idle-jobs ----


def _spec(name: str) -> dict[str, object]:
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": name},
        "spec": {
            "command": IDLE_WORKER,
            "gpus": {"min": 1, "max": 1},
            "policy": {"name": "static", "params": {"gpus": 1}},
        },
    }


def driver_pids(state_dir: Path) -> list[int]:
    """Our drivers started by the operator of `state_dir` (their grant file is in it)."""
    marker = str(state_dir.resolve())
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if DRIVER_MODULE in cmdline and any(marker in part for part in cmdline):
            found.append(proc.pid)
    return found


@contextlib.contextmanager
def operator_with_idle_jobs(root: Path, count: int) -> Iterator[list[int]]:
    """An operator on `count` virtual GPUs running `count` idle 1-GPU jobs; yields the
    drivers' pids once every job's worker runs."""
    specs_dir = root / "jobs"
    specs_dir.mkdir(parents=True)
    config = OperatorConfig(
        specs_dir=specs_dir,
        state_dir=root / "state",
        pool=StaticPool(Pool.from_counts({"localhost": count}), True, "bench pool"),
        relist_seconds=2.0,
        grace_seconds=5.0,
    )
    operator = Operator(config)
    stop = threading.Event()
    thread = threading.Thread(target=operator.run, args=(stop,), daemon=True)
    thread.start()
    try:
        if not operator.ready.wait(60):
            raise TimeoutError("the operator did not start")
        for index in range(count):
            path = specs_dir / f"idle-{index}.yaml"
            write_atomically(path, yaml.safe_dump(_spec(f"idle-{index}")))
        deadline = time.monotonic() + START_GUARD_S
        while len(pids := driver_pids(config.state_dir)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pids)} of {count} drivers started")
            time.sleep(0.5)
        wait_for_workers(pids, count)
        yield pids
    finally:
        for path in specs_dir.glob("*.yaml"):
            path.unlink()
        deadline = time.monotonic() + 60
        while driver_pids(config.state_dir) and time.monotonic() < deadline:
            time.sleep(0.5)
        stop.set()
        thread.join(60)
        for pid in driver_pids(config.state_dir):  # what the operator did not stop
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def run_idle_jobs(ctx: Context) -> list[Row]:
    count = 4 if ctx.quick else IDLE_JOBS
    window = 3.0 if ctx.quick else 30.0
    ours: list[float] = []
    bare: list[float] = []
    rss: list[float] = []
    alive: list[float] = []
    for index in range(ctx.repeat):
        ctx.progress(f"idle-jobs: run {index + 1}, one bare horovodrun job alone")
        bare.append(count * idle_cpu_share(ctx.scratch / f"bare-{index}", "bare", window) * 100)
        ctx.progress(f"idle-jobs: run {index + 1}, {count} jobs under the operator")
        with operator_with_idle_jobs(ctx.scratch / f"operator-{index}", count) as pids:
            time.sleep(2.0)
            before = sum(tree_cpu_seconds(pid) for pid in pids)
            wall = time.monotonic()
            time.sleep(window)
            used = sum(tree_cpu_seconds(pid) for pid in pids) - before
            ours.append(used / (time.monotonic() - wall) * 100)
            alive.append(sum(psutil.pid_exists(pid) for pid in pids))
            rss.append(
                sum(psutil.Process(pid).memory_info().rss for pid in pids if psutil.pid_exists(pid))
                / 2**20
            )
    return [
        Row(
            name=f"idle-jobs ({count})",
            what=f"CPU of {count} idle 1-worker jobs' drivers together under the operator,"
            f" over {window:.0f} s (workers and the operator excluded)",
            unit="% of a core",
            better="lower",
            baseline_label=f"{count} x one bare horovodrun job's idle CPU, measured alone",
            baseline=Stats.of(bare),
            ours=Stats.of(ours),
            extra={
                **paired_ratio_figures(ours, bare),
                "drivers_alive_at_end_min": min(alive),
                "drivers_rss_mb_median": Stats.of(rss).median,
            },
        )
    ]
