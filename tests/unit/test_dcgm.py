"""dcgm-exporter interoperability, against its real metric names, labels and mapping files.

`FakeDcgmExporter` serves on loopback what dcgm-exporter serves: the exposition its GPU
template renders (internal/pkg/rendermetrics/render_metrics.go in NVIDIA/dcgm-exporter:
`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, MIG's `GPU_I_PROFILE`/`GPU_I_ID`,
`Hostname`, then its extra labels and attributes such as `hpc_job`), and it labels series
from an HPC job mapping directory the way its HPC mapper does
(internal/pkg/transformation/hpc.go: integer file names are GPU indices, each line a job,
one copy of a series per job). The operator's side must read the first and write the second.
"""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.cli.main import build_parser
from herd_operator.exporters.dcgm import (
    FB_FREE,
    FB_USED,
    HPC_JOB_LABEL,
    MIB,
    DcgmPrometheusGpuSource,
    DcgmScrapeGpuSource,
    JobMappingLoop,
    JobMappingWriter,
    dcgm_exporter_urls,
)
from herd_operator.exporters.gpu import GpuReading
from herd_operator.runtime.config import OperatorConfig
from herd_operator.runtime.handlers import ExporterRegistry
from herd_operator.runtime.observer import UsageObserver
from herd_operator.runtime.operator import Operator
from herd_operator.runtime.pools import StaticPool
from herd_operator.runtime.telemetry import job_mapping, observed_gpus
from herd_operator.specs.values import Placement, Pool

HELP = {
    "DCGM_FI_DEV_FB_FREE": "Framebuffer memory free (in MiB).",
    "DCGM_FI_DEV_FB_USED": "Framebuffer memory used (in MiB).",
    "DCGM_FI_DEV_GPU_UTIL": "GPU utilization (in %).",
    "DCGM_FI_DEV_POWER_USAGE": "Power draw (in W).",
}


@dataclass
class DcgmGpu:
    index: int
    fb_used_mib: int
    fb_free_mib: int
    util_percent: int = 0
    power_watts: float = 0.0
    mig_instance: int | None = None

    @property
    def uuid(self) -> str:
        return f"GPU-5f1c{self.index:04d}-aaaa-bbbb-cccc-0123456789ab"


def hpc_jobs_by_gpu(directory: Path) -> dict[str, list[str]]:
    """dcgm-exporter's reading of the mapping directory (hpc.go's getGPUFiles + readFile)."""
    jobs: dict[str, list[str]] = {}
    for entry in os.scandir(directory):
        if not entry.is_file():
            continue
        try:
            int(entry.name, 10)  # strconv.Atoi: an optional sign, then decimal digits
        except ValueError:
            continue
        with open(entry.path, encoding="utf-8") as handle:
            # bufio.Scanner's ScanLines: lines without their "\n" (or "\r\n")
            jobs[entry.name] = [line.rstrip("\r") for line in handle.read().splitlines()]
    return jobs


@dataclass
class FakeDcgmExporter:
    """Renders dcgm-exporter's GPU exposition for `gpus`, labelled from `mapping_dir`."""

    hostname: str | None
    gpus: list[DcgmGpu]
    mapping_dir: Path | None = None
    driver: str = "550.54.15"
    url: str = ""
    scrapes: int = 0

    def render(self) -> str:
        mapping = hpc_jobs_by_gpu(self.mapping_dir) if self.mapping_dir else {}
        lines: list[str] = []
        values = {
            "DCGM_FI_DEV_FB_FREE": lambda g: str(g.fb_free_mib),
            "DCGM_FI_DEV_FB_USED": lambda g: str(g.fb_used_mib),
            "DCGM_FI_DEV_GPU_UTIL": lambda g: str(g.util_percent),
            "DCGM_FI_DEV_POWER_USAGE": lambda g: f"{g.power_watts:.6f}",
        }
        for name, value in values.items():
            lines.append(f"# HELP {name} {HELP[name]}")
            lines.append(f"# TYPE {name} gauge")
            for gpu in self.gpus:
                labels = (
                    f'gpu="{gpu.index}",UUID="{gpu.uuid}"'
                    f',pci_bus_id="00000000:{gpu.index + 3:02X}:00.0"'
                    f',device="nvidia{gpu.index}",modelName="NVIDIA H200"'
                )
                if gpu.mig_instance is not None:
                    labels += f',GPU_I_PROFILE="3g.71gb",GPU_I_ID="{gpu.mig_instance}"'
                if self.hostname:
                    labels += f',Hostname="{self.hostname}"'
                labels += f',DCGM_FI_DRIVER_VERSION="{self.driver}"'
                jobs = mapping.get(str(gpu.index)) if gpu.mig_instance is None else None
                for job in jobs or [None]:
                    attributes = "" if job is None else f',{HPC_JOB_LABEL}="{job}"'
                    lines.append(f"{name}{{{labels}{attributes}}} {value(gpu)}")
        return "\n".join(lines) + "\n"


