"""dcgm-exporter interoperability, against its real metric names, labels and mapping files.

`FakeDcgmExporter` serves on loopback what dcgm-exporter serves: the exposition its GPU
template renders (internal/pkg/rendermetrics/render_metrics.go in NVIDIA/dcgm-exporter:
`gpu`, `UUID`, `pci_bus_id`, `device`, `modelName`, MIG's `GPU_I_PROFILE`/`GPU_I_ID`,
`hostname` (`Hostname` in releases up to 4.5.3-4.8.2), then its extra labels and attributes
such as `hpc_job`), and it labels series from an HPC job mapping directory through
`hpc_mapping`, a model of its HPC mapper written from internal/pkg/transformation/hpc.go
(file names that are GPU ids, each line a job, one copy of a series per job, a file listed
and then not opened failing the scrape with 500). The operator's side must read the first
and write the second, sharing the files with a site's Slurm prolog.
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
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
    physical_gpu_ids,
    slot_gpu_ids,
)
from herd_operator.exporters.gpu import GpuReading
from herd_operator.runtime.config import OperatorConfig, OperatorError
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


GPU_FILE = re.compile(r"[0-9]+(\.[0-9]+)?")
"""hpc.go's `validGPUFile`, `^\\d+(\\.\\d+)?$` (RE2's `\\d` is ASCII digits, its `$` the end of
the text): a GPU id, or `<gpu>.<instance>` for a MIG instance."""
MAX_SCAN_TOKEN_BYTES = 64 * 1024
"""bufio.MaxScanTokenSize: a longer line is bufio.ErrTooLong."""


class HpcMapperError(Exception):
    """Where hpc.go's `Process` returns an error: server.go's `render` gives it back and
    the scrape is answered 500."""


def scan_lines(data: bytes) -> list[str]:
    """bufio.Scanner with ScanLines: split at each newline, a last line without one
    counted, one carriage return dropped at each line's end; a blank line is a line."""
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    if any(len(line) >= MAX_SCAN_TOKEN_BYTES for line in lines):
        raise HpcMapperError("bufio.Scanner: token too long")
    return [line.removesuffix(b"\r").decode("utf-8", "replace") for line in lines]


def hpc_mapping(
    directory: Path, after_listing: Callable[[], None] | None = None
) -> dict[str, list[str]]:
    """dcgm-exporter's reading of its `--hpc-job-mapping-dir` at a scrape, modelled on
    internal/pkg/transformation/hpc.go (NVIDIA/dcgm-exporter at d5e5f51): `Process` stats
    the directory (missing: no mapping, no error), `getGPUFiles` lists it (`os.ReadDir`,
    sorted by name) and keeps each entry whose `Info()` (an lstat) succeeds, that is not a
    directory and whose name matches `validGPUFile`; then `readFile` opens each (following
    a link) and scans its lines. Any error there fails the scrape. `after_listing` runs
    between the listing and the reads: what another process does in that gap."""
    if not directory.exists():
        return {}
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise HpcMapperError(f"ReadDir: {err}") from err
    files = []
    for name in names:
        try:
            info = os.lstat(directory / name)
        except OSError:
            continue  # "can not get file info": a warning, the entry skipped
        if stat.S_ISDIR(info.st_mode) or not GPU_FILE.fullmatch(name):
            continue
        files.append(name)
    if after_listing is not None:
        after_listing()
    mapping: dict[str, list[str]] = {}
    for name in files:
        try:
            data = (directory / name).read_bytes()
        except OSError as err:
            raise HpcMapperError(f"readFile {name}: {err}") from err
        mapping.setdefault(name, []).extend(scan_lines(data))
    return mapping


def hpc_jobs(mapping: dict[str, list[str]], gpu: int, mig_instance: int | None = None) -> list[str]:
    """The `hpc_job` values a GPU's series get (`Process`: one copy of each series per job;
    none for a GPU without jobs, an empty file included). MIG instances are keyed
    `<gpu>.<instance>`."""
    return mapping.get(str(gpu) if mig_instance is None else f"{gpu}.{mig_instance}", [])


