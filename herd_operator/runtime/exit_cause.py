"""What a failed launch's own process said of its failure, from the job's log.

The job's driver ends a failed run with one line of its own, unprefixed (a worker's lines
carry `[rank]<stderr>:`, the driver's log lines a time first): `herd-driver: <error>` from
the Horovod engine's driver, `herd-torchrun: <error>` from the torchrun engine's. Its exit
status alone (1) says nothing; this line names the cause (the workers' first meeting failed,
a worker exited with status 134, the grant file could not be read), and the job's `BackOff`
or `Failed` says it where people look instead of `herd-operator logs` only.

Pure: lines in, the error out; `Launcher.state` reads the lines once the launch failed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

DRIVER_ERROR = re.compile(r"^herd-(?:driver|torchrun): (?P<error>\S.*)$")
MAX_CONTINUATION_LINES = 3
"""Lines of the same error after its first (Horovod's names the first failed process and its
exit code on two more)."""
MAX_ERROR_CHARS = 400


def driver_error(lines: Sequence[str]) -> str:
    """The last error line the job's driver printed, with the lines that continue it (not
    a worker's, not blank, not the launcher's `====` header), joined by spaces and cut at
    `MAX_ERROR_CHARS`; '' when it printed none."""
    for index in range(len(lines) - 1, -1, -1):
        match = DRIVER_ERROR.match(lines[index])
        if match is None:
            continue
        parts = [match["error"].strip()]
        for line in lines[index + 1 : index + 1 + MAX_CONTINUATION_LINES]:
            text = line.strip()
            if not text or text.startswith(("[", "====")) or DRIVER_ERROR.match(text):
                break
            parts.append(text)
        error = " ".join(parts)
        return error if len(error) <= MAX_ERROR_CHARS else error[: MAX_ERROR_CHARS - 3] + "..."
    return ""
