"""`herd-operator`: run the operator, and look at what it did.

    herd-operator run --specs-dir jobs --hosts localhost:4
    herd-operator get [NAME] [-o wide|json|yaml|name] [-l SELECTOR] [--sort-by KEY]
                      [-L KEY,...] [--show-labels] [--no-headers] [-w]
    herd-operator report [--format png|svg|pdf|text|json|csv] [--output FILE]
    herd-operator describe NAME
    herd-operator logs NAME [-f] [--tail N]
    herd-operator events [NAME] [-w]
    herd-operator check-state [--full]
    herd-operator apply -f FILE|DIR|-
    herd-operator delete NAME... | -l SELECTOR [--wait]
    herd-operator suspend NAME... / resume NAME...
    herd-operator wait NAME --for=condition=Succeeded [--timeout 2h]
    herd-operator validate FILE|DIR|-...
    herd-operator schema
    herd-operator demo
    herd-operator completion bash|zsh

Every command takes the same `--state-dir` (default `$HERD_STATE_DIR`, else
`./.herd-state`), before the command or after it; the reading commands work while the
operator runs and after.

This module only assembles the parser from the command groups and dispatches: each group
is one module with `add_commands(commands)`, which registers its commands and their
handlers; a new group is that module and one line in `COMMAND_GROUPS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from herd_operator.cli import (
    agent,
    apply,
    bench_commands,
    completion,
    demo_command,
    reading,
    run,
    simulate_commands,
    spec_commands,
    state,
    wait,
)
from herd_operator.cli.arguments import (
    Handler,
    HerdArgumentParser,
    Subcommands,
    UsageError,
    state_dir_option,
    usage_message,
)
from herd_operator.cli.report import command as report_command
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE
from herd_operator.layout import default_state_dir
from herd_operator.runtime.store import StoreError


class _CommandGroup(Protocol):
    """A module of commands: it registers each of them, with its handler, on `commands`."""

    def add_commands(self, commands: Subcommands) -> None: ...


COMMAND_GROUPS: tuple[_CommandGroup, ...] = (
    run,
    agent,
    reading,
    apply,
    wait,
    state,
    report_command,
    spec_commands,
    demo_command,
    bench_commands,
    simulate_commands,
    completion,
)
"""In the order `herd-operator --help` lists their commands."""


def _version() -> str:
    # Imported here: reading the distribution's metadata costs tens of milliseconds, which
    # every command (the operator's restart among them) paid for a flag it rarely gets.
    import importlib.metadata

    try:
        return importlib.metadata.version("herd-operator")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """`--version`, whose text is read only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"herd-operator {_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = HerdArgumentParser(
        prog="herd-operator",
        description="Share the GPUs of an allocation among elastic Horovod jobs declared as YAML.",
    )
    parser.add_argument("--version", action=_VersionAction)
    state_dir_option(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "state_dir", None) is None:
        # A command may have its own (the demo's, which it wipes), else $HERD_STATE_DIR's.
        args.state_dir = getattr(args, "state_dir_default", None) or default_state_dir()
    handler: Handler = args.handler
    try:
        return handler(args)
    except UsageError as err:  # found by the command, printed as the parser's own
        sys.stderr.write(usage_message(str(err), f"herd-operator {args.command}"))
        return EXIT_USAGE
    except StoreError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # Ctrl-C ends a watch or a follow: that is how one stops them
        if getattr(args, "watch", False) or getattr(args, "follow", False):
            return EXIT_OK
        raise
    except BrokenPipeError:  # `herd-operator schema | head`: the reader left, that is fine
        sys.stderr.close()
        return EXIT_OK
    except OSError as err:  # a file of the state dir that cannot be read: one line, no trace
        where = f"{err.filename}: {err.strerror}" if err.filename else str(err)
        print(f"herd-operator: {where}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
