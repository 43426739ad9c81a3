"""The operator's metrics: what a scrape shows, series by series."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.controllers.loop import Outcome
from herd_operator.exporters.gpu import GpuReading
from herd_operator.runtime.metrics import JOB_STATUSES, OperatorMetrics, StateCollector, job_status
from herd_operator.runtime.observer import UsageObserver, job_usage
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs import Condition, ConditionStatus, HerdJob
from herd_operator.specs.status import GpuCounts, HerdJobStatus, ResizeCost
from herd_operator.specs.values import Placement, Pool, ResizeMode
from tests.unit.full_disk import accept_writes, fill_up, make_room, refuse_writes

SPEC = {
    "apiVersion": "herd/v1alpha1",
    "kind": "HerdJob",
    "metadata": {"name": "x"},
    "spec": {"command": ["python"], "gpus": {"min": 1, "max": 4}},
}


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def record(store: Store, name: str, policy: dict[str, object] | None = None, **gpus: int) -> None:
    spec = json.loads(json.dumps(SPEC))
    spec["metadata"]["name"] = name
    if policy:
        spec["spec"]["policy"] = policy
    store.record_spec(name, f"{name}.yaml", HerdJob.model_validate(spec), name, 1.0)
    status = HerdJobStatus(
        conditions=(
            Condition(
                type="Running",
                status=ConditionStatus.TRUE,
                reason="Training",
                last_transition_time=1.0,
                observed_generation=1,
            ),
        ),
        gpus=GpuCounts(min=1, max=4, **gpus),
        epoch=3,
    )
    store.put_status(name, status, 2.0)


def test_state_collector_reads_jobs_pool_and_requests_at_scrape_time(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    record(store, "a", desired=3, allocated=2, active=2)
    record(store, "b", {"name": "memory", "params": {"low": 0.1}}, desired=1, allocated=1)
    store.add_usage("b", 1, 512, 2048, 3.0)
    placements = {"a": Placement((("h", (0, 1)),)), "b": Placement((("h", (2,)),))}
    registry = CollectorRegistry()
    registry.register(
        StateCollector(
            store,
            lambda: Pool.from_counts({"h": 4}),
            lambda: placements,
            lambda: {("bind", "ok"): 5, ("report", "bad_request"): 1},
            lambda: 2,
        )
    )
    got = samples(registry)
    assert got[("herd_job_gpus_desired", (("herd_job", "a"),))] == 3
    assert got[("herd_job_gpus_allocated", (("herd_job", "a"),))] == 2
    assert got[("herd_job_gpus_active", (("herd_job", "a"),))] == 2
    assert ("herd_job_gpus_active", (("herd_job", "b"),)) not in got  # nothing reported yet
    assert got[("herd_job_epoch", (("herd_job", "a"),))] == 3
    assert got[("herd_job_memory_utilization_ratio", (("herd_job", "b"),))] == 0.25
    assert got[("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "b")))] == 0.1
    assert got[("herd_job_policy_threshold_ratio", (("bound", "high"), ("herd_job", "b")))] == 0.75
    assert ("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "a"))) not in got
    assert got[("herd_jobs", (("condition", "Running"), ("status", "True")))] == 2
    assert got[("herd_jobs", (("condition", "Failed"), ("status", "True")))] == 0
    assert got[("herd_pool_gpus", (("state", "allocated"),))] == 3
    assert got[("herd_pool_gpus", (("state", "free"),))] == 1
    assert got[("herd_allocator_requests_total", (("op", "bind"), ("result", "ok")))] == 5
    assert got[("herd_drains_overdue", ())] == 2

    # Read at scrape time: a change shows in the next scrape.
    record(store, "a", desired=4, allocated=4, active=2)
    assert samples(registry)[("herd_job_gpus_allocated", (("herd_job", "a"),))] == 4


def test_a_job_whose_stored_spec_is_unreadable_keeps_the_scrape_and_its_status_series(
    tmp_path: Path,
) -> None:
    """The spec row is corrupted with sqlite3; the store stays writable throughout."""
    store = Store(tmp_path / "state.db")
    record(store, "a", {"name": "memory"}, desired=2, allocated=2)
    record(store, "b", {"name": "memory"}, desired=1, allocated=1)
    raw = sqlite3.connect(store.path)
    raw.execute("UPDATE jobs SET spec_json = '{\"spec\": 3}' WHERE name = 'a'")
    raw.commit()
    raw.close()
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))
    got = samples(registry)
    assert got[("herd_job_gpus_allocated", (("herd_job", "a"),))] == 2
    assert got[("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "b")))] == 0.25
    assert ("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "a"))) not in got
    assert got[("herd_store_writable", ())] == 1


def test_a_scrape_reads_the_policies_without_parsing_any_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first scrape after a start used to parse every stored spec (~0.3 s per 10,000
    jobs, under the store's lock); the thresholds come from the stored JSON instead."""
    with Store(tmp_path / "state.db") as writer:
        record(writer, "a", {"name": "memory", "params": {"low": 0.2, "high": 0.9}}, allocated=1)
        record(writer, "b", {"name": "static"}, allocated=1)
    parsed: list[str] = []
    original = HerdJob.model_validate_json

    def counting(text: str | bytes, **kwargs: object) -> HerdJob:
        parsed.append(str(text)[:40])
        return original(text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(HerdJob, "model_validate_json", counting)
    store = Store(tmp_path / "state.db")  # a fresh operator: nothing parsed yet
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))
    got = samples(registry)
    assert got[("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "a")))] == 0.2
    assert got[("herd_job_policy_threshold_ratio", (("bound", "high"), ("herd_job", "a")))] == 0.9
    assert ("herd_job_policy_threshold_ratio", (("bound", "low"), ("herd_job", "b"))) not in got
    assert parsed == []


def test_the_store_writable_gauge_shows_a_full_disk_and_its_end(tmp_path: Path) -> None:
    """Writes fail for real (see tests/unit/full_disk.py)."""
    store = Store(tmp_path / "state.db")
    record(store, "a", desired=2, allocated=2)
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))
    fill_up(store)
    with pytest.raises(StoreError):
        store.add_event("a", "Normal", "Big", "x" * 100_000, 3.0)
    got = samples(registry)
    assert got[("herd_store_writable", ())] == 0
    assert got[("herd_job_gpus_allocated", (("herd_job", "a"),))] == 2  # reads go on
    make_room(store)
    store.add_event("a", "Normal", "Small", "x", 4.0)
    assert samples(registry)[("herd_store_writable", ())] == 1


