"""A worker killed under a real elastic horovodrun job on the default one-host pool.

Horovod blacklists the host name of a failed worker and stops the job when every name
is blacklisted. The operator shows the one host under several names, so the job goes on
at a smaller size; the operator takes back the dead worker's GPU, says so, and grows the
job back. Marked `faults` (each test runs a job through a worker failure: about a minute).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from herd_operator.controllers.running import WORKER_LOST_GRACE_SECONDS
from herd_operator.runtime.engines.horovod import DRIVER_MODULE
from herd_operator.specs.values import Grant, Placement
from tests.integration.harness import (
    OperatorHarness,
    digits_command,
    marked_processes,
    operator_harness,
    slow_first_grown_worker,
    spec_document,
)

pytestmark = pytest.mark.faults

EPOCHS = 12


def test_a_killed_worker_costs_the_job_one_gpu_not_the_run(herd: OperatorHarness) -> None:
    # The survivors notice the dead worker after Gloo's timeout (30 s). A shorter one would
    # fail the worker that rejoins later: it must start (import torch) within it.
    herd.write_spec(spec_document("digits", 1, 4, digits_command(EPOCHS)))
    # Set-up, not what is tested: 240 s, as CI starts this file in its first seconds beside
    # the suite's heaviest ones, where 4 new interpreters importing torch on 2 cores at load
    # 12-30 gave no epoch in 120 s (twice, 2026-12-02).
    herd.wait_for(
        lambda: any(r.epoch is not None and r.world_size == 4 for r in herd.reports("digits")),
        "an epoch at 4 workers",
        240,
        job="digits",
    )
    launch = herd.launch_id("digits")
    allocator = herd.operator.allocator
    # A worker bound under a second name of the host, and not rank 0: killing rank 0 in the
    # middle of an allreduce can take a second worker down with it (a Gloo abort).
    victims = [
        b
        for b in allocator.bindings()
        if b.job == "digits" and b.name and b.pid is not None and rank_of(b.pid) not in (None, 0)
    ]
    assert victims, f"no worker of rank > 0 under a second host name: {allocator.bindings()}"
    victim = victims[0]
    assert victim.pid is not None
    epoch_at_kill = max(r.epoch for r in herd.reports("digits") if r.epoch is not None)
    killed_at = time.time()
    with contextlib.suppress(ProcessLookupError):
        os.kill(victim.pid, signal.SIGKILL)

    lost = herd.wait_for(
        lambda: next((e for e in herd.events("digits") if e.reason == "WorkerLost"), None),
        "a WorkerLost event",
        job="digits",
    )
    assert lost.type == "Warning"
    assert f"localhost:{victim.gpu}" in lost.message, lost.message
    smaller = herd.wait_for(
        lambda: next(
            (
                r.world_size
                for r in herd.reports("digits")
                if r.time > killed_at and r.epoch is not None and r.world_size < 4
            ),
            None,
        ),
        "an epoch at fewer workers",
        job="digits",
    )
    shrink = next(
        e
        for e in herd.events("digits")
        if e.reason == "Resized" and e.message.startswith(f"4 -> {smaller} GPUs: workers lost")
    )
    assert shrink.time >= lost.time

    done = herd.wait_for(
        lambda: (c := herd.condition("digits", "Succeeded")) and c["status"] == "True" and c,
        "the job to succeed",
        job="digits",
        timeout=180,
    )
    assert done is not None
    assert herd.launch_id("digits") == launch, "the job was relaunched"
    reasons = [e.reason for e in herd.events("digits")]
    assert reasons.count("Started") == 1, reasons
    after = [r.epoch for r in herd.reports("digits") if r.time > killed_at and r.epoch is not None]
    # Elastic Horovod resumes from the last commit: at most the epoch in flight is redone.
    assert after and min(after) >= epoch_at_kill, (epoch_at_kill, after)
    assert max(after) == EPOCHS - 1
    # The policy grew it back: the grant returned to 4 after the loss.
    grown = [e for e in herd.events("digits") if e.reason == "Resized" and e.time >= shrink.time]
    assert any(e.message.startswith(f"{smaller} -> 4 GPUs") for e in grown), reasons


def rank_of(pid: int, job: str = "digits") -> int | None:
    """The Horovod rank of a worker process, from the environment horovodrun gave it."""
    try:
        environ = psutil.Process(pid).environ()
    except psutil.Error:
        return None
    if environ.get("HERD_JOB") != job or "HOROVOD_RANK" not in environ:
        return None
    return int(environ["HOROVOD_RANK"])


def test_a_worker_lost_by_a_script_that_does_not_report_is_shown(tmp_path: Path) -> None:
    """examples/train_plain.py reports nothing: its job showed ACTIVE `-`, and a lost worker
    went unseen until the report deadline (600 s). Its workers' bindings show it: ACTIVE
    from the live bound workers, and a `WorkerLost` Warning once one has been gone for
    WORKER_LOST_GRACE_SECONDS while the job's driver runs (issue 25, item 8)."""
    with operator_harness(tmp_path) as herd:
        plain = ["python", "examples/train_plain.py", "--epochs", "1000", "--step-delay", "0.1"]
        herd.write_spec(spec_document("plain", 4, 4, plain))
        allocator = herd.operator.allocator

        def active() -> int | None:
            job = herd.job("plain")
            return None if job is None else job["gpus"]["active"]

        herd.wait_for(lambda: active() == 4, "ACTIVE 4, from the bound workers", job="plain")
        victim = next(
            b
            for b in allocator.bindings()
            if b.job == "plain" and b.pid is not None and rank_of(b.pid, "plain") not in (None, 0)
        )
        assert victim.pid is not None
        killed_at = time.time()
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim.pid, signal.SIGKILL)
        herd.wait_for(lambda: active() == 3, "ACTIVE 3 once the worker is gone", job="plain")
        lost = herd.wait_for(
            lambda: next((e for e in herd.events("plain") if e.reason == "WorkerLost"), None),
            "a WorkerLost event",
            job="plain",
        )
        print(f"WorkerLost {lost.time - killed_at:.1f} s after the kill: {lost.message}")
        assert lost.type == "Warning"
        # Horovod's driver may restart the other workers too after the kill; on a loaded machine
        # they can be gone as long as the grace, so the message names the victim's GPU among
        # possibly several.
        named = re.search(r"\(none on ([^)]*)\)", lost.message)
        assert named is not None, lost.message
        assert f"localhost:{victim.gpu}" in named.group(1).split(", "), lost.message
        assert lost.time - killed_at >= WORKER_LOST_GRACE_SECONDS  # not while it may be ending
        assert is_true_condition(herd.condition("plain", "Running"))
        assert not any(e.reason == "ReportDeadlineExceeded" for e in herd.events("plain"))


