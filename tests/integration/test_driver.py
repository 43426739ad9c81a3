"""Our in-process Horovod driver with real Horovod workers, without the operator.

The workers run `examples/train_plain.py`, a plain Elastic Horovod script (no herd
import, only `hvd.elastic.run` and `TorchState`), started by the driver as it is: no
shim. The operator's own integration tests (test_jobs, test_faults, test_crash_only)
run the digits example under this driver, which is the engine's default launcher.
About 57 s together here (2 cores shared, load average 5-7).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from herd_operator.bench.harness import stop_session
from herd_operator.layout import write_atomically
from herd_operator.runtime.engines.horovod import DRIVER_MODULE
from tests.integration.harness import slow_first_grown_worker

REPO = Path(__file__).resolve().parents[2]
PLAIN = [sys.executable, str(REPO / "examples" / "train_plain.py"), "--epochs", "100000"]
MARK_ENV = "HERD_TEST_DRIVER_MARK"
GUARD_S = 90.0
EPOCH = re.compile(r"^\[0\]<stdout>:epoch (\d+): world size (\d+)$", re.MULTILINE)

T = TypeVar("T")


class DriverJob:
    def __init__(self, root: Path, process: subprocess.Popen[bytes], mark: str) -> None:
        self.root = root
        self.process = process
        self.mark = mark

    @property
    def output(self) -> str:
        return (self.root / "driver.log").read_text(errors="replace")

    def grant(self, text: str) -> float:
        write_atomically(self.root / "grant", text)
        return time.time()

    def epochs(self) -> list[tuple[int, int]]:
        """(epoch, world size) of every epoch rank 0 ended, in order."""
        return [(int(e), int(w)) for e, w in EPOCH.findall(self.output)]

    def wait_for(self, probe: Callable[[], T | None], what: str, guard: float = GUARD_S) -> T:
        deadline = time.monotonic() + guard
        while True:
            found = probe()
            if found is not None:
                return found
            if self.process.poll() is not None and probe() is None:
                pytest.fail(
                    f"the driver exited ({self.process.returncode}) before {what}:\n"
                    f"{self.output[-3000:]}"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} in {guard} s:\n{self.output[-3000:]}")
            time.sleep(0.1)

    def wait_for_epoch(self, size: int, after: int = -1, guard: float = GUARD_S) -> int:
        """The number of the first epoch after epoch `after` that ended at world size `size`."""
        return self.wait_for(
            lambda: next((e for e, w in self.epochs() if w == size and e > after), None),
            f"epoch at world size {size} after epoch {after}",
            guard,
        )

    def worker_pids(self) -> list[int]:
        return [p.pid for p in marked(self.mark) if p.pid != self.process.pid]


def marked(mark: str) -> list[psutil.Process]:
    """Live processes (the driver, its workers) that carry the test's environment mark."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARK_ENV) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


@contextlib.contextmanager
def driver_job(
    tmp_path: Path,
    grant: str,
    np: int,
    *horovod_args: str,
    env: dict[str, str] | None = None,
    command: Sequence[str] = PLAIN,
    driver_args: Sequence[str] = (),
) -> Iterator[DriverJob]:
    """Our driver on `grant` running `command`; stopped (group SIGTERM, then SIGKILL) after."""
    mark = uuid.uuid4().hex
    write_atomically(tmp_path / "grant", grant)
    argv = [sys.executable, "-m", DRIVER_MODULE, "--grant-file", str(tmp_path / "grant")]
    argv += [*driver_args, "--", "-np", str(np), "--network-interface", "lo", *horovod_args]
    argv += command
    full_env = {**os.environ, **(env or {}), MARK_ENV: mark}
    with open(tmp_path / "driver.log", "wb") as log:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    job = DriverJob(tmp_path, process, mark)
    try:
        yield job
    finally:
        stop_session(process, 20.0)
        for proc in marked(mark):  # a leftover fails the test below; do not leave it running
            with contextlib.suppress(psutil.Error):
                proc.kill()


