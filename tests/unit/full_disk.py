"""Make a real store's writes fail as on a full disk, and free the space again.

No tmpfs can be mounted here, so the limit is SQLite's own: `PRAGMA max_page_count` on
the store's connection caps the file at its present size, and a write that needs a new
page fails with SQLITE_FULL ("database or disk is full"), as when the disk is full.

On a full disk the statements of a transaction usually succeed (their pages are changed
in SQLite's cache) and its COMMIT fails, when the pages are written to the write-ahead
log; the cap cannot make that happen, so `fail_commits` makes each COMMIT fail with the
error SQLite gives then.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from herd_operator.runtime.store import Store, StoreError

NO_LIMIT = 1_073_741_823


def cap_at_present_size(store: Store) -> None:
    """Writes that need a new page fail; small ones may still fit in the pages there are."""
    pages = store._conn.execute("PRAGMA page_count").fetchone()[0]
    store._conn.execute(f"PRAGMA max_page_count = {pages}")


def fill_up(store: Store) -> None:
    """Every write fails: the capped file is filled with events down to the last bytes
    (so the store is already unwritable when this returns)."""
    cap_at_present_size(store)
    size, index = 4096, 0
    while size:
        index += 1
        try:
            store.add_event(None, "Normal", "Filler", f"{index} {'x' * size}", 0.0)
        except StoreError:
            size //= 2


def make_room(store: Store) -> None:
    store._conn.execute(f"PRAGMA max_page_count = {NO_LIMIT}")


def refuse_writes(store: Store) -> None:
    """Every write fails with SQLITE_READONLY, as on a file system remounted read-only."""
    store._conn.execute("PRAGMA query_only = ON")


def accept_writes(store: Store) -> None:
    """Undo `refuse_writes`."""
    store._conn.execute("PRAGMA query_only = OFF")


SQLITE_FULL = 13


class _CommitsFail:
    """The store's connection, except that COMMIT fails as on a full disk."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.strip().upper() == "COMMIT":
            error = sqlite3.OperationalError("database or disk is full")
            error.sqlite_errorcode = SQLITE_FULL  # type: ignore[attr-defined]
            raise error
        return self.conn.execute(sql, *args)


def fail_commits(store: Store) -> None:
    """Every commit fails with SQLITE_FULL after its statements went through (the store
    rolls the transaction back), as when the write-ahead log cannot grow."""
    if not isinstance(store._conn, _CommitsFail):
        store._conn = _CommitsFail(store._conn)  # type: ignore[assignment]


def commit_again(store: Store) -> None:
    """Undo `fail_commits`."""
    if isinstance(store._conn, _CommitsFail):
        store._conn = store._conn.conn
