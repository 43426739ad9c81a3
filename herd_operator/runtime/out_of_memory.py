"""Which workers of an ended launch ran out of GPU memory, from the job's log.

A worker that runs out of GPU memory ends like any failed worker (an exception, exit status
1), so its exit says nothing of why; its output does: PyTorch's `torch.OutOfMemoryError:
CUDA out of memory. Tried to allocate ...` (older releases: `RuntimeError: CUDA out of
memory`), CUDA's own `CUDA error: out of memory`. Horovod prefixes each worker's lines with
its rank (`[1]<stderr>:`, after a time stamp when asked), torchrun with its local rank
(`[default1]:`, `[rank1]:`), so the worker is named too. On a shared GPU this tells the
user the job outgrew its memory share, not that the job is broken.

`out_of_memory_workers` is pure (lines in, workers out); `launch_output` reads the part of
the job's log that one launch wrote, once it failed; `LogFollower` reads a running launch's
new lines, for `say_out_of_memory`: Elastic Horovod goes on without a worker that failed, so
its out of memory is said while the job runs (an `OutOfMemory` Warning, once per worker and
launch), not only when the whole launch fails.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from herd_operator.controllers.launching import out_of_memory_message
from herd_operator.controllers.ports import EventType
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic

log = logging.getLogger(__name__)

OUT_OF_MEMORY = re.compile(
    r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY"
)
_WORKER_PREFIX = re.compile(
    r"^(?:[^\[]*?)\[(?:(?P<rank>\d+)\]<std(?:err|out)>|(?:default|rank)(?P<local>\d+)\]):"
)
UNNAMED_WORKER = "a worker"
"""How an out-of-memory line without a worker prefix names its worker."""

OUT_OF_MEMORY_WATCH_SECONDS = 2.0
"""How often the running launches' new log lines are read (the `out-of-memory-watch` loop)."""
TAIL_BYTES = 256 * 1024
"""How much of the end of a job's log is read at an exit: a traceback's last lines are there."""


def out_of_memory_workers(lines: Iterable[str]) -> tuple[str, ...]:
    """The workers (`rank 1`, `local rank 0`, or `a worker` when the line names none) whose
    output says they ran out of GPU memory, each once, in the order first seen."""
    found: dict[str, None] = {}
    for line in lines:
        if not OUT_OF_MEMORY.search(line):
            continue
        prefix = _WORKER_PREFIX.match(line)
        if prefix is None:
            worker = UNNAMED_WORKER
        elif prefix["rank"] is not None:
            worker = f"rank {prefix['rank']}"
        else:
            worker = f"local rank {prefix['local']}"
        found.setdefault(worker, None)
    return tuple(found)


def launch_output(log_file: Path, launch_id: str, tail_bytes: int = TAIL_BYTES) -> list[str]:
    """The last lines of `log_file` that launch `launch_id` wrote: those after its header line
    (the launcher's `==== <time> launch <id>: ...`), or the whole tail when its header is
    further up. [] when the log cannot be read."""
    try:
        with log_file.open("rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - tail_bytes))
            raw = handle.read(tail_bytes)
    except OSError:
        return []
    lines = raw.decode("utf-8", errors="replace").splitlines()
    header = f" launch {launch_id}: "
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("==== ") and header in lines[index]:
            return lines[index + 1 :]
    return lines


class LogFollower:
    """The lines a job's log gains, from where it stood when the follower was made; at most
    `TAIL_BYTES` a call (a flood skips to its end: a traceback's last lines are there). A
    line still being written waits for its end."""

    def __init__(self, log_file: Path) -> None:
        self.log_file = log_file
        try:
            self._offset = log_file.stat().st_size
        except OSError:
            self._offset = 0
        self._partial = b""

    def new_lines(self, tail_bytes: int = TAIL_BYTES) -> list[str]:
        try:
            with self.log_file.open("rb") as handle:
                size = handle.seek(0, os.SEEK_END)
                if size < self._offset:  # truncated or replaced: from its start
                    self._offset, self._partial = 0, b""
                if size - self._offset > tail_bytes:
                    self._offset, self._partial = size - tail_bytes, b""
                handle.seek(self._offset)
                raw = handle.read(size - self._offset)
        except OSError:
            return []
        self._offset += len(raw)
        *complete, self._partial = (self._partial + raw).split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete]


RecordEvent = Callable[[str, EventType, str, str, float], object]
"""(job, type, reason, message, now): the store's `add_event`."""


def say_out_of_memory(
    news: Mapping[str, tuple[str, ...]], record_event: RecordEvent, now: float
) -> None:
    """An `OutOfMemory` Warning for each job whose running workers newly ran out of memory."""
    for job, workers in news.items():
        if workers:
            log.warning("%s", out_of_memory_message(job, workers))
            record_event(job, "Warning", "OutOfMemory", out_of_memory_message(job, workers), now)


class OutOfMemoryWatch:
    """The `out-of-memory-watch` loop: every `interval` seconds, the running launches' new
    out-of-memory workers (`Launcher.out_of_memory_news`) as `OutOfMemory` Warnings."""

    def __init__(
        self,
        news: Callable[[], Mapping[str, tuple[str, ...]]],
        record_event: RecordEvent,
        *,
        interval: float = OUT_OF_MEMORY_WATCH_SECONDS,
        health: LoopHealth | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._news = news
        self._record_event = record_event
        self._clock = clock
        self._loop = Periodic(
            "out-of-memory-watch",
            self.step,
            interval,
            what="reading the jobs' logs for workers out of GPU memory",
            health=health,
        )

    @property
    def name(self) -> str:
        return self._loop.name

    def step(self) -> None:
        say_out_of_memory(self._news(), self._record_event, self._clock())

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self._loop.stop(timeout)
