"""Control-plane latency and cost: spec-to-launch, decision-to-grant, discovery-cost.

These run the operator's real code paths with `horovodrun` replaced by a tiny
script that records when it started, so they measure the operator alone.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import random
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import yaml

from herd_operator.bench.harness import Context, Row, Stats
from herd_operator.bench.jobs import bench_job
from herd_operator.environment import JOB_ENV
from herd_operator.layout import StateLayout, write_atomically
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Demand, Placement, Pool

MARKS_ENV = "HERD_BENCH_MARKS"
"""The directory where the fake horovodrun writes its start time, to a file named after the
job: set by the operator (a spec's `env` reaches the workers only, not horovodrun)."""
POLL_SECONDS = 0.010
HANG_GUARD_S = 60.0

# Stands in for horovodrun: records its start (wall clock, as time.time()) and waits.
FAKE_HOROVODRUN = f"""#!/bin/sh
date +%s.%N > "${MARKS_ENV}/${JOB_ENV}"
exec sleep 600
"""


def write_fake_horovodrun(directory: Path) -> Path:
    script = directory / "fake-horovodrun"
    write_atomically(script, FAKE_HOROVODRUN, mode=0o755)
    return script


def read_mark(mark: Path, timeout: float = HANG_GUARD_S) -> float:
    """The start time a fake horovodrun wrote to `mark` (polled until complete)."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ValueError):
            text = mark.read_text()
            if text.endswith("\n"):
                return float(text)
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing started within {timeout:.0f} s (no {mark})")
        time.sleep(0.001)


def wait_until(probe: Callable[[], bool], what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.005)


def spec_text(name: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            # The bare launcher: the fake `horovodrun` marks the instant the launch command
            # runs (the default driver would start Horovod's real driver instead).
            "spec": {
                "command": ["true"],
                "gpus": {"min": 1, "max": 1},
                "horovod": {"launcher": "horovodrun"},
            },
        }
    )


def rename_into(directory: Path, file_name: str, text: str) -> float:
    """Write atomically as users are told to; returns the instant of the rename."""
    tmp = directory / f".{file_name}.tmp"
    tmp.write_text(text)
    renamed_at = time.time()
    os.replace(tmp, directory / file_name)
    return renamed_at


@contextlib.contextmanager
def running_operator(
    root: Path, fake: Path, marks: Path, *, watch_events: bool
) -> Iterator[Operator]:
    """A real operator in a thread, its horovodrun replaced by `fake` writing to `marks`."""
    specs_dir = root / "jobs"
    specs_dir.mkdir(parents=True)
    config = OperatorConfig(
        specs_dir=specs_dir,
        state_dir=root / "state",
        pool=StaticPool(Pool.from_counts({"localhost": 4}), True, "bench pool"),
        relist_seconds=60.0 if watch_events else 1.0,
        watch_events=watch_events,
        grace_seconds=2.0,
        min_resize_interval=0.0,
        extra_env={MARKS_ENV: str(marks)},
    )
    operator = Operator(config)
    stop = threading.Event()
    with mock.patch(
        "herd_operator.runtime.engines.horovod.horovodrun_executable", return_value=str(fake)
    ):
        thread = threading.Thread(target=operator.run, args=(stop,), daemon=True)
        thread.start()
        try:
            if not operator.ready.wait(HANG_GUARD_S):
                raise TimeoutError("the operator did not start")
            yield operator
        finally:
            stop.set()
            thread.join(HANG_GUARD_S)


def _operator_samples(ctx: Context, fake: Path, *, watch_events: bool) -> list[float]:
    root = ctx.scratch / ("events" if watch_events else "relist")
    marks = root / "marks"
    marks.mkdir(parents=True)
    samples = []
    rng = random.Random(3)
    with running_operator(root, fake, marks, watch_events=watch_events) as operator:
        specs_dir = operator.config.specs_dir
        for index in range(ctx.repeat + 1):  # the first one warms up
            name = f"bench-{index}"
            mark = marks / name
            # Users write at any moment, not just after a relist: a random phase.
            time.sleep(rng.uniform(0, operator.config.relist_seconds if not watch_events else 0.05))
            renamed_at = rename_into(specs_dir, f"{name}.yaml", spec_text(name))
            latency = read_mark(mark) - renamed_at
            if index:
                samples.append(latency)
            # Delete it and wait for its GPU to come back, so every job starts the same way.
            (specs_dir / f"{name}.yaml").unlink()
            wait_until(functools.partial(_released, operator, name), f"{name} to be released")
    return samples


def _poll_then_launch(
    path: Path, mark: Path, fake: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while time.monotonic() < deadline:
        try:
            os.stat(path)
        except FileNotFoundError:
            time.sleep(POLL_SECONDS)
            continue
        env = {**os.environ, MARKS_ENV: str(mark.parent), JOB_ENV: mark.name}
        started.append(subprocess.Popen([str(fake)], env=env, start_new_session=True))
        return


def _released(operator: Operator, job: str) -> bool:
    return operator.allocator is not None and operator.allocator.grant(job) is None


def _polling_samples(ctx: Context, fake: Path) -> list[float]:
    """A careful script: stat the path every 10 ms and start horovodrun when it appears."""
    directory = ctx.scratch / "poll"
    directory.mkdir()
    path = directory / "job.yaml"
    samples = []
    rng = random.Random(5)
    for index in range(ctx.repeat + 1):  # the first one warms up
        mark = directory / f"mark-{index}"
        started: list[subprocess.Popen[bytes]] = []
        poller = threading.Thread(
            target=_poll_then_launch, args=(path, mark, fake, started), daemon=True
        )
        poller.start()
        # The loop is in its steady state, and the rename comes at a random phase of it.
        time.sleep(POLL_SECONDS * 3 + rng.uniform(0, POLL_SECONDS))
        renamed_at = rename_into(directory, path.name, "kind: HerdJob\n")
        latency = read_mark(mark) - renamed_at
        poller.join(HANG_GUARD_S)
        for process in started:
            process.kill()
            process.wait()
        path.unlink()
        if index:
            samples.append(latency)
    return samples


def run_spec_to_launch(ctx: Context) -> list[Row]:
    fake = write_fake_horovodrun(ctx.scratch)
    baseline = Stats.of([s * 1000 for s in _polling_samples(ctx, fake)])
    rows = []
    for watch_events, label in ((True, "inotify"), (False, "relist 1 s, as on NFS")):
        ctx.progress(f"spec-to-launch: operator, {label}")
        ours = Stats.of([s * 1000 for s in _operator_samples(ctx, fake, watch_events=watch_events)])
        rows.append(
            Row(
                name=f"spec-to-launch ({label})",
                what="rename of a new spec file -> horovodrun process started",
                unit="ms",
                better="lower",
                baseline_label="os.stat poll every 10 ms + Popen",
                baseline=baseline,
                ours=ours,
                extra={"ours_p95_ms": ours.p95, "baseline_p95_ms": baseline.p95},
            )
        )
    return rows


# ---- decision-to-grant ----

# Runs a discovery script in a loop, as Horovod's driver does (there every second),
# and prints each new output with the wall time it was first seen.
READER = """
import subprocess, sys, time
last = None
while True:
    out = subprocess.run([sys.argv[1]], stdout=subprocess.PIPE, check=False).stdout
    if out != last:
        last = out
        print(repr(time.time()), out.decode().strip().replace("\\n", ","), flush=True)
    time.sleep(0.002)
"""


class DiscoveryReader:
    """A subprocess running a discovery script in a loop; yields (time, output) changes."""

    def __init__(self, script: Path) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", READER, str(script)], stdout=subprocess.PIPE, text=True
        )
        self._lines: queue.Queue[tuple[float, str]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            seen, _, output = line.strip().partition(" ")
            self._lines.put((float(seen), output))

    def wait_for(self, output: str, timeout: float = HANG_GUARD_S) -> float:
        """The time the script first printed `output` (lines joined by commas)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                seen, text = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"the discovery script never printed {output!r}") from None
            if text == output:
                return seen

    def close(self) -> None:
        self._process.kill()
        self._process.wait()


