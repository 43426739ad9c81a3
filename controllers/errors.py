"""The controllers' one error taxonomy: what the queue does with a failed reconcile.

A `TemporaryError` is worth retrying (the queue backs off per key and tries again):
a process that could not start, a database another process holds, a full disk that
may be freed. A `PermanentError` cannot be helped by retrying until the spec changes:
the reconciler shows it as the job's `Stalled` condition and the queue forgets the key.
Anything else is a bug; it is logged with its traceback and retried like a temporary
error, so one bad job never stops the loop; the `STALL_AFTER_FAILURES`-th failed
reconcile in a row shows the job `Stalled` too, and it is retried at the queue's
longest delay from then on. Runtime errors that are temporary by nature (the store's
`StoreError`) subclass `TemporaryError`, so the loop needs no knowledge of the runtime
to sort them; one that no wait mends (a damaged store) subclasses `PermanentError` as
well, which the loop checks first.

The queue's count of a key's failures in a row is the one count behind every delay: the
loop hands it to each reconcile, so a step that shows when the next try comes (a launch
failure) says what the queue will do, from the same `Backoff`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

# 2**62 times any sane base delay already exceeds any sane cap (as in the work queue).
_MAX_EXPONENT = 62


@dataclass(frozen=True)
class Backoff:
    """Delays that double from `base_seconds` up to `max_seconds`."""

    base_seconds: float
    max_seconds: float

    def delay(self, attempt: int) -> float:
        """The wait after the `attempt`-th failure in a row (from 1): what the work queue's
        `backoff(key, base_delay=..., max_delay=...)` returns for that failure."""
        exponent = min(max(attempt - 1, 0), _MAX_EXPONENT)
        return min(self.base_seconds * 2.0**exponent, self.max_seconds)


STALL_AFTER_FAILURES = 10
"""The failed reconcile in a row, ending in an unexpected error (a bug), that shows the job
`Stalled=True ReconcileError`: a bug that lasts is said where people look, not only in the
operator's log, and its retries go to the queue's longest delay. Ten tries of the queue's
50 ms doubling backoff span about 25 s: long enough to ride out a passing fault."""


class TemporaryError(Exception):
    """Worth retrying: the queue backs off and tries the key again."""

    backoff: ClassVar[Backoff | None] = None
    """The retries' delays; None: the queue's own (50 ms doubling to 30 s)."""
    shown: ClassVar[bool] = False
    """True when the reconciler showed the error in the job's status and a Warning event
    (logged with it) before raising it: the loop's line about the retry is then at info."""


class PermanentError(Exception):
    """Retrying cannot help until the spec changes; `reason` is the condition's reason."""

    def __init__(self, message: str, reason: str = "ReconcileError") -> None:
        super().__init__(message)
        self.reason = reason


LAUNCH_BACKOFF = Backoff(1.0, 60.0)
"""Launch failures are tried again after 1, 2, 4 ... 60 s: the cause (a missing
executable, a directory) is fixed by a person, not by the next 50 ms."""


class LaunchError(TemporaryError):
    """The job's command could not be started (no executable, no working directory, the
    keeper unable to execute it): not a failure of the job, which never ran.

    Raised by the reconciler after the status shows it (`Running=False LaunchFailed`, one
    Warning event whose count grows, the attempt and when the next one comes); the queue
    retries it on `LAUNCH_BACKOFF`, the key's one backoff, so nothing else keeps a retry
    time: an event (a spec edit that mends the command) tries again at once.
    """

    backoff = LAUNCH_BACKOFF
    shown = True