def is_true_condition(condition: dict[str, object] | None) -> bool:
    return condition is not None and condition["status"] == "True"


def test_a_drained_gpu_waits_for_the_worker_that_still_runs_on_it(tmp_path: Path) -> None:
    """A job that reports nothing and commits rarely keeps the workers it lost in a shrink
    until their next commit: their GPUs go to the next job only once they are gone, however
    long past the drain time that is (issue 11, item 14a)."""
    with operator_harness(tmp_path, drain_seconds=1.0) as herd:
        slow = ["python", "examples/train_plain.py", "--epochs", "3", "--steps", "60"]
        slow += ["--step-delay", "0.1"]  # a commit every 6 s or more
        herd.write_spec(spec_document("slow", 1, 4, slow))
        allocator = herd.operator.allocator
        bound = herd.wait_for(
            lambda: len(b := [b for b in allocator.bindings() if b.job == "slow"]) == 4 and b,
            "4 workers of the slow job bound",
            job="slow",
        )
        herd.write_spec(spec_document("urgent", 2, 2, digits_command(2), priority=10))
        herd.wait_for(
            lambda: (allocator.grant("slow") or Grant(Placement.EMPTY, "")).placement.size == 2,
            "the slow job shrunk to 2",
            job="slow",
        )
        kept = allocator.grant("slow")
        assert kept is not None
        slots = kept.placement.slots()
        given_back = {(b.host, b.gpu): b.pid for b in bound if (b.host, b.gpu) not in slots}
        assert len(given_back) == 2

        def urgent_admitted_on_free_gpus() -> bool:
            urgent = allocator.grant("urgent")
            held = set(urgent.placement.slots()) if urgent else set()
            for slot, pid in given_back.items():
                # The invariant under test: never a GPU whose old worker still runs.
                assert not (slot in held and pid is not None and alive(pid)), (
                    f"{slot} granted to urgent while worker {pid} of slow still runs on it"
                )
            return bool(held)

        # Its admission is the moment under test; its training after that proves nothing more.
        herd.wait_for(urgent_admitted_on_free_gpus, "the urgent job admitted", job="urgent")
        overdue = [e for e in herd.events("slow") if e.reason == "DrainOverdue"]
        print(f"DrainOverdue events: {[e.message for e in overdue]}")
        assert all(e.type == "Warning" for e in overdue)


