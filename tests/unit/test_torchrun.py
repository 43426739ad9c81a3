"""The torchrun engine's parts that decide: its options and their errors, the grant file,
the agents' arguments, what needs a relaunch, the driver's plan and exit status; and that
the engine imports and builds its launch without Horovod installed.

The engine end to end (real torchrun agents under a real operator) is
tests/integration/test_torchrun.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import jsonschema
import psutil
import pytest
import yaml

from herd_operator.cli.demo import DEMO_SPECS, place_spec, stage_examples
from herd_operator.cli.main import main
from herd_operator.cli.spec_commands import checked_sources
from herd_operator.environment import (
    worker_host,
    worker_local_rank,
    worker_rank,
    worker_world_size,
)
from herd_operator.layout import StateLayout
from herd_operator.runtime.bindings import BindingTracker
from herd_operator.runtime.engines import EngineContext, engine_problems
from herd_operator.runtime.engines.remote_start import ENV_EXEC_SCRIPT
from herd_operator.runtime.engines.torchrun import (
    DRIVER_MODULE,
    GrantFileError,
    TorchrunEngine,
    agent_args,
    gloo_interface,
    grant_text,
    parse_grant,
    present,
    relaunch_reason,
    slot_host,
    slot_name,
    store_host,
)
from herd_operator.runtime.engines.torchrun_driver import (
    Agents,
    GrantFile,
    failure_summary,
    outcome,
    parse_args,
    plan,
    remote_agent_argv,
    remote_environment,
)
from herd_operator.runtime.engines.torchrun_options import TorchrunOptions, option_problems
from herd_operator.simulate.model import (
    SHRINK_STALL_SECONDS,
    TORCHRUN_GROW_STALL_SECONDS,
    TORCHRUN_SHRINK_STALL_SECONDS,
    JobModel,
)
from herd_operator.specs import HerdJob, load_spec_text
from herd_operator.specs.values import Placement

REPO = Path(__file__).resolve().parents[2]


def document(options: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    engine: dict[str, Any] = {"kind": "torchrun"}
    if options is not None:
        engine["options"] = options
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "a"},
        "spec": {
            "command": ["python", "train.py"],
            "gpus": {"min": 1, "max": 3},
            "engine": engine,
            **spec,
        },
    }


def job(options: dict[str, Any] | None = None, **spec: Any) -> HerdJob:
    return HerdJob.model_validate(document(options, **spec))


# ---- options ----


def test_options_default_to_torchruns_elastic_settings_tuned_for_resizes() -> None:
    options = TorchrunOptions()
    assert (options.max_restarts, options.last_call_seconds, options.keep_alive_seconds) == (
        100,
        3,
        2,
    )
    assert option_problems({}) == []
    assert option_problems({"maxRestarts": 0, "monitorIntervalSeconds": 1}) == []


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (
            {"maxRestarts": -1},
            "spec.engine.options.maxRestarts: must be at least 0, got integer -1",
        ),
        ({"maxRestarts": "3"}, "spec.engine.options.maxRestarts: expected an integer"),
        ({"monitorIntervalSeconds": 0}, "spec.engine.options.monitorIntervalSeconds: must be "),
        ({"keepAliveSeconds": 0}, "spec.engine.options.keepAliveSeconds: must be at least 1"),
        ({"lastCallSeconds": True}, "spec.engine.options.lastCallSeconds: expected an integer"),
        ({"nprocPerNode": 2}, "spec.engine.options.nprocPerNode: unknown field (allowed: maxR"),
        (
            {"extraArgs": ["--log-dir=/tmp/x", "--rdzv-endpoint=h:1"]},
            "spec.engine.options.extraArgs: '--rdzv-endpoint=h:1' is set by the torchrun engine",
        ),
        ({"extraArgs": ["--nnodes", "2"]}, "spec.engine.options.extraArgs: '--nnodes' is set by"),
    ],
)
def test_a_bad_option_is_an_error_naming_its_field(options: dict[str, Any], problem: str) -> None:
    problems = [f"{field}: {what}" for field, what in option_problems(options)]
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_validate_and_the_spec_directory_refuse_bad_options_naming_each_field(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.yaml"
    bad = document({"maxRestarts": -1, "lastCallSeconds": "soon", "bogus": 1})
    path.write_text(yaml.safe_dump(bad), encoding="utf-8")
    _, problems = checked_sources([str(path)], io.StringIO())
    fields = sorted(problem.split(": ")[1] for problem in problems)
    assert fields == [
        "spec.engine.options.bogus",
        "spec.engine.options.lastCallSeconds",
        "spec.engine.options.maxRestarts",
    ], problems
    good = tmp_path / "b.yaml"
    good.write_text(yaml.safe_dump(document({"maxRestarts": 5})), encoding="utf-8")
    assert checked_sources([str(good)], io.StringIO())[1] == []


def test_options_are_checked_for_torchrun_jobs_only() -> None:
    # A horovod job's `engine.options` are its own model's (the spec validates those).
    loaded = load_spec_text(yaml.safe_dump(document({"maxRestarts": 2})), "a.yaml")
    assert loaded.job is not None and engine_problems(loaded.job.spec) == []
    horovod = HerdJob.model_validate(
        {**document(), "spec": {"command": ["x"], "gpus": {"min": 1, "max": 2}}}
    )
    assert engine_problems(horovod.spec) == []


def test_the_readme_torchrun_example_validates() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    example = readme.split("# jobs/digits-torchrun.yaml\n", 1)[1].split("```", 1)[0]
    loaded = load_spec_text(example, "README.md")
    assert loaded.job is not None, loaded.errors
    assert loaded.job.spec.engine.kind == "torchrun"
    assert engine_problems(loaded.job.spec) == []
    assert TorchrunOptions.model_validate(loaded.job.spec.engine.options) == TorchrunOptions()


def test_the_demos_jobs_on_torchrun_are_the_same_jobs_of_the_torchrun_script(
    tmp_path: Path,
) -> None:
    examples = REPO / "examples"
    working = stage_examples(examples, tmp_path / "demo", "torchrun")
    assert (working / "examples" / "train_torchrun.py").is_file()
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    for name in DEMO_SPECS:
        place_spec(name, examples, working, jobs, "torchrun")
        horovod = yaml.safe_load((examples / "specs" / name).read_text())
        loaded = load_spec_text((jobs / name).read_text(), name)
        assert loaded.job is not None, loaded.errors
        spec = loaded.job.spec
        assert spec.engine.kind == "torchrun" and engine_problems(spec) == []
        python, _, *args = horovod["spec"]["command"]
        assert spec.command == [
            python, "examples/train_torchrun.py", *args, "--snapshot", f"{loaded.job.name}.pt",
        ]  # fmt: skip
        assert spec.gpus.model_dump(exclude_defaults=True) == horovod["spec"]["gpus"]


# ---- the grant file and the names ----


def test_each_gpu_is_shown_under_a_name_of_its_own_at_local_rank_0() -> None:
    placement = Placement((("localhost", (0, 2)), ("node-b", (1,))))
    assert present(placement) == {
        "localhost:gpu0": (("localhost", 0),),
        "localhost:gpu2": (("localhost", 2),),
        "node-b:gpu1": (("node-b", 1),),
    }
    tracker = BindingTracker(lambda job, p: present(p), frozenset({"localhost"}))
    slot, named = tracker.where("a", slot_name("localhost", 2), 0, placement, ["a"])
    assert slot == ("localhost", 2) and named == (("localhost", 2),)


def test_the_grant_file_says_every_slot_and_reads_back_the_same() -> None:
    placement = Placement((("localhost", (3, 1)), ("node-b", (0,))))
    text = grant_text(placement)
    assert text == "localhost 3\nlocalhost 1\nnode-b 0\n"
    assert parse_grant(text + "\n") == (("localhost", 3), ("localhost", 1), ("node-b", 0))
    with pytest.raises(GrantFileError, match=r"grant:2: 'node-b x' is not 'HOST GPU'"):
        parse_grant("localhost 0\nnode-b x\n")


def test_the_grant_file_is_read_again_only_when_replaced_and_kept_when_removed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "a.hosts"
    grant = GrantFile(path)
    with pytest.raises(FileNotFoundError):
        grant.slots()
    path.write_text("localhost 0\n")
    assert grant.slots() == (("localhost", 0),)
    replacement = tmp_path / "tmp"
    replacement.write_text("localhost 0\nlocalhost 1\n")
    os.replace(replacement, path)
    assert grant.slots() == (("localhost", 0), ("localhost", 1))
    path.unlink()  # withdrawn: the job is being stopped
    assert grant.slots() == (("localhost", 0), ("localhost", 1))


def test_the_store_listens_on_loopback_for_a_pool_of_this_host() -> None:
    assert store_host(("localhost",), None) == "127.0.0.1"
    assert store_host(("localhost",), "eth0") == "127.0.0.1"
    assert store_host(("node-a", "node-b"), "lo") == "127.0.0.1"  # lo's address


def test_the_store_and_gloo_use_the_operators_interface_on_a_pool_of_several_hosts() -> None:
    lo_address = store_host(("node-a", "node-b"), "lo")
    assert lo_address == "127.0.0.1"
    assert gloo_interface(("node-a", "node-b"), "hsn0") == {"GLOO_SOCKET_IFNAME": "hsn0"}
    assert gloo_interface(("localhost",), "hsn0") == {}, "a pool of this host: Gloo's default"
    assert gloo_interface(("node-a", "node-b"), None) == {}


def test_a_gpus_name_gives_back_its_host() -> None:
    assert slot_host(slot_name("nid001234", 3)) == "nid001234"
    assert slot_host(slot_name("h2", 10)) == "h2"
    assert slot_host("h2") is None
    assert slot_host(":gpu1") is None
    assert slot_host("h2:gpux") is None


# ---- agents on other hosts ----


def test_an_agent_on_another_host_is_started_over_ssh_with_names_and_paths_only() -> None:
    agent = ["/venv/bin/python", "-m", "torch.distributed.run", "--local-addr=h2", "--x=1"]
    argv = remote_agent_argv("h2", agent)
    assert argv[:5] == ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
    assert argv[5] == "h2"
    remote = argv[6].split()
    assert remote[:4] == ["exec", "/venv/bin/python", "-I", ENV_EXEC_SCRIPT]
    # Stopped as a local agent is (SIGTERM) when its ssh session ends.
    assert remote[4:9] == ["--", "setpriv", "--pdeathsig", "TERM", "--"]
    assert remote[9:] == agent


def test_an_agent_on_another_host_gets_the_drivers_environment_less_this_hosts_own() -> None:
    env = {
        "PATH": "/venv/bin:/usr/bin", "HERD_JOB": "a", "GLOO_SOCKET_IFNAME": "eth0",
        "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "h1", "SLURM_PROCID": "0",
        "CUDA_VISIBLE_DEVICES": "0,1", "BASH_FUNC_which%%": "() { :; }", "OLDPWD": "/tmp",
    }  # fmt: skip
    assert remote_environment(env) == {
        "PATH": "/venv/bin:/usr/bin", "HERD_JOB": "a", "GLOO_SOCKET_IFNAME": "eth0",
        "SLURM_JOB_ID": "42",
    }  # fmt: skip


FAKE_SSH = """#!/bin/sh
# ssh HOST OPTIONS... REMOTE: run REMOTE as sshd does (the login shell's -c), here.
for last; do :; done
echo "$@" > "$HERD_TEST_SSH_ARGS"
exec sh -c "$last"
"""

STAND_IN_AGENT = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(),
                  "host": os.environ.get("HERD_WORKER_HOST"),
                  "share": os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE"),
                  "secret": os.environ.get("HERD_TEST_SECRET")}))
"""


