"""The in-process Horovod driver's parts: grant-file discovery, the local worker launch
(real processes), its arguments, and the engine's argument list for it."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pydantic
import pytest
from horovod.runner.common.util.hosts import SlotInfo
from horovod.runner.elastic.worker import HostUpdateResult

from herd_operator.layout import StateLayout, write_atomically
from herd_operator.runtime.engines import EngineContext
from herd_operator.runtime.engines import horovod as horovod_module
from herd_operator.runtime.engines.forkserver import Zygote, forkable
from herd_operator.runtime.engines.horovod import HorovodEngine, horovodrun_argv
from herd_operator.runtime.engines.hvd_discovery import (
    GrantFileDiscovery,
    GrantFileError,
    MissedUpdateRedelivery,
    parse_grant,
)
from herd_operator.runtime.engines.hvd_driver import parse_driver_args
from herd_operator.runtime.engines.hvd_workers import (
    make_worker_factory,
    run_local_worker,
    worker_environment,
)
from herd_operator.specs.fingerprint import spec_fingerprint
from tests.unit.test_horovod_engine import make_job

PYTHON = sys.executable


def driver_settings(**changes: object) -> SimpleNamespace:
    """The fields of Horovod's settings that `make_worker_factory` reads, as a one-host
    elastic run of one worker sets them, with `changes` applied."""
    fields: dict[str, object] = {
        "output_filename": None,
        "num_proc": 1,
        "max_num_proc": 1,
        "prefix_output_with_timestamp": False,
        "elastic": True,
        "ssh_port": None,
        "ssh_identity_file": None,
        "verbose": 0,
    }
    return SimpleNamespace(**(fields | changes))


def test_grant_lines_are_read_as_horovod_reads_a_discovery_script() -> None:
    text = "localhost:2\n\n127.0.0.1:1\nnode7\n"
    assert parse_grant(text, 3, Path("g")) == {"localhost": 2, "127.0.0.1": 1, "node7": 3}
    with pytest.raises(GrantFileError, match=r"^g:2: slots in 'b:x' must be a whole number"):
        parse_grant("a:1\nb:x\n", 1, Path("g"))
    with pytest.raises(GrantFileError, match=r"^g:1: ':2' has no host name"):
        parse_grant(":2\n", 1, Path("g"))


def test_discovery_follows_the_grant_file_and_keeps_the_last_grant_when_it_is_gone(
    tmp_path: Path,
) -> None:
    grant = tmp_path / "job.grant"
    changes: list[dict[str, int]] = []
    discovery = GrantFileDiscovery(grant, on_change=changes.append)
    with pytest.raises(FileNotFoundError):  # the first read must succeed, as horovodrun's
        discovery.find_available_hosts_and_slots()
    write_atomically(grant, "localhost:2\n")
    assert discovery.find_available_hosts_and_slots() == {"localhost": 2}
    assert discovery.find_available_hosts_and_slots() == {"localhost": 2}
    write_atomically(grant, "localhost:4\n")
    assert discovery.find_available_hosts_and_slots() == {"localhost": 4}
    write_atomically(grant, "localhost:4\n")  # rewritten, same grant: no change reported
    assert discovery.find_available_hosts_and_slots() == {"localhost": 4}
    grant.unlink()
    assert discovery.find_available_hosts_and_slots() == {"localhost": 4}
    assert changes == [{"localhost": 2}, {"localhost": 4}]
    # What Horovod gets is a copy: its changes do not reach the cache.
    discovery.find_available_hosts_and_slots()["localhost"] = 9
    assert discovery.find_available_hosts_and_slots() == {"localhost": 4}


def test_worker_environment_is_horovodruns_command_line_environment() -> None:
    env = {"PATH": "/bin", "BASH_FUNC_f%%": "() { :; }", "CUDA_VISIBLE_DEVICES": "0", "A": "1"}
    merged = worker_environment(
        env, {"HOROVOD_RANK": "3"}, {"HOROVOD_GLOO_RENDEZVOUS_PORT": 1234, "A": "run"}
    )
    assert merged == {
        "PATH": "/bin",
        "A": "run",
        "PYTHONUNBUFFERED": "1",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "1234",
        "HOROVOD_RANK": "3",
    }


def test_a_local_worker_gets_its_environment_off_the_command_line_and_its_output_prefixed(
    tmp_path: Path,
) -> None:
    script = (
        "import os, sys, time\n"
        "sys.stdout.write('one\\ntwo'); sys.stdout.flush(); time.sleep(0.2)\n"
        "on_line = 's3' 'cr3t' in open('/proc/self/cmdline').read()\n"
        "print(' halves', os.environ['SECRET_TOKEN'], on_line)\n"
        "print('oops', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    out, err = io.StringIO(), io.StringIO()
    env = {**os.environ, "SECRET_TOKEN": "s3cr3t"}
    code = run_local_worker([PYTHON, "-c", script], env, 5, [], out, err)
    assert code == 3
    assert out.getvalue() == "[5]<stdout>:one\n[5]<stdout>:two halves s3cr3t False\n"
    assert err.getvalue() == "[5]<stderr>:oops\n"


def test_output_files_per_rank_and_timestamps_as_horovodrun_writes_them(tmp_path: Path) -> None:
    settings = driver_settings(
        output_filename=str(tmp_path / "out"), max_num_proc=12, prefix_output_with_timestamp=True
    )
    command = [PYTHON, "-c", "import sys; print('hi'); print('bad', file=sys.stderr)"]
    create_worker = make_worker_factory(
        settings, dict(os.environ), command, "127.0.0.1", ["lo"], 1, threading.Event()
    )
    slot = SlotInfo(
        "localhost", rank=3, local_rank=0, cross_rank=0, size=4, local_size=1, cross_size=4
    )
    code, _ = create_worker(slot, [])
    assert code == 0
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    stdout = (tmp_path / "out" / "rank.03" / "stdout").read_text()
    assert re.fullmatch(stamp + r"\[3\]<stdout>:hi\n", stdout), stdout
    stderr = (tmp_path / "out" / "rank.03" / "stderr").read_text()
    assert re.fullmatch(stamp + r"\[3\]<stderr>:bad\n", stderr), stderr


def test_verbose_echoes_each_worker_with_horovods_variables_but_no_other_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = driver_settings(num_proc=2, max_num_proc=2, verbose=2)
    env = {"PATH": os.environ["PATH"], "HERD_TEST_SECRET": "s3cr3t value"}
    command = [PYTHON, "-c", "import os; assert os.environ['HERD_TEST_SECRET']"]
    create_worker = make_worker_factory(
        settings, env, command, "127.0.0.1", ["lo"], 4321, threading.Event()
    )
    slot = SlotInfo(
        "localhost", rank=1, local_rank=1, cross_rank=0, size=2, local_size=2, cross_size=1
    )
    code, _ = create_worker(slot, [])
    assert code == 0  # the worker still got the value it was not shown with
    echoed = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("localhost:")
    ]
    assert len(echoed) == 1, echoed
    line = echoed[0]
    for shown in ("HOROVOD_RANK=1", "HOROVOD_SIZE=2", "HOROVOD_GLOO_RENDEZVOUS_PORT=4321"):
        assert shown in line
    assert line.index("HOROVOD_") < line.index(PYTHON)
    assert "s3cr3t" not in line and "HERD_TEST_SECRET=" not in line
    # PATH, HERD_TEST_SECRET and PYTHONUNBUFFERED are counted, not shown
    assert line.endswith("(and 3 more variables, values not shown)"), line


def test_without_verbose_no_worker_command_is_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    settings = driver_settings()
    create_worker = make_worker_factory(
        settings, {"PATH": os.environ["PATH"]}, [PYTHON, "-c", "pass"], "127.0.0.1", ["lo"], 1,
        threading.Event(),
    )  # fmt: skip
    slot = SlotInfo(
        "localhost", rank=0, local_rank=0, cross_rank=0, size=1, local_size=1, cross_size=1
    )
    assert create_worker(slot, [])[0] == 0
    assert "localhost:" not in capsys.readouterr().out


def test_a_worker_killed_by_a_signal_reports_128_plus_the_signal() -> None:
    script = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    code = run_local_worker([PYTHON, "-c", script], dict(os.environ), 0, [], io.StringIO())
    assert code == 128 + signal.SIGKILL


def test_a_stop_event_stops_the_worker_and_its_children(tmp_path: Path) -> None:
    child_pid = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    stop = threading.Event()
    result: list[int] = []
    thread = threading.Thread(
        target=lambda: result.append(
            run_local_worker([PYTHON, "-c", script], dict(os.environ), 0, [stop], io.StringIO())
        )
    )
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not child_pid.exists() or not child_pid.read_text():
            assert time.monotonic() < deadline, "the worker never started its child"
            time.sleep(0.05)
        child = psutil.Process(int(child_pid.read_text()))
        stop.set()
        thread.join(30)
        assert not thread.is_alive()
        assert result == [128 + signal.SIGTERM]
        child.wait(10)  # raises TimeoutExpired if the child outlived the worker
    finally:
        stop.set()
        thread.join(30)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grant-file", "g", "-np", "1"], "usage: "),
        (["--grant-file", "g", "--", "-np", "1", "python", "x.py"], "--min-np is required"),
        (
            ["--grant-file", "g", "--", "-np", "1", "--min-np", "1", "-H", "a:1", "python"],
            "the grant file is the job's hosts",
        ),
        (
            ["--grant-file", "g", "--poll-seconds", "0", "--", "-np", "1", "--min-np", "1", "x"],
            "--poll-seconds must be > 0",
        ),
        (
            ["--grant-file", "g", "--grow-retry-seconds", "0", "--", "-np", "1", "x"],
            "--grow-retry-seconds must be > 0",
        ),
        (
            ["--grant-file", "g", "--grow-timeout-seconds", "-1", "--", "-np", "1", "x"],
            "--grow-timeout-seconds must be > 0",
        ),
    ],
)
def test_bad_driver_arguments_are_refused_with_a_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_driver_args(argv)
    said = str(exited.value.code) + capsys.readouterr().err
    assert message in said
    assert exited.value.code != 0


def test_driver_arguments_are_horovodruns() -> None:
    horovod = ["-np", "2", "--min-np", "1", "--max-np", "4", "--reset-limit", "3"]
    horovod += ["--blacklist-cooldown-range", "10", "30", "--network-interface", "lo"]
    ours, args = parse_driver_args(
        ["--grant-file", "/g", "--", *horovod, "python", "train.py", "--lr", "0.1"]
    )
    assert (ours.grant_file, ours.poll_seconds) == (Path("/g"), 0.05)
    assert (args.num_proc, args.min_num_proc, args.max_num_proc) == (2, 1, 4)
    assert (args.reset_limit, args.cooldown_range, args.nics) == (3, [10, 30], {"lo"})
    assert args.command == ["python", "train.py", "--lr", "0.1"]


def test_the_engine_starts_the_driver_by_default_with_horovodruns_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(horovod_module, "local_names", lambda: ("localhost",))
    layout = StateLayout(tmp_path / "state")
    layout.create()
    engine = HorovodEngine(EngineContext(layout, ("localhost",), python=PYTHON))
    job = make_job(horovod={"resetLimit": 2})
    argv = engine.launch_argv(job, 2)
    grant = layout.grant_file("train").resolve()
    bare = horovodrun_argv(job.spec, 2, None, ("localhost",), "horovodrun", PYTHON)
    assert argv[:5] == [PYTHON, "-m", horovod_module.DRIVER_MODULE, "--grant-file", str(grant)]
    assert argv[5:7] == ["--grow-timeout-seconds", "120"]  # the spec's growTimeoutSeconds
    assert argv[7:] == ["--", *bare[1:]]
    assert "--host-discovery-script" not in argv
    assert not layout.discovery_script("train").exists()  # no script: nothing runs it
    fallback = engine.launch_argv(make_job(horovod={"launcher": "horovodrun"}), 2)
    assert "--host-discovery-script" in fallback
    preloaded = engine.launch_argv(make_job(horovod={"preload": ["torch", "horovod.torch"]}), 2)
    assert preloaded[7:9] == ["--preload", "torch,horovod.torch"]
    assert parse_driver_args(preloaded[3:])[0].grow_timeout_seconds == 120
    assert parse_driver_args(preloaded[3:])[0].preload == ["torch", "horovod.torch"]


def test_preload_takes_module_names_only_in_the_spec_and_the_driver() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"'torch; rm' is not a module name"):
        make_job(horovod={"preload": ["torch; rm"]})
    with pytest.raises(SystemExit):
        parse_driver_args(["--grant-file", "/g", "--preload", "a..b", "--", "-np", "1", "x"])
    # A spec without it keeps its fingerprint (and generation): no relaunch on upgrade.
    assert spec_fingerprint(make_job(horovod={"preload": []})) == spec_fingerprint(make_job())
    assert spec_fingerprint(make_job(horovod={"preload": ["torch"]})) != spec_fingerprint(
        make_job()
    )


def test_given_interfaces_are_used_as_given_even_when_the_first_hosts_are_all_local() -> None:
    # Horovod's own choice looks for 127.0.0.1 on `eth0` here and raises; workers of nodes
    # the job grows onto later need the rendezvous on the given interface.
    from horovod.runner.elastic.settings import ElasticSettings

    from herd_operator.runtime.engines.hvd_driver import job_interfaces

    settings = ElasticSettings(
        discovery=None, min_num_proc=1, max_num_proc=4, elastic_timeout=600,
        reset_limit=None, cooldown_range=None, nics={"eth0", "ib0"},
    )  # fmt: skip
    assert job_interfaces(settings, ["localhost"]) == ["eth0", "ib0"]


PARENT = """
import shutil, subprocess, sys
if sys.argv[1] == "fallback":
    shutil.which = lambda name: None
