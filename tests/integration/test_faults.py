"""A worker killed under a real elastic horovodrun job on the default one-host pool.

Horovod blacklists the host name of a failed worker and stops the job when every name
is blacklisted. The operator shows the one host under several names, so the job goes on
at a smaller size; the operator takes back the dead worker's GPU, says so, and grows the
job back. Marked `faults` (each test runs a job through a worker failure: about a minute).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import psutil
import pytest

from tests.integration.harness import OperatorHarness, digits_command, spec_document

pytestmark = pytest.mark.faults

EPOCHS = 12


def test_a_killed_worker_costs_the_job_one_gpu_not_the_run(herd: OperatorHarness) -> None:
    # The survivors notice the dead worker after Gloo's timeout (30 s). A shorter one would
    # fail the worker that rejoins later: it must start (import torch) within it.
    herd.write_spec(spec_document("digits", 1, 4, digits_command(EPOCHS)))
    herd.wait_for(
        lambda: any(r.epoch is not None and r.world_size == 4 for r in herd.reports("digits")),
        "an epoch at 4 workers",
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


def rank_of(pid: int) -> int | None:
    """The Horovod rank of a worker process, from the environment horovodrun gave it."""
    try:
        environ = psutil.Process(pid).environ()
    except psutil.Error:
        return None
    if environ.get("HERD_JOB") != "digits" or "HOROVOD_RANK" not in environ:
        return None
    return int(environ["HOROVOD_RANK"])