def test_operator_metrics_count_resizes_and_reconciles() -> None:
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    metrics.resized("a", 2, 4)
    metrics.resized("a", 4, 1)
    metrics.resized("b", 4, 2)
    metrics.resize_completed("a", resize(3.5, before=2, after=4, engine="torchrun"))
    metrics.reconcile_duration.observe(0.004)
    metrics.reconciled(Outcome.TEMPORARY_ERROR, 0.002)
    got = samples(registry)
    assert got[("herd_resizes_total", (("direction", "grow"),))] == 1
    assert got[("herd_resizes_total", (("direction", "shrink"),))] == 2
    torchrun_grow = (("direction", "grow"), ("engine", "torchrun"))
    assert got[("herd_resize_duration_seconds_count", torchrun_grow)] == 1
    assert got[("herd_resize_duration_seconds_bucket", (*torchrun_grow, ("le", "5.0")))] == 1
    assert got[("herd_resize_duration_seconds_bucket", (*torchrun_grow, ("le", "2.0")))] == 0
    # Each engine's grows and shrinks are there from the start, at zero, for rate().
    for engine in ("horovod", "torchrun"):
        for direction in ("grow", "shrink"):
            labels = (("direction", direction), ("engine", engine))
            assert ("herd_resize_duration_seconds_count", labels) in got
    assert got[("herd_resize_duration_seconds_count", (("direction", "shrink"),
                                                       ("engine", "horovod")))] == 0  # fmt: skip
    assert got[("herd_reconcile_duration_seconds_count", ())] == 2
    assert got[("herd_reconcile_total", (("outcome", "temporary_error"),))] == 1
    assert not any(name.startswith("herd_reconcile_errors") for name, _ in got)


def reading(index: int, used: int | None, total: int | None = 1000, host: str = "h") -> GpuReading:
    return GpuReading(host, index, f"GPU-{index}", "virtual", used, total)


def test_job_usage_sums_a_jobs_gpus_and_skips_jobs_with_an_unread_gpu() -> None:
    placements = {
        "a": Placement((("h", (0, 1)),)),
        "b": Placement((("h", (2,)), ("g", (0,)))),  # g:0 is not read
        "c": Placement((("h", (3,)),)),  # h:3 has no used value
        "pending": Placement.EMPTY,
    }
    readings = [reading(0, 100), reading(1, 300), reading(2, 50), reading(3, None)]
    assert job_usage(readings, placements) == {"a": (2, 400, 2000)}