def labelled(directory: Path) -> dict[str, list[str]]:
    """The GPUs dcgm-exporter labels, with their jobs (files without a line label none)."""
    return {key: jobs for key, jobs in hpc_mapping(directory).items() if jobs}


@dataclass
class FakeDcgmExporter:
    """Renders dcgm-exporter's GPU exposition for `gpus`, labelled from `mapping_dir`."""

    hostname: str | None
    gpus: list[DcgmGpu]
    mapping_dir: Path | None = None
    hostname_label: str = "hostname"
    """`Hostname` up to release 4.5.3-4.8.2, `hostname` since (render_metrics.go)."""
    driver: str = "550.54.15"
    url: str = ""
    scrapes: int = 0

    def render(self) -> str:
        mapping = hpc_mapping(self.mapping_dir) if self.mapping_dir else {}
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
                    labels += f',{self.hostname_label}="{self.hostname}"'
                labels += f',DCGM_FI_DRIVER_VERSION="{self.driver}"'
                jobs: list[str | None] = [*hpc_jobs(mapping, gpu.index, gpu.mig_instance)]
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
            try:
                body, code = fake.render().encode(), 200 if self.path == "/metrics" else 404
            except HpcMapperError as err:
                body, code = f"{err}\n".encode(), 500
            self.send_response(code)
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
        "gpu", "UUID", "pci_bus_id", "device", "modelName", "hostname", "DCGM_FI_DRIVER_VERSION"
    }  # fmt: skip


@pytest.mark.parametrize("hostname_label", ["hostname", "Hostname"])
def test_scraping_dcgm_exporter_gives_memory_in_bytes_per_gpu_of_the_host(
    dcgm_exporter: FakeDcgmExporter, hostname_label: str
) -> None:
    """Either spelling of the node's label (current dcgm-exporter's, or a release's up to
    4.5.3-4.8.2) names the host: with `hostname` the GPUs were the page's host's (127.0.0.1)."""
    dcgm_exporter.hostname_label = hostname_label
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


def scraped_jobs(exporter: FakeDcgmExporter) -> dict[tuple[str, str], set[str | None]]:
    """(series, gpu) -> the hpc_job values of its copies on the fake's page."""
    found: dict[tuple[str, str], set[str | None]] = {}
    for family in text_string_to_metric_families(exporter.render()):
        for sample in family.samples:
            if "GPU_I_ID" not in sample.labels:
                key = (sample.name, sample.labels["gpu"])
                found.setdefault(key, set()).add(sample.labels.get(HPC_JOB_LABEL))
    return found


def temporary_files(directory: Path) -> list[str]:
    return [path.name for path in directory.iterdir() if path.name.endswith(".tmp")]


def test_mapping_files_make_dcgm_label_each_gpu_with_its_herd_job(
    dcgm_exporter: FakeDcgmExporter, tmp_path: Path
) -> None:
    mapping_dir = tmp_path / "dcgm-job-map"
    dcgm_exporter.mapping_dir = mapping_dir
    owners = {0: "resnet", 1: "resnet", 2: "bert-large"}
    writer = JobMappingWriter(mapping_dir, lambda: owners)

    writer.write()
    assert labelled(mapping_dir) == {"0": ["resnet"], "1": ["resnet"], "2": ["bert-large"]}
    jobs = scraped_jobs(dcgm_exporter)
    assert jobs[(FB_USED, "0")] == {"resnet"}
    assert jobs[(FB_FREE, "2")] == {"bert-large"}

    # bert-large ends and resnet shrinks to GPU 0; a file under a name dcgm-exporter
    # ignores is left alone.
    (mapping_dir / "README").write_text("not a GPU\n")
    owners = {0: "resnet"}
    writer.write()
    assert labelled(mapping_dir) == {"0": ["resnet"]}
    jobs = scraped_jobs(dcgm_exporter)
    assert jobs[(FB_USED, "0")] == {"resnet"}
    assert jobs[(FB_USED, "1")] == {None}
    assert jobs[(FB_USED, "2")] == {None}
    assert (mapping_dir / "README").read_text() == "not a GPU\n"
    assert temporary_files(mapping_dir) == []

    writer.clear()
    assert labelled(mapping_dir) == {}
    # Emptied, not deleted: a scrape that listed a file still opens it.
    assert hpc_mapping(mapping_dir) == {"0": [], "1": [], "2": []}


