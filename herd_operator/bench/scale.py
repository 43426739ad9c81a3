"""`scale`: thousands of spec files: relist, one reconcile pass, peak memory.

Each measurement runs in a child process (`python -m herd_operator.bench.scale`)
so that its peak memory is its own.
"""

from __future__ import annotations

import contextlib
import json
import random
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from herd_operator.bench.harness import Context, Row, Stats

CHILD_TIMEOUT_S = 600.0
FIRST_PASS_BUDGET_S = 120.0
PERLMUTTER_NODES = 1792
GPUS_PER_NODE = 4


def write_specs(directory: Path, count: int, seed: int = 7) -> None:
    """`count` valid, distinct HerdJob files, with seeded sizes and priorities."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for index in range(count):
        low = rng.randint(1, 2)
        high = low + rng.randint(0, 6)
        (directory / f"job-{index:05d}.yaml").write_text(
            "apiVersion: herd/v1alpha1\n"
            "kind: HerdJob\n"
            f"metadata:\n  name: job-{index:05d}\n"
            "spec:\n"
            f"  command: [python, train.py, --seed, '{index}']\n"
            f"  gpus: {{min: {low}, max: {high}}}\n"
            f"  priority: {rng.randint(0, 2)}\n"
        )


def peak_rss_mb() -> float:
    """This process's peak resident memory since its exec.

    VmHWM, not ru_maxrss: after fork + exec, ru_maxrss keeps the parent's RSS.
    """
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def measure_yaml(directory: Path) -> dict[str, float]:
    """The least any tool reading these files does: read each one and parse it with libyaml."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    started = time.perf_counter()
    documents = [
        yaml.load(path.read_bytes(), Loader=loader)
        for path in sorted(directory.iterdir())
        if path.is_file()
    ]
    elapsed = time.perf_counter() - started
    assert all(isinstance(document, dict) for document in documents)
    return {"seconds": elapsed, "peak_mb": peak_rss_mb()}


def measure_operator(directory: Path, state: Path, nodes: int, budget_s: float) -> dict[str, float]:
    """Relist cold and warm, then reconcile every job once (stopping after `budget_s`)
    and again (the steady state) the jobs that the first pass reached."""
    from herd_operator.controllers.loop import ControlLoop
    from herd_operator.controllers.ports import LaunchInfo, ProcessPhase, ProcessState, Result
    from herd_operator.controllers.reconciler import JobReconciler
    from herd_operator.controllers.workqueue import WorkQueue
    from herd_operator.layout import (
        StateLayout,
        make_runtime_dir,
        remove_runtime_dir,
        runtime_base,
    )
    from herd_operator.runtime.allocator import Allocator
    from herd_operator.runtime.engines.horovod import (
        GrantPublisher,
        HorovodEngine,
        relaunch_reason,
    )
    from herd_operator.runtime.operator import tune_gc
    from herd_operator.runtime.specdir import SpecDirectory
    from herd_operator.runtime.store import Store
    from herd_operator.specs import HerdJob
    from herd_operator.specs.values import Pool, ResizeMode

    @dataclass
    class RecordingLauncher:
        """Starts nothing; answers as if every started job runs."""

        started: dict[str, LaunchInfo] = field(default_factory=dict)

        def start(self, job: HerdJob, generation: int, np: int) -> LaunchInfo:
            info = LaunchInfo(
                launch_id=f"{job.name}-launch",
                pid=1,
                started_at=time.time(),
                generation=generation,
                command="horovodrun",
                spec=job.spec,
            )
            self.started[job.name] = info
            return info

        def state(self, name: str) -> ProcessState:
            info = self.started.get(name)
            if info is None:
                return ProcessState(ProcessPhase.ABSENT)
            return ProcessState(ProcessPhase.RUNNING, launch=info)

        def relaunch_reason(self, launch: LaunchInfo, job: HerdJob) -> str:
            return relaunch_reason(launch.spec, job.spec)

        def resize_mode(self, kind: str) -> ResizeMode | None:
            return HorovodEngine.resize_mode  # every generated job is a Horovod job

        def stop(self, name: str) -> None:
            raise AssertionError(f"nothing should be stopped ({name})")

        def forget(self, name: str) -> None:
            self.started.pop(name, None)

    tune_gc()  # as `herd-operator run` does
    # Grants where the operator puts them: a private runtime dir on tmpfs when there is one.
    base = runtime_base(None)
    layout = StateLayout(state, make_runtime_dir(base) if base is not None else None)
    layout.create()
    specs = SpecDirectory(directory)
    result: dict[str, float] = {}
    started = time.perf_counter()
    names = specs.relist()
    result["relist_cold"] = time.perf_counter() - started
    started = time.perf_counter()
    specs.relist()
    result["relist_warm"] = time.perf_counter() - started
    store = Store(layout.database)
    pool = Pool.from_counts({f"nid{n:06d}": GPUS_PER_NODE for n in range(nodes)})
    allocator = Allocator(pool, GrantPublisher(layout), virtual=False)
    launcher = RecordingLauncher()
    reconciler = JobReconciler(specs, store, allocator, launcher)
    done: list[str] = []

    class Recording:
        """The reconciler, noting each name it is asked for."""

        def reconcile(self, name: str, failures: int) -> Result:
            done.append(name)
            return reconciler.reconcile(name, failures)

        def record_shutdown(self, name: str) -> None:
            reconciler.record_shutdown(name)

        def known_jobs(self) -> list[str]:
            return reconciler.known_jobs()

    # The operator's own loop: bursts of up to MAX_BATCH names under one allocator decision;
    # jobs whose grant changed are woken and reconciled again in the next burst.
    queue = WorkQueue()
    loop = ControlLoop(queue, Recording(), allocator, store)
    for name in sorted(names):
        queue.add(name)
    started = time.perf_counter()
    deadline = started + budget_s
    while time.perf_counter() <= deadline and loop.run_once(timeout=0):
        pass
    result["reconcile_first"] = time.perf_counter() - started
    started = time.perf_counter()
    for name in sorted(set(done)):
        reconciler.reconcile(name)  # nothing changed: no decision, no launch
    result["reconcile_steady"] = time.perf_counter() - started
    store.close()
    if layout.runtime is not None:
        remove_runtime_dir(layout.runtime)
    result["jobs"] = len(names)
    result["first_pass_jobs"] = len(set(done))
    result["reconciles"] = len(done)
    result["launched"] = len(launcher.started)
    result["peak_mb"] = peak_rss_mb()
    return result


