"""Real training under the operator against a bare `horovodrun`: resize-stall, training-overhead.

Both run the example, `examples/train_digits.py`, with `--step-log`: its rank 0
logs the wall time and world size of every step.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from herd_operator.bench.harness import (
    Context,
    Row,
    Stats,
    paired_ratio_figures,
    stop_session,
)
from herd_operator.layout import write_atomically
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.engines.horovod import horovodrun_executable
from herd_operator.runtime.log_format import LOG_TIME_PATTERN, parse_log_time
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.specs.values import Pool

REPO = Path(__file__).resolve().parents[2]
"""The checkout's root, in a checkout (an installed package has none)."""
_PACKAGED_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
TRAIN_SCRIPT = (
    _PACKAGED_SCRIPT if _PACKAGED_SCRIPT.is_file() else REPO / "examples" / "train_digits.py"
)
"""The example training script: an installed package carries it as herd_operator/examples/
(package data built from examples/), which a checkout does not have; there it is examples/."""
JOB = "bench-train"
HANG_GUARD_S = 180.0
BATCH_SIZE = 32  # examples/train_digits.py's default --batch-size
STEADY_STEPS = 20


def train_command(step_log: Path) -> list[str]:
    """The example training script itself, long enough to be stopped, logging every step."""
    return ["python", str(TRAIN_SCRIPT), "--epochs", "1000000", "--step-log", str(step_log)]


PRELOAD = ("torch", "horovod.torch", "torch._dynamo")
"""What `examples/train_digits.py` imports that takes time: its zygote's preload. torch 2.13's
`torch.optim` imports `torch._dynamo` when the optimizer is built (`torch._disable_dynamo`)."""


def training_spec(
    name: str, step_log: Path, min_np: int, max_np: int, size: int, preload: Sequence[str] = ()
) -> dict[str, Any]:
    """A HerdJob of the example training script held at `size` GPUs by the `static` policy
    (its local workers forked by a zygote that imported `preload`, when given)."""
    horovod = {"horovod": {"preload": list(preload)}} if preload else {}
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": name},
        "spec": {
            "command": train_command(step_log),
            "workingDir": str(step_log.parent),  # the run's own directory, never site-packages
            "gpus": {"min": min_np, "max": max_np},
            "policy": {"name": "static", "params": {"gpus": size}},
            **horovod,
        },
    }


@dataclass
class StepLog:
    """The step log of a run: (wall time, world size) per step of rank 0. Read on from where
    the last read stopped: the waits poll it every 10 ms while the runs train, and reading a
    log of thousands of steps whole each time took a tenth of a core from the jobs measured."""

    path: Path
    _parsed: list[tuple[float, int]] = field(default_factory=list, init=False, repr=False)
    _offset: int = field(default=0, init=False, repr=False)

    def steps(self) -> list[tuple[float, int]]:
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:
            return []
        whole = chunk[: chunk.rfind(b"\n") + 1]  # the last line may be half written
        self._offset += len(whole)
        for line in whole.decode().splitlines():
            fields = line.split()
            if len(fields) == 2:
                self._parsed.append((float(fields[0]), int(fields[1])))
        return list(self._parsed)

    def wait_steps(self, size: int, count: int, after: float) -> list[float]:
        """Times of the first `count` steps at world size `size` that ended after `after`."""
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            times = [at for at, world in self.steps() if world == size and at > after]
            if len(times) >= count:
                return times[:count]
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{len(times)} of {count} steps at world size {size} after"
                    f" {HANG_GUARD_S:.0f} s ({self.path})"
                )
            time.sleep(0.01)


def modified_at(path: Path) -> float:
    return path.stat().st_mtime_ns / 1e9


def granted_slots(text: str) -> int:
    """Slots in a grant file's `name:slots` lines (the operator shows one host under several
    names, so a grant of 4 on localhost may be `localhost:2` and `127.0.0.1:2`)."""
    return sum(int(line.rpartition(":")[2]) for line in text.splitlines() if ":" in line)


