"""The allocator's queue with preemption against a real operator and real Horovod jobs
(issue 31): on one GPU under `srpt`, a long job that has run and says it resumes
(`training.resumable`) is preempted for a new short one (its workers stopped, its GPU
drained), then launched again from its checkpoint once the short one is done, and
finishes; `Preempted` and its events say so, and the preemption counts as no failure."""

from __future__ import annotations

import time
from pathlib import Path

from herd_operator.policies.queueing import QueueConfig
from tests.integration.harness import digits_command, operator_harness, spec_document

MIN_RUN_S = 2.0
"""The queue's minimum run before a preemption, shortened from 10 minutes."""


def test_a_long_job_is_preempted_for_a_short_one_then_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    queue = QueueConfig("srpt", min_run_seconds=MIN_RUN_S)
    checkpoint = tmp_path / "long.ckpt"
    long_command = digits_command(4, "--step-delay", "0.03", "--checkpoint", str(checkpoint))
    with operator_harness(tmp_path, gpus=1, queue=queue) as herd:
        herd.write_spec(spec_document("long", 1, 1, long_command, training={"resumable": True}))
        done = herd.wait_for(
            lambda: (
                checkpoint.exists()
                and [r.epoch for r in herd.reports("long") if r.epoch is not None]
            ),
            "long's first epoch and checkpoint",
            240,
            "long",
        )
        reached = max(done)

        herd.write_spec(spec_document("short", 1, 1, digits_command(1)))
        preempted = herd.wait_for(
            lambda: (c := herd.condition("long", "Preempted")) and c["status"] == "True" and c,
            "long preempted",
            120,
            "long",
        )
        assert preempted["message"].startswith("preempted for short (attained "), preempted
        herd.wait_for(
            lambda: (c := herd.condition("short", "Succeeded")) and c["status"] == "True",
            "short to succeed",
            240,
            "short",
        )
        herd.wait_for(
            lambda: (c := herd.condition("long", "Succeeded")) and c["status"] == "True",
            "long to resume and succeed",
            300,
            "long",
        )

        job = herd.job("long")
        assert job is not None, herd.diagnostics("long")
        assert job["restarts"] == 0 and job["preemptions"] == 1, herd.diagnostics(None)
        readmitted = herd.condition("long", "Preempted")
        assert readmitted is not None and readmitted["reason"] == "Readmitted"
        reasons = [event.reason for event in herd.events("long")]
        assert reasons.count("Preempted") == 1 and reasons.count("Readmitted") == 1
        assert "BackOff" not in reasons and "Failed" not in reasons
        log = herd.layout.log_file("long").read_text()
        assert f"resuming from {checkpoint}: epoch " in log
        resumed_at = int(log.split(f"resuming from {checkpoint}: epoch ")[1].split()[0])
        assert resumed_at >= reached, (resumed_at, reached)
        times = {(e.job, e.reason): e.time for e in herd.events()}
        # The short job started only after long's worker left the GPU (its drain).
        assert times[("short", "Started")] >= times[("long", "Preempted")]
        print(
            f"long preempted after epoch {reached}, resumed at epoch {resumed_at};"
            f" short started {times[('short', 'Started')] - times[('long', 'Preempted')]:.1f}s"
            f" after the preemption; at {time.strftime('%H:%M:%S')}"
        )
