"""Starts and stops job processes: the side effects at the edge, the same for every engine.

Each job runs as one process (its engine says which: `horovodrun` for Horovod) in a
session of its own, with stdout and stderr appended to a per-job log file. Engines
like Horovod start each worker in a new session of its own too, so a job's processes
are found by the environment marker `HERD_LAUNCH_ID` that every one of them inherits,
as well as by descent, and stopping a job makes sure that none of them is left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from controllers.ports import LaunchInfo, ProcessPhase, ProcessState
from herd_operator.environment import JOB_ENV, LAUNCH_ID_ENV, STATE_DIR_ENV
from specs import HerdJobSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchRequest:
    job: str
    generation: int
    argv: Sequence[str]
    """The argument list to run (never a shell string)."""
    log_file: Path
    command: str
    """What the process is called in messages (`LaunchInfo.command`)."""
    spec: HerdJobSpec
    """The spec it runs, given back in `LaunchInfo.spec`."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Set on top of the operator's environment; the launch id marker is added."""
    working_dir: str | None = None
    """Where it runs (default: the operator's working directory)."""


@dataclass
class _Process:
    info: LaunchInfo
    popen: subprocess.Popen[bytes]
    known_pids: set[int] = field(default_factory=set)
    stop_requested: bool = False
    exit_code: int | None = None
    escalation: threading.Timer | None = None


