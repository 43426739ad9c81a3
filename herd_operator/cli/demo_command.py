"""`herd-operator demo`: its options; the demo itself is `cli/demo.py`.

Apart from the demo because the demo imports the whole operator, which the other
commands start without: it is imported only when the demo runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from herd_operator.cli.arguments import Subcommands, add_command, positive_float, positive_int
from herd_operator.cli.foreground import configure_logging

DEMO_STATE_DIR = Path(".herd-demo")
"""The demo's state directory when none is given (not $HERD_STATE_DIR: the demo wipes it)."""


def add_commands(commands: Subcommands) -> None:
    demo = add_command(
        commands, "demo", cmd_demo, help="run the example jobs on this machine, end to end"
    )
    demo.set_defaults(state_dir_default=DEMO_STATE_DIR)
    demo.add_argument(
        "--state-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="where the demo keeps its jobs, state and logs (default: ./.herd-demo; wiped first)",
    )
    demo.add_argument("--virtual-gpus", type=positive_int, default=4)
    demo.add_argument(
        "--engine",
        choices=("horovod", "torchrun"),
        default="horovod",
        help="run the example jobs on Horovod (default) or on torchrun, which needs no Horovod",
    )
    demo.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="give up after this many seconds (default: 600)",
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from herd_operator.cli.demo import run_demo

    configure_logging("INFO")
    code: int = run_demo(args.state_dir, args.virtual_gpus, args.timeout, args.engine)
    return code
