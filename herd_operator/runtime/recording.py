"""How the allocator's decisions and events reach the store: after its lock is released.

The lock order is the store's lock before the allocator's, never the other way: a group of
RPC reports holds the store's transaction while it tells the allocator each job's world
size, and the loop's reconciles hold it while they request grants. So a decision never
writes to the store under the allocator's lock (that order deadlocked: a burst's decision
waited for the store held by a report group, which waited for the allocator). A change
only marks the state unrecorded and queues its events, under the lock; `flush`, called
once the lock is released, hands them over.

One thread records at a time; one that finds another recording leaves its change to it,
and the recording thread looks again after letting go, so no change is left behind. What
is recorded is always the state as it is when taken, so an older decision never
overwrites a newer one. A write that fails (a full disk) is tried again at the next
flush; the decision stands meanwhile (its grants are published and its jobs woken).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from herd_operator.specs.values import Allocation

log = logging.getLogger("herd_operator.runtime.allocator")

EventType = Literal["Normal", "Warning"]
EventSink = Callable[[str, EventType, str, str], object]
"""(job, type, reason, message): an event the allocator raises on its own."""


class Recorder:
    """The allocator's unrecorded state and unsent events, and the one way they leave."""

    def __init__(
        self,
        lock: threading.RLock,
        snapshot: Callable[[], Allocation],
        on_decision: Callable[[Allocation], None],
        on_event: EventSink,
    ) -> None:
        """`lock` is the allocator's; `snapshot()` (called under it) is its state now."""
        self._lock = lock
        self._snapshot = snapshot
        self._on_decision = on_decision
        self._on_event = on_event
        self._unrecorded = False
        self._events: list[tuple[str, EventType, str, str]] = []
        self._recording = threading.Lock()
        self._failing = False
        self._error: Exception | None = None

    def changed(self) -> None:
        """The state changed (call under the allocator's lock)."""
        self._unrecorded = True

    def event(self, job: str, kind: EventType, reason: str, message: str) -> None:
        """An event to record (call under the allocator's lock)."""
        self._events.append((job, kind, reason, message))

    def lost(self) -> None:
        """What was recorded was lost (the store rolled back the group it was written in):
        record the state again at the next flush."""
        with self._lock:
            self._unrecorded = True

    def error(self) -> Exception | None:
        """The store's error if the state is still not recorded, else None."""
        with self._lock:
            return self._error if self._unrecorded else None

    def flush(self) -> None:
        """Hand the store the latest state and the events; never under the allocator's lock."""
        while self._unrecorded or self._events:
            if not self._recording.acquire(blocking=False):
                return  # the thread recording now looks again once it lets go
            try:
                while True:
                    with self._lock:
                        events, self._events = self._events, []
                        allocation = self._snapshot() if self._unrecorded else None
                        self._unrecorded = False
                    if allocation is None and not events:
                        break
                    self._send(events)
                    if allocation is not None and not self._write(allocation):
                        return
            finally:
                self._recording.release()

    def _send(self, events: list[tuple[str, EventType, str, str]]) -> None:
        for job, kind, reason, message in events:
            try:
                self._on_event(job, kind, reason, message)
            except Exception as err:  # logged with its text when it was raised
                log.warning("%s: cannot record the event %s: %s", job, reason, err)

    def _write(self, allocation: Allocation) -> bool:
        """Hand `allocation` to the store; False (and said once until it works again) if it
        refused."""
        try:
            self._on_decision(allocation)
        except Exception as err:
            with self._lock:
                self._unrecorded = True
                self._error = err
            if not self._failing:
                self._failing = True
                log.error(
                    "cannot record the allocator's decision (tried again at each change or"
                    " request; the grants stand): %s", err,
                )  # fmt: skip
            return False
        if self._failing:
            self._failing = False
            log.warning("the allocator's decisions are recorded again")
        return True
