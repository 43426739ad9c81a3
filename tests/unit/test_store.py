"""Tests for herd_operator.runtime.store."""

from __future__ import annotations

import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator.runtime.store import (
    DB_FILENAME,
    SCHEMA_VERSION,
    GrantChange,
    RuntimeRecord,
    Store,
    StoreError,
)
from specs.values import UsageSample

SPEC = '{"gpus": {"min": 1, "max": 4}}'


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / DB_FILENAME


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    with Store(db_path) as opened:
        yield opened


def runtime(name: str, pid: int = 4242, generation: int = 1) -> RuntimeRecord:
    return RuntimeRecord(
        name=name,
        launch_id=f"{name}-launch",
        pid=pid,
        started_at=10.0,
        generation=generation,
        restarts=0,
        launched_max=4,
    )


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


def test_corrupt_file_raises_store_error_naming_path_and_sqlite_message(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"this is not sqlite at all, " * 100)
    with pytest.raises(StoreError) as excinfo:
        Store(db_path)
    assert str(excinfo.value) == f"cannot open state store {db_path}: file is not a database"
    with pytest.raises(StoreError, match="file is not a database"):
        Store.open_readonly(db_path)


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


# jobs


def test_first_record_gets_generation_one_and_a_fresh_uid(store: Store) -> None:
    job = store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    assert job.name == "resnet"
    assert len(job.uid) == 32 and int(job.uid, 16) >= 0
    assert (job.generation, job.fingerprint, job.spec_json) == (1, "fp1", SPEC)
    assert (job.status_json, job.created_at, job.updated_at) == ("{}", 100.0, 100.0)
    assert store.get_job("resnet") == job
    assert store.get_job("missing") is None


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
    new_spec = '{"gpus": {"min": 2, "max": 8}}'
    second = store.record_spec("resnet", "/jobs/r.yaml", new_spec, "fp2", now=200.0)
    third = store.record_spec("resnet", "/jobs/r.yaml", SPEC, "fp1", now=300.0)
    assert (second.generation, second.spec_json, second.spec_path) == (2, new_spec, "/jobs/r.yaml")
    assert (third.generation, third.spec_json) == (3, SPEC)
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


def test_invalid_json_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match=r"^spec_json is not valid JSON: "):
        store.record_spec("resnet", "/jobs/resnet.yaml", "{not json", "fp1", now=1.0)
    assert store.get_job("resnet") is None
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    with pytest.raises(ValueError, match=r"^status_json is not valid JSON: "):
        store.put_status("resnet", "", now=2.0)


def test_put_status_replaces_status_and_refuses_unknown_job(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=100.0)
    store.put_status("resnet", '{"observedGeneration": 1}', now=150.0)
    job = store.get_job("resnet")
    assert job is not None
    assert (job.status_json, job.updated_at, job.generation) == (
        '{"observedGeneration": 1}',
        150.0,
        1,
    )
    with pytest.raises(KeyError) as excinfo:
        store.put_status("ghost", "{}", now=1.0)
    assert excinfo.value.args == ("no job named 'ghost' in the state store",)


