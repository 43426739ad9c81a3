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

The writer refuses a damaged file at open (``check()``; ``DamagedStoreError`` says how to
move it aside). A write the storage refuses (a full disk) fails like any ``StoreError``, for
the caller to retry; ``writable`` says whether the last one did, for the metrics.

One module per concern; each but ``connection`` is a mixin class over its ``StoreBase``:

- ``connection``: the connection, its lock, ``_read``/``_write``/``transaction()`` with
  savepoints, SQLite's errors as ``StoreError``, whether writes work, the checkpoint thread;
- ``schema``: the tables, the version and its migrations, the checks of a file at open;
- ``jobs``: specs and statuses as models, and the caches that parse each text once;
- ``allocations``: who holds which GPU, and the GPUs draining;
- ``shares``: the log of which sharing jobs each GPU held, with their counted memory;
- ``reports``: the workers' reports and the GPU usage samples (batched in a group);
- ``history``: the bounded grant history, its pruning, the pool's size over time;
- ``events``: the bounded event log.

Why mixins over one base class, not functions taking the connection behind a facade: every
method runs under the one lock, inside ``_write``'s transaction or savepoint, and the
group, the full-disk tracking and the caches are state of the one object, so the concerns
share ``self`` rather than pass it to each other; each of ``Store``'s methods is written
once, where its concern is, with its signature and docstring, not repeated in a facade;
and there is one ``_conn`` attribute, which every concern reads at each call (the tests
that simulate a full disk swap it). What the base needs from the concerns is explicit:
its three abstract methods. This module composes ``Store`` and holds the opening
sequence, which crosses the concerns.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from herd_operator.lifecycle import LoopHealth
from herd_operator.runtime.store.allocations import AllocationsMixin
from herd_operator.runtime.store.connection import DamagedStoreError, StoreError
from herd_operator.runtime.store.events import MAX_EVENTS, Event, EventsMixin, EventType
from herd_operator.runtime.store.history import (
    MAX_GRANTS_PER_JOB,
    PRUNE_BATCH_JOBS,
    GrantChange,
    GrantHistory,
    HistoryMixin,
    TrimmedHistory,
)
from herd_operator.runtime.store.jobs import JobsMixin, UnreadableSpecError
from herd_operator.runtime.store.reports import MAX_REPORTS_PER_JOB, ReportsMixin
from herd_operator.runtime.store.schema import DB_FILENAME, SCHEMA_VERSION, SchemaMixin
from herd_operator.runtime.store.shares import MAX_SHARE_CHANGES, ShareChange, SharesMixin

__all__ = [
    "BUSY_TIMEOUT_MS",
    "DB_FILENAME",
    "MAX_EVENTS",
    "MAX_GRANTS_PER_JOB",
    "MAX_REPORTS_PER_JOB",
    "MAX_SHARE_CHANGES",
    "PRUNE_BATCH_JOBS",
    "SCHEMA_VERSION",
    "DamagedStoreError",
    "Event",
    "EventType",
    "GrantChange",
    "GrantHistory",
    "ShareChange",
    "Store",
    "StoreError",
    "TrimmedHistory",
    "UnreadableSpecError",
]

BUSY_TIMEOUT_MS = 5_000
"""How long the writer waits for another process's write lock before a ``StoreError``."""


class Store(
    SchemaMixin,
    JobsMixin,
    AllocationsMixin,
    SharesMixin,
    ReportsMixin,
    HistoryMixin,
    EventsMixin,
):
    """The SQLite state store; see the package docstring for the guarantees."""

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
        loop_health: LoopHealth | None = None,
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
        The thread is a `Periodic` (`store-checkpoint`) reporting to ``loop_health``; it stops
        with ``close()``.
        """
        if max_reports_per_job < 1 or max_events < 1 or max_grants_per_job < 1:
            raise ValueError(
                "max_reports_per_job, max_events and max_grants_per_job must be at least 1"
            )
        if checkpoint_seconds is not None and not checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be positive, not {checkpoint_seconds}")
        super().__init__(path, readonly=readonly, clock=clock)
        self._init_jobs()
        self._init_reports(max_reports_per_job)
        self._init_history(max_grants_per_job)
        self._init_events(max_events)
        if readonly:
            self._conn = self._connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True)
        else:
            self._refuse_truncated(previous_state)
            self._create_private_file()
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
                self._make_sidecars_private()
            if checkpoint_seconds is not None and not readonly:
                self._start_checkpointer(checkpoint_seconds, loop_health)
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def open_readonly(cls, path: Path) -> Store:
        """Open an existing store for reading only, e.g. from a CLI while the operator runs."""
        return cls(path, readonly=True)
