"""The argparse pieces that several command groups share: the CLI's parser class, how a
command is registered, bounded number and size types, the `--state-dir` option and the
GPU metrics options.

Apart from the command modules so that each of them stays one group of commands, and so
that a bound or an option's help reads the same wherever it is used.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeAlias, TypeVar

from herd_operator.cli.views import EXIT_USAGE

_Number = TypeVar("_Number", int, float)

Subcommands: TypeAlias = "argparse._SubParsersAction[HerdArgumentParser]"
"""What `add_commands(commands)` of a command module registers its commands on."""

Handler: TypeAlias = Callable[[argparse.Namespace], int]
"""A command: the parsed arguments in, the exit code out."""

DIRECTORY_COMPLETION = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/"}
"""shtab's completion of a directory (its `shtab.DIRECTORY`), spelled out so that the CLI
imports shtab only for `herd-operator completion`."""

STATE_DIR_HELP = "the operator's state directory (default: $HERD_STATE_DIR or ./.herd-state)"


class UsageError(Exception):
    """A command was given arguments it cannot use, found after parsing (the parser finds
    the rest): `main` prints it as the parser does, and exits with EXIT_USAGE."""


def usage_message(message: str, prog: str) -> str:
    """A usage error as kubectl prints one: the problem on one line, then where help is.
    No usage dump: the line names the argument, and `--help` is one command away."""
    first_line = " ".join(message.split())
    return f"error: {first_line}\nSee '{prog} --help'.\n"


class HerdArgumentParser(argparse.ArgumentParser):
    """Usage errors print as kubectl's (`usage_message`), exit 2; an unknown flag is refused
    naming the command it was given to."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, usage_message(message, self.prog))

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.command_parsers.get(getattr(parsed, "command", None) or "")
            (command or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    @property
    def command_parsers(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def add_command(
    commands: Subcommands, name: str, handler: Handler, **kwargs: Any
) -> argparse.ArgumentParser:
    """The parser of the command `name` (kwargs as for `add_parser`), run by `handler`."""
    parser = commands.add_parser(name, **kwargs)
    parser.set_defaults(handler=handler)
    return parser


def state_dir_option(parser: argparse.ArgumentParser) -> None:
    # No default here: given before the command (`herd-operator --state-dir X get`) or after
    # it, one value lands in the namespace, and `main` fills in the default when neither did.
    action = parser.add_argument(
        "--state-dir", type=Path, default=argparse.SUPPRESS, help=STATE_DIR_HELP
    )
    action.complete = DIRECTORY_COMPLETION  # type: ignore[attr-defined]


def gpu_metrics_options(parser: argparse.ArgumentParser) -> None:
    """Options of the GPU metrics that the operator (one host) and node exporters serve."""
    parser.add_argument(
        "--process-metrics",
        action="store_true",
        help="also export each GPU process's memory, labelled with its pid (new series on "
        "every restart of a job's workers: off by default)",
    )
    parser.add_argument(
        "--dcgm-job-mapping-dir",
        type=Path,
        metavar="DIR",
        help="keep NVIDIA dcgm-exporter's HPC job mapping files for this host's GPUs in DIR "
        "(the DIR given to dcgm-exporter --hpc-job-mapping-dir), so its series carry "
        "hpc_job=<herd job>",
    )


def bounded(
    convert: Callable[[str], _Number], ok: Callable[[_Number], bool], rule: str, noun: str
) -> Callable[[str], _Number]:
    """An argparse type: convert, then check a bound; errors say what is allowed."""

    def parse(text: str) -> _Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


positive_int = bounded(int, lambda v: v >= 1, "must be at least 1", "an integer")
non_negative_int = bounded(int, lambda v: v >= 0, "must not be negative", "an integer")
port = bounded(int, lambda v: 0 <= v < 65536, "a port is 0..65535", "a port number")
positive_float = bounded(float, lambda v: v > 0, "must be positive", "a number")
non_negative_float = bounded(float, lambda v: v >= 0, "must not be negative", "a number")

_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5GB` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 2GiB, 512MiB, 1.5GB, 1048576)"
        )
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value
