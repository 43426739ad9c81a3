"""GPU sharing by memory end to end: two small jobs that opt in share the one virtual GPU of
the pool, with real Horovod workers, and both finish; `get -o wide` and `describe` show it."""

from __future__ import annotations

import subprocess
from pathlib import Path

from herd_operator.policies.sharing import SharingLimits
from tests.integration.harness import HERD, digits_command, operator_harness, spec_document
from tests.integration.test_crash_only import GpuSharingSampler


def test_two_sharing_jobs_run_together_on_one_gpu_and_finish(tmp_path: Path) -> None:
    sharing = SharingLimits(max_jobs_per_gpu=2, gpu_memory_bytes=2 << 30)
    asked = dict.fromkeys(("small-a", "small-b"), 512 << 20)
    with (
        operator_harness(tmp_path, gpus=1, sharing=sharing) as herd,
        GpuSharingSampler(herd.layout.root, sharing=asked, gpu_memory=2 << 30) as sampler,
    ):
        for name in ("small-a", "small-b"):
            document = spec_document(name, 1, 1, digits_command(2))
            document["spec"]["gpus"].update(share=True, memory="512Mi")
            herd.write_spec(document)

        def together() -> bool:
            with herd.store() as store:
                placements = store.allocations()
            return all(placements.get(job) is not None for job in ("small-a", "small-b"))

        herd.wait_for(together, "both jobs on the one GPU at once", timeout=60)
        state = str(herd.layout.root)
        wide = subprocess.run(
            [HERD, "get", "-o", "wide", "--state-dir", state],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert wide.count("localhost:0(shared:512Mi)") == 2, wide
        described = subprocess.run(
            [HERD, "describe", "small-a", "--state-dir", state],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert (
            "Sharing:      GPUs shared by memory, 512Mi per worker asked;"
            " localhost:0 with small-b" in described
        ), described
        assert "(sharing, 512.0Mi per worker)" in described, described
        for name in ("small-a", "small-b"):
            herd.wait_for(
                lambda name=name: (herd.job(name) or {}).get("status") == "Succeeded",
                f"{name} to succeed",
                timeout=240,
                job=name,
            )
            job = herd.job(name)
            assert job is not None and job["epoch"] is not None
        assert [e for e in herd.events() if e.type == "Warning"] == []
    # The workers sat on the one GPU together (the sampler saw it), never beyond its memory.
    assert sampler.co_located > 0 and sampler.shared == [], sampler.shared[:5]
