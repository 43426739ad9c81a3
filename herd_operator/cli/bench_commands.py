"""`herd-operator bench`: the operator measured against baselines (`herd_operator.bench`).

Apart so the benchmarks, imported only when they run, have one small door in the CLI.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from herd_operator.cli.arguments import Subcommands, add_command, positive_int
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE


def add_commands(commands: Subcommands) -> None:
    bench = add_command(commands, "bench", cmd_bench, help="measure the operator against baselines")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, 1-2 repetitions")
    bench.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks")
    bench.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="where benchmarks.md and benchmarks.json go (default: ./bench-results)",
    )
    bench.add_argument(
        "--repeat", type=positive_int, help="measured repetitions (default: per benchmark)"
    )


def cmd_bench(args: argparse.Namespace) -> int:
    from herd_operator.bench.suite import run_bench

    argv = ["--quick"] if args.quick else []
    argv += ["--only", args.only] if args.only else []
    argv += ["--repeat", str(args.repeat)] if args.repeat else []
    argv += ["--output", str(args.output)]
    try:
        outcomes, markdown, report = run_bench(
            quick=args.quick, only=args.only, output=args.output, repeat=args.repeat, argv=argv
        )
    except ValueError as err:
        print(f"herd-operator bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {markdown} and {report}")
    return EXIT_FAILURE if any(outcome.error for outcome in outcomes) else EXIT_OK
