"""The torchrun engine against bare `torchrun`: torchrun-resize-stall, torchrun-training-overhead,
torchrun-idle-cost.

Every job here runs `examples/train_torchrun.py` (the digits CNN of `train_digits.py`, over
Gloo on CPU) with `--step-log` (rank 0 logs each step's wall time and world size) and
`--phase-log` (rank 0 logs when each start of its worker reached each phase). The baseline
is what a user runs without us: `torchrun --nnodes=MIN:MAX --nproc-per-node=1
--rdzv-backend=c10d` agents on one endpoint, the first of them hosting the store, started
and stopped by hand to resize, with the same rendezvous settings as the engine's defaults.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from herd_operator.bench.driver import IDLE_WORKER, driven, idle_job, tree_cpu_seconds
from herd_operator.bench.harness import (
    Context,
    Row,
    Stats,
    missing_modules,
    paired_ratio_figures,
    stop_session,
)
from herd_operator.bench.training import (
    BATCH_SIZE,
    HANG_GUARD_S,
    REPO,
    STEADY_STEPS,
    StepLog,
    job_cpu_seconds,
    modified_at,
    operator_job,
    resize_stalls,
    running_operator,
    samples_per_second,
    withdraw,
)
from herd_operator.layout import write_atomically
from herd_operator.runtime.engines.torchrun import (
    AGENT_MODULE,
    DRIVER_MODULE,
    KEEP_ALIVE_ATTEMPTS,
    LOOPBACK,
    driver_argv,
)
from herd_operator.runtime.engines.torchrun_driver import AGENT_ENV
from herd_operator.runtime.engines.torchrun_options import TorchrunOptions
from herd_operator.runtime.operator import Operator
from herd_operator.specs.loading import load_spec_document

_PACKAGED_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "train_torchrun.py"
SCRIPT = _PACKAGED_SCRIPT if _PACKAGED_SCRIPT.is_file() else REPO / "examples" / "train_torchrun.py"
JOB = "bench-torchrun"
OPTIONS = TorchrunOptions()
"""The engine's defaults, which the bare agents are given too."""
PHASES = ("process", "script", "imports", "rendezvous", "snapshot")
"""What `train_torchrun.py --phase-log` logs for each start of rank 0's worker, in order."""
STALL_PARTS = (
    ("agents", "process"),
    ("interpreter", "script"),
    ("imports", "imports"),
    ("init_process_group", "rendezvous"),
    ("data_model_snapshot", "snapshot"),
)
"""A stall's parts, each ending at a phase: from the trigger to the worker's process (the
agents notice, meet at their rendezvous and stop the old workers), to the script's first line
(the interpreter, and under us the shim's bind), to the end of the imports (torch), to
`init_process_group`'s return (the workers' own rendezvous), to the snapshot loaded (the data,
the model); then `first_step` to the first step at the new size."""


def script_args(root: Path) -> list[str]:
    """The example, long enough to be stopped, logging its steps and phases into `root`."""
    return [
        str(SCRIPT), "--epochs", "1000000", "--snapshot", str(root / "snapshot.pt"),
        "--step-log", str(root / "steps.txt"), "--phase-log", str(root / "phases.txt"),
    ]  # fmt: skip


def rendezvous_conf(options: TorchrunOptions) -> str:
    return ",".join(
        [
            f"join_timeout={options.join_timeout_seconds}",
            f"last_call_timeout={options.last_call_seconds}",
            f"keep_alive_interval={options.keep_alive_seconds}",
            f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}",
        ]
    )


def bare_agent_argv(endpoint: str, min_np: int, max_np: int, command: Sequence[str]) -> list[str]:
    """One bare `torchrun` agent of a job of `min_np`..`max_np` nodes at `endpoint`."""
    return [
        sys.executable, "-m", AGENT_MODULE, f"--nnodes={min_np}:{max_np}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=bench",
        f"--rdzv-conf={rendezvous_conf(OPTIONS)}", f"--max-restarts={OPTIONS.max_restarts}",
        f"--monitor-interval={OPTIONS.monitor_interval_seconds}", "--no-python", *command,
    ]  # fmt: skip


