"""The Horovod engine: the exact horovodrun command, the grant files its discovery script
reads, what needs a relaunch, and the environment it adds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from herd_operator.controllers.ports import ProcessPhase, ProcessState
from herd_operator.layout import StateLayout
from herd_operator.runtime.dispatch import EngineDispatch, JobLauncher
from herd_operator.runtime.engines import ENGINES, EngineContext
from herd_operator.runtime.engines import horovod as horovod_module
from herd_operator.runtime.engines.horovod import (
    FIXED_AT_LAUNCH_CHANGED,
    GrantPublisher,
    HorovodEngine,
    discovery_lines,
    horovodrun_argv,
    host_aliases,
    local_names,
    local_names_of,
    present,
    relaunch_reason,
)
from herd_operator.runtime.launcher import Launcher
from herd_operator.specs import HerdJob, HerdJobSpec
from herd_operator.specs.values import Placement

# Hang guard for waiting on processes; never a performance expectation.
from tests.unit.test_launcher import GUARD_S, Exits

PYTHON = "/opt/env/bin/python"
HOROVODRUN = "/opt/env/bin/horovodrun"


def make_spec(**fields: Any) -> HerdJobSpec:
    data: dict[str, Any] = {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}}
    data.update(fields)
    return HerdJobSpec.model_validate(data)


def make_job(name: str = "train", **fields: Any) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": make_spec(**fields).model_dump(by_alias=True),
        }
    )


def argv_for(
    spec: HerdJobSpec, tmp_path: Path, *, np: int = 2, hosts: Sequence[str] = ("localhost",)
) -> list[str]:
    script = tmp_path / "grants" / "train.discover.sh"
    return horovodrun_argv(spec, np, script, hosts, HOROVODRUN, PYTHON)


@pytest.fixture
def layout(tmp_path: Path) -> StateLayout:
    layout = StateLayout(tmp_path / "state")
    layout.create()
    return layout


def test_horovod_is_the_registered_default_engine() -> None:
    assert ENGINES[make_spec().engine.kind] is HorovodEngine


def test_events_name_the_process_that_was_started_driver_or_horovodrun(
    layout: StateLayout,
) -> None:
    engine = HorovodEngine(EngineContext(layout, ("localhost",)))
    assert engine.process_name(make_job()) == "hvd-driver"
    assert engine.process_name(make_job(horovod={"launcher": "horovodrun"})) == "horovodrun"


# ---- horovodrun_argv ----


def test_argv_minimal_on_one_local_host(tmp_path: Path) -> None:
    assert argv_for(make_spec(), tmp_path, np=3) == [
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
        "--gloo-timeout-seconds",
        "30",
        "--blacklist-cooldown-range",
        "10",
        "30",
        "--network-interface",
        "lo",
        PYTHON,
        "-m",
        "herd_operator.agent.shim",
        "--",
        "python",
        "train.py",
    ]


HOROVOD_OPTIONS = {
    "elasticTimeoutSeconds": 60,
    "resetLimit": 0,
    "extraArgs": ["--gloo-timeout-seconds", "30", "--verbose"],
}


@pytest.mark.parametrize(
    "spelling",
    [{"horovod": HOROVOD_OPTIONS}, {"engine": {"kind": "horovod", "options": HOROVOD_OPTIONS}}],
    ids=["horovod-field", "engine-options"],
)
def test_argv_with_horovod_options_on_remote_hosts(
    tmp_path: Path, spelling: dict[str, Any]
) -> None:
    spec = make_spec(gpus={"min": 2, "max": 8}, **spelling)
    assert argv_for(spec, tmp_path, np=4, hosts=("nid001", "localhost")) == [
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
        "--blacklist-cooldown-range",
        "10",
        "30",
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
    argv = argv_for(make_spec(), tmp_path, hosts=hosts)
    assert (argv[16:18] == ["--network-interface", "lo"]) is loopback
    assert argv.count("--network-interface") == int(loopback)


def test_user_strings_stay_single_arguments(tmp_path: Path) -> None:
    command = ["python", "train.py", "--name", "my run", "--note", 'it\'s "quoted"; rm -rf /']
    spec = make_spec(command=command, horovod={"extraArgs": ["--log-level", "a b;c"]})
    argv = argv_for(spec, tmp_path)
    assert argv[-len(command) :] == command
    assert argv[argv.index("--") + 1 :] == command
    assert argv[argv.index("--log-level") + 1] == "a b;c"


# ---- grants: the files the discovery script reads ----


def run_discovery(script: Path) -> str:
    done = subprocess.run(
        [str(script)], capture_output=True, text=True, timeout=GUARD_S, check=True
    )
    assert done.stderr == ""
    return done.stdout


def test_discovery_lines_list_hosts_with_slots_in_placement_order() -> None:
    placement = Placement((("n2", (3, 1)), ("n1", ()), ("n0", (0,))))
    assert discovery_lines(placement) == ["n2:2", "n0:1"]
    assert discovery_lines(Placement.EMPTY) == []


def test_a_cooldown_given_in_extra_args_replaces_the_default(tmp_path: Path) -> None:
    spec = make_spec(horovod={"extraArgs": ["--blacklist-cooldown-range", "5", "600"]})
    argv = argv_for(spec, tmp_path)
    assert argv.count("--blacklist-cooldown-range") == 1
    at = argv.index("--blacklist-cooldown-range")
    assert argv[at + 1 : at + 3] == ["5", "600"]


# ---- one host under several names ----

ALIASES = {"n0": ("n0", "127.0.0.1", "10.0.0.5")}


def test_each_gpu_is_shown_under_the_name_its_index_picks() -> None:
    placement = Placement((("n0", (0, 1, 2, 3, 4)), ("n1", (7,))))
    assert present(placement, ALIASES) == {
        "n0": (("n0", 0), ("n0", 3)),
        "127.0.0.1": (("n0", 1), ("n0", 4)),
        "10.0.0.5": (("n0", 2),),
        "n1": (("n1", 7),),
    }
    assert discovery_lines(placement, ALIASES) == ["n0:2", "127.0.0.1:2", "10.0.0.5:1", "n1:1"]


def test_a_gpu_keeps_its_name_and_local_rank_when_others_leave() -> None:
    """Horovod knows a running worker by (host name, local rank): a change elsewhere in the
    placement must not move it to another GPU."""
    before = present(Placement((("n0", (0, 1, 2, 3)),)), ALIASES)
    after = present(Placement((("n0", (0, 1, 3)),)), ALIASES)  # GPU 2 given back
    assert before["n0"] == after["n0"] == (("n0", 0), ("n0", 3))
    assert before["127.0.0.1"] == after["127.0.0.1"] == (("n0", 1),)
    assert "10.0.0.5" not in after


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (("localhost",), {"localhost": ("localhost", "127.0.0.1", "vm")}),
        (("vm",), {"vm": ("vm", "localhost", "127.0.0.1")}),
        # Several nodes: real node names only, so local ranks and placements follow nodes.
        (("vm", "nid001"), {"vm": ("vm",), "nid001": ("nid001",)}),
        (("localhost", "nid001"), {"localhost": ("localhost",), "nid001": ("nid001",)}),
        # Two pool hosts on this machine (a test pool): each keeps its own name only.
        (("localhost", "127.0.0.1"), {"localhost": ("localhost",), "127.0.0.1": ("127.0.0.1",)}),
        (("nid001", "nid002"), {"nid001": ("nid001",), "nid002": ("nid002",)}),
    ],
)
def test_only_a_pool_of_one_local_host_gets_this_machines_other_names(
    hosts: tuple[str, ...], expected: dict[str, tuple[str, ...]]
) -> None:
    assert host_aliases(hosts, ("localhost", "127.0.0.1", "vm")) == expected


def test_local_names_are_those_horovod_runs_without_ssh() -> None:
    names = local_names()
    assert names[:2] == ("localhost", "127.0.0.1")
    # Another loopback address is not an interface address: Horovod would ssh to it.
    assert "127.0.0.2" not in names
    assert len(set(names)) == len(names)


def test_local_names_leave_out_documentation_addresses() -> None:
    """Issue 28.4: this machine's eth0 is 192.0.2.2 (TEST-NET-1); it showed in the aliases,
    so in every job's log (`grant seen: {..., '192.0.2.2': 1}`). Only real names and
    addresses are Horovod's host names; a host name that resolves to such an address is
    still one (a real name)."""
    addresses = ["127.0.0.1", "192.0.2.2", "198.51.100.7", "203.0.113.9", "10.0.0.5"]
    table = {"localhost": "127.0.0.1", "vm": "192.0.2.2"}
    table.update((address, address) for address in addresses)

    def resolve(name: str) -> str:
        if name not in table:
            raise OSError(f"unknown host {name}")
        return table[name]

    assert local_names_of(addresses, "vm", resolve) == ("localhost", "127.0.0.1", "10.0.0.5", "vm")
    assert local_names_of(["127.0.0.1"], "ghost", resolve) == ("localhost", "127.0.0.1")


def test_this_machines_names_hold_no_documentation_address() -> None:
    for name in local_names():
        assert not name.startswith(("192.0.2.", "198.51.100.", "203.0.113.")), local_names()


def test_the_engine_shows_a_lone_local_host_under_its_names(
    layout: StateLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(horovod_module, "local_names", lambda: ("localhost", "127.0.0.1"))
    engine = HorovodEngine(EngineContext(layout, ("localhost",)))
    placement = Placement((("localhost", (0, 1, 2)),))
    engine.publish("a", placement)
    assert run_discovery(engine.grants.discovery_script("a")) == "localhost:2\n127.0.0.1:1\n"
    assert engine.present("a", placement)["127.0.0.1"] == (("localhost", 1),)


def test_discovery_script_path_is_quoted(tmp_path: Path) -> None:
    layout = StateLayout(tmp_path / "state dir; with 'quotes'")
    layout.create()
    publisher = GrantPublisher(layout)
    publisher.publish("a", Placement((("localhost", (0, 1)),)))
    assert run_discovery(publisher.discovery_script("a")) == "localhost:2\n"


def test_engine_publishes_and_withdraws_the_grant_files(layout: StateLayout) -> None:
    engine = HorovodEngine(EngineContext(layout, ("n1", "n2")))
    engine.publish("a", Placement((("n1", (0, 1)), ("n2", (3,)))))
    script = engine.grants.discovery_script("a")
    assert run_discovery(script) == "n1:2\nn2:1\n"
    engine.publish("a", Placement((("n2", (3,)),)))
    assert run_discovery(script) == "n2:1\n"
    engine.withdraw("a")
    assert not layout.grant_file("a").exists()
    assert not layout.discovery_script("a").exists()


# ---- what needs a relaunch ----


@pytest.mark.parametrize(
    "change",
    [
        {"command": ["python", "train_v2.py"]},
        {"workingDir": "/elsewhere"},
        {"env": {"SEED": "1"}},
        {"training": {"batchPolicy": "preserve-batch"}},
        {"gpus": {"min": 2, "max": 4}},
        {"horovod": {"elasticTimeoutSeconds": 30}},
        {"horovod": {"glooTimeoutSeconds": 60}},
        {"horovod": {"growTimeoutSeconds": 60}},
        {"engine": {"options": {"extraArgs": ["--verbose"]}}},
    ],
)
def test_what_horovodrun_fixes_at_launch_needs_a_relaunch(change: dict[str, Any]) -> None:
    assert relaunch_reason(make_spec(), make_spec(**change)) == FIXED_AT_LAUNCH_CHANGED


def test_max_needs_a_relaunch_only_above_the_launched_max_np() -> None:
    launched = make_spec(gpus={"min": 1, "max": 4})
    assert relaunch_reason(launched, make_spec(gpus={"min": 1, "max": 2})) == ""
    assert relaunch_reason(launched, make_spec(gpus={"min": 1, "max": 8})) == (
        "gpus.max raised above the launched --max-np 4"
    )


def test_priority_policy_and_the_other_spelling_of_the_same_options_are_live() -> None:
    launched = make_spec(horovod={"resetLimit": 2})
    assert relaunch_reason(launched, make_spec(horovod={"resetLimit": 2}, priority=5)) == ""
    assert relaunch_reason(launched, make_spec(engine={"options": {"resetLimit": 2}})) == ""
    same = {"horovod": {"resetLimit": 2}}
    assert relaunch_reason(launched, make_spec(policy={"name": "memory"}, **same)) == ""


def test_environment_puts_this_python_first_and_unbuffers_it(layout: StateLayout) -> None:
    engine = HorovodEngine(EngineContext(layout, ("localhost",), python=PYTHON))
    env = engine.environment(make_job(), {"PATH": "/usr/bin"})
    assert env == {"PYTHONUNBUFFERED": "1", "PATH": f"/opt/env/bin{os.pathsep}/usr/bin"}


# ---- through the operator's job launcher, with a fake horovodrun ----

# Prints what it was started with, the environment the engine and operator gave it, the
# spec's env file (for the shim) and the grant its discovery script prints; then exits
# with $FAKE_EXIT.
EXITING_HOROVODRUN = """\
#!/bin/sh
echo "job=$HERD_JOB launch=$HERD_LAUNCH_ID unbuffered=$PYTHONUNBUFFERED seed=$SEED"
echo "path=$PATH"
echo "env file: $(cat "$HERD_ENV_FILE")"
echo "cwd=$(pwd)"
previous=""
for arg in "$@"; do
  if [ "$previous" = "--host-discovery-script" ]; then "$arg"; fi
  previous="$arg"
