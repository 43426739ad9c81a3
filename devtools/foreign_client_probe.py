"""Fault cases run by a client nobody here wrote, under a real operator on this host.

    python -m devtools.foreign_client_probe --script /path/to/elastic_torch_main.py [--cases abcde]

`--script` is a third party's Elastic Horovod test script that fails ranks on purpose
(Horovod's own `test/integration/data/elastic_torch_main.py` is the one this was written
for: flags `--exit-schedule` '{"(epoch, batch)": [ranks]}', `--exit-mode exception|kill`,
`--epochs`, `--batches-per-epoch`, `--epoch-wait`, `--logfile`, and one JSON line per epoch
in the log file). It is run from where it lies; nothing of it is copied anywhere.

Each case starts `herd-operator run` on a fresh temporary specs and state directory with 4
virtual GPUs, drops in the script's job (3 GPUs, min 1, priority 10, relaunched on failure
at most twice) and a small neighbour job of our own (`examples/train_plain.py`, 1-2 GPUs)
that may take what the first one gives back, and watches until the script's job has ended or
the case's time is up. It records what the operator showed (status changes, conditions,
events, `get -o wide`, `describe`), the script's epoch lines, every moment a GPU had workers
of both jobs, whether the job's GPUs and processes were all released at the end, and the
time from the fault (the first scheduled worker seen gone) to the first epoch the script
logged after it, and to the first at full size. The operator is stopped, and any process
left of it killed, whatever happens. Cases run one at a time; a JSON report goes to
`--out` (default: a temporary directory), a summary to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from herd_operator.cli.views import job_object
from herd_operator.environment import GPU_ENV, JOB_ENV, LAUNCH_ID_ENV, STATE_DIR_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store

REPO = Path(__file__).resolve().parents[1]
HERD = str(Path(sys.executable).with_name("herd-operator"))
JOB = "foreign"
NEIGHBOUR = "neighbour"
POOL_GPUS = 4
SIZE = 3
TERMINAL = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    exit_schedule: dict[str, list[int]]
    exit_mode: str
    epochs: int = 12
    batches_per_epoch: int = 10
    epoch_wait: int = 2

    @property
    def doomed(self) -> set[int]:
        return {rank for ranks in self.exit_schedule.values() for rank in ranks}


CASES = {
    case.key: case
    for case in (
        Case("a", "one rank raises mid-epoch", {"(1, 5)": [1]}, "exception"),
        Case("b", "one rank SIGKILLs itself mid-epoch", {"(1, 5)": [1]}, "kill"),
        Case("c", "two of three ranks killed at one batch", {"(1, 5)": [1, 2]}, "kill"),
        Case("d", "every rank killed at once", {"(1, 5)": [0, 1, 2]}, "kill"),
        Case("e", "a kill in the first epoch, before any commit", {"(0, 0)": [1]}, "kill"),
    )
}


@dataclass
class Worker:
    pid: int
    job: str
    launch: str
    gpu: str | None
    start_rank: int | None


def live_workers(state_dir: Path) -> list[Worker]:
    """The operator's training processes now: those the shim bound to a GPU."""
    wanted = str(state_dir.resolve())
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = process.environ()
            if env.get(STATE_DIR_ENV) != wanted or GPU_ENV not in env:
                continue
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            rank = env.get("HOROVOD_RANK")
            found.append(
                Worker(
                    process.pid,
                    env.get(JOB_ENV, "?"),
                    env.get(LAUNCH_ID_ENV, "?"),
                    env.get(GPU_ENV),
                    int(rank) if rank is not None and rank.isdigit() else None,
                )
            )
    return found


def marked_pids(state_dir: Path) -> list[int]:
    """Every live process of the operator's launches (drivers, shims, workers)."""
    wanted = str(state_dir.resolve())
    pids = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = process.environ()
            live = process.status() != psutil.STATUS_ZOMBIE
            if env.get(STATE_DIR_ENV) == wanted and env.get(LAUNCH_ID_ENV) and live:
                pids.append(process.pid)
    return pids


@dataclass
class Observation:
    """What the watcher saw, with wall times."""

    statuses: list[dict[str, Any]] = field(default_factory=list)
    epochs: list[dict[str, Any]] = field(default_factory=list)
    shared_gpus: list[dict[str, Any]] = field(default_factory=list)
    worker_counts: list[tuple[float, int]] = field(default_factory=list)
    fault_at: float | None = None
    samples: int = 0