def run_child(
    mode: str, directory: Path, state: Path, nodes: int, budget_s: float = 0.0
) -> dict[str, float]:
    module = "herd_operator.bench.scale"
    argv = [mode, str(directory), str(state), str(nodes), str(budget_s)]
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"scale child ({mode}) failed:\n{done.stderr[-2000:]}")
    measured: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return measured


def run_scale(ctx: Context) -> list[Row]:
    rows = []
    nodes = 64 if ctx.quick else PERLMUTTER_NODES
    budget_s = 60.0 if ctx.quick else FIRST_PASS_BUDGET_S
    for count in (200,) if ctx.quick else (1000, 10000):
        directory = ctx.scratch / f"specs-{count}"
        write_specs(directory, count)
        ours: list[dict[str, float]] = []
        plain: list[dict[str, float]] = []
        for index in range(ctx.repeat):
            ctx.progress(f"scale: {count} files, repetition {index + 1}")
            ours.append(
                run_child(
                    "operator", directory, ctx.scratch / f"state-{count}-{index}", nodes, budget_s
                )
            )
            plain.append(run_child("yaml", directory, ctx.scratch / "unused", nodes))
        yaml_seconds = Stats.of([m["seconds"] * 1000 for m in plain])
        baseline_label = "read + libyaml safe load of every file"
        reached = min(int(m["first_pass_jobs"]) for m in ours)
        jobs = f"all {count}" if reached == count else f"first {reached} of {count}, budget hit"
        figures = {
            "relist cold": "relist_cold",
            "relist warm": "relist_warm",
            f"first reconcile pass ({jobs} jobs)": "reconcile_first",
            f"steady reconcile pass ({jobs.split(',')[0]} jobs)": "reconcile_steady",
        }
        for label, key in figures.items():
            rows.append(
                Row(
                    name=f"scale {count} files: {label}",
                    what=f"{label}, {count} spec files, {nodes} nodes x {GPUS_PER_NODE} GPUs",
                    unit="ms",
                    better="lower",
                    baseline_label=baseline_label,
                    baseline=yaml_seconds,
                    ours=Stats.of([m[key] * 1000 for m in ours]),
                )
            )
        resync = Stats.of([(m["relist_warm"] + m["reconcile_steady"]) * 1000 for m in ours])
        rows.append(
            Row(
                name=f"scale {count} files: full pass, relist + reconcile every job",
                what="what the operator repeats for the whole allocation (files unchanged);"
                " goal for 10,000 files: under 2 s",
                unit="ms",
                better="lower",
                baseline_label=baseline_label,
                baseline=yaml_seconds,
                ours=resync,
            )
        )
        total = Stats.of([(m["relist_cold"] + m["reconcile_first"]) * 1000 for m in ours])
        rows.append(
            Row(
                name=f"scale {count} files: start, cold relist + first pass ({jobs} jobs)",
                what="every file new: parse, record, decide, launch (recorded, not spawned)",
                unit="ms",
                better="lower",
                baseline_label=baseline_label,
                baseline=yaml_seconds,
                ours=total,
                extra={
                    "jobs_launched": ours[0]["launched"],
                    "first_pass_jobs_per_s": reached / ours[0]["reconcile_first"],
                },
            )
        )
        rows.append(
            Row(
                name=f"scale {count} files: peak memory",
                what="peak RSS of the process (VmHWM); goal for 10,000 files: under 500 MB",
                unit="MB",
                better="lower",
                baseline_label=baseline_label,
                baseline=Stats.of([m["peak_mb"] for m in plain]),
                ours=Stats.of([m["peak_mb"] for m in ours]),
            )
        )
    return rows


def main(argv: list[str]) -> int:
    mode, directory, state = argv[0], Path(argv[1]), Path(argv[2])
    nodes, budget_s = int(argv[3]), float(argv[4])
    measured: dict[str, Any]
    if mode == "yaml":
        measured = measure_yaml(directory)
    elif mode == "operator":
        measured = measure_operator(directory, state, nodes, budget_s)
    else:
        print(f"unknown mode {mode!r}: expected yaml or operator", file=sys.stderr)
        return 2
    print(json.dumps(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
