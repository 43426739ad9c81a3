"""The server's pool of connections that have not authenticated yet, and the line behind it.

Apart from the connection's callbacks: it is the server's defence against strangers, a
policy with a measured history of its own, and a connection only asks it for a place.

Connections that have not authenticated yet are a pool of their own (``max_unauthenticated``)
since anyone who can reach the port can open them. A connection in the pool has its
challenge; a real client answers it in milliseconds, and its hello, whole or begun, makes it
*speaking*.

When the pool is full, a newcomer takes the place of the oldest silent connection (no byte
of its hello read, and none waiting unread in the kernel: a hello that has arrived is read,
never dropped) once that one is older than ``eviction_age``. If there is none, the newcomer
waits in line, silent, and gets its challenge when a place frees or an idler becomes old
enough, first come first served (a newcomer never passes the line), so a burst of workers
larger than the pool all get in.

Nobody waits longer than ``max_wait`` (the handshake deadline, 5 s): a connection that has
waited that long takes the oldest place at once, whatever its age (the oldest silent one's;
the oldest speaking one's if none is silent), and so does the line's first whenever the
line outgrows the places authenticated connections leave (``max_connections`` bounds the
two together). The pool then turns over by arrivals, not by time: a silent connection
keeps its place for ``eviction_age``, or until ``max_unauthenticated - 1`` later ones have
got theirs (fewer only if older ones are speaking), so a client that answers within that
many arrivals is never dropped, and strangers can neither keep workers out nor take their
places in ``max_connections``. ``busy`` is left for a waiter that finds every place's hello
waiting unread (``RpcClient`` retries it).

Before (issue 27) a waiter was refused as ``busy`` at its handshake deadline (5 s) and went
back to the end of a line that connections which never answered, reconnecting the moment
they were dropped, kept full while the pool let 256 in a second: 5 of 100 fresh workers
failed in a flood of 106,902 reconnects (0 of 100 in ``scripts/rpc_churn_probe.py``'s flood
of 4,096 connections).

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
from typing import Protocol, TypeVar

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")

Member = TypeVar("Member")

_ABSENT = object()


def choose_victim(
    oldest_silent: tuple[Member, float] | None,
    oldest_speaking: Member | None,
    *,
    now: float,
    eviction_age: float,
    forced: bool,
) -> Member | None:
    """Whose place in a full pool a newcomer takes; None if nobody's.

    ``oldest_silent``: the silent member admitted first, with the clock's time it was
    admitted; ``oldest_speaking``: the speaking member (a hello begun) that began first;
    each None if the pool has none. Not ``forced`` (a newcomer, or the line, looking for a
    place): the oldest silent member once ``eviction_age`` has passed since it was admitted,
    so a client gets that long to answer. ``forced`` (a waiter at its ``max_wait``, or a line
    past its room: a flood): the oldest silent member whatever its age, else the oldest
    speaking one, so that whatever holds the pool, the oldest place turns over.
    """
    if oldest_silent is not None:
        member, admitted = oldest_silent
        if forced or now - admitted >= eviction_age:
            return member
    if forced:
        return oldest_speaking
    return None


class Pooled(Protocol):
    """What the pool needs of a connection."""

    peer: str
    admitted: float
    """The pool's clock when it got its place (and with it its challenge)."""

    def greet(self) -> None:
        """It has its place: send its challenge."""

    def evict(self) -> None:
        """It lost its place to a newcomer: cut it off."""

    def refuse(self, reason: str) -> None:
        """It is pushed out of the line with no place to go: refuse it as busy."""

    def unread(self) -> bool:
        """Whether bytes from it wait unread (its hello, arrived while the server was busy)."""