def test_the_driver_runs_an_agent_of_another_hosts_slot_through_ssh_with_its_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real processes: `ssh` is a stand-in that runs the remote command string with `sh -c`
    here (what sshd does there); the agent is a stand-in for torchrun that prints what it
    got. Its environment arrives (the slot's name, the driver's variables), in the job's
    directory, and no value is on the ssh line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(FAKE_SSH)
    (bin_dir / "ssh").chmod(0o755)
    (tmp_path / "torch_stand_in.py").write_text(STAND_IN_AGENT)
    secret = "-".join(["not", "on", "a", "command", "line"])
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("HERD_TEST_SSH_ARGS", str(tmp_path / "ssh-args"))
    monkeypatch.setenv("HERD_TEST_SECRET", secret)
    monkeypatch.chdir(tmp_path)
    agents = Agents("10.0.0.1:29400", "10.0.0.1", ["--nnodes=1:2"], frozenset({"h1"}))
    agents.argv = lambda local_addr=None: [  # type: ignore[method-assign]
        sys.executable,
        str(tmp_path / "torch_stand_in.py"),
        f"--local-addr={local_addr}",
    ]
    out = tmp_path / "out"
    with out.open("wb") as sink:
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            agents.start(("h2", 1))
            agents.running[("h2", 1)].popen.wait(60)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    assert agents.reap(0.0) == [(("h2", 1), 0, False)]
    got = json.loads(out.read_text())
    assert got == {
        "argv": ["--local-addr=h2"], "cwd": str(tmp_path), "host": "h2:gpu1", "share": "1",
        "secret": secret,
    }  # fmt: skip
    ssh_line = (tmp_path / "ssh-args").read_text()
    assert ssh_line.startswith("-o PasswordAuthentication=no") and " h2 exec " in ssh_line
    assert secret not in ssh_line


