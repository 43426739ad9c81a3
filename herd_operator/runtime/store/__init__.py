"""The operator's crash-safe embedded state store (see ``connection`` for its guarantees)."""

from herd_operator.runtime.store.connection import (
    BUSY_TIMEOUT_MS,
    DB_FILENAME,
    MAX_EVENTS,
    MAX_GRANTS_PER_JOB,
    MAX_REPORTS_PER_JOB,
    PRUNE_BATCH_JOBS,
    SCHEMA_VERSION,
    DamagedStoreError,
    Event,
    EventType,
    GrantChange,
    Store,
    StoreError,
    TrimmedHistory,
    UnreadableSpecError,
)

__all__ = [
    "BUSY_TIMEOUT_MS",
    "DB_FILENAME",
    "MAX_EVENTS",
    "MAX_GRANTS_PER_JOB",
    "MAX_REPORTS_PER_JOB",
    "PRUNE_BATCH_JOBS",
    "SCHEMA_VERSION",
    "DamagedStoreError",
    "Event",
    "EventType",
    "GrantChange",
    "Store",
    "StoreError",
    "TrimmedHistory",
    "UnreadableSpecError",
]
