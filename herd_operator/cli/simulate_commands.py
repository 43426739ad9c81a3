"""`herd-operator simulate` and `replay`: workloads on a simulated cluster under the real
policies and allocator, and a recorded run simulated again (`herd_operator.simulate`).

Apart so the simulator, imported only when it runs, has one small door in the CLI.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from herd_operator.cli.arguments import (
    Subcommands,
    add_command,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from herd_operator.cli.views import EXIT_OK, EXIT_USAGE
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.specs.values import DEFAULT_MEASURE_STEPS

if TYPE_CHECKING:
    from herd_operator.policies.sharing import SharingLimits


def add_commands(commands: Subcommands) -> None:
    simulate = add_command(
        commands,
        "simulate",
        cmd_simulate,
        help="run a workload on a simulated cluster under the real policies and allocator",
    )
    simulate.add_argument(
        "workload", help="'perlmutter' (the generated Perlmutter-like mix) or a CSV trace"
    )
    simulate.add_argument("--pool", default="1792x4", help="NODESxGPUS (default: 1792x4)")
    simulate.add_argument(
        "--policy",
        default="fcfs,static,memory,goodput",
        help="comma-separated: fcfs (rigid, first come), static, memory, goodput, or any"
        " installed policy (default: fcfs,static,memory,goodput); NAME+spare: under an"
        " allocator that lends spare GPUs by the gain the policy reports; NAME+share: one"
        " that divides every GPU above the mins by that gain; NAME+small: one that admits"
        " the pending job with the smallest min first (combined: NAME+small+share);"
        " NAME+pack: jobs share GPUs by their memory, slowed by their neighbours;"
        " NAME+adaptive: the jobs of Pollux's traces train at the batch the policy picks;"
        " tiresias, optimus: the baselines of Pollux's artifact, rebuilt (not the operator's"
        " allocator; docs/simulation.md)",
    )
    simulate.add_argument("--jobs", type=positive_int, default=1000, help="generated jobs")
    simulate.add_argument(
        "--engine",
        choices=("horovod", "torchrun"),
        default="horovod",
        help="what runs every job: its resizes stall as that engine's measured ones"
        " (default: horovod)",
    )
    simulate.add_argument("--seed", type=int, default=1, help="seed of the generated mix")
    simulate.add_argument(
        "--share-utilization",
        type=positive_float,
        default=1.0,
        help="under NAME+pack: the jobs whose GPU utilization is at most this share GPUs"
        " (default 1.0: every job)",
    )
    simulate.add_argument(
        "--max-jobs-per-gpu",
        type=positive_int,
        default=4,
        help="under NAME+pack: jobs sharing one GPU at most (default 4, as run's)",
    )
    simulate.add_argument(
        "--max-gpu-utilization",
        type=positive_float,
        default=None,
        help="under NAME+pack: the summed GPU utilization of the jobs sharing one GPU at most"
        " (>= 1; 1.29 keeps every job within 25%% of its speed alone in the interference"
        " model; default: no cap)",
    )
    simulate.add_argument(
        "--share-backfill",
        action="store_true",
        help="under NAME+pack: sharing jobs may take the GPUs the whole-GPU jobs' arbitration"
        " left free while a whole-GPU job waits (default: only when none of their priority"
        " waits)",
    )
    simulate.add_argument(
        "--share-admit-first",
        action="store_true",
        help="under NAME+pack: waiting sharing jobs are admitted at their min before any"
        " sharing job grows, and free GPUs are kept for the first of them that waits"
        " (default: a running job grows first)",
    )
    simulate.add_argument(
        "--share-whole-first",
        action="store_true",
        help="under NAME+pack: a sharing job takes a free GPU before a shared one whose"
        " summed utilization it would take past 1.0 (default: shared GPUs first)",
    )
    simulate.add_argument(
        "--share-shrink-to-admit",
        action="store_true",
        help="under NAME+pack: the first waiting sharing job that fits nowhere, or a waiting"
        " whole-GPU job, may take GPUs from running sharing jobs of its priority or lower, down"
        " to their min, as the whole-GPU arbitration does (default: a sharing job is never"
        " shrunk to admit another job; not with --share-admit-first)",
    )
    simulate.add_argument(
        "--share-to-admit",
        action="store_true",
        help="under NAME+pack: a sharing job takes a GPU another job uses only to be admitted,"
        " after every free GPU, and grows onto free GPUs only (default: it grows onto shared"
        " GPUs too)",
    )
    simulate.add_argument(
        "--share-light-growth",
        action="store_true",
        help="under NAME+pack: a running job grows onto a shared GPU only where the summed"
        " utilization stays within 1.0; only admission crowds a GPU (default: growth too)",
    )
    simulate.add_argument(
        "--share-move-apart",
        action="store_true",
        help="under NAME+pack, with --share-shrink-to-admit: after admission and before"
        " growth, a running job's workers on GPUs past a summed utilization of 1.0 move to"
        " free GPUs (a move stalls it as a grow by one does; default: a worker stays where it"
        " was placed)",
    )
    simulate.add_argument(
        "--share-when-waiting",
        action="store_true",
        help="under NAME+pack: each sharing job gets the size the policy's division of whole"
        " GPUs gives it (+speedup's, +share's or fair share), on free GPUs first; only a job"
        " that division leaves waiting shares a GPU, at its min (default: each sharing job"
        " grows up to what it wants)",
    )
    simulate.add_argument(
        "--memory",
        choices=("guess", "published"),
        default="guess",
        help="a trace's GPU memory per worker: our earlier guess per application, or the"
        " estimate from published model and activation sizes (docs/simulation.md,"
        " 'Co-location'; default: guess)",
    )
    simulate.add_argument(
        "--load", type=positive_float, default=0.9, help="offered load of the mix (default 0.9)"
    )
    simulate.add_argument(
        "--tick",
        type=non_negative_float,
        default=0.0,
        help="decide at multiples of this many seconds (default 0: at each event)",
    )
    simulate.add_argument(
        "--resync",
        type=non_negative_float,
        default=0.0,
        help="reconcile every job again every this many seconds, as the operator's periodic"
        " resync (5 s there) does (default 0: only at each job's events)",
    )
    simulate.add_argument(
        "--max-wait",
        type=positive_float,
        default=DEFAULT_MAX_WAIT_SECONDS,
        help="under +small: a job pending this many seconds is admitted first"
        f" (default {DEFAULT_MAX_WAIT_SECONDS:g}, as run --max-wait)",
    )
    simulate.add_argument(
        "--measure-steps",
        type=non_negative_int,
        default=DEFAULT_MEASURE_STEPS,
        help="under NAME+adaptive: the workers report their measurement this many steps into"
        " each new size or batch, as a job's training.measureSteps (default"
        f" {DEFAULT_MEASURE_STEPS}, its default); 0: at epoch ends only",
    )
    simulate.add_argument(
        "--queue",
        choices=("fifo", "las", "srpt"),
        default="fifo",
        help="the allocator's queue for every policy that names none (NAME+las, NAME+srpt,"
        " NAME+fifo): las orders by service attained and srpt by work left, both preempting"
        " (every simulated job resumes from its last epoch; docs/simulation.md); fifo, the"
        " default, is arrival order without preemption, as the operator runs by default",
    )
    simulate.add_argument(
        "--output", type=Path, default=Path("sim-results"), help="default: ./sim-results"
    )
    replay = add_command(
        commands,
        "replay",
        cmd_replay,
        help="simulate a recorded run of the operator again and compare the two timelines",
    )
    replay.add_argument(
        "state",
        type=Path,
        help="the run's store: its state.db, the directory holding it, or a demo's --state-dir",
    )
    replay.add_argument(
        "--min-resize-interval",
        type=non_negative_float,
        default=30.0,
        help="the recorded operator's --min-resize-interval (default 30; the demo runs with 5)",
    )
    replay.add_argument(
        "--model-start",
        action="store_true",
        help="launch jobs in the simulator's constant start time, not in what each recorded"
        " job took from its first grant to its first epoch",
    )


def cmd_simulate(args: argparse.Namespace) -> int:
    from herd_operator.simulate.report import write
    from herd_operator.simulate.runner import (
        describe_timing,
        load_workload,
        parse_pool,
        simulate,
    )

    # The allocator's warnings (drains past 30 s when a tick delays the workers' reports)
    # are about simulated jobs: thousands of lines nobody needs.
    logging.getLogger("herd_operator.runtime.allocator").setLevel(logging.ERROR)
    arbitration_ms = 25.8  # docs/benchmarks.md: arbitrate() on 1,792 x 4 GPUs, 2,000 jobs
    try:
        pool = parse_pool(args.pool)
        workload = load_workload(
            args.workload, pool, args.jobs, args.seed, args.load, args.memory == "published"
        )
        jobs = [dataclasses.replace(job, engine=args.engine) for job in workload.jobs]
        workload = dataclasses.replace(workload, jobs=jobs)
        policies = [name.strip() for name in args.policy.split(",") if name.strip()]
        results = simulate(
            workload, pool, policies, args.tick, args.resync, max_wait_seconds=args.max_wait,
            queue=args.queue, share_utilization=args.share_utilization,
            sharing=_sharing_limits(args), measure_steps=args.measure_steps,
        )  # fmt: skip
    except ValueError as err:
        print(f"herd-operator simulate: {err}", file=sys.stderr)
        return EXIT_USAGE
    header = (
        f"{workload.description} on {args.pool} ({pool.size} GPUs), {args.engine} jobs,"
        f" tick {args.tick:g} s\n\n" + describe_timing(results, arbitration_ms)
    )
    if any("+pack" in policy for policy in policies):
        from herd_operator.simulate.share_report import sharing_table

        header += "\n\nCo-location (GPUs counted once however many jobs hold them):\n\n"
        header += sharing_table(results)
    paths = write(results, args.output, header)
    print((args.output / "summary.md").read_text())
    print(f"wrote {', '.join(str(path) for path in paths)}")
    return EXIT_OK


def _sharing_limits(args: argparse.Namespace) -> SharingLimits:
    """The sharing allocator's settings a `+pack` policy runs under (ValueError naming the
    option for a bad one)."""
    from dataclasses import replace

    from herd_operator.simulate.colocation import SIMULATED_SHARING

    cap = args.max_gpu_utilization
    if cap is not None and cap < 1.0:
        raise ValueError(f"--max-gpu-utilization must be >= 1 (one busy job's), got {cap:g}")
    if args.share_shrink_to_admit and args.share_admit_first:
        raise ValueError("--share-shrink-to-admit and --share-admit-first: choose one")
    if args.share_move_apart and not args.share_shrink_to_admit:
        raise ValueError("--share-move-apart: only with --share-shrink-to-admit")
    return replace(
        SIMULATED_SHARING,
        max_jobs_per_gpu=args.max_jobs_per_gpu,
        max_utilization=cap,
        backfill=args.share_backfill,
        admit_first=args.share_admit_first,
        whole_first=args.share_whole_first,
        shrink_to_admit=args.share_shrink_to_admit,
        share_to_admit=args.share_to_admit,
        light_growth=args.share_light_growth,
        move_apart=args.share_move_apart,
        share_when_waiting=args.share_when_waiting,
    )


def cmd_replay(args: argparse.Namespace) -> int:
    from herd_operator.policies.power_mean import GROW_STALL_SECONDS
    from herd_operator.simulate.model import SHRINK_STALL_SECONDS, START_SECONDS
    from herd_operator.simulate.replay import (
        describe,
        describe_stalls,
        measured_stalls,
        read_store,
        replay,
    )

    logging.getLogger("herd_operator.runtime.allocator").setLevel(logging.ERROR)
    path: Path = args.state
    for candidate in (path, path / "state.db", path / "state" / "state.db"):
        if candidate.is_file():
            path = candidate
            break
    else:
        print(f"herd-operator replay: no state.db at {args.state}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run = read_store(path)
        comparisons = replay(
            run,
            min_resize_interval=args.min_resize_interval,
            measured_start=not args.model_start,
        )
        stalls = [stall for job in run.jobs for stall in measured_stalls(job)]
    except ValueError as err:
        print(f"herd-operator replay: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: {len(run.jobs)} jobs on {run.pool_gpus} GPUs, replayed in the simulator\n")
    print(describe(comparisons, {job.name: job.arrival for job in run.jobs}))
    worst = max(abs(c.end_error) for c in comparisons)
    least = min(c.size_agreement for c in comparisons)
    print(f"\nworst completion error {worst:.1%}; least time with the same grant {least:.0%}")
    print(
        "\nLaunches and resizes as recorded (the simulator's model: first start"
        f" {START_SECONDS:g} s, grow {GROW_STALL_SECONDS:g} s, shrink {SHRINK_STALL_SECONDS:g} s)\n"
    )
    print(describe_stalls(stalls))
    return EXIT_OK
