"""Crash-only: `herd-operator run` killed with SIGKILL at random moments, and started again.

Three real elastic jobs run through every stop: one resized by a schedule (grows and
shrinks), one steady, and one of a higher priority that arrives after the first stop and
shrinks the first while it trains (its GPUs drain, then it grows back once the late job
ends). Most stops are a SIGKILL at a random moment, some wait for a GPU to drain first,
and some are the upgrade path (SIGTERM under `--leave-jobs-running`). After each restart
the operator must adopt the jobs: no job is stopped or started again, no epoch is trained
twice or lost, and at no moment do two jobs' workers sit on one GPU (a sampler reads the
GPU each live worker was bound to, from its environment, all along).

The number of stops is HERD_CHAOS_KILLS (default 3, so the suite stays short; the
figures in docs/reliability.md come from a run with 20), the moments come from
HERD_CHAOS_SEED (default 11), and HERD_CHAOS_REPORT names a JSON file for the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from herd_operator.cli.views import job_object
from herd_operator.runtime.process_table import job_processes
from herd_operator.runtime.store import Store
from tests.integration.harness import (
    HERD,
    REPO,
    digits_command,
    kill_marked_processes,
    marked_processes,
    spec_document,
)

KILLS = int(os.environ.get("HERD_CHAOS_KILLS", "3"))
SEED = int(os.environ.get("HERD_CHAOS_SEED", "11"))
EPOCHS = max(10, 3 * KILLS)
"""Long enough for every kill to land while the jobs train (an epoch takes ~1 s on a quiet
machine, and a kill comes every 1-7 s)."""
GUARD_S = 600.0
"""Hang guard for the whole run; never a performance expectation."""


class GpuSharingSampler:
    """Samples, every `interval` s, the GPU each live worker of the state dir is bound to
    (HERD_GPU, exported by the shim) and keeps every moment two jobs shared one in a way the
    allocator never allows (`shared`): a job that does not share GPUs (not in `sharing`)
    beside another, or sharing jobs whose memory (`sharing`: job -> bytes per worker) is
    over `gpu_memory`. Moments that sharing jobs shared one within its memory are counted
    (`co_located`)."""

    def __init__(
        self,
        state: Path,
        interval: float = 0.2,
        sharing: Mapping[str, int] | None = None,
        gpu_memory: int = 0,
    ) -> None:
        self.state = state
        self.interval = interval
        self.sharing = dict(sharing or {})
        self.gpu_memory = gpu_memory
        self.samples = 0
        self.co_located = 0
        self.shared: list[tuple[float, str, list[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSharingSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            holders: dict[str, set[str]] = {}
            for proc in job_processes(self.state):
                gpu = proc.env.get("HERD_GPU")
                if gpu is not None:
                    host = proc.env.get("HOROVOD_HOSTNAME", "localhost")
                    holders.setdefault(f"{host}:{gpu}", set()).add(proc.job)
            self.samples += 1
            for slot, jobs in holders.items():
                if len(jobs) < 2:
                    continue
                within = sum(self.sharing.get(job, 0) for job in jobs) <= self.gpu_memory
                if jobs <= self.sharing.keys() and within:
                    self.co_located += 1
                    continue
                self.shared.append((time.time(), slot, sorted(jobs)))


def stop_operator(operator: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as a user stops it; SIGKILL if it will not go."""
    operator.send_signal(signal.SIGTERM)
    try:
        operator.wait(60)
    except subprocess.TimeoutExpired:
        operator.kill()