class Watcher:
    """Samples, every `interval` s, the job's status from the store (read-only, as the CLI
    reads it: no process start per sample on a loaded host), the script's log file and the
    live workers' GPUs, until stopped."""

    def __init__(self, state_dir: Path, logfile: Path, doomed: set[int], interval: float = 0.5):
        self.state_dir = state_dir
        self.logfile = logfile
        self.doomed = doomed
        self.interval = interval
        self.seen = Observation()
        self._seen_doomed: set[int] = set()
        self._read = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def status(self) -> dict[str, Any] | None:
        database = StateLayout(self.state_dir).database
        if not database.exists():
            return None
        with contextlib.suppress(Exception), Store.open_readonly(database) as store:
            record = store.get_job(JOB)
            return None if record is None else job_object(record)
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            now = time.time()
            self._sample_status(now)
            self._sample_log(now)
            self._sample_workers(now)
            self.seen.samples += 1

    def _sample_status(self, now: float) -> None:
        job = self.status()
        if job is None:
            return
        shown = {
            "status": job["status"],
            "allocated": job["gpus"]["allocated"],
            "active": job["gpus"]["active"],
            "restarts": job["restarts"],
            "placement": job["placement"],
        }
        last = self.seen.statuses[-1] if self.seen.statuses else None
        if last is None or {k: last[k] for k in shown} != shown:
            self.seen.statuses.append({"t": now, **shown})

    def _sample_log(self, now: float) -> None:
        if not self.logfile.exists():
            return
        text = self.logfile.read_text()
        complete = text[self._read :].rsplit("\n", 1)
        if len(complete) < 2:
            return
        self._read += len(complete[0]) + 1
        for line in complete[0].splitlines():
            with contextlib.suppress(ValueError):
                self.seen.epochs.append({"t": now, **json.loads(line)})

    def _sample_workers(self, now: float) -> None:
        workers = live_workers(self.state_dir)
        ours = [w for w in workers if w.job == JOB]
        counts = self.seen.worker_counts
        if not counts or counts[-1][1] != len(ours):
            counts.append((now, len(ours)))
        ranks = {w.start_rank for w in ours if w.start_rank is not None}
        if self.seen.fault_at is None:
            self._seen_doomed |= ranks & self.doomed
            if self._seen_doomed - ranks:
                self.seen.fault_at = now
        holders: dict[str, set[str]] = {}
        for worker in workers:
            if worker.gpu is not None:
                holders.setdefault(worker.gpu, set()).add(worker.job)
        for gpu, jobs in holders.items():
            if len(jobs) > 1:
                self.seen.shared_gpus.append({"t": now, "gpu": gpu, "jobs": sorted(jobs)})


def spec(name: str, command: list[str], gpus: tuple[int, int], priority: int) -> dict[str, Any]:
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": name},
        "spec": {
            "command": command,
            "workingDir": str(REPO),
            "env": {"OMP_NUM_THREADS": "1"},
            "gpus": {"min": gpus[0], "max": gpus[1]},
            "priority": priority,
            "restartPolicy": {"onFailure": True, "backoffLimit": 2},
        },
    }


def write_spec(specs_dir: Path, document: dict[str, Any]) -> None:
    """Atomically, as users are told to: the operator never reads half a file."""
    name = document["metadata"]["name"]
    tmp = specs_dir / f".{name}.yaml.tmp"
    tmp.write_text(yaml.safe_dump(document))
    os.replace(tmp, specs_dir / f"{name}.yaml")


def foreign_command(script: Path, case: Case, logfile: Path) -> list[str]:
    return [sys.executable, str(script), "--epochs", str(case.epochs),
            "--batches-per-epoch", str(case.batches_per_epoch),
            "--epoch-wait", str(case.epoch_wait), "--logfile", str(logfile),
            "--exit-schedule", json.dumps(case.exit_schedule),
            "--exit-mode", case.exit_mode, "--discovery-wait", "0"]  # fmt: skip


def neighbour_command() -> list[str]:
    return [sys.executable, str(REPO / "examples" / "train_plain.py"), "--epochs", "10000",
            "--steps", "10", "--step-delay", "0.2"]  # fmt: skip


