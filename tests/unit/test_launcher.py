"""The launcher: real processes started and stopped, whatever engine's argv they run.

The fake "horovodrun" scripts behave like Horovod's: a launcher process whose workers
live in sessions of their own. (The Horovod argv is tested in test_horovod_engine.py.)
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

from herd_operator.controllers.ports import ProcessPhase, ProcessState
from herd_operator.environment import LAUNCH_ID_ENV
from herd_operator.runtime.launcher import Launcher, LaunchRequest
from herd_operator.runtime.log_format import LOG_TIME_PATTERN
from herd_operator.specs import HerdJobSpec

# Hang guard for waiting on processes; never a performance expectation.
GUARD_S = 20.0


def make_spec(**fields: Any) -> HerdJobSpec:
    data: dict[str, Any] = {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}}
    data.update(fields)
    return HerdJobSpec.model_validate(data)


def make_request(
    argv: Sequence[str],
    tmp_path: Path,
    *,
    spec: HerdJobSpec | None = None,
    env: Mapping[str, str] | None = None,
) -> LaunchRequest:
    return LaunchRequest(
        job="train",
        generation=1,
        argv=argv,
        log_file=tmp_path / "logs" / "train.log",
        command="horovodrun",
        spec=spec or make_spec(),
        env=dict(env or {}),
        working_dir=str(tmp_path),
    )


# ---- Launcher with a fake horovodrun ----


def write_script(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    path.chmod(0o755)
    return path


# Starts one "worker" in a new session, as Horovod does, that ignores SIGTERM: only the
# SIGKILL after the grace period can end it.
STUBBORN_HOROVODRUN = """\
import os, subprocess, sys, time
worker = (
    "import os, signal, time\\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
    "open(os.environ['FAKE_READY'] + '.tmp', 'w').write(str(os.getpid()))\\n"
    "os.replace(os.environ['FAKE_READY'] + '.tmp', os.environ['FAKE_READY'])\\n"
    "time.sleep(300)\\n"
)
subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
time.sleep(300)
"""

# Prints its environment marker and each argument it got, then exits with $FAKE_EXIT.
EXITING_HOROVODRUN = """\
#!/bin/sh
echo "job=$HERD_JOB launch=$HERD_LAUNCH_ID"
printf '<%s>\\n' "$@"
exit "$FAKE_EXIT"
"""


class Exits:
    """The launcher's `on_exit` callback: records each job and wakes a waiting test."""

    def __init__(self) -> None:
        self.jobs: list[str] = []
        self.called = threading.Event()

    def __call__(self, job: str) -> None:
        self.jobs.append(job)
        self.called.set()


@pytest.fixture
def exits() -> Exits:
    return Exits()


@pytest.fixture
def launcher(exits: Exits) -> Iterator[Launcher]:
    launcher = Launcher(exits, grace_seconds=1)
    yield launcher
    launcher.stop_all(timeout=GUARD_S)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def marked_pids(launch_id: str) -> set[int]:
    found = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(LAUNCH_ID_ENV) == launch_id and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def is_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_stop_escalates_to_sigkill_for_a_worker_in_its_own_session(
    tmp_path: Path, launcher: Launcher, exits: Exits
) -> None:
    fake = write_script(tmp_path / "horovodrun", f"#!{sys.executable}\n{STUBBORN_HOROVODRUN}")
    ready = tmp_path / "worker.pid"
    request = make_request([str(fake)], tmp_path, env={"FAKE_READY": str(ready)})
    info = launcher.launch(request)
    assert (info.command, info.spec, info.generation) == ("horovodrun", request.spec, 1)
    wait_for(ready.exists, "the worker to start")
    worker_pid = int(ready.read_text())
    assert os.getsid(worker_pid) != os.getsid(info.pid)
    assert marked_pids(info.launch_id) == {info.pid, worker_pid}

    assert launcher.state("train") == ProcessState(ProcessPhase.RUNNING, launch=info)
    with pytest.raises(RuntimeError, match=r"^job train already has a process$"):
        launcher.launch(request)

    launcher.stop("train")
    stopping = launcher.state("train")
    assert stopping.phase is ProcessPhase.STOPPING
    assert stopping.stopped_by_us is True

    wait_for(lambda: launcher.state("train").phase is ProcessPhase.EXITED, "the job to exit")
    final = launcher.state("train")
    assert final.stopped_by_us is True
    assert final.exit_code == -15  # the launched process itself went on SIGTERM
    assert final.launch == info
    assert is_dead(worker_pid)
    assert marked_pids(info.launch_id) == set()
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    assert exits.jobs == ["train"]


