"""A job whose workers' first meeting fails on every rank that came: it is relaunched under
its restart policy (or fails), instead of showing Running with no worker training forever.

CI at 1620f19 saw it in test_slurm: under load one worker was not at Gloo's rendezvous in
time, the others failed (`Wait timeout after 30 seconds for key(s): 2`), and Horovod's
driver waited at its registry's barrier for the one that never came nor ended; the job
stayed Running, "waiting for the workers' first report". Here a worker is held back before
`hvd.init()` on the first launch only, with a Gloo timeout of 5 s. About 40 s.
"""

from __future__ import annotations

import pytest

from tests.integration.harness import OperatorHarness, digits_command, spec_document

pytestmark = pytest.mark.faults

HELD_BACK_WORKER = """
import os, runpy, sys, time
flag = sys.argv[1]
if os.environ["HOROVOD_RANK"] == "1" and not os.path.exists(flag):
    open(flag, "w").close()
    print("held back before hvd.init()", flush=True)
    time.sleep(600)  # neither at the rendezvous nor ended: a stuck start
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_first_meeting_missed_by_a_held_back_worker_relaunches_the_job(
    herd: OperatorHarness,
) -> None:
    command = digits_command(1)
    held = ["python", "-c", HELD_BACK_WORKER, str(herd.root / "held-once"), *command[1:]]
    spec = spec_document(
        "first",
        2,
        2,
        held,
        horovod={"glooTimeoutSeconds": 5},
        restartPolicy={"onFailure": True, "backoffLimit": 1},
    )
    herd.write_spec(spec)
    backoff = herd.wait_for(
        lambda: next((e for e in herd.events("first") if e.reason == "BackOff"), None),
        "the failed first meeting to be restarted",
        timeout=90,
        job="first",
    )
    # The reason is the driver's: which worker failed and which one never came.
    assert "hvd-driver exited with status 1: the workers' first meeting failed:" in (
        backoff.message
    ), backoff.message
    assert "rank 1 (" in backoff.message and "neither came to the rendezvous nor ended" in (
        backoff.message
    )
    assert "restart 1/1" in backoff.message
    log = herd.layout.log_file("first").read_text()
    assert "held back before hvd.init()" in log
    assert "Wait timeout after 5 seconds" in log  # rank 0's Gloo timeout, as in CI

    # Relaunched at once (restart 1 in 1 s), on the same GPUs: its workers bound them. How
    # the relaunched job trains is every other test's; this one stops where the old code hung.
    def relaunch_bound() -> bool:
        job = herd.job("first")
        started = [e for e in herd.events("first") if e.reason == "Started"]
        return len(started) == 2 and job is not None and job["gpus"]["active"] == 2

    herd.wait_for(relaunch_bound, "the relaunch's two workers", timeout=60, job="first")
    assert is_true(herd.condition("first", "Running")), herd.condition("first", "Running")


def is_true(condition: dict[str, object] | None) -> bool:
    return condition is not None and condition["status"] == "True"
