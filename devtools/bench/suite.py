"""The developer benchmarks' registry and `python -m devtools.bench`, which runs them after
the product's own (`herd_operator.bench.suite.BENCHMARKS`).

A command of its own rather than a `herd-operator bench` that looks for this folder: the
installed command then runs, and offers, only what an installed package has, and the product
holds no import of `devtools`, not even a guarded one. The options and the results files are
`herd-operator bench`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from devtools.bench.history import run_history
from devtools.bench.multinode import run_multinode_resize
from devtools.bench.rpcflood import run_rpc_flood
from devtools.bench.rpcscale import run_allocator_rpc
from devtools.bench.soak import run_soak
from herd_operator.bench.harness import Benchmark
from herd_operator.bench.suite import BENCHMARKS, TRAINING, run_bench
from herd_operator.cli.arguments import positive_int

PROGRAM = ("python", "-m", "devtools.bench")

DEVELOPER_BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark(
        "multinode-resize",
        "spec edit -> first training step at the new world size, growing a job from one"
        " network-namespace host onto a second over ssh and back (real horovodrun; needs root)",
        run_multinode_resize,
        full_repeat=3,
        quick_repeat=1,
        requires=TRAINING,
    ),
    Benchmark(
        "allocator-rpc",
        "authenticated bind/report requests per second on loopback, 1/64/256 concurrent clients,"
        " against Redis PING; 7,168 workers binding at once",
        run_allocator_rpc,
        full_repeat=3,
        quick_repeat=1,
    ),
    Benchmark(
        "rpc-flood",
        "256 authenticated clients calling for 60 s while 1,100 unauthenticated connections"
        " are held open (reopened when dropped), against the same clients alone",
        run_rpc_flood,
        full_repeat=1,
        quick_repeat=1,
    ),
    Benchmark(
        "history",
        "10,000 jobs x 100 grant changes, half deleted: store size after the prune, its"
        " longest store hold, and an insert at the per-job bound",
        run_history,
        full_repeat=3,
        quick_repeat=1,
    ),
    Benchmark(
        "soak",
        "a real `herd-operator run` for 30 min (HERD_BENCH_SOAK_MINUTES) with jobs coming,"
        " resizing and going: its RSS, threads, fds and state dir over time",
        run_soak,
        full_repeat=1,
        quick_repeat=1,
        requires=("torch", "horovod.torch"),  # examples/train_plain.py
    ),
)

EVERY: tuple[Benchmark, ...] = (*BENCHMARKS, *DEVELOPER_BENCHMARKS)
"""What `python -m devtools.bench` runs and `--only` picks from: the product's benchmarks,
then the developer's, `soak` last so that the short ones report first."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=" ".join(PROGRAM),
        description="Run herd-operator's benchmarks and the developer benchmarks of the"
        f" checkout ({', '.join(bench.name for bench in DEVELOPER_BENCHMARKS)})."
        " Run from the checkout's root; docs/benchmarks.md says what each measures.",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1-2 repetitions")
    parser.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks")
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="where benchmarks.md and benchmarks.json go (default: ./bench-results)",
    )
    parser.add_argument(
        "--repeat", type=positive_int, help="measured repetitions (default: per benchmark)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 when every benchmark ran or was skipped, 1 when one failed, 2 for a
    usage error (an unknown name)."""
    args = build_parser().parse_args(argv)
    recorded = ["--quick"] if args.quick else []
    recorded += ["--only", args.only] if args.only else []
    recorded += ["--repeat", str(args.repeat)] if args.repeat else []
    recorded += ["--output", str(args.output)]
    try:
        outcomes, markdown, report = run_bench(
            quick=args.quick,
            only=args.only,
            output=args.output,
            repeat=args.repeat,
            argv=recorded,
            benchmarks=EVERY,
            program=PROGRAM,
        )
    except ValueError as err:
        print(f"{' '.join(PROGRAM)}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {markdown} and {report}")
    return 1 if any(outcome.error for outcome in outcomes) else 0
