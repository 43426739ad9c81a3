"""The jobs' processes as the process table shows them, found by what they carry.

Every process of a launch carries `HERD_LAUNCH_ID` (and the state dir, `HERD_STATE_DIR`) in
its environment, whichever session it runs in and whoever started it: a previous
operator, a keeper, Horovod's own worker launch. So a launch's processes, an adopted
launch's pid, and the orphans of a launch that nobody adopted are all found by one pass
over the process table.

Apart from the launcher (`launcher.py`), which supervises the launches of this operator:
the operator's start-up also scans the table for every launch (`job_processes`,
`find_orphans`, `stop_orphans`), whether the launcher knows it or not.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

import psutil

from herd_operator.environment import (
    GPU_ENV,
    JOB_ENV,
    LAUNCH_ID_ENV,
    STATE_DIR_ENV,
    WORKER_HOST_ENV,
)


@dataclass(frozen=True)
class Orphan:
    job: str
    launch_id: str
    pids: tuple[int, ...]


@dataclass(frozen=True)
class JobProcess:
    """A live process of a job launched for some state dir, as its environment says."""

    pid: int
    job: str
    launch_id: str
    env: Mapping[str, str]
    """The few variables that say where it stands (see `_KEPT_ENV`)."""


_KEPT_ENV = (GPU_ENV, WORKER_HOST_ENV, "HOROVOD_HOSTNAME", "HOROVOD_LOCAL_RANK", "LOCAL_RANK")


def job_processes(state_dir: Path) -> list[JobProcess]:
    """Every live process of the jobs launched for `state_dir`, by any operator.

    They carry the state dir and a launch id in their environment (one pass over the
    process table: it costs ~1 ms per 100 processes).
    """
    wanted = str(state_dir.resolve())
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
            if env.get(STATE_DIR_ENV) != wanted or not env.get(LAUNCH_ID_ENV):
                continue
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
        except psutil.Error:
            continue
        kept = {name: env[name] for name in _KEPT_ENV if name in env}
        found.append(JobProcess(proc.pid, env.get(JOB_ENV, "?"), env[LAUNCH_ID_ENV], kept))
    return found


def find_orphans(processes: Sequence[JobProcess], adopted: Set[str] = frozenset()) -> list[Orphan]:
    """The processes of launches nobody adopted (`adopted`: launch ids), grouped by launch.

    Left alone, they would train on beside the jobs this operator starts, on the same GPUs.
    """
    found: dict[tuple[str, str], list[int]] = {}
    for proc in processes:
        if proc.launch_id not in adopted:
            found.setdefault((proc.job, proc.launch_id), []).append(proc.pid)
    return [
        Orphan(job, launch, tuple(sorted(pids))) for (job, launch), pids in sorted(found.items())
    ]


def stop_orphans(orphans: Sequence[Orphan], grace_seconds: float) -> None:
    """SIGTERM every orphan process, SIGKILL what outlives the grace period."""
    procs = []
    for orphan in orphans:
        for pid in orphan.pids:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                proc.terminate()
                procs.append(proc)
    _, alive = psutil.wait_procs(procs, timeout=grace_seconds)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


def same_process(pid: int, launch_id: str) -> bool:
    """Whether `pid` is still the live process of that launch (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        return (
            proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(LAUNCH_ID_ENV) == launch_id
        )
    except psutil.Error:
        return False


def descendants(pid: int) -> set[int]:
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def marked_processes(launch_id: str) -> list[psutil.Process]:
    """The live processes that carry `launch_id` (this one excepted)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(LAUNCH_ID_ENV) == launch_id and (
                proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def alive(pid: int) -> bool:
    """Whether `pid` is a live process here (not a zombie). Any pid a job said is taken:
    one that is no process (0, negative, too large) is simply not alive."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, ValueError, OverflowError, OSError):
        return False


def started_since(pid: int, since: float) -> bool:
    """Whether `pid` runs and started at or after `since` (psutil's start time counts from
    the boot time in whole seconds: a second of slack each way)."""
    try:
        process = psutil.Process(pid)
        return process.status() != psutil.STATUS_ZOMBIE and process.create_time() >= since - 2.0
    except (psutil.Error, ValueError, OverflowError, OSError):
        return False


def agent_names(state_dir: Path, job: str) -> frozenset[str]:
    """The names (`HERD_WORKER_HOST`) of `job`'s GPUs on this host that a live process of
    the job stands for without being the GPU's worker (it carries no `HERD_GPU`, which the
    shim sets before it execs the worker): the torchrun engine's agents, and a shim not yet
    bound. The Horovod engine's processes carry no such name."""
    return frozenset(
        proc.env[WORKER_HOST_ENV]
        for proc in job_processes(state_dir)
        if proc.job == job and WORKER_HOST_ENV in proc.env and GPU_ENV not in proc.env
    )


def is_process_of_job(job: str, pid: int) -> bool:
    """Whether `pid` is a live process here that belongs to `job`: it carries the job's
    name in `HERD_JOB`, as everything the operator starts for a job does (the workers, the
    zygote, the forked workers: a fork's /proc environ is its zygote's). A process this user
    cannot read, or a pid that is no process, is not the job's. Read from /proc directly:
    every worker's bind asks, and psutil's Process costs a second read."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as environ:
            variables = environ.read()
    except (OSError, ValueError, OverflowError):
        return False
    return f"\0{JOB_ENV}={job}\0".encode() in b"\0" + variables