def test_the_reader_model_follows_hpc_go() -> None:
    """The model's own rules, each one of hpc.go's (read at NVIDIA/dcgm-exporter d5e5f51)."""
    assert scan_lines(b"") == []
    assert scan_lines(b"a\n") == ["a"]
    assert scan_lines(b"a\r\nb") == ["a", "b"]  # CR dropped, a last line without newline
    assert scan_lines(b"a\n\nb\n") == ["a", "", "b"]  # a blank line is a job named ""
    assert scan_lines(b"\n") == [""]
    with pytest.raises(HpcMapperError):
        scan_lines(b"x" * MAX_SCAN_TOKEN_BYTES)
    for name in ("0", "12", "2.0", "3.10", "007"):
        assert GPU_FILE.fullmatch(name), name
    for name in ("+1", "-1", "1_0", " 1", "1\n", ".0.abc.tmp", ".herd-lines.0", "2.", "a"):
        assert not GPU_FILE.fullmatch(name), name


def test_a_sites_lines_stay_and_herd_takes_out_only_its_own(
    dcgm_exporter: FakeDcgmExporter, tmp_path: Path
) -> None:
    """A site's Slurm prolog wrote the allocation's job id into the files of its GPUs (one
    with Windows line ends and no last newline, one with two jobs): herd adds its job after
    them and takes out only its own line; a GPU it never held is not written at all."""
    mapping_dir = tmp_path / "dcgm-job-map"
    mapping_dir.mkdir()
    (mapping_dir / "0").write_bytes(b"4567890\n")
    (mapping_dir / "1").write_bytes(b"4567890\r\n4567891")
    (mapping_dir / "3").write_bytes(b"999\n")
    dcgm_exporter.mapping_dir = mapping_dir
    owners: dict[int, str] = {0: "resnet", 1: "bert", 2: "bert"}
    writer = JobMappingWriter(mapping_dir, lambda: owners)

    writer.write()
    assert labelled(mapping_dir) == {
        "0": ["4567890", "resnet"], "1": ["4567890", "4567891", "bert"], "2": ["bert"],
        "3": ["999"],
    }  # fmt: skip
    assert scraped_jobs(dcgm_exporter)[(FB_USED, "1")] == {"4567890", "4567891", "bert"}

    owners = {0: "bert"}
    writer.write()
    assert labelled(mapping_dir) == {
        "0": ["4567890", "bert"], "1": ["4567890", "4567891"], "3": ["999"]
    }  # fmt: skip
    assert (mapping_dir / "1").read_bytes() == b"4567890\r\n4567891\n"  # the site's bytes

    writer.clear()
    assert labelled(mapping_dir) == {"0": ["4567890"], "1": ["4567890", "4567891"], "3": ["999"]}
    assert (mapping_dir / "3").read_bytes() == b"999\n"
    assert temporary_files(mapping_dir) == []


def test_a_writer_started_again_takes_out_the_lines_of_jobs_that_ended_meanwhile(
    tmp_path: Path,
) -> None:
    """An agent restarted (or an operator that took over) knows the lines herd wrote
    before it from `.herd-lines.<gpu>`: a job that ended while it was away loses its line,
    a job still there keeps its one line, and the site's line stays."""
    (tmp_path / "0").write_text("4567890\n")
    JobMappingWriter(tmp_path, lambda: {0: "gone", 1: "still"}).write()
    assert labelled(tmp_path) == {"0": ["4567890", "gone"], "1": ["still"]}

    JobMappingWriter(tmp_path, lambda: {1: "still"}).write()
    assert labelled(tmp_path) == {"0": ["4567890"], "1": ["still"]}


