"""The operator's crash-safe embedded state store: one SQLite file in WAL mode.

The operator process owns one writable ``Store``; its threads share the single
connection behind a lock, and every write method is one transaction, so a
crash leaves either the old or the new state. Other processes (``herd-operator
get`` while the operator runs) use ``Store.open_readonly``; WAL lets them read
committed data without blocking the writer, and ``snapshot()`` holds one read
transaction across several calls so what they show is consistent.

All times are unix seconds passed in by the caller (``now``), so tests control
them. Jobs are keyed by name; a job that is deleted and re-created gets a new
uid. Allocations, reports and usage samples belong to their job and go with it;
events and the grant history are a log and outlive it.

Specs and statuses cross the store's interface as models (``JobRecord``): the store
serializes them, parses each stored text once (later reads of the same text reuse the
model) and skips writing a status equal to the stored one. A stored text that no longer
parses spoils only its job: an unreadable status reads as empty, an unreadable spec raises
``UnreadableSpecError`` when asked for and is recorded again from the spec file.

The writer refuses a damaged file at open (``check()``; ``DamagedStoreError`` says how to
move it aside). A write the storage refuses (a full disk) fails like any ``StoreError``, for
the caller to retry; ``writable`` says whether the last one did, for the metrics.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shlex
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Literal

from herd_operator.controllers.errors import TemporaryError
from herd_operator.controllers.ports import JobRecord
from herd_operator.specs import HerdJob
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Drain, Placement, Report, Slot, UsageSample

_log = logging.getLogger(__name__)

DB_FILENAME = "state.db"
"""The store's file name inside the operator's state directory."""

SCHEMA_VERSION = 4
"""1: the first release. 2: the unused ``runtime`` table is dropped. 3: the grant history
is bounded per job; ``grant_history_trimmed`` says what was dropped. 4: ``drains``, the GPUs
jobs gave back that their workers may still be on, recorded with the allocations."""
MAX_REPORTS_PER_JOB = 10_000
MAX_EVENTS = 100_000
MAX_GRANTS_PER_JOB = 1_000
"""Grant changes kept per job (the newest): a job resized every minute for a week has
about 10,000, and the report and ``describe`` need the recent ones."""
PRUNE_BATCH_JOBS = 50
"""Names of the grant history that one ``prune_deleted_history`` call looks at: one short
write transaction (about 20 ms for 50 deleted jobs of 100 grant changes each, on the loaded
2-core machine: ``python -m devtools.bench --only history``), so the loop and the RPC thread,
which share the store's lock, wait little."""
BUSY_TIMEOUT_MS = 5_000

UNWRITABLE_LOG_SECONDS = 60.0
"""While writes keep failing (a full disk), the store says so at most this often."""
WRITE_FAILURE_CODES = frozenset({8, 10, 13, 14})
"""SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN (primary codes): the
storage refuses writes, as opposed to another process holding the database (BUSY)."""
DAMAGE_CODES = frozenset({11, 26})
"""SQLITE_CORRUPT, SQLITE_NOTADB: the file is not a database one can trust."""

EventType = Literal["Normal", "Warning"]
_EVENT_TYPES: frozenset[str] = frozenset({"Normal", "Warning"})
_UPPER_CAMEL_CASE = re.compile(r"[A-Z][A-Za-z0-9]*")

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
    PRIMARY KEY (host, gpu)
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
}
"""What takes a store from the version before to the key's version."""
_TABLES_ADDED: dict[int, frozenset[str]] = {
    3: frozenset({"grant_history_trimmed"}),
    4: frozenset({"drains"}),
}
"""Tables a store of an older version lacks: a reader opens such a store as it is."""


class StoreError(TemporaryError):
    """The state database cannot be opened, read or written.

    Temporary to the control loop: another process may hold the database, a full disk
    may be freed; the reconciles whose writes were lost are redone with backoff.
    """


class DamagedStoreError(StoreError):
    """The state database is corrupt, not a database, or was truncated: nothing waiting
    can help, so the operator refuses to start on it (the message says how to recover)."""


class UnreadableSpecError(StoreError):
    """A job's stored spec no longer parses (a damaged row, or a spec format this version
    no longer reads). Only that job's spec is affected; the operator records the spec
    file's again when the job is next reconciled with a good file."""


@dataclass(frozen=True)
class GrantChange:
    """A change of a job's granted GPU count."""

    job: str
    time: float
    gpus: int
    reason: str