def start_operator(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


def wait_until_serving(state: Path, operator: subprocess.Popen[bytes], deadline: float) -> float:
    """Seconds from now until `operator` serves (its endpoint file names it): by then it has
    adopted what it found, and workers reach it again."""
    started = time.monotonic()
    while True:
        with contextlib.suppress(OSError, ValueError):
            if json.loads((state / "allocator.json").read_text())["pid"] == operator.pid:
                return time.monotonic() - started
        assert operator.poll() is None, f"the operator exited with {operator.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for the operator to serve"
        time.sleep(0.02)


def stored_jobs(state: Path) -> dict[str, dict[str, Any]]:
    with Store.open_readonly(state / "state.db") as store:
        return {record.name: job_object(record) for record in store.list_jobs()}


def conditions(job: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in job["conditions"]}


def finished(state: Path, names: list[str]) -> bool:
    try:
        records = stored_jobs(state)
    except Exception:  # the database may be mid-creation right after a kill
        return False
    return all(
        name in records
        and "True" in (conditions(records[name]).get(t) for t in ("Succeeded", "Failed"))
        for name in names
    )


@pytest.fixture
def chaos_dirs(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    jobs, state = tmp_path / "jobs", tmp_path / "state"
    jobs.mkdir()
    yield jobs, state
    kill_marked_processes(state)  # whatever a failed run left


def draining(state: Path) -> bool:
    """Whether the store records a GPU being given back (its workers may still be on it)."""
    try:
        with Store.open_readonly(state / "state.db") as store:
            return bool(store.draining())
    except Exception:  # the database may be mid-creation right after a kill
        return False


def test_operator_killed_at_random_moments_never_stops_restarts_or_overlaps_jobs(
    chaos_dirs: tuple[Path, Path],
) -> None:
    jobs, state = chaos_dirs
    # A worker started by a resize joins within Gloo's timeout (30 s by default), which a
    # machine shared with other test runs can exceed while torch imports.
    slow_start = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "120"}
    resized = spec_document(
        "resized", 1, 3, digits_command(EPOCHS, "--step-delay", "0.03"), env=slow_start,
        policy={"name": "schedule", "params": {
            "initial": 2, "steps": [{"atEpoch": 3, "gpus": 3}, {"atEpoch": 6, "gpus": 1}]}},
    )  # fmt: skip
    steady = spec_document(
        "steady", 1, 1, digits_command(EPOCHS, "--step-delay", "0.03"), env=slow_start
    )
    # Arrives at the first stop; its min takes GPUs from `resized`, which drain first.
    late = spec_document(
        "late", 2, 2, digits_command(4, "--step-delay", "0.03"), env=slow_start, priority=10
    )
    for document in (resized, steady):
        (jobs / f"{document['metadata']['name']}.yaml").write_text(yaml.safe_dump(document))
    names = ["resized", "steady", "late"]
    epochs_of = {"resized": EPOCHS, "steady": EPOCHS, "late": 4}
    log = state.parent / "operator.log"
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:4", "--resync-seconds", "0.5", "--grace-seconds", "5",
            "--min-resize-interval", "1", "--metrics-port", "0",
            "--leave-jobs-running"]  # fmt: skip
    rng = random.Random(SEED)
    kills: list[float] = []
    stops = {"start-up": 0, "running": 0, "draining": 0, "upgrade": 0}
    ready_after: list[float] = []  # seconds from a restart to an operator that serves again
    deadline = time.monotonic() + GUARD_S
    operator = start_operator(argv, log)
    try:
        with GpuSharingSampler(state) as sampler:
            while len(kills) < KILLS and not finished(state, names):
                assert time.monotonic() < deadline, "timed out"
                how = "SIGKILL"
                if kills and rng.random() < 0.25:
                    time.sleep(rng.uniform(0.0, 1.0))  # in the middle of start-up
                    stops["start-up"] += 1
                else:
                    ready = wait_until_serving(state, operator, deadline)
                    if kills:
                        ready_after.append(ready)
                    # Any instant of the jobs' first launches may be hit too: a launch is
                    # recorded before its process starts (tests/unit/test_adoption.py).
                    time.sleep(rng.uniform(0.5, 5.0))
                    mode = rng.random()
                    if mode < 0.3:
                        # Wait (a while) for a GPU to drain, then stop right in it.
                        until = time.monotonic() + 10.0
                        while not draining(state) and time.monotonic() < until:
                            time.sleep(0.05)
                    if mode >= 0.8:
                        how = "SIGTERM"  # the upgrade path: --leave-jobs-running
                        stops["upgrade"] += 1
                    else:
                        stops["draining" if draining(state) else "running"] += 1
                operator.send_signal(signal.SIGKILL if how == "SIGKILL" else signal.SIGTERM)
                operator.wait(60)
                kills.append(time.time())
                if not (jobs / "late.yaml").exists():
                    # At the first stop, maybe while `resized`'s first launch still forms:
                    # the allocator must not shrink it before its workers bound
                    # (runtime/first_launch.py).
                    (jobs / "late.yaml").write_text(yaml.safe_dump(late))
                time.sleep(rng.uniform(0.0, 1.5))  # down for a moment
                operator = start_operator(argv, log)
            ready_after.append(wait_until_serving(state, operator, deadline))
            if not (jobs / "late.yaml").exists():  # no stop came before the jobs ended
                (jobs / "late.yaml").write_text(yaml.safe_dump(late))
            while not finished(state, names):
                assert time.monotonic() < deadline, "timed out"
                assert operator.poll() is None, log.read_text()[-3000:]
                time.sleep(0.5)
    finally:
        stop_operator(operator)
    text = log.read_text()
    context = f"seed {SEED}, {len(kills)} kills; operator log:\n{text[-4000:]}"
    assert len(kills) == KILLS, f"the jobs finished before all kills: {context}"
    assert sampler.samples > 50 and sampler.shared == [], f"GPUs shared: {sampler.shared[:5]}"

    records = stored_jobs(state)
    with Store.open_readonly(state / "state.db") as store:
        events = {name: store.events(name) for name in names}
    relaunches, epochs_repeated_or_lost = 0, 0
    for name in names:
        final = conditions(records[name])
        assert final.get("Succeeded") == "True", f"{name}: {final}; {context}"
        reasons = [event.reason for event in events[name]]
        job_log = (state / "logs" / f"{name}.log").read_text()
        epochs = [int(e) for e in re.findall(r"<stdout>:epoch (\d+):", job_log)]
        total = epochs_of[name]
        relaunches += reasons.count("Started") - 1
        epochs_repeated_or_lost += len(epochs) - len(set(epochs)) + total - len(set(epochs))
        assert reasons.count("Started") == 1, f"{name} was started again: {reasons}; {context}"
        assert "Orphaned" not in reasons and "BackOff" not in reasons, reasons
        assert job_log.count("==== ") == 1, f"{name} launched more than once:\n{job_log}"
        assert epochs == list(range(total)), f"{name}: epochs trained {epochs}\n{job_log}"
        assert f"done: {total} epochs" in job_log
    resizes = [e.message for e in events["resized"] if e.reason == "Resized"]
    assert resizes, "the schedule should have resized a job across the kills"

    adoption = [float(s) for s in re.findall(r"adopted \d+ running job.* in ([\d.]+) s", text)]
    figures = {
        "kills": len(kills),
        "stops": stops,
        "seed": SEED,
        "gpu_samples": sampler.samples,
        "gpus_shared": len(sampler.shared),
        "relaunches": relaunches,
        "epochs_repeated_or_lost": epochs_repeated_or_lost,
        "adopt_step_seconds_max": max(adoption, default=None),
        "restart_to_serving_seconds": sorted(round(t, 2) for t in ready_after),
        "restart_to_serving_seconds_max": round(max(ready_after), 2),
        "resizes": len(resizes),
    }
    if report := os.environ.get("HERD_CHAOS_REPORT"):
        Path(report).write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))


