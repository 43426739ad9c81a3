"""`herd-operator check-state`: the state store checked for damage, as the operator checks
it at start.

Apart from the reading commands: it checks the store itself, not what the jobs did.
"""

from __future__ import annotations

import argparse
import sys

from herd_operator.cli.arguments import Subcommands, add_command, state_dir_option
from herd_operator.cli.views import EXIT_OK, open_store
from herd_operator.runtime.store import UnreadableSpecError


def add_commands(commands: Subcommands) -> None:
    check = add_command(
        commands,
        "check-state",
        cmd_check_state,
        help="check the state store for damage (exit 1 if damaged)",
    )
    state_dir_option(check)
    check.add_argument(
        "--full",
        action="store_true",
        help="SQLite's integrity_check (indexes too; ~3x slower) instead of quick_check",
    )


def cmd_check_state(args: argparse.Namespace) -> int:
    """The check the operator makes at start (read-only: it may run meanwhile), and the
    jobs whose stored spec is unreadable (each says so on stderr)."""
    with open_store(args.state_dir) as store:
        store.check(full=args.full)
        records = store.list_jobs()
        unreadable = 0
        for record in records:
            try:
                record.spec  # noqa: B018
            except UnreadableSpecError as err:
                unreadable += 1
                print(f"herd-operator: {err}", file=sys.stderr)
    print(
        f"state store {store.path}: no damage found ({len(records)} jobs"
        + (f", {unreadable} with an unreadable spec" if unreadable else "")
        + ")"
    )
    return EXIT_OK
