"""`herd-operator wait NAME --for=condition=Succeeded`: block until a job's condition holds,
and say with the exit status whether it did (kubectl wait; `sbatch --wait` and submitit's
`result()`, whose exit is the job's outcome).

Apart from the reading commands: its answer is an exit status, decided by `verdict`, a
pure function of what the store says, and the loop that asks (`poll`) takes its clock and
its sleep as arguments, so the tests run its rounds without waiting.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from herd_operator.cli.arguments import Subcommands, add_command, state_dir_option
from herd_operator.cli.spec_files import (
    Declared,
    SpecsDirError,
    not_found,
    specs_dir,
    specs_dir_option,
)
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, open_store
from herd_operator.specs import ConditionStatus, ConditionType, get_condition, is_true
from herd_operator.specs.records import JobRecord

EXIT_TIMEOUT = 124
"""What `timeout(1)` exits with when the time ran out: the condition may still come."""
POLL_SECONDS = 0.5
"""How often `wait` reads the store (one row)."""

_T = TypeVar("_T")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")


def duration(text: str) -> float:
    """An argparse type: seconds from `90`, `90s`, `5m`, `1h30m`, `2d` (Go's and kubectl's
    spelling, and a plain number of seconds)."""
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION_PART.findall(text)
        if not parts or "".join(number + unit for number, unit in parts) != text:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a duration (examples: 90s, 5m, 1h30m, 2d, 600)"
            ) from None
        seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text}")
    return seconds


@dataclass(frozen=True)
class WaitFor:
    """What `--for` asks: a condition of a status (kubectl's `condition=TYPE[=STATUS]`),
    or the job's removal (`delete`)."""

    condition: str | None
    status: ConditionStatus = ConditionStatus.TRUE

    @property
    def deleted(self) -> bool:
        return self.condition is None

    def __str__(self) -> str:
        if self.condition is None:
            return "delete"
        return f"condition={self.condition}={self.status}"


def wait_for(text: str) -> WaitFor:
    """An argparse type: `condition=Succeeded`, `condition=Running=False`, `delete`. A
    condition's name is matched without regard to case (kubectl's `condition=complete`)."""
    if text == "delete":
        return WaitFor(None)
    known = {str(kind).lower(): str(kind) for kind in ConditionType}
    match = re.fullmatch(r"condition=([A-Za-z]+)(?:=(true|false|unknown))?", text, re.IGNORECASE)
    if match is None or match.group(1).lower() not in known:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected condition=TYPE[=True|False] or delete; TYPE one of "
            f"{', '.join(known.values())}"
        )
    status = ConditionStatus((match.group(2) or "True").capitalize())
    return WaitFor(known[match.group(1).lower()], status)


@dataclass(frozen=True)
class Verdict:
    code: int
    message: str


def verdict(record: JobRecord | None, wanted: WaitFor, name: str) -> Verdict | None:
    """What the wait ends with, given the job's record now; None: wait on.

    Met: 0. The job ended so that the condition can no longer come (it Failed while
    `Succeeded` was awaited, or the reverse; a finished job keeps its conditions until its
    spec changes), or it is gone: 1, at once, with the reason. A finished condition counts
    only for the generation the store holds: a job applied anew after it ended has not
    ended yet."""
    if record is None:
        if wanted.deleted:
            return Verdict(EXIT_OK, f"herdjob/{name} deleted")
        return Verdict(EXIT_FAILURE, f"error: herdjob/{name} was deleted")
    if wanted.deleted or wanted.condition is None:
        return None
    conditions = record.status.conditions
    condition = get_condition(conditions, wanted.condition)
    current = condition is not None and condition.observed_generation >= record.generation
    if condition is not None and condition.status == wanted.status and current:
        return Verdict(EXIT_OK, f"herdjob/{name} {wanted}: met")
    for ended in (ConditionType.Succeeded, ConditionType.Failed):
        final = get_condition(conditions, ended)
        if ended == wanted.condition or final is None or not is_true(conditions, ended):
            continue
        if final.observed_generation < record.generation:
            continue  # ended for an older spec: the operator runs the new one
        return Verdict(
            EXIT_FAILURE,
            f"error: herdjob/{name} {ended}: {final.reason}"
            + (f": {final.message}" if final.message else "")
            + f" (waited for {wanted})",
        )
    return None