def test_an_operator_told_to_leave_its_jobs_hands_them_to_the_next_one(
    chaos_dirs: tuple[Path, Path],
) -> None:
    """`run --leave-jobs-running` and SIGTERM: an upgrade or a restart without losing steps."""
    jobs, state = chaos_dirs
    document = spec_document("kept", 1, 2, digits_command(8, "--step-delay", "0.03"))
    (jobs / "kept.yaml").write_text(yaml.safe_dump(document))
    log = state.parent / "operator.log"
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:2", "--resync-seconds", "0.5", "--grace-seconds", "5",
            "--metrics-port", "0", "--leave-jobs-running"]  # fmt: skip
    deadline = time.monotonic() + GUARD_S
    operator = start_operator(argv, log)
    try:
        wait_until_serving(state, operator, deadline)
        while not marked_processes(state):
            assert time.monotonic() < deadline and operator.poll() is None, log.read_text()
            time.sleep(0.2)
        launches = set(marked_processes(state).values())
        port = json.loads((state / "allocator.json").read_text())["address"]
        operator.send_signal(signal.SIGTERM)
        assert operator.wait(60) == 0, log.read_text()
        assert set(marked_processes(state).values()) == launches, "the job must train on"
        assert "left 1 job(s) running: kept" in log.read_text()

        operator = start_operator(argv, log)
        wait_until_serving(state, operator, deadline)
        assert json.loads((state / "allocator.json").read_text())["address"] == port
        while not finished(state, ["kept"]):
            assert time.monotonic() < deadline and operator.poll() is None, log.read_text()
            time.sleep(0.5)
    finally:
        stop_operator(operator)
    with Store.open_readonly(state / "state.db") as store:
        reasons = [event.reason for event in store.events("kept")]
    assert reasons.count("Started") == 1 and "Adopted" in reasons, reasons
    assert conditions(stored_jobs(state)["kept"]).get("Succeeded") == "True"
    job_log = (state / "logs" / "kept.log").read_text()
    assert [int(e) for e in re.findall(r"<stdout>:epoch (\d+):", job_log)] == list(range(8))
    # The last operator had nothing left to hand over: it cleaned up like any stop.
    assert not (state / "runtime-dir").exists() and not (state / "allocator.json").exists()


