"""A worker that ran out of GPU memory is named as such (issue 30): from its output, through
the launcher's log, to the job's events and conditions.

The workers are real processes raising torch's own OutOfMemoryError (what PyTorch raises when
an allocation passes `set_per_process_memory_fraction`'s cap), on CPU.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from herd_operator.controllers.ports import ProcessPhase
from herd_operator.runtime.launcher import Launcher, LaunchRequest
from herd_operator.runtime.out_of_memory import (
    UNNAMED_WORKER,
    LogFollower,
    OutOfMemoryWatch,
    launch_output,
    out_of_memory_workers,
)
from herd_operator.specs import HerdJobSpec

PYTHON = sys.executable
OOM_SCRIPT = (
    "import torch\n"
    "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a"
    " total capacity of 79.10 GiB of which 1.19 GiB is free.')\n"
)


@pytest.mark.parametrize(
    ("lines", "workers"),
    [
        (
            ["[1]<stderr>:torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20 MiB"],
            ("rank 1",),
        ),
        (["Mon Dec  1 10:00:00 2026[12]<stderr>:RuntimeError: CUDA out of memory."], ("rank 12",)),
        (["[default3]:torch.cuda.OutOfMemoryError: CUDA out of memory."], ("local rank 3",)),
        (["[rank0]: RuntimeError: CUDA error: out of memory"], ("local rank 0",)),
        (["torch.OutOfMemoryError: CUDA out of memory."], (UNNAMED_WORKER,)),
        (
            [
                "[0]<stderr>:CUDA out of memory",
                "[1]<stderr>:Traceback",
                "[0]<stderr>:OutOfMemoryError",
            ],
            ("rank 0",),
        ),
        (["[1]<stderr>:RuntimeError: Gloo connectFullMesh failed", "MemoryError"], ()),
    ],
)
def test_the_workers_that_ran_out_of_gpu_memory(lines: list[str], workers: tuple[str, ...]) -> None:
    assert out_of_memory_workers(lines) == workers


def test_only_the_launch_s_own_output_counts(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text(
        '==== 2026-12-01T10:00:00.000Z launch old: ["horovodrun"]\n'
        "[0]<stderr>:torch.OutOfMemoryError: CUDA out of memory.\n"
        '==== 2026-12-01T10:05:00.000Z launch new: ["horovodrun"]\n'
        "[0]<stdout>:epoch 1\n"
    )
    assert launch_output(log, "new") == ["[0]<stdout>:epoch 1"]
    assert out_of_memory_workers(launch_output(log, "new")) == ()
    assert out_of_memory_workers(launch_output(log, "old", tail_bytes=1 << 20)) == ("rank 0",)
    assert launch_output(tmp_path / "missing.log", "new") == []


def test_a_real_worker_out_of_memory_is_named_by_its_rank_from_the_launch_s_log(
    tmp_path: Path,
) -> None:
    # The launch is a driver stand-in forwarding its worker's output as ours does (with
    # horovodrun's time stamps) and exiting with its status; one torch import in all.
    driver = (
        "import os, sys\n"
        "from herd_operator.runtime.engines.hvd_workers import run_local_worker\n"
        f"worker = [sys.executable, '-c', {OOM_SCRIPT!r}]\n"
        "sys.exit(run_local_worker(worker, dict(os.environ), 2, [], timestamp=True))\n"
    )
    launcher = Launcher(grace_seconds=1)
    try:
        request = LaunchRequest(
            job="train",
            generation=1,
            argv=[PYTHON, "-c", driver],
            log_file=tmp_path / "train.log",
            command="horovodrun",
            spec=HerdJobSpec.model_validate({"command": ["python"], "gpus": {"min": 1, "max": 1}}),
        )
        launcher.launch(request)
        deadline = time.monotonic() + 120  # a hang guard: torch's import is slow under load
        while (state := launcher.state("train")).phase != ProcessPhase.EXITED:
            assert time.monotonic() < deadline, "the worker did not exit"
            time.sleep(0.05)
    finally:
        launcher.stop_all(timeout=10)

    assert state.exit_code == 1
    assert "]<stderr>:torch.OutOfMemoryError: CUDA out of memory" in request.log_file.read_text()
    assert state.out_of_memory == ("rank 2",)


def test_a_follower_reads_whole_new_lines_only(tmp_path: Path) -> None:
    log = tmp_path / "a.log"
    log.write_text("before the follower\n")
    follower = LogFollower(log)
    with log.open("a") as handle:
        handle.write("one\ntw")
        handle.flush()
        assert follower.new_lines() == ["one"]
        handle.write("o\n")
    assert follower.new_lines() == ["two"]
    assert follower.new_lines() == []
    with log.open("a") as handle:
        handle.write("x" * 100 + "\nlast\n")
    assert follower.new_lines(tail_bytes=20) == ["x" * 14, "last"]  # a flood: its end
    log.write_text("new\n")  # replaced: read from its start
    assert follower.new_lines() == ["new"]


def test_a_running_launch_s_worker_out_of_memory_is_said_once(tmp_path: Path) -> None:
    # Elastic Horovod goes on without the worker: the launch still runs.
    script = (
        "import sys, time\n"
        "print('[1]<stderr>:torch.OutOfMemoryError: CUDA out of memory.', flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = Launcher(grace_seconds=1)
    events: list[tuple[str, str, str, str, float]] = []
    watch = OutOfMemoryWatch(
        launcher.out_of_memory_news,
        lambda *event: events.append(event),
        clock=lambda: 5.0,
    )
    try:
        launcher.launch(
            LaunchRequest(
                job="train",
                generation=1,
                argv=[PYTHON, "-c", script],
                log_file=tmp_path / "train.log",
                command="horovodrun",
                spec=HerdJobSpec.model_validate(
                    {"command": ["python"], "gpus": {"min": 1, "max": 2}}
                ),
            )
        )
        deadline = time.monotonic() + 60
        while not events:
            assert time.monotonic() < deadline, "no OutOfMemory event"
            watch.step()
            time.sleep(0.05)
        watch.step()
        assert launcher.state("train").phase == ProcessPhase.RUNNING
    finally:
        launcher.stop_all(timeout=10)

    said = "rank 1 of job train ran out of GPU memory (CUDA out of memory)"
    assert events == [("train", "Warning", "OutOfMemory", said, 5.0)]
