"""An out of memory on a shared GPU fails the job whose worker ran out, not its neighbour
(issue 30): two sharing jobs on one virtual GPU, with real Horovod workers; one worker raises
torch's own OutOfMemoryError (what PyTorch raises past `set_per_process_memory_fraction`'s
cap) once both are placed together. The failure, read from its launch's log, is said of
that job only; the neighbour trains on in its one launch and succeeds."""

from __future__ import annotations

import subprocess
from pathlib import Path

from herd_operator.policies.sharing import SharingLimits
from herd_operator.specs.values import Placement
from tests.integration.harness import HERD, digits_command, operator_harness, spec_document

GPU_MEMORY = 1600 << 20
ASKED = 640 << 20


def oom_command(trigger: Path) -> list[str]:
    """A worker that joins Horovod, binds its GPU like any worker, waits for `trigger`, then
    runs out of GPU memory as PyTorch says it."""
    script = (
        "import os, time, torch, horovod.torch as hvd\n"
        "from herd_operator import worker as herd\n"
        "hvd.init()\n"
        "herd.bind_device()\n"
        f"while not os.path.exists({str(trigger)!r}):\n"
        "    time.sleep(0.1)\n"
        "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0"
        " has a total capacity of 1.56 GiB of which 20.00 MiB is free.')\n"
    )
    return ["python", "-c", script]


def test_an_out_of_memory_on_a_shared_gpu_fails_only_the_job_that_ran_out(
    tmp_path: Path,
) -> None:
    sharing = SharingLimits(max_jobs_per_gpu=2, gpu_memory_bytes=GPU_MEMORY)
    trigger = tmp_path / "oom-now"
    with operator_harness(
        tmp_path, gpus=1, sharing=sharing, virtual_gpu_memory_bytes=GPU_MEMORY
    ) as herd:
        documents = [
            spec_document("steady", 1, 1, digits_command(5, "--step-delay", "0.1")),
            spec_document("greedy", 1, 1, oom_command(trigger)),
        ]
        for document in documents:
            document["spec"]["gpus"].update(share=True, memory=f"{ASKED >> 20}Mi")
            herd.write_spec(document)

        def together() -> bool:
            with herd.store() as store:
                now = store.allocations()
            gpu0 = Placement((("localhost", (0,)),))
            return now.get("steady") == gpu0 and now.get("greedy") == gpu0

        herd.wait_for(together, "steady and greedy both on GPU 0", timeout=60)
        # The operator logged the shared GPU with each job's counted memory (for `report`).
        with herd.store() as store:
            last = store.share_history()[-1]
        assert (last.host, last.gpu) == ("localhost", 0)
        assert [job for job, _ in last.jobs] == ["greedy", "steady"], last
        assert all(counted >= ASKED for _, counted in last.jobs), last
        launch = herd.wait_for(lambda: herd.launch_id("steady"), "steady's launch", timeout=60)
        trigger.touch()
        herd.wait_for(
            lambda: (herd.job("greedy") or {}).get("status") == "Failed",
            "greedy to fail",
            timeout=180,
            job="greedy",
        )
        said = [e.message for e in herd.events("greedy") if e.reason == "OutOfMemory"]
        assert said == ["rank 0 of job greedy ran out of GPU memory (CUDA out of memory)"], said
        # The neighbour: not named, not touched, in its one launch to the end.
        assert [(e.reason, e.message) for e in herd.events("steady") if e.type == "Warning"] == []
        herd.wait_for(
            lambda: (herd.job("steady") or {}).get("status") == "Succeeded",
            "steady to succeed",
            timeout=240,
            job="steady",
        )
        assert herd.launch_id("steady") == launch
        epochs = [r.epoch for r in herd.reports("steady") if r.epoch is not None]
        assert epochs == list(range(5)), epochs
        assert not [e for e in herd.events("steady") if e.reason == "OutOfMemory"]
        state = str(herd.layout.root)
        report = ("report", "--state-dir", state)
        text = subprocess.run(
            [HERD, *report, "--format", "text"],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        shared = text.split("Shared GPUs:")[1].strip().splitlines()[1:]
        assert [row.split()[0] for row in shared] == ["localhost:0"], text
        assert "greedy" in shared[0] and "steady" in shared[0], text
        figure = tmp_path / "timeline.png"  # looked at by hand: pytest --basetemp
        subprocess.run(
            [HERD, *report, "--output", str(figure)], capture_output=True, check=True, timeout=120
        )
