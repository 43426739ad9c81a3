"""The sharing guard on a node other than the operator's: that node's exporter
(`herd-operator exporter --process-metrics`) serves each GPU process's memory with its pid,
the operator scrapes it (real HTTP on loopback) and charges each process to the job whose
worker bound with that (host, pid), and the guard moves the worker that grew. NVML is the
fake `pynvml`."""

from __future__ import annotations

import sys
from collections.abc import Generator
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.http import serve_metrics
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.exporters.sources import ScrapeGpuSource
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import present
from herd_operator.specs.values import Demand, Placement, Pool
from tests.unit import fake_pynvml
from tests.unit.fake_pynvml import FakeGpu, FakeNvmlConfig
from tests.unit.sinks import RecordingSink
from tests.unit.test_sharing import share
from tests.unit.test_sharing_guard import guarding_watch

GI = 1 << 30
MI = 1 << 20


def _node_exporter(per_process: bool) -> Generator[str, None, None]:
    """h1's exporter as `herd-operator exporter` builds it: its GPUs (NVML) at /metrics."""
    registry = CollectorRegistry()
    registry.register(GpuCollector(NvmlGpuSource("h1"), per_process=per_process))
    server = serve_metrics(registry, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("per_process", [True, False])
def test_the_guard_moves_a_worker_on_another_node_from_that_nodes_exporter(
    monkeypatch: pytest.MonkeyPatch, per_process: bool
) -> None:
    events: list[tuple[str, str, str, str]] = []
    allocator = Allocator(
        Pool.from_counts({"h0": 1, "h1": 3}),
        RecordingSink(),
        on_event=lambda *event: events.append(event),
        belongs=lambda job, pid: True,
        sharing=SharingLimits(max_jobs_per_gpu=2, margin=0.1, gpu_memory_bytes=2 * GI),
        virtual=False,
        present=lambda job, placement: present(placement, {"h1": ("a", "b", "c")}),
    )
    allocator.request(Demand("x", 1, 1, 1))  # the operator's node: a whole-GPU job
    allocator.request(replace(Demand("grower", 1, 2, 2, arrival=1.0), share=True,
                              memory_bytes=GI // 2))  # fmt: skip
    allocator.request(share("neighbour", 1, GI, arrival=2.0))
    on_h1 = {job: list(p.slots()) for job, p in allocator.placements().items() if job != "x"}
    assert on_h1 == {"grower": [("h1", 0), ("h1", 1)], "neighbour": [("h1", 0)]}
    allocator.bind("grower", "a", 0, 101)
    allocator.bind("grower", "b", 0, 102)
    allocator.bind("neighbour", "a", 0, 201)
    # grower's worker on h1's GPU 0 uses 1000 Mi of its 512 Mi share: counted 1.1 Gi, it no
    # longer fits beside neighbour's 1 Gi on a 2 Gi GPU.
    gpus = [
        FakeGpu("GPU-0", 2 * GI, 1600 * MI, processes=[(101, 1000 * MI), (201, 600 * MI)]),
        FakeGpu("GPU-1", 2 * GI, 400 * MI, processes=[(102, 400 * MI)]),
        FakeGpu("GPU-2", 2 * GI, 0),
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.make_module(FakeNvmlConfig(gpus)))
    watch = guarding_watch(allocator)
    exporter = _node_exporter(per_process)
    scraped = ScrapeGpuSource([next(exporter)])
    try:
        watch.observe(scraped.read(), 1.0)
    finally:
        exporter.close()
    if not per_process:  # without the pids, nothing on h1 is charged to a job
        assert events == [] and watch.peaks.peak("grower") is None
        return
    assert [(job, reason) for job, _, reason, _ in events] == [("grower", "MovedForMemory")]
    assert allocator.placements()["grower"] == Placement((("h1", (1, 2)),))
    assert allocator.draining() == {("h1", 0): "grower"}
    assert watch.peaks.peak("grower") == 1000 * MI