def test_a_local_agent_runs_in_a_session_of_its_own_and_still_stops_on_sigterm() -> None:
    """A bare agent started from a shell has a session of its own, so (CFS autogroup, on by
    default on many kernels) a CPU share of its own: our driver's agents shared the driver's
    session, and so one share, and a grow's new agents took 1-2.5 s longer than bare ones to
    import torch while the old workers trained (docs/benchmarks.md, run 19)."""
    agents = Agents("127.0.0.1:29400", "127.0.0.1", ["--nnodes=1:2"], frozenset({"localhost"}))
    stand_in = [sys.executable, "-c", "import time; time.sleep(600)"]
    agents.argv = lambda local_addr=None: stand_in  # type: ignore[method-assign]
    slot = ("localhost", 0)
    agents.start(slot)
    popen = agents.running[slot].popen
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(popen.pid).cmdline() != stand_in:  # past the pdeathsig wrapper
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert os.getsid(popen.pid) == popen.pid != os.getsid(0)
        agents.stop(slot, time.monotonic())
        popen.wait(60)
        assert agents.reap(time.monotonic()) == [(slot, -15, True)]
    finally:
        popen.kill()
        popen.wait()


# ---- the launch ----


def test_each_agent_is_one_node_of_the_jobs_range_with_its_worker_behind_the_shim() -> None:
    a = job({"maxRestarts": 7, "lastCallSeconds": 1, "extraArgs": ["--log-dir=/tmp/l"]})
    options = TorchrunOptions.model_validate(a.spec.engine.options)
    args = agent_args("a", a.spec, options, "/venv/bin/python")
    assert args[:4] == [
        "--nnodes=1:3",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-id=a",
    ]
    conf = dict(item.split("=") for item in args[4].removeprefix("--rdzv-conf=").split(","))
    assert conf == {
        "is_host": "false",
        "join_timeout": "600",
        "last_call_timeout": "1",
        "keep_alive_interval": "2",
        "keep_alive_max_attempt": "3",
    }
    assert args[5:8] == ["--max-restarts=7", "--monitor-interval=0.5", "--log-dir=/tmp/l"]
    assert args[8:] == [
        "--no-python", "/venv/bin/python", "-m", "herd_operator.agent.shim", "--",
        "python", "train.py",
    ]  # fmt: skip


