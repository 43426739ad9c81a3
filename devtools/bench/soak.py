"""soak: a real `herd-operator run` with jobs coming and going for half an hour.

Not a speed test: the rows make a leak visible. The operator runs as its own process
(so its RSS is its own), with real `horovodrun` jobs (examples/train_plain.py: torch
and Horovod, but seconds of work) whose spec files are written, resized and deleted at
a steady rate. Its RSS, USS, threads and open file descriptors are sampled every few
seconds; the rows give RSS and state-dir size at the end against the first sample after
warm-up, the least-squares slope, and what the state dir keeps per job.

`HERD_BENCH_SOAK_MINUTES` sets the duration (default 30; `--quick` 0.75).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from herd_operator.bench.harness import Context, Row, Stats
from herd_operator.environment import LAUNCH_ID_ENV, STATE_DIR_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store, StoreError

REPO = Path(__file__).resolve().parents[2]
DURATION_ENV = "HERD_BENCH_SOAK_MINUTES"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
MB = 1e6


@dataclass(frozen=True)
class SoakPlan:
    """How long, how fast and how big: the workload of one soak."""

    duration_s: float
    warmup_s: float
    sample_every_s: float
    arrival_every_s: float
    """A new spec file at most this often, while fewer than `concurrency` jobs are in play."""
    concurrency: int = 3
    resize_after_s: float = 4.0
    """Seconds after a job is first seen running before its spec asks for 2 GPUs."""
    cancel_every: int = 4
    """Every n-th job has its spec deleted while it runs, not after it finished."""
    epochs: int = 3
    steps: int = 30
    step_delay_s: float = 0.1
    report_every_s: float = 60.0

    @classmethod
    def for_context(cls, ctx: Context) -> SoakPlan:
        default = 0.75 if ctx.quick else 30.0
        minutes = float(os.environ.get(DURATION_ENV, default))
        if minutes <= 0:
            raise ValueError(f"{DURATION_ENV} must be positive, got {minutes}")
        duration = minutes * 60
        # Warm-up: the interpreter's imports, the first launches and the store's first
        # pages settle; a tenth of the run, at least 15 s, leaves the rest for the slope.
        return cls(
            duration_s=duration,
            warmup_s=max(15.0, duration / 10),
            sample_every_s=2.0 if duration < 300 else 5.0,
            arrival_every_s=5.0,
            report_every_s=15.0 if duration < 300 else 60.0,
        )


@dataclass(frozen=True)
class Sample:
    at: float
    """Seconds since the operator was ready."""
    rss: int
    uss: int
    threads: int
    fds: int


@dataclass
class TrackedJob:
    name: str
    cancel: bool
    started: bool = False
    running_since: float | None = None
    resized: bool = False
    removed_at: float | None = None
    """When its spec file was deleted; it stays in play until the store forgets it."""


@dataclass
class Tally:
    written: int = 0
    started: int = 0
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0
    resizes: int = 0
    gone: int = 0
    """Jobs whose spec was deleted and whose record the operator has removed."""
    launches: set[str] = field(default_factory=set)


def job_document(name: str, plan: SoakPlan, gpus: int) -> dict[str, Any]:
    command = [
        "python",
        "examples/train_plain.py",
        "--epochs",
        str(plan.epochs),
        "--steps",
        str(plan.steps),
        "--step-delay",
        str(plan.step_delay_s),
    ]
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": name},
        "spec": {
            "command": command,
            "workingDir": str(REPO),
            "gpus": {"min": 1, "max": 2},
            "policy": {"name": "static", "params": {"gpus": gpus}},
        },
    }


def write_spec(specs_dir: Path, document: dict[str, Any]) -> None:
    """Temp file + rename, as users are told to: the operator never reads half a file."""
    name = document["metadata"]["name"]
    tmp = specs_dir / f".{name}.yaml.tmp"
    tmp.write_text(yaml.safe_dump(document))
    os.replace(tmp, specs_dir / f"{name}.yaml")


def job_processes(state_dir: Path) -> list[psutil.Process]:
    """Live processes of the jobs of the operator on `state_dir` (the launch-id marker)."""
    wanted = str(state_dir.resolve())
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if (
                env.get(LAUNCH_ID_ENV)
                and env.get(STATE_DIR_ENV) == wanted
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(proc)
    return found


def store_bytes(database: Path) -> int:
    """The store's logical size: its pages as a reader sees them, WAL included.

    The files' sizes would swing by megabytes as the WAL fills and is checkpointed.
    """
    with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as conn:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (page_size,) = conn.execute("PRAGMA page_size").fetchone()
    return int(pages) * int(page_size)


def history_rows(database: Path) -> tuple[int, int]:
    """Rows of the two tables that outlive a job: (events, grant_history)."""
    with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as conn:
        (events,) = conn.execute("SELECT count(*) FROM events").fetchone()
        (grants,) = conn.execute("SELECT count(*) FROM grant_history").fetchone()
    return int(events), int(grants)


def files_bytes(root: Path) -> int:
    return sum(path.stat().st_size for path in root.rglob("*") if path.is_file())


def state_bytes(layout: StateLayout) -> tuple[int, int]:
    """(everything under the state dir, the store's share): the store counted by its
    logical size, the other files (logs, launch records, grants) by their sizes."""
    store = store_bytes(layout.database)
    total = store
    skip = {layout.database.name + suffix for suffix in ("", "-wal", "-shm", "-journal")}
    for directory, _, files in os.walk(layout.root):
        for file in files:
            if Path(directory) == layout.root and file in skip:
                continue
            with contextlib.suppress(OSError):
                total += (Path(directory) / file).lstat().st_size
    return total, store


def slope_per_hour(samples: list[Sample]) -> float:
    """Least-squares slope of RSS in MB per hour; 0 for fewer than two samples."""
    if len(samples) < 2:
        return 0.0
    xs = [s.at / 3600 for s in samples]
    ys = [s.rss / MB for s in samples]
    mean_x = sum(xs) / len(xs)
    mean_y = sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


@dataclass
class OperatorProcess:
    process: subprocess.Popen[bytes]
    specs_dir: Path
    layout: StateLayout
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def sample(self, at: float) -> Sample:
        proc = psutil.Process(self.pid)
        with proc.oneshot():
            # USS reads /proc/PID/smaps: a few ms for this process, fine every few seconds.
            memory = proc.memory_full_info()
            return Sample(at, memory.rss, memory.uss, proc.num_threads(), proc.num_fds())

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is not None:
            raise RuntimeError(f"the operator exited with {code}; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"


@contextlib.contextmanager
def operator_process(root: Path) -> Iterator[OperatorProcess]:
    """`herd-operator run` on 4 virtual GPUs, stopped with SIGTERM (it stops its jobs);
    whatever is left of it or its jobs afterwards is killed, also on KeyboardInterrupt."""
    specs_dir = root / "jobs"
    state_dir = root / "state"
    specs_dir.mkdir(parents=True)
    log = root / "operator.log"
    argv = [
        sys.executable,
        "-c",
        "import sys; from herd_operator.cli import main; sys.exit(main(sys.argv[1:]))",
        "run",
        "--specs-dir", str(specs_dir),
        "--state-dir", str(state_dir),
        "--hosts", "localhost:4",
        "--metrics-port", "0",
        "--relist-seconds", "2",
        "--resync-seconds", "1",
        "--grace-seconds", "5",
        # Resizes are part of the churn; the default 30 s freeze would skip most of them.
        "--min-resize-interval", "2",
        # Grant files in the state dir, so the measured size holds everything it writes.
        "--runtime-dir", str(state_dir / "runtime"),
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        # The jobs' `python` is this interpreter, with torch and Horovod.
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop(STATE_DIR_ENV, None)
    with open(log, "wb") as output:
        process = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    handle = OperatorProcess(process, specs_dir, StateLayout(state_dir), log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "metrics on http://" not in log.read_text(errors="replace"):
            handle.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the operator did not start:\n{handle.log_tail()}")
            time.sleep(0.2)
        yield handle
    finally:
        stop_everything(handle)


def stop_everything(handle: OperatorProcess) -> None:
    """SIGTERM the operator and wait; then kill its group and any marked job process."""
    # Ignore a second Ctrl-C here: an interrupted teardown is what leaves jobs behind.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with contextlib.suppress(ProcessLookupError):
            handle.process.send_signal(signal.SIGTERM)
        try:
            handle.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.pid, signal.SIGKILL)
            handle.process.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(handle.pid, signal.SIGKILL)  # anything of its group still there
        left = job_processes(handle.layout.root)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=10)
    finally:
        signal.signal(signal.SIGINT, previous)


class Churn:
    """Keeps jobs coming and going: writes, resizes and deletes spec files."""

    def __init__(self, operator: OperatorProcess, plan: SoakPlan) -> None:
        self.operator = operator
        self.plan = plan
        self.tally = Tally()
        self.jobs: dict[str, TrackedJob] = {}
        self.numbers = itertools.count(1)
        self.last_arrival = -plan.arrival_every_s

    def step(self, now: float, *, arrivals: bool) -> None:
        """Observe the store, then act: delete finished specs, resize, cancel, add."""
        records = self._records()
        for job in list(self.jobs.values()):
            record = records.get(job.name)
            if job.removed_at is not None:
                if record is None:
                    self.tally.gone += 1
                    del self.jobs[job.name]
                continue
            if record is None:
                continue  # not read yet
            launch = record.status.launch_id
            if launch and launch not in self.tally.launches:
                self.tally.launches.add(launch)
                if not job.started:
                    job.started = True
                    self.tally.started += 1
            word = record.status.summary()
            if word in ("Succeeded", "Failed"):
                if word == "Succeeded":
                    self.tally.succeeded += 1
                else:
                    self.tally.failed += 1
                self._remove(job, now)
                continue
            if word in ("Running", "Resizing") and job.running_since is None:
                job.running_since = now
            if job.running_since is None:
                continue
            if job.cancel and now - job.running_since > self.plan.resize_after_s / 2:
                self.tally.cancelled += 1
                self._remove(job, now)
            elif not job.resized and now - job.running_since > self.plan.resize_after_s:
                write_spec(self.operator.specs_dir, job_document(job.name, self.plan, 2))
                job.resized = True
                self.tally.resizes += 1
        if (
            arrivals
            and len(self.jobs) < self.plan.concurrency
            and now - self.last_arrival >= self.plan.arrival_every_s
        ):
            number = next(self.numbers)
            name = f"soak-{number:05d}"
            cancel = number % self.plan.cancel_every == 0
            write_spec(self.operator.specs_dir, job_document(name, self.plan, 1))
            self.jobs[name] = TrackedJob(name, cancel)
            self.tally.written += 1
            self.last_arrival = now

    def _remove(self, job: TrackedJob, now: float) -> None:
        (self.operator.specs_dir / f"{job.name}.yaml").unlink(missing_ok=True)
        job.removed_at = now

    def _records(self) -> dict[str, Any]:
        try:
            with Store.open_readonly(self.operator.layout.database) as store:
                return {record.name: record for record in store.list_jobs()}
        except StoreError:
            return {}  # busy or not created yet: the next tick reads it


def soak(ctx: Context, plan: SoakPlan) -> list[Row]:
    samples: list[Sample] = []
    with operator_process(ctx.scratch / "soak") as operator:
        churn = Churn(operator, plan)
        started = time.monotonic()
        next_sample = next_report = 0.0
        warm_state = warm_store = 0
        warm_tally = (0, 0)
        while (now := time.monotonic() - started) < plan.duration_s:
            operator.check_alive()
            churn.step(now, arrivals=True)
            if now >= next_sample:
                samples.append(operator.sample(now))
                if not warm_state and now >= plan.warmup_s:
                    warm_state, warm_store = state_bytes(operator.layout)
                    warm_tally = (churn.tally.written, churn.tally.gone)
                next_sample += plan.sample_every_s
            if now >= next_report:
                last = samples[-1]
                t = churn.tally
                ctx.progress(
                    f"soak: {now / 60:.1f} min: rss {last.rss / MB:.1f} MB, uss"
                    f" {last.uss / MB:.1f} MB, {last.threads} threads, {last.fds} fds;"
                    f" jobs written {t.written}, started {t.started}, succeeded {t.succeeded},"
                    f" failed {t.failed}, cancelled {t.cancelled}, resized {t.resizes}"
                )
                next_report += plan.report_every_s
            time.sleep(0.5)
        # The last sample is taken with jobs still in play, as the one after warm-up was.
        end_sample = operator.sample(time.monotonic() - started)
        samples.append(end_sample)
        end_state, end_store = state_bytes(operator.layout)
        end_logs = files_bytes(operator.layout.logs_dir)
        events, grant_changes = history_rows(operator.layout.database)
        end_tally = churn.tally
        cpu = psutil.Process(operator.pid).cpu_times()
    if job_processes(operator.layout.root):
        raise RuntimeError("job processes outlived the operator")
    warm = [s for s in samples if s.at >= plan.warmup_s]
    if len(warm) < 2 or not warm_state:
        raise RuntimeError(f"too few samples after warm-up ({len(warm)}): run longer")
    first = warm[0]
    written_warm, gone_warm = warm_tally
    jobs_since_warm = max(1, end_tally.written - written_warm)
    common = {"duration_s": plan.duration_s, "warmup_s": plan.warmup_s, "samples": len(samples)}
    tally = {
        "jobs_written": end_tally.written,
        "jobs_started": end_tally.started,
        "launches": len(end_tally.launches),
        "jobs_succeeded": end_tally.succeeded,
        "jobs_failed": end_tally.failed,
        "jobs_cancelled_running": end_tally.cancelled,
        "resizes_asked": end_tally.resizes,
        "jobs_forgotten_by_operator": end_tally.gone,
    }
    return [
        Row(
            name="soak: operator RSS",
            what="RSS at the end against the first sample after warm-up; jobs coming and going",
            unit="MB",
            better="lower",
            baseline_label="RSS after warm-up",
            baseline=Stats.of([first.rss / MB]),
            ours=Stats.of([end_sample.rss / MB]),
            extra={
                **common,
                **tally,
                "rss_slope_mb_per_hour": slope_per_hour(warm),
                "rss_max_mb": max(s.rss for s in samples) / MB,
                "uss_after_warmup_mb": first.uss / MB,
                "uss_end_mb": end_sample.uss / MB,
                "threads_max": max(s.threads for s in samples),
                "threads_end": end_sample.threads,
                "fds_max": max(s.fds for s in samples),
                "fds_end": end_sample.fds,
                "operator_cpu_s": cpu.user + cpu.system,
            },
        ),
        Row(
            name="soak: state dir",
            what="bytes under the state dir at the end (the store by its pages, WAL included;"
            " logs, launch records, grants by file size)",
            unit="MB",
            better="lower",
            baseline_label="state dir after warm-up",
            baseline=Stats.of([warm_state / MB]),
            ours=Stats.of([end_state / MB]),
            extra={
                "jobs_since_warmup": jobs_since_warm,
                "state_kb_per_job_since_warmup": (end_state - warm_state) / 1e3 / jobs_since_warm,
                "store_mb_after_warmup": warm_store / MB,
                "store_mb_end": end_store / MB,
                "store_kb_per_job_since_warmup": (end_store - warm_store) / 1e3 / jobs_since_warm,
                "jobs_forgotten_since_warmup": end_tally.gone - gone_warm,
                # What stays after a job is deleted: its log file, its events (the store
                # keeps the last 100,000) and its grant changes (kept for ever).
                "logs_kb_per_job": end_logs / 1e3 / max(1, end_tally.written),
                "events_per_job": events / max(1, end_tally.written),
                "grant_changes_per_job": grant_changes / max(1, end_tally.written),
            },
        ),
    ]


def run_soak(ctx: Context) -> list[Row]:
    return soak(ctx, SoakPlan.for_context(ctx))
