"""Starting a job's process on another host: over ssh, its environment on ssh's stdin.

    ssh [OPTIONS] HOST 'exec PYTHON -I .../env_exec.py -- COMMAND...'   (stdin: env_exec's JSON)

Both engines' drivers start their processes on other hosts this way (the Horovod driver its
workers, the torchrun driver its agents), so what reaches such a process's environment and
what stays off command lines is decided here once: the ssh line holds names and paths only
(`remote_argv`), the environment goes over ssh's encrypted channel (`env_exec` reads it
there), without the batch step's own Slurm variables (`for_another_node`).

Apart from `hvd_workers` because the torchrun driver must not import Horovod; standard
library only.
"""

from __future__ import annotations

import contextlib
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from herd_operator.runtime.engines import env_exec

ENV_EXEC_SCRIPT = str(Path(env_exec.__file__).resolve())
"""Run by its path on the other host (the same path on a shared file system, like the
driver's interpreter): it needs no import path there."""

SLURM_JOB_WIDE = frozenset(
    {
        "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_STEP",
        "SLURM_CLUSTER_NAME", "SLURM_CONF", "SLURM_GPUS_PER_NODE", "SLURM_JOBID",
        "SLURM_JOB_ACCOUNT", "SLURM_JOB_CPUS_PER_NODE", "SLURM_JOB_END_TIME", "SLURM_JOB_GID",
        "SLURM_JOB_ID", "SLURM_JOB_LICENSES", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST",
        "SLURM_JOB_NUM_NODES", "SLURM_JOB_PARTITION", "SLURM_JOB_QOS", "SLURM_JOB_RESERVATION",
        "SLURM_JOB_START_TIME", "SLURM_JOB_UID", "SLURM_JOB_USER", "SLURM_MEM_PER_CPU",
        "SLURM_MEM_PER_NODE", "SLURM_NNODES", "SLURM_NODELIST", "SLURM_SUBMIT_DIR",
        "SLURM_SUBMIT_HOST",
    }
)  # fmt: skip
"""Slurm's variables that say the same on every node of the allocation. The operator (and
each job's driver) runs in the batch script, whose other SLURM_* variables describe the
batch step on the batch node: its name (SLURMD_NODENAME), its GPUs (SLURM_JOB_GPUS,
SLURM_GPUS_ON_NODE), its CPUs, its task (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS: a
library that finds them takes the worker for task 0 of 1) and its step (SLURM_STEP_*)."""


def for_another_node(env: Mapping[str, str]) -> dict[str, str]:
    """A process's environment for a node other than the driver's: without the Slurm
    variables of the batch step (all but `SLURM_JOB_WIDE`), which would be taken there as
    that node's. A process on the driver's node keeps them: they are true of its node."""
    return {
        key: value
        for key, value in env.items()
        if key in SLURM_JOB_WIDE or not key.startswith(("SLURM_", "SLURMD_"))
    }


def remote_argv(
    host: str,
    command: Sequence[str],
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The ssh command that starts `command` on `host` through `env_exec` (the environment
    goes on its stdin): Horovod's ssh options and host, then one remote command string of
    quoted names and paths, no value."""
    argv = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["-i", ssh_identity_file]
    # ssh joins its arguments into one string for the remote shell: quote each part.
    remote = [python, "-I", ENV_EXEC_SCRIPT, "--", *command]
    return [*argv, host, "exec " + " ".join(shlex.quote(part) for part in remote)]


def feed(sink: IO[bytes], data: bytes) -> None:
    """Write `data` and close `sink` (its reader sees the end); a reader that is gone (ssh
    could not connect) is not an error here: its exit status says what happened. Run in a
    thread: a payload larger than the pipe's buffer blocks until ssh reads it, and ssh may
    still be connecting."""
    with contextlib.suppress(OSError), sink:
        sink.write(data)
