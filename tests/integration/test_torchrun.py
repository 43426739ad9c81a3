"""The torchrun engine end to end: real `torchrun` agents over Gloo on CPU under a real
operator (4 virtual GPUs on localhost), running a plain torchrun script
(`examples/train_torchrun.py`: no herd import needed, its own snapshot every epoch)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from herd_operator.runtime.process_table import job_processes
from herd_operator.runtime.store import Store
from tests.integration.harness import (
    HERD,
    OperatorHarness,
    digits_command,
    kill_marked_processes,
    spec_document,
)
from tests.integration.test_crash_only import (
    GUARD_S,
    conditions,
    finished,
    start_operator,
    stop_operator,
    stored_jobs,
    wait_for,
    wait_until_serving,
)

EPOCHS = 60
"""Long enough that a grow (new agents import torch while the job trains: 20-40 s on a
loaded 2-core machine) and a shrink both land before the end; about a second an epoch."""


def torchrun_spec(name: str, gpus: int, snapshot: Path, epochs: int = EPOCHS) -> dict[str, Any]:
    """A torchrun job of 1 to 3 GPUs that runs at `gpus` (the static policy's count: a
    policy change resizes it without a relaunch)."""
    command = [
        "python", "examples/train_torchrun.py", "--epochs", str(epochs),
        "--snapshot", str(snapshot), "--step-delay", "0.03",
    ]  # fmt: skip
    return spec_document(
        name,
        1,
        3,
        command,
        engine={"kind": "torchrun", "options": {"lastCallSeconds": 3}},
        policy={"name": "static", "params": {"gpus": gpus}},
    )


def trained(state: Path, job: str) -> bool:
    """Whether `job`'s workers reported an epoch (the store may be mid-creation right after
    an operator's kill: then not yet)."""
    try:
        with Store.open_readonly(state / "state.db") as store:
            return any(report.epoch is not None for report in store.reports(job))
    except Exception:
        return False


def history(snapshot: Path) -> list[tuple[int, int]]:
    """(epoch, world size) of every epoch the job's snapshot says it trained."""
    saved = torch.load(snapshot, map_location="cpu", weights_only=False)
    return [(int(epoch), int(world)) for epoch, world in saved["history"]]


