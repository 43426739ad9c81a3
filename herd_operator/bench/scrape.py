"""`scrape`: what a Prometheus scrape costs.

- The GPU exporter with 8 GPUs (each with 4 processes), served over HTTP by
  prometheus_client, against the same server type returning the same bytes
  pre-rendered (so the ratio is the collector's own cost on top of HTTP).
- The operator's endpoint with 1,000 jobs (state read from a real store at
  scrape time), against the same pre-rendered.
- CPU time per scrape of each collector (in-process `generate_latest`).

The GPUs are an in-memory source shaped like NVML's readings: the collector's
cost is measured here; a real NVML read adds the driver's own time per call.
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from herd_operator.bench.harness import Context, Row, Stats
from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.gpu import GpuReading, ProcessMemory
from herd_operator.exporters.http import serve_metrics
from herd_operator.runtime.metrics import StateCollector
from herd_operator.runtime.store import Store
from herd_operator.specs import Condition, ConditionStatus, HerdJob
from herd_operator.specs.status import GpuCounts, HerdJobStatus
from herd_operator.specs.values import Placement, Pool


class EightGpus:
    """8 GPUs with every field NVML gives, 4 processes each."""

    def read(self) -> list[GpuReading]:
        return [
            GpuReading(
                host="node0",
                index=i,
                uuid=f"GPU-{i:08d}",
                kind="nvml",
                memory_used_bytes=(i + 1) << 30,
                memory_total_bytes=80 << 30,
                utilization_ratio=0.5,
                power_watts=300.0,
                processes=tuple(ProcessMemory(1000 + 10 * i + p, 1 << 28) for p in range(4)),
            )
            for i in range(8)
        ]


def operator_store(path: Path, jobs: int) -> Store:
    store = Store(path)
    status = HerdJobStatus(
        conditions=(
            Condition(
                type="Running",
                status=ConditionStatus.TRUE,
                reason="Training",
                last_transition_time=1.0,
                observed_generation=1,
            ),
        ),
        gpus=GpuCounts(min=1, max=4, desired=4, allocated=4, active=4),
        epoch=3,
    )
    for n in range(jobs):
        name = f"job-{n:05d}"
        spec = {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {
                "command": ["python"],
                "gpus": {"min": 1, "max": 4},
                "policy": {"name": "memory"},
            },
        }
        store.record_spec(name, f"{name}.yaml", HerdJob.model_validate(spec), name, 1.0)
        store.put_status(name, status, 2.0)
        store.add_usage(name, 4, 1 << 30, 4 << 30, 3.0)
    return store


@contextmanager
def serve(registry: CollectorRegistry) -> Iterator[str]:
    server = serve_metrics(registry, "127.0.0.1", 0)  # the server the operator runs
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def serve_bytes(body: bytes) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def scrape_seconds(url: str, count: int) -> list[float]:
    samples = []
    for _ in range(count + 1):  # the first one warms up
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=30) as response:
            response.read()
        samples.append(time.perf_counter() - started)
    return samples[1:]


def cpu_per_scrape(registry: CollectorRegistry, count: int) -> float:
    started = time.process_time()
    for _ in range(count):
        generate_latest(registry)
    return (time.process_time() - started) / count


def measure(name: str, what: str, collector: Collector, scrapes: int) -> list[Row]:
    registry = CollectorRegistry()
    registry.register(collector)
    body = generate_latest(registry)
    with serve(registry) as ours_url, serve_bytes(body) as base_url:
        ours, base = [], []
        for _ in range(3):  # alternate, so drift hits both alike
            ours += scrape_seconds(ours_url, scrapes)
            base += scrape_seconds(base_url, scrapes)
    cpu = cpu_per_scrape(registry, scrapes)
    return [
        Row(
            name=f"scrape: {name}",
            what=what,
            unit="ms",
            better="lower",
            baseline_label="the same bytes, pre-rendered, over HTTP",
            baseline=Stats.of([s * 1000 for s in base]),
            ours=Stats.of([s * 1000 for s in ours]),
            extra={"cpu_ms_per_scrape": cpu * 1000, "bytes": float(len(body))},
        )
    ]


def run_scrape(ctx: Context) -> list[Row]:
    scrapes = 5 if ctx.quick else 30
    jobs = 50 if ctx.quick else 1000
    rows = measure(
        "exporter, 8 GPUs",
        "GET /metrics of the GPU collector: 8 GPUs x 4 processes",
        GpuCollector(EightGpus(), lambda: {("node0", i): f"job-{i}" for i in range(8)}),
        scrapes,
    )
    store = operator_store(ctx.scratch / "scrape-state.db", jobs)
    try:
        pool = Pool.from_counts({f"nid{n:06d}": 4 for n in range(jobs)})
        placements = {
            f"job-{n:05d}": Placement(((f"nid{n:06d}", (0, 1, 2, 3)),)) for n in range(jobs)
        }
        rows += measure(
            f"operator, {jobs} jobs",
            f"GET /metrics of the operator state collector: {jobs} running jobs from the store",
            StateCollector(store, lambda: pool, lambda: placements, lambda: {("bind", "ok"): 1}),
            scrapes,
        )
    finally:
        store.close()
    return rows