from herd_operator.runtime.engines.parent_death import dies_with_parent
child = subprocess.Popen(dies_with_parent(sys.argv[2:]))
print(child.pid, flush=True)
child.wait()
"""


@pytest.mark.parametrize("setpriv", [True, False], ids=["setpriv", "python-fallback"])
def test_a_child_started_to_die_with_its_parent_gets_sigterm_when_the_parent_is_killed(
    setpriv: bool,
) -> None:
    sleeper = [PYTHON, "-c", "import time; time.sleep(600)"]
    mode = "setpriv" if setpriv else "fallback"
    parent = subprocess.Popen([PYTHON, "-c", PARENT, mode, *sleeper], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        deadline = time.monotonic() + 30
        while child.cmdline() != sleeper:  # exec'd in place: the pid is the worker's
            assert time.monotonic() < deadline, child.cmdline()
            time.sleep(0.01)
        parent.kill()
        parent.wait()
        # Reparented, so not ours to reap: gone or a zombie both mean it died.
        _, alive = psutil.wait_procs([child], timeout=30)
        assert alive == [] or child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        with contextlib.suppress(psutil.Error, UnboundLocalError):
            child.kill()


# ---- the zygote ----


def test_only_a_script_run_by_this_python_is_forked_shim_or_not(tmp_path: Path) -> None:
    env = {"PATH": str(Path(PYTHON).parent)}
    name = Path(PYTHON).name
    assert forkable([name, "train.py", "--lr", "1"], env) == (["train.py", "--lr", "1"], False)
    shimmed = [PYTHON, "-m", "herd_operator.agent.shim", "--", name, "train.py"]
    assert forkable(shimmed, env) == (["train.py"], True)
    assert forkable([name, "-m", "train"], env) is None  # interpreter options: started as is
    assert forkable([name, "-u", "train.py"], env) is None
    assert forkable(["bash", "train.sh"], env) is None
    other = tmp_path / "python"  # same binary, another environment: not ours
    other.symlink_to(os.path.realpath(PYTHON))
    assert forkable([str(other), "train.py"], env) is None


SCRIPT = """
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd() == sys.argv[1], "path0", sys.path[0], flush=True)
print("rank", os.environ["HOROVOD_RANK"], os.getenv("ZYGOTE_ONLY"), __name__, flush=True)
print("to stderr", file=sys.stderr, flush=True)
if sys.argv[2] == "sleep":
    import time
    time.sleep(600)