done
printf '<%s>\\n' "$@"
exit "$FAKE_EXIT"
"""


@pytest.mark.parametrize("code", [0, 3])
def test_job_launcher_starts_horovodrun_with_the_grant_in_place(
    tmp_path: Path,
    layout: StateLayout,
    launcher: Launcher,
    exits: Exits,
    monkeypatch: pytest.MonkeyPatch,
    code: int,
) -> None:
    fake = tmp_path / "horovodrun"
    fake.write_text(EXITING_HOROVODRUN, encoding="utf-8")
    fake.chmod(0o755)
    monkeypatch.setattr(horovod_module, "horovodrun_executable", lambda: str(fake))
    monkeypatch.setattr(horovod_module, "local_names", lambda: ("localhost", "127.0.0.1"))
    engines = EngineDispatch(EngineContext(layout, ("localhost",)))
    operator_env = {"HERD_ALLOCATOR": "127.0.0.1:1", "FAKE_EXIT": str(code)}
    jobs = JobLauncher(launcher, engines, layout, operator_env, bytes(range(32)))
    command = ["python", "train.py", "--name", "my run", "it's; rm -rf x"]
    job = make_job(
        command=command,
        workingDir=str(tmp_path),
        env={"SEED": "7"},
        horovod={"launcher": "horovodrun"},
    )
    # Decided before the start, as the allocator does: the discovery script finds it.
    engines.publish("train", Placement((("localhost", (0, 1)),)))

    info = jobs.start(job, 1, 2)
    assert exits.called.wait(GUARD_S), "on_exit was not called"
    assert (info.command, info.spec, info.generation) == ("horovodrun", job.spec, 1)
    state = jobs.state("train")
    assert state == ProcessState(ProcessPhase.EXITED, code, info, False, ended_at=state.ended_at)

    log_lines = layout.log_file("train").read_text().splitlines()
    header, marker, path, env_file, cwd, grant, alias_grant, *args = log_lines
    match = re.fullmatch(r"==== \S+ launch ([0-9a-f]{32}): (.*)", header)
    assert match is not None, header
    assert match[1] == info.launch_id
    script = layout.discovery_script("train")
    assert json.loads(match[2]) == horovodrun_argv(
        job.spec, 2, script, ("localhost",), str(fake), sys.executable
    )
    # The spec's env is not in horovodrun's environment (Horovod would put it on every
    # worker's command line): the shim loads it from the file.
    assert marker == f"job=train launch={info.launch_id} unbuffered=1 seed="
    assert env_file == 'env file: {"SEED": "7"}'
    assert path.startswith(f"path={Path(sys.executable).parent}{os.pathsep}")
    assert cwd == f"cwd={tmp_path}"
    # The pool's one local host, shown under two of its names (a worker failure costs one).
    assert (grant, alias_grant) == ("localhost:1", "127.0.0.1:1")
    assert args[-len(command) :] == [f"<{arg}>" for arg in command]
    assert jobs.relaunch_reason(info, job) == ""
    moved = make_job(
        command=command,
        workingDir=str(tmp_path),
        env={"FAKE_EXIT": "0"},
        horovod={"launcher": "horovodrun"},
    )
    assert jobs.relaunch_reason(info, moved) == FIXED_AT_LAUNCH_CHANGED