def run_decision_to_grant(ctx: Context) -> list[Row]:
    # The job only grows, one GPU per sample: a GPU taken from a running job drains
    # before it can be granted again, and that wait is not what this measures.
    gpus = ctx.repeat + 2
    layout = StateLayout(ctx.scratch / "state")
    layout.create()
    store = Store(layout.database)
    store.record_spec("bench", "jobs/bench.yaml", bench_job("bench"), "fingerprint", time.time())
    publisher = GrantPublisher(layout)
    allocator = Allocator(
        Pool.from_counts({"localhost": gpus}),
        publisher,
        virtual=True,
        on_decision=lambda decision: store.replace_allocations(
            decision.placements, time.time(), decision.draining
        ),
    )
    allocator.request(Demand("bench", 1, gpus, 1))
    hand_file = ctx.scratch / "hand.hosts"
    write_atomically(hand_file, "localhost:1\n")
    hand_script = ctx.scratch / "hand.discover.sh"
    write_atomically(hand_script, f"#!/bin/sh\nexec cat {hand_file}\n", mode=0o755)
    ours_reader = DiscoveryReader(publisher.discovery_script("bench"))
    hand_reader = DiscoveryReader(hand_script)
    ours: list[float] = []
    baseline: list[float] = []
    try:
        ours_reader.wait_for("localhost:1")
        hand_reader.wait_for("localhost:1")
        for size in range(2, gpus + 1):  # the first one warms up
            changed_at = time.time()
            allocator.request(Demand("bench", 1, gpus, size))
            ours_ms = (ours_reader.wait_for(f"localhost:{size}") - changed_at) * 1000
            changed_at = time.time()
            write_atomically(hand_file, f"localhost:{size}\n")
            hand_ms = (hand_reader.wait_for(f"localhost:{size}") - changed_at) * 1000
            if size > 2:
                ours.append(ours_ms)
                baseline.append(hand_ms)
    finally:
        ours_reader.close()
        hand_reader.close()
        store.close()
    ours_stats, baseline_stats = Stats.of(ours), Stats.of(baseline)
    return [
        Row(
            name="decision-to-grant",
            what="Allocator.request with a new demand -> discovery script prints the new hosts",
            unit="ms",
            better="lower",
            baseline_label="write_atomically by hand, same reader loop",
            baseline=baseline_stats,
            ours=ours_stats,
            extra={"ours_p95_ms": ours_stats.p95, "baseline_p95_ms": baseline_stats.p95},
        )
    ]


