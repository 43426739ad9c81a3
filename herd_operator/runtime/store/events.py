"""Kubernetes-style events: a bounded log of what happened, with repeats counted.

Like the grant history, events are a log and outlive their job. Apart because many parts
write them (the reconciler, the allocator, the grant history's first trim, the store's own
``StoreWritable``), and they are bounded by their count, not per job.
"""

from __future__ import annotations

import re
import sqlite3
from dataclasses import dataclass
from typing import Literal

from herd_operator.runtime.store.connection import StoreBase

MAX_EVENTS = 100_000

EventType = Literal["Normal", "Warning"]
_EVENT_TYPES: frozenset[str] = frozenset({"Normal", "Warning"})
_UPPER_CAMEL_CASE = re.compile(r"[A-Z][A-Za-z0-9]*")


@dataclass(frozen=True)
class Event:
    """A Kubernetes-style event; repeats of a job's latest event raise ``count``."""

    id: int
    time: float
    job: str | None
    type: EventType
    reason: str
    message: str
    count: int
    last_time: float


class EventsMixin(StoreBase):
    """The ``events`` table: the newest ``max_events``, of all jobs and none."""

    def _init_events(self, max_events: int) -> None:
        self._max_events = max_events

    def add_event(
        self, job: str | None, type: EventType, reason: str, message: str, now: float
    ) -> Event:
        """Record an event; a repeat of the job's latest event only bumps its count."""
        if type not in _EVENT_TYPES:
            raise ValueError(f"event type must be 'Normal' or 'Warning', got {type!r}")
        if not _UPPER_CAMEL_CASE.fullmatch(reason):
            raise ValueError(f"event reason must be UpperCamelCase, got {reason!r}")
        with self._write() as conn:
            latest = conn.execute(
                "SELECT id, type, reason, message FROM events WHERE job IS ?"
                " ORDER BY id DESC LIMIT 1",
                (job,),
            ).fetchone()
            if latest is not None and (latest["type"], latest["reason"], latest["message"]) == (
                type,
                reason,
                message,
            ):
                event_id: int = latest["id"]
                conn.execute(
                    "UPDATE events SET count = count + 1, last_time = ? WHERE id = ?",
                    (now, event_id),
                )
            else:
                cursor = conn.execute(
                    "INSERT INTO events (time, job, type, reason, message, count, last_time)"
                    " VALUES (?, ?, ?, ?, ?, 1, ?)",
                    (now, job, type, reason, message, now),
                )
                assert cursor.lastrowid is not None
                event_id = cursor.lastrowid
                # AUTOINCREMENT ids only grow and only pruning deletes, so this keeps the newest.
                conn.execute("DELETE FROM events WHERE id <= ?", (event_id - self._max_events,))
            return _event(conn.execute("SELECT * FROM events WHERE id = ?", (event_id,)).fetchone())

    def events(self, job: str | None = None, limit: int = 100) -> list[Event]:
        """The newest ``limit`` events (of one job, or all) by last occurrence, newest last."""
        with self._read() as conn:
            if job is None:
                rows = conn.execute(
                    "SELECT * FROM events ORDER BY last_time DESC, id DESC LIMIT ?", (limit,)
                ).fetchall()
            else:
                rows = conn.execute(
                    "SELECT * FROM events WHERE job = ? ORDER BY last_time DESC, id DESC LIMIT ?",
                    (job, limit),
                ).fetchall()
        return [_event(row) for row in reversed(rows)]

    def _record_writable(self, now: float) -> None:
        # A constant message: flapping near a full disk bumps one event's count.
        self.add_event(None, "Normal", "StoreWritable", "store writes work again", now)


def _event(row: sqlite3.Row) -> Event:
    return Event(
        id=row["id"],
        time=row["time"],
        job=row["job"],
        type=row["type"],
        reason=row["reason"],
        message=row["message"],
        count=row["count"],
        last_time=row["last_time"],
    )
