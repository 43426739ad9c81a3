"""What the report draws over time: each job's grant changes and the pool's size.

A log, not a job's state: the grant history outlives its job (the report of a finished
job needs it), bounded per job as it is written (what the bound dropped is counted), and
deleted some time after its job by the pruner (``runtime/pruner.py``), in small steps that
keep the lock the operator's threads share free. Apart because of that lifetime of its own.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from herd_operator.runtime.store.connection import StoreError
from herd_operator.runtime.store.events import EventsMixin
from herd_operator.specs.models import is_job_name

MAX_GRANTS_PER_JOB = 1_000
"""Grant changes kept per job (the newest): a job resized every minute for a week has
about 10,000, and the report and ``describe`` need the recent ones."""
PRUNE_BATCH_JOBS = 50
"""Names of the grant history that one ``prune_deleted_history`` call looks at: one short
write transaction (about 20 ms for 50 deleted jobs of 100 grant changes each, on the loaded
2-core machine: ``python -m devtools.bench --only history``), so the loop and the RPC thread,
which share the store's lock, wait little."""


@dataclass(frozen=True)
class GrantChange:
    """A change of a job's granted GPU count."""

    job: str
    time: float
    gpus: int
    reason: str


GRANT_ROW_PROBLEMS = (
    "not a job's name",
    "time not a number >= 0",
    "gpus not an integer >= 0",
    "reason not text",
    "time before the job's previous change",
)
"""Why a stored grant change is not read, in the order a summary names them. The operator
writes none of these; a store another program wrote, or mended by hand, may hold them."""


@dataclass(frozen=True)
class GrantHistory:
    """Grant changes as read, and how many rows were skipped for each problem (of
    ``GRANT_ROW_PROBLEMS``; only those with any)."""

    changes: list[GrantChange]
    skipped: dict[str, int]

    def skipped_summary(self, where: object) -> str:
        """``12 bad rows of grant_history in WHERE: 2 not a job's name, ...`` (empty when
        none were skipped)."""
        if not self.skipped:
            return ""
        total = sum(self.skipped.values())
        counts = ", ".join(f"{self.skipped[why]} {why}" for why in self.skipped)
        return f"{total} bad row{'s' if total != 1 else ''} of grant_history in {where}: {counts}"


def checked_grant_changes(rows: Iterable[Sequence[object]]) -> GrantHistory:
    """The changes of ``rows`` ((job, time, gpus, reason), oldest first) that a report can
    add up; the others are counted by problem. A change earlier than the job's change
    before it would make a negative span of time (GPU-seconds below zero)."""
    changes: list[GrantChange] = []
    counts = dict.fromkeys(GRANT_ROW_PROBLEMS, 0)
    latest: dict[str, float] = {}
    for row in rows:
        change = _grant_change(row)
        if isinstance(change, GrantChange) and change.time < latest.get(change.job, 0.0):
            change = GRANT_ROW_PROBLEMS[4]
        if isinstance(change, str):
            counts[change] += 1
            continue
        latest[change.job] = change.time
        changes.append(change)
    return GrantHistory(changes, {why: count for why, count in counts.items() if count})


def _grant_change(row: Sequence[object]) -> GrantChange | str:
    """The change a row says, or the problem (of ``GRANT_ROW_PROBLEMS``) that it is not one."""
    job, time, gpus, reason = row
    if not isinstance(job, str) or not is_job_name(job):
        return GRANT_ROW_PROBLEMS[0]
    if isinstance(time, bool) or not isinstance(time, int | float):
        return GRANT_ROW_PROBLEMS[1]
    if not math.isfinite(time) or time < 0:
        return GRANT_ROW_PROBLEMS[1]
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        return GRANT_ROW_PROBLEMS[2]
    if not isinstance(reason, str):
        return GRANT_ROW_PROBLEMS[3]
    return GrantChange(job, float(time), gpus, reason)


@dataclass(frozen=True)
class TrimmedHistory:
    """What the bound on a job's grant history dropped: its ``dropped`` oldest changes, the
    newest of them at ``through``."""

    dropped: int
    through: float