# ---- discovery-cost ----


def child_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_per_call(argv: list[str], calls: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per run of `argv`, over `calls` runs."""
    cpu_before, wall_before = child_cpu_seconds(), time.perf_counter()
    for _ in range(calls):
        subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
    return (
        (child_cpu_seconds() - cpu_before) / calls,
        (time.perf_counter() - wall_before) / calls,
    )


def run_discovery_cost(ctx: Context) -> list[Row]:
    layout = StateLayout(ctx.scratch / "state")
    layout.create()
    publisher = GrantPublisher(layout)
    publisher.publish("bench", Placement((("localhost", (0, 1, 2, 3)),)))
    script = [str(publisher.discovery_script("bench"))]
    cat = ["cat", str(layout.grant_file("bench"))]
    calls = 20 if ctx.quick else 200
    cpu_per_call(script, 5)
    cpu_per_call(cat, 5)
    ours_cpu, ours_wall, cat_cpu, cat_wall = [], [], [], []
    for _ in range(ctx.repeat):  # alternate, so drift hits both alike
        cpu, wall = cpu_per_call(script, calls)
        ours_cpu.append(cpu * 1000)
        ours_wall.append(wall * 1000)
        cpu, wall = cpu_per_call(cat, calls)
        cat_cpu.append(cpu * 1000)
        cat_wall.append(wall * 1000)
    extra = {
        "ours_wall_ms": Stats.of(ours_wall).median,
        "baseline_wall_ms": Stats.of(cat_wall).median,
    }
    horovod_cpu = horovod_discovery_cpu_ms(script[0], 3 if ctx.quick else 10)
    if horovod_cpu is not None:
        extra["horovod_driver_cpu_ms_per_discovery"] = horovod_cpu
    return [
        Row(
            name="discovery-cost",
            what=f"CPU time (user+sys) per discovery-script call, mean of {calls} calls per sample",
            unit="ms CPU",
            better="lower",
            baseline_label="cat FILE",
            baseline=Stats.of(cat_cpu),
            ours=Stats.of(ours_cpu),
            extra=extra,
        )
    ]


def horovod_discovery_cpu_ms(script: str, calls: int) -> float | None:
    """CPU per discovery as Horovod's driver does it (a spawned middleman runs the script).

    This is what each second of an elastic job costs regardless of the script; None
    without Horovod.
    """
    try:
        from horovod.runner.elastic.discovery import HostDiscoveryScript
    except ImportError:
        return None
    discovery = HostDiscoveryScript(script, 1)
    before = child_cpu_seconds()
    for _ in range(calls):
        discovery.find_available_hosts_and_slots()
    return (child_cpu_seconds() - before) / calls * 1000
