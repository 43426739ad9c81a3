"""The installed Horovod wheel's wait for a collective sleeps, not spins.

Horovod 0.28.1's `WaitAndClear` polled the collective's handle in a `yield` loop, so a
worker waiting for a slower peer kept a core busy (on a shared node, the peer's core:
docs/benchmarks.md, session 9). herd_operator/horovod_build/horovod-0.28.1.patch makes it
sleep after 50 us; this runs a real 2-rank `horovodrun` in which rank 1 waits for rank 0
and reads the CPU time of rank 1's training thread over the wait.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("horovod.torch", reason="Horovod is not installed (HERD_ENGINES=torchrun)")

WAIT_SECONDS = 3.0
# A yield loop spends most of the wait on the CPU (all of it on an idle core, its share of
# a busy one otherwise); the sleeping wait about 1% (a wake-up every 500 us).
MOST_CPU_SHARE = 0.15

SCRIPT = textwrap.dedent(
    f"""
    import json, time
    import torch
    import horovod.torch as hvd

    hvd.init()
    hvd.allreduce(torch.zeros(1), name="warm")
    if hvd.rank() == 0:
        time.sleep({WAIT_SECONDS})
    cpu, wall = time.thread_time(), time.monotonic()
    hvd.allreduce(torch.zeros(1), name="waited")
    cpu, wall = time.thread_time() - cpu, time.monotonic() - wall
    print("WAIT " + json.dumps({{"rank": hvd.rank(), "cpu": cpu, "wall": wall}}), flush=True)
    """
)


def test_a_worker_waiting_for_a_collective_leaves_its_core_free(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(SCRIPT)
    horovodrun = Path(sys.executable).with_name("horovodrun")
    argv = [str(horovodrun), "-np", "2", "-H", "localhost:2", sys.executable, str(script)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    waits = {}
    for line in done.stdout.splitlines():
        if "WAIT " in line:
            wait = json.loads(line.split("WAIT ", 1)[1])
            waits[wait["rank"]] = wait
    assert set(waits) == {0, 1}, done.stdout
    waiter = waits[1]
    print(f"rank 1 waited {waiter['wall']:.2f} s using {waiter['cpu']:.3f} CPU-s")
    assert waiter["wall"] >= WAIT_SECONDS * 0.8, waiter  # it did wait for rank 0
    assert waiter["cpu"] <= MOST_CPU_SHARE * waiter["wall"], waiter
