"""What the store's file holds and how an older or damaged one is met at open.

The tables (``_SCHEMA``), the schema version in SQLite's ``user_version``, the migrations
from each older version, and the checks before the operator trusts a file: SQLite's
``quick_check``, the tables the version promises, a file truncated to 0 bytes. Apart
because a change of the schema is a change here (a new version, its migration, the
tables it adds) and in the one concern's module that reads the new table.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path

from herd_operator.runtime.store.connection import StoreBase, StoreError

_log = logging.getLogger(__name__)

DB_FILENAME = "state.db"
"""The store's file name inside the operator's state directory."""

SCHEMA_VERSION = 7
"""1: the first release. 2: the unused ``runtime`` table is dropped. 3: the grant history
is bounded per job; ``grant_history_trimmed`` says what was dropped. 4: ``drains``, the GPUs
jobs gave back that their workers may still be on, recorded with the allocations. 5: a GPU
may be allocated to several jobs that share GPUs by memory (``allocations.shared``; the key
is the GPU and the job). 6: ``share_history``, the log of which sharing jobs each GPU held
and the memory each was counted for (the report's shared GPUs). 7: ``reports.measurement``,
a report made within an epoch (the adaptive metrics a few steps into a configuration)."""

_SCHEMA = """
CREATE TABLE jobs (
    name TEXT PRIMARY KEY,
    uid TEXT NOT NULL UNIQUE,
    spec_path TEXT NOT NULL,
    spec_json TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    generation INTEGER NOT NULL,
    status_json TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE allocations (
    host TEXT NOT NULL,
    gpu INTEGER NOT NULL,
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    host_ordinal INTEGER NOT NULL,
    local_rank INTEGER NOT NULL,
    shared INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (host, gpu, job)
);
CREATE INDEX allocations_by_job ON allocations (job, host_ordinal, local_rank);
CREATE TABLE drains (
    host TEXT NOT NULL,
    gpu INTEGER NOT NULL,
    job TEXT NOT NULL,
    given_back_at REAL NOT NULL,
    pids_json TEXT NOT NULL,
    after_loss INTEGER NOT NULL,
    PRIMARY KEY (host, gpu)
);
CREATE TABLE reports (
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    epoch INTEGER,
    world_size INTEGER NOT NULL,
    rank INTEGER NOT NULL,
    time REAL NOT NULL,
    metrics_json TEXT NOT NULL,
    measurement INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (job, seq)
);
CREATE TABLE gpu_usage (
    job TEXT NOT NULL REFERENCES jobs(name) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    time REAL NOT NULL,
    gpus INTEGER NOT NULL,
    used_bytes INTEGER NOT NULL,
    total_bytes INTEGER NOT NULL,
    PRIMARY KEY (job, seq)
);
CREATE INDEX gpu_usage_by_time ON gpu_usage (job, time);
CREATE TABLE grant_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job TEXT NOT NULL,
    time REAL NOT NULL,
    gpus INTEGER NOT NULL,
    reason TEXT NOT NULL
);
CREATE INDEX grant_history_by_job ON grant_history (job, id);
CREATE TABLE grant_history_trimmed (
    job TEXT PRIMARY KEY,
    dropped INTEGER NOT NULL,
    through REAL NOT NULL
);
CREATE TABLE share_history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    host TEXT NOT NULL,
    gpu INTEGER NOT NULL,
    jobs_json TEXT NOT NULL
);
CREATE TABLE events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    job TEXT,
    type TEXT NOT NULL CHECK (type IN ('Normal', 'Warning')),
    reason TEXT NOT NULL,
    message TEXT NOT NULL,
    count INTEGER NOT NULL,
    last_time REAL NOT NULL
);
CREATE INDEX events_by_job ON events (job, id);
CREATE INDEX events_by_last_time ON events (last_time, id);
CREATE TABLE meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""
"""The current schema, for a new store."""
_TABLES = frozenset(re.findall(r"CREATE TABLE (\w+)", _SCHEMA))