class Launcher:
    def __init__(
        self,
        on_exit: Callable[[str], None] = lambda job: None,
        *,
        grace_seconds: float = 10.0,
    ) -> None:
        self._on_exit = on_exit
        self.grace_seconds = grace_seconds
        self._lock = threading.Lock()
        self._processes: dict[str, _Process] = {}

    def launch(self, request: LaunchRequest) -> LaunchInfo:
        with self._lock:
            if request.job in self._processes:
                raise RuntimeError(f"job {request.job} already has a process")
        launch_id = uuid.uuid4().hex
        argv = list(request.argv)
        env = dict(os.environ)
        env.update(request.env)
        env[LAUNCH_ID_ENV] = launch_id
        workdir = request.working_dir or os.getcwd()
        request.log_file.parent.mkdir(parents=True, exist_ok=True)
        # 0600: a job's output is its owner's (a log may print its env or data paths).
        log_fd = os.open(
            request.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        with open(log_fd, "ab") as log_handle:
            header = f"==== {time.strftime('%Y-%m-%dT%H:%M:%S%z')} launch {launch_id}: "
            log_handle.write((header + json.dumps(argv) + "\n").encode())
            log_handle.flush()
            popen = subprocess.Popen(
                argv,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        info = LaunchInfo(
            launch_id=launch_id,
            pid=popen.pid,
            started_at=time.time(),
            generation=request.generation,
            command=request.command,
            spec=request.spec,
        )
        process = _Process(info, popen, {popen.pid})
        with self._lock:
            self._processes[request.job] = process
        threading.Thread(
            target=self._wait, args=(request.job, process), name=f"wait-{request.job}", daemon=True
        ).start()
        return info

    def _wait(self, job: str, process: _Process) -> None:
        code = process.popen.wait()
        with self._lock:
            process.exit_code = code
        self._on_exit(job)

    def state(self, job: str) -> ProcessState:
        with self._lock:
            process = self._processes.get(job)
        if process is None:
            return ProcessState(ProcessPhase.ABSENT)
        stopped_by_us = process.stop_requested
        if process.exit_code is None:
            phase = ProcessPhase.STOPPING if stopped_by_us else ProcessPhase.RUNNING
            return ProcessState(phase, launch=process.info, stopped_by_us=stopped_by_us)
        # The launched process is gone; its workers may still be on their way out.
        if self._leftovers(process):
            self._clean_up(job, process)
            return ProcessState(
                ProcessPhase.STOPPING, process.exit_code, process.info, stopped_by_us
            )
        return ProcessState(ProcessPhase.EXITED, process.exit_code, process.info, stopped_by_us)

    def stop(self, job: str) -> None:
        """Start stopping a job: SIGTERM now, SIGKILL to what is left after the grace period."""
        with self._lock:
            process = self._processes.get(job)
            if process is None or process.stop_requested or process.exit_code is not None:
                return  # nothing to stop: an exit of its own is not a stop by us
            process.stop_requested = True
        log.info("stopping %s (pid %d)", job, process.info.pid)
        self._clean_up(job, process)

    def _clean_up(self, job: str, process: _Process) -> None:
        """SIGTERM the job's processes once, and schedule the SIGKILL of what outlives the grace."""
        with self._lock:
            if process.escalation is not None:
                return
            timer = threading.Timer(self.grace_seconds, self._kill, args=(job, process))
            timer.daemon = True
            process.escalation = timer
        process.known_pids |= _descendants(process.info.pid)
        _signal_group(process.info.pid, signal.SIGTERM)
        if process.exit_code is not None:  # the launched process is gone: signal its orphans
            for proc in self._leftovers(process):
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.terminate()
        timer.start()

    def _kill(self, job: str, process: _Process) -> None:
        leftovers = self._leftovers(process)
        if leftovers:
            log.warning(
                "%s: %d process(es) outlived the grace period; killing", job, len(leftovers)
            )
        _signal_group(process.info.pid, signal.SIGKILL)
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()

    def _leftovers(self, process: _Process) -> list[psutil.Process]:
        """Live processes of this launch: known by descent or by the environment marker."""
        found: dict[int, psutil.Process] = {}
        for pid in process.known_pids | _descendants(process.info.pid):
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and _has_marker(proc, process.info):
                    found[pid] = proc
            except psutil.Error:
                continue
        for proc in _marked_processes(process.info.launch_id):
            found.setdefault(proc.pid, proc)
        return list(found.values())

    def forget(self, job: str) -> None:
        """Drop an exited job's record, once the controller has acted on its exit."""
        with self._lock:
            process = self._processes.get(job)
            if process is not None and process.exit_code is not None:
                del self._processes[job]
                if process.escalation is not None:
                    process.escalation.cancel()

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._processes)

    def stop_all(self, timeout: float) -> list[str]:
        """Stop every job and wait for all their processes; returns jobs that would not die."""
        for job in self.jobs():
            self.stop(job)
        deadline = time.monotonic() + timeout
        stubborn = self.jobs()
        while stubborn and time.monotonic() < deadline:
            stubborn = [job for job in stubborn if self.state(job).phase != ProcessPhase.EXITED]
            if stubborn:
                time.sleep(0.1)
        for job in stubborn:
            with self._lock:
                process = self._processes[job]
            self._kill(job, process)
        return stubborn


@dataclass(frozen=True)
class Orphan:
    job: str
    launch_id: str
    pids: tuple[int, ...]


def find_orphans(state_dir: Path) -> list[Orphan]:
    """Processes of jobs launched for `state_dir` by an operator that is gone (a crash).

    They carry the state dir and a launch id in their environment. Left alone, they would
    train on beside the jobs a new operator starts, on the same GPUs.
    """
    wanted = str(state_dir.resolve())
    found: dict[tuple[str, str], list[int]] = {}
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
        key = (env.get(JOB_ENV, "?"), env[LAUNCH_ID_ENV])
        found.setdefault(key, []).append(proc.pid)
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


def _descendants(pid: int) -> set[int]:
    try:
        return {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _has_marker(proc: psutil.Process, info: LaunchInfo) -> bool:
    if proc.pid == info.pid:
        return True
    try:
        return proc.environ().get(LAUNCH_ID_ENV) == info.launch_id
    except psutil.Error:
        # Cannot read it (gone, or another user's): trust descent.
        return True


def _marked_processes(launch_id: str) -> list[psutil.Process]:
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


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