@dataclass(frozen=True)
class TrimmedHistory:
    """What the bound on a job's grant history dropped: its ``dropped`` oldest changes, the
    newest of them at ``through``."""

    dropped: int
    through: float


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


class Store:
    """The SQLite state store; see the module docstring for the guarantees."""

    def __init__(
        self,
        path: Path,
        *,
        max_reports_per_job: int = MAX_REPORTS_PER_JOB,
        max_events: int = MAX_EVENTS,
        max_grants_per_job: int = MAX_GRANTS_PER_JOB,
        readonly: bool = False,
        previous_state: Sequence[Path] = (),
        clock: Callable[[], float] = time.time,
        checkpoint_seconds: float | None = None,
    ) -> None:
        """Open the store at ``path`` (the database file).

        Writable: creates the file, its schema and its parent directory (mode 0700) as needed,
        after ``check()``: a damaged store raises ``DamagedStoreError``. A 0-byte file is a
        store never set up (SQLite writes the header when it first opens one) unless its
        ``-wal`` file or one of ``previous_state`` (files made only after a store opened
        here) exists: then it was truncated, and is refused rather than started over empty.
        Read-only: the store must exist already; see ``open_readonly``.
        ``clock`` times the event that says writes work again after they failed.

        ``checkpoint_seconds`` (writable only): copy the write-ahead log into the database
        from a thread of the store's own, on a connection of its own, this often, instead
        of in whichever commit finds the log over SQLite's 1,000 pages. That commit would
        hold the store's lock for the copy and its fsyncs: the allocator's RPC thread, which
        commits the workers' reports, saw its p99 double (docs/benchmarks.md, run 15).
        """
        if max_reports_per_job < 1 or max_events < 1 or max_grants_per_job < 1:
            raise ValueError(
                "max_reports_per_job, max_events and max_grants_per_job must be at least 1"
            )
        if checkpoint_seconds is not None and not checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be positive, not {checkpoint_seconds}")
        self.path = Path(path)
        self.readonly = readonly
        self._max_reports_per_job = max_reports_per_job
        self._max_events = max_events
        self._max_grants_per_job = max_grants_per_job
        self._clock = clock
        self._lock = threading.RLock()
        self.writable = True
        """False from a write the storage refused (disk full, read-only, I/O error) until
        a write succeeds again."""
        self._unwritable_since: float | None = None
        self._failed_writes = 0
        self._last_unwritable_log: float | None = None  # monotonic
        self._said_unwritable = False  # the last word in the log on it was "writes fail"
        self._group_wrote = False  # a write of the group changed a row (see _write)
        self._group_lost = False  # SQLite rolled the group back (a full disk, an I/O error)
        self._rollback_listeners: list[Callable[[], None]] = []
        self._grouping = False  # inside transaction(): writes are savepoints, not commits
        # Inside transaction(): the reports added so far, inserted together at its commit
        # (see add_report), and the jobs already found to exist in it.
        self._group_reports: list[tuple[str, int | None, int, int, float, str]] = []
        self._group_report_jobs: set[str] = set()
        # Per job, the status text last read or written here with its model: a read of
        # the same text reuses the model, a write of the same text is skipped. Keyed by
        # the exact text, so a reader never gets a model of text it did not just read.
        self._statuses: dict[str, tuple[str, HerdJobStatus]] = {}
        # Per job, the spec of one (uid, generation), once a record's spec was asked for:
        # record_spec writes a spec only with a new generation and a re-declared job gets a
        # new uid, so the pair fixes the text, and no text needs to be kept to know the
        # cached model is still right.
        self._specs: dict[str, tuple[str, int, HerdJob]] = {}
        # Per job, the (uid, generation) whose stored spec was found not to parse.
        self._unreadable_specs: dict[str, tuple[str, int]] = {}
        if readonly:
            self._conn = self._connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
        else:
            self._refuse_truncated(previous_state)
            try:
                self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(
                    f"cannot create the directory of state store {self.path}: {exc}"
                ) from exc
            _make_private(self.path)
            self._conn = self._connect(str(self.path), uri=False)
        try:
            with self._errors("open"):
                self._conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            if readonly:
                self._check_version(self._user_version(), readonly=True)
            else:
                self.check()
                self._configure_writer()
                self._ensure_schema()
                self._find_unreadable_specs()
                for suffix in ("-wal", "-shm"):  # SQLite gives them the database's mode
                    sidecar = self.path.with_name(self.path.name + suffix)
                    if sidecar.exists():
                        os.chmod(sidecar, 0o600)
        except BaseException:
            self._conn.close()
            raise
        self._checkpointer: _Checkpointer | None = None
        if checkpoint_seconds is not None and not readonly:
            try:
                with self._errors("open"):
                    self._conn.execute("PRAGMA wal_autocheckpoint = 0")
                    self._checkpointer = _Checkpointer(
                        self._connect(str(self.path), uri=False), self.path, checkpoint_seconds
                    )
            except BaseException:
                self._conn.close()
                raise

    @property
    def checkpoints(self) -> int:
        """Checkpoints the store's own thread has completed (0 without one)."""
        return 0 if self._checkpointer is None else self._checkpointer.completed

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
        problems = [str(row[0]) for row in rows if row[0] != "ok"]
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

    @classmethod
    def open_readonly(cls, path: Path) -> Store:
        """Open an existing store for reading only, e.g. from a CLI while the operator runs."""
        return cls(path, readonly=True)

    def close(self) -> None:
        """Close the connection (and stop the checkpoint thread); further calls raise
        StoreError."""
        if self._checkpointer is not None:
            self._checkpointer.stop()
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """Hold one read transaction, so the reads inside see the state as of entry.

        It holds the store's lock throughout: other threads sharing this store wait, and
        writes inside it raise StoreError.
        """
        with self._lock, self._errors("read"):
            if self._grouping:
                raise StoreError(f"{self.path}: snapshot() cannot be used inside transaction()")
            self._conn.execute("BEGIN")
            try:
                # WAL fixes the snapshot at the first read, not at BEGIN.
                self._conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
                yield
            finally:
                self._conn.execute("COMMIT")

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """Commit the writes made inside once, at the end, instead of once each.

        Each write method stays all-or-nothing (a savepoint), and the writes that completed
        are committed even when an exception leaves the block: the same outcome as without
        grouping, only later. A crash inside loses the group's writes, so keep groups short
        (the operator commits every 20 ms of reconciles). It holds the store's lock throughout:
        other threads sharing this store wait. Not re-entrant; not inside snapshot().
        """
        with self._lock:
            if self._grouping or self._conn.in_transaction:
                raise StoreError(f"{self.path}: transaction() cannot be nested or in snapshot()")
            with self._errors("write"):
                self._conn.execute("BEGIN IMMEDIATE")
            self._grouping = True
            try:
                yield
            finally:
                self._grouping = False
                self._commit_group()

    def _commit_group(self) -> None:
        wrote, self._group_wrote = self._group_wrote, False
        lost, self._group_lost = self._group_lost, False
        reports, self._group_reports = self._group_reports, []
        self._group_report_jobs.clear()
        if lost or not self._conn.in_transaction:
            # A full disk or an I/O error inside made SQLite roll back the whole group.
            self._group_rolled_back()
            raise self._rolled_back()
        try:
            with self._errors("write"):
                if reports:
                    _insert_numbered(self._conn, "reports", reports, self._max_reports_per_job)
                    wrote = True
                self._conn.execute("COMMIT")
        except StoreError:
            if self._conn.in_transaction:  # e.g. disk full: leave no transaction open
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute("ROLLBACK")
            self._group_rolled_back()
            raise
        if wrote:
            self._writes_work()

    def on_rollback(self, listener: Callable[[], None]) -> None:
        """Call `listener` (with the store's lock held) whenever a `transaction()` group is
        rolled back: what other parts wrote in it is not stored, and they may write it again."""
        self._rollback_listeners.append(listener)

    def _group_rolled_back(self) -> None:
        # The cached texts may be of writes that were just rolled back.
        self._forget_cached()
        for listener in self._rollback_listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not hide the store's own error
                _log.exception("state store: a rollback listener failed")

    # jobs

    def record_spec(
        self, name: str, spec_path: str, job: HerdJob, fingerprint: str, now: float
    ) -> JobRecord:
        """Record a job's good spec; a new fingerprint bumps the generation.

        With the same fingerprint the stored spec stays (only its path may move): the
        record returned is what is stored, like ``get_job``.
        """
        with self._lock:
            with self._write() as conn:
                row = conn.execute(
                    "SELECT uid, generation, fingerprint, spec_path FROM jobs WHERE name = ?",
                    (name,),
                ).fetchone()
                unreadable = row is not None and self._unreadable_specs.get(name) == (
                    row["uid"],
                    row["generation"],
                )
                if row is None:
                    conn.execute(
                        "INSERT INTO jobs (name, uid, spec_path, spec_json, fingerprint,"
                        " generation, status_json, created_at, updated_at)"
                        " VALUES (?, ?, ?, ?, ?, 1, '{}', ?, ?)",
                        (name, uuid.uuid4().hex, spec_path, _spec_json(job), fingerprint, now, now),
                    )
                elif row["fingerprint"] != fingerprint:
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, spec_json = ?, fingerprint = ?,"
                        " generation = generation + 1, updated_at = ? WHERE name = ?",
                        (spec_path, _spec_json(job), fingerprint, now, name),
                    )
                elif unreadable:
                    # The spec file says what the damaged text was (same fingerprint): repair
                    # the text and keep the generation, since nothing about the job changed.
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, spec_json = ?, updated_at = ?"
                        " WHERE name = ?",
                        (spec_path, _spec_json(job), now, name),
                    )
                    _log.info(
                        "state store %s: the spec of job %r is recorded again", self.path, name
                    )
                elif row["spec_path"] != spec_path:
                    conn.execute(
                        "UPDATE jobs SET spec_path = ?, updated_at = ? WHERE name = ?",
                        (spec_path, now, name),
                    )
                stored = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
            if unreadable:
                del self._unreadable_specs[name]
            if row is None or row["fingerprint"] != fingerprint or unreadable:
                # What was just written is this model: no need to parse it back.
                return self._job(stored, lambda: job)
            return self._job(stored)

    def get_job(self, name: str) -> JobRecord | None:
        """The job named ``name``, or None."""
        with self._read() as conn:
            row = conn.execute("SELECT * FROM jobs WHERE name = ?", (name,)).fetchone()
            return None if row is None else self._job(row)

    def has_job(self, name: str) -> bool:
        """Whether a job named ``name`` is recorded; parses nothing (adoption asks this
        before the operator serves, and parsing would build the spec models' validators)."""
        with self._read() as conn:
            return conn.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone() is not None

    def list_jobs(self) -> list[JobRecord]:
        """All jobs, by name."""
        with self._read() as conn:
            return [self._job(row) for row in conn.execute("SELECT * FROM jobs ORDER BY name")]

    def job_policies(self) -> dict[str, tuple[str, dict[str, object]]]:
        """Job -> (policy name, its params) as stored, without parsing the specs.

        For a scrape: parsing every spec on the first one cost ~0.3 s per 10,000 jobs,
        each parse under the store's lock. Jobs whose stored spec has no readable policy
        (a damaged row) are left out, like ``UnreadableSpecError`` would have them.
        """
        with self._read() as conn:
            try:
                rows = conn.execute(
                    "SELECT name, json_extract(spec_json, '$.spec.policy') FROM jobs"
                    " WHERE json_valid(spec_json)"
                ).fetchall()
            except sqlite3.OperationalError:  # an SQLite without JSON: read the texts
                rows = [
                    (row[0], _policy_text(row[1]))
                    for row in conn.execute("SELECT name, spec_json FROM jobs")
                ]
        policies: dict[str, tuple[str, dict[str, object]]] = {}
        for name, text in rows:
            try:
                policy = json.loads(text) if isinstance(text, str) else None
            except ValueError:
                continue
            if not isinstance(policy, dict):
                continue
            policy_name, params = policy.get("name"), policy.get("params", {})
            if isinstance(policy_name, str) and isinstance(params, dict):
                policies[name] = (policy_name, params)
        return policies

    def put_status(self, name: str, status: HerdJobStatus, now: float) -> bool:
        """Replace a job's status unless it equals the stored one; True if it was written.

        KeyError if there is no such job. Most reconciles change nothing, and an unchanged
        status is not written (nor its ``updated_at`` moved). "Stored" is the text this store
        last read or wrote for the job: the operator, the database's one writer (it holds
        the state dir's lock), reads a job before it writes the job's status.
        """
        with self._lock:
            cached = self._statuses.get(name)
            if cached is not None and cached[1] == status:  # cheaper than serializing
                return False
            text = status.model_dump_json(by_alias=True)
            if cached is not None and cached[0] == text:
                return False
            with self._write() as conn:
                updated = conn.execute(
                    "UPDATE jobs SET status_json = ?, updated_at = ? WHERE name = ?",
                    (text, now, name),
                ).rowcount
                if updated == 0:
                    raise _unknown_job(name)
            self._statuses[name] = (text, status)
            return True

    def delete_job(self, name: str) -> bool:
        """Delete a job with its allocations, reports and usage; False if it did not exist."""
        with self._write() as conn:
            deleted: int = conn.execute("DELETE FROM jobs WHERE name = ?", (name,)).rowcount
            self._statuses.pop(name, None)
            self._specs.pop(name, None)
            self._unreadable_specs.pop(name, None)
            return deleted > 0

    # allocations

    def replace_allocations(
        self,
        placements: Mapping[str, Placement],
        now: float,
        draining: Mapping[Slot, Drain] | None = None,
    ) -> None:
        """Replace all allocations with ``placements`` (job -> placement), and the draining
        GPUs with ``draining``, in one transaction: a restarted operator must find a GPU that
        a job was shrunk off still held (its workers may be on it), never in between.

        A job with an empty placement holds nothing and is not stored (the allocator's
        decisions name pending jobs too). ValueError if a GPU is placed twice or a host of
        a placement has no GPUs; KeyError if a job that holds GPUs does not exist. On
        error nothing changes.
        """
        held = {job: placement for job, placement in placements.items() if placement.size}
        rows: list[tuple[str, int, str, int, int]] = []
        owner: dict[tuple[str, int], str] = {}
        for job, placement in held.items():
            # A Placement has no host twice and no GPU twice on a host already.
            for host_ordinal, (host, gpus) in enumerate(placement.hosts):
                if not gpus:
                    raise ValueError(f"job {job!r}: host {host!r} has an empty GPU list")
                for local_rank, gpu in enumerate(gpus):
                    other = owner.get((host, gpu))
                    if other is not None:
                        raise ValueError(
                            f"GPU {host}:{gpu} is placed twice (jobs {other!r} and {job!r})"
                        )
                    owner[(host, gpu)] = job
                    rows.append((host, gpu, job, host_ordinal, local_rank))
        with self._write() as conn:
            for job in held:
                _require_job(conn, job)
            conn.execute("DELETE FROM allocations")
            conn.executemany(
                "INSERT INTO allocations (host, gpu, job, host_ordinal, local_rank)"
                " VALUES (?, ?, ?, ?, ?)",
                rows,
            )
            conn.execute("DELETE FROM drains")
            conn.executemany(
                "INSERT INTO drains (host, gpu, job, given_back_at, pids_json, after_loss)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (host, gpu, drain.job, drain.given_back_at,
                     json.dumps([list(pid) for pid in drain.pids]), int(drain.after_loss))
                    for (host, gpu), drain in (draining or {}).items()
                ],
            )  # fmt: skip
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('allocations_updated_at', ?)"
                " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (repr(float(now)),),
            )

    def allocations(self) -> dict[str, Placement]:
        """Job -> placement, jobs by name, hosts and GPUs in the order they were given."""
        hosts: dict[str, list[tuple[str, list[int]]]] = {}
        with self._read() as conn:
            rows = conn.execute(
                "SELECT job, host, gpu FROM allocations ORDER BY job, host_ordinal, local_rank"
            ).fetchall()
        for row in rows:
            placement = hosts.setdefault(row["job"], [])
            if not placement or placement[-1][0] != row["host"]:
                placement.append((row["host"], []))
            placement[-1][1].append(row["gpu"])
        return {
            job: Placement(tuple((host, tuple(gpus)) for host, gpus in placement))
            for job, placement in hosts.items()
        }

    def draining(self) -> dict[Slot, Drain]:
        """The GPUs jobs gave back and their workers may still be on, as last recorded
        (empty for a store from before drains were recorded: schema 3 or older)."""
        try:
            with self._read() as conn:
                rows = conn.execute(
                    "SELECT host, gpu, job, given_back_at, pids_json, after_loss FROM drains"
                ).fetchall()
        except StoreError as err:
            if "no such table" in str(err):
                return {}
            raise
        drains: dict[Slot, Drain] = {}
        for row in rows:
            try:
                pids = tuple((str(host), int(pid)) for host, pid in json.loads(row["pids_json"]))
            except (ValueError, TypeError) as err:
                # Still a drain: the GPU stays held until the job reports its smaller size.
                _log.warning("state store: drain of %s:%s: unreadable pids (%s)",
                             row["host"], row["gpu"], err)  # fmt: skip
                pids = ()
            drains[(row["host"], row["gpu"])] = Drain(
                row["job"], row["given_back_at"], pids, bool(row["after_loss"])
            )
        return drains

    def allocations_updated_at(self) -> float | None:
        """When ``replace_allocations`` last ran, or None if it never did."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT value FROM meta WHERE key = 'allocations_updated_at'"
            ).fetchone()
        return None if row is None else float(row["value"])

    # reports

    def add_report(
        self,
        job: str,
        epoch: int | None,
        world_size: int,
        rank: int,
        metrics: Mapping[str, float],
        now: float,
    ) -> None:
        """Record a worker's report, keeping only the job's newest reports; KeyError if no job.

        Inside ``transaction()`` the report is written with the group's other reports, in
        one batch just before the group commits (so reads inside the group do not see it
        yet): the allocator's RPC thread runs a group of reports every loop turn, and a
        statement's round trip through Python per report was a fifth of its cost.
        """
        metrics_json = json.dumps({str(k): float(v) for k, v in metrics.items()})
        row = (job, epoch, world_size, rank, now, metrics_json)
        with self._lock:
            if self._grouping:
                if self._group_lost:
                    raise self._rolled_back()
                if job not in self._group_report_jobs:
                    # The group holds the lock: a job found here is still there at the commit.
                    with self._errors("read"):
                        _require_job(self._conn, job)
                    self._group_report_jobs.add(job)
                self._group_reports.append(row)
                return
        with self._write() as conn:
            _insert_numbered(conn, "reports", [row], self._max_reports_per_job)

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

    # grant history

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
        (None: all), oldest first. ``trimmed_history`` says what the bound dropped."""
        with self._read() as conn:
            rows = conn.execute(
                "SELECT job, time, gpus, reason FROM grant_history"
                " WHERE (? IS NULL OR job = ?) AND (? IS NULL OR time >= ?)"
                " ORDER BY id DESC LIMIT ?",
                (job, job, since, since, -1 if limit is None else limit),
            ).fetchall()
        return [
            GrantChange(row["job"], row["time"], row["gpus"], row["reason"])
            for row in reversed(rows)
        ]

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

    # events

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

    # plumbing

    def _connect(self, database: str, *, uri: bool) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                database, uri=uri, check_same_thread=False, isolation_level=None, timeout=5.0
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open state store {self.path}: {exc}") from exc
        conn.row_factory = sqlite3.Row
        return conn

    def _configure_writer(self) -> None:
        with self._errors("open"):
            self._conn.execute("PRAGMA foreign_keys = ON")
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self._conn.execute("PRAGMA synchronous = NORMAL")
        if str(mode).lower() != "wal":
            # Some network filesystems cannot do WAL's shared memory; stay correct, if slower.
            _log.warning("state store %s: WAL mode unavailable, using %s journal", self.path, mode)

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

    def _job(self, row: sqlite3.Row, spec: Callable[[], HerdJob] | None = None) -> JobRecord:
        """The record of a row: its status parsed unless parsed before, its spec on demand.

        Called with the lock held (the caches are shared by the store's threads).
        """
        name: str = row["name"]
        text: str = row["status_json"]
        cached_status = self._statuses.get(name)
        if cached_status is not None and cached_status[0] == text:
            status = cached_status[1]
        else:
            try:
                status = _parse_status(text)
            except ValueError as exc:  # pydantic's ValidationError is one
                # Status is observed state: an unreadable one is rebuilt by the next
                # reconcile instead of failing every read of the store (`get`, /metrics,
                # the shutdown) for all jobs. Said once per unreadable text (it is cached).
                _log.warning(
                    "state store %s: the stored status of job %r is unreadable (%s);"
                    " showing it empty until the operator observes the job again",
                    self.path,
                    name,
                    str(exc).splitlines()[0],
                )
                status = HerdJobStatus()
            self._statuses[name] = (text, status)
        uid: str = row["uid"]
        generation: int = row["generation"]
        if spec is None:
            spec = functools.partial(self._spec, name, uid, generation, row["spec_json"])
        fingerprint: str = row["fingerprint"]
        if self._unreadable_specs.get(name) == (uid, generation):
            # The stored spec cannot serve as the last good one: a fingerprint no spec file
            # has makes the reconciler record the file's spec again (see record_spec).
            fingerprint = ""
        return JobRecord(
            name=name,
            uid=uid,
            spec_path=row["spec_path"],
            fingerprint=fingerprint,
            generation=generation,
            status=status,
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            load_spec=spec,
        )

    def _spec(self, name: str, uid: str, generation: int, text: str) -> HerdJob:
        """The spec of a record, parsed once per (uid, generation); ``text`` is its row's."""
        with self._lock:
            cached = self._specs.get(name)
            if cached is not None and cached[:2] == (uid, generation):
                return cached[2]
            try:
                spec = HerdJob.model_validate_json(text)
            except ValueError as exc:  # pydantic's ValidationError is one
                raise self._unreadable_spec(name, uid, generation, exc) from exc
            self._specs[name] = (uid, generation, spec)
            return spec

    def _unreadable_spec(
        self, name: str, uid: str, generation: int, exc: Exception
    ) -> UnreadableSpecError:
        """Said once per stored spec text (its job's uid and generation fix it)."""
        problem = str(exc).splitlines()[0]
        if self._unreadable_specs.get(name) != (uid, generation):
            self._unreadable_specs[name] = (uid, generation)
            _log.warning(
                "state store %s: the stored spec of job %r is unreadable (%s); the job shows"
                " without it until the operator records its spec file again",
                self.path,
                name,
                problem,
            )
        return UnreadableSpecError(
            f"state store {self.path}: the stored spec of job {name!r} is unreadable ({problem});"
            " it is recorded again from the spec file when the file is valid"
        )

    def _find_unreadable_specs(self) -> None:
        """Mark the specs that are not even JSON (a damaged row) at start, so the first
        reconcile records them again: parsing every spec would cost ~0.4 s per 10,000 jobs."""
        try:
            with self._lock:
                rows = self._conn.execute(
                    "SELECT name, uid, generation FROM jobs WHERE NOT json_valid(spec_json)"
                ).fetchall()
        except sqlite3.OperationalError:  # an SQLite built without JSON: found on first use
            return
        for row in rows:
            self._unreadable_spec(
                row["name"], row["uid"], row["generation"], ValueError("not JSON")
            )

    def _forget_cached(self) -> None:
        with self._lock:
            self._statuses.clear()
            self._specs.clear()

    @contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            if code in DAMAGE_CODES:
                raise self._damaged(str(exc)) from exc
            if action == "write" and code in WRITE_FAILURE_CODES:
                self._writes_fail(exc)
            raise StoreError(f"cannot {action} state store {self.path}: {exc}") from exc

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

    def _damaged(self, problem: str) -> DamagedStoreError:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = shlex.quote(str(self.path.with_name(f"damaged-{stamp}")))
        return DamagedStoreError(
            f"state store {self.path} is damaged: {problem}. To start over without it, stop"
            f" the operator and move the file aside with its -wal and -shm files: `mkdir {aside}"
            f" && mv {shlex.quote(str(self.path))}* {aside}/`. The jobs then start again from"
            " their spec files; their events and history stay in the moved files."
        )

    @contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._errors("read"):
            yield self._conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._errors("write"):
            if self._grouping:
                if self._group_lost:
                    # A savepoint now would begin a new transaction and commit this write
                    # without the earlier ones of the group.
                    raise self._rolled_back()
                # Inside transaction(): a savepoint keeps this method all-or-nothing.
                self._conn.execute("SAVEPOINT write")
                changes = self._conn.total_changes
                try:
                    yield self._conn
                except BaseException:
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK TO write")
                        self._conn.execute("RELEASE write")
                    else:  # SQLite rolled back the whole group (a full disk, an I/O error)
                        self._group_lost = True
                    raise
                self._conn.execute("RELEASE write")
                if self._conn.total_changes != changes:
                    self._group_wrote = True  # proven by the group's commit
                return
            if self._conn.in_transaction:
                raise StoreError(f"{self.path}: cannot write inside snapshot()")
            self._conn.execute("BEGIN IMMEDIATE")
            changes = self._conn.total_changes
            try:
                yield self._conn
            except BaseException:
                if self._conn.in_transaction:  # SQLite rolls back itself on some errors
                    self._conn.execute("ROLLBACK")
                raise
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error:
                # A commit the disk refused may leave the transaction open (SQLite rolls
                # back by itself on some errors only): every later write would fail too.
                if self._conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._conn.execute("ROLLBACK")
                raise
            # Only a commit that wrote a row needed room: one that changed nothing (a prune
            # with nothing to prune) succeeds on a full disk too, and proves nothing.
            wrote = self._conn.total_changes != changes
        if wrote:
            self._writes_work()

    def _rolled_back(self) -> StoreError:
        return StoreError(f"state store {self.path}: a failed write rolled back the group")

    def _writes_fail(self, exc: sqlite3.Error) -> None:
        """A write the storage refused. Said at most once a minute: every reconcile fails
        while the disk is full, and near full small writes fit and big ones do not, so the
        state may flap many times a second (the gauge and the event count show it all)."""
        self._failed_writes += 1
        if self.writable:
            self.writable = False
            self._unwritable_since = self._clock()
        now = time.monotonic()
        last = self._last_unwritable_log
        if last is not None and now - last < UNWRITABLE_LOG_SECONDS:
            return
        self._last_unwritable_log = now
        self._said_unwritable = True
        _log.error(
            "state store %s: writes fail (%s; %d so far); the jobs keep running, and what"
            " could not be recorded is recorded once writes work again",
            self.path,
            exc,
            self._failed_writes,
        )

    def _writes_work(self) -> None:
        """A commit that wrote rows: the storage takes writes (again). Said once per
        `writes fail` said, with the event `StoreWritable`."""
        with self._lock:
            if self.writable:
                return
            since = self._unwritable_since
            self.writable = True
            self._unwritable_since = None
            now = self._clock()
            if self._said_unwritable:  # each "writes fail" in the log gets its answer
                self._said_unwritable = False
                _log.warning(
                    "state store %s: writes work again (%d failed so far, the last %.0f s)",
                    self.path,
                    self._failed_writes,
                    now - (since if since is not None else now),
                )
            # A constant message: flapping near a full disk bumps one event's count.
            with contextlib.suppress(StoreError):
                self.add_event(None, "Normal", "StoreWritable", "store writes work again", now)