@pytest.mark.parametrize("code", [0, 3])
def test_natural_exit(tmp_path: Path, launcher: Launcher, exits: Exits, code: int) -> None:
    fake = write_script(tmp_path / "horovodrun", EXITING_HOROVODRUN)
    command = ["python", "train.py", "--name", "my run", "it's; rm -rf x"]
    argv = [str(fake), "-np", "2", "--", *command]
    request = make_request(argv, tmp_path, env={"HERD_JOB": "train", "FAKE_EXIT": str(code)})
    info = launcher.launch(request)
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    assert exits.jobs == ["train"]

    state = launcher.state("train")
    assert state.ended_at is not None and info.started_at <= state.ended_at <= time.time()
    assert state == ProcessState(
        ProcessPhase.EXITED, code, info, stopped_by_us=False, ended_at=state.ended_at
    )

    header, marker, *args = request.log_file.read_text().splitlines()
    # Stamped as the driver's lines are (ISO 8601 UTC, ms): a job's log reads one way.
    match = re.fullmatch(rf"==== {LOG_TIME_PATTERN} launch ([0-9a-f]{{32}}): (.*)", header)
    assert match is not None, header
    assert match[1] == info.launch_id
    assert json.loads(match[2]) == argv
    assert marker == f"job=train launch={info.launch_id}"
    assert args == [f"<{arg}>" for arg in argv[1:]]

    launcher.forget("train")
    assert launcher.state("train") == ProcessState(ProcessPhase.ABSENT)
    assert launcher.jobs() == []


def test_runs_in_its_working_dir_with_the_operators_env_and_the_requests(
    tmp_path: Path, launcher: Launcher, exits: Exits, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FROM_OPERATOR", "kept")
    monkeypatch.setenv("OVERRIDDEN", "operator")
    script = 'echo "cwd=$(pwd) op=$FROM_OPERATOR over=$OVERRIDDEN launch=$HERD_LAUNCH_ID"\n'
    work = tmp_path / "work"
    work.mkdir()
    request = LaunchRequest(
        job="train",
        generation=1,
        argv=["/bin/sh", "-c", script],
        log_file=tmp_path / "logs" / "train.log",
        command="sh",
        spec=make_spec(),
        # The request cannot forge the launch marker that finds its processes.
        env={"OVERRIDDEN": "request", LAUNCH_ID_ENV: "forged"},
        working_dir=str(work),
    )
    info = launcher.launch(request)
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    line = request.log_file.read_text().splitlines()[1]
    assert line == f"cwd={work} op=kept over=request launch={info.launch_id}"


def test_stop_after_a_natural_exit_is_not_a_stop_by_us(
    tmp_path: Path, launcher: Launcher, exits: Exits
) -> None:
    fake = write_script(tmp_path / "horovodrun", EXITING_HOROVODRUN)
    info = launcher.launch(make_request([str(fake)], tmp_path, env={"FAKE_EXIT": "0"}))
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    # The controller read RUNNING a moment ago and now decides to stop: the job beat it.
    launcher.stop("train")
    state = launcher.state("train")
    assert state == ProcessState(ProcessPhase.EXITED, 0, info, False, ended_at=state.ended_at)
