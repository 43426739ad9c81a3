"""Make a real store's writes fail as on a full disk, and free the space again.

No tmpfs can be mounted here, so the limit is SQLite's own: `PRAGMA max_page_count` on
the store's connection caps the file at its present size, and a write that needs a new
page fails with SQLITE_FULL ("database or disk is full"), as when the disk is full.
"""

from __future__ import annotations

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
