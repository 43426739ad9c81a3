"""End to end on localhost with 4 virtual GPUs: real horovodrun, real allocator, real files."""

from __future__ import annotations

import os
import time

import psutil

from tests.integration.harness import (
    OperatorHarness,
    digits_command,
    marked_processes,
    spec_document,
)


def test_elastic_job_runs_shrinks_survives_bad_edit_and_stops_on_delete(
    herd: OperatorHarness,
) -> None:
    command = digits_command(400, "--step-delay", "0.02")
    herd.write_spec(spec_document("digits", 1, 2, command))

    # (a) min 1, max 2 on a free pool: runs at 2 workers, as the workers themselves report.
    herd.wait_for(
        lambda: (herd.job("digits") or {}).get("gpus", {}).get("active") == 2,
        "2 workers reporting",
        job="digits",
    )
    launch = herd.launch_id("digits")
    assert launch
    job = herd.job("digits")
    assert job is not None
    assert job["gpus"]["allocated"] == 2
    assert job["placement"] == {"localhost": [0, 1]}
    herd.wait_for(
        lambda: any(r.epoch is not None and r.epoch >= 1 for r in herd.reports("digits")),
        "two epochs",
        job="digits",
    )

    # (b) lowering max to 1 shrinks to 1 worker and training goes on from where it was.
    herd.write_spec(spec_document("digits", 1, 1, command))
    herd.wait_for(
        lambda: (herd.job("digits") or {})["gpus"]["allocated"] == 1, "grant of 1", job="digits"
    )
    shrunk_at = time.time()
    epoch_before = max(r.epoch for r in herd.reports("digits") if r.epoch is not None)
    herd.wait_for(
        lambda: any(
            r.time > shrunk_at and r.epoch is not None and r.world_size == 1
            for r in herd.reports("digits")
        ),
        "an epoch completed by 1 worker",
        job="digits",
    )
    job = herd.job("digits")
    assert job is not None
    assert job["gpus"]["active"] == 1
    assert job["placement"] == {"localhost": [0]}, "the surviving worker keeps its GPU"
    assert herd.launch_id("digits") == launch, "shrinking must not relaunch the job"
    epochs = [r.epoch for r in herd.reports("digits") if r.epoch is not None]
    assert epochs == sorted(epochs), f"the epoch counter went back: {epochs}"
    assert epochs[-1] >= epoch_before
    assert any(e.reason == "Resized" and "2 -> 1" in e.message for e in herd.events("digits"))

    # (e) an invalid edit keeps the last good spec running and says why.
    herd.write_text(
        "digits.yaml",
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata:\n"
        "  name: digits\nspec:\n  command: [python]\n  gpus: {min: 0, max: 1}\n",
    )
    condition = herd.wait_for(
        lambda: (c := herd.condition("digits", "SpecValid")) and c["status"] == "False" and c,
        "SpecValid=False",
        job="digits",
    )
    assert "spec.gpus.min" in condition["message"]
    invalid_at = time.time()
    herd.wait_for(
        lambda: any(r.time > invalid_at and r.epoch is not None for r in herd.reports("digits")),
        "training to go on after the bad edit",
        job="digits",
    )
    assert herd.launch_id("digits") == launch
    running = herd.condition("digits", "Running")
    assert running is not None and running["status"] == "True"

    # (d) deleting the spec stops every process of the job and frees its GPUs.
    pids = [pid for pid, marker in marked_processes(herd.layout.root).items() if marker == launch]
    assert len(pids) >= 2, f"expected horovodrun and a worker, found {pids}"
    os.unlink(herd.specs_dir / "digits.yaml")
    herd.wait_for(lambda: herd.job("digits") is None, "the job to be removed", timeout=60)
    alive = [
        pid
        for pid in pids
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert not alive, f"processes of the deleted job still alive: {alive}"
    with herd.store() as store:
        assert store.allocations() == {}
    assert not herd.layout.grant_file("digits").exists()
    assert any(e.reason == "Deleted" for e in herd.events("digits"))


def test_gang_job_waits_until_its_min_fits(herd: OperatorHarness) -> None:
    # A plain Elastic Horovod script (no herd import) holding 2 of the 4 GPUs, not shrinkable.
    # Three epochs of about a second: it only has to hold its GPUs from its launch (Running)
    # until the big job is seen pending, which is a reconcile away; its workers' imports
    # alone outlast that.
    plain = ["python", "examples/train_plain.py", "--epochs", "3", "--steps", "20"]
    herd.write_spec(spec_document("plain", 2, 2, plain))
    herd.wait_for(
        lambda: (c := herd.condition("plain", "Running")) and c["status"] == "True",
        "the plain job to run",
        job="plain",
    )

    herd.write_spec(spec_document("big", 3, 3, digits_command(2)))
    admitted = herd.wait_for(
        lambda: (c := herd.condition("big", "Admitted")) and c["status"] == "False" and c,
        "the min-3 job to be pending",
        job="big",
    )
    assert admitted["reason"] == "Pending"
    assert "3" in admitted["message"], admitted["message"]
    big = herd.job("big")
    assert big is not None and big["gpus"]["allocated"] == 0

    # When the plain job finishes, its GPUs go to the waiting job.
    herd.wait_for(
        lambda: (c := herd.condition("plain", "Succeeded")) and c["status"] == "True",
        "the plain job to finish",
        job="plain",
        timeout=180,
    )
    plain_job = herd.job("plain")
    assert plain_job is not None
    assert plain_job["gpus"]["active"] is None, "a script without the worker API reports nothing"
    assert "world size 2" in herd.layout.log_file("plain").read_text()
    herd.wait_for(
        lambda: (herd.job("big") or {})["gpus"]["active"] == 3,
        "3 workers reporting",
        job="big",
        timeout=180,
    )
    herd.wait_for(
        lambda: (c := herd.condition("big", "Succeeded")) and c["status"] == "True",
        "the big job to finish",
        job="big",
        timeout=180,
    )
    with herd.store() as store:
        assert store.allocations() == {}


def test_failing_job_is_restarted_then_marked_failed(herd: OperatorHarness) -> None:
    crash = ["python", "-c", "import sys; sys.exit(3)"]
    herd.write_spec(
        spec_document("crash", 1, 1, crash, restartPolicy={"onFailure": True, "backoffLimit": 1})
    )
    failed = herd.wait_for(
        lambda: (c := herd.condition("crash", "Failed")) and c["status"] == "True" and c,
        "the job to fail",
        job="crash",
        timeout=120,
    )
    assert failed["reason"] == "BackoffLimitExceeded"
    reasons = [e.reason for e in herd.events("crash")]
    assert reasons.count("Started") == 2, reasons
    assert "BackOff" in reasons
    with herd.store() as store:
        assert store.allocations() == {}, "a failed job holds no GPUs"
