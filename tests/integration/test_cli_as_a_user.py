"""The reading commands against a real operator, as a user runs them: `logs -f` follows a
running job to its end, `get -w` prints its change, and a missing `horovodrun` shows as a
condition and an event from the job's first reconcile."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs import ConditionType, get_condition
from tests.integration.harness import HERD, REPO, kill_marked_processes, spec_document

STEPS = 5
COUNTER = (
    f"import time\nfor i in range({STEPS}):\n"
    "    print('step', i, flush=True)\n    time.sleep(0.5)\n"
)


def operator_argv(python: str, tmp_path: Path) -> list[str]:
    return [python, "-m", "herd_operator.cli", "run",
            "--specs-dir", str(tmp_path / "jobs"), "--state-dir", str(tmp_path / "state"),
            "--hosts", "localhost:2", "--resync-seconds", "0.5", "--grace-seconds", "5",
            "--metrics-port", "0"]  # fmt: skip


def write_spec(tmp_path: Path, name: str, command: list[str]) -> None:
    jobs = tmp_path / "jobs"
    jobs.mkdir(exist_ok=True)
    document = spec_document(name, 1, 1, command)
    document["metadata"]["labels"] = {"team": "vision"}
    (jobs / f"{name}.yaml").write_text(yaml.safe_dump(document))


def herd(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HERD, *argv], capture_output=True, text=True, timeout=60)


def wait_until(probe, what: str, timeout: float = 90.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := probe()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)
    return value


def stop(operator: subprocess.Popen[str]) -> str:
    operator.send_signal(signal.SIGTERM)
    output, _ = operator.communicate(timeout=60)
    return output


@pytest.fixture(autouse=True)
def no_job_left(tmp_path: Path) -> Iterator[None]:
    yield
    kill_marked_processes(tmp_path / "state")


def _interruptible() -> None:
    """Ctrl-C reaches the child as it reaches a terminal's foreground command: a test run
    started in the background by a non-interactive shell (`.ci/run &`) has SIGINT ignored,
    which every child inherits (and Python then keeps), so `get -w` never saw the test's
    Ctrl-C (it failed this way twice)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_logs_follow_and_get_watch_see_a_job_run_to_its_end(tmp_path: Path) -> None:
    write_spec(tmp_path, "counter", ["python", "-c", COUNTER])
    state = str(tmp_path / "state")
    operator = subprocess.Popen(
        operator_argv(sys.executable, tmp_path),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchers: list[subprocess.Popen[str]] = []
    try:
        # Label selectors and the global --state-dir, on the real store.
        wait_until(
            lambda: (
                herd("--state-dir", state, "get", "-l", "team=vision", "-o", "name").stdout
                == "herdjob/counter\n"
            ),
            "the job to be recorded",
        )
        follow = subprocess.Popen(
            [HERD, "logs", "counter", "-f", "--state-dir", state],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        watch = subprocess.Popen(
            [HERD, "get", "-w", "--no-headers", "--state-dir", state],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_interruptible,
        )
        watchers += [follow, watch]
        # `logs -f` returns by itself once the job has ended, with every line it printed.
        followed, errors = follow.communicate(timeout=120)
        assert (follow.returncode, errors) == (0, "")
        steps = [line for line in followed.splitlines() if line.startswith("[0]<stdout>:")]
        assert steps == [f"[0]<stdout>:step {i}" for i in range(STEPS)]
        assert followed.startswith("==== "), "the launcher's header line of the launch"

        shown = json.loads(herd("get", "counter", "-o", "json", "--state-dir", state).stdout)
        assert shown["kind"] == "HerdJob" and shown["status"]["summary"] == "Succeeded"
        time.sleep(1.5)  # two of get -w's looks
        watch.send_signal(signal.SIGINT)  # Ctrl-C
        watched, errors = watch.communicate(timeout=30)
        assert (watch.returncode, errors) == (0, "")
        statuses = [line.split()[1] for line in watched.splitlines()]
        assert statuses[-1] == "Succeeded" and len(statuses) >= 2, watched
        assert statuses[0] != "Succeeded", "the change should come after the first list"
    finally:
        for process in watchers:
            if process.poll() is None:
                process.kill()
        output = stop(operator)
    assert operator.returncode == 0, output


def python_without_horovod(root: Path) -> Path:
    """A virtual environment with every package of this one but Horovod's `horovodrun`
    script: a user who installed herd-operator where Horovod is not."""
    venv = root / "venv"
    subprocess.run(
        [os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(venv)],
        check=True,
        timeout=120,
    )
    (site_packages,) = (venv / "lib").glob("python3*/site-packages")
    ours = [path for path in sys.path if path.endswith("site-packages")]
    (site_packages / "this-env.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in ours)
    )
    python = venv / "bin" / "python"
    assert not (python.parent / "horovodrun").exists()
    return python


def test_a_missing_horovodrun_is_a_condition_and_an_event_from_the_first_reconcile(
    tmp_path: Path,
) -> None:
    python = python_without_horovod(tmp_path)
    write_spec(tmp_path, "nohvd", ["python", "-c", "pass"])
    env = {**os.environ, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    assert subprocess.run(["which", "horovodrun"], env=env, capture_output=True).returncode
    operator = subprocess.Popen(
        operator_argv(str(python), tmp_path),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    database = StateLayout(tmp_path / "state").database
    try:

        def launch_failed() -> object:
            if not database.exists():
                return None
            try:
                reader = Store.open_readonly(database)
            except StoreError as error:
                # The operator creates the file, then its schema: between the two it is not
                # a store yet (seen here at load 10).
                if "has no schema" in str(error):
                    return None
                raise
            with reader as store:
                record = store.get_job("nohvd")
                events = store.events("nohvd")
            if record is None:
                return None
            running = get_condition(record.status.conditions, ConditionType.Running)
            return (record, running, events) if running is not None else None

        record, running, events = wait_until(launch_failed, "the job's first reconcile")
        time.sleep(3.0)  # long enough for a retry storm to show, had there been one
        with Store.open_readonly(database) as store:
            (event,) = store.events("nohvd")
            decisions = store.grant_history("nohvd")
        described = herd("describe", "nohvd", "--state-dir", str(tmp_path / "state")).stdout
        _, row = herd("get", "nohvd", "--state-dir", str(tmp_path / "state")).stdout.splitlines()
    finally:
        output = stop(operator)
    assert operator.returncode == 0, output
    # Set by the very reconcile that recorded the job (both carry that reconcile's time).
    assert (running.status, running.reason) == ("False", "LaunchFailed")
    assert running.last_transition_time == record.created_at
    assert "horovodrun not found" in running.message
    assert [(e.type, e.reason) for e in events] == [("Warning", "LaunchFailed")]
    # Tried again after 1 s, 2 s, 4 s ...: attempts counted on one event, and one decision.
    assert event.count >= 2, "tried again"
    assert event.last_time - event.time >= 2 ** (event.count - 1) - 1 - 0.5, "backed off"
    assert len(decisions) == 1, decisions
    assert "LaunchFailed" in described and "horovodrun not found" in described
    assert row.split()[1] == "LaunchFailed"
