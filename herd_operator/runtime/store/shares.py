"""Which sharing jobs each GPU held over time, and the memory each was counted for: the
log `report` draws shared GPUs from.

The allocations table holds only the last decision; a row here is written, in the same
transaction as the allocations, for each GPU whose sharing jobs or their counted memory
changed (an empty set when its last sharing job left). Apart from ``allocations`` because
it is a log with a bound of its own, read by the report, not by a restarted operator.
A store from before schema 6 has no such log: the report shows no shared GPUs for it.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from herd_operator.runtime.store.connection import StoreBase, StoreError
from herd_operator.specs.values import Slot

MAX_SHARE_CHANGES = 10_000
"""Rows of the log kept (the newest): a change is a sharing job admitted, resized, gone or
measured anew on one GPU; 10,000 is weeks of a busy pool, and each row is small."""


@dataclass(frozen=True)
class ShareChange:
    """From ``time`` on, GPU ``host:gpu`` holds these sharing jobs' workers, each counted
    for its bytes (0: not known). Empty ``jobs``: no sharing job is on it any more."""

    time: float
    host: str
    gpu: int
    jobs: tuple[tuple[str, int], ...]


def gpu_sharers(
    rows: Iterable[tuple[str, int, str, int]],
    memory: Mapping[str, int],
    before: Mapping[Slot, dict[str, int]],
) -> dict[Slot, dict[str, int]]:
    """Each GPU's sharing jobs -> counted bytes from allocation ``rows`` (host, gpu, job,
    shared). A job whose memory is not known now (an adopted job before its first request)
    keeps what was logged for it on that GPU ``before``."""
    on: dict[Slot, dict[str, int]] = {}
    for host, gpu, job, shared in rows:
        if shared:
            known = memory.get(job) or before.get((host, gpu), {}).get(job, 0)
            on.setdefault((host, gpu), {})[job] = known
    return on


def last_logged(conn: sqlite3.Connection) -> dict[Slot, dict[str, int]]:
    """Each GPU's state as last logged (GPUs whose last row is empty left out): kept in
    ``meta`` beside the log, one row to read per decision, where finding each GPU's newest
    row of the log read all of it (2.6 ms against 0.3 ms a decision, at 10,000 rows)."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'shared_gpus'").fetchone()
    if row is None:
        return {}
    return {(str(host), int(gpu)): dict(jobs) for host, gpu, jobs in json.loads(row[0])}


def log_share_changes(
    conn: sqlite3.Connection,
    rows: Iterable[tuple[str, int, str, int]],
    memory: Mapping[str, int],
    now: float,
) -> None:
    """Log each GPU whose sharing jobs or their memory differ from its last row (inside the
    caller's transaction), then drop the rows beyond ``MAX_SHARE_CHANGES``."""
    before = last_logged(conn)
    after = gpu_sharers(rows, memory, before)
    changed = [
        (now, host, gpu, json.dumps(sorted(after.get((host, gpu), {}).items())))
        for host, gpu in sorted(before.keys() | after.keys())
        if before.get((host, gpu), {}) != after.get((host, gpu), {})
    ]
    if not changed:
        return
    conn.executemany(
        "INSERT INTO share_history (time, host, gpu, jobs_json) VALUES (?, ?, ?, ?)", changed
    )
    state = [[host, gpu, sorted(jobs.items())] for (host, gpu), jobs in sorted(after.items())]
    conn.execute(
        "INSERT INTO meta (key, value) VALUES ('shared_gpus', ?)"
        " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (json.dumps(state),),
    )
    conn.execute(
        "DELETE FROM share_history WHERE id <= (SELECT max(id) FROM share_history) - ?",
        (MAX_SHARE_CHANGES,),
    )


class SharesMixin(StoreBase):
    """The ``share_history`` table (written by ``AllocationsMixin.replace_allocations``)."""

    def share_history(self) -> list[ShareChange]:
        """Every logged change, oldest first; empty for a store from before the log
        (schema 5 or older)."""
        try:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT time, host, gpu, jobs_json FROM share_history ORDER BY id"
                ).fetchall()
        except StoreError as err:
            if "no such table" in str(err):
                return []
            raise
        return [
            ShareChange(
                float(row[0]),
                str(row[1]),
                int(row[2]),
                tuple((str(job), int(bytes_)) for job, bytes_ in json.loads(row[3])),
            )
            for row in rows
        ]
