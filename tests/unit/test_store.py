"""Tests for herd_operator.runtime.store."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from herd_operator.runtime.store import (
    DB_FILENAME,
    SCHEMA_VERSION,
    DamagedStoreError,
    GrantChange,
    Store,
    StoreError,
    TrimmedHistory,
    UnreadableSpecError,
)
from herd_operator.runtime.store import schema as store_module
from herd_operator.specs import HerdJob
from herd_operator.specs.status import GpuCounts, HerdJobStatus
from herd_operator.specs.values import Drain, Placement, UsageSample
from tests.unit.full_disk import (
    cap_at_present_size,
    commit_again,
    fail_commits,
    fill_up,
    make_room,
)


def make_spec(low: int = 1, high: int = 4, name: str = "resnet") -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": low, "max": high}},
        }
    )


SPEC = make_spec()


def placed(*hosts: tuple[str, list[int]]) -> Placement:
    return Placement(tuple((host, tuple(gpus)) for host, gpus in hosts))


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / DB_FILENAME


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    with Store(db_path) as opened:
        yield opened


# opening


def test_creates_private_parent_directory_and_wal_database(db_path: Path) -> None:
    with Store(db_path):
        pass
    assert stat.S_IMODE(db_path.parent.stat().st_mode) == 0o700
    raw = sqlite3.connect(db_path)
    try:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        raw.close()


def test_refuses_a_newer_schema_version(db_path: Path) -> None:
    Store(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    raw.close()
    expected = (
        f"{db_path}: schema version {SCHEMA_VERSION + 1} is newer than this herd-operator"
        f" supports ({SCHEMA_VERSION}); upgrade herd-operator to open it"
    )
    with pytest.raises(StoreError) as writable:
        Store(db_path)
    assert str(writable.value) == expected
    with pytest.raises(StoreError) as readonly:
        Store.open_readonly(db_path)
    assert str(readonly.value) == expected


def test_a_file_that_is_not_sqlite_is_refused_with_a_recovery_that_works(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not sqlite at all, " * 100)
    with pytest.raises(DamagedStoreError) as excinfo:
        Store(db_path)
    message = str(excinfo.value)
    assert message.startswith(f"state store {db_path} is damaged: file is not a database.")
    with pytest.raises(DamagedStoreError, match="file is not a database"):
        Store.open_readonly(db_path)
    # The command the message gives moves the file aside, and a new store starts empty.
    command = re.search(r"`(mkdir .*)`", message)
    assert command is not None
    subprocess.run(["sh", "-c", command.group(1)], check=True)
    (aside,) = db_path.parent.glob("damaged-*")
    assert (aside / DB_FILENAME).read_bytes().startswith(b"this is not sqlite")
    with Store(db_path) as fresh:
        assert fresh.list_jobs() == []


def corrupt_a_table_page(db_path: Path) -> None:
    """Overwrite the jobs table's last page in the file (not through SQLite)."""
    raw = sqlite3.connect(db_path)
    page_size = raw.execute("PRAGMA page_size").fetchone()[0]
    root = raw.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    raw.close()  # the last connection: SQLite checkpoints the WAL into the file
    with open(db_path, "r+b") as handle:
        handle.seek((root - 1) * page_size + 8)
        handle.write(b"\xff" * (page_size - 8))


def test_a_store_with_a_corrupt_page_is_refused_at_open(db_path: Path) -> None:
    with Store(db_path) as store:
        for index in range(20):
            store.record_spec(f"job-{index}", "/jobs/a.yaml", SPEC, "fp", now=1.0)
    corrupt_a_table_page(db_path)
    with pytest.raises(DamagedStoreError) as excinfo:
        Store(db_path)
    assert str(excinfo.value).startswith(f"state store {db_path} is damaged: ")
    assert "move the file aside" in str(excinfo.value)


def test_a_store_truncated_to_0_bytes_is_refused_when_a_store_was_set_up_before(
    tmp_path: Path, db_path: Path
) -> None:
    with Store(db_path) as store:
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    token = db_path.parent / "allocator.token"  # what the operator makes once its store opened
    token.write_text("secret")
    db_path.write_bytes(b"")
    with pytest.raises(DamagedStoreError) as excinfo:
        Store(db_path, previous_state=[token])
    assert "it is empty (0 bytes), yet" in str(excinfo.value)
    assert f"{token} shows a store was set up here before: it was truncated" in str(excinfo.value)
    assert db_path.stat().st_size == 0  # left as it was found
    # A -wal file left next to it is evidence enough on its own.
    db_path.with_name(DB_FILENAME + "-wal").write_bytes(b"")
    with pytest.raises(DamagedStoreError, match=r"state\.db-wal shows a store was set up"):
        Store(db_path)


def test_a_0_byte_file_and_nothing_else_is_a_store_never_set_up(
    tmp_path: Path, db_path: Path
) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"")  # a start that died between creating the file and the schema
    with Store(db_path, previous_state=[tmp_path / "absent.token"]) as store:
        assert store.list_jobs() == []