sys.exit(int(sys.argv[2]))
"""


def test_a_forked_worker_runs_its_script_as_python_would_and_reports_its_status(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="herd.hvd_driver")
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    zygote = Zygote([], {**os.environ, "ZYGOTE_ONLY": "x"})
    try:
        env = {**os.environ, "HOROVOD_RANK": "3"}
        out, err = io.StringIO(), io.StringIO()
        argv = [PYTHON, str(script), str(tmp_path), "7"]
        code = run_local_worker(argv, env, 3, [], out, err, zygote=zygote)
        assert code == 7
        assert out.getvalue().splitlines() == [
            f"[3]<stdout>:argv ['{tmp_path}', '7'] cwd False path0 {script.parent}",
            "[3]<stdout>:rank 3 None __main__",  # the worker's environment, not the zygote's
        ]
        assert err.getvalue() == "[3]<stderr>:to stderr\n"
        stop = threading.Event()
        threading.Timer(1.0, stop.set).start()
        argv = [PYTHON, str(script), str(tmp_path), "sleep"]
        # Stopped as a started worker is: SIGTERM, reported as horovodrun reports it.
        assert run_local_worker(argv, env, 0, [stop], out, err, zygote=zygote) == 128 + 15
        forked = [r.getMessage() for r in caplog.records if "forked by the zygote" in r.message]
        assert len(forked) == 2, caplog.text  # neither started the usual way
    finally:
        zygote.close()
        assert zygote.process.wait(30) == 0


class FakeElasticDriver:
    """The parts of Horovod's ElasticDriver that `MissedUpdateRedelivery` touches."""

    def __init__(self, slots: int, running_on: dict[str, list[int]]) -> None:
        self.slots = slots
        self.host_assignments = running_on
        self._min_num_proc = 1
        self._shutdown = threading.Event()
        self._wait_hosts_cond = threading.Condition()
        self._host_manager = SimpleNamespace(
            current_hosts=SimpleNamespace(count_available_slots=lambda: self.slots)
        )
        self.coordinator: object | None = None
        self.notices: list[HostUpdateResult] = []

    def _get_host_assignments(self, hosts: object) -> tuple[dict[str, list[int]], int]:
        return {"localhost": list(range(self.slots))}, self.slots

    def get_coordinator_info(self) -> object | None:
        return self.coordinator

    def get_worker_client(self, coordinator: object) -> object:
        return coordinator

    def _notify_workers_host_changes(self, hosts: object, update: HostUpdateResult) -> None:
        if self.coordinator is not None:
            self.notices.append(update)


