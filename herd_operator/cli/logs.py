"""`herd-operator logs NAME [-f] [--tail N]`: a job's output, as `kubectl logs` shows a pod's.

The launcher appends everything a job prints (horovodrun's and every worker's stdout and
stderr, one header line per launch) to `<state-dir>/logs/<job>.log`. Following reads the
file as it grows; a file that shrank (truncated, e.g. `: > job.log`) is read again from
its start, and one that was replaced (rotated: renamed away and created again, as
logrotate does) is read to its end and then the new one from its start, so no line is
lost or shown twice.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

FOLLOW_POLL_SECONDS = 0.25
TAIL_BLOCK_BYTES = 64 * 1024


def tail_offset(handle: BinaryIO, lines: int) -> int:
    """Where the last `lines` lines of the file start (a last line without a newline counts)."""
    end = handle.seek(0, os.SEEK_END)
    if lines <= 0:
        return end
    position = end
    newlines = 0
    # A final newline ends the last line; it does not start another one.
    handle.seek(max(0, end - 1))
    if end and handle.read(1) == b"\n":
        position = end - 1
    while position > 0:
        start = max(0, position - TAIL_BLOCK_BYTES)
        handle.seek(start)
        block = handle.read(position - start)
        index = len(block)
        while (index := block.rfind(b"\n", 0, index)) != -1:
            newlines += 1
            if newlines == lines:
                return start + index + 1
        position = start
    return 0


@dataclass
class LogFollower:
    """Reads a log file from an offset on, across truncation and rotation."""

    path: os.PathLike[str] | str
    write: Callable[[bytes], None]
    notice: Callable[[str], None]
    _handle: BinaryIO | None = None
    _inode: int | None = None

    def open(self, offset: int | None = None, tail: int | None = None) -> bool:
        """Open the file at `offset` (or `tail` lines before its end); False if it is absent."""
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 (kept open while following)
        except FileNotFoundError:
            return False
        if tail is not None:
            handle.seek(tail_offset(handle, tail))
        elif offset is not None:
            handle.seek(offset)
        self._handle = handle
        self._inode = os.fstat(handle.fileno()).st_ino
        return True

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def pump(self) -> None:
        """Write what was appended since the last call; notice truncation and rotation."""
        if self._handle is None and not self.open(offset=0):
            return  # not written yet: the job has not started
        assert self._handle is not None
        self._drain()
        try:
            current = os.stat(self.path)
        except FileNotFoundError:
            return  # rotated away and not created again yet: keep the old one open
        if current.st_ino != self._inode:
            self._drain()  # the last lines written to the old file before the rename
            self.close()
            self.notice(f"{self.path} was replaced (rotated): reading the new file")
            self.open(offset=0)
            self._drain()
        elif current.st_size < self._handle.tell():
            self.notice(f"{self.path} was truncated: reading it again from its start")
            self._handle.seek(0)
            self._drain()

    def _drain(self) -> None:
        assert self._handle is not None
        while chunk := self._handle.read(TAIL_BLOCK_BYTES):
            self.write(chunk)


def show_log(
    path: os.PathLike[str] | str,
    tail: int | None,
    follow: bool,
    still_running: Callable[[], bool],
    deadline: float | None = None,
) -> bool:
    """Print the log (its last `tail` lines); with `follow`, keep printing what is appended
    until `still_running()` says the job ended (or `deadline`, on time.monotonic()).

    Returns False when there is no log file and nothing to follow.
    """
    out = sys.stdout.buffer

    def write(chunk: bytes) -> None:
        out.write(chunk)
        out.flush()

    def notice(text: str) -> None:
        print(f"herd-operator logs: {text}", file=sys.stderr, flush=True)

    follower = LogFollower(path, write, notice)
    found = follower.open(offset=0, tail=tail)
    if not follow:
        if found:
            follower.pump()
            follower.close()
        return found
    try:
        while True:
            running = still_running()  # asked before reading: lines written up to the end show
            follower.pump()
            if not running or (deadline is not None and time.monotonic() >= deadline):
                return True
            time.sleep(FOLLOW_POLL_SECONDS)
    finally:
        follower.close()
