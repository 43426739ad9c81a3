"""Starts and stops job processes: the side effects at the edge, the same for every engine.

Each job runs as one process (its engine says which: `horovodrun` for Horovod) in a
session of its own, with stdout and stderr appended to a per-job log file. Engines
like Horovod start each worker in a new session of its own too, so a job's processes
are found by the environment marker `HERD_LAUNCH_ID` that every one of them inherits,
as well as by descent, and stopping a job makes sure that none of them is left.

Jobs outlive the operator. With a records directory, each launch runs through a keeper
(`keeper.py`, which writes the exit status to a file) and is recorded in a 0600 file
(launch id, pid and its start time, generation, spec): an operator restarted after a
crash adopts the launches still running (`adopt_recorded`) and learns how the others
ended, instead of stopping and starting them again.

The record is written, durably and without a pid ("starting"), before the process is
started, and the pid is filled in after: at no instant does a process of a launch run
without a record naming its launch id, so a killed operator's successor never takes a
launch for an orphan. A "starting" record is resolved by the launch id marker: a live
keeper carrying it is adopted; none, and no exit file, means the launch never ran.

The records' format and paths are in `launch_records.py`, the scans of the process table
(a launch's processes, orphans) in `process_table.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from typing import BinaryIO

import psutil

from herd_operator.controllers.ports import LaunchInfo, ProcessPhase, ProcessState
from herd_operator.environment import LAUNCH_ID_ENV
from herd_operator.runtime.exit_cause import driver_error
from herd_operator.runtime.keeper import read_exit_start
from herd_operator.runtime.launch_records import LaunchRecord, LaunchRecords, read_record
from herd_operator.runtime.log_format import log_time
from herd_operator.runtime.out_of_memory import (
    LogFollower,
    launch_output,
    out_of_memory_workers,
)
from herd_operator.runtime.process_table import descendants, marked_processes, same_process
from herd_operator.specs import HerdJobSpec

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


ADOPTED_POLL_SECONDS = 1.0
"""How often an adopted launch (not this operator's child: no wait(2)) is checked."""


@dataclass
class _Process:
    info: LaunchInfo
    popen: subprocess.Popen[bytes] | None
    """None for a launch adopted from a previous operator: it is not our child."""
    known_pids: set[int] = field(default_factory=set)
    stop_requested: bool = False
    exit_code: int | None = None
    launch_error: str | None = None
    """Why the keeper could not execute the command (from its exit file)."""
    ended_at: float | None = None
    """When it ended: its keeper's record, else when this launcher saw it end."""
    exited: bool = False
    escalation: threading.Timer | None = None
    log_file: Path | None = None
    """The job's log (None for an adopted launch: its records do not name it)."""
    out_of_memory: tuple[str, ...] | None = None
    """Read from the log once the launch failed (`out_of_memory.py`)."""
    error: str = ""
    """Its driver's last error line, read with `out_of_memory` (`exit_cause.py`)."""
    follower: LogFollower | None = None
    """The running launch's new log lines, for `out_of_memory_news`."""
    said_out_of_memory: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Adopted:
    """A launch recorded by a previous operator, as `Launcher.adopt_recorded` found it."""

    job: str
    info: LaunchInfo
    running: bool
    """False: it ended while no operator was there (its exit status is in the state)."""


class Launcher:
    def __init__(
        self,
        on_exit: Callable[[str], None] = lambda job: None,
        *,
        grace_seconds: float = 10.0,
        records_dir: Path | None = None,
    ) -> None:
        self._on_exit = on_exit
        self.grace_seconds = grace_seconds
        self.records_dir = records_dir
        """Where launches are recorded for a restarted operator (None: not at all, no keeper)."""
        self._records = None if records_dir is None else LaunchRecords(records_dir)
        self._lock = threading.Lock()
        self._processes: dict[str, _Process] = {}
        self._forgotten: list[tuple[str, _Process]] = []
        """Exited launches forgotten whose records wait for ``release_forgotten``."""

    def launch(self, request: LaunchRequest) -> LaunchInfo:
        with self._lock:
            if request.job in self._processes:
                raise RuntimeError(f"job {request.job} already has a process")
        launch_id = uuid.uuid4().hex
        argv = list(request.argv)
        records = self._records
        if records is not None:
            records.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            argv = records.keeper_argv(request.job, launch_id, argv)
            # Before the process exists, and durable: an operator killed from here on leaves
            # a record naming the launch id its processes carry, so its successor adopts
            # them instead of stopping them as orphans. A launch that cannot be recorded is
            # not started (OSError: the reconciler retries it with backoff).
            starting = LaunchRecord(
                request.job, launch_id, None, None, request.generation, request.command,
                request.spec,
            )  # fmt: skip
            records.write(starting, durable=True)
        env = dict(os.environ)
        env.update(request.env)
        env[LAUNCH_ID_ENV] = launch_id
        workdir = request.working_dir or os.getcwd()
        try:
            popen = self._start_logged(request, launch_id, argv, workdir, env)
        except (OSError, ValueError, subprocess.SubprocessError):
            if records is not None:  # it names a launch that never ran
                records.record_file(request.job).unlink(missing_ok=True)
            raise
        info = LaunchInfo(
            launch_id=launch_id,
            pid=popen.pid,
            started_at=time.time(),
            generation=request.generation,
            command=request.command,
            spec=request.spec,
        )
        process = _Process(
            info,
            popen,
            {popen.pid},
            log_file=request.log_file,
            follower=LogFollower(request.log_file),
        )
        if records is not None:
            self._record_started(request.job, info)
        with self._lock:
            self._processes[request.job] = process
        threading.Thread(
            target=self._wait, args=(request.job, process), name=f"wait-{request.job}", daemon=True
        ).start()
        return info

    def _start_logged(
        self,
        request: LaunchRequest,
        launch_id: str,
        argv: list[str],
        workdir: str,
        env: dict[str, str],
    ) -> subprocess.Popen[bytes]:
        """Start `argv` with its output appended to the job's log, after a header line."""
        request.log_file.parent.mkdir(parents=True, exist_ok=True)
        # 0600: a job's output is its owner's (a log may print its env or data paths).
        log_fd = os.open(
            request.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
        )
        with open(log_fd, "ab") as log_handle:
            # Stamped as the driver's lines below it are: UTC, ISO 8601, milliseconds.
            header = f"==== {log_time(time.time())} launch {launch_id}: "
            log_handle.write((header + json.dumps(argv) + "\n").encode())
            log_handle.flush()
            return self._spawn(argv, workdir, env, log_handle)

    def _spawn(
        self, argv: list[str], workdir: str, env: dict[str, str], log_handle: BinaryIO
    ) -> subprocess.Popen[bytes]:
        """The one fork of a launch (a seam where tests simulate a kill around it)."""
        return subprocess.Popen(
            argv,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def _record_started(self, job: str, info: LaunchInfo) -> None:
        """Fill in the pid and start time of a launch recorded as starting.

        Not durable (no fsync): a record that lost this write on a crash is still the
        "starting" record, which adoption resolves by the launch id. Not fatal either, for
        the same reason.
        """
        assert self._records is not None  # only a recorded launch has a pid to add
        record = LaunchRecord(job, info.launch_id, info.pid, info.started_at, info.generation,
                              info.command, info.spec)  # fmt: skip
        try:
            self._records.write(record, durable=False)
        except OSError as err:
            log.warning(
                "%s: cannot add the pid to the launch record (a restarted operator finds the"
                " launch by its id): %s", job, err,
            )  # fmt: skip

    def _wait(self, job: str, process: _Process) -> None:
        if process.popen is not None:
            code: int | None = process.popen.wait()
        else:
            code = self._wait_adopted(job, process)
        launch_id = process.info.launch_id
        launch_error: str | None = None
        ended_at: float | None = None
        if self._records is not None:
            launch_error = self._records.launch_error(job, launch_id)
            if launch_error is None and process.popen is not None:
                launch_error = self._records.keeper_failure(job, launch_id, code)
            ended_at = self._records.exit_time(job, launch_id)
        ended_at = ended_at or time.time()
        with self._lock:
            process.exit_code = code
            process.launch_error = launch_error
            process.ended_at = ended_at
            process.exited = True
        self._on_exit(job)

    def _wait_adopted(self, job: str, process: _Process) -> int | None:
        """Wait for a launch that is not our child; its keeper tells how it ended."""
        assert self._records is not None  # only a recorded launch is adopted
        while same_process(process.info.pid, process.info.launch_id):
            time.sleep(ADOPTED_POLL_SECONDS)
        return self._records.exit_code(job, process.info.launch_id)

    def adopt_recorded(self) -> list[Adopted]:
        """Take over the launches a previous operator recorded (call before launching).

        A launch whose keeper still runs is supervised as if this operator had started it;
        one that ended while no operator was there is reported exited with the status its
        keeper recorded (None when there is none: the keeper was killed too). A record
        that cannot be read is dropped: its processes, if any, are orphans.

        A record still "starting" (no pid: the previous operator was killed around the
        start of the process) is resolved by its launch id: the live keeper that carries it
        is adopted like any other; with no such keeper, an exit file says the launch ran
        and ended; with neither, the launch never ran, and its record is dropped so that
        the job is launched (once) like one that has no process.
        """
        records = self._records
        if records is None:
            return []
        adopted = []
        for path in records.recorded():
            job = path.stem
            try:
                record = read_record(path)
            except (OSError, ValueError) as err:
                log.warning("%s: dropping the unreadable launch record %s: %s", job, path, err)
                path.unlink(missing_ok=True)
                continue
            if record.pid is None or record.started_at is None:
                resolved = self._resolve_starting(records, path, record)
                if resolved is None:
                    continue
                info, running = resolved
            else:
                info = record.info()
                running = same_process(info.pid, info.launch_id)
            # The pid of a launch that ended may be another process's by now: it is no
            # leftover of the launch (those carry its launch id, and `state` finds them).
            process = _Process(info, None, {info.pid} if running else set())
            if not running:
                process.exit_code = records.exit_code(job, info.launch_id)
                process.launch_error = records.launch_error(job, info.launch_id)
                # Its status's finishedAt: when it ended, not when this operator started.
                process.ended_at = records.exit_time(job, info.launch_id)
                process.exited = True
            with self._lock:
                if job in self._processes:
                    continue
                self._processes[job] = process
            if running:
                threading.Thread(
                    target=self._wait, args=(job, process), name=f"wait-{job}", daemon=True
                ).start()
            adopted.append(Adopted(job, info, running))
        return adopted

    def _resolve_starting(
        self, records: LaunchRecords, path: Path, record: LaunchRecord
    ) -> tuple[LaunchInfo, bool] | None:
        """What became of a launch recorded as starting: its live keeper (running), an end
        its keeper recorded (not running), or None: it never ran (or its keeper was killed
        before recording an end; any processes left of it are then orphans)."""
        exit_file = records.exit_file(record.job, record.launch_id)
        for proc in marked_processes(record.launch_id):
            with contextlib.suppress(psutil.Error):
                # The keeper is the launched process: `python -m ...keeper EXIT_FILE -- ...`
                # (the file's name holds the launch id; the dir may be spelt another way).
                if any(Path(arg).name == exit_file.name for arg in proc.cmdline()[:5]):
                    info = dataclasses.replace(
                        record.info(), pid=proc.pid, started_at=proc.create_time()
                    )
                    log.info(
                        "%s: launch %s was recorded as starting; its keeper runs (pid %d)",
                        record.job, record.launch_id[:8], proc.pid,
                    )  # fmt: skip
                    # Cheaper for the next restart; the launch id finds it anyway.
                    self._record_started(record.job, info)
                    return info, True
        if exit_file.exists():
            pid, started_at = read_exit_start(exit_file)
            info = dataclasses.replace(record.info(), pid=pid or 0, started_at=started_at or 0.0)
            return info, False
        log.info(
            "%s: launch %s was recorded as starting but never ran; dropping its record",
            record.job, record.launch_id[:8],
        )  # fmt: skip
        path.unlink(missing_ok=True)
        return None

    def state(self, job: str) -> ProcessState:
        with self._lock:
            process = self._processes.get(job)
        if process is None:
            return ProcessState(ProcessPhase.ABSENT)
        stopped_by_us = process.stop_requested
        if not process.exited:
            phase = ProcessPhase.STOPPING if stopped_by_us else ProcessPhase.RUNNING
            return ProcessState(phase, launch=process.info, stopped_by_us=stopped_by_us)
        # The launched process is gone; its workers may still be on their way out.
        if self._leftovers(process):
            self._clean_up(job, process)
            return ProcessState(
                ProcessPhase.STOPPING, process.exit_code, process.info, stopped_by_us
            )
        out_of_memory = self._out_of_memory(process)  # reads `process.error` with it
        return ProcessState(
            ProcessPhase.EXITED,
            process.exit_code,
            process.info,
            stopped_by_us,
            launch_error=process.launch_error,
            ended_at=process.ended_at,
            out_of_memory=out_of_memory,
            error=process.error,
        )

    def out_of_memory_news(self) -> dict[str, tuple[str, ...]]:
        """Per running launch of this operator, the workers whose output says they ran out of
        GPU memory since the last call (each worker once per launch). Called by one loop."""
        with self._lock:
            running = [(job, p) for job, p in self._processes.items() if not p.exited]
        news = {}
        for job, process in running:
            if process.follower is None:
                continue
            found = out_of_memory_workers(process.follower.new_lines())
            new = tuple(worker for worker in found if worker not in process.said_out_of_memory)
            if new:
                process.said_out_of_memory.update(new)
                news[job] = new
        return news

    @staticmethod
    def _out_of_memory(process: _Process) -> tuple[str, ...]:
        """The workers that ran out of GPU memory, read once from the log of a failed launch
        (its driver's error with them)."""
        if process.stop_requested or process.exit_code == 0 or process.log_file is None:
            return ()
        if process.out_of_memory is None:
            lines = launch_output(process.log_file, process.info.launch_id)
            process.out_of_memory = out_of_memory_workers(lines)
            process.error = driver_error(lines)
        return process.out_of_memory

    def stop(self, job: str) -> None:
        """Start stopping a job: SIGTERM now, SIGKILL to what is left after the grace period."""
        with self._lock:
            process = self._processes.get(job)
            if process is None or process.stop_requested or process.exited:
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
        leader = _group_leader(process)
        if leader is not None:
            process.known_pids |= descendants(leader)
            _signal_group(leader, signal.SIGTERM)
        if process.exited:  # the launched process is gone: signal its orphans
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
        leader = _group_leader(process)
        if leader is not None:
            _signal_group(leader, signal.SIGKILL)
        for proc in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()

    def _leftovers(self, process: _Process) -> list[psutil.Process]:
        """Live processes of this launch: known by descent or by the environment marker."""
        found: dict[int, psutil.Process] = {}
        leader = _group_leader(process)
        below = descendants(leader) if leader is not None else set()
        for pid in process.known_pids | below:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and _has_marker(proc, process.info):
                    found[pid] = proc
            except psutil.Error:
                continue
        for proc in marked_processes(process.info.launch_id):
            found.setdefault(proc.pid, proc)
        return list(found.values())

    def forget(self, job: str) -> None:
        """Drop an exited job, once the controller has acted on its exit.

        The job is gone from ``state`` at once, but its launch record and exit file stay
        until ``release_forgotten``: the caller calls that once the status recording the
        exit is durable, so an operator killed in between adopts the exit again instead of
        finding neither record nor final status and running the job again.
        """
        with self._lock:
            process = self._processes.get(job)
            if process is None or not process.exited:
                return
            del self._processes[job]
            if process.escalation is not None:
                process.escalation.cancel()
            if self._records is not None:
                self._forgotten.append((job, process))

    def release_forgotten(self) -> None:
        """Remove the records of the launches forgotten so far (their exits are durable)."""
        with self._lock:
            forgotten, self._forgotten = self._forgotten, []
        for job, process in forgotten:
            assert self._records is not None  # only recorded launches are kept forgotten
            self._records.remove(job, process.info.launch_id)

    def restore_forgotten(self) -> None:
        """Take back the launches forgotten since the last release: the writes that recorded
        their exits were lost (the store could not commit them), and the reconciles that
        redo those writes must find the exits again. A job launched again since keeps its
        new launch (its old record was replaced by the new one's)."""
        with self._lock:
            forgotten, self._forgotten = self._forgotten, []
            for job, process in forgotten:
                if job not in self._processes:
                    process.escalation = None  # cancelled by forget(): leftovers get a new one
                    self._processes[job] = process

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


def _group_leader(process: _Process) -> int | None:
    """The launched process's pid, to signal its group and look under: None once the keeper
    of an adopted launch is gone (not our child, so not kept from reuse by a zombie: the pid
    may be a stranger's by now; the launch's leftovers still carry its launch id)."""
    if process.popen is None and process.exited:
        return None
    return process.info.pid if process.info.pid > 1 else None


def _has_marker(proc: psutil.Process, info: LaunchInfo) -> bool:
    """Whether `proc` carries the launch's id (the launched process does too: it is started
    with it). Not by pid alone: a pid of a launch that ended may be another process's."""
    try:
        return proc.environ().get(LAUNCH_ID_ENV) == info.launch_id
    except psutil.Error:
        # Cannot read it (gone, or another user's): trust descent.
        return True


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """Signal the process group `pid` leads (a `_group_leader`, never 0 or 1: killpg(0)
    would signal the operator's own group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
