"""A remote worker's start: the ssh line the driver builds carries names and paths only,
and `env_exec` (real processes) gives the worker the environment read from its stdin.

No sshd here: sshd runs the remote command string with the user's shell (`sh -c STRING`),
which is what these tests run; tests/integration/test_multinode.py goes through ssh."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from horovod.runner.common.util.hosts import SlotInfo

from herd_operator.runtime.engines import env_exec
from herd_operator.runtime.engines.hvd_workers import make_worker_factory, run_local_worker
from herd_operator.runtime.engines.remote_start import ENV_EXEC_SCRIPT, remote_argv
from tests.unit.test_hvd_driver import driver_settings

PYTHON = sys.executable
SECRET = "s3cr3t-" + "value"
"""Split in the source so that this file's own command line never holds it."""
GUARD_S = 60.0
"""Hang guard for a process; never a performance expectation."""

SHOWS_ITSELF = (
    "import os, sys\n"
    "cmdline = open('/proc/self/cmdline').read()\n"
    "print(os.environ['HERD_TEST_SECRET'], os.environ.get('HOROVOD_RANK'), os.getcwd())\n"
    "print('on its command line:', os.environ['HERD_TEST_SECRET'] in cmdline)\n"
    "print('stdin:', repr(sys.stdin.read()))\n"
)


def test_the_ssh_line_holds_no_value_and_the_worker_gets_them_all(tmp_path: Path) -> None:
    env = {"HERD_TEST_SECRET": SECRET, "HOROVOD_RANK": "7", "PATH": os.environ["PATH"]}
    argv = remote_argv("h2", [PYTHON, "-c", SHOWS_ITSELF], 2222, "/keys/id")
    assert argv[:9] == [
        "ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no",
        "-p", "2222", "-i", "/keys/id",
    ]  # fmt: skip
    assert argv[9] == "h2" and len(argv) == 11
    assert not any(SECRET in part or "HOROVOD_RANK=" in part for part in argv)

    # What sshd does with the remote command string: the login shell runs it.
    out, err = io.StringIO(), io.StringIO()
    code = run_local_worker(
        ["sh", "-c", argv[-1]],
        os.environ,
        7,
        [],
        out,
        err,
        stdin_data=env_exec.encode_payload(env, str(tmp_path)),
    )

    assert (code, err.getvalue()) == (0, "")
    assert out.getvalue() == (
        f"[7]<stdout>:{SECRET} 7 {tmp_path}\n"
        "[7]<stdout>:on its command line: False\n"
        "[7]<stdout>:stdin: ''\n"
    )


def env_exec_run(payload: bytes, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-I", ENV_EXEC_SCRIPT, "--", *command],
        input=payload.decode(errors="surrogateescape"),
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )


RUNS = [PYTHON, "-c", "print('ran')"]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"", "stdin is not a JSON object"),
        (b"[1]", "stdin is not a JSON object: a list"),
        (b'{"env": {}, "shell": "x"}', "unknown field 'shell' on stdin (allowed: cwd, env)"),
        (b'{"cwd": "/"}', "'env' is missing or not an object of name: value strings"),
        (b'{"env": {"A=B": "1"}}', "env: 'A=B' is not a variable name (non-empty, no '=' or NUL)"),
        (b'{"env": {"": "1"}}', "env: '' is not a variable name"),
        (b'{"env": {"A": 1}}', "env: the value of A must be a string without NUL"),
        (b'{"env": {"A": "x\\u0000y"}}', "env: the value of A must be a string without NUL"),
        (b'{"env": {}, "cwd": 3}', "'cwd' must be a non-empty string without NUL"),
        (
            json.dumps({"env": {"A": "x" * env_exec.MAX_PAYLOAD_BYTES}}).encode(),
            f"the environment on stdin is over {env_exec.MAX_PAYLOAD_BYTES} bytes",
        ),
    ],
)
def test_a_bad_payload_is_refused_naming_what_is_wrong_and_nothing_runs(
    payload: bytes, message: str
) -> None:
    done = env_exec_run(payload, *RUNS)
    assert done.returncode == env_exec.FAILED
    assert done.stdout == ""
    assert done.stderr.startswith(f"herd env-exec: {message}"), done.stderr


def test_a_directory_that_is_not_there_is_said_and_the_worker_runs_on(tmp_path: Path) -> None:
    """As Horovod's `cd DIR > /dev/null 2>&1 ; ...` does, but said in the job's log."""
    missing = tmp_path / "gone"
    done = env_exec_run(env_exec.encode_payload({}, str(missing)), *RUNS)
    assert (done.returncode, done.stdout) == (0, "ran\n")
    assert "herd env-exec: staying in" in done.stderr and str(missing) in done.stderr