class HistoryMixin(EventsMixin):
    """The ``grant_history`` and ``grant_history_trimmed`` tables, and the pool's sizes.

    An ``EventsMixin``: the first trim of a job's history is said in an event.
    """

    def _init_history(self, max_grants_per_job: int) -> None:
        self._max_grants_per_job = max_grants_per_job

    def add_grant_change(self, job: str, gpus: int, reason: str, now: float) -> None:
        """Log that ``job`` is now granted ``gpus`` GPUs, and why.

        Keeps the job's newest ``max_grants_per_job`` changes; what is dropped is counted in
        ``trimmed_history``, and the first drop for a job is said in an event.
        """
        with self._lock:
            with self._write() as conn:
                conn.execute(
                    "INSERT INTO grant_history (job, time, gpus, reason) VALUES (?, ?, ?, ?)",
                    (job, now, gpus, reason),
                )
                first_trim = self._trim_grants(conn, job)
            if first_trim:
                self.add_event(
                    job,
                    "Normal",
                    "GrantHistoryTrimmed",
                    f"only the newest {self._max_grants_per_job} grant changes are kept;"
                    " older ones are dropped",
                    now,
                )

    def _trim_grants(self, conn: sqlite3.Connection, job: str) -> bool:
        """Drop the job's changes beyond the newest ``max_grants_per_job``; True if these
        are its first dropped. One index step past the kept ones when nothing is dropped."""
        boundary = conn.execute(
            "SELECT id FROM grant_history WHERE job = ? ORDER BY id DESC LIMIT 1 OFFSET ?",
            (job, self._max_grants_per_job),
        ).fetchone()
        if boundary is None:
            return False
        dropped, through = conn.execute(
            "SELECT count(*), max(time) FROM grant_history WHERE job = ? AND id <= ?",
            (job, boundary[0]),
        ).fetchone()
        conn.execute("DELETE FROM grant_history WHERE job = ? AND id <= ?", (job, boundary[0]))
        before = conn.execute(
            "SELECT 1 FROM grant_history_trimmed WHERE job = ?", (job,)
        ).fetchone()
        conn.execute(
            "INSERT INTO grant_history_trimmed (job, dropped, through) VALUES (?, ?, ?)"
            " ON CONFLICT (job) DO UPDATE SET dropped = dropped + excluded.dropped,"
            " through = max(through, excluded.through)",
            (job, dropped, through),
        )
        return before is None

    def trimmed_history(self, job: str | None = None) -> dict[str, TrimmedHistory]:
        """Job -> what the bound dropped of its grant history (only jobs with drops; of
        ``job`` only, if given). Empty for a store from before the bound (schema 2)."""
        try:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT job, dropped, through FROM grant_history_trimmed"
                    " WHERE ? IS NULL OR job = ?",
                    (job, job),
                ).fetchall()
        except StoreError as err:
            if "no such table" in str(err):
                return {}
            raise
        return {row["job"]: TrimmedHistory(row["dropped"], row["through"]) for row in rows}

    def prune_deleted_history(
        self, older_than: float, after: str = "", limit: int = PRUNE_BATCH_JOBS
    ) -> tuple[list[str], str | None]:
        """Delete the grant history of deleted jobs whose last change is older than
        ``older_than`` (unix time), looking at up to ``limit`` job names after ``after``.

        Returns the jobs pruned and the name to continue after (None: the end was reached).
        A job deleted and declared again under the same name is not deleted: its history
        goes on. Incremental: one bounded transaction per call, walking the index.
        """
        with self._write() as conn:
            names = [
                row[0]
                for row in conn.execute(
                    "SELECT DISTINCT job FROM grant_history WHERE job > ? ORDER BY job LIMIT ?",
                    (after, limit),
                )
            ]
            pruned = []
            for name in names:
                if conn.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone():
                    continue
                (last,) = conn.execute(
                    "SELECT max(time) FROM grant_history WHERE job = ?", (name,)
                ).fetchone()
                if last is None or last >= older_than:
                    continue
                conn.execute("DELETE FROM grant_history WHERE job = ?", (name,))
                conn.execute("DELETE FROM grant_history_trimmed WHERE job = ?", (name,))
                pruned.append(name)
        return pruned, (names[-1] if len(names) == limit else None)

    def grant_history(
        self, job: str | None = None, since: float | None = None, limit: int | None = None
    ) -> list[GrantChange]:
        """Grant changes (of one job, or all) with time >= ``since``, the newest ``limit``
        (None: all), oldest first. ``trimmed_history`` says what the bound dropped; rows
        that are not a change (``GRANT_ROW_PROBLEMS``) are left out."""
        return self.read_grant_history(job, since, limit).changes

    def read_grant_history(
        self, job: str | None = None, since: float | None = None, limit: int | None = None
    ) -> GrantHistory:
        """``grant_history``'s changes, and the count of the rows it left out and why."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT job, time, gpus, reason FROM grant_history"
                " WHERE (? IS NULL OR job = ?) AND (? IS NULL OR time >= ?)"
                " ORDER BY id DESC LIMIT ?",
                (job, job, since, since, -1 if limit is None else limit),
            ).fetchall()
        return checked_grant_changes(tuple(row) for row in reversed(rows))

    # the pool's size over time (the report stacks the jobs' GPUs up to it)

    def record_pool_size(self, gpus: int, now: float) -> None:
        """Log the pool's size from ``now`` on, unless it is the size logged last.

        Kept as a JSON list in ``meta`` (no schema change): pools change rarely (a node
        lost or back), and an operator start logs only a size that differs.
        """
        with self._write() as conn:
            sizes = _pool_sizes(conn)
            if sizes and sizes[-1][1] == gpus:
                return
            sizes.append((float(now), int(gpus)))
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('pool_sizes', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (json.dumps(sizes),),
            )

    def pool_sizes(self) -> list[tuple[float, int]]:
        """(time, GPUs in the pool) from each change on, oldest first; empty in a store
        written before the size was logged."""
        with self._read() as conn:
            return _pool_sizes(conn)


def _pool_sizes(conn: sqlite3.Connection) -> list[tuple[float, int]]:
    row = conn.execute("SELECT value FROM meta WHERE key = 'pool_sizes'").fetchone()
    if row is None:
        return []
    return [(float(at), int(gpus)) for at, gpus in json.loads(row["value"])]