@pytest.fixture
def dcgm_exporter() -> Iterator[FakeDcgmExporter]:
    fake = FakeDcgmExporter(
        hostname="nid001",
        gpus=[
            DcgmGpu(0, fb_used_mib=20_000, fb_free_mib=60_000, util_percent=87, power_watts=412.5),
            DcgmGpu(1, fb_used_mib=70_000, fb_free_mib=10_000),
            DcgmGpu(2, fb_used_mib=0, fb_free_mib=80_000),
            # A MIG instance of GPU 3: not a GPU of the pool.
            DcgmGpu(3, fb_used_mib=1, fb_free_mib=2, mig_instance=1),
        ],
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            fake.scrapes += 1
            body = fake.render().encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.url = f"http://127.0.0.1:{server.server_port}/metrics"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_the_fake_renders_what_prometheus_parses_as_dcgm_series(
    dcgm_exporter: FakeDcgmExporter,
) -> None:
    """The fixture itself: real names, real labels, parsed by the Prometheus parser."""
    families = {f.name: f for f in text_string_to_metric_families(dcgm_exporter.render())}
    assert {FB_USED, FB_FREE} <= set(families)
    first = families[FB_USED].samples[0]
    assert set(first.labels) == {
        "gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"
    }  # fmt: skip


def test_scraping_dcgm_exporter_gives_memory_in_bytes_per_gpu_of_the_host(
    dcgm_exporter: FakeDcgmExporter,
) -> None:
    source = DcgmScrapeGpuSource([dcgm_exporter.url])

    readings = source.read()

    assert source.up and source.errors() == {}
    by_index = {reading.index: reading for reading in readings}
    assert sorted(by_index) == [0, 1, 2]  # the MIG instance is left out
    assert {reading.host for reading in readings} == {"nid001"}
    gpu0 = by_index[0]
    assert gpu0.memory_used_bytes == 20_000 * MIB
    assert gpu0.memory_total_bytes == 80_000 * MIB
    assert gpu0.utilization_ratio == pytest.approx(0.87)
    assert gpu0.power_watts == pytest.approx(412.5)
    assert gpu0.uuid == dcgm_exporter.gpus[0].uuid
    assert gpu0.kind == "dcgm"


def test_without_a_hostname_label_the_gpus_belong_to_the_scraped_host(
    dcgm_exporter: FakeDcgmExporter,
) -> None:
    dcgm_exporter.hostname = None
    readings = DcgmScrapeGpuSource([dcgm_exporter.url]).read()
    assert {reading.host for reading in readings} == {"127.0.0.1"}


def test_the_memory_signal_of_a_job_comes_from_dcgm(dcgm_exporter: FakeDcgmExporter) -> None:
    """What the memory policy decides on: per job, used over total of the GPUs it holds."""
    placements = {
        "resnet": Placement((("nid001", (0, 1)),)),
        "idle": Placement((("nid001", (2,)),)),
    }
    recorded: dict[str, tuple[int, int, int]] = {}

    def record(job: str, gpus: int, used: int, total: int, now: float) -> None:
        recorded[job] = (gpus, used, total)

    UsageObserver(
        DcgmScrapeGpuSource([dcgm_exporter.url]), lambda: placements, record
    ).sample_once()

    assert recorded == {
        "resnet": (2, 90_000 * MIB, 160_000 * MIB),
        "idle": (1, 0, 80_000 * MIB),
    }


def test_dcgm_series_read_through_prometheus(dcgm_exporter: FakeDcgmExporter) -> None:
    """A Prometheus API on loopback answering the source's query with DCGM series."""
    now = time.time()
    asked: list[str] = []

    def series(name: str, gpu: int, value: str, when: float, **extra: str) -> object:
        metric = {"__name__": name, "gpu": str(gpu), "UUID": f"GPU-{gpu}", "device": f"nvidia{gpu}"}
        metric |= {"modelName": "NVIDIA H200", "instance": "nid002:9400", "job": "dcgm", **extra}
        return {"metric": metric, "values": [[when, value]]}

    result = [
        series(FB_USED, 0, "1024", now - 1, Hostname="nid001", hpc_job="resnet"),
        series(FB_FREE, 0, "3072", now - 1, Hostname="nid001", hpc_job="resnet"),
        series(FB_USED, 1, "10", now - 1),  # no Hostname: the host of `instance`
        series(FB_FREE, 1, "30", now - 1),
        series(FB_USED, 2, "10", now - 100),  # older than the window: dropped
    ]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            asked.extend(urllib.parse.parse_qs(url.query)["query"])
            body = json.dumps(
                {"status": "success", "data": {"resultType": "matrix", "result": result}}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        readings = DcgmPrometheusGpuSource(f"http://127.0.0.1:{server.server_port}").read()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)

    assert readings == [
        GpuReading("nid001", 0, "GPU-0", "dcgm", 1024 * MIB, 4096 * MIB),
        GpuReading("nid002", 1, "GPU-1", "dcgm", 10 * MIB, 40 * MIB),
    ]
    assert FB_USED in asked[0] and FB_FREE in asked[0] and asked[0].endswith("[30000ms]")


def test_default_dcgm_exporter_urls_are_port_9400_of_each_host() -> None:
    assert dcgm_exporter_urls(["nid001", "::1"]) == [
        "http://nid001:9400/metrics",
        "http://[::1]:9400/metrics",
    ]


def test_mapping_files_make_dcgm_label_each_gpu_with_its_herd_job(
    dcgm_exporter: FakeDcgmExporter, tmp_path: Path
) -> None:
    mapping_dir = tmp_path / "dcgm-job-map"
    dcgm_exporter.mapping_dir = mapping_dir
    owners = {0: "resnet", 1: "resnet", 2: "bert-large"}
    writer = JobMappingWriter(mapping_dir, lambda: owners)

    def hpc_jobs() -> dict[tuple[str, str], set[str | None]]:
        found: dict[tuple[str, str], set[str | None]] = {}
        for family in text_string_to_metric_families(dcgm_exporter.render()):
            for sample in family.samples:
                if "GPU_I_ID" not in sample.labels:
                    key = (sample.name, sample.labels["gpu"])
                    found.setdefault(key, set()).add(sample.labels.get(HPC_JOB_LABEL))
        return found

    writer.write()
    assert hpc_jobs_by_gpu(mapping_dir) == {"0": ["resnet"], "1": ["resnet"], "2": ["bert-large"]}
    labelled = hpc_jobs()
    assert labelled[(FB_USED, "0")] == {"resnet"}
    assert labelled[(FB_FREE, "2")] == {"bert-large"}

    # bert-large ends and resnet shrinks to GPU 0; a file the site's Slurm prolog keeps
    # under a name dcgm-exporter ignores is left alone.
    (mapping_dir / "README").write_text("not a GPU\n")
    owners = {0: "resnet"}
    writer.write()
    assert hpc_jobs_by_gpu(mapping_dir) == {"0": ["resnet"]}
    labelled = hpc_jobs()
    assert labelled[(FB_USED, "0")] == {"resnet"}
    assert labelled[(FB_USED, "1")] == {None}
    assert labelled[(FB_USED, "2")] == {None}
    assert (mapping_dir / "README").exists()
    assert not [p.name for p in mapping_dir.iterdir() if p.name.startswith(".")], "temp files"

    writer.clear()
    assert hpc_jobs_by_gpu(mapping_dir) == {}


def test_a_mapping_file_removed_behind_the_writers_back_is_written_again(tmp_path: Path) -> None:
    writer = JobMappingWriter(tmp_path, lambda: {3: "resnet"})
    writer.write()
    (tmp_path / "3").unlink()
    writer.write()
    assert hpc_jobs_by_gpu(tmp_path) == {"3": ["resnet"]}


def test_an_unwritable_mapping_dir_is_logged_once_and_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    writer = JobMappingWriter(blocker / "map", lambda: {0: "a"})
    writer.write()
    writer.write()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    blocker.unlink()
    writer.write()
    assert hpc_jobs_by_gpu(blocker / "map") == {"0": ["a"]}


def test_the_mapping_loop_follows_the_owners_and_clears_on_stop(tmp_path: Path) -> None:
    owners: dict[int, str] = {1: "a"}
    loop = JobMappingLoop(JobMappingWriter(tmp_path, lambda: dict(owners)), interval=0.02)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while hpc_jobs_by_gpu(tmp_path) != {"1": ["a"]} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hpc_jobs_by_gpu(tmp_path) == {"1": ["a"]}
        owners[1] = "b"
        while hpc_jobs_by_gpu(tmp_path) != {"1": ["b"]} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert hpc_jobs_by_gpu(tmp_path) == {"1": ["b"]}
    finally:
        loop.stop()
    assert hpc_jobs_by_gpu(tmp_path) == {}


def operator_for(tmp_path: Path, hosts: dict[str, int], **options: Any) -> Operator:
    return Operator(
        OperatorConfig(
            specs_dir=tmp_path / "specs",
            state_dir=tmp_path / "state",
            pool=StaticPool(Pool.from_counts(hosts), False, "test pool"),
            **options,
        )
    )


def test_run_flags_point_the_memory_signal_at_dcgm(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["run", "--specs-dir", "jobs", "--gpu-metrics", "dcgm",
         "--dcgm-exporter-url", "http://a:9400/metrics", "--dcgm-job-mapping-dir", "/run/map",
         "--process-metrics"]
    )  # fmt: skip
    assert (args.gpu_metrics, args.dcgm_exporter_url) == ("dcgm", ["http://a:9400/metrics"])
    assert (args.dcgm_job_mapping_dir, args.process_metrics) == (Path("/run/map"), True)
    exporter = build_parser().parse_args(["exporter", "--dcgm-job-mapping-dir", "/run/map"])
    assert (exporter.dcgm_job_mapping_dir, exporter.process_metrics) == (Path("/run/map"), False)

    registry = ExporterRegistry(tmp_path / "targets.json", None)
    scraped = operator_for(tmp_path, {"nid001": 4, "nid002": 4}, gpu_metrics="dcgm")
    source = observed_gpus(scraped.config, None, registry)
    assert isinstance(source, DcgmScrapeGpuSource)
    assert source._urls == ["http://nid001:9400/metrics", "http://nid002:9400/metrics"]
    through_prometheus = operator_for(
        tmp_path, {"nid001": 4}, gpu_metrics="dcgm", prometheus_url="http://prom:9090"
    )
    assert isinstance(
        observed_gpus(through_prometheus.config, None, registry), DcgmPrometheusGpuSource
    )
    herd_metrics = operator_for(tmp_path, {"nid001": 4}, prometheus_url="http://prom:9090")
    assert not isinstance(
        observed_gpus(herd_metrics.config, None, registry), DcgmPrometheusGpuSource
    )


def test_a_one_host_operator_maps_the_gpus_its_jobs_hold(tmp_path: Path) -> None:
    class Placements:
        def placements(self) -> dict[str, Placement]:
            return {"resnet": Placement((("nid001", (0, 2)),)), "bert": Placement.EMPTY}

    operator = operator_for(tmp_path, {"nid001": 4}, dcgm_job_mapping_dir=tmp_path / "map")
    loop = job_mapping(operator.config, Placements())  # type: ignore[arg-type]
    assert loop is not None
    loop.writer.write()
    assert hpc_jobs_by_gpu(tmp_path / "map") == {"0": ["resnet"], "2": ["resnet"]}
    # Many hosts: each node's exporter keeps its own node's files.
    many = operator_for(tmp_path, {"a": 1, "b": 1}, dcgm_job_mapping_dir=tmp_path / "map")
    assert job_mapping(many.config, Placements()) is None  # type: ignore[arg-type]


def test_unknown_owners_leave_the_files_as_they_are(tmp_path: Path) -> None:
    """The operator out of reach (a restart that leaves the jobs running): the jobs still
    hold their GPUs, so their labels stay."""
    owners: dict[int, str] | None = {0: "resnet"}
    writer = JobMappingWriter(tmp_path, lambda: owners)
    writer.write()
    owners = None
    writer.write()
    assert hpc_jobs_by_gpu(tmp_path) == {"0": ["resnet"]}
    owners = {}
    writer.write()
    assert hpc_jobs_by_gpu(tmp_path) == {}


def test_a_link_planted_where_a_temporary_file_goes_is_not_followed(tmp_path: Path) -> None:
    """Another user of a shared mapping directory links the names the writer's temporary
    files had (`.N.<pid>.tmp`) to a file of theirs: the writer must not truncate, rewrite or
    chmod it (it did all three), and its own files are right all the same."""
    shared = tmp_path / "mapping"
    shared.mkdir()
    victim = tmp_path / "victim-secret"
    victim.write_text("do not touch\n")
    victim.chmod(0o600)
    for index in range(4):
        (shared / f".{index}.{os.getpid()}.tmp").symlink_to(victim)
    writer = JobMappingWriter(shared, lambda: {0: "resnet", 2: "bert"})
    writer.write()
    assert victim.read_text() == "do not touch\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert (shared / "0").read_text() == "resnet\n" and (shared / "2").read_text() == "bert\n"
    assert stat.S_IMODE((shared / "0").stat().st_mode) == 0o644, "readable by dcgm-exporter"
    leftovers = {path.name for path in shared.iterdir()} - {"0", "2"}
    assert all(os.path.islink(shared / name) for name in leftovers), "no temporary file left"
