"""Issue 28's limits and order end to end, with real horovodrun jobs on 4 virtual GPUs: a
dependency chain (B starts only once A has Succeeded), a job stopped by its time limit
(Failed, DeadlineExceeded, its GPUs freed), and a job's progress and reported metrics as
its real workers report them."""

from __future__ import annotations

from tests.integration.harness import (
    OperatorHarness,
    digits_command,
    marked_processes,
    spec_document,
)


def test_a_dependent_starts_only_after_its_dependency_succeeded(herd: OperatorHarness) -> None:
    # One GPU each: the order, not the size, is under test (a worker fewer to start).
    herd.write_spec(spec_document("first", 1, 1, digits_command(2), training={"epochs": 2}))
    herd.write_spec(spec_document("second", 1, 1, digits_command(1), dependsOn=["first"]))
    waiting = herd.wait_for(
        lambda: (c := herd.condition("second", "DependenciesMet")) and c,
        "the dependent to say what it waits for",
        job="second",
    )
    assert (waiting["status"], waiting["reason"]) == ("False", "Waiting")
    assert waiting["message"] == "waiting for first to succeed"

    succeeded = herd.wait_for(
        lambda: (c := herd.condition("first", "Succeeded")) and c["status"] == "True" and c,
        "the first job to succeed",
        job="first",
        timeout=240,
    )
    herd.wait_for(
        lambda: (c := herd.condition("second", "Succeeded")) and c["status"] == "True",
        "the dependent to run and succeed",
        job="second",
        timeout=240,
    )
    started = [event for event in herd.events("second") if event.reason == "Started"]
    assert len(started) == 1, [e.reason for e in herd.events("second")]
    latency = started[0].time - succeeded["lastTransitionTime"]
    print(f"the dependent started {latency:.2f}s after its dependency succeeded")
    # Looked at again every resync (the harness's 0.5 s): the start follows within about one.
    assert 0 <= latency <= 15, latency
    met = herd.condition("second", "DependenciesMet")
    assert met is not None and (met["status"], met["reason"]) == ("True", "Met")

    # The first job's real workers reported 2 epochs and their loss.
    first = herd.job("first")
    assert first is not None
    assert first["progress"]["completed"] == 2 and first["progress"]["epochs"] == 2
    assert set(first["metrics"]) == {"loss"} and first["metrics"]["loss"] > 0
    with herd.store() as store:
        assert store.allocations() == {}


def test_a_job_past_its_time_limit_is_stopped_failed_and_its_gpus_freed(
    herd: OperatorHarness,
) -> None:
    # Sleeps far past its limit: only the operator can end it.
    sleeper = ["python", "-c", "import time; time.sleep(600)"]
    herd.write_spec(spec_document("sleepy", 2, 2, sleeper, activeDeadlineSeconds=10))
    herd.wait_for(
        lambda: (c := herd.condition("sleepy", "Running")) and c["status"] == "True",
        "the job to run",
        job="sleepy",
    )
    failed = herd.wait_for(
        lambda: (c := herd.condition("sleepy", "Failed")) and c["status"] == "True" and c,
        "the job to fail at its time limit",
        job="sleepy",
        timeout=180,
    )
    assert failed["reason"] == "DeadlineExceeded"
    assert failed["message"].startswith("activeDeadlineSeconds 10 reached")
    events = herd.events("sleepy")
    reasons = [event.reason for event in events]
    assert reasons.count("DeadlineExceeded") == 2, reasons  # stopping it, then failed
    with herd.store() as store:
        record = store.get_job("sleepy")
    assert record is not None and record.status.run_started_at is not None
    stop, end = (e.time - record.status.run_started_at for e in events
                 if e.reason == "DeadlineExceeded")  # fmt: skip
    print(f"limit 10s: stopped at {stop:.2f}s, failed at {end:.2f}s after the first start")
    assert 10 <= stop <= end
    job = herd.job("sleepy")
    assert job is not None and job["gpus"]["allocated"] == 0 and job["placement"] == {}
    with herd.store() as store:
        assert store.allocations() == {}, "a job failed by its deadline holds no GPUs"
    herd.wait_for(
        lambda: not marked_processes(herd.layout.root), "its processes to be gone", job="sleepy"
    )
