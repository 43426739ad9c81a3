"""What the jobs' workers and the GPUs say about a job: reports and GPU usage samples.

Both are numbered per job and bounded to the newest ``max_reports_per_job``; both go with
their job. Apart because they are the store's hot path (every worker reports each epoch,
through the allocator's RPC thread): a group's reports are written in one batch just
before the group commits.
"""

from __future__ import annotations

import functools
import json
import sqlite3
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from herd_operator.runtime.store.connection import DeferredWrite, StoreBase
from herd_operator.runtime.store.jobs import require_job, unknown_job
from herd_operator.specs.values import Report, UsageSample

MAX_REPORTS_PER_JOB = 10_000

_ReportRow = tuple[str, int | None, int, int, float, str, int]


class ReportsMixin(StoreBase):
    """The ``reports`` and ``gpu_usage`` tables."""

    def _init_reports(self, max_reports_per_job: int) -> None:
        self._max_reports_per_job = max_reports_per_job
        # Inside transaction(): the reports added so far, inserted together at its commit
        # (see add_report), and the jobs already found to exist in it.
        self._group_reports: list[_ReportRow] = []
        self._group_report_jobs: set[str] = set()

    def add_report(
        self,
        job: str,
        epoch: int | None,
        world_size: int,
        rank: int,
        metrics: Mapping[str, float],
        now: float,
        measurement: bool = False,
    ) -> None:
        """Record a worker's report, keeping only the job's newest reports; KeyError if no job.
        `measurement`: made within an epoch (`Report.measurement`; epoch is then None).

        Inside ``transaction()`` the report is written with the group's other reports, in
        one batch just before the group commits (so reads inside the group do not see it
        yet): the allocator's RPC thread runs a group of reports every loop turn, and a
        statement's round trip through Python per report was a fifth of its cost.
        """
        metrics_json = json.dumps({str(k): float(v) for k, v in metrics.items()})
        row = (job, epoch, world_size, rank, now, metrics_json, int(measurement))
        with self._lock:
            if self._grouping:
                if self._group_lost:
                    raise self._rolled_back()
                if job not in self._group_report_jobs:
                    # The group holds the lock: a job found here is still there at the commit.
                    with self._errors("read"):
                        require_job(self._conn, job)
                    self._group_report_jobs.add(job)
                self._group_reports.append(row)
                return
        with self._write() as conn:
            _insert_numbered(conn, "reports", [row], self._max_reports_per_job)

    def _take_deferred_writes(self) -> DeferredWrite | None:
        reports, self._group_reports = self._group_reports, []
        self._group_report_jobs.clear()
        if not reports:
            return None
        return functools.partial(
            _insert_numbered, table="reports", rows=reports, keep=self._max_reports_per_job
        )

    def reports(self, job: str, since: float | None = None, limit: int = 1000) -> list[Report]:
        """The job's newest ``limit`` reports with time >= ``since``, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT * FROM reports WHERE job = ? AND (? IS NULL OR time >= ?)"
                " ORDER BY seq DESC LIMIT ?",
                (job, since, since, limit),
            ).fetchall()
        return [_report(row) for row in reversed(rows)]

    # GPU usage samples (what the policies' memory signal is made of)

    def add_usage(self, job: str, gpus: int, used_bytes: int, total_bytes: int, now: float) -> None:
        """Record the memory of a job's GPUs at one instant, keeping the newest samples."""
        with self._write() as conn:
            row = (job, now, gpus, used_bytes, total_bytes)
            _insert_numbered(conn, "gpu_usage", [row], self._max_reports_per_job)

    def usage(self, job: str, since: float | None = None, limit: int = 10_000) -> list[UsageSample]:
        """The job's newest ``limit`` usage samples with time >= ``since``, oldest first."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT time, gpus, used_bytes, total_bytes FROM gpu_usage"
                " WHERE job = ? AND (? IS NULL OR time >= ?) ORDER BY seq DESC LIMIT ?",
                (job, since, since, limit),
            ).fetchall()
        return [UsageSample(row[0], row[1], row[2], row[3]) for row in reversed(rows)]

    def latest_usage(self) -> dict[str, UsageSample]:
        """Each job's newest usage sample, in one query (a scrape reads every job's)."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT u.job, u.time, u.gpus, u.used_bytes, u.total_bytes FROM gpu_usage AS u"
                " JOIN (SELECT job, MAX(seq) AS seq FROM gpu_usage GROUP BY job) AS newest"
                " ON u.job = newest.job AND u.seq = newest.seq"
            ).fetchall()
        return {row[0]: UsageSample(row[1], row[2], row[3], row[4]) for row in rows}


_NUMBERED_INSERTS = {
    "reports": "INSERT INTO reports"
    " (job, seq, epoch, world_size, rank, time, metrics_json, measurement)"
    " SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3, ?4, ?5, ?6, ?7 FROM reports WHERE job = ?1",
    "gpu_usage": "INSERT INTO gpu_usage (job, seq, time, gpus, used_bytes, total_bytes)"
    " SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3, ?4, ?5 FROM gpu_usage WHERE job = ?1",
}
"""Each row is numbered after its job's last: per-job sequence numbers make pruning one
index range delete."""


def _insert_numbered(
    conn: sqlite3.Connection, table: str, rows: Sequence[tuple[object, ...]], keep: int
) -> None:
    """Insert rows (the job first) into a numbered ``table`` in order, then delete all but
    each job's newest ``keep``; KeyError if a single row's job is unknown (its foreign key).
    A batch's jobs were checked as they came (``add_report``)."""
    try:
        conn.executemany(_NUMBERED_INSERTS[table], rows)
    except sqlite3.IntegrityError as error:
        if len(rows) > 1 or "FOREIGN KEY" not in str(error):
            raise
        raise unknown_job(str(rows[0][0])) from None
    for job in dict.fromkeys(row[0] for row in rows):
        conn.execute(
            f"DELETE FROM {table} WHERE job = ?1"
            f" AND seq <= (SELECT MAX(seq) FROM {table} WHERE job = ?1) - ?2",
            (job, keep),
        )


def _report(row: sqlite3.Row) -> Report:
    return Report(
        epoch=row["epoch"],
        time=row["time"],
        world_size=row["world_size"],
        metrics=MappingProxyType(json.loads(row["metrics_json"])),
        rank=row["rank"],
        # A reader may open a store of version 6 as it is (no column: no measurement).
        # `in row` would test the values of a sqlite3.Row, not its names.
        measurement="measurement" in row.keys() and bool(row["measurement"]),  # noqa: SIM118
    )