def test_a_line_with_the_jobs_name_already_there_is_not_written_twice(tmp_path: Path) -> None:
    """Its ledger lost (or never written: a crash between the file and the ledger), herd
    finds its job's line in the file: a second copy would give dcgm-exporter two series
    with the same labels, whose second sample Prometheus drops as a duplicate."""
    (tmp_path / "0").write_text("4567890\nresnet\n")
    owners: dict[int, str] = {0: "resnet"}
    writer = JobMappingWriter(tmp_path, lambda: owners)
    writer.write()
    assert labelled(tmp_path) == {"0": ["4567890", "resnet"]}
    owners = {}
    writer.write()
    assert labelled(tmp_path) == {"0": ["4567890"]}


def test_a_scrape_between_listing_and_reading_finds_every_file_it_listed(
    dcgm_exporter: FakeDcgmExporter, tmp_path: Path
) -> None:
    """dcgm-exporter lists the directory, then opens each file: a GPU that fell free in
    between must still have its file (it was deleted: the open failed, the scrape was 500)."""
    owners: dict[int, str] = {0: "resnet", 1: "resnet"}
    writer = JobMappingWriter(tmp_path, lambda: owners)
    writer.write()

    def job_ends() -> None:
        owners.clear()
        writer.write()

    assert hpc_mapping(tmp_path, after_listing=job_ends) == {"0": [], "1": []}
    dcgm_exporter.mapping_dir = tmp_path
    with urllib.request.urlopen(dcgm_exporter.url, timeout=10) as page:
        assert page.status == 200


def test_scrapes_during_writes_see_whole_files_and_never_fail(tmp_path: Path) -> None:
    """A reader thread runs the model as fast as it can while the writer moves GPU 0
    between two jobs and none, 300 times: every read is one of the states the writer
    meant (the site's line always first), and none fails."""
    (tmp_path / "0").write_text("4567890\n")
    states: list[dict[int, str]] = [{0: "resnet"}, {0: "bert"}, {}]
    owners: dict[int, str] = {}
    writer = JobMappingWriter(tmp_path, lambda: owners)
    done = threading.Event()
    seen: list[list[str]] = []
    errors: list[BaseException] = []

    def scrape() -> None:
        while not done.is_set():
            try:
                seen.append(hpc_jobs(hpc_mapping(tmp_path), 0))
            except BaseException as err:  # what a 500 would be
                errors.append(err)
                return

    reader = threading.Thread(target=scrape)
    reader.start()
    try:
        for turn in range(300):
            owners = states[turn % len(states)]
            writer.write()
    finally:
        done.set()
        reader.join(timeout=30)
    assert errors == []
    assert seen, "the reader read"
    allowed = [["4567890"], ["4567890", "resnet"], ["4567890", "bert"]]
    assert [jobs for jobs in seen if jobs not in allowed] == []
    assert temporary_files(tmp_path) == []


STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "4"}
"""An `srun` step of job 7 (the agents' steps)."""


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "2,3"}, (2, 3)),
        ({"CUDA_VISIBLE_DEVICES": "2,3"}, (2, 3)),
        # The step's own node's GPUs come first; the batch node's are not this node's.
        ({**STEP, "SLURM_STEP_GPUS": "1", "SLURM_JOB_GPUS": "2,3"}, (1,)),
        ({**STEP, "SLURM_JOB_GPUS": "2,3"}, None),
        # Inside Slurm, CUDA_VISIBLE_DEVICES counts from 0 in a device cgroup, or is the
        # batch node's, inherited: Slurm's ids are the node's.
        ({**STEP, "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}, None),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}, (2, 3)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-5f1c0000-aaaa-bbbb-cccc-0123456789ab"}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({}, None),
    ],
)
def test_pool_slots_are_named_by_their_physical_gpu_ids(
    environ: dict[str, str], expected: tuple[int, ...] | None
) -> None:
    ids, said = physical_gpu_ids(environ)
    assert ids == expected
    assert said