def test_list_jobs_is_sorted_by_name(store: Store) -> None:
    for name in ["zeta", "alpha", "mid"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    assert [job.name for job in store.list_jobs()] == ["alpha", "mid", "zeta"]


# runtime


def test_runtime_put_get_replace_list_delete(store: Store) -> None:
    for name in ["b", "a"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.put_runtime(runtime(name))
    replaced = RuntimeRecord("a", "a-launch-2", 777, 20.0, 2, 1, 8)
    store.put_runtime(replaced)
    assert store.get_runtime("a") == replaced
    assert store.list_runtime() == [replaced, runtime("b")]
    assert store.delete_runtime("a") is True
    assert store.delete_runtime("a") is False
    assert store.get_runtime("a") is None
    assert store.get_job("a") is not None


def test_runtime_of_unknown_job_is_refused(store: Store) -> None:
    with pytest.raises(KeyError, match="no job named 'ghost'"):
        store.put_runtime(runtime("ghost"))
    assert store.list_runtime() == []


# allocations


def test_allocations_keep_host_and_local_rank_order(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    placements = {
        "resnet": [("nid0009", [3, 1]), ("nid0002", [2, 0])],
        "bert": [("nid0002", [3]), ("nid0009", [0, 2])],
    }
    store.replace_allocations(placements, now=50.0)
    assert store.allocations() == placements
    assert list(store.allocations()) == ["bert", "resnet"]
    assert store.allocations_updated_at() == 50.0


def test_replace_allocations_replaces_the_whole_table(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    assert store.allocations_updated_at() is None
    store.replace_allocations({"resnet": [("h", [0, 1])], "bert": [("h", [2])]}, now=1.0)
    # The GPU bert had moves to resnet: legal because the old rows go in the same transaction.
    store.replace_allocations({"resnet": [("h", [0, 1, 2])], "bert": []}, now=2.0)
    assert store.allocations() == {"resnet": [("h", [0, 1, 2])]}
    store.replace_allocations({}, now=3.0)
    assert store.allocations() == {}
    assert store.allocations_updated_at() == 3.0


def test_gpu_placed_for_two_jobs_is_refused_and_nothing_changes(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
    before = {"resnet": [("h", [0])]}
    store.replace_allocations(before, now=1.0)
    with pytest.raises(ValueError) as excinfo:
        store.replace_allocations({"resnet": [("h", [0, 1])], "bert": [("h", [1])]}, now=2.0)
    assert str(excinfo.value) == "GPU h:1 is placed twice (jobs 'resnet' and 'bert')"
    with pytest.raises(ValueError, match=r"^GPU h:1 is placed twice \(jobs 'bert' and 'bert'\)$"):
        store.replace_allocations({"bert": [("h", [1, 1])]}, now=2.0)
    assert store.allocations() == before
    assert store.allocations_updated_at() == 1.0


def test_schema_primary_key_refuses_a_gpu_in_two_jobs(db_path: Path) -> None:
    with Store(db_path) as store:
        for name in ["resnet", "bert"]:
            store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.replace_allocations({"resnet": [("h", [0])]}, now=1.0)
    raw = sqlite3.connect(db_path)
    try:
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            raw.execute(
                "INSERT INTO allocations (host, gpu, job, host_ordinal, local_rank)"
                " VALUES ('h', 0, 'bert', 0, 0)"
            )
    finally:
        raw.close()


def test_bad_placements_are_refused(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    with pytest.raises(
        ValueError, match=r"^job 'resnet': host 'h' appears twice in its placement$"
    ):
        store.replace_allocations({"resnet": [("h", [0]), ("g", [0]), ("h", [1])]}, now=1.0)
    with pytest.raises(ValueError, match=r"^job 'resnet': host 'h' has an empty GPU list$"):
        store.replace_allocations({"resnet": [("h", [])]}, now=1.0)
    with pytest.raises(KeyError, match="no job named 'ghost'"):
        store.replace_allocations({"resnet": [("h", [0])], "ghost": [("h", [1])]}, now=1.0)
    assert store.allocations() == {}


# cascades


def test_delete_job_takes_runtime_allocations_and_reports_but_keeps_logs(store: Store) -> None:
    for name in ["resnet", "bert"]:
        store.record_spec(name, f"/jobs/{name}.yaml", SPEC, "fp", now=1.0)
        store.put_runtime(runtime(name))
        store.add_report(name, 1, 2, 0, {"loss": 0.5}, now=2.0)
        store.add_event(name, "Normal", "Launched", "started", now=3.0)
        store.add_grant_change(name, 2, "admitted", now=3.0)
    store.replace_allocations({"resnet": [("h", [0, 1])], "bert": [("h", [2])]}, now=4.0)

    store.delete_job("resnet")

    assert store.get_runtime("resnet") is None
    assert store.allocations() == {"bert": [("h", [2])]}
    assert store.last_report("resnet") is None
    assert store.reports("resnet") == []
    assert [event.job for event in store.events()] == ["resnet", "bert"]
    assert [change.job for change in store.grant_history()] == ["resnet", "bert"]
    assert store.get_runtime("bert") == runtime("bert")
    assert store.last_report("bert") is not None


# reports


def test_reports_are_returned_oldest_first_with_since_and_limit(store: Store) -> None:
    store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp", now=1.0)
    for epoch in range(5):
        store.add_report("resnet", epoch, 4, 0, {"loss": 1.0 / (epoch + 1)}, now=10.0 + epoch)
    store.add_report("resnet", None, 2, 0, {}, now=20.0)
    assert [r.epoch for r in store.reports("resnet")] == [0, 1, 2, 3, 4, None]
    assert [r.epoch for r in store.reports("resnet", since=13.0)] == [3, 4, None]
    assert [r.epoch for r in store.reports("resnet", limit=2)] == [4, None]
    last = store.last_report("resnet")
    assert last is not None
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
            store.replace_allocations({"bert": [("h", [0])]}, now=2.0)
            assert len(reader.list_jobs()) == 1
            assert reader.allocations() == {}
        assert len(reader.list_jobs()) == 2
        assert reader.allocations() == {"bert": [("h", [0])]}


def test_writes_inside_a_snapshot_are_refused(store: Store) -> None:
    with store.snapshot(), pytest.raises(StoreError, match=r"cannot write inside snapshot\(\)$"):
        store.add_grant_change("a", 1, "x", now=1.0)
    store.add_grant_change("a", 1, "x", now=1.0)
    assert len(store.grant_history()) == 1


def test_data_survives_reopening(db_path: Path) -> None:
    writer = Store(db_path)
    writer.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
    writer.put_runtime(runtime("resnet"))
    # A second writer while the first is still open (as after a crash without close()).
    with Store(db_path) as second:
        job = second.get_job("resnet")
        assert job is not None and job.generation == 1
        assert second.get_runtime("resnet") == runtime("resnet")
        second.add_event("resnet", "Normal", "Adopted", "pid 4242", now=2.0)
    writer.close()
    with Store(db_path) as reopened:
        assert reopened.get_runtime("resnet") == runtime("resnet")
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
            store.put_status("resnet", '{"epoch": 3}', now=2.0)
            store.add_event("resnet", "Normal", "Started", "pid 1", now=2.0)
            assert store.get_job("resnet") is not None  # the writer reads its own writes
            assert reader.list_jobs() == []  # nobody else sees them yet
            assert reader.events() == []
        job = reader.get_job("resnet")
        assert job is not None and job.status_json == '{"epoch": 3}'
        assert [event.reason for event in reader.events()] == ["Started"]


def test_a_failing_write_inside_a_transaction_undoes_only_itself(store: Store) -> None:
    with store.transaction():
        store.record_spec("resnet", "/jobs/resnet.yaml", SPEC, "fp1", now=1.0)
        with pytest.raises(KeyError, match="no job named 'ghost'"):
            store.replace_allocations({"resnet": [("h", [0])], "ghost": [("h", [1])]}, now=2.0)
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
        store.put_status("resnet", '{"epoch": 1}', now=2.0)
        thread = threading.Thread(target=report_from_another_thread)
        thread.start()
        assert entered.wait(5)
        # It blocks on the store until the group commits; it does not join the group.
        assert not written.wait(0.2)
    thread.join(5)
    assert written.is_set()
    assert [report.epoch for report in store.reports("resnet")] == [1]