_MIGRATIONS: dict[int, tuple[str, ...]] = {
    2: ("DROP TABLE runtime",),
    3: (
        "CREATE TABLE grant_history_trimmed (job TEXT PRIMARY KEY, dropped INTEGER NOT NULL,"
        " through REAL NOT NULL)",
    ),
    4: (
        "CREATE TABLE drains (host TEXT NOT NULL, gpu INTEGER NOT NULL, job TEXT NOT NULL,"
        " given_back_at REAL NOT NULL, pids_json TEXT NOT NULL, after_loss INTEGER NOT NULL,"
        " PRIMARY KEY (host, gpu))",
    ),
    5: (
        "CREATE TABLE allocations_v5 (host TEXT NOT NULL, gpu INTEGER NOT NULL, job TEXT NOT"
        " NULL REFERENCES jobs(name) ON DELETE CASCADE, host_ordinal INTEGER NOT NULL,"
        " local_rank INTEGER NOT NULL, shared INTEGER NOT NULL DEFAULT 0,"
        " PRIMARY KEY (host, gpu, job))",
        "INSERT INTO allocations_v5 (host, gpu, job, host_ordinal, local_rank)"
        " SELECT host, gpu, job, host_ordinal, local_rank FROM allocations",
        "DROP TABLE allocations",
        "ALTER TABLE allocations_v5 RENAME TO allocations",
        "CREATE INDEX allocations_by_job ON allocations (job, host_ordinal, local_rank)",
    ),
    6: (
        "CREATE TABLE share_history (id INTEGER PRIMARY KEY AUTOINCREMENT, time REAL NOT NULL,"
        " host TEXT NOT NULL, gpu INTEGER NOT NULL, jobs_json TEXT NOT NULL)",
    ),
    7: ("ALTER TABLE reports ADD COLUMN measurement INTEGER NOT NULL DEFAULT 0",),
}
"""What takes a store from the version before to the key's version."""
_TABLES_ADDED: dict[int, frozenset[str]] = {
    3: frozenset({"grant_history_trimmed"}),
    4: frozenset({"drains"}),
    6: frozenset({"share_history"}),
}
"""Tables a store of an older version lacks: a reader opens such a store as it is."""


class SchemaMixin(StoreBase):
    """The checks and migrations of the store's file."""

    def check(self, *, full: bool = False) -> None:
        """Raise ``DamagedStoreError`` unless the file passes SQLite's ``quick_check`` and
        holds this store's tables (or none yet, and no schema version).

        ``quick_check`` reads every page once (about 90 ms for a 38 MB store of 10,000
        jobs); ``full`` runs ``integrity_check``, which also checks indexes against their
        tables, three times as long (``herd-operator check-state --full``).
        """
        pragma = "integrity_check" if full else "quick_check"
        started = time.perf_counter()
        with self._lock, self._errors("check"):
            rows = self._conn.execute(f"PRAGMA {pragma}(5)").fetchall()
            tables = {
                row[0]
                for row in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }
        # One line: quick_check's first row holds several problems, a line each.
        problems = ["; ".join(str(row[0]).splitlines()) for row in rows if row[0] != "ok"]
        if problems:
            raise self._damaged(f"SQLite's {pragma} found: {'; '.join(problems)}")
        elapsed = time.perf_counter() - started
        # It reads the whole file: say so when that delays the start noticeably.
        _log.log(
            logging.INFO if elapsed >= 1.0 else logging.DEBUG,
            "state store %s: %s passed in %.2f s",
            self.path,
            pragma,
            elapsed,
        )
        version = self._user_version()
        if version == 0:
            if tables - {"sqlite_sequence"}:
                raise self._damaged(
                    "it holds tables but no herd-operator schema version"
                    " (another program's database, or its header was overwritten)"
                )
            return
        added_later = {
            table for step, added in _TABLES_ADDED.items() if step > version for table in added
        }
        missing = sorted(_TABLES - added_later - tables)
        if missing and version <= SCHEMA_VERSION:
            raise self._damaged(f"schema version {version} but table(s) missing: {missing}")

    def _refuse_truncated(self, previous_state: Sequence[Path]) -> None:
        try:
            if self.path.stat().st_size > 0:
                return
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StoreError(f"cannot open state store {self.path}: {exc}") from exc
        wal = self.path.with_name(self.path.name + "-wal")
        evidence = [path for path in (wal, *previous_state) if path.exists()]
        if evidence:
            raise self._damaged(
                f"it is empty (0 bytes), yet {evidence[0]} shows a store was set up here"
                " before: it was truncated, and opening it would start over with no jobs"
            )

    def _ensure_schema(self) -> None:
        """Create the schema of a new store, or migrate an older one, in one transaction."""
        with self._write() as conn:
            version = self._user_version()
            if version == SCHEMA_VERSION:
                return
            self._check_version(version, readonly=False)
            if version == 0:
                # executescript() would commit our transaction first; run statement by statement.
                statements = tuple(part for part in _SCHEMA.split(";") if part.strip())
            else:
                statements = tuple(
                    statement
                    for step in range(version + 1, SCHEMA_VERSION + 1)
                    for statement in _MIGRATIONS[step]
                )
                _log.info(
                    "state store %s: migrating schema %d -> %d", self.path, version, SCHEMA_VERSION
                )
            for statement in statements:
                conn.execute(statement)
            # user_version lives in the database header: it commits with the statements.
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _user_version(self) -> int:
        with self._errors("open"):
            version: int = self._conn.execute("PRAGMA user_version").fetchone()[0]
        return version

    def _check_version(self, version: int, *, readonly: bool) -> None:
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path}: schema version {version} is newer than this herd-operator"
                f" supports ({SCHEMA_VERSION}); upgrade herd-operator to open it"
            )
        if readonly and version == 0:
            raise StoreError(f"{self.path}: not a herd-operator state store (it has no schema)")
        # A reader opens an older store as it is (the operator that owns it migrates it):
        # every version it can meet has the tables and columns it reads.
