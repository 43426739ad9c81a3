"""The store's connection and how every concern uses it: the lock, reads, writes, groups.

``StoreBase`` holds the one SQLite connection and the one ``RLock`` that the operator's
threads (the control loop, the RPC thread) share, and the only ways the concerns touch
them: ``_read`` and ``_write`` (one transaction each, or a savepoint inside
``transaction()``), ``snapshot``, and the mapping of SQLite's errors to ``StoreError``,
which also tracks whether the storage takes writes (a full disk). The checkpoint thread is
here too: it exists only to keep the write-ahead log's copy out of the shared lock.

Apart from the tables because every concern's module builds on it, and none of it knows
a table: what the concerns must supply (a cache to drop when a group is rolled back, the
writes a group defers to its commit, the event that says writes work again) are the three
abstract methods at the end of the class.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Self

from herd_operator.controllers.errors import PermanentError, TemporaryError
from herd_operator.lifecycle import LoopHealth, Periodic

_log = logging.getLogger(__name__)

UNWRITABLE_LOG_SECONDS = 60.0
"""While writes keep failing (a full disk), the store says so at most this often."""
WRITE_FAILURE_CODES = frozenset({8, 10, 13, 14})
"""SQLITE_READONLY, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN (primary codes): the
storage refuses writes, as opposed to another process holding the database (BUSY)."""
DAMAGE_CODES = frozenset({11, 26})
"""SQLITE_CORRUPT, SQLITE_NOTADB: the file is not a database one can trust."""


class StoreError(TemporaryError):
    """The state database cannot be opened, read or written.

    Temporary to the control loop: another process may hold the database, a full disk
    may be freed; the reconciles whose writes were lost are redone with backoff.
    """


class DamagedStoreError(StoreError, PermanentError):
    """The state database is corrupt, not a database, or was truncated: nothing waiting
    can help, so the operator refuses to start on it (the message says how to recover).

    A `StoreError` to whoever opens or reads the store, and a `PermanentError` to the
    control loop, which checks that first: a reconcile that meets a damaged store is not
    retried (it failed the same way every minute, for every job)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="StoreDamaged")


DeferredWrite = Callable[[sqlite3.Connection], None]
"""Writes a concern leaves for the end of a ``transaction()`` group, run just before its
commit (see ``StoreBase._take_deferred_writes``)."""


class StoreBase(ABC):
    """The connection, its lock and the transactions every concern's methods run in.

    The connection is opened by ``Store.__init__`` (the opening sequence crosses the
    concerns); until then ``_conn`` is unset.
    """

    _conn: sqlite3.Connection

    def __init__(self, path: Path, *, readonly: bool, clock: Callable[[], float]) -> None:
        self.path = Path(path)
        self.readonly = readonly
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
        self._checkpointer: _Checkpointer | None = None

    @property
    def checkpoints(self) -> int:
        """Checkpoints the store's own thread has completed (0 without one)."""
        return 0 if self._checkpointer is None else self._checkpointer.completed

    def close(self) -> None:
        """Close the connection (and stop the checkpoint thread); further calls raise
        StoreError."""
        if self._checkpointer is not None:
            self._checkpointer.stop()
        with self._lock:
            self._conn.close()

    def __enter__(self) -> Self:
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
        deferred = self._take_deferred_writes()
        if lost or not self._conn.in_transaction:
            # A full disk or an I/O error inside made SQLite roll back the whole group.
            self._group_rolled_back()
            raise self._rolled_back()
        try:
            with self._errors("write"):
                if deferred is not None:
                    deferred(self._conn)
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

    def _connect(self, database: str, *, uri: bool) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(
                database, uri=uri, check_same_thread=False, isolation_level=None, timeout=5.0
            )
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open state store {self.path}: {exc}") from exc
        conn.row_factory = sqlite3.Row
        return conn

    def _create_private_file(self) -> None:
        """The database's directory (mode 0700) and the file itself, readable by its owner
        only (it holds every spec's env), whatever the umask or an older version said."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(
                f"cannot create the directory of state store {self.path}: {exc}"
            ) from exc
        try:
            descriptor = os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                os.fchmod(descriptor, 0o600)
            finally:
                os.close(descriptor)
        except OSError as exc:
            raise StoreError(f"cannot create state store {self.path}: {exc}") from exc

    def _configure_writer(self) -> None:
        with self._errors("open"):
            self._conn.execute("PRAGMA foreign_keys = ON")
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            self._conn.execute("PRAGMA synchronous = NORMAL")
        if str(mode).lower() != "wal":
            # Some network filesystems cannot do WAL's shared memory; stay correct, if slower.
            _log.warning("state store %s: WAL mode unavailable, using %s journal", self.path, mode)

    def _make_sidecars_private(self) -> None:
        for suffix in ("-wal", "-shm"):  # SQLite gives them the database's mode
            sidecar = self.path.with_name(self.path.name + suffix)
            if sidecar.exists():
                os.chmod(sidecar, 0o600)

    def _start_checkpointer(self, seconds: float, health: LoopHealth | None) -> None:
        """Copy the write-ahead log from a thread of the store's own (see ``Store``)."""
        with self._errors("open"):
            self._conn.execute("PRAGMA wal_autocheckpoint = 0")
            self._checkpointer = _Checkpointer(
                self._connect(str(self.path), uri=False), self.path, seconds, health
            )

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

    def _damaged(self, problem: str) -> DamagedStoreError:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        aside = shlex.quote(str(self.path.with_name(f"damaged-{stamp}")))
        state_dir = shlex.quote(str(self.path.parent))
        return DamagedStoreError(
            f"state store {self.path} is damaged: {problem}. Waiting will not mend it"
            f" (`herd-operator check-state --state-dir {state_dir} --full` checks the file)."
            " To start over without it, stop the operator and move the file aside with its"
            f" -wal and -shm files: `mkdir {aside} && mv {shlex.quote(str(self.path))}*"
            f" {aside}/`. The jobs then start again from their spec files; their events and"
            " history stay in the moved files."
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
            with contextlib.suppress(StoreError):
                self._record_writable(now)

    # What the concerns supply (each overridden by one of the store's mixins).

    @abstractmethod
    def _forget_cached(self) -> None:
        """Drop what was parsed from rows that a rolled-back group may have written."""

    @abstractmethod
    def _take_deferred_writes(self) -> DeferredWrite | None:
        """Take the writes the group's methods left for its commit (None: there are none);
        the next group starts with none, whether this one commits or is rolled back."""

    @abstractmethod
    def _record_writable(self, now: float) -> None:
        """Record, as an event, that the storage takes writes again."""


class _Checkpointer:
    """Copies the write-ahead log into the database every ``interval`` seconds, from a
    daemon thread (a `Periodic`) with a connection of its own (the writer's connection does
    not); a failing checkpoint is said once per streak of failures (the writes report their
    own) and backed off."""

    def __init__(
        self, conn: sqlite3.Connection, path: Path, interval: float, health: LoopHealth | None
    ) -> None:
        self.completed = 0
        self._conn = conn
        self._loop = Periodic(
            "store-checkpoint",
            self._checkpoint,
            interval,
            what=f"state store {path}: checkpoint",
            expected=(sqlite3.Error,),
            health=health,
            logger=_log,
        )
        self._loop.start()

    def _checkpoint(self) -> None:
        # PASSIVE: copy what no reader still needs; never wait for the writer.
        self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        self.completed += 1

    def stop(self) -> None:
        # Waited for: the connection is closed next, and a checkpoint never waits long.
        self._loop.stop(None)
        self._conn.close()
