"""Which workers of an ended launch ran out of GPU memory, from the job's log.

A worker that runs out of GPU memory ends like any failed worker (an exception, exit status
1), so its exit says nothing of why; its output does: PyTorch's `torch.OutOfMemoryError:
CUDA out of memory. Tried to allocate ...` (older releases: `RuntimeError: CUDA out of
memory`), CUDA's own `CUDA error: out of memory`. Horovod prefixes each worker's lines with
its rank (`[1]<stderr>:`, after a time stamp when asked), torchrun with its local rank
(`[default1]:`, `[rank1]:`), so the worker is named too. On a shared GPU this tells the
user the job outgrew its memory share, not that the job is broken.

`out_of_memory_workers` is pure (lines in, workers out); `launch_output` reads the part of
the job's log that one launch wrote.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

OUT_OF_MEMORY = re.compile(
    r"OutOfMemoryError|CUDA out of memory|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY"
)
_WORKER_PREFIX = re.compile(
    r"^(?:[^\[]*?)\[(?:(?P<rank>\d+)\]<std(?:err|out)>|(?:default|rank)(?P<local>\d+)\]):"
)
UNNAMED_WORKER = "a worker"
"""How an out-of-memory line without a worker prefix names its worker."""

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