def herd(state_dir: Path, *args: str) -> str:
    """A read-only CLI command, as a user runs it; its output (or why it had none)."""
    try:
        done = subprocess.run(
            [HERD, *args, "--state-dir", str(state_dir)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"(herd-operator {' '.join(args)} timed out)"
    return done.stdout + (f"\n(stderr) {done.stderr}" if done.returncode else "")


@contextlib.contextmanager
def running_operator(root: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """`herd-operator run` on `root`'s jobs/ and state/; stopped (SIGTERM, then SIGKILL),
    and whatever it left killed, on the way out however the case ended."""
    state = root / "state"
    argv = [HERD, "run", "--specs-dir", str(root / "jobs"), "--state-dir", str(state),
            "--hosts", f"localhost:{POOL_GPUS}", "--virtual-gpus", str(POOL_GPUS),
            "--port", str(port), "--metrics-port", str(port + 1),
            "--resync-seconds", "0.5", "--grace-seconds", "5"]  # fmt: skip
    with (root / "operator.log").open("wb") as log:
        operator = subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield operator
    finally:
        if operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(60)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(10)
        for pid in marked_pids(state):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def wait_until(probe: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    value = probe()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = probe()
    return value


@dataclass
class CaseResult:
    case: str
    title: str
    exit_mode: str
    exit_schedule: dict[str, list[int]]
    ended: str
    seconds: float
    load: list[float]
    epochs_logged: list[int]
    finished_every_epoch: bool
    recovery_s: float | None
    full_size_s: float | None
    gpus_released: bool
    processes_left: int
    shared_gpu_samples: int
    samples: int
    neighbour_shared: list[dict[str, Any]]
    statuses: list[dict[str, Any]]
    conditions: list[dict[str, Any]]
    epoch_lines: list[dict[str, Any]]
    worker_counts: list[tuple[float, int]]
    get_wide: str
    describe: str
    events: str
    job_log_tail: str
    root: str


def recovery_times(seen: Observation) -> tuple[float | None, float | None]:
    """Seconds from the fault to the first epoch the script logged after it, and to the
    first logged at full size."""
    if seen.fault_at is None:
        return None, None
    after = [line for line in seen.epochs if line["t"] >= seen.fault_at]
    first = after[0]["t"] - seen.fault_at if after else None
    full = next((line["t"] - seen.fault_at for line in after if line.get("size") == SIZE), None)
    return first, full


def run_case(script: Path, case: Case, root: Path, port: int, timeout: float) -> CaseResult:
    for folder in ("jobs", "state"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    state, logfile = root / "state", root / "epochs.jsonl"
    started = time.time()
    ended = "timeout"
    with running_operator(root, port) as operator, Watcher(state, logfile, case.doomed) as watch:
        write_spec(root / "jobs", spec(NEIGHBOUR, neighbour_command(), (1, 2), 0))
        write_spec(root / "jobs", spec(JOB, foreign_command(script, case, logfile), (1, SIZE), 10))

        def finished() -> str | None:
            if operator.poll() is not None:
                return f"operator exited {operator.returncode}"
            job = watch.status()
            return job["status"] if job and job["status"] in TERMINAL else None

        ended = wait_until(finished, timeout) or f"still {watch.seen.statuses[-1:]}"
        # Give the allocator a few rounds to take the job's GPUs back before looking.
        released = wait_until(
            lambda: (
                (watch.status() or {}).get("gpus", {}).get("allocated") == 0
                and not [w for w in live_workers(state) if w.job == JOB]
            ),
            15,
        )
        job = watch.status() or {}
        shown = {
            "get_wide": herd(state, "get", "-o", "wide"),
            "describe": herd(state, "describe", JOB),
            "events": herd(state, "events", JOB),
        }
        left = [w for w in live_workers(state) if w.job == JOB]
    seen = watch.seen
    first, full = recovery_times(seen)
    logged = [line["epoch"] for line in seen.epochs]
    log_file = StateLayout(state).log_file(JOB)
    return CaseResult(
        case=case.key,
        title=case.title,
        exit_mode=case.exit_mode,
        exit_schedule=case.exit_schedule,
        ended=str(ended),
        seconds=round(time.time() - started, 1),
        load=[round(x, 2) for x in os.getloadavg()],
        epochs_logged=logged,
        finished_every_epoch=set(range(case.epochs)) <= set(logged),
        recovery_s=None if first is None else round(first, 1),
        full_size_s=None if full is None else round(full, 1),
        gpus_released=bool(released),
        processes_left=len(left),
        shared_gpu_samples=len(seen.shared_gpus),
        samples=seen.samples,
        neighbour_shared=seen.shared_gpus[:10],
        statuses=seen.statuses,
        conditions=job.get("conditions", []),
        epoch_lines=seen.epochs,
        worker_counts=seen.worker_counts,
        job_log_tail="\n".join(log_file.read_text().splitlines()[-60:])
        if log_file.exists()
        else "",
        root=str(root),
        **shown,
    )


def summary_line(result: CaseResult) -> str:
    recovery = "-" if result.recovery_s is None else f"{result.recovery_s}s"
    full = "-" if result.full_size_s is None else f"{result.full_size_s}s"
    return (
        f"{result.case}  {result.title}: ended {result.ended} after {result.seconds}s; "
        f"epochs logged {result.epochs_logged}; every epoch: {result.finished_every_epoch}; "
        f"recovery {recovery}, full size {full}; GPUs released: {result.gpus_released}; "
        f"GPU shared by two jobs: {result.shared_gpu_samples} of {result.samples} samples; "
        f"load {result.load}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--script", type=Path, required=True, help="the foreign client script")
    parser.add_argument("--cases", default="".join(CASES), help="which cases, e.g. abd")
    parser.add_argument("--port", type=int, default=27000, help="allocator port (and +1)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--out", type=Path, help="report directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep each case's directory")
    args = parser.parse_args(argv)
    script = args.script.resolve()
    if not script.is_file():
        parser.error(f"--script {args.script}: no such file")
    unknown = set(args.cases) - CASES.keys()
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; known: {''.join(CASES)}")
    out = args.out or Path(tempfile.mkdtemp(prefix="foreign-probe-"))
    out.mkdir(parents=True, exist_ok=True)
    failures = 0
    for key in args.cases:
        root = Path(tempfile.mkdtemp(prefix=f"foreign-{key}-"))
        result = run_case(script, CASES[key], root, args.port, args.timeout)
        (out / f"case-{key}.json").write_text(json.dumps(asdict(result), indent=1))
        print(summary_line(result), flush=True)
        failures += result.ended not in TERMINAL or not result.gpus_released
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(f"report: {out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