def wait_for_slots(path: Path, slots: int) -> float:
    """Wait until `path` grants `slots` slots in all; returns its modification time."""
    deadline = time.monotonic() + HANG_GUARD_S
    while True:
        with contextlib.suppress(FileNotFoundError, ValueError):
            if granted_slots(path.read_text()) == slots:
                return modified_at(path)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never granted {slots} slots")
        time.sleep(0.002)


# ---- bare horovodrun ----


@dataclass
class BareJob:
    hosts_file: Path
    log: StepLog

    def resize(self, size: int) -> float:
        """Edit the hosts file by hand; the trigger is the edit's instant."""
        write_atomically(self.hosts_file, f"localhost:{size}\n")
        return modified_at(self.hosts_file)


@contextlib.contextmanager
def bare_job(root: Path, size: int, min_np: int, max_np: int) -> Iterator[BareJob]:
    """`horovodrun` whose discovery script `cat`s a hand-edited file."""
    root.mkdir(parents=True)
    hosts_file = root / "hosts"
    write_atomically(hosts_file, f"localhost:{size}\n")
    script = root / "discover.sh"
    write_atomically(script, f"#!/bin/sh\nexec cat {hosts_file}\n", mode=0o755)
    log = StepLog(root / "steps.txt")
    argv = [
        horovodrun_executable(),
        "-np",
        str(size),
        "--min-np",
        str(min_np),
        "--max-np",
        str(max_np),
        "--host-discovery-script",
        str(script),
        "--network-interface",
        "lo",
        *train_command(log.path),
    ]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    with open(root / "horovodrun.log", "wb") as output:
        process = subprocess.Popen(
            argv, cwd=root, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield BareJob(hosts_file, log)
    finally:
        stop_session(process)


# ---- under the operator ----


@contextlib.contextmanager
def running_operator(root: Path) -> Iterator[Operator]:
    specs_dir = root / "jobs"
    specs_dir.mkdir(parents=True)
    # Its grants in its scratch dir, not /dev/shm: on a shared machine, another run's clean-up
    # of /dev/shm/herd-operator-* took a running bench's grants away (every launch after
    # that failed).
    runtime_base = root / "run"
    runtime_base.mkdir()
    config = OperatorConfig(
        specs_dir=specs_dir,
        state_dir=root / "state",
        pool=StaticPool(Pool.from_counts({"localhost": 4}), True, "bench pool"),
        relist_seconds=1.0,
        grace_seconds=5.0,
        # The trigger is the grant change itself; a resize freeze would only delay it.
        min_resize_interval=0.0,
        runtime_dir=runtime_base,
    )
    operator = Operator(config)
    stop = threading.Event()
    thread = threading.Thread(target=operator.run, args=(stop,), daemon=True)
    thread.start()
    try:
        if not operator.ready.wait(60):
            raise TimeoutError("the operator did not start")
        yield operator
    finally:
        stop.set()
        thread.join(HANG_GUARD_S)


@dataclass
class OperatorJob:
    operator: Operator
    min_np: int
    max_np: int
    log: StepLog
    preload: tuple[str, ...] = ()

    @property
    def spec_path(self) -> Path:
        return self.operator.config.specs_dir / f"{JOB}.yaml"

    def write_spec(self, size: int) -> None:
        document = training_spec(JOB, self.log.path, self.min_np, self.max_np, size, self.preload)
        tmp = self.spec_path.with_name(f".{JOB}.yaml.tmp")
        tmp.write_text(yaml.safe_dump(document))
        os.replace(tmp, self.spec_path)

    def resize(self, size: int) -> float:
        """Ask for `size` through the spec; the trigger is the allocator's grant change."""
        self.write_spec(size)
        return wait_for_slots(self.operator.layout.grant_file(JOB), size)


@contextlib.contextmanager
def operator_job(
    operator: Operator,
    root: Path,
    size: int,
    min_np: int,
    max_np: int,
    preload: Sequence[str] = (),
) -> Iterator[OperatorJob]:
    root.mkdir(parents=True)
    job = OperatorJob(operator, min_np, max_np, StepLog(root / "steps.txt"), tuple(preload))
    job.write_spec(size)
    try:
        yield job
    finally:
        withdraw(operator, job.spec_path)


def withdraw(operator: Operator, spec_path: Path) -> None:
    """Delete the bench job's spec and wait (bounded) until the operator gave back its GPUs."""
    spec_path.unlink(missing_ok=True)
    allocator = operator.allocator
    assert allocator is not None
    deadline = time.monotonic() + HANG_GUARD_S
    while allocator.grant(JOB) is not None and time.monotonic() < deadline:
        time.sleep(0.05)


# ---- resize-stall ----


def started_at(pid: int) -> float | None:
    """Wall-clock start of a process to the clock tick (~10 ms). psutil's `create_time`
    adds the tick count to the boot time in whole seconds, so it can be off by up to 1 s."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22: starttime
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


def first_worker_started(marker: str, after: float) -> float | None:
    """Start time of the first process started after `after` whose command line holds
    `marker` (the run's step-log path): the first new worker's process (its shim, or
    horovodrun's `sh -c env ...` wrapper)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(marker in a for a in cmdline):
            started = started_at(proc.pid)
            if started is not None and started > after:
                found.append(started)
    return min(found, default=None)


GRANT_SEEN = re.compile(rf"^({LOG_TIME_PATTERN}) herd-driver: grant seen:", re.MULTILINE)
WORKER_FORKED = re.compile(
    rf"^({LOG_TIME_PATTERN}) herd-driver: worker rank \d+ forked", re.MULTILINE
)


def first_worker_forked(driver_log: Path | None, after: float) -> float | None:
    """When the driver's zygote forked the first worker after `after` (the child has the
    zygote's command line: `first_worker_started` cannot tell it by its own)."""
    if driver_log is None or not driver_log.exists():
        return None
    text = driver_log.read_text(errors="replace")
    stamps = [parse_log_time(m) for m in WORKER_FORKED.findall(text)]
    return min((t for t in stamps if t > after), default=None)


def grant_seen(driver_log: Path | None, after: float) -> float | None:
    """When our driver logged that it saw a new grant, after `after` (None: bare run)."""
    if driver_log is None or not driver_log.exists():
        return None
    text = driver_log.read_text(errors="replace")
    stamps = [parse_log_time(m) for m in GRANT_SEEN.findall(text)]
    return min((t for t in stamps if t > after), default=None)


@dataclass
class GrowPhases:
    """Seconds of each phase of 2 -> 4 grows: trigger -> driver saw the grant (ours only),
    trigger -> first new worker process, that process -> first step at the new size."""

    seen: list[float]
    to_worker: list[float]
    worker_to_step: list[float]


def resize_stalls(
    resize: Callable[[int], float],
    log: StepLog,
    cycles: int,
    phases: GrowPhases | None = None,
    driver_log: Path | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds from each trigger to the first step at the new size: (2->4 list, 4->2 list)."""
    up, down = [], []
    last = log.wait_steps(2, STEADY_STEPS, 0.0)[-1]
    for _ in range(cycles):
        trigger = resize(4)
        first = log.wait_steps(4, 1, trigger)[0]
        up.append(first - trigger)
        if phases is not None:
            found = [
                first_worker_started(str(log.path), trigger),
                first_worker_forked(driver_log, trigger),
            ]
            started = min((t for t in found if t is not None), default=None)
            if started is not None:
                phases.to_worker.append(started - trigger)
                phases.worker_to_step.append(first - started)
            seen = grant_seen(driver_log, trigger)
            if seen is not None:
                phases.seen.append(seen - trigger)
        last = log.wait_steps(4, STEADY_STEPS, first)[-1]
        trigger = resize(2)
        first = log.wait_steps(2, 1, max(trigger, last))[0]
        down.append(first - trigger)
        log.wait_steps(2, STEADY_STEPS, first)
    return up, down


def run_resize_stall(ctx: Context) -> list[Row]:
    modes = ("bare", "driver", "zygote")
    up: dict[str, list[float]] = {mode: [] for mode in modes}
    down: dict[str, list[float]] = {mode: [] for mode in modes}
    phases = {mode: GrowPhases([], [], []) for mode in modes}
    dropped: dict[str, int] = {mode: 0 for mode in modes}
    with running_operator(ctx.scratch / "operator") as operator:
        for index in range(ctx.repeat):  # one cycle per job run; rotate which goes first
            round_up: dict[str, list[float]] = {}
            round_down: dict[str, list[float]] = {}
            round_phases = {mode: GrowPhases([], [], []) for mode in modes}
            for mode in modes[index % 3 :] + modes[: index % 3]:
                ctx.progress(f"resize-stall: run {index + 1}, {mode}")
                root = ctx.scratch / f"{mode}-{index}"
                try:
                    if mode == "bare":
                        with bare_job(root, 2, 2, 4) as hand_edited:
                            grown, shrunk = resize_stalls(
                                hand_edited.resize, hand_edited.log, 1, round_phases[mode]
                            )
                    else:
                        preload = PRELOAD if mode == "zygote" else ()
                        with operator_job(operator, root, 2, 2, 4, preload) as job:
                            driver_log = operator.layout.log_file(JOB)
                            grown, shrunk = resize_stalls(
                                job.resize, job.log, 1, round_phases[mode], driver_log
                            )
                except TimeoutError as err:
                    # One stuck run (a loaded machine) costs its round, not the whole run; the
                    # round is dropped in every mode so that the pairs stay pairs.
                    ctx.progress(f"resize-stall: run {index + 1}, {mode} dropped: {err}")
                    dropped[mode] += 1
                    break
                round_up[mode] = grown
                round_down[mode] = shrunk
                ctx.progress(
                    f"resize-stall: run {index + 1}, {mode}: 2->4 {grown[0]:.2f} s,"
                    f" 4->2 {shrunk[0]:.2f} s"
                )
            else:
                for mode in modes:
                    up[mode] += round_up[mode]
                    down[mode] += round_down[mode]
                    for name in ("seen", "to_worker", "worker_to_step"):
                        getattr(phases[mode], name).extend(getattr(round_phases[mode], name))
    if not up["bare"]:
        raise TimeoutError(f"every round was dropped (stuck runs by mode: {dropped})")
    return _stall_rows(up, down, phases, dropped)


def _stall_rows(
    up: dict[str, list[float]],
    down: dict[str, list[float]],
    phases: dict[str, GrowPhases],
    dropped: dict[str, int],
) -> list[Row]:
    """The grow and shrink rows of the driver and of the zygote, each against bare."""
    rows = []
    for mode, how in (("driver", ""), ("zygote", ", workers forked by a zygote")):
        for label, ours, bare in (
            ("2->4", up[mode], up["bare"]),
            ("4->2", down[mode], down["bare"]),
        ):
            rows.append(
                Row(
                    name=f"resize-stall {label}" + (" zygote" if mode == "zygote" else ""),
                    what="grant change -> first training step completed at the new world size"
                    + how,
                    unit="s",
                    better="lower",
                    baseline_label="bare horovodrun, hosts file edited by hand",
                    baseline=Stats.of(bare),
                    ours=Stats.of(ours),
                    extra={
                        **{f"dropped_rounds_{m}_stuck": n for m, n in dropped.items() if n},
                        **paired_ratio_figures(ours, bare),
                        **(phase_figures(phases[mode], phases["bare"]) if label == "2->4" else {}),
                    },
                )
            )
    return rows


def phase_figures(ours: GrowPhases, bare: GrowPhases) -> dict[str, float]:
    """Medians of each phase of the grows, per mode."""
    figures: dict[str, float] = {}
    for mode, phases in (("ours", ours), ("baseline", bare)):
        for name, values in (
            ("grant_seen_s", phases.seen),
            ("to_first_worker_process_s", phases.to_worker),
            ("worker_process_to_first_step_s", phases.worker_to_step),
        ):
            if values:
                figures[f"{mode}_{name}"] = Stats.of(values).median
    return figures


# ---- training-overhead ----


def samples_per_second(times: list[float], world: int) -> float:
    return (len(times) - 1) * BATCH_SIZE * world / (times[-1] - times[0])


def job_cpu_seconds(marker: str) -> float:
    """User + system CPU so far of the live processes whose command line holds `marker`
    (the run's own step-log path): its `horovodrun` and its workers.

    Unlike samples/s, CPU per sample barely moves with what else runs on the machine, so
    it tells work the operator adds to the job from time the job waited for a core.
    """
    total = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline = proc.info["cmdline"] or []
        times = proc.info["cpu_times"]
        if times is not None and any(marker in part for part in cmdline):
            total += times.user + times.system
    return total


def run_training_overhead(ctx: Context) -> list[Row]:
    skip, measure = (20, 100) if ctx.quick else (50, 400)
    ours: list[float] = []
    bare: list[float] = []
    # CPU of this process (the operator's threads, and the step-log polling that both
    # modes do) per second of wall time while the job trains.
    ours_cpu: list[float] = []
    bare_cpu: list[float] = []
    # CPU of the job's own processes per sample trained.
    ours_job_cpu: list[float] = []
    bare_job_cpu: list[float] = []
    with running_operator(ctx.scratch / "operator") as operator:
        for index in range(ctx.repeat):
            runs = ("bare", "operator") if index % 2 == 0 else ("operator", "bare")
            for mode in runs:
                ctx.progress(f"training-overhead: run {index + 1}, {mode}")
                root = ctx.scratch / f"{mode}-{index}"
                job: BareJob | OperatorJob
                with (
                    bare_job(root, 2, 2, 2)
                    if mode == "bare"
                    else operator_job(operator, root, 2, 2, 2)
                ) as job:
                    job.log.wait_steps(2, skip, 0.0)
                    marker = str(job.log.path)
                    cpu, wall = time.process_time(), time.monotonic()
                    job_cpu = job_cpu_seconds(marker)
                    times = job.log.wait_steps(2, skip + measure, 0.0)[skip:]
                    job_cpu = job_cpu_seconds(marker) - job_cpu
                    cpu_share = (time.process_time() - cpu) / (time.monotonic() - wall)
                (bare if mode == "bare" else ours).append(samples_per_second(times, 2))
                (bare_cpu if mode == "bare" else ours_cpu).append(cpu_share)
                samples = (len(times) - 1) * BATCH_SIZE * 2
                (bare_job_cpu if mode == "bare" else ours_job_cpu).append(job_cpu / samples)
    return [
        Row(
            name="training-overhead (2 workers)",
            what=f"samples/s over {measure} steps after {skip} warm-up steps; goal ratio >= 0.98",
            unit="samples/s",
            better="higher",
            baseline_label="bare horovodrun",
            baseline=Stats.of(bare),
            ours=Stats.of(ours),
            extra={
                **paired_ratio_figures(ours, bare),
                "ours_bench_process_cpu_share": Stats.of(ours_cpu).median,
                "baseline_bench_process_cpu_share": Stats.of(bare_cpu).median,
                "ours_job_cpu_us_per_sample": Stats.of(ours_job_cpu).median * 1e6,
                "baseline_job_cpu_us_per_sample": Stats.of(bare_job_cpu).median * 1e6,
            },
        )
    ]