def test_a_database_with_tables_but_no_schema_version_is_refused(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    raw = sqlite3.connect(db_path)
    raw.execute("CREATE TABLE something_else (x)")
    raw.close()
    with pytest.raises(DamagedStoreError, match="it holds tables but no herd-operator schema"):
        Store(db_path)


def test_a_store_missing_a_table_of_its_version_is_refused(db_path: Path) -> None:
    Store(db_path).close()
    raw = sqlite3.connect(db_path)
    raw.execute("DROP TABLE events")
    raw.close()
    with pytest.raises(DamagedStoreError, match=r"table\(s\) missing: \['events'\]"):
        Store(db_path)


def test_readonly_open_of_missing_store_fails(db_path: Path) -> None:
    with pytest.raises(StoreError, match=r"unable to open database file"):
        Store.open_readonly(db_path)
    assert not db_path.exists()


def test_readonly_open_of_an_empty_database_fails(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    sqlite3.connect(db_path).close()
    with pytest.raises(StoreError) as excinfo:
        Store.open_readonly(db_path)
    assert str(excinfo.value) == f"{db_path}: not a herd-operator state store (it has no schema)"


def test_closed_store_raises_store_error(db_path: Path) -> None:
    store = Store(db_path)
    store.close()
    with pytest.raises(StoreError, match=r"^cannot read state store .*closed database"):
        store.list_jobs()


# schema versions

SCHEMA_V1 = """
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
CREATE TABLE runtime (
    name TEXT PRIMARY KEY REFERENCES jobs(name) ON DELETE CASCADE,
    launch_id TEXT NOT NULL,
    pid INTEGER NOT NULL,
    started_at REAL NOT NULL,
    generation INTEGER NOT NULL,
    restarts INTEGER NOT NULL,
    launched_max INTEGER NOT NULL
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
"""The schema of a version 1 store, as herd-operator 0.1 created it."""


def make_v1_store(path: Path) -> None:
    """A store as the first release left it: a job, with a row in the runtime table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = sqlite3.connect(path)
    try:
        raw.executescript(SCHEMA_V1)
        raw.execute(
            "INSERT INTO jobs (name, uid, spec_path, spec_json, fingerprint, generation,"
            " status_json, created_at, updated_at) VALUES (?, ?, ?, ?, ?, 1, ?, 1.0, 2.0)",
            (
                "resnet",
                "0" * 32,
                "/jobs/resnet.yaml",
                SPEC.model_dump_json(by_alias=True),
                "fp1",
                '{"epoch": 3}',
            ),
        )
        raw.execute("INSERT INTO runtime VALUES ('resnet', 'resnet-1', 4242, 1.0, 1, 0, 4)")
        raw.execute("PRAGMA user_version = 1")
        raw.commit()
    finally:
        raw.close()


def write_raw(path: Path, statement: str) -> None:
    """One statement committed to the store's file behind its back (an older store's rows)."""
    raw = sqlite3.connect(path)
    try:
        raw.execute(statement)
        raw.commit()
    finally:
        raw.close()


def tables(path: Path) -> set[str]:
    raw = sqlite3.connect(path)
    try:
        rows = raw.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        return {row[0] for row in rows} - {"sqlite_sequence"}
    finally:
        raw.close()


def user_version(path: Path) -> int:
    raw = sqlite3.connect(path)
    try:
        version: int = raw.execute("PRAGMA user_version").fetchone()[0]
        return version
    finally:
        raw.close()


def test_a_new_store_is_created_at_the_current_version_without_the_runtime_table(
    db_path: Path,
) -> None:
    Store(db_path).close()
    assert SCHEMA_VERSION == 7
    assert user_version(db_path) == 7
    assert tables(db_path) == {
        "jobs",
        "allocations",
        "drains",
        "reports",
        "gpu_usage",
        "grant_history",
        "grant_history_trimmed",
        "share_history",
        "events",
        "meta",
    }


def test_a_reader_reads_a_version_1_store_as_it_is(db_path: Path) -> None:
    make_v1_store(db_path)
    with Store.open_readonly(db_path) as reader:
        job = reader.get_job("resnet")
        assert job is not None
        assert (job.spec, job.status.epoch, job.generation) == (SPEC, 3, 1)
        assert [record.name for record in reader.list_jobs()] == ["resnet"]
        assert reader.allocations() == {}
        assert reader.draining() == {}, "no drains were recorded then"
        assert reader.trimmed_history() == {}, "no bound then: nothing was dropped"
        assert reader.share_history() == [], "no log of shared GPUs then"
    assert user_version(db_path) == 1  # a reader never migrates
    assert "runtime" in tables(db_path)


def test_the_writer_migrates_a_version_1_store(db_path: Path) -> None:
    make_v1_store(db_path)
    with Store(db_path) as store:
        job = store.get_job("resnet")
        assert job is not None and (job.uid, job.status.epoch) == ("0" * 32, 3)
    assert user_version(db_path) == SCHEMA_VERSION
    assert "runtime" not in tables(db_path)
    assert {"grant_history_trimmed", "drains", "share_history"} <= tables(db_path)
    with Store(db_path) as again:  # migrated once: opening again changes nothing
        assert again.get_job("resnet") == job


def test_a_failed_migration_leaves_the_store_at_its_version(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_v1_store(db_path)
    monkeypatch.setitem(
        store_module._MIGRATIONS, 2, ("DROP TABLE runtime", "SELECT * FROM no_such_table")
    )
    with pytest.raises(StoreError, match="no such table: no_such_table"):
        Store(db_path)
    # One transaction: the table dropped before the failure is back, the version unchanged.
    assert user_version(db_path) == 1
    assert "runtime" in tables(db_path)


# jobs


def test_first_record_gets_generation_one_and_a_fresh_uid(store: Store) -> None:
    job = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    assert job.name == "resnet"
    assert len(job.uid) == 32 and int(job.uid, 16) >= 0
    assert (job.generation, job.fingerprint, job.spec) == (1, "fp1", SPEC)
    assert job.spec is SPEC  # what was just written is not parsed back
    assert (job.status, job.created_at, job.updated_at) == (HerdJobStatus(), 100.0, 100.0)
    assert store.get_job("resnet") == job
    assert store.get_job("missing") is None
    assert store.has_job("resnet") and not store.has_job("missing")


def test_same_fingerprint_keeps_generation_and_may_move_spec_path(store: Store) -> None:
    first = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    again = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=200.0)
    assert again == first
    moved = store.record_spec("resnet", "/jobs/resnet.yml", SPEC, "fp1", now=300.0)
    assert moved.spec_path == "/jobs/resnet.yml"
    assert moved.generation == 1
    assert moved.updated_at == 300.0
    assert moved.uid == first.uid


def test_new_fingerprint_bumps_generation_and_replaces_spec(store: Store) -> None:
    first = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    new_spec = make_spec(2, 8)
    second = store.record_spec("resnet", "/jobs/r.yaml", new_spec, "fp2", now=200.0)
    third = store.record_spec("resnet", "/jobs/r.yaml", SPEC, "fp1", now=300.0)
    assert (second.generation, second.spec, second.spec_path) == (2, new_spec, "/jobs/r.yaml")
    assert (third.generation, third.spec) == (3, SPEC)
    assert third.uid == first.uid
    assert third.created_at == 100.0
    assert third.updated_at == 300.0


def test_recreated_job_gets_a_new_uid_and_starts_over(store: Store) -> None:
    first = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp2", now=110.0)
    assert store.delete_job("resnet") is True
    assert store.delete_job("resnet") is False
    recreated = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp2", now=200.0)
    assert recreated.uid != first.uid
    assert recreated.generation == 1
    assert recreated.created_at == 200.0


def test_an_unreadable_status_reads_as_empty(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    store.record_spec("bert", "/jobs/bert.yaml", make_spec(name="bert"), "fp1", now=1.0)
    raw = sqlite3.connect(store.path)
    raw.execute("UPDATE jobs SET status_json = '{\"epoch\": \"many\"}' WHERE name = 'resnet'")
    raw.commit()
    # Status is observed state: one corrupt row must not break `get` or /metrics for all
    # jobs; the reconciler rebuilds it. Said once, not on every read.
    with caplog.at_level("WARNING"):
        record = store.get_job("resnet")
        assert [job.name for job in store.list_jobs()] == ["bert", "resnet"]
    assert record is not None and record.status == HerdJobStatus()
    warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 1 and "the stored status of job 'resnet'" in warnings[0]
    raw.close()


def test_an_unreadable_spec_spoils_only_its_job_and_is_recorded_again_from_the_file(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A row corrupted with sqlite3 (valid JSON, not a spec: what a format change gives)."""
    resnet = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    store.record_spec("bert", "/jobs/bert.yaml", make_spec(name="bert"), "fp1", now=1.0)
    raw = sqlite3.connect(store.path)
    raw.execute("UPDATE jobs SET spec_json = '{\"spec\": 3}' WHERE name = 'resnet'")
    raw.commit()
    raw.close()
    with caplog.at_level("WARNING"):
        # The spec is parsed when it is asked for, not with every read of the job.
        records = {job.name: job for job in store.list_jobs()}
        assert records["bert"].spec.metadata.name == "bert"
        for _ in range(2):
            with pytest.raises(UnreadableSpecError, match=r"stored spec of job 'resnet' is unr"):
                store.list_jobs()[1].spec  # noqa: B018
    warnings = [r.getMessage() for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(warnings) == 1 and "the stored spec of job 'resnet'" in warnings[0]
    # Known unreadable, it matches no spec file's fingerprint, so the reconciler records the
    # file's spec again: the text is repaired, the generation (nothing changed) kept.
    damaged = store.get_job("resnet")
    assert damaged is not None and damaged.fingerprint == ""
    repaired = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=2.0)
    assert (repaired.fingerprint, repaired.generation) == ("fp1", resnet.generation)
    again = store.get_job("resnet")
    assert again is not None and again.spec == SPEC and again.fingerprint == "fp1"


def test_a_spec_that_is_not_json_is_found_when_the_writer_opens(db_path: Path) -> None:
    with Store(db_path) as store:
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    raw = sqlite3.connect(db_path)
    raw.execute("UPDATE jobs SET spec_json = 'garbage{' WHERE name = 'resnet'")
    raw.commit()
    raw.close()
    with Store(db_path) as store:
        record = store.get_job("resnet")
        # Without reading the spec: the first reconcile records the file's spec again.
        assert record is not None and record.fingerprint == ""


def test_put_status_replaces_status_and_refuses_unknown_job(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    assert store.put_status("resnet", HerdJobStatus(observed_generation=1), now=150.0) is True
    job = store.get_job("resnet")
    assert job is not None
    assert (job.status, job.updated_at, job.generation) == (
        HerdJobStatus(observed_generation=1),
        150.0,
        1,
    )
    with pytest.raises(KeyError) as excinfo:
        store.put_status("ghost", HerdJobStatus(epoch=1), now=1.0)
    assert excinfo.value.args == ("no job named 'ghost' in the state store",)


def test_a_status_equal_to_the_stored_one_is_not_written(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    status = HerdJobStatus(epoch=3, gpus=GpuCounts(min=1, max=4, allocated=2))
    assert store.put_status("resnet", status, now=150.0) is True
    # An equal status, as another model (a reconcile builds a new one each time).
    again = status.model_copy(update={"epoch": 3})
    assert store.put_status("resnet", again, now=160.0) is False
    job = store.get_job("resnet")
    assert job is not None and (job.status, job.updated_at) == (status, 150.0)
    assert store.put_status("resnet", status.model_copy(update={"epoch": 4}), now=170.0) is True
    job = store.get_job("resnet")
    assert job is not None and (job.status.epoch, job.updated_at) == (4, 170.0)
    # Not written is not written: a reader sees the same row.
    with Store.open_readonly(store.path) as reader:
        assert reader.get_job("resnet") == job


def test_the_stored_status_is_compared_as_last_read(db_path: Path) -> None:
    """Another writer's change is seen by the next read, and then written over."""
    with Store(db_path) as store, Store(db_path) as other:
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
        mine = HerdJobStatus(epoch=1)
        assert store.put_status("resnet", mine, now=2.0) is True
        assert other.put_status("resnet", HerdJobStatus(epoch=2), now=3.0) is True
        job = store.get_job("resnet")
        assert job is not None and job.status.epoch == 2
        assert store.put_status("resnet", mine, now=4.0) is True
        job = other.get_job("resnet")
        assert job is not None and job.status == mine


def test_reads_of_an_unchanged_row_share_the_parsed_models(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    store.put_status("resnet", HerdJobStatus(epoch=1), now=2.0)
    with Store.open_readonly(store.path) as reader:
        first, second = reader.get_job("resnet"), reader.get_job("resnet")
        assert first is not None and second is not None
        assert first.status is second.status and first.spec is second.spec
        # A write by the operator is seen by the reader's next read, never its cache.
        store.put_status("resnet", HerdJobStatus(epoch=2), now=3.0)
        store.record_spec("resnet", "/jobs/resnet.yaml", make_spec(2, 8), "fp2", now=3.0)
        third = reader.get_job("resnet")
        assert third is not None
        assert (third.status.epoch, third.spec.spec.gpus.min, third.generation) == (2, 2, 2)
    writer_view = store.get_job("resnet")
    assert writer_view is not None and writer_view.spec == make_spec(2, 8)


def test_statuses_are_immutable(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    job = store.get_job("resnet")
    assert job is not None
    with pytest.raises(ValidationError, match="frozen"):
        job.status.epoch = 3  # type: ignore[misc]


def test_a_failed_group_commit_forgets_what_it_wrote(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    status = HerdJobStatus(epoch=1)
    with pytest.raises(StoreError), store.transaction():
        store.put_status("resnet", status, now=2.0)
        store._conn.execute("ROLLBACK")  # as a failed COMMIT leaves it (e.g. disk full)
    # Written again at once, without a read in between: the rolled-back text is not trusted.
    assert store.put_status("resnet", status, now=3.0) is True
    job = store.get_job("resnet")
    assert job is not None and (job.status, job.updated_at) == (status, 3.0)


def test_list_jobs_is_sorted_by_name(store: Store) -> None:
    for name in ["zeta", "alpha", "mid"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    assert [job.name for job in store.list_jobs()] == ["alpha", "mid", "zeta"]


# allocations


def test_allocations_keep_host_and_local_rank_order(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    placements = {
        "resnet": placed(("nid0009", [3, 1]), ("nid0002", [2, 0])),
        "bert": placed(("nid0002", [3]), ("nid0009", [0, 2])),
    }
    store.replace_allocations(placements, now=50.0)
    assert store.allocations() == placements
    assert list(store.allocations()) == ["bert", "resnet"]
    assert store.allocations_updated_at() == 50.0


def test_replace_allocations_replaces_the_whole_table(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    assert store.allocations_updated_at() is None
    store.replace_allocations(
        {"resnet": placed(("h", [0, 1])), "bert": placed(("h", [2]))}, now=1.0
    )
    # The GPU bert had moves to resnet: legal because the old rows go in the same transaction.
    # A job that holds nothing (bert, and a pending job not recorded yet) has no rows.
    store.replace_allocations(
        {"resnet": placed(("h", [0, 1, 2])), "bert": Placement.EMPTY, "new": Placement.EMPTY},
        now=2.0,
    )
    assert store.allocations() == {"resnet": placed(("h", [0, 1, 2]))}
    store.replace_allocations({}, now=3.0)
    assert store.allocations() == {}
    assert store.allocations_updated_at() == 3.0


def test_draining_gpus_are_recorded_with_the_allocations_and_replaced_with_them(
    store: Store,
) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    draining = {
        ("h", 2): Drain("resnet", 40.5, (("h", 4242), ("h", 4243))),
        ("g", 0): Drain("resnet", 41.0, (), after_loss=True),
    }
    store.replace_allocations({"resnet": placed(("h", [0, 1]))}, now=42.0, draining=draining)
    assert store.draining() == draining
    assert store.allocations() == {"resnet": placed(("h", [0, 1]))}
    store.replace_allocations({"resnet": placed(("h", [0, 1]))}, now=43.0)
    assert store.draining() == {}, "each decision says every drain there is"


def test_a_refused_decision_leaves_the_drains_as_they_were(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    draining = {("h", 2): Drain("resnet", 40.0, (("h", 7),))}
    store.replace_allocations({"resnet": placed(("h", [0]))}, now=1.0, draining=draining)
    with pytest.raises(KeyError):
        store.replace_allocations({"ghost": placed(("h", [0]))}, now=2.0)
    assert store.draining() == draining


def test_gpu_placed_for_two_jobs_is_refused_and_nothing_changes(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    before = {"resnet": placed(("h", [0]))}
    store.replace_allocations(before, now=1.0)
    with pytest.raises(ValueError) as excinfo:
        store.replace_allocations(
            {"resnet": placed(("h", [0, 1])), "bert": placed(("h", [1]))}, now=2.0
        )
    assert str(excinfo.value) == "GPU h:1 is placed twice (jobs 'resnet' and 'bert')"
    assert store.allocations() == before
    assert store.allocations_updated_at() == 1.0


def test_schema_primary_key_refuses_a_gpu_twice_in_one_job(db_path: Path) -> None:
    with Store(db_path) as store:
        for name in ["resnet", "bert"]:
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.replace_allocations({"resnet": placed(("h", [0]))}, now=1.0)
    raw = sqlite3.connect(db_path)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            raw.execute(
                "INSERT INTO allocations (host, gpu, job, host_ordinal, local_rank)"
                " VALUES ('h', 0, 'resnet', 0, 1)"
            )
    finally:
        raw.close()


def test_a_gpu_shared_by_memory_is_recorded_for_each_sharing_job(store: Store) -> None:
    for name in ["resnet", "bert", "gpt"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    shared = {"resnet": placed(("h", [0, 1])), "bert": placed(("h", [1]))}
    store.replace_allocations({**shared, "gpt": placed(("h", [2]))}, 1.0, None, {"resnet", "bert"})
    assert store.allocations() == {**shared, "gpt": placed(("h", [2]))}
    assert store.shared_jobs() == {"resnet", "bert"}
    # A job that does not share is never recorded on a shared GPU.
    with pytest.raises(ValueError, match=r"^GPU h:1 is placed twice \(jobs 'bert' and 'gpt'\)$"):
        store.replace_allocations(
            {**shared, "gpt": placed(("h", [1]))}, 2.0, None, {"resnet", "bert"}
        )
    assert store.shared_jobs() == {"resnet", "bert"}


def test_the_migration_to_version_5_keeps_the_allocations_unshared(db_path: Path) -> None:
    make_v1_store(db_path)
    write_raw(db_path, "INSERT INTO allocations VALUES ('h', 3, 'resnet', 0, 0)")
    with Store(db_path) as store:
        assert store.allocations() == {"resnet": placed(("h", [3]))}
        assert store.shared_jobs() == frozenset()


def test_bad_placements_are_refused(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    # A host twice, or a GPU twice on a host, is refused by Placement itself.
    with pytest.raises(ValueError, match=r"^job 'resnet': host 'h' has an empty GPU list$"):
        store.replace_allocations({"resnet": placed(("g", [0]), ("h", []))}, now=1.0)
    with pytest.raises(KeyError, match="no job named 'ghost'"):
        store.replace_allocations(
            {"resnet": placed(("h", [0])), "ghost": placed(("h", [1]))}, now=1.0
        )
    assert store.allocations() == {}


# cascades


def test_delete_job_takes_allocations_reports_and_usage_but_keeps_logs(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.add_report(name, 1, 2, 0, {"loss": 0.5}, now=2.0)
        store.add_usage(name, 2, 100, 1000, now=2.0)
        store.add_event(name, "Normal", "Launched", "started", now=3.0)
        store.add_grant_change(name, 2, "admitted", now=3.0)
    store.replace_allocations(
        {"resnet": placed(("h", [0, 1])), "bert": placed(("h", [2]))}, now=4.0
    )

    store.delete_job("resnet")

    assert store.allocations() == {"bert": placed(("h", [2]))}
    assert store.reports("resnet") == []
    assert store.usage("resnet") == []
    assert [event.job for event in store.events()] == ["resnet", "bert"]
    assert [change.job for change in store.grant_history()] == ["resnet", "bert"]
    assert len(store.reports("bert")) == 1
    assert len(store.usage("bert")) == 1


# reports


def test_reports_are_returned_oldest_first_with_since_and_limit(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    for epoch in range(5):
        store.add_report("resnet", epoch, 4, 0, {"loss": 1.0 / (epoch + 1)}, now=10.0 + epoch)
    store.add_report("resnet", None, 2, 0, {}, now=20.0)
    assert [r.epoch for r in store.reports("resnet")] == [0, 1, 2, 3, 4, None]
    assert [r.epoch for r in store.reports("resnet", since=13.0)] == [3, 4, None]
    assert [r.epoch for r in store.reports("resnet", limit=2)] == [4, None]
    last = store.reports("resnet", limit=1)[-1]
    assert (last.epoch, last.world_size, last.rank, last.time, dict(last.metrics)) == (
        None,
        2,
        0,
        20.0,
        {},
    )
    first = store.reports("resnet")[0]
    assert dict(first.metrics) == {"loss": 1.0}
    with pytest.raises(TypeError):
        first.metrics["loss"] = 2.0  # type: ignore[index]


def test_reports_are_pruned_per_job_to_the_newest(db_path: Path) -> None:
    with Store(db_path, max_reports_per_job=3) as store:
        for name in ["resnet", "bert"]:
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.add_report("bert", 0, 1, 0, {}, now=1.0)
        for epoch in range(10):
            store.add_report("resnet", epoch, 1, 0, {}, now=float(epoch))
        assert [r.epoch for r in store.reports("resnet")] == [7, 8, 9]
        assert [r.epoch for r in store.reports("bert")] == [0]
    raw = sqlite3.connect(db_path)
    try:
        count = raw.execute("SELECT COUNT(*) FROM reports WHERE job = 'resnet'").fetchone()[0]
    finally:
        raw.close()
    assert count == 3


def test_background_checkpoints_copy_the_log_into_the_database(db_path: Path) -> None:
    with Store(db_path, checkpoint_seconds=0.05) as store:
        writer = store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        assert writer == 0  # the writer's commits never checkpoint
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
        for epoch in range(50):
            store.add_report("resnet", epoch, 1, 0, {}, now=float(epoch))
        after_writes = store.checkpoints
        deadline = time.monotonic() + 30
        while store.checkpoints < after_writes + 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.checkpoints >= after_writes + 2
        # immutable=1 reads the database file alone, without the write-ahead log: the
        # reports are there only if a checkpoint copied them.
        raw = sqlite3.connect(f"{db_path.resolve().as_uri()}?immutable=1", uri=True)
        try:
            copied = raw.execute("SELECT COUNT(*) FROM reports").fetchone()[0]
        finally:
            raw.close()
        assert copied == 50
    assert not [t for t in threading.enumerate() if t.name == "store-checkpoint"]


def test_without_a_checkpoint_thread_the_store_starts_none(store: Store) -> None:
    assert store.checkpoints == 0
    assert store._conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == 1000
    assert not [t for t in threading.enumerate() if t.name == "store-checkpoint"]


@pytest.mark.parametrize("seconds", [0.0, -1.0, float("nan")])
def test_checkpoint_seconds_must_be_positive(db_path: Path, seconds: float) -> None:
    with pytest.raises(ValueError, match="checkpoint_seconds must be positive"):
        Store(db_path, checkpoint_seconds=seconds)


def test_reports_of_a_group_are_written_together_at_its_commit(db_path: Path) -> None:
    with Store(db_path, max_reports_per_job=3) as store:
        for name in ["resnet", "bert"]:
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.add_report("resnet", 0, 1, 0, {}, now=0.5)
        with store.transaction():
            for epoch in range(1, 6):
                store.add_report("resnet", epoch, 2, 0, {"loss": 0.5}, now=float(epoch))
            store.add_report("bert", 7, 1, 0, {}, now=7.0)
            with pytest.raises(KeyError, match="no job named 'ghost'"):
                store.add_report("ghost", 1, 1, 0, {}, now=1.0)
            # Not yet written: the batch goes in just before the commit.
            assert [r.epoch for r in store.reports("resnet")] == [0]
        # In order after the earlier one, pruned to the newest 3, the refused one left out.
        assert [r.epoch for r in store.reports("resnet")] == [3, 4, 5]
        assert [dict(r.metrics) for r in store.reports("resnet")] == [{"loss": 0.5}] * 3
        assert [r.epoch for r in store.reports("bert")] == [7]
        store.add_report("resnet", 6, 2, 0, {}, now=6.0)
        assert [r.epoch for r in store.reports("resnet")] == [4, 5, 6]


def test_a_measurement_within_an_epoch_is_kept_apart_from_a_reset(db_path: Path) -> None:
    with Store(db_path) as store:
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
        store.add_report("resnet", None, 2, 0, {}, now=2.0)
        store.add_report("resnet", None, 2, 0, {"step_seconds": 0.5}, now=3.0, measurement=True)
        with store.transaction():  # the RPC server's grouped write keeps it too
            store.add_report("resnet", None, 4, 0, {"step_seconds": 0.3}, 4.0, measurement=True)
        store.add_report("resnet", 0, 4, 0, {"step_seconds": 0.3}, now=5.0)
        reports = store.reports("resnet")
    assert [(r.epoch, r.world_size, r.measurement) for r in reports] == [
        (None, 2, False),
        (None, 2, True),
        (None, 4, True),
        (0, 4, False),
    ]
    assert dict(reports[1].metrics) == {"step_seconds": 0.5}


def test_an_older_stores_reports_are_no_measurements_for_a_reader_and_after_migration(
    db_path: Path,
) -> None:
    make_v1_store(db_path)
    write_raw(db_path, "INSERT INTO reports VALUES ('resnet', 1, NULL, 2, 0, 5.0, '{}')")
    with Store.open_readonly(db_path) as reader:  # no such column in a version 1 store
        assert [(r.world_size, r.measurement) for r in reader.reports("resnet")] == [(2, False)]
    with Store(db_path) as store:
        store.add_report("resnet", None, 2, 0, {"batch_size": 64}, now=6.0, measurement=True)
        assert [r.measurement for r in store.reports("resnet")] == [False, True]


def test_report_of_unknown_job_is_refused(store: Store) -> None:
    with pytest.raises(KeyError, match="no job named 'ghost'"):
        store.add_report("ghost", 1, 1, 0, {}, now=1.0)


# grant history


def test_grant_history_filters_by_job_and_since(store: Store) -> None:
    store.add_grant_change("resnet", 2, "admitted", now=1.0)
    store.add_grant_change("bert", 1, "admitted", now=2.0)
    store.add_grant_change("resnet", 4, "scaled up", now=3.0)
    assert store.grant_history() == [
        GrantChange("resnet", 1.0, 2, "admitted"),
        GrantChange("bert", 2.0, 1, "admitted"),
        GrantChange("resnet", 3.0, 4, "scaled up"),
    ]
    assert [c.gpus for c in store.grant_history(job="resnet")] == [2, 4]
    assert [c.job for c in store.grant_history(since=2.0)] == ["bert", "resnet"]
    assert store.grant_history(job="bert", since=2.5) == []
    assert store.grant_history(limit=2) == store.grant_history()[1:]


def test_grant_history_keeps_the_newest_per_job_and_says_what_it_dropped(db_path: Path) -> None:
    with Store(db_path, max_grants_per_job=3) as store:
        for step in range(5):
            store.add_grant_change("resnet", step + 1, "resized", now=float(step))
        store.add_grant_change("bert", 1, "admitted", now=9.0)

        assert [c.gpus for c in store.grant_history("resnet")] == [3, 4, 5]
        assert [c.gpus for c in store.grant_history("bert")] == [1]
        assert store.trimmed_history() == {"resnet": TrimmedHistory(dropped=2, through=1.0)}
        trims = [e for e in store.events("resnet") if e.reason == "GrantHistoryTrimmed"]
        assert len(trims) == 1 and trims[0].count == 1, "said once, at the first drop"
        assert "newest 3 grant changes" in trims[0].message


def test_pruning_removes_only_deleted_jobs_history_past_the_retention(store: Store) -> None:
    store.record_spec("alive", "/jobs/alive.yaml", SPEC, "fp", now=1.0)
    for name, last in [("alive", 10.0), ("old", 10.0), ("recent", 95.0)]:
        store.add_grant_change(name, 2, "admitted", now=1.0)
        store.add_grant_change(name, 0, "spec deleted", now=last)

    pruned, after = store.prune_deleted_history(older_than=90.0)

    assert (pruned, after) == (["old"], None)
    assert sorted({c.job for c in store.grant_history()}) == ["alive", "recent"]


def test_pruning_walks_the_names_in_bounded_steps(store: Store) -> None:
    names = [f"job{index:02d}" for index in range(5)]
    for name in names:
        store.add_grant_change(name, 1, "admitted", now=1.0)
    walked: list[str] = []
    after: str | None = ""
    steps = 0
    while after is not None:
        pruned, after = store.prune_deleted_history(older_than=2.0, after=after, limit=2)
        walked += pruned
        steps += 1
    assert walked == names
    assert steps == 3
    assert store.grant_history() == []


# events


def test_repeated_event_bumps_count_and_last_time(store: Store) -> None:
    first = store.add_event("resnet", "Warning", "BackOff", "restart failed", now=1.0)
    again = store.add_event("resnet", "Warning", "BackOff", "restart failed", now=5.0)
    assert again.id == first.id
    assert (again.count, again.time, again.last_time) == (2, 1.0, 5.0)
    assert store.events("resnet") == [again]


def test_event_only_dedups_against_the_jobs_latest_event(store: Store) -> None:
    store.add_event("resnet", "Normal", "Scaled", "to 2", now=1.0)
    store.add_event("bert", "Normal", "Scaled", "to 1", now=2.0)
    # bert's event in between does not break resnet's dedup: it is per job.
    store.add_event("resnet", "Normal", "Scaled", "to 2", now=3.0)
    store.add_event("resnet", "Normal", "Scaled", "to 4", now=4.0)
    store.add_event("resnet", "Normal", "Scaled", "to 2", now=5.0)
    store.add_event("resnet", "Warning", "Scaled", "to 2", now=6.0)
    resnet = store.events("resnet")
    assert [(e.message, e.type, e.count) for e in resnet] == [
        ("to 2", "Normal", 2),
        ("to 4", "Normal", 1),
        ("to 2", "Normal", 1),
        ("to 2", "Warning", 1),
    ]


def test_operator_events_without_job_dedup_among_themselves(store: Store) -> None:
    store.add_event(None, "Normal", "Started", "operator up", now=1.0)
    store.add_event("resnet", "Normal", "Started", "operator up", now=2.0)
    bumped = store.add_event(None, "Normal", "Started", "operator up", now=3.0)
    assert (bumped.job, bumped.count) == (None, 2)
    assert len(store.events()) == 2


def test_events_are_newest_last_by_last_occurrence_and_limited(store: Store) -> None:
    store.add_event("a", "Normal", "Launched", "one", now=1.0)
    store.add_event("b", "Normal", "Launched", "two", now=2.0)
    store.add_event("a", "Normal", "Launched", "one", now=3.0)
    assert [e.job for e in store.events()] == ["b", "a"]
    assert [e.job for e in store.events(limit=1)] == ["a"]


def test_events_are_pruned_to_the_newest(db_path: Path) -> None:
    with Store(db_path, max_events=3) as store:
        for i in range(6):
            store.add_event("resnet", "Normal", "Tick", f"tick {i}", now=float(i))
        assert [e.message for e in store.events()] == ["tick 3", "tick 4", "tick 5"]


def test_event_type_and_reason_are_validated(store: Store) -> None:
    with pytest.raises(
        ValueError, match=r"^event type must be 'Normal' or 'Warning', got 'Error'$"
    ):
        store.add_event("a", "Error", "Failed", "x", now=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^event reason must be UpperCamelCase, got 'back off'$"):
        store.add_event("a", "Warning", "back off", "x", now=1.0)
    assert store.events() == []


# other processes, durability, threads


def test_readonly_reader_sees_committed_data_while_writer_is_open(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    with Store.open_readonly(store.path) as reader:
        assert [job.name for job in reader.list_jobs()] == ["resnet"]
        store.record_spec("bert", "/jobs/bert.yaml", SPEC, "fp1", now=2.0)
        assert [job.name for job in reader.list_jobs()] == ["bert", "resnet"]
        with pytest.raises(StoreError, match=r"^cannot write state store .*readonly database"):
            reader.add_event(None, "Normal", "Tried", "to write", now=3.0)


def test_snapshot_holds_one_consistent_view(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    with Store.open_readonly(store.path) as reader:
        with reader.snapshot():
            # The view is fixed on entry, before any read inside.
            store.record_spec("bert", "/jobs/bert.yaml", SPEC, "fp1", now=2.0)
            assert len(reader.list_jobs()) == 1
            store.replace_allocations({"bert": placed(("h", [0]))}, now=2.0)
            assert len(reader.list_jobs()) == 1
            assert reader.allocations() == {}
        assert len(reader.list_jobs()) == 2
        assert reader.allocations() == {"bert": placed(("h", [0]))}


def test_writes_inside_a_snapshot_are_refused(store: Store) -> None:
    with store.snapshot(), pytest.raises(StoreError, match=r"cannot write inside snapshot\(\)$"):
        store.add_grant_change("a", 1, "x", now=1.0)
    store.add_grant_change("a", 1, "x", now=1.0)
    assert len(store.grant_history()) == 1


def test_data_survives_reopening(db_path: Path) -> None:
    writer = Store(db_path)
    writer.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    writer.put_status("resnet", HerdJobStatus(launch_id="resnet-1"), now=1.0)
    # A second writer while the first is still open (as after a crash without close()).
    with Store(db_path) as second:
        job = second.get_job("resnet")
        assert job is not None and job.generation == 1
        assert job.status.launch_id == "resnet-1"
        second.add_event("resnet", "Normal", "Adopted", "pid 4242", now=2.0)
    writer.close()
    with Store(db_path) as reopened:
        assert reopened.get_job("resnet") == job
        assert [e.reason for e in reopened.events()] == ["Adopted"]
        assert reopened.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", 3.0) == job


def test_threads_share_one_store(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)

    def report(rank: int) -> None:
        for epoch in range(25):
            store.add_report("resnet", epoch, 4, rank, {"loss": 0.1}, now=float(epoch))

    threads = [threading.Thread(target=report, args=(rank,)) for rank in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10.0)
    assert len(store.reports("resnet")) == 100


# GPU usage


def test_latest_usage_is_each_jobs_newest_sample(store: Store) -> None:
    for name in ("resnet", "bert", "idle"):
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp1", now=1.0)
    store.add_usage("resnet", 2, 100, 1000, now=2.0)
    store.add_usage("bert", 1, 50, 500, now=2.5)
    store.add_usage("resnet", 2, 300, 1000, now=3.0)
    store.add_usage("resnet", 2, 200, 1000, now=2.9)  # arrived last, so it is the newest

    latest = store.latest_usage()

    assert latest == {
        "resnet": UsageSample(2.9, 2, 200, 1000),
        "bert": UsageSample(2.5, 1, 50, 500),
    }
    assert [sample.used_bytes for sample in store.usage("resnet", limit=1)] == [200]


# grouped transactions


def test_transaction_commits_its_writes_once_at_the_end(store: Store) -> None:
    with Store.open_readonly(store.path) as reader:
        with store.transaction():
            store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
            store.put_status("resnet", HerdJobStatus(epoch=3), now=2.0)
            store.add_event("resnet", "Normal", "Started", "pid 1", now=2.0)
            assert store.get_job("resnet") is not None  # the writer reads its own writes
            assert reader.list_jobs() == []  # nobody else sees them yet
            assert reader.events() == []
        job = reader.get_job("resnet")
        assert job is not None and job.status == HerdJobStatus(epoch=3)
        assert [event.reason for event in reader.events()] == ["Started"]


def test_a_failing_write_inside_a_transaction_undoes_only_itself(store: Store) -> None:
    with store.transaction():
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
        with pytest.raises(KeyError, match="no job named 'ghost'"):
            store.replace_allocations(
                {"resnet": placed(("h", [0])), "ghost": placed(("h", [1]))}, now=2.0
            )
        store.add_grant_change("resnet", 1, "admitted", now=3.0)
    assert store.get_job("resnet") is not None
    assert store.allocations() == {}  # the failed replacement left nothing behind
    assert [change.gpus for change in store.grant_history()] == [1]


def test_an_exception_leaving_a_transaction_keeps_the_completed_writes(store: Store) -> None:
    with pytest.raises(RuntimeError, match="boom"), store.transaction():
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
        raise RuntimeError("boom")
    assert store.get_job("resnet") is not None
    store.record_spec("bert", "/jobs/bert.yaml", SPEC, "fp1", now=2.0)  # no transaction left open
    with Store.open_readonly(store.path) as reader:
        assert [job.name for job in reader.list_jobs()] == ["bert", "resnet"]


def test_transactions_do_not_nest_or_mix_with_snapshots(store: Store) -> None:
    nested = r"transaction\(\) cannot be nested or in snapshot"
    with store.transaction():
        with pytest.raises(StoreError, match=nested), store.transaction():
            pass
        inside = r"snapshot\(\) cannot be used inside transaction"
        with pytest.raises(StoreError, match=inside), store.snapshot():
            pass
        store.add_grant_change("a", 1, "still usable", now=1.0)
    with store.snapshot(), pytest.raises(StoreError, match=nested), store.transaction():
        pass
    assert len(store.grant_history()) == 1


def test_other_threads_wait_for_a_transaction_to_end(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    entered, written = threading.Event(), threading.Event()

    def report_from_another_thread() -> None:
        entered.set()
        store.add_report("resnet", epoch=1, world_size=2, rank=0, metrics={}, now=5.0)
        written.set()

    with store.transaction():
        store.put_status("resnet", HerdJobStatus(epoch=1), now=2.0)
        thread = threading.Thread(target=report_from_another_thread)
        thread.start()
        assert entered.wait(5)
        # It blocks on the store until the group commits; it does not join the group.
        assert not written.wait(0.2)
    thread.join(5)
    assert written.is_set()
    assert [report.epoch for report in store.reports("resnet")] == [1]


def test_the_database_is_private_whatever_the_umask_or_an_older_file_said(tmp_path: Path) -> None:
    """It holds every spec's env: once created 0644, other local users could read it."""
    path = tmp_path / "state.db"
    path.touch(mode=0o644)
    path.chmod(0o644)
    old = os.umask(0o022)
    try:
        with Store(path) as store:
            store.record_spec("resnet", "jobs/resnet.yaml", SPEC, "fp", now=1.0)
            modes = {
                p.name: stat.S_IMODE(p.stat().st_mode)
                for p in tmp_path.iterdir()
                if p.name.startswith("state.db")
            }
    finally:
        os.umask(old)
    assert modes and set(modes.values()) == {0o600}, modes


# writes the storage refuses


def test_refused_writes_mark_the_store_unwritable_until_one_works_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    assert store.writable
    big = "x" * 100_000  # needs new pages
    with caplog.at_level("ERROR"):
        fill_up(store)
        for attempt in range(5):
            with pytest.raises(StoreError, match="database or disk is full"):
                store.add_event("resnet", "Warning", "Big", f"{attempt}{big}", now=2.0)
            with pytest.raises(StoreError), store.transaction():
                store.add_event("resnet", "Warning", "Big", f"{attempt}{big}", now=2.0)
    assert not store.writable
    # Said when it starts, not once per refused write (a reconcile each makes one).
    failures = [r for r in caplog.records if "writes fail" in r.getMessage()]
    assert len(failures) == 1 and "the jobs keep running" in failures[0].getMessage()
    assert store.get_job("resnet") is not None  # reads go on
    make_room(store)
    with caplog.at_level("WARNING"):
        store.add_event("resnet", "Normal", "Small", "fits", now=3.0)
    assert store.writable
    assert len([r for r in caplog.records if "writes fail" in r.getMessage()]) == 1
    (back,) = store.events(limit=1)  # timed by the store's clock, after the test's times
    assert (back.job, back.type, back.reason) == (None, "Normal", "StoreWritable")


def test_a_group_a_full_disk_rolled_back_is_lost_and_proves_nothing(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    cap_at_present_size(store)
    # SQLite rolls back a whole transaction on a full disk: the group is lost (and redone),
    # including what it wrote before, and what it would write after.
    rolled_back = pytest.raises(StoreError, match="a failed write rolled back the group")
    with rolled_back, store.transaction():
        store.record_spec("bert", "/jobs/bert.yaml", make_spec(name="bert"), "fp", now=2.0)
        with pytest.raises(StoreError, match="database or disk is full"):
            store.add_event("resnet", "Warning", "Big", "y" * 100_000, now=2.0)
        with pytest.raises(StoreError, match="a failed write rolled back the group"):
            store.add_event("resnet", "Normal", "Small", "after", now=2.0)
    assert not store.writable  # the group's one good write proves nothing
    assert store.get_job("bert") is None
    assert [event.reason for event in store.events()] == []


@pytest.mark.parametrize(
    "writes_nothing",
    [
        lambda store: store.prune_deleted_history(older_than=10.0),  # the pruner, each minute
        lambda store: store.record_pool_size(4, now=3.0),  # the size it logged last
        lambda store: store.delete_job("ghost"),
    ],
    ids=["prune-nothing", "same-pool-size", "delete-nothing"],
)
@pytest.mark.parametrize("grouped", [False, True], ids=["alone", "in-a-group"])
def test_a_write_that_changed_nothing_does_not_say_writes_work_again(
    store: Store,
    caplog: pytest.LogCaptureFixture,
    writes_nothing: Callable[[Store], object],
    grouped: bool,
) -> None:
    """A commit that wrote no row needs no room: on a full disk it succeeds, and taking it
    for a working store logged `writes work again` (and set `herd_store_writable` back to
    1) while the disk was still full."""
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    store.record_pool_size(4, now=1.0)
    fill_up(store)
    with pytest.raises(StoreError):
        store.add_event("resnet", "Warning", "Big", "x" * 100_000, now=2.0)
    assert not store.writable
    caplog.clear()  # filling the file up flapped: small writes fitted while big ones failed
    with caplog.at_level("INFO"), store.transaction() if grouped else contextlib.nullcontext():
        writes_nothing(store)
    assert not store.writable
    assert not [r for r in caplog.records if "writes work again" in r.getMessage()]
    make_room(store)
    store.add_event("resnet", "Normal", "Small", "fits", now=3.0)  # a row: now it is proven
    assert store.writable


def test_a_commit_the_disk_refuses_leaves_no_transaction_open(store: Store) -> None:
    """SQLite may keep the transaction of a failed COMMIT open; the store then took every
    later write for one inside snapshot() and refused it, after the disk was freed too."""
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    fail_commits(store)
    with pytest.raises(StoreError, match="database or disk is full"):
        store.add_event("resnet", "Normal", "Lost", "not committed", now=2.0)
    assert not store.writable
    commit_again(store)
    store.add_event("resnet", "Normal", "Kept", "committed", now=3.0)
    assert store.writable
    assert [event.reason for event in store.events("resnet")] == ["Kept"]