def poll(
    probe: Callable[[], _T | None],
    timeout: float | None,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    interval: float = POLL_SECONDS,
) -> _T | None:
    """Ask `probe` until it answers (not None), every `interval` seconds by `clock`;
    None once `timeout` seconds have passed (None: no limit). The probe is asked once more
    at the deadline, so a condition met in the last interval is not reported late."""
    deadline = None if timeout is None else clock() + timeout
    while True:
        answer = probe()
        if answer is not None:
            return answer
        now = clock()
        if deadline is not None and now >= deadline:
            return None
        sleep(interval if deadline is None else max(0.0, min(interval, deadline - now)))


def add_commands(commands: Subcommands) -> None:
    wait = add_command(
        commands,
        "wait",
        cmd_wait,
        help="wait until a job's condition holds; the exit status says how it ended",
        description="Wait until the job's condition holds (kubectl wait). Exit status: 0 "
        "when it holds; 1 when it can no longer come (waiting for Succeeded, the job "
        "Failed, or the reverse; the job was deleted; no such job), with the reason on "
        f"stderr; {EXIT_TIMEOUT} (as timeout(1)) when --timeout passed first; 2 on a usage "
        "error. So `herd-operator wait JOB --for=condition=Succeeded && next-step` runs "
        "the next step only after a success.",
    )
    state_dir_option(wait)
    wait.add_argument("name", metavar="NAME")
    wait.add_argument(
        "--for",
        dest="wait_for",
        type=wait_for,
        required=True,
        metavar="CONDITION",
        help="condition=TYPE (Succeeded, Failed, Running, Suspended, ...), "
        "condition=TYPE=False, or delete",
    )
    wait.add_argument(
        "--timeout",
        type=duration,
        metavar="DURATION",
        help="give up after DURATION (90s, 5m, 1h30m, or seconds; default: no limit, "
        "as sbatch --wait: training takes hours)",
    )
    specs_dir_option(wait)


_clock: Callable[[], float] = time.monotonic
_sleep: Callable[[float], None] = time.sleep


def cmd_wait(args: argparse.Namespace) -> int:
    name: str = args.name
    wanted: WaitFor = args.wait_for
    with open_store(args.state_dir) as store:
        # A job declared but not recorded yet (an apply just before: the operator has not
        # read the file) is waited for; it counts as deleted only once it was seen.
        seen = False

        def probe() -> Verdict | None:
            nonlocal seen
            record = store.get_job(name)
            if record is None and not seen and not wanted.deleted:
                return _unrecorded(args, name)
            seen = True
            return verdict(record, wanted, name)

        answer = poll(probe, args.timeout, _clock, _sleep)
    if answer is None:
        print(
            f"error: timed out after {args.timeout:g}s waiting for {wanted} on herdjob/{name}",
            file=sys.stderr,
        )
        return EXIT_TIMEOUT
    print(answer.message, file=sys.stdout if answer.code == EXIT_OK else sys.stderr)
    return answer.code


def _unrecorded(args: argparse.Namespace, name: str) -> Verdict | None:
    """A job the operator has not recorded: None (wait for it) while a valid spec in the
    spec directory declares it; else why it never will be (NotFound, or its spec's first
    problem: the operator does not record a job whose spec was never valid)."""
    try:
        directory = specs_dir(args.specs_dir)
    except SpecsDirError:
        directory = None  # no spec directory here: what the store says is all there is
    try:
        declared = Declared.scan(directory).one_file(name) if directory else None
    except SpecsDirError as err:  # several files declare it: the operator runs none
        return Verdict(EXIT_FAILURE, f"error: {err}")
    except OSError:
        declared = None
    if declared is None:
        return Verdict(EXIT_FAILURE, not_found(name))
    if declared.job is None:
        return Verdict(
            EXIT_FAILURE,
            f"error: herdjob/{name} is not run: its spec is invalid ({declared.errors[0]})",
        )
    return None