def test_a_command_that_cannot_run_ends_127_as_in_a_shell(tmp_path: Path) -> None:
    done = env_exec_run(env_exec.encode_payload({}, str(tmp_path)), str(tmp_path / "nothing"))
    assert done.returncode == env_exec.CANNOT_RUN
    assert done.stderr.startswith(f"herd env-exec: cannot run '{tmp_path / 'nothing'}'")


def test_the_variables_are_added_to_the_login_environment_and_win_over_it() -> None:
    """As `env K=V COMMAND`: the login's PATH or HOME stay unless the driver sends its own."""
    show = "import os; print(os.environ['FROM_LOGIN'], os.environ['BOTH'])"
    done = subprocess.run(
        [PYTHON, "-I", ENV_EXEC_SCRIPT, "--", PYTHON, "-c", show],
        input=env_exec.encode_payload({"BOTH": "sent"}, "/").decode(),
        env={**os.environ, "FROM_LOGIN": "login", "BOTH": "login"},
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert (done.returncode, done.stdout) == (0, "login sent\n"), done.stderr


def test_the_driver_starts_a_worker_of_another_host_through_ssh_with_output_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's path for a slot on another host, up to ssh: an `ssh` on PATH that does
    what sshd does with the remote string (the real one: tests/integration/test_multinode.py)
    and records its own arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    seen = tmp_path / "ssh-argv"
    ssh = bin_dir / "ssh"
    ssh.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$SEEN"\nfor last; do :; done\nexec sh -c "$last"\n'
    )
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SEEN", str(seen))
    settings = driver_settings(output_filename=str(tmp_path / "out"), num_proc=2, max_num_proc=2)
    show = "import os; print(os.environ['HERD_TEST_SECRET'], os.environ['HOROVOD_HOSTNAME'])"
    create_worker = make_worker_factory(
        settings,
        {**os.environ, "HERD_TEST_SECRET": SECRET},
        [PYTHON, "-c", show],
        "127.0.0.1",
        ["lo"],
        1,
        threading.Event(),
    )
    # An address of TEST-NET-1: never one of this machine's.
    slot = SlotInfo(
        "192.0.2.7", rank=1, local_rank=0, cross_rank=1, size=2, local_size=1, cross_size=2
    )

    code, _ = create_worker(slot, [])

    assert code == 0
    assert (tmp_path / "out" / "rank.1" / "stdout").read_text() == (
        f"[1]<stdout>:{SECRET} 192.0.2.7\n"
    )
    ssh_argv = seen.read_text().splitlines()
    assert "192.0.2.7" in ssh_argv and not any(SECRET in part for part in ssh_argv)


BATCH_STEP_SLURM = {
    "SLURM_JOB_ID": "4567890",
    "SLURM_JOB_NODELIST": "nid[001-002]",
    "SLURM_GPUS_PER_NODE": "4",
    "SLURMD_NODENAME": "nid001",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_JOB_GPUS": "0,1,2,3",
    "SLURM_GPUS_ON_NODE": "4",
    "SLURM_CPUS_ON_NODE": "128",
    "SLURM_TOPOLOGY_ADDR": "nid001",
}
"""What the batch script (where the operator and each job's driver run) has on nid001."""


@pytest.mark.parametrize(("host", "remote"), [("192.0.2.7", True), ("127.0.0.1", False)])
def test_the_batch_nodes_slurm_variables_stay_off_workers_of_other_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host: str, remote: bool
) -> None:
    """A worker on another node got the batch node's name, GPUs, CPUs and task ids as its
    own (SLURMD_NODENAME=nid001 on nid002); it keeps the allocation's job-wide variables.
    A worker on the driver's node keeps them all: they are true of its node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text('#!/bin/sh\nfor last; do :; done\nexec sh -c "$last"\n')
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    for name in list(os.environ):  # the test's own environment plays the other node's login
        if name.startswith(("SLURM_", "SLURMD_")):
            monkeypatch.delenv(name)
    settings = driver_settings(output_filename=str(tmp_path / "out"), num_proc=2, max_num_proc=2)
    show = (
        "import json, os; print(json.dumps({k: v for k, v in os.environ.items()"
        " if k.startswith(('SLURM_', 'SLURMD_'))}))"
    )
    create_worker = make_worker_factory(
        settings,
        {**os.environ, **BATCH_STEP_SLURM},
        [PYTHON, "-c", show],
        "127.0.0.1",
        ["lo"],
        1,
        threading.Event(),
    )
    slot = SlotInfo(host, rank=1, local_rank=0, cross_rank=1, size=2, local_size=1, cross_size=2)

    code, _ = create_worker(slot, [])

    assert code == 0
    line = (tmp_path / "out" / "rank.1" / "stdout").read_text().partition(":")[2]
    seen = json.loads(line)
    if remote:
        assert seen == {
            "SLURM_JOB_ID": "4567890",
            "SLURM_JOB_NODELIST": "nid[001-002]",
            "SLURM_GPUS_PER_NODE": "4",
        }
    else:
        assert seen == BATCH_STEP_SLURM
