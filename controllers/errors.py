"""The controllers' one error taxonomy: what the queue does with a failed reconcile.

A `TemporaryError` is worth retrying (the queue backs off per key and tries again):
a process that could not start, a database another process holds, a full disk that
may be freed. A `PermanentError` cannot be helped by retrying until the spec changes:
the reconciler shows it as the job's `Stalled` condition and the queue forgets the key.
Anything else is a bug; it is logged with its traceback and retried like a temporary
error, so one bad job never stops the loop. Runtime errors that are temporary by
nature (the store's `StoreError`) subclass `TemporaryError`, so the loop needs no
knowledge of the runtime to sort them.
"""

from __future__ import annotations


class TemporaryError(Exception):
    """Worth retrying: the queue backs off and tries the key again."""


class PermanentError(Exception):
    """Retrying cannot help until the spec changes; `reason` is the condition's reason."""

    def __init__(self, message: str, reason: str = "ReconcileError") -> None:
        super().__init__(message)
        self.reason = reason