def test_usage_observer_records_each_job_and_tolerates_a_deleted_job(tmp_path: Path) -> None:
    class Source:
        def read(self) -> list[GpuReading]:
            return [reading(0, 100), reading(1, 700)]

    recorded: list[tuple[str, int, int, int]] = []

    def record_usage(job: str, gpus: int, used: int, total: int, now: float) -> None:
        if job == "gone":
            raise KeyError(job)
        recorded.append((job, gpus, used, total))

    placements = {"a": Placement((("h", (0,)),)), "gone": Placement((("h", (1,)),))}
    UsageObserver(Source(), lambda: placements, record_usage).sample_once()
    assert recorded == [("a", 1, 100, 1000)]


def test_usage_samples_on_a_full_disk_are_skipped_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store says that writes fail (once a minute at most); a traceback for each
    sample (one a second) filled the log while the disk was full."""

    class Source:
        def read(self) -> list[GpuReading]:
            return [reading(0, 100), reading(1, 700)]

    store = Store(tmp_path / "state.db")
    record(store, "a", desired=1, allocated=1)
    record(store, "b", desired=1, allocated=1)
    placements = {"a": Placement((("h", (0,)),)), "b": Placement((("h", (1,)),))}
    observer = UsageObserver(Source(), lambda: placements, store.add_usage)
    refuse_writes(store)  # small rows like these still fit in a full file's free space
    with caplog.at_level("INFO"):
        for _ in range(30):
            observer.sample_once()
    assert not store.writable
    (said,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "writes fail" in said  # by the store, once
    accept_writes(store)
    observer.sample_once()
    assert [len(store.usage(job)) for job in ("a", "b")] == [1, 1]


def condition(kind: str, status: ConditionStatus, reason: str) -> Condition:
    return Condition(
        type=kind, status=status, reason=reason, last_transition_time=1.0, observed_generation=1
    )


def put(store: Store, name: str, conditions: tuple[Condition, ...], **fields: object) -> None:
    current = store.get_job(name)
    assert current is not None
    store.put_status(
        name, current.status.model_copy(update={"conditions": conditions, **fields}), 5.0
    )


def status_series(
    got: dict[tuple[str, tuple[tuple[str, str], ...]], float], job: str
) -> dict[str, float]:
    return {
        dict(labels)["status"]: value
        for (name, labels), value in got.items()
        if name == "herd_job_status" and dict(labels)["herd_job"] == job
    }


def test_job_status_has_one_series_per_status_and_follows_the_conditions(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    record(store, "a", desired=2, allocated=2, active=2)
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))
    admitted = condition("Admitted", ConditionStatus.TRUE, "Admitted")

    running = status_series(samples(registry), "a")
    assert set(running) == set(JOB_STATUSES)
    assert [s for s, v in running.items() if v == 1] == ["Running"]

    put(store, "a", (condition("Admitted", ConditionStatus.FALSE, "Pending"),))
    assert [s for s, v in status_series(samples(registry), "a").items() if v] == ["Pending"]

    put(store, "a", (admitted, condition("Running", ConditionStatus.FALSE, "BackOff")))
    assert [s for s, v in status_series(samples(registry), "a").items() if v] == ["Pending"]

    suspended = condition("Suspended", ConditionStatus.TRUE, "Suspended")
    put(store, "a", (condition("Admitted", ConditionStatus.FALSE, "Suspended"), suspended))
    assert [s for s, v in status_series(samples(registry), "a").items() if v] == ["Suspended"]

    put(store, "a", (admitted, condition("Succeeded", ConditionStatus.TRUE, "Completed")))
    succeeded = status_series(samples(registry), "a")
    assert set(succeeded) == set(JOB_STATUSES), "the same series, only their values change"
    assert [s for s, v in succeeded.items() if v] == ["Succeeded"]


def test_a_job_that_ended_keeps_no_gauges_of_its_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    record(store, "done", {"name": "memory"}, desired=3, allocated=2, active=2)
    record(store, "live", {"name": "memory"}, desired=3, allocated=2, active=2)
    store.add_usage("done", 2, 500, 1000, 3.0)
    store.add_usage("live", 2, 250, 1000, 3.0)
    placements = {"live": Placement((("h", (0, 1)),))}
    registry = CollectorRegistry()
    registry.register(
        StateCollector(store, lambda: Pool.from_counts({"h": 4}), lambda: placements, dict)
    )
    put(
        store,
        "done",
        (condition("Succeeded", ConditionStatus.TRUE, "Completed"),),
        gpus=GpuCounts(min=1, max=4, desired=3, allocated=0, active=2),
    )

    got = samples(registry)

    per_job = {
        (name, dict(labels)["herd_job"])
        for name, labels in got
        if name.startswith("herd_job_") and name != "herd_job_status"
    }
    assert {name for name, job in per_job if job == "done"} == {
        "herd_job_gpus_allocated",
        "herd_job_restarts_total",
    }
    assert got[("herd_job_gpus_allocated", (("herd_job", "done"),))] == 0
    assert {name for name, job in per_job if job == "live"} == {
        "herd_job_gpus_desired",
        "herd_job_gpus_allocated",
        "herd_job_gpus_active",
        "herd_job_epoch",
        "herd_job_memory_utilization_ratio",
        "herd_job_policy_threshold_ratio",
        "herd_job_restarts_total",
    }

    # A live job that holds no GPU (pending again) shows no memory: its sample is of the past.
    placements.clear()
    assert ("herd_job_memory_utilization_ratio", (("herd_job", "live"),)) not in samples(registry)


def resize(seconds: float, *, before: int | None, after: int, engine: str) -> ResizeCost:
    mode = {"horovod": ResizeMode.LIVE, "torchrun": ResizeMode.RESTART}.get(engine)
    return ResizeCost(
        before=before, after=after, seconds=seconds, engine=engine, mode=mode, completed_at=4.0
    )


def test_each_jobs_last_resize_cost_is_a_gauge_with_its_engine_and_mode(tmp_path: Path) -> None:
    """What a resize cost per job (describe's Last resize), beside the histogram by engine:
    kept for a job that ended, as its restarts; none for a job that never finished one."""
    store = Store(tmp_path / "state.db")
    for name in ("tr", "hvd", "old", "none"):
        record(store, name, desired=2, allocated=2, active=2)
    running = (condition("Running", ConditionStatus.TRUE, "Training"),)
    put(store, "tr", running, last_resize=resize(31.5, before=1, after=3, engine="torchrun"))
    put(store, "hvd", running, last_resize=resize(0.3, before=4, after=2, engine="horovod"))
    ended = (condition("Succeeded", ConditionStatus.TRUE, "Completed"),)
    put(store, "old", ended, last_resize=resize(2.0, before=None, after=2, engine="gone"))
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))

    got = {
        dict(labels)["herd_job"]: (dict(labels)["engine"], dict(labels)["mode"], value)
        for (name, labels), value in samples(registry).items()
        if name == "herd_job_last_resize_seconds"
    }

    assert got == {
        "tr": ("torchrun", "restart", 31.5),
        "hvd": ("horovod", "live", 0.3),
        "old": ("gone", "unknown", 2.0),
    }


def test_restarts_are_a_counter_per_job(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    record(store, "a", desired=1, allocated=1)
    registry = CollectorRegistry()
    registry.register(StateCollector(store, lambda: Pool.from_counts({"h": 4}), dict, dict))
    assert samples(registry)[("herd_job_restarts_total", (("herd_job", "a"),))] == 0
    current = store.get_job("a")
    assert current is not None
    put(store, "a", current.status.conditions, restarts=2)
    assert samples(registry)[("herd_job_restarts_total", (("herd_job", "a"),))] == 2


@pytest.mark.parametrize(
    ("conditions", "expected"),
    [
        ((), "Unknown"),  # as `get` says: nothing known yet
        ((("Admitted", "False", "Pending"),), "Pending"),
        ((("Admitted", "True", "Admitted"), ("Stalled", "True", "PolicyUnavailable")), "Stalled"),
        ((("Admitted", "True", "Admitted"), ("Resizing", "True", "Shrinking")), "Resizing"),
        ((("Admitted", "True", "Admitted"), ("Failed", "True", "BackoffLimitExceeded")), "Failed"),
        ((("Admitted", "True", "Admitted"), ("Running", "False", "OperatorStopped")), "Stopped"),
        ((("Admitted", "True", "Admitted"), ("Running", "False", "LaunchFailed")), "Stopped"),
        ((("Admitted", "True", "Admitted"), ("Running", "Unknown", "Starting")), "Unknown"),
    ],
)
def test_job_status_maps_conditions_to_a_fixed_set(
    conditions: tuple[tuple[str, str, str], ...], expected: str
) -> None:
    status = HerdJobStatus(
        conditions=tuple(condition(t, ConditionStatus(s), r) for t, s, r in conditions)
    )
    assert job_status(status) == expected
