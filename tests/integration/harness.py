"""Runs a real operator (real horovodrun, real TCP, real SQLite) on loopback for tests."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil
import yaml

from herd_operator.cli.views import job_object
from herd_operator.environment import LAUNCH_ID_ENV, STATE_DIR_ENV
from herd_operator.layout import StateLayout
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Pool

REPO = Path(__file__).resolve().parents[2]
HERD = str(Path(sys.executable).with_name("herd-operator"))
"""The CLI of this environment, as users run it."""
T = TypeVar("T")


def digits_command(epochs: int, *extra: str) -> list[str]:
    return ["python", "examples/train_digits.py", "--epochs", str(epochs), *extra]


ZYGOTE = {"preload": ["torch", "horovod.torch", "torch._dynamo"]}
"""`horovod=ZYGOTE` in a spec: the job's local workers are forked by its zygote, which has
these imported (`spec.horovod.preload`), instead of each starting an interpreter and importing
them: 0.09 CPU-s from the fork to the first step of `examples/train_digits.py` against 3.6
from a new interpreter (`python -m devtools.worker_start`, n = 5, 2026-12-02). For the tests of
what the operator does with jobs that start many workers (policies resizing them), where
the workers' start is not what is checked: the other tests start their workers the usual
way, which is the default."""

SLOW_CYCLE = {"HOROVOD_CYCLE_TIME": "10"}
"""`env=SLOW_CYCLE` in a spec: Horovod's background thread coordinates the job's workers
every 10 ms, not every 1 ms (its default), busy or idle: a worker stepping every 0.2 s
used 0.113 CPU-s a second against 0.168 (2 workers, n = 1, docs/benchmarks.md, CI). For
jobs whose tests wait on time and events, not on epochs: each collective waits for the
next cycle, so short steps take longer."""

LAUNCHER_ENV = "HERD_TEST_HOROVOD_LAUNCHER"
"""Set to `horovodrun` to run the operator's integration tests under the bare launch (the
fallback) instead of the default driver."""


def spec_document(
    name: str, gpus_min: int, gpus_max: int, command: Sequence[str], **spec: Any
) -> dict[str, Any]:
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher:
        spec = {**spec, "horovod": {"launcher": launcher, **spec.get("horovod", {})}}
    return {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": name},
        "spec": {
            "command": list(command),
            "workingDir": str(REPO),
            "gpus": {"min": gpus_min, "max": gpus_max},
            **spec,
        },
    }


def marked_processes(state_dir: Path) -> dict[int, str]:
    """Live processes of jobs of the operator on `state_dir`: pid -> launch id."""
    found = {}
    wanted = str(state_dir.resolve())
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            launch = env.get(LAUNCH_ID_ENV)
            if (
                launch
                and env.get(STATE_DIR_ENV) == wanted
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found[proc.pid] = launch
        except psutil.Error:
            continue
    return found


def workers_by_host(state_dir: Path) -> dict[str, int]:
    """Live workers of the operator on `state_dir`, counted per host they run on (the host
    Horovod started them for: local ones and those started over ssh alike)."""
    counts: dict[str, int] = {}
    wanted = str(state_dir.resolve())
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = process.environ()
            # A worker has its rank in its environment (the shim execs the user's command);
            # the `sh -c` and `ssh` that start it have it only on their command lines.
            if (
                env.get(STATE_DIR_ENV) == wanted
                and env.get(LAUNCH_ID_ENV)
                and "HOROVOD_RANK" in env
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                host = env.get("HOROVOD_HOSTNAME", "?")
                counts[host] = counts.get(host, 0) + 1
    return counts


GRANT_LINE = re.compile(
    r"herd_operator\.runtime\.allocator: grant (?P<job>[^:\s]+): "
    r"(?P<placement>nothing \(pending\)|[^\[\]\s,]+\[[0-9, ]*\](?:, [^\[\]\s,]+\[[0-9, ]*\])*) \("
)


def grant_history(log_text: str) -> list[tuple[str, dict[str, set[int]]]]:
    """The allocator's grants as logged, in order: (job, host -> its GPUs)."""
    found = []
    for line in log_text.splitlines():
        match = GRANT_LINE.search(line)
        if match is None:
            continue
        hosts: dict[str, set[int]] = {}
        if not match["placement"].startswith("nothing"):
            for host, gpus in re.findall(r"([^\[\]\s,]+)\[([0-9, ]*)\]", match["placement"]):
                hosts[host] = {int(gpu) for gpu in gpus.split(",") if gpu.strip()}
        found.append((match["job"], hosts))
    return found


def new_grants_on(log_text: str, offset: int, host: str) -> list[str]:
    """GPUs of `host` that a grant logged after `offset` gave a job that did not hold them."""
    held: dict[str, set[int]] = {}
    for job, hosts in grant_history(log_text[:offset]):
        held[job] = hosts.get(host, set())
    found = []
    for job, hosts in grant_history(log_text[offset:]):
        now = hosts.get(host, set())
        found += [f"{job}:{host}:{gpu}" for gpu in sorted(now - held.get(job, set()))]
        held[job] = now
    return found


def soon(probe: Any, timeout: float) -> Any:
    """`probe()` once it is truthy, polled until `timeout`; its last value if never."""
    deadline = time.monotonic() + timeout
    value = probe()
    while not value and time.monotonic() < deadline:
        time.sleep(0.5)
        value = probe()
    return value