@pytest.mark.parametrize(
    ("slots_at_redelivery", "delivered"),
    [(2, []), (4, [HostUpdateResult.added])],
    ids=["grant-unchanged-since-start", "grant-changed-while-starting"],
)
def test_a_notice_dropped_at_start_is_delivered_only_if_the_hosts_still_call_for_it(
    slots_at_redelivery: int, delivered: list[HostUpdateResult]
) -> None:
    driver = FakeElasticDriver(slots=2, running_on={})
    redelivery = MissedUpdateRedelivery(driver, period=0.05)
    # Horovod's first discovery: no coordinator yet, so the notice is dropped.
    driver._notify_workers_host_changes(driver._host_manager.current_hosts, HostUpdateResult.added)
    # The first workers start on 2 slots and a coordinator registers.
    driver.host_assignments = {"localhost": [0, 1]}
    driver.coordinator = object()
    driver.slots = slots_at_redelivery
    seen = redelivery.poll(seen_client=False)  # seen for the first time: not yet
    assert seen and driver.notices == []
    redelivery.poll(seen_client=True)
    assert driver.notices == delivered
    redelivery.poll(seen_client=True)  # delivered or found stale: never again
    assert driver.notices == delivered


def test_a_notice_the_coordinator_lost_while_resetting_is_told_again_until_acted_on() -> None:
    # Horovod's State.on_reset empties the worker's queue of host messages: a notice that
    # lands between the driver's answer to the worker's rendezvous and the end of its reset
    # is never acted on (a grow given up and offered again as its worker ended, under load).
    now = [100.0]
    driver = FakeElasticDriver(slots=1, running_on={"localhost": [0]})
    driver.coordinator = object()
    redelivery = MissedUpdateRedelivery(
        driver, period=0.05, redeliver_seconds=5.0, clock=lambda: now[0]
    )
    driver.slots = 2
    driver._notify_workers_host_changes(driver._host_manager.current_hosts, HostUpdateResult.added)
    assert driver.notices == [HostUpdateResult.added]  # sent, then lost in the worker
    now[0] += 4.9
    redelivery.poll(seen_client=True)
    assert driver.notices == [HostUpdateResult.added]  # not yet: the worker may still act
    now[0] += 0.1
    redelivery.poll(seen_client=True)
    assert driver.notices == [HostUpdateResult.added] * 2
    now[0] += 5.0
    redelivery.poll(seen_client=True)  # still not acted on: told again
    assert driver.notices == [HostUpdateResult.added] * 3
    driver.host_assignments = {"localhost": [0, 1]}  # the workers reset onto both slots
    for _ in range(3):
        now[0] += 5.0
        redelivery.poll(seen_client=True)
    assert driver.notices == [HostUpdateResult.added] * 3


def test_a_notice_acted_on_is_never_told_again() -> None:
    now = [0.0]
    driver = FakeElasticDriver(slots=1, running_on={"localhost": [0]})
    driver.coordinator = object()
    redelivery = MissedUpdateRedelivery(
        driver, period=0.05, redeliver_seconds=5.0, clock=lambda: now[0]
    )
    driver.slots = 2
    driver._notify_workers_host_changes(driver._host_manager.current_hosts, HostUpdateResult.added)
    driver.host_assignments = {"localhost": [0, 1]}  # acted on within the delay
    for _ in range(3):
        now[0] += 5.0
        redelivery.poll(seen_client=True)
    assert driver.notices == [HostUpdateResult.added]