def test_the_engine_launches_the_driver_with_the_jobs_grant_file(tmp_path: Path) -> None:
    layout = StateLayout(tmp_path / "state")
    engine = TorchrunEngine(EngineContext(layout, ("localhost",), python="/venv/bin/python"))
    argv = engine.launch_argv(job(), 2)
    grant = str(layout.grant_file("a").resolve())
    assert argv[:10] == [
        "/venv/bin/python", "-m", DRIVER_MODULE, "--grant-file", grant,
        "--store-host", "127.0.0.1", "--", "--nnodes=1:3", "--nproc-per-node=1",
    ]  # fmt: skip
    ours, torchrun_args = parse_args(argv[3:])
    assert ours.grant_file == Path(grant) and torchrun_args[0] == "--nnodes=1:3"
    layout.create()
    engine.publish("a", Placement((("localhost", (1, 0)),)))
    assert GrantFile(layout.grant_file("a")).slots() == (("localhost", 1), ("localhost", 0))
    engine.withdraw("a")
    assert not layout.grant_file("a").exists()


def test_what_the_agents_fix_at_launch_needs_a_relaunch_and_the_rest_does_not() -> None:
    launched = job({"maxRestarts": 5}).spec
    same = job({"maxRestarts": 5}, policy={"name": "static", "params": {"gpus": 1}}).spec
    assert relaunch_reason(launched, same) == ""
    lower_max = job({"maxRestarts": 5}, gpus={"min": 1, "max": 2}).spec
    assert relaunch_reason(launched, lower_max) == ""
    higher_max = job({"maxRestarts": 5}, gpus={"min": 1, "max": 4}).spec
    assert relaunch_reason(launched, higher_max) == (
        "gpus.max raised above the launched --nnodes max 3"
    )
    assert "torchrun options" in relaunch_reason(launched, job({"maxRestarts": 6}).spec)
    assert relaunch_reason(launched, job({"maxRestarts": 5}, command=["python", "b.py"]).spec)
    # The same options said with or without their defaults are the same launch.
    assert relaunch_reason(job({}).spec, job({"maxRestarts": 100}).spec) == ""
    # Expected epochs are the operator's to read, not the workers': as under Horovod, a
    # change of them relaunches nothing; a batch field, which the workers read, does.
    assert relaunch_reason(launched, job({"maxRestarts": 5}, training={"epochs": 9}).spec) == ""
    batch = job({"maxRestarts": 5}, training={"batchPolicy": "preserve-batch"}).spec
    assert relaunch_reason(launched, batch)


