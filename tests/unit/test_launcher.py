"""The launcher: the exact horovodrun command, and real processes started and stopped."""

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

from controllers.ports import ProcessPhase, ProcessState
from herd_operator.environment import LAUNCH_ID_ENV
from herd_operator.runtime import launcher as launcher_module
from herd_operator.runtime.launcher import Launcher, LaunchRequest, horovodrun_argv
from specs import HerdJobSpec

# Hang guard for waiting on processes; never a performance expectation.
GUARD_S = 20.0
PYTHON = "/opt/env/bin/python"
HOROVODRUN = "/opt/env/bin/horovodrun"


def make_spec(**fields: Any) -> HerdJobSpec:
    data: dict[str, Any] = {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}}
    data.update(fields)
    return HerdJobSpec.model_validate(data)


def make_request(
    spec: HerdJobSpec,
    tmp_path: Path,
    *,
    np: int = 2,
    hosts: Sequence[str] = ("localhost",),
    env: Mapping[str, str] | None = None,
) -> LaunchRequest:
    return LaunchRequest(
        job="train",
        generation=1,
        spec=spec,
        np=np,
        discovery_script=tmp_path / "grants" / "train.discover.sh",
        log_file=tmp_path / "logs" / "train.log",
        hosts=hosts,
        env=dict(env or {}),
    )


# ---- horovodrun_argv ----


def test_argv_minimal_on_one_local_host(tmp_path: Path) -> None:
    request = make_request(make_spec(), tmp_path, np=3)
    assert horovodrun_argv(request, HOROVODRUN, PYTHON) == [
        HOROVODRUN,
        "-np",
        "3",
        "--min-np",
        "1",
        "--max-np",
        "4",
        "--host-discovery-script",
        str(tmp_path / "grants" / "train.discover.sh"),
        "--elastic-timeout",
        "600",
        "--network-interface",
        "lo",
        PYTHON,
        "-m",
        "herd_operator.agent.shim",
        "--",
        "python",
        "train.py",
    ]


def test_argv_with_horovod_options_on_remote_hosts(tmp_path: Path) -> None:
    spec = make_spec(
        gpus={"min": 2, "max": 8},
        horovod={
            "elasticTimeoutSeconds": 60,
            "resetLimit": 0,
            "extraArgs": ["--gloo-timeout-seconds", "30", "--verbose"],
        },
    )
    request = make_request(spec, tmp_path, np=4, hosts=("nid001", "localhost"))
    assert horovodrun_argv(request, HOROVODRUN, PYTHON) == [
        HOROVODRUN,
        "-np",
        "4",
        "--min-np",
        "2",
        "--max-np",
        "8",
        "--host-discovery-script",
        str(tmp_path / "grants" / "train.discover.sh"),
        "--elastic-timeout",
        "60",
        "--reset-limit",
        "0",
        "--gloo-timeout-seconds",
        "30",
        "--verbose",
        PYTHON,
        "-m",
        "herd_operator.agent.shim",
        "--",
        "python",
        "train.py",
    ]


@pytest.mark.parametrize(
    ("hosts", "loopback"),
    [
        (("localhost",), True),
        (("127.0.0.1", "::1", "localhost"), True),
        (("localhost", "nid001"), False),
        (("nid001",), False),
        ((), False),
    ],
)
def test_loopback_interface_only_when_every_host_is_local(
    tmp_path: Path, hosts: tuple[str, ...], loopback: bool
) -> None:
    argv = horovodrun_argv(make_request(make_spec(), tmp_path, hosts=hosts), HOROVODRUN, PYTHON)
    assert (argv[11:13] == ["--network-interface", "lo"]) is loopback
    assert argv.count("--network-interface") == int(loopback)


def test_user_strings_stay_single_arguments(tmp_path: Path) -> None:
    command = ["python", "train.py", "--name", "my run", "--note", 'it\'s "quoted"; rm -rf /']
    spec = make_spec(command=command, horovod={"extraArgs": ["--log-level", "a b;c"]})
    argv = horovodrun_argv(make_request(spec, tmp_path), HOROVODRUN, PYTHON)
    assert argv[-len(command) :] == command
    assert argv[argv.index("--") + 1 :] == command
    assert argv[argv.index("--log-level") + 1] == "a b;c"


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


@pytest.fixture
def use_horovodrun(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    def use(path: Path) -> None:
        monkeypatch.setattr(launcher_module, "horovodrun_executable", lambda: str(path))

    return use


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
    tmp_path: Path, launcher: Launcher, exits: Exits, use_horovodrun: Callable[[Path], None]
) -> None:
    fake = write_script(tmp_path / "horovodrun", f"#!{sys.executable}\n{STUBBORN_HOROVODRUN}")
    use_horovodrun(fake)
    ready = tmp_path / "worker.pid"
    request = make_request(
        make_spec(workingDir=str(tmp_path)), tmp_path, env={"FAKE_READY": str(ready)}
    )
    info = launcher.launch(request)
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
    assert final.exit_code == -15  # horovodrun itself went on SIGTERM
    assert final.launch == info
    assert is_dead(worker_pid)
    assert marked_pids(info.launch_id) == set()
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    assert exits.jobs == ["train"]


@pytest.mark.parametrize("code", [0, 3])
def test_natural_exit(
    tmp_path: Path,
    launcher: Launcher,
    exits: Exits,
    use_horovodrun: Callable[[Path], None],
    code: int,
) -> None:
    fake = write_script(tmp_path / "horovodrun", EXITING_HOROVODRUN)
    use_horovodrun(fake)
    command = ["python", "train.py", "--name", "my run", "it's; rm -rf x"]
    spec = make_spec(command=command, workingDir=str(tmp_path), env={"FAKE_EXIT": str(code)})
    request = make_request(spec, tmp_path, env={"HERD_JOB": "train"})
    info = launcher.launch(request)
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    assert exits.jobs == ["train"]

    state = launcher.state("train")
    assert state == ProcessState(ProcessPhase.EXITED, code, info, stopped_by_us=False)

    header, marker, *args = request.log_file.read_text().splitlines()
    match = re.fullmatch(r"==== \S+ launch ([0-9a-f]{32}): (.*)", header)
    assert match is not None, header
    assert match[1] == info.launch_id
    assert json.loads(match[2]) == horovodrun_argv(request, str(fake), sys.executable)
    assert marker == f"job=train launch={info.launch_id}"
    assert args[-len(command) :] == [f"<{arg}>" for arg in command]

    launcher.forget("train")
    assert launcher.state("train") == ProcessState(ProcessPhase.ABSENT)
    assert launcher.jobs() == []


def test_stop_after_a_natural_exit_is_not_a_stop_by_us(
    tmp_path: Path, launcher: Launcher, exits: Exits, use_horovodrun: Callable[[Path], None]
) -> None:
    use_horovodrun(write_script(tmp_path / "horovodrun", EXITING_HOROVODRUN))
    spec = make_spec(workingDir=str(tmp_path), env={"FAKE_EXIT": "0"})
    info = launcher.launch(make_request(spec, tmp_path))
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    # The controller read RUNNING a moment ago and now decides to stop: the job beat it.
    launcher.stop("train")
    assert launcher.state("train") == ProcessState(ProcessPhase.EXITED, 0, info, False)