def free_port() -> int:
    """A port free now, for the bare job's `--rdzv-endpoint` (as a user picks one)."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


@dataclass
class BareTorchrun:
    """Bare torchrun agents, one per slot; resized by starting agents or SIGTERM to the newest
    (the first hosts the store, as with bare torchrun). The trigger is that instant."""

    argv: list[str]
    log: StepLog
    output: Path
    agents: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, count: int) -> float:
        at = time.time()
        env = {**os.environ, **AGENT_ENV}  # the grow deadlock torchrun_driver.AGENT_ENV avoids
        with self.output.open("ab") as output:
            for _ in range(count):
                self.agents.append(
                    subprocess.Popen(
                        self.argv,
                        env=env,
                        stdout=output,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        return at

    def resize(self, size: int) -> float:
        running = [agent for agent in self.agents if agent.poll() is None]
        if size >= len(running):
            return self.start(size - len(running))
        at = time.time()
        for agent in running[size:]:
            agent.send_signal(signal.SIGTERM)
        return at


@contextlib.contextmanager
def bare_torchrun(root: Path, size: int, min_np: int, max_np: int) -> Iterator[BareTorchrun]:
    root.mkdir(parents=True)
    endpoint = f"{LOOPBACK}:{free_port()}"
    command = [sys.executable, *script_args(root)]
    job = BareTorchrun(
        bare_agent_argv(endpoint, min_np, max_np, command),
        StepLog(root / "steps.txt"),
        root / "agents.log",
    )
    try:
        job.start(size)
        yield job
    finally:
        for agent in job.agents:
            stop_session(agent)


def torchrun_spec(root: Path, min_np: int, max_np: int, size: int) -> dict[str, Any]:
    """The example as a torchrun job held at `size` GPUs by the `static` policy."""
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": JOB},
        "spec": {
            "command": ["python", *script_args(root)],
            "workingDir": str(root),
            "gpus": {"min": min_np, "max": max_np},
            "policy": {"name": "static", "params": {"gpus": size}},
            "engine": {"kind": "torchrun"},
        },
    }


@dataclass
class OperatorTorchrun:
    operator: Operator
    root: Path
    min_np: int
    max_np: int
    log: StepLog

    @property
    def spec_path(self) -> Path:
        return self.operator.config.specs_dir / f"{JOB}.yaml"

    def write_spec(self, size: int) -> None:
        document = torchrun_spec(self.root, self.min_np, self.max_np, size)
        write_atomically(self.spec_path, yaml.safe_dump(document))

    def resize(self, size: int) -> float:
        """Ask for `size` through the spec; the trigger is the grant file's change."""
        self.write_spec(size)
        grant = self.operator.layout.grant_file(JOB)
        deadline = time.monotonic() + HANG_GUARD_S
        while True:
            with contextlib.suppress(FileNotFoundError):
                if len(grant.read_text().split("\n")) - 1 == size:  # one `HOST GPU` line a slot
                    return modified_at(grant)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{grant} never granted {size} slots")
            time.sleep(0.002)


@contextlib.contextmanager
def operator_torchrun(
    operator: Operator, root: Path, size: int, min_np: int, max_np: int
) -> Iterator[OperatorTorchrun]:
    root.mkdir(parents=True)
    job = OperatorTorchrun(operator, root, min_np, max_np, StepLog(root / "steps.txt"))
    job.write_spec(size)
    try:
        yield job
    finally:
        withdraw(operator, job.spec_path)


# ---- torchrun-resize-stall ----


