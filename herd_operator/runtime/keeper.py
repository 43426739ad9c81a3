"""Keeps a job's exit status for an operator that may not be there to see it.

    python -m herd_operator.runtime.keeper EXIT_FILE -- COMMAND [ARG...]

The launcher runs every job through a keeper, in a session of its own. The keeper
starts the command in its own process group, waits for it, writes how it ended to
EXIT_FILE (atomically) and then ends the same way: the same status, or death by the
same signal, so an operator that is still its parent sees what the command did.

Jobs outlive the operator (crash-only): an operator that was killed and restarted
adopts the jobs still running and learns from their exit files how the others ended
while it was away, instead of running a finished job again.

SIGTERM, SIGINT and SIGHUP sent to the group reach the command as well; the keeper
only stays to record the command's end. A SIGKILL of the group ends both, and then
nothing is recorded: only an operator that is there sends one, and it knows why.
"""

from __future__ import annotations

# Only what the interpreter has loaded anyway: the keeper starts before every job, and each
# import (subprocess, pathlib, our layout module) added its milliseconds to spec-to-launch.
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

STAYS_FOR = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def exit_record(
    returncode: int, launch_error: str | None = None, *, started_at: float | None = None
) -> str:
    """The exit file's content: `returncode` as subprocess gives it (-N: killed by signal N),
    `launchError` when the command could not be executed at all, and the keeper's pid and
    start time (what an operator that never learnt them, killed as it started the keeper,
    reports for the launch)."""
    record: dict[str, object] = {
        "returncode": returncode,
        "ended_at": time.time(),
        "pid": os.getpid(),
        "started_at": started_at,
    }
    if launch_error is not None:
        record["launchError"] = launch_error
    return json.dumps(record) + "\n"


def read_exit_file(path: Path) -> int | None:
    """The recorded return code, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    code = data.get("returncode") if isinstance(data, dict) else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def read_exit_time(path: Path) -> float | None:
    """When the command ended, from its exit file (None when there is none)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ended_at = data.get("ended_at") if isinstance(data, dict) else None
    return float(ended_at) if isinstance(ended_at, (int, float)) and ended_at > 0 else None


def read_exit_start(path: Path) -> tuple[int | None, float | None]:
    """The keeper's pid and start time from its exit file (None for what it lacks)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, None
    if not isinstance(data, dict):
        return None, None
    pid, started_at = data.get("pid"), data.get("started_at")
    return (
        pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
        float(started_at) if isinstance(started_at, (int, float)) else None,
    )


def read_launch_error(path: Path) -> str | None:
    """Why the keeper could not execute the command, or None (it ran, or no record)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    error = data.get("launchError") if isinstance(data, dict) else None
    return error if isinstance(error, str) else None


def _write_private(path: Path, text: str) -> None:
    """Write `path` (0600) through a temporary file and a rename: a reader sees all or none."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _stay(signum: int, frame: FrameType | None) -> None:
    """A handler, not SIG_IGN: an ignored signal would stay ignored in the command."""


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m herd_operator.runtime.keeper EXIT_FILE -- COMMAND [ARG...]")
        return 2
    started_at = time.time()
    exit_file, command = Path(argv[0]), argv[2:]
    for signum in STAYS_FOR:
        signal.signal(signum, _stay)
    launch_error = None
    try:
        # Inherits stdio, environment, cwd and process group; the handlers above are reset.
        child = os.posix_spawnp(command[0], command, os.environ)
    except OSError as err:
        launch_error = f"cannot run {command[0]!r}: {err.strerror or err}"
        print(f"herd keeper: {launch_error}", file=sys.stderr, flush=True)
        returncode = 127
    else:
        returncode = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    try:
        _write_private(exit_file, exit_record(returncode, launch_error, started_at=started_at))
    except OSError as err:  # a full disk: the operator that is there still sees the status
        print(f"herd keeper: cannot record the exit status: {err}", file=sys.stderr, flush=True)
    if returncode < 0:
        if -returncode in STAYS_FOR:
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
        return 128 - returncode  # the shell's convention, if the signal did not end us
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
