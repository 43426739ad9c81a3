"""A deduplicating work queue with per-key exponential backoff, after client-go's workqueue.

Keys are job names. Reconcile workers loop on ``get()`` / ``done()``; the
watcher and the controllers ``add()`` keys. The guarantees:

- Dedup: ``add(key)`` of a key that is already waiting does nothing, so a burst
  of file events for one job yields one reconcile.
- One worker per key: a key being processed (handed out by ``get`` and not yet
  ``done``) is never handed out again. Adding it meanwhile marks it dirty, and
  ``done(key)`` re-queues it exactly once, so the change is not lost.
- ``add_after(key, delay)`` makes the key ready at ``clock() + delay``. A later
  ``add_after`` never postpones an earlier pending one, and an immediate
  ``add`` wins over any pending delay.
- ``get(timeout)`` blocks until a key is ready and returns ready keys in FIFO
  order (delayed keys join in due-time order). It returns None when the
  timeout passes or once ``shutdown()`` was called; after shutdown, adds are
  ignored, so workers drain out instead of picking up new work.
- Backoff: ``backoff(key)`` counts a failure and returns
  ``min(base_delay * 2**(failures - 1), max_delay)`` (the base and cap may be given per
  call, for a slower schedule of some failures); ``add_rate_limited(key)``
  re-adds the key after that delay; ``forget(key)`` resets the count after a
  success.
- ``len(queue)`` counts the ready plus the delayed keys.

Due times use the injectable ``clock``; ``get``'s timeout is real time, because
it is how long the calling thread blocks. Waiting is on a condition variable,
woken by adds or when the earliest delayed key falls due; no polling.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable

# 2**62 times any sane base delay already exceeds any sane cap; bounding the
# exponent keeps the float arithmetic from overflowing after many failures.
_MAX_BACKOFF_EXPONENT = 62


class WorkQueue:
    """Thread-safe dedup queue of job names with delayed adds and per-key backoff."""

    def __init__(
        self,
        base_delay: float = 0.05,
        max_delay: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if base_delay <= 0:
            raise ValueError(f"base_delay must be positive, got {base_delay}")
        if max_delay < base_delay:
            raise ValueError(f"max_delay ({max_delay}) must be >= base_delay ({base_delay})")
        self._base_delay = base_delay
        self._max_delay = max_delay
        self._clock = clock
        self._cond = threading.Condition()
        self._ready: deque[str] = deque()
        self._ready_set: set[str] = set()
        self._processing: set[str] = set()
        self._dirty: set[str] = set()
        self._due: dict[str, float] = {}
        # (due, sequence, key); entries whose due no longer matches _due are stale.
        self._due_heap: list[tuple[float, int, str]] = []
        self._sequence = itertools.count()
        self._failures: dict[str, int] = {}
        self._shut_down = False

    def add(self, key: str) -> None:
        """Make ``key`` ready now (deduplicated; deferred to ``done`` while it is processed)."""
        with self._cond:
            if self._shut_down:
                return
            self._due.pop(key, None)
            self._make_ready(key)

    def add_after(self, key: str, delay: float) -> None:
        """Make ``key`` ready ``delay`` seconds from now, unless it is due sooner already."""
        if delay <= 0:
            self.add(key)
            return
        with self._cond:
            if self._shut_down or key in self._ready_set or key in self._dirty:
                return
            due = self._clock() + delay
            pending = self._due.get(key)
            if pending is not None and pending <= due:
                return
            self._due[key] = due
            heapq.heappush(self._due_heap, (due, next(self._sequence), key))
            # A waiting get() may be sleeping towards a later due time.
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> str | None:
        """Take the next ready key, blocking up to ``timeout`` seconds (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._shut_down:
                    return None
                self._promote_due()
                if self._ready:
                    key = self._ready.popleft()
                    self._ready_set.remove(key)
                    self._processing.add(key)
                    return key
                wait: float | None = None
                if deadline is not None:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        return None
                if self._due_heap:
                    until_due = max(self._due_heap[0][0] - self._clock(), 0.0)
                    wait = until_due if wait is None else min(wait, until_due)
                self._cond.wait(wait)

    def done(self, key: str) -> None:
        """Mark ``key`` processed; re-queue it if it was added while being processed."""
        with self._cond:
            if key not in self._processing:
                raise ValueError(f"done({key!r}): key is not being processed")
            self._processing.remove(key)
            if key in self._dirty:
                self._dirty.remove(key)
                if not self._shut_down:
                    self._make_ready(key)

    def backoff(
        self, key: str, *, base_delay: float | None = None, max_delay: float | None = None
    ) -> float:
        """Count a failure of ``key`` and return the delay before its next try.

        ``base_delay`` and ``max_delay`` replace the queue's for this delay (a slower
        schedule for some failures); the count of failures is the key's either way."""
        with self._cond:
            exponent = self._failures.get(key, 0)
            self._failures[key] = exponent + 1
        base = self._base_delay if base_delay is None else base_delay
        delay = base * 2.0 ** min(exponent, _MAX_BACKOFF_EXPONENT)
        return min(delay, self._max_delay if max_delay is None else max_delay)

    @property
    def max_delay(self) -> float:
        """The longest delay ``backoff`` gives by default (its cap)."""
        return self._max_delay

    def add_rate_limited(self, key: str) -> None:
        """Re-add ``key`` after its backoff delay (counts one more failure)."""
        self.add_after(key, self.backoff(key))

    def forget(self, key: str) -> None:
        """Reset the failure count of ``key`` (call after it succeeded)."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: str) -> int:
        """How many failures of ``key`` were counted since it was last forgotten."""
        with self._cond:
            return self._failures.get(key, 0)

    def shutdown(self) -> None:
        """Stop the queue: every blocked and later ``get`` returns None, adds are ignored."""
        with self._cond:
            self._shut_down = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            self._promote_due()
            return len(self._ready) + len(self._due)

    def _make_ready(self, key: str) -> None:
        if key in self._processing:
            self._dirty.add(key)
        elif key not in self._ready_set:
            self._ready.append(key)
            self._ready_set.add(key)
            self._cond.notify()

    def _promote_due(self) -> None:
        now = self._clock()
        while self._due_heap and self._due_heap[0][0] <= now:
            due, _, key = heapq.heappop(self._due_heap)
            if self._due.get(key) == due:
                del self._due[key]
                self._make_ready(key)