def read_phases(path: Path) -> list[tuple[float, str, int]]:
    """(wall time, phase, world size) of each line of a phase log (a half-written last line
    is skipped)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in PHASES and fields[2].isdigit():
            lines.append((float(fields[0]), fields[1], int(fields[2])))
    return lines


def stall_parts(
    lines: Sequence[tuple[float, str, int]], world: int, trigger: float, first_step: float
) -> dict[str, float] | None:
    """Seconds of each part of a stall (`STALL_PARTS`, then `first_step`): from the last
    complete start of a worker at `world` whose process began after `trigger` and whose
    snapshot was loaded before `first_step`. None when there is no such start."""
    starts: list[dict[str, float]] = []
    for at, phase, size in lines:
        if phase == PHASES[0]:
            starts.append({})
        if starts and size == world:
            starts[-1][phase] = at
    found = [
        start
        for start in starts
        if set(start) == set(PHASES)
        and start["process"] >= trigger
        and start["snapshot"] <= first_step
    ]
    if not found:
        return None
    start = max(found, key=lambda phases: phases["snapshot"])
    parts, since = {}, trigger
    for part, phase in STALL_PARTS:
        parts[part] = start[phase] - since
        since = start[phase]
    parts["first_step"] = first_step - since
    return parts


def gap_before(log: StepLog, first: float) -> float:
    """Seconds without a step before `first` (a grow's old workers train on for a while)."""
    return first - max((at for at, _ in log.steps() if at < first), default=first)


@dataclass
class StallSamples:
    """One mode's stalls: seconds from each trigger to the first step at the new size, the
    time without a step before it, and the parts of each."""

    stall: list[float] = field(default_factory=list)
    gap: list[float] = field(default_factory=list)
    parts: list[dict[str, float]] = field(default_factory=list)


def torchrun_cycle(
    resize: Callable[[int], float], log: StepLog, phases: Path
) -> tuple[StallSamples, StallSamples]:
    """2 steady -> 4 -> 2: the (grow, shrink) samples."""
    grow, shrink = StallSamples(), StallSamples()
    last = log.wait_steps(2, STEADY_STEPS, 0.0)[-1]
    for size, samples in ((4, grow), (2, shrink)):
        trigger = resize(size)
        first = log.wait_steps(size, 1, max(trigger, last))[0]
        samples.stall.append(first - trigger)
        samples.gap.append(gap_before(log, first))
        parts = stall_parts(read_phases(phases), size, trigger, first)
        if parts is not None:
            samples.parts.append(parts)
        last = log.wait_steps(size, STEADY_STEPS, first)[-1]
    return grow, shrink


def merge(into: StallSamples, more: StallSamples) -> None:
    into.stall += more.stall
    into.gap += more.gap
    into.parts += more.parts


def run_torchrun_resize_stall(ctx: Context) -> list[Row]:
    horovod = not missing_modules(("horovod.torch",))
    modes = ("bare", "ours", "horovod") if horovod else ("bare", "ours")
    grows = {mode: StallSamples() for mode in modes}
    shrinks = {mode: StallSamples() for mode in modes}
    dropped = 0
    with running_operator(ctx.scratch / "operator") as operator:
        for index in range(ctx.repeat):  # rotate which mode goes first
            rounds: dict[str, tuple[StallSamples, StallSamples]] = {}
            for mode in modes[index % len(modes) :] + modes[: index % len(modes)]:
                ctx.progress(f"torchrun-resize-stall: run {index + 1}, {mode}")
                try:
                    grow, shrink = stall_cycle(operator, ctx.scratch / f"{mode}-{index}", mode)
                except TimeoutError as err:
                    # As resize-stall does: a stuck run costs its round in every mode, so
                    # that the pairs stay pairs.
                    ctx.progress(f"torchrun-resize-stall: run {index + 1}, {mode} dropped: {err}")
                    dropped += 1
                    break
                rounds[mode] = grow, shrink
                ctx.progress(
                    f"torchrun-resize-stall: run {index + 1}, {mode}: 2->4 {grow.stall[0]:.2f} s,"
                    f" 4->2 {shrink.stall[0]:.2f} s"
                )
            else:
                for mode, (grow, shrink) in rounds.items():
                    merge(grows[mode], grow)
                    merge(shrinks[mode], shrink)
    if not grows["bare"].stall:
        raise TimeoutError(f"every one of {dropped} rounds was dropped")
    return [stall_row("2->4", grows, dropped), stall_row("4->2", shrinks, dropped)]


def stall_cycle(operator: Operator, root: Path, mode: str) -> tuple[StallSamples, StallSamples]:
    """One job of `mode` (bare, ours, horovod) at 2, grown to 4 and shrunk to 2."""
    if mode == "bare":
        with bare_torchrun(root, 2, 2, 4) as bare:
            return torchrun_cycle(bare.resize, bare.log, root / "phases.txt")
    if mode == "ours":
        with operator_torchrun(operator, root, 2, 2, 4) as ours:
            return torchrun_cycle(ours.resize, ours.log, root / "phases.txt")
    # The Horovod engine's driver on train_digits.py: resize-stall's own path.
    with operator_job(operator, root, 2, 2, 4) as job:
        up, down = resize_stalls(job.resize, job.log, 1)
    return StallSamples(stall=up), StallSamples(stall=down)


def parts_figures(prefix: str, parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median of each part of the stalls, as `{prefix}_{part}_s`."""
    if not parts:
        return {}
    return {
        f"{prefix}_{name}_s": Stats.of([sample[name] for sample in parts]).median
        for name in parts[0]
    }


def stall_row(label: str, samples: dict[str, StallSamples], dropped: int) -> Row:
    ours, bare = samples["ours"], samples["bare"]
    extra = {
        **({"dropped_rounds_stuck": dropped} if dropped else {}),
        **paired_ratio_figures(ours.stall, bare.stall),
        "ours_gap_without_step_s": Stats.of(ours.gap).median,
        "baseline_gap_without_step_s": Stats.of(bare.gap).median,
        **parts_figures("ours", ours.parts),
        **parts_figures("baseline", bare.parts),
    }
    if "horovod" in samples:
        horovod = Stats.of(samples["horovod"].stall).median
        extra["horovod_engine_median_s"] = horovod
        extra["ours_over_horovod_engine"] = Stats.of(ours.stall).median / horovod
    return Row(
        name=f"torchrun-resize-stall {label}",
        what="grant change -> first training step completed at the new world size"
        " (every worker restarts from the job's snapshot); goal ratio <= 1.1",
        unit="s",
        better="lower",
        baseline_label="bare torchrun --nnodes=2:4 c10d, an agent started/stopped by hand",
        baseline=Stats.of(bare.stall),
        ours=Stats.of(ours.stall),
        extra=extra,
    )


# ---- torchrun-training-overhead ----


def launcher_cpu_seconds(marker: str) -> float:
    """CPU so far of the job's launch processes (our driver, the torchrun agents) whose
    command line holds `marker`; the workers are not counted."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmdline = proc.info["cmdline"] or []
        times = proc.info["cpu_times"]
        launcher = AGENT_MODULE in cmdline or DRIVER_MODULE in cmdline
        if times is not None and launcher and any(marker in part for part in cmdline):
            total += times.user + times.system
    return total


def run_torchrun_training_overhead(ctx: Context) -> list[Row]:
    skip, measure = (20, 100) if ctx.quick else (100, 3000)
    rates: dict[str, list[float]] = {"bare": [], "ours": []}
    job_cpu: dict[str, list[float]] = {"bare": [], "ours": []}
    launcher_cpu: dict[str, list[float]] = {"bare": [], "ours": []}
    with running_operator(ctx.scratch / "operator") as operator:
        for index in range(ctx.repeat):
            for mode in ("bare", "ours") if index % 2 == 0 else ("ours", "bare"):
                ctx.progress(f"torchrun-training-overhead: run {index + 1}, {mode}")
                root = ctx.scratch / f"{mode}-{index}"
                job: BareTorchrun | OperatorTorchrun
                with (
                    bare_torchrun(root, 2, 2, 2)
                    if mode == "bare"
                    else operator_torchrun(operator, root, 2, 2, 2)
                ) as job:
                    job.log.wait_steps(2, skip, 0.0)
                    marker = str(job.log.path)
                    wall = time.monotonic()
                    cpu, launch = job_cpu_seconds(marker), launcher_cpu_seconds(marker)
                    times = job.log.wait_steps(2, skip + measure, 0.0)[skip:]
                    cpu = job_cpu_seconds(marker) - cpu
                    launch = launcher_cpu_seconds(marker) - launch
                    wall = time.monotonic() - wall
                rates[mode].append(samples_per_second(times, 2))
                job_cpu[mode].append(cpu / ((len(times) - 1) * BATCH_SIZE * 2))
                launcher_cpu[mode].append(launch / wall * 60)
    return [
        Row(
            name="torchrun-training-overhead (2 workers)",
            what=f"samples/s over {measure} steps after {skip} warm-up steps, torchrun engine;"
            " goal ratio >= 0.98",
            unit="samples/s",
            better="higher",
            baseline_label="bare torchrun, 2 agents",
            baseline=Stats.of(rates["bare"]),
            ours=Stats.of(rates["ours"]),
            extra={
                **paired_ratio_figures(rates["ours"], rates["bare"]),
                "ours_job_cpu_us_per_sample": Stats.of(job_cpu["ours"]).median * 1e6,
                "baseline_job_cpu_us_per_sample": Stats.of(job_cpu["bare"]).median * 1e6,
                "ours_launch_tree_cpu_s_per_min": Stats.of(launcher_cpu["ours"]).median,
                "baseline_launch_tree_cpu_s_per_min": Stats.of(launcher_cpu["bare"]).median,
            },
        )
    ]


# ---- torchrun-idle-cost ----

IDLE_SLOTS = 2


def tree_rss_mib(root: int) -> float:
    """Resident memory of `root` and its live descendants, the idle workers excluded."""
    top = psutil.Process(root)
    total = 0
    for proc in [top, *top.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if proc.name() != IDLE_WORKER[0]:
                total += proc.memory_info().rss
    return total / 2**20


@contextlib.contextmanager
def idle_torchrun(root: Path, slots: int) -> Iterator[int]:
    """The torchrun engine's driver on `slots` local GPUs, each worker a `sleep`; yields its
    pid once every worker runs."""
    root.mkdir(parents=True)
    grant = root / "grant"
    write_atomically(grant, "".join(f"localhost {gpu}\n" for gpu in range(slots)))
    document = {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "idle"},
        "spec": {"command": IDLE_WORKER, "gpus": {"min": 1, "max": slots}},
    }
    job = load_spec_document(document, "idle").job
    assert job is not None
    argv = driver_argv("idle", job.spec, grant, sys.executable, LOOPBACK)
    with driven(argv, root / "driver.log", slots) as pid:
        yield pid


def idle_cost(job: contextlib.AbstractContextManager[int], window: float) -> tuple[float, float]:
    """(CPU seconds per minute, RSS in MiB at the end) of an idle job's launch tree."""
    with job as pid:
        time.sleep(2.0)  # past the start
        cpu, wall = tree_cpu_seconds(pid), time.monotonic()
        time.sleep(window)
        used = tree_cpu_seconds(pid) - cpu
        return used / (time.monotonic() - wall) * 60, tree_rss_mib(pid)


def run_torchrun_idle_cost(ctx: Context) -> list[Row]:
    window = 3.0 if ctx.quick else 30.0
    cpu: dict[str, list[float]] = {"horovod": [], "ours": []}
    rss: dict[str, list[float]] = {"horovod": [], "ours": []}
    for index in range(ctx.repeat):
        for mode in ("horovod", "ours") if index % 2 == 0 else ("ours", "horovod"):
            ctx.progress(f"torchrun-idle-cost: run {index + 1}, {mode}")
            root = ctx.scratch / f"{mode}-{index}"
            job = (
                idle_torchrun(root, IDLE_SLOTS)
                if mode == "ours"
                else idle_job(root, "ours", IDLE_SLOTS)
            )
            per_minute, resident = idle_cost(job, window)
            cpu[mode].append(per_minute)
            rss[mode].append(resident)
    what = (
        f"a {IDLE_SLOTS}-GPU job whose workers sleep, over {window:.0f} s: the launch tree"
        " (workers excluded): the torchrun driver and its agents"
    )
    return [
        Row(
            name=f"torchrun-idle-cost CPU ({IDLE_SLOTS} GPUs)",
            what=what,
            unit="CPU-s/min",
            better="lower",
            baseline_label="the Horovod engine's driver (in-process ElasticDriver)",
            baseline=Stats.of(cpu["horovod"]),
            ours=Stats.of(cpu["ours"]),
            extra=paired_ratio_figures(cpu["ours"], cpu["horovod"]),
        ),
        Row(
            name=f"torchrun-idle-cost RSS ({IDLE_SLOTS} GPUs)",
            what=what,
            unit="MiB",
            better="lower",
            baseline_label="the Horovod engine's driver (in-process ElasticDriver)",
            baseline=Stats.of(rss["horovod"]),
            ours=Stats.of(rss["ours"]),
        ),
    ]