def bound_workers(state: Path) -> dict[str, dict[int, int]]:
    """Live workers of the state dir's jobs: job -> GPU -> pid (from the shim's HERD_GPU)."""
    found: dict[str, dict[int, int]] = {}
    for proc in job_processes(state):
        gpu = proc.env.get("HERD_GPU")
        if gpu is not None:
            found.setdefault(proc.job, {})[int(gpu)] = proc.pid
    return found


def wait_for(what: str, probe: Any, deadline: float, operator: subprocess.Popen[bytes]) -> Any:
    while not (value := probe()):
        assert operator.poll() is None, f"the operator exited while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
    return value


@pytest.mark.parametrize("restart", ["SIGKILL", "leave-jobs-running"])
def test_a_restart_during_a_drain_gives_the_draining_gpus_to_nobody(
    chaos_dirs: tuple[Path, Path], restart: str
) -> None:
    """A job shrunk to admit another gives GPUs back; its workers there leave them only when
    Horovod removes them (here: never, until the test kills them). An operator killed (or
    stopped for an upgrade) while they drain must, after its restart, still hold them: the
    job waiting for them starts only once those workers are gone. Before drains were
    recorded, the restarted operator granted them at once: two jobs on one GPU."""
    jobs, state = chaos_dirs
    sleeper = ["python", "-c", "import time; time.sleep(600)"]
    log = state.parent / "operator.log"
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:4", "--resync-seconds", "0.5", "--grace-seconds", "2",
            "--min-resize-interval", "0", "--metrics-port", "0"]  # fmt: skip
    if restart == "leave-jobs-running":
        argv.append("--leave-jobs-running")
    deadline = time.monotonic() + GUARD_S
    operator = start_operator(argv, log)
    try:
        wait_until_serving(state, operator, deadline)
        slow = spec_document("slow", 1, 4, sleeper)
        (jobs / "slow.yaml").write_text(yaml.safe_dump(slow))
        wait_for("4 workers of slow", lambda: len(bound_workers(state).get("slow", {})) == 4,
                 deadline, operator)  # fmt: skip
        urgent = spec_document("urgent", 2, 2, sleeper, priority=10)
        (jobs / "urgent.yaml").write_text(yaml.safe_dump(urgent))

        def shrunk() -> bool:
            with contextlib.suppress(Exception), Store.open_readonly(state / "state.db") as s:
                slow = s.allocations().get("slow")
                return slow is not None and slow.size == 2
            return False

        wait_for("slow shrunk to 2", shrunk, deadline, operator)
        draining = {gpu: pid for gpu, pid in bound_workers(state)["slow"].items() if gpu >= 2}
        assert len(draining) == 2, bound_workers(state)

        if restart == "SIGKILL":
            operator.send_signal(signal.SIGKILL)
            operator.wait(30)
        else:
            operator.send_signal(signal.SIGTERM)
            assert operator.wait(60) == 0, log.read_text()[-3000:]
        time.sleep(1.0)
        operator = start_operator(argv, log)
        with GpuSharingSampler(state, interval=0.1) as sampler:
            wait_until_serving(state, operator, deadline)
            # Several of the operator's resyncs, each a chance to hand the GPUs on: what it
            # decides is in the store (its workers may take seconds more to show up).
            settle = time.monotonic() + 6.0
            granted_early: list[Any] = []
            while time.monotonic() < settle:
                assert operator.poll() is None, log.read_text()[-3000:]
                with contextlib.suppress(Exception), Store.open_readonly(state / "state.db") as s:
                    if placement := s.allocations().get("urgent"):
                        granted_early.append(placement)
                time.sleep(0.2)
            assert granted_early == [], f"urgent granted draining GPUs: {granted_early[:1]}"
            assert "urgent" not in bound_workers(state), "urgent started on draining GPUs"
            for pid in draining.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            granted = wait_for(
                "urgent's 2 workers",
                lambda: (
                    len(bound_workers(state).get("urgent", {})) == 2
                    and bound_workers(state)["urgent"]
                ),
                deadline,
                operator,
            )
        assert sampler.samples > 20 and sampler.shared == [], f"GPUs shared: {sampler.shared[:5]}"
        assert set(granted) == set(draining), "urgent gets the GPUs slow gave back"
    finally:
        stop_operator(operator)