class UnauthenticatedPool:
    """At most ``capacity`` connections in their handshake, silent ones in the order they
    got in and speaking ones in the order they began; and the newcomers waiting for a place,
    in the order they came."""

    def __init__(self, capacity: int, eviction_age: float, clock: Callable[[], float]) -> None:
        self._capacity = capacity
        self._eviction_age = eviction_age
        self._clock = clock
        # Dicts keep their order, so the oldest of each is the first.
        self._silent: dict[Pooled, None] = {}
        self._speaking: dict[Pooled, None] = {}
        self._line: dict[Pooled, None] = {}

    def __len__(self) -> int:
        return len(self._silent) + len(self._speaking)

    def waiting(self) -> int:
        return len(self._line)

    def arrive(self, connection: Pooled, now: float, line_room: int) -> None:
        """A newcomer: it gets a place (``greet``) if one is free, or an idler is old enough,
        and nobody waits before it; else it waits in line. ``line_room``: how many may wait
        (the places authenticated connections leave); past it, the line's first takes the
        oldest place at once, whatever its age."""
        if not self._line and len(self) < self._capacity:
            self._admit(connection, now)
            return
        self._line[connection] = None
        self.recheck(now)
        if len(self._line) > line_room:
            self._force(next(iter(self._line)), now)

    def recheck(self, now: float) -> None:
        """The line takes the places of idlers that have become old enough, first come first
        served (at each arrival, and at each waiting connection's timer)."""
        while self._line:
            victim = self._victim(now, forced=False)
            if victim is None:
                return
            self._replace(victim, next(iter(self._line)), now)

    def expire(self, connection: Pooled, now: float) -> None:
        """``connection`` has waited its deadline in line: it takes the oldest place,
        whatever its age, rather than go back to the end of the line."""
        if connection in self._line:
            self._force(connection, now)

    def spoke(self, connection: Pooled) -> None:
        """The first byte of ``connection``'s hello has arrived."""
        if self._silent.pop(connection, _ABSENT) is not _ABSENT:
            self._speaking[connection] = None

    def release(self, connection: Pooled) -> None:
        """``connection`` leaves the pool (or the line): the first in line takes its place."""
        self._line.pop(connection, None)
        if (
            self._silent.pop(connection, _ABSENT) is _ABSENT
            and self._speaking.pop(connection, _ABSENT) is _ABSENT
        ):
            return
        while self._line and len(self) < self._capacity:
            first = next(iter(self._line))
            del self._line[first]
            self._admit(first, self._clock())

    def _admit(self, connection: Pooled, now: float) -> None:
        connection.admitted = now
        self._silent[connection] = None
        connection.greet()

    def _force(self, waiter: Pooled, now: float) -> None:
        victim = self._victim(now, forced=True)
        if victim is not None:
            self._replace(victim, waiter, now)
            return
        # Every member's hello waits unread: they are about to leave; this one retries.
        del self._line[waiter]
        waiter.refuse(f"{self._capacity} hellos waiting to be read")

    def _replace(self, victim: Pooled, waiter: Pooled, now: float) -> None:
        """``waiter`` leaves the line for ``victim``'s place."""
        del self._line[waiter]
        self._silent.pop(victim, None)
        self._speaking.pop(victim, None)
        victim.evict()
        logger.debug("dropped an unauthenticated connection for %s", waiter.peer)
        self._admit(waiter, now)

    def _victim(self, now: float, *, forced: bool) -> Pooled | None:
        """``choose_victim`` over the pool; a silent one it picks whose hello waits unread in
        the kernel is speaking from now on (it is read in this turn of the loop), never
        dropped, and the choice is made again. Only a pick is peeked at (a system call):
        every waiting connection looks for an old idler once an eviction age."""
        while True:
            silent = next(iter(self._silent), None)
            victim = choose_victim(
                None if silent is None else (silent, silent.admitted),
                self._oldest_speaking() if forced and silent is None else None,
                now=now,
                eviction_age=self._eviction_age,
                forced=forced,
            )
            if victim is not silent or victim is None or not victim.unread():
                return victim
            self.spoke(victim)

    def _oldest_speaking(self) -> Pooled | None:
        """The oldest speaking member, unless the rest of its hello waits unread. Only the
        oldest is looked at: in a burst every hello may wait unread behind the accepts, and
        a look at each (a system call) for each waiter cost the server 25 s in one burst."""
        oldest = next(iter(self._speaking), None)
        return None if oldest is None or oldest.unread() else oldest