def _spec_json(job: HerdJob) -> str:
    return job.model_dump_json(by_alias=True)


def _unknown_job(name: str) -> KeyError:
    return KeyError(f"no job named {name!r} in the state store")


def _make_private(path: Path) -> None:
    """The database readable by its owner only (it holds every spec's env), whatever the
    umask or an older version of the file said."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(descriptor, 0o600)
        finally:
            os.close(descriptor)
    except OSError as exc:
        raise StoreError(f"cannot create state store {path}: {exc}") from exc


def _pool_sizes(conn: sqlite3.Connection) -> list[tuple[float, int]]:
    row = conn.execute("SELECT value FROM meta WHERE key = 'pool_sizes'").fetchone()
    if row is None:
        return []
    return [(float(at), int(gpus)) for at, gpus in json.loads(row["value"])]


class _Checkpointer:
    """Copies the write-ahead log into the database every ``interval`` seconds, from a
    daemon thread with a connection of its own (the writer's connection does not)."""

    def __init__(self, conn: sqlite3.Connection, path: Path, interval: float) -> None:
        self.completed = 0
        self._conn = conn
        self._path = path
        self._interval = interval
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failing = False
        while not self._stopping.wait(self._interval):
            try:
                # PASSIVE: copy what no reader still needs; never wait for the writer.
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            except sqlite3.Error as exc:
                if not failing:  # once per streak of failures: the writes report their own
                    _log.warning("state store %s: checkpoint failed: %s", self._path, exc)
                failing = True
                continue
            failing = False
            self.completed += 1

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._conn.close()


_NUMBERED_INSERTS = {
    "reports": "INSERT INTO reports (job, seq, epoch, world_size, rank, time, metrics_json)"
    " SELECT ?1, COALESCE(MAX(seq), 0) + 1, ?2, ?3, ?4, ?5, ?6 FROM reports WHERE job = ?1",
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
        raise _unknown_job(str(rows[0][0])) from None
    for job in dict.fromkeys(row[0] for row in rows):
        conn.execute(
            f"DELETE FROM {table} WHERE job = ?1"
            f" AND seq <= (SELECT MAX(seq) FROM {table} WHERE job = ?1) - ?2",
            (job, keep),
        )


def _require_job(conn: sqlite3.Connection, name: str) -> None:
    if conn.execute("SELECT 1 FROM jobs WHERE name = ?", (name,)).fetchone() is None:
        raise _unknown_job(name)


def _policy_text(spec_json: str) -> str | None:
    """The ``spec.policy`` of a stored spec as JSON text, None if it has none."""
    try:
        spec = json.loads(spec_json)
        return json.dumps(spec["spec"]["policy"])
    except (ValueError, KeyError, TypeError):
        return None


def _parse_status(text: str) -> HerdJobStatus:
    if text in ("", "{}"):  # a job not reconciled yet: no need to parse
        return _empty_status()
    return HerdJobStatus.model_validate_json(text)


@functools.cache
def _empty_status() -> HerdJobStatus:
    """One shared empty status (statuses are frozen), made on first use: made at import, it
    built the status models' validators before a restarted operator could serve."""
    return HerdJobStatus()


def _report(row: sqlite3.Row) -> Report:
    return Report(
        epoch=row["epoch"],
        time=row["time"],
        world_size=row["world_size"],
        metrics=MappingProxyType(json.loads(row["metrics_json"])),
        rank=row["rank"],
    )


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