@pytest.mark.parametrize(
    ("slots", "gpu_ids", "expected"),
    [
        ((0, 1), (2, 3), {0: 2, 1: 3}),  # counted: the k-th slot is the k-th GPU
        ((2, 3), (2, 3), {2: 2, 3: 3}),  # asked of Slurm (IDX:2-3): the slots are the ids
        ((1, 0), (3, 2), {0: 3, 1: 2}),  # CUDA_VISIBLE_DEVICES=3,2: its order is the slots'
        ((0, 1, 2), (5, 6), {0: 5, 1: 6}),  # a slot beyond the ids has none
        ((1, 2), (1, 2), {1: 1, 2: 2}),
    ],
)
def test_pool_slots_map_to_gpu_ids_by_position_unless_they_are_the_ids(
    slots: tuple[int, ...], gpu_ids: tuple[int, ...], expected: dict[int, int]
) -> None:
    assert slot_gpu_ids(slots, gpu_ids) == expected


@given(
    st.lists(st.integers(0, 15), unique=True, max_size=8),
    st.lists(st.integers(0, 15), unique=True, max_size=8),
)
def test_no_two_slots_are_one_gpu_and_every_gpu_is_one_of_the_ids(
    slots: list[int], gpu_ids: list[int]
) -> None:
    mapped = slot_gpu_ids(slots, gpu_ids)
    assert set(mapped) <= set(slots)
    assert set(mapped.values()) <= set(gpu_ids)
    assert len(set(mapped.values())) == len(mapped)
    assert len(mapped) == min(len(slots), len(gpu_ids))


def test_slots_not_known_yet_leave_the_files_as_they_are(tmp_path: Path) -> None:
    """An agent whose operator has not answered yet does not know which GPU a slot is."""
    slots: tuple[int, ...] | None = None
    writer = JobMappingWriter(tmp_path, lambda: {0: "resnet"}, (2, 3), lambda: slots)
    writer.write()
    assert hpc_mapping(tmp_path) == {}
    slots = (0, 1)
    writer.write()
    assert labelled(tmp_path) == {"2": ["resnet"]}


def test_a_slurm_gpu_list_that_is_not_ids_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="SLURM_STEP_GPUS"):
        physical_gpu_ids({"SLURM_STEP_GPUS": "gpu:2"})


def test_on_a_shared_node_slot_0_is_written_as_the_allocations_first_gpu(tmp_path: Path) -> None:
    """`SLURM_JOB_GPUS=2,3`: herd's pool has slots 0 and 1, and GPUs 0 and 1 belong to
    another user's job, whose prolog lines herd must neither label nor touch."""
    (tmp_path / "0").write_text("1111\n")
    (tmp_path / "1").write_text("1111\n")
    ids, _ = physical_gpu_ids({"SLURM_JOB_GPUS": "2,3"})
    owners: dict[int, str] = {0: "resnet", 1: "bert", 5: "stray"}
    writer = JobMappingWriter(tmp_path, lambda: owners, ids)
    writer.write()
    assert labelled(tmp_path) == {"0": ["1111"], "1": ["1111"], "2": ["resnet"], "3": ["bert"]}
    # Another herd on the same node (GPUs 0 and 1) has its own ledgers: this one's writer,
    # started again, reads only its GPUs'.
    (tmp_path / "0").write_text("1111\nother\n")
    (tmp_path / ".herd-lines.0").write_text("other\n")
    owners = {}
    JobMappingWriter(tmp_path, lambda: owners, ids).write()
    assert labelled(tmp_path) == {"0": ["1111", "other"], "1": ["1111"]}


def test_a_mapping_file_removed_behind_the_writers_back_is_written_again(tmp_path: Path) -> None:
    writer = JobMappingWriter(tmp_path, lambda: {3: "resnet"})
    writer.write()
    (tmp_path / "3").unlink()
    writer.write()
    assert labelled(tmp_path) == {"3": ["resnet"]}


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
    assert labelled(blocker / "map") == {"0": ["a"]}