def test_the_driver_grows_and_shrinks_a_plain_elastic_script_and_stops_cleanly(
    tmp_path: Path,
) -> None:
    with driver_job(tmp_path, "localhost:1\n", 1, "--min-np", "1", "--max-np", "2") as job:
        job.wait_for(lambda: "grant seen" in job.output or None, "the first grant seen")
        # Grown while the first worker still imports torch: Horovod alone drops this notice
        # (no coordinator has registered) and would stay at 1 until the grant changed again.
        job.grant("localhost:2\n")
        grown = job.wait_for_epoch(2)
        assert len(job.worker_pids()) == 2
        job.grant("localhost:1\n")
        job.wait_for_epoch(1, after=grown)
        # The removed worker ends as Horovod ends it (status 134), the job goes on.
        assert "Process 1 exit with status code 134." in job.output
        assert len(job.worker_pids()) == 1
        os.killpg(job.process.pid, signal.SIGTERM)
        assert job.process.wait(30) == 1  # horovodrun's status for a job stopped by a signal
        assert marked(job.mark) == []
    epochs = [e for e, _ in job.epochs()]
    assert epochs == sorted(epochs), "an epoch was trained twice or out of order across resizes"
    # Started directly: the grant was seen within one poll, no discovery middleman.
    assert "grant seen: {'localhost': 2}" in job.output


def test_a_worker_killed_with_sigkill_costs_the_job_one_name_not_the_run(tmp_path: Path) -> None:
    # Two names of this host, one slot each, as the operator presents one host.
    grant = "localhost:1\n127.0.0.1:1\n"
    cooldown = ["--blacklist-cooldown-range", "600", "600"]  # the dead name stays out
    with driver_job(tmp_path, grant, 2, "--min-np", "1", "--max-np", "2", *cooldown) as job:
        first = job.wait_for_epoch(2)
        victim = job.wait_for(
            lambda: next(
                (
                    p
                    for p in marked(job.mark)
                    if p.pid != job.process.pid and p.environ().get("HOROVOD_RANK") == "1"
                ),
                None,
            ),
            "the worker of rank 1",
        )
        victim.kill()
        job.wait_for_epoch(1, after=first)
        assert job.process.poll() is None
        assert len(job.worker_pids()) == 1
    assert f"exit with status code {128 + signal.SIGKILL}." in job.output


def test_the_reset_limit_ends_the_job_as_horovodrun_does(tmp_path: Path) -> None:
    with driver_job(
        tmp_path, "localhost:1\n", 1, "--min-np", "1", "--max-np", "2", "--reset-limit", "1"
    ) as job:
        first = job.wait_for_epoch(1)
        job.grant("localhost:2\n")  # the first reset: allowed
        job.wait_for_epoch(2, after=first)
        job.grant("localhost:1\n")  # the second: over the limit
        assert job.process.wait(GUARD_S) == 1
        assert "resets during elastic job exceeded limit: 1" in job.output
        assert marked(job.mark) == []


def test_workers_die_with_a_driver_killed_alone(tmp_path: Path) -> None:
    # The OOM killer or `kill -9 <driver>`: no group signal, no stop from the driver. Workers
    # that print nothing (a long epoch) would never notice that their driver is gone; the
    # parent-death signal ends them at once, where they would hold their GPUs until the job's
    # end. About 9 s here (the driver imports Horovod; the workers need not).
    quiet = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    with driver_job(tmp_path, "localhost:2\n", 2, "--min-np", "2", command=quiet) as job:
        job.wait_for(lambda: job.output.count("<stdout>:up") == 2 or None, "two workers up")
        workers = [psutil.Process(pid) for pid in job.worker_pids()]
        assert len(workers) == 2
        job.process.kill()  # the driver alone, not its group
        assert job.process.wait(GUARD_S) == -signal.SIGKILL
        _, alive = psutil.wait_procs(workers, timeout=GUARD_S)
        assert alive == [], f"workers outlived their driver: {alive}"
        assert marked(job.mark) == []


