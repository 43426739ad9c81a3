"""The benchmarks in the order they are run, and the `herd-operator bench` entry point."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from herd_operator.bench.arbitration import run_arbitration
from herd_operator.bench.control import (
    run_decision_to_grant,
    run_discovery_cost,
    run_spec_to_launch,
)
from herd_operator.bench.driver import run_driver_idle_cpu, run_idle_jobs
from herd_operator.bench.harness import (
    Benchmark,
    Outcome,
    machine_info,
    run_benchmarks,
    select,
    write_results,
)
from herd_operator.bench.scale import run_scale
from herd_operator.bench.scrape import run_scrape
from herd_operator.bench.torchrun import (
    run_torchrun_idle_cost,
    run_torchrun_resize_stall,
    run_torchrun_training_overhead,
)
from herd_operator.bench.training import run_resize_stall, run_training_overhead

REPO = Path(__file__).resolve().parents[2]
TRAINING = ("torch", "horovod.torch", "sklearn")
TORCHRUN = ("torch", "sklearn")
"""What the torchrun rows need (no Horovod: a `[torchrun]` install runs them)."""

BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "spec-to-launch",
        "atomic rename of a new spec file -> the job's horovodrun process exists"
        " (horovodrun replaced by a script that records its start)",
        run_spec_to_launch,
        full_repeat=20,
        quick_repeat=2,
    ),
    Benchmark(
        "decision-to-grant",
        "Allocator.request with a new demand -> the job's discovery script prints the new hosts",
        run_decision_to_grant,
        full_repeat=30,
        quick_repeat=2,
    ),
    Benchmark(
        "resize-stall",
        "grant change -> first completed training step at the new world size (real horovodrun)",
        run_resize_stall,
        full_repeat=3,
        quick_repeat=1,
        requires=TRAINING,
    ),
    Benchmark(
        "training-overhead",
        "samples/s of digits training on 2 workers, under the operator vs bare horovodrun",
        run_training_overhead,
        full_repeat=3,
        quick_repeat=1,
        requires=TRAINING,
    ),
    Benchmark(
        "torchrun-resize-stall",
        "torchrun engine: grant change -> first step at the new world size, against bare"
        " torchrun resized by hand (and the Horovod engine's driver, when Horovod is here)",
        run_torchrun_resize_stall,
        full_repeat=3,
        quick_repeat=1,
        requires=TORCHRUN,
    ),
    Benchmark(
        "torchrun-training-overhead",
        "samples/s of digits training on 2 workers, torchrun engine vs bare torchrun",
        run_torchrun_training_overhead,
        full_repeat=3,
        quick_repeat=1,
        requires=TORCHRUN,
    ),
    Benchmark(
        "torchrun-idle-cost",
        "CPU and memory of an idle 2-GPU torchrun job's driver and agents, next to the Horovod"
        " engine's driver",
        run_torchrun_idle_cost,
        full_repeat=3,
        quick_repeat=1,
        requires=(*TORCHRUN, "horovod.runner"),
    ),
    Benchmark(
        "discovery-cost",
        "CPU time per call of a job's discovery script (Horovod calls it every second)",
        run_discovery_cost,
        full_repeat=10,
        quick_repeat=2,
    ),
    Benchmark(
        "driver-idle-cpu",
        "CPU of an idle elastic job's driver: ours (in-process) vs bare horovodrun",
        run_driver_idle_cpu,
        full_repeat=3,
        quick_repeat=1,
        requires=("horovod.runner",),
    ),
    Benchmark(
        "idle-jobs",
        "32 idle elastic jobs under the operator at once: their drivers' CPU together",
        run_idle_jobs,
        full_repeat=1,
        quick_repeat=1,
        requires=("horovod.runner",),
    ),
    Benchmark(
        "scrape",
        "GET /metrics: the exporter with 8 GPUs and the operator with 1,000 jobs; CPU per scrape",
        run_scrape,
        full_repeat=1,
        quick_repeat=1,
    ),
    Benchmark(
        "scale",
        "1,000 and 10,000 spec files: relist (cold, warm), one reconcile pass, peak memory",
        run_scale,
        full_repeat=1,
        quick_repeat=1,
    ),
    Benchmark(
        "arbitration",
        "one arbitrate() decision: 1,792 nodes x 4 GPUs, 2,000 jobs, half already placed",
        run_arbitration,
        full_repeat=15,
        quick_repeat=2,
    ),
)


def run_bench(
    *,
    quick: bool,
    only: str | None,
    output: Path,
    repeat: int | None,
    argv: Sequence[str],
    progress: Callable[[str], None] | None = None,
    benchmarks: Sequence[Benchmark] = BENCHMARKS,
    program: Sequence[str] = ("herd-operator", "bench"),
) -> tuple[list[Outcome], Path, Path]:
    """Run the selected benchmarks and write `benchmarks.md` and `benchmarks.json` to `output`.

    `benchmarks` is the registry `only` picks from, and `program` the command the results
    files name: a checkout's `python -m devtools.bench` passes its own (this package's and
    the developer benchmarks).

    Raises ValueError for an unknown benchmark name or a repeat count under 1.
    """
    if repeat is not None and repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {repeat}")
    chosen = select(benchmarks, only)

    def to_stderr(line: str) -> None:
        print(f"bench: {line}", file=sys.stderr, flush=True)

    machine = machine_info(REPO)  # before the run: its load average is the one that matters
    outcomes = run_benchmarks(chosen, quick=quick, repeat=repeat, progress=progress or to_stderr)
    command = shlex.join([*program, *argv])
    markdown, report = write_results(output, outcomes, machine, command)
    return outcomes, markdown, report