def alive(pid: int) -> bool:
    """Whether `pid` is still a live worker process (not a zombie)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_driver_killed_alone_fails_its_job_and_leaves_no_worker(tmp_path: Path) -> None:
    # The OOM killer's way: SIGKILL to the driver alone, not its group. Its workers die with
    # it (parent-death signal), the keeper records the death, the job fails (no restart
    # policy), and nothing of it is left, in the process table or in /dev/shm.
    with operator_harness(tmp_path) as herd:
        herd.write_spec(spec_document("digits", 2, 2, digits_command(1000)))
        allocator = herd.operator.allocator
        # Both workers bound their GPUs: they are past hvd.init(), in one Horovod job. An
        # epoch more proves nothing more about what a killed driver leaves behind.
        herd.wait_for(
            lambda: sum(b.job == "digits" and b.pid is not None for b in allocator.bindings()) == 2,
            "both workers bound",
            job="digits",
        )
        processes = [psutil.Process(pid) for pid in marked_processes(herd.layout.root)]
        (driver,) = [p for p in processes if p.cmdline()[2:3] == [DRIVER_MODULE]]
        workers = [p for p in processes if "examples/train_digits.py" in p.cmdline()]
        assert len(workers) >= 2  # the workers, and whatever they started
        runtime = herd.layout.runtime
        driver.kill()
        failed = herd.wait_for(
            lambda: (c := herd.condition("digits", "Failed")) and c["status"] == "True" and c,
            "the job to fail",
            job="digits",
        )
        assert failed["message"] == f"hvd-driver exited with status -{signal.SIGKILL}"
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert alive == []
        assert marked_processes(herd.layout.root) == {}
    assert runtime is None or not runtime.exists()
    assert [e.reason for e in herd.events("digits")].count("Started") == 1


def test_a_grow_whose_new_worker_starts_too_slowly_costs_the_job_no_progress(
    herd: OperatorHarness,
) -> None:
    """Issue 25, item 5: the worker a grow started took longer than Gloo's timeout to start;
    the running worker aborted, the job failed and was started again from epoch 0. Now the
    job's driver holds the running worker past Gloo's timeout (10 s) up to the spec's
    growTimeoutSeconds (15 s), gives the grow up, and the job goes on at its old size.
    About 30 s here."""
    command = digits_command(1000, "--step-delay", "0.03")
    slow = slow_first_grown_worker(herd.root / "slow-once", command)
    schedule = {"name": "schedule", "params": {"initial": 1, "steps": [{"atEpoch": 1, "gpus": 2}]}}
    timeouts = {"glooTimeoutSeconds": 10, "growTimeoutSeconds": 15}
    herd.write_spec(spec_document("slow", 1, 2, slow, policy=schedule, horovod=timeouts))
    log = herd.layout.log_file("slow")
    herd.wait_for(
        lambda: log.exists() and "<stdout>:starting slowly" in log.read_text(),
        "the grow",
        job="slow",
    )
    launch = herd.launch_id("slow")
    # The spec's Gloo timeout is the workers' (Horovod exports it to them).
    (worker,) = [p for p in workers_of(herd, "slow") if p.environ()["HOROVOD_RANK"] == "0"]
    assert worker.environ()["HOROVOD_GLOO_TIMEOUT_SECONDS"] == "10"
    gave_up = herd.wait_for(
        lambda: "gave up the grow to 2" in (text := log.read_text()) and text,
        "the grow given up",
        job="slow",
    )
    assert "going on at 1" in gave_up and "Process 0 exit" not in gave_up, gave_up[-2000:]
    given_up_at = time.time()
    last = max(r.epoch for r in herd.reports("slow") if r.epoch is not None)
    herd.wait_for(
        lambda: any(
            r.epoch is not None and r.epoch > last and r.time > given_up_at
            for r in herd.reports("slow")
        ),
        "an epoch after the grow was given up",
        job="slow",
    )
    epochs = [r.epoch for r in herd.reports("slow") if r.epoch is not None]
    assert epochs == sorted(epochs), f"the epochs started again: {epochs}"
    assert herd.launch_id("slow") == launch, "the job was relaunched"
    assert [e.reason for e in herd.events("slow")].count("Started") == 1
    assert worker.is_running(), "the running worker was replaced"


def workers_of(herd: OperatorHarness, job: str) -> list[psutil.Process]:
    """The job's live worker processes (those with a Horovod rank)."""
    found = []
    for pid in marked_processes(herd.layout.root):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            environ = process.environ()
            if environ.get("HERD_JOB") == job and "HOROVOD_RANK" in environ:
                found.append(process)
    return found