def test_the_mapping_loop_follows_the_owners_and_clears_on_stop(tmp_path: Path) -> None:
    owners: dict[int, str] = {1: "a"}
    loop = JobMappingLoop(JobMappingWriter(tmp_path, lambda: dict(owners)), interval=0.02)
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while labelled(tmp_path) != {"1": ["a"]} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert labelled(tmp_path) == {"1": ["a"]}
        owners[1] = "b"
        while labelled(tmp_path) != {"1": ["b"]} and time.monotonic() < deadline:
            time.sleep(0.02)
        assert labelled(tmp_path) == {"1": ["b"]}
    finally:
        loop.stop()
    assert labelled(tmp_path) == {}


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
        """The allocator as the mapping sees it: its placements and its pool."""

        pool = Pool.from_counts({"nid001": 4})

        def placements(self) -> dict[str, Placement]:
            return {"resnet": Placement((("nid001", (0, 2)),)), "bert": Placement.EMPTY}

    operator = operator_for(tmp_path, {"nid001": 4}, dcgm_job_mapping_dir=tmp_path / "map")
    loop = job_mapping(operator.config, Placements(), environ={})  # type: ignore[arg-type]
    assert loop is not None
    loop.writer.write()
    assert labelled(tmp_path / "map") == {"0": ["resnet"], "2": ["resnet"]}
    # The same pool on a node shared with another job: Slurm gave this one GPUs 4 to 7.
    on_shared = operator_for(tmp_path, {"nid001": 4}, dcgm_job_mapping_dir=tmp_path / "shared")
    shared_node = {"SLURM_JOB_GPUS": "4,5,6,7"}
    shared = job_mapping(on_shared.config, Placements(), environ=shared_node)  # type: ignore[arg-type]
    assert shared is not None
    shared.writer.write()
    assert labelled(tmp_path / "shared") == {"4": ["resnet"], "6": ["resnet"]}
    # A pool that asked Slurm numbers the GPUs as Slurm does: those are the files.
    by_slurm = Operator(
        OperatorConfig(
            specs_dir=tmp_path / "specs",
            state_dir=tmp_path / "state",
            pool=StaticPool(Pool((("nid001", (4, 5, 6, 7)),)), False, "scontrol"),
            dcgm_job_mapping_dir=tmp_path / "slurm",
        )
    )

    class SlurmPlacements:
        pool = by_slurm.config.pool.pool

        def placements(self) -> dict[str, Placement]:
            return {"resnet": Placement((("nid001", (5, 7)),))}

    numbered = job_mapping(by_slurm.config, SlurmPlacements(), environ=shared_node)  # type: ignore[arg-type]
    assert numbered is not None
    numbered.writer.write()
    assert labelled(tmp_path / "slurm") == {"5": ["resnet"], "7": ["resnet"]}
    with pytest.raises(OperatorError, match="SLURM_JOB_GPUS"):
        job_mapping(on_shared.config, Placements(), environ={"SLURM_JOB_GPUS": "x"})  # type: ignore[arg-type]
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
    assert labelled(tmp_path) == {"0": ["resnet"]}
    owners = {}
    writer.write()
    assert labelled(tmp_path) == {}


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
    ledgers = {".herd-lines.0", ".herd-lines.2"}
    leftovers = {path.name for path in shared.iterdir()} - {"0", "2"} - ledgers
    assert all(os.path.islink(shared / name) for name in leftovers), "no temporary file left"


def test_a_link_planted_as_a_gpus_file_is_not_read_nor_written_through(tmp_path: Path) -> None:
    """Another user links `2` to a file of this user's: herd must not copy its content
    into a file every user can read, nor write through it; it leaves that GPU's entry
    alone (logged) and writes the other GPUs' files all the same."""
    shared = tmp_path / "mapping"
    shared.mkdir()
    victim = tmp_path / "victim-secret"
    victim.write_text("secret\n")
    victim.chmod(0o600)
    (shared / "2").symlink_to(victim)
    writer = JobMappingWriter(shared, lambda: {0: "resnet", 2: "bert"})
    writer.write()
    assert victim.read_text() == "secret\n"
    assert os.path.islink(shared / "2")
    assert (shared / "0").read_text() == "resnet\n"
    copies = [p.name for p in shared.iterdir() if not p.is_symlink() and "secret" in p.read_text()]
    assert copies == []