def steps(path: Path) -> list[tuple[float, int]]:
    """The step log of a job's rank 0 (`--step-log`): (wall time, world size) per step."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            rows.append((float(parts[0]), int(parts[1])))
    return rows


def kill_marked_processes(state_dir: Path) -> None:
    """SIGKILL whatever jobs of `state_dir` still run: jobs outlive a killed operator, so a
    test that kills one must not leave them training after it failed."""
    for pid in marked_processes(state_dir):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()


@dataclass
class OperatorHarness:
    root: Path
    gpus: int = 4
    overrides: dict[str, Any] = field(default_factory=dict)
    """OperatorConfig fields to set for this test."""
    operator: Operator = field(init=False)
    _thread: threading.Thread = field(init=False)
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def specs_dir(self) -> Path:
        return self.root / "jobs"

    @property
    def layout(self) -> StateLayout:
        """The running operator's layout (with its runtime dir), else the state dir's."""
        operator = getattr(self, "operator", None)
        return operator.layout if operator is not None else StateLayout(self.root / "state")

    def start(self) -> None:
        self.specs_dir.mkdir(parents=True, exist_ok=True)
        pool = StaticPool(Pool.from_counts({"localhost": self.gpus}), True, "test pool")
        config = OperatorConfig(
            specs_dir=self.specs_dir,
            state_dir=self.layout.root,
            pool=pool,
            resync_seconds=0.5,
            relist_seconds=1.0,
            grace_seconds=5.0,
            min_resize_interval=2.0,
            sample_seconds=0.5,
            virtual_gpu_memory_bytes=2 << 30,
        )
        config = dataclasses.replace(config, **self.overrides)
        self.operator = Operator(config)
        self._thread = threading.Thread(target=self.operator.run, args=(self._stop,), daemon=True)
        self._thread.start()
        assert self.operator.ready.wait(30), "operator did not start"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "operator did not stop"

    # ---- specs ----

    def write_spec(self, document: dict[str, Any], file: str | None = None) -> Path:
        """Write atomically (temp file + rename), as users are told to."""
        return self.write_text(
            file or f"{document['metadata']['name']}.yaml", yaml.safe_dump(document)
        )

    def write_text(self, file: str, text: str) -> Path:
        path = self.specs_dir / file
        tmp = self.specs_dir / f".{file}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
        return path

    # ---- observation ----

    def store(self) -> Store:
        return Store.open_readonly(self.layout.database)

    def job(self, name: str) -> dict[str, Any] | None:
        with self.store() as store:
            record = store.get_job(name)
        return None if record is None else job_object(record)

    def condition(self, name: str, type: str) -> dict[str, Any] | None:
        job = self.job(name)
        if job is None:
            return None
        return next((c for c in job["conditions"] if c["type"] == type), None)

    def reports(self, name: str) -> list[Any]:
        with self.store() as store:
            return store.reports(name)

    def events(self, name: str | None = None) -> list[Any]:
        with self.store() as store:
            return store.events(name, limit=1000)

    def launch_id(self, name: str) -> str | None:
        with self.store() as store:
            record = store.get_job(name)
        return None if record is None else record.status.launch_id

    def diagnostics(self, name: str | None) -> str:
        parts = []
        if name is not None:
            parts.append(f"job: {json.dumps(self.job(name), indent=1, default=str)}")
            log_file = self.layout.log_file(name)
            if log_file.exists():
                parts.append("log tail:\n" + "\n".join(log_file.read_text().splitlines()[-40:]))
        events = self.events(name)
        parts.append(
            "events:\n"
            + "\n".join(f"{e.time:.1f} {e.job} {e.reason}: {e.message}" for e in events[-30:])
        )
        return "\n".join(parts)

    def wait_for(
        self, probe: Callable[[], T], what: str, timeout: float = 120.0, job: str | None = None
    ) -> T:
        """Poll `probe` until it returns something truthy; fail with the job's story if not."""
        deadline = time.monotonic() + timeout
        while True:
            value = probe()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting for {what}\n" + self.diagnostics(job)
                )
            # A probe reads the state database (1-2 ms here): at 10 a second a wait ends
            # closer to its event and costs the workers next to nothing.
            time.sleep(0.1)


def running_harness(root: Path, gpus: int = 4, **overrides: Any) -> Iterator[OperatorHarness]:
    harness = OperatorHarness(root, gpus, overrides)
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()
        left = marked_processes(harness.layout.root)
        for pid in left:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        assert not left, f"processes left behind after the operator stopped: {left}"


operator_harness = contextmanager(running_harness)
"""`with operator_harness(root, **overrides) as herd:` when a fixture does not fit."""


SLOW_GROWN_WORKER = """
import os, runpy, sys, time
flag = sys.argv[1]
if os.environ["HOROVOD_RANK"] != "0" and not os.path.exists(flag):
    open(flag, "w").close()
    print("starting slowly", flush=True)
    time.sleep(600)  # a start far longer than any Gloo timeout (a loaded node)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def slow_first_grown_worker(
    flag: Path, command: Sequence[str], python: str = "python"
) -> list[str]:
    """`command` (`python SCRIPT ...`), but the first worker of a rank other than 0 (one a
    grow started) sleeps instead of starting, until it is stopped; the later ones start as
    usual. `flag` is the file that says the slow one was started."""
    if command[0] not in ("python", sys.executable):
        raise ValueError(f"not a python command: {command}")
    return [python, "-c", SLOW_GROWN_WORKER, str(flag), *command[1:]]