@pytest.mark.timeout(600)  # every restart imports torch again: minutes on 2 loaded cores
def test_a_torchrun_job_grows_shrinks_survives_a_killed_worker_and_succeeds(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    snapshot = tmp_path / "digits.pt"
    # A spec with bad torchrun options next to it: refused naming the field, the rest runs.
    bad = torchrun_spec("bad", 1, tmp_path / "bad.pt")
    bad["spec"]["engine"]["options"] = {"maxRestarts": -1, "nprocPerNode": 2}
    herd.write_spec(bad)
    herd.write_spec(torchrun_spec("digits", 1, snapshot))
    refused = herd.wait_for(
        lambda: [e.message for e in herd.events("bad") if e.reason == "InvalidSpec"],
        "the bad spec refused",
    )
    assert "spec.engine.options.maxRestarts: must be at least 0, got integer -1" in refused[0]
    assert "spec.engine.options.nprocPerNode: unknown field (allowed: maxRestarts" in refused[0]

    def epochs_at(world: int) -> bool:
        return any(r.epoch is not None and r.world_size == world for r in herd.reports("digits"))

    herd.wait_for(lambda: epochs_at(1), "an epoch at 1 worker", timeout=180, job="digits")
    launch = herd.launch_id("digits")
    herd.write_spec(torchrun_spec("digits", 3, snapshot))  # grow 1 -> 3
    herd.wait_for(lambda: epochs_at(3), "an epoch at 3 workers", timeout=240, job="digits")
    herd.write_spec(torchrun_spec("digits", 2, snapshot))  # shrink 3 -> 2
    herd.wait_for(lambda: epochs_at(2), "an epoch at 2 workers", timeout=180, job="digits")
    # A worker SIGKILLed: its agent starts it again (one of maxRestarts), the other's
    # worker too, and the job goes on at its size from its last snapshot.
    victim = max(workers_of(herd.layout.root, "digits").values())
    os.kill(victim, signal.SIGKILL)
    herd.wait_for(
        lambda: len(w := workers_of(herd.layout.root, "digits")) == 2 and victim not in w.values(),
        "the killed worker started again",
        timeout=180,
        job="digits",
    )
    ended = herd.wait_for(
        lambda: [
            kind
            for kind in ("Succeeded", "Failed")
            if (c := herd.condition("digits", kind)) and c["status"] == "True"
        ],
        "the job to end",
        timeout=240,
        job="digits",
    )
    assert ended == ["Succeeded"], herd.diagnostics("digits")
    assert herd.launch_id("digits") == launch, "a resize must not relaunch the job"

    epochs_run = history(snapshot)
    assert [epoch for epoch, _ in epochs_run] == list(range(EPOCHS)), "an epoch lost or repeated"
    worlds = [world for _, world in epochs_run]
    changes = [world for i, world in enumerate(worlds) if i == 0 or world != worlds[i - 1]]
    assert changes == [1, 3, 2], f"world sizes by epoch: {worlds}"
    resized = [e.message for e in herd.events("digits") if e.reason == "Resized"]
    assert any("1 -> 3" in m for m in resized) and any("3 -> 2" in m for m in resized), resized
    with herd.store() as store:
        assert store.allocations() == {}
    # The operator ran on; the bad spec, never valid, never became a job.
    assert herd.job("bad") is None


def gpu_holders(state: Path) -> dict[int, set[str]]:
    """Each GPU of the (one-host) pool -> the jobs whose live workers are bound to it."""
    holders: dict[int, set[str]] = {}
    for proc in job_processes(state):
        gpu = proc.env.get("HERD_GPU")
        if gpu is not None:
            holders.setdefault(int(gpu), set()).add(proc.job)
    return holders


def workers_of(state: Path, job: str) -> dict[int, int]:
    """`job`'s live workers: GPU -> pid."""
    return {
        int(proc.env["HERD_GPU"]): proc.pid
        for proc in job_processes(state)
        if proc.job == job and "HERD_GPU" in proc.env
    }


@pytest.mark.timeout(600)
def test_an_operator_killed_and_restarted_adopts_a_torchrun_job_beside_a_horovod_one(
    tmp_path: Path,
) -> None:
    """Two engines in one pool, and crash-only: SIGKILL the operator while a torchrun job
    and a Horovod job train; the next operator adopts both, the torchrun job's workers
    (the same processes) train on to the end, and at no sample do two jobs share a GPU."""
    jobs, state = tmp_path / "jobs", tmp_path / "state"
    jobs.mkdir()
    snapshot = tmp_path / "digits.pt"
    epochs = 30
    torchrun_job = torchrun_spec("tr", 2, snapshot, epochs)
    horovod_job = spec_document("hvd", 2, 2, digits_command(12, "--step-delay", "0.03"))
    (jobs / "tr.yaml").write_text(yaml.safe_dump(torchrun_job))
    (jobs / "hvd.yaml").write_text(yaml.safe_dump(horovod_job))
    log = tmp_path / "operator.log"
    argv = [HERD, "run", "--specs-dir", str(jobs), "--state-dir", str(state),
            "--hosts", "localhost:4", "--resync-seconds", "0.5", "--grace-seconds", "5",
            "--metrics-port", "0"]  # fmt: skip
    deadline = time.monotonic() + GUARD_S
    shared: list[dict[int, set[str]]] = []
    operator = start_operator(argv, log)
    try:
        wait_until_serving(state, operator, deadline)
        before = wait_for(
            "both jobs' workers on 2 GPUs each",
            lambda: (
                (w := workers_of(state, "tr"))
                and len(w) == 2
                and trained(state, "tr")
                and len(workers_of(state, "hvd")) == 2
                and w
            ),
            deadline,
            operator,
        )
        operator.kill()
        operator.wait(30)
        operator = start_operator(argv, log)
        wait_until_serving(state, operator, deadline)
        while not finished(state, ["tr", "hvd"]):
            assert time.monotonic() < deadline and operator.poll() is None, log.read_text()
            holders = gpu_holders(state)
            if any(len(held) > 1 for held in holders.values()):
                shared.append(holders)
            if workers_of(state, "tr"):
                # The same generation trains on: no worker was started again.
                assert set(workers_of(state, "tr").values()) <= set(before.values()), log
            time.sleep(0.2)
    finally:
        stop_operator(operator)
        kill_marked_processes(state)
    assert not shared, f"GPUs held by two jobs: {shared[:3]}"
    records = stored_jobs(state)
    assert conditions(records["tr"]).get("Succeeded") == "True", records["tr"]
    assert conditions(records["hvd"]).get("Succeeded") == "True", records["hvd"]
    with Store.open_readonly(state / "state.db") as store:
        reasons = [event.reason for event in store.events("tr")]
    assert reasons.count("Started") == 1 and "Adopted" in reasons, reasons
    assert [epoch for epoch, _ in history(snapshot)] == list(range(epochs))