# ---- the driver's decisions ----

A, B, C = ("localhost", 0), ("localhost", 1), ("localhost", 2)


def test_the_driver_keeps_an_agent_per_granted_slot() -> None:
    assert plan([A, B], set(), set(), set(), False).start == (A, B)
    grown = plan([A, B, C], {A, B}, set(), set(), False)
    assert (grown.start, grown.stop) == ((C,), ())
    shrunk = plan([A, C], {A, B, C}, set(), set(), False)
    assert (shrunk.start, shrunk.stop) == ((), (B,))
    # Not twice: an agent already told to stop, or one that ended by itself under this grant.
    assert plan([A], {A, B}, {B}, set(), False).stop == ()
    assert plan([A, B], {A}, {B}, set(), False).start == ()
    assert plan([A, B], {A}, set(), {B}, False).start == ()
    # Once the workers finished, nothing starts any more.
    assert plan([A, B], {A}, set(), set(), True).start == ()


def test_the_driver_ends_when_no_agent_runs_or_can_start() -> None:
    assert outcome({}, running=True, startable=False) is None
    assert outcome({B: 1}, running=False, startable=True) is None
    assert outcome({A: 0, B: 1}, running=False, startable=False) == 0
    assert outcome({B: 3, A: 1}, running=False, startable=False) == 3
    assert outcome({}, running=False, startable=False) == 1


def test_a_driver_whose_agents_all_failed_says_how_each_ended() -> None:
    # All agents failing their first rendezvous ends the driver (`outcome`); its last line
    # names them (the job's Failed says it, through exit_cause).
    summary = failure_summary({B: 1, A: 1})
    assert summary.startswith("every agent ended and none finished: ")
    assert f"{slot_name(*B)} with status 1, {slot_name(*A)} with status 1" in summary
    assert "joinTimeoutSeconds" in summary
    assert failure_summary({}) == "no agent could be started"


# ---- the workers' side ----


def test_a_worker_reads_its_place_from_horovods_variables_else_torchruns() -> None:
    torchrun = {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "HERD_WORKER_HOST": "h:gpu1"}
    assert (worker_rank(torchrun), worker_local_rank(torchrun), worker_world_size(torchrun)) == (
        2,
        0,
        3,
    )
    assert worker_host(torchrun) == "h:gpu1"
    horovod = {"HOROVOD_RANK": "1", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_SIZE": "4",
               "HOROVOD_HOSTNAME": "127.0.0.1", "RANK": "9"}  # fmt: skip
    assert (worker_rank(horovod), worker_local_rank(horovod), worker_world_size(horovod)) == (
        1,
        1,
        4,
    )
    assert worker_host(horovod) == "127.0.0.1"
    assert worker_host({}) is None and worker_world_size({}) == 1


# ---- without Horovod ----

