"""The server's pool of connections that have not authenticated yet, and the line behind it.

Apart from the connection's callbacks: it is the server's defence against strangers, a
policy with a measured history of its own, and a connection only asks it for a place.

Connections that have not authenticated yet are a pool of their own (``max_unauthenticated``)
since anyone who can reach the port can open them. When the pool is full, a newcomer takes
the slot of the oldest connection that has sent no byte of its hello and is older than
``eviction_age`` (a real client answers the challenge in milliseconds, so that one is an
idler); a connection whose hello has begun is never dropped for a newcomer (its handshake
deadline still applies). If there is no such idler, the newcomer waits in line, silent,
and gets its challenge as soon as a place frees, or every ``eviction_age`` takes the
place of an idler that has become old enough; after ``handshake_timeout`` in line it is
refused with ``busy``. ``RpcClient`` retries a connection refused or dropped before the
welcome, with jittered exponential backoff, so a burst of workers larger than the pool
all get in.

The eviction age is fixed on purpose. One that stretched with the answer times of recent
successful handshakes (which strangers cannot feed) was built and measured against it in a
slow 7,168-worker burst (commit 8535ad8, docs/benchmarks.md): it did not stop the churn
(thousands of challenges went unanswered either way), bursts took longer (median 29.6 s
against 16.1 s over 7 pairs), and two of them left workers unserved. A longer age holds
the pool's places longer, and the line behind them waits out its deadline more often.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

_ABSENT = object()

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


class Pooled(Protocol):
    """What the pool needs of a connection."""

    peer: str
    admitted: float
    """The pool's clock when it got its place (and with it its challenge)."""
    speaking: bool
    """Whether the first byte of its hello has arrived: never evicted from then on."""

    def greet(self) -> None:
        """It has its place: send its challenge."""

    def evict(self) -> None:
        """It lost its place to a newcomer, as an idler: cut it off."""


class UnauthenticatedPool:
    """At most ``capacity`` connections in their handshake, in the order they got in; and
    the newcomers waiting for a place, in the order they came."""

    def __init__(self, capacity: int, eviction_age: float, clock: Callable[[], float]) -> None:
        self._capacity = capacity
        self._eviction_age = eviction_age
        self._clock = clock
        # In the order they were admitted (dicts keep it), so the first evictable one is the
        # oldest.
        self._members: dict[Pooled, None] = {}
        # Newcomers that found the pool full of young handshakes, in the order they came.
        self._line: dict[Pooled, None] = {}

    def admit(self, connection: Pooled, now: float) -> str | None:
        """Put ``connection`` in the pool, in the place of the oldest silent one older than
        eviction_age if it is full. Return None if it got in, else why not (for the log:
        it may wait in line, or be refused as busy)."""
        if len(self._members) >= self._capacity:
            oldest_allowed = now - self._eviction_age
            for other in self._members:
                if other.admitted > oldest_allowed:
                    # This one and every later one is too young to be taken for an idler.
                    return (
                        f"{self._capacity} connections are authenticating"
                        f" and none has been silent for {self._eviction_age:g} s"
                    )
                if not other.speaking:
                    del self._members[other]
                    other.evict()
                    logger.debug(
                        "dropped a silent unauthenticated connection for %s", connection.peer
                    )
                    break
            else:
                return f"{self._capacity} connections are sending their hello"
        connection.admitted = now
        self._members[connection] = None
        return None

    def wait_in_line(self, connection: Pooled) -> None:
        """``connection`` found no place: it gets the first one that frees."""
        self._line[connection] = None

    def leave_line(self, connection: Pooled) -> None:
        self._line.pop(connection, None)

    def release(self, connection: Pooled) -> None:
        """``connection`` leaves the pool (or the line): the first in line takes its place."""
        self._line.pop(connection, None)
        if self._members.pop(connection, _ABSENT) is _ABSENT:
            return
        while self._line and len(self._members) < self._capacity:
            first = next(iter(self._line))
            del self._line[first]
            first.admitted = self._clock()
            self._members[first] = None
            first.greet()
