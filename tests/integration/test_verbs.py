"""The writing verbs against a real operator and real Horovod jobs, through the CLI as a
user runs it: apply, suspend (the GPUs freed, no worker left), resume (the script goes on
from its checkpoint's epoch, not from 0), delete; and `wait`'s exit status on a job that
succeeds and one that fails."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import yaml

from tests.integration.harness import (
    HERD,
    REPO,
    OperatorHarness,
    digits_command,
    marked_processes,
    spec_document,
)


def cli(herd: OperatorHarness, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    where = ["--state-dir", str(herd.layout.root)]
    if argv[0] != "get":
        where += ["--specs-dir", str(herd.specs_dir)]
    return subprocess.run(
        [HERD, *argv, *where], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def epochs(herd: OperatorHarness, name: str) -> list[int]:
    return [report.epoch for report in herd.reports(name) if report.epoch is not None]


def test_apply_suspend_resume_delete_a_running_horovod_job(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "digits.ckpt"
    command = digits_command(400, "--step-delay", "0.02", "--checkpoint", str(checkpoint))
    source = tmp_path / "digits.yaml"
    source.write_text(yaml.safe_dump(spec_document("digits", 2, 2, command)))

    applied = cli(herd, "apply", "-f", str(source))
    assert (applied.returncode, applied.stdout) == (0, "herdjob/digits created\n"), applied.stderr
    herd.wait_for(lambda: len(epochs(herd, "digits")) >= 2, "two epochs", 240, "digits")

    asked = time.monotonic()
    suspended = cli(herd, "suspend", "digits")
    assert suspended.stdout == "herdjob/digits suspended\n", suspended.stderr
    waited = cli(herd, "wait", "digits", "--for=condition=Suspended", "--timeout=120s", timeout=150)
    assert waited.returncode == 0, waited.stderr + herd.diagnostics("digits")
    stopped_in = time.monotonic() - asked
    assert marked_processes(herd.layout.root) == {}  # no worker, no driver left
    job = herd.job("digits")
    assert job is not None and job["status"] == "Suspended" and job["gpus"]["allocated"] == 0
    assert herd.operator.allocator.grant("digits") is None
    reached = max(epochs(herd, "digits"))
    assert checkpoint.exists()
    shown = cli(herd, "get", "digits")
    assert shown.stdout.splitlines()[1].split()[1] == "Suspended"

    resumed = cli(herd, "resume", "digits")
    assert resumed.stdout == "herdjob/digits resumed\n", resumed.stderr
    before = len(herd.reports("digits"))
    herd.wait_for(
        lambda: [r.epoch for r in herd.reports("digits")[before:] if r.epoch is not None],
        "an epoch after the resume",
        240,
        "digits",
    )
    after = [r.epoch for r in herd.reports("digits")[before:] if r.epoch is not None]
    # Epochs are reported as they end: the first after the resume is the checkpoint's
    # (the one after the last that ended before the suspension, or that one's successor
    # when the suspension came after its checkpoint but before its report).
    assert after[0] >= reached, (after, reached)
    times = {event.reason: event.time for event in herd.events("digits")}
    print(
        f"suspended in {stopped_in:.1f}s (the operator's Suspending to Suspended:"
        f" {times['Suspended'] - times['Suspending']:.1f}s) after epoch {reached};"
        f" resumed at epoch {after[0]}"
    )
    log = herd.layout.log_file("digits").read_text()
    assert "resuming from" in log

    deleted = cli(herd, "delete", "digits", "--wait", "--timeout", "120", timeout=150)
    assert (deleted.returncode, deleted.stdout) == (0, 'herdjob "digits" deleted\n'), deleted.stderr
    assert herd.job("digits") is None
    assert marked_processes(herd.layout.root) == {}


def test_wait_exits_0_on_success_and_1_at_once_on_failure(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    good = spec_document("good", 1, 1, digits_command(1))
    bad = spec_document("bad", 1, 1, ["python", "-c", "import sys; sys.exit(3)"])
    source = tmp_path / "both.yaml"
    source.write_text(yaml.safe_dump_all([good, bad]))

    applied = cli(herd, "apply", "-f", str(source))
    assert applied.stdout.splitlines() == ["herdjob/good created", "herdjob/bad created"]
    failed = cli(herd, "wait", "bad", "--for=condition=Succeeded", "--timeout=5m", timeout=330)
    succeeded = cli(herd, "wait", "good", "--for=condition=Succeeded", "--timeout=5m", timeout=330)

    assert failed.returncode == 1, failed.stderr + herd.diagnostics("bad")
    assert failed.stderr.startswith("error: herdjob/bad Failed: Failed: ")
    assert "exited with status" in failed.stderr
    assert (succeeded.returncode, succeeded.stdout) == (
        0,
        "herdjob/good condition=Succeeded=True: met\n",
    ), succeeded.stderr + herd.diagnostics("good")
    impossible = cli(herd, "wait", "good", "--for=condition=Failed", "--timeout=1s")
    assert impossible.returncode == 1  # it Succeeded: Failed can no longer come