WITHOUT_HOROVOD = textwrap.dedent(
    """
    import importlib.abc, sys
    class NoHorovod(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "horovod" or name.startswith("horovod."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, NoHorovod())
    from pathlib import Path
    from herd_operator.layout import StateLayout
    from herd_operator.runtime.engines import EngineContext, engine_factory
    from herd_operator.runtime.engines import torchrun_driver
    from herd_operator.runtime.operator import Operator
    from herd_operator.specs import HerdJob
    job = HerdJob.model_validate({
        "apiVersion": "herd/v1alpha1", "kind": "HerdJob", "metadata": {"name": "a"},
        "spec": {"command": ["python", "t.py"], "gpus": {"min": 1, "max": 2},
                 "engine": {"kind": "torchrun"}},
    })
    context = EngineContext(StateLayout(Path(sys.argv[1])), ("localhost",))
    engine = engine_factory("torchrun")(context)
    argv = engine.launch_argv(job, 1)
    assert argv[2] == torchrun_driver.__name__, argv
    try:
        import horovod
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit("horovod was importable")
    print(sorted(name for name in sys.modules if name.split(".")[0] == "horovod"))
    """
)


def test_the_torchrun_engine_and_the_operator_import_without_horovod(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HOROVOD, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# ---- the schema editors use ----


def test_the_schema_checks_torchrun_options_where_they_are_given() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["schema"]) == 0
    schema = json.loads(out.getvalue())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)

    def errors(options: dict[str, Any]) -> list[str]:
        return [e.message for e in validator.iter_errors(document(options))]

    assert errors({"maxRestarts": 5, "lastCallSeconds": 2}) == []
    assert errors({"maxRestarts": -1}) == ["-1 is less than the minimum of 0"]
    assert any("nprocPerNode" in message for message in errors({"nprocPerNode": 2}))
    # A horovod job's options are still Horovod's.
    horovod = document()
    horovod["spec"]["engine"] = {"kind": "horovod", "options": {"maxRestarts": 1}}
    assert any("maxRestarts" in e.message for e in validator.iter_errors(horovod))


# ---- the simulator ----


def test_the_simulators_torchrun_jobs_stall_as_measured_on_every_resize() -> None:
    horovod = JobModel("a", 0.0, 4, 1, 4, 100.0, 2, 0.0, 0.1, 0.1)
    torchrun = dataclasses.replace(horovod, engine="torchrun")
    assert torchrun.stall(2, 4) == TORCHRUN_GROW_STALL_SECONDS
    assert torchrun.stall(4, 2) == TORCHRUN_SHRINK_STALL_SECONDS
    assert horovod.stall(4, 2) == SHRINK_STALL_SECONDS < torchrun.stall(4, 2)
    assert torchrun.stall(0, 2) == horovod.stall(0, 2) and torchrun.stall(2, 2) == 0.0
    with pytest.raises(ValueError, match="engine must be one of horovod, torchrun"):
        dataclasses.replace(horovod, engine="mpi")


def test_simulate_runs_every_job_on_the_engine_asked_for(tmp_path: Path) -> None:
    argv = ["simulate", "perlmutter", "--jobs", "20", "--pool", "8x4", "--policy", "memory"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv, "--engine", "torchrun", "--output", str(tmp_path)]) == 0
    assert "torchrun jobs" in (tmp_path / "summary.md").read_text()


STAND_IN_TORCHRUN_AGENT = """
import os, subprocess, sys
# As torch's agent starts a worker: a session of its own, TORCHELASTIC_RUN_ID set.
worker = subprocess.Popen(
    sys.argv[1:], start_new_session=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "tr"}
)
print(worker.pid, flush=True)
worker.wait()
"""


def test_a_worker_dies_with_its_torchrun_agent_when_only_the_agent_is_killed() -> None:
    """Issue 29: an agent SIGKILLed alone left its worker training on as an orphan (torch
    starts workers in their own session). The shim ties the worker to its agent's life."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    shimmed = [sys.executable, "-m", "herd_operator.agent.shim", "--", *sleeper]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERD_")}  # no operator
    agent = subprocess.Popen(
        [sys.executable, "-c", STAND_IN_TORCHRUN_AGENT, *shimmed], stdout=subprocess.PIPE, env=env
    )
    worker = None
    try:
        assert agent.stdout is not None
        worker = psutil.Process(int(agent.stdout.readline()))
        deadline = time.monotonic() + 60
        while worker.cmdline() != sleeper:  # the shim exec'd the command in its place
            assert time.monotonic() < deadline, worker.cmdline()
            time.sleep(0.01)
        agent.kill()
        agent.wait()
        # Reparented, so not ours to reap: gone or a zombie both mean it died.
        _, alive = psutil.wait_procs([worker], timeout=30)
        assert alive == [] or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        agent.kill()
        agent.wait()
        if worker is not None:
            with contextlib.suppress(psutil.Error):
                worker.kill()