def test_a_grow_from_2_to_4_forks_the_new_workers_from_the_zygote(tmp_path: Path) -> None:
    # About 36 s here: the first two workers wait for the zygote's imports (one import
    # instead of two), the grow forks the other two. torch._dynamo as the docs advise: the
    # workers' optimizer imports it otherwise, and here it must be safe to fork after.
    preload = ["--preload", "torch,horovod.torch,torch._dynamo"]
    with driver_job(
        tmp_path, "localhost:2\n", 2, "--min-np", "2", "--max-np", "4", driver_args=preload
    ) as job:
        two = job.wait_for_epoch(2)
        job.grant("localhost:4\n")
        job.wait_for_epoch(4, after=two)  # trained at 4: all four in one Gloo context
        forked = dict(re.findall(r"worker rank (\d) forked by the zygote: pid (\d+)", job.output))
        assert set(forked) == {"0", "1", "2", "3"}, job.output[-3000:]
        (zygote,) = psutil.Process(job.process.pid).children()  # the driver's only child
        assert "herd_operator.agent.zygote" in zygote.cmdline()
        workers = [pid for pid in job.worker_pids() if pid != zygote.pid]
        assert sorted(workers) == sorted(int(pid) for pid in forked.values())
        assert {psutil.Process(pid).ppid() for pid in workers} == {zygote.pid}
        os.killpg(job.process.pid, signal.SIGTERM)
        assert job.process.wait(30) == 1
        assert marked(job.mark) == []
    epochs = [e for e, _ in job.epochs()]
    assert epochs == sorted(epochs)


def test_a_grow_whose_new_worker_starts_too_slowly_leaves_the_job_at_its_old_size(
    tmp_path: Path,
) -> None:
    # Issue 25, item 5: the running worker waited in Gloo's rendezvous for the new one,
    # aborted after Gloo's timeout, and the whole job failed ("failure count == 2"): the
    # operator then started it again from epoch 0. Now the driver holds it where Gloo's
    # timeout does not run (here for 4 times that timeout), then gives the grow up.
    # The grow timeout is also the retried worker's: one that starts as usual (python,
    # torch, Horovod) took over 20 s three times in a row at load 23-27 on 2 cores, so
    # each retry was given up too. 34-55 s here (at load 5-7, with 20 s).
    slow = slow_first_grown_worker(tmp_path / "slow-once", PLAIN, sys.executable)
    grow = ["--grow-timeout-seconds", "40", "--grow-retry-seconds", "1"]
    with driver_job(
        tmp_path,
        "localhost:1\n",
        1,
        "--min-np", "1", "--max-np", "2", "--gloo-timeout-seconds", "10",
        command=slow,
        driver_args=grow,
    ) as job:  # fmt: skip
        first = job.wait_for_epoch(1)
        job.grant("localhost:2\n")
        job.wait_for(
            lambda: "<stdout>:starting slowly" in job.output or None, "the slow new worker"
        )
        given_up = job.wait_for(
            lambda: next(
                iter(re.findall(r"gave up the grow to 2.*|Process 0 exit.*", job.output)), None
            ),
            "the grow given up (or the running worker lost)",
        )
        assert "going on at 1" in given_up, job.output[-3000:]
        # The running worker kept its state: the epochs go on from where they were.
        after = job.wait_for_epoch(1, after=max(e for e, _ in job.epochs()))
        assert after > first
        # Retried after the cool-down, with a worker that starts as usual: the job grows
        # (within its 40 s grow timeout, or at a later retry).
        job.wait_for_epoch(2, after=after, guard=2 * GUARD_S)
        assert job.process.poll() is None
        assert len(job.worker_pids()) == 2
        running = job.output  # before the stop, whose SIGTERM ends every worker
        (tmp_path / "kept.log").write_text(running)
    epochs = [e for e, _ in job.epochs()]
    assert epochs == sorted(epochs), "an epoch was trained twice: the job started again"
    assert "Process 0 exit" not in running  # the running worker was never lost
    assert running.count("starting worker localhost[0]") == 1
