"""`herd-operator run` as a user starts it: a foreground process that stops cleanly on signals."""

from __future__ import annotations

import contextlib
import io
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from herd_operator.cli import main
from tests.integration.harness import (
    HERD,
    REPO,
    digits_command,
    kill_marked_processes,
    marked_processes,
    spec_document,
)


def one_job_operator(tmp_path: Path) -> tuple[Path, list[str]]:
    """A spec directory with one elastic job, and the `herd-operator run` argv for it."""
    jobs, state = tmp_path / "jobs", tmp_path / "state"
    jobs.mkdir()
    spec = spec_document("digits", 1, 2, digits_command(500, "--step-delay", "0.05"))
    (jobs / "digits.yaml").write_text(yaml.safe_dump(spec))
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:2", "--resync-seconds", "0.5", "--grace-seconds", "5",
            "--metrics-port", "0"]  # fmt: skip
    return state, argv


def in_process(command: list[str]) -> tuple[int, str]:
    """`command` (`herd-operator ...`) run by the CLI's own `main` in this process: its exit
    status and output. For polling: a new `herd-operator` process costs about 0.5 CPU-s to
    start, and these waits asked every half second for up to a minute."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(io.StringIO()):
        try:
            status = main(command[1:])
        except Exception:  # a store still being made: the process would exit non-zero
            status = 1
    return status, output.getvalue()


def wait_for_json(command: list[str], probe, timeout: float = 120.0):  # type: ignore[no-untyped-def]
    """The answer of `command` (the installed CLI, as a user runs it) once `probe` holds for
    it; polled in this process until it should."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        status, output = in_process(command)
        if status == 0 and probe(last := json.loads(output)):
            result = subprocess.run(command, capture_output=True, text=True, timeout=60)
            if result.returncode == 0:
                last = json.loads(result.stdout)
                if probe(last):
                    return last
        time.sleep(0.5)
    raise AssertionError(f"timed out; last answer: {last}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_stops_its_jobs_and_leaves_no_process_on_signal(
    tmp_path: Path, sig: signal.Signals
) -> None:
    state, argv = one_job_operator(tmp_path)
    operator = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        get = [HERD, "get", "-o", "json", "--state-dir", str(state)]
        wait_for_json(
            get, lambda jobs: jobs["items"] and jobs["items"][0]["status"]["gpus"]["active"] == 2
        )
        assert any(marked_processes(state).values()), "the job's processes should be running"
        operator.send_signal(sig)
        output, _ = operator.communicate(timeout=60)
    finally:
        if operator.poll() is None:
            operator.kill()
    assert operator.returncode == 0, output
    assert "stopping digits" in output
    # One line per decision, not per poll: a few dozen lines for this whole run.
    assert len(output.splitlines()) < 40, output
    assert marked_processes(state) == {}, "processes left behind"
    # Works after the operator stopped, too.
    after = json.loads(subprocess.run(get, capture_output=True, text=True, check=True).stdout)
    status = after["items"][0]["status"]
    running = next(c for c in status["conditions"] if c["type"] == "Running")
    assert (running["status"], running["reason"]) == ("False", "OperatorStopped")
    assert status["gpus"]["allocated"] == 0
    events = subprocess.run(
        [HERD, "events", "digits", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Started" in events and "Stopped" in events


def test_restart_after_a_crash_stops_launches_whose_record_is_lost_and_starts_the_job_again(
    tmp_path: Path,
) -> None:
    """A launch whose record is gone (removed by hand, or unreadable) is nobody's: stopped,
    and the job started again. (A launch is recorded before its process starts, so a crash
    alone never does this: tests/integration/test_crash_only.py and the kill points of
    tests/unit/test_adoption.py.)"""
    state, command = one_job_operator(tmp_path)
    get = [HERD, "get", "-o", "json", "--state-dir", str(state)]
    first = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_for_json(
            get, lambda jobs: jobs["items"] and jobs["items"][0]["status"]["gpus"]["active"] == 2
        )
        first.kill()  # a crash: no chance to stop its jobs
        first.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    orphans = marked_processes(state)
    assert orphans, "the crashed operator's job keeps running on its own"
    old_launch = set(orphans.values())
    (state / "launches" / "digits.json").unlink()  # the record is lost

    second = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        events = [HERD, "events", "digits", "--state-dir", str(state)]

        def relaunched(text: str) -> bool:
            return "Orphaned" in text and text.count("Started") == 2

        deadline = time.monotonic() + 120
        # Polled in this process; what counts is the installed command's answer.
        while not (
            relaunched(in_process(events)[1])
            and relaunched(
                subprocess.run(events, capture_output=True, text=True, check=True).stdout
            )
        ):
            assert time.monotonic() < deadline, "the job was not started again"
            time.sleep(0.5)
        wait_for_json(
            get, lambda jobs: jobs["items"] and jobs["items"][0]["status"]["gpus"]["active"] == 2
        )
        assert not [pid for pid, launch in marked_processes(state).items() if launch in old_launch]
        second.send_signal(signal.SIGTERM)
        output, _ = second.communicate(timeout=60)
    finally:
        if second.poll() is None:
            second.kill()
    assert "have no launch record" in output and "stopping them" in output
    assert marked_processes(state) == {}


@pytest.fixture(autouse=True)
def no_job_left(tmp_path: Path) -> Iterator[None]:
    """Jobs outlive an operator killed here (or a test that failed midway): kill them."""
    yield
    kill_marked_processes(tmp_path / "state")


def test_run_with_json_logs_writes_one_object_per_line_and_no_secret(tmp_path: Path) -> None:
    """Issue 28.4: `run --log-format json`, as a log shipper reads it. A spec that is
    invalid makes a line with a `job` field; the allocator's token and every key the
    operator derived (secrets/) appear in no line."""
    jobs, state = tmp_path / "jobs", tmp_path / "state"
    jobs.mkdir()
    (jobs / "broken.yaml").write_text(
        "apiVersion: herd/v1alpha1\nkind: HerdJob\nmetadata: {name: broken}\nspec: {}\n"
    )
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:2", "--metrics-port", "0", "--log-format", "json"]  # fmt: skip
    operator = subprocess.Popen(argv, cwd=REPO, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    try:
        assert operator.stderr is not None
        deadline = time.monotonic() + 120
        # Bounded: a line a read, until the invalid spec's line or the deadline.
        while time.monotonic() < deadline and not any("invalid spec" in x for x in lines):
            line = operator.stderr.readline()
            if not line:
                break
            lines.append(line)
        operator.send_signal(signal.SIGTERM)
        _, rest = operator.communicate(timeout=60)
        lines += rest.splitlines(keepends=True)
    finally:
        if operator.poll() is None:
            operator.kill()
            operator.wait()
    assert operator.returncode == 0, "".join(lines)
    shown = [json.loads(line) for line in lines]
    for line in shown:
        assert {"time", "level", "logger", "message"} <= line.keys(), line
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    invalid = [line for line in shown if "invalid spec" in line["message"]]
    assert invalid and invalid[0]["job"] == "broken" and invalid[0]["level"] == "WARNING"
    secrets = [(state / "allocator.token").read_text().strip()]
    secrets += [path.read_text().strip() for path in (state / "secrets").iterdir()]
    assert secrets[0]
    text = "".join(lines)
    assert not [secret for secret in secrets if secret and secret in text]
