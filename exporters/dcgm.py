"""NVIDIA's dcgm-exporter, both ways: its metrics as the memory signal, herd's jobs as its labels.

Reading. Sites that run dcgm-exporter already have every GPU's framebuffer memory in
Prometheus. `DcgmScrapeGpuSource` (the exporters' `/metrics` pages) and
`DcgmPrometheusGpuSource` (PromQL) turn its series into the `GpuReading`s the observer
samples, so the memory policy needs no herd exporter on the nodes. The series used:

    DCGM_FI_DEV_FB_USED, DCGM_FI_DEV_FB_FREE   framebuffer memory used / free, in MiB
    DCGM_FI_DEV_FB_RESERVED, DCGM_FI_DEV_FB_TOTAL   where the site's counters list them
    DCGM_FI_DEV_GPU_UTIL (%), DCGM_FI_DEV_POWER_USAGE (W)   when present

with the labels dcgm-exporter writes on GPU series (its GPU template,
internal/pkg/rendermetrics/render_metrics.go in NVIDIA/dcgm-exporter): `gpu` (the GPU's
index), `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname` (when it knows the node's
name), MIG instances with `GPU_I_PROFILE`/`GPU_I_ID`, then extra labels such as `hpc_job`.
The host of a GPU is its `Hostname`, else the host of the page or of Prometheus' `instance`.
MIG instances are skipped: the pool hands out whole GPUs. Total memory is FB_TOTAL where
exported, else used + free (+ reserved).

Writing. dcgm-exporter's `--hpc-job-mapping-dir DIR` labels each GPU's series with
`hpc_job="<job>"` read from files in DIR, as its HPC mapper reads them
(internal/pkg/transformation/hpc.go in NVIDIA/dcgm-exporter: `getGPUFiles`, `readFile`,
`Process`). Every regular file whose name parses as an integer (`strconv.Atoi`; newer
versions also take `<gpu>.<instance>` for MIG) stands for the GPU of that index, matched
against the series' `gpu` label. Its lines are job ids, one per line; a GPU with several
lines gets one copy of each series per job; a GPU without a file keeps its series
unlabelled; other names (`.0.tmp`) are ignored. `JobMappingWriter` writes one such file per
GPU of this host that a herd job holds, holding the job's name, and removes it when the GPU
is free, so that DCGM's own series carry herd's job names.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from herd_operator.exporters.gpu import GpuReading
from herd_operator.exporters.sources import MetricSample, PrometheusGpuSource, ScrapeGpuSource
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic

log = logging.getLogger(__name__)

MIB = 1 << 20
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
DCGM_FAMILIES = (FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL, GPU_UTIL, POWER_USAGE)
HPC_JOB_LABEL = "hpc_job"
"""The label dcgm-exporter gives the job names it reads from the mapping files."""
DEFAULT_PORT = 9400
"""dcgm-exporter's default listening port (`--address :9400`)."""


@dataclass
class _DcgmGpu:
    uuid: str
    # family -> (time, value); the newest wins (a GPU mapped to two jobs is listed twice).
    values: dict[str, tuple[float, float]] = field(default_factory=dict)

    def reading(self, host: str, index: int) -> GpuReading:
        def value(name: str) -> float | None:
            return self.values[name][1] if name in self.values else None

        used, free = value(FB_USED), value(FB_FREE)
        total = value(FB_TOTAL)
        if total is None and used is not None and free is not None:
            total = used + free + (value(FB_RESERVED) or 0.0)
        util, power = value(GPU_UTIL), value(POWER_USAGE)
        return GpuReading(
            host=host,
            index=index,
            uuid=self.uuid,
            kind="dcgm",
            memory_used_bytes=None if used is None else round(used * MIB),
            memory_total_bytes=None if total is None else round(total * MIB),
            utilization_ratio=None if util is None else util / 100,
            power_watts=power,
        )


def dcgm_readings(
    samples: Iterable[MetricSample],
    now: float,
    max_age: float,
    host_of: Callable[[Mapping[str, str]], str | None],
) -> list[GpuReading]:
    """One reading per (host, gpu) from dcgm-exporter's series, fresh samples only.

    `host_of` names the host of a series that has no `Hostname` label (None: skipped).
    """
    gpus: dict[tuple[str, int], _DcgmGpu] = {}
    for sample in samples:
        if sample.name not in DCGM_FAMILIES or "GPU_I_ID" in sample.labels:
            continue
        when = now if sample.timestamp is None else sample.timestamp
        if now - when > max_age or not math.isfinite(sample.value):
            continue
        host = sample.labels.get("Hostname") or host_of(sample.labels)
        try:
            index = int(sample.labels["gpu"])
        except (KeyError, ValueError):
            continue  # not a GPU series (an NVSwitch, a CPU): nothing of the pool
        if not host:
            continue
        uuid = sample.labels.get("UUID") or sample.labels.get("uuid") or ""
        gpu = gpus.setdefault((host, index), _DcgmGpu(uuid))
        previous = gpu.values.get(sample.name)
        if previous is None or when > previous[0]:
            gpu.values[sample.name] = (when, sample.value)
    return [gpu.reading(host, index) for (host, index), gpu in gpus.items()]


def _url_host(url: str) -> str | None:
    return urllib.parse.urlsplit(url).hostname


def _instance_host(labels: Mapping[str, str]) -> str | None:
    instance = labels.get("instance", "")
    if not instance:
        return None
    return urllib.parse.urlsplit(f"//{instance}").hostname


class DcgmScrapeGpuSource(ScrapeGpuSource):
    """GPU readings scraped from dcgm-exporter's `/metrics` pages (one per node)."""

    def page_readings(self, samples: list[MetricSample], url: str) -> list[GpuReading]:
        return dcgm_readings(samples, time.time(), self.max_age, lambda _: _url_host(url))


class DcgmPrometheusGpuSource(PrometheusGpuSource):
    """GPU readings from dcgm-exporter's series in a Prometheus server that scrapes it."""

    families = DCGM_FAMILIES

    def series_readings(self, samples: list[MetricSample]) -> list[GpuReading]:
        return dcgm_readings(samples, time.time(), self.max_age_seconds, _instance_host)


def dcgm_exporter_urls(hosts: Iterable[str], port: int = DEFAULT_PORT) -> list[str]:
    """The `/metrics` URL of a dcgm-exporter on each host, at its default port."""
    return [
        f"http://[{host}]:{port}/metrics" if ":" in host else f"http://{host}:{port}/metrics"
        for host in hosts
    ]


class JobMappingWriter:
    """Keeps dcgm-exporter's HPC job mapping files in `directory` for this host's GPUs.

    `owners()` says which job holds each GPU index of this host, or None when that is not
    known now (the operator cannot be reached: the files are left as they are, rather than
    unlabel GPUs that jobs still hold). Each call to `write()` brings the files in line: a
    held GPU's file holds its job's name and a newline, a free GPU has no file. Files are
    replaced whole (a temporary name that is not an integer, then a rename), so
    dcgm-exporter never reads half of one; only the integer-named files are touched,
    whichever process wrote them, since dcgm-exporter reads them all.
    """

    def __init__(self, directory: Path, owners: Callable[[], Mapping[int, str] | None]) -> None:
        self.directory = directory
        self.owners = owners
        self._written: dict[int, str] = {}
        self._lock = threading.Lock()
        self._failing = False

    def write(self) -> None:
        """Bring the files in line with `owners()`; an error is logged when it starts."""
        with self._lock:
            try:
                owners = self.owners()
                if owners is None:
                    return
                self._write(dict(owners))
            except OSError as err:
                if not self._failing:
                    log.warning(
                        "cannot write DCGM job mapping files in %s: %s", self.directory, err
                    )
                self._failing = True
                self._written = {}  # unknown now: compare with the files again next time
                return
            if self._failing:
                log.info("DCGM job mapping files in %s written again", self.directory)
            self._failing = False

    def _write(self, owners: dict[int, str]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        present = {
            int(entry.name): entry.name
            for entry in os.scandir(self.directory)
            if entry.name.isascii() and entry.name.isdigit() and entry.is_file()
        }
        for index in sorted(set(present) - set(owners)):
            (self.directory / present[index]).unlink(missing_ok=True)
            self._written.pop(index, None)
        for index, job in sorted(owners.items()):
            if self._written.get(index) == job and index in present:
                continue
            _replace(self.directory / str(index), f"{job}\n")
            self._written[index] = job

    def clear(self) -> None:
        """Remove the files of every GPU: herd no longer says who holds them."""
        with self._lock:
            for index in list(self._written):
                (self.directory / str(index)).unlink(missing_ok=True)
            self._written = {}


def _replace(path: Path, text: str) -> None:
    """Replace `path` whole with `text`, through a temporary file this process made.

    The directory may be shared with other users: a temporary name chosen in advance could
    be another user's link, and writing or chmodding it by path would change the file it
    points to. mkstemp creates a new file (O_CREAT|O_EXCL: never through a link) with a
    random name that is not an integer, so dcgm-exporter's reader skips it; its mode is
    set on the descriptor it opened (readable by all: dcgm-exporter often runs as another
    user), and the rename replaces the entry `path`, not a file a link there points to.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o644)
            out.write(text)
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise


class JobMappingLoop:
    """Runs `writer.write()` every `interval` seconds on a thread (a `Periodic`, the first
    write at once) until `stop()`, which removes the files unless `clear_on_stop` is False
    (the operator then clears them itself unless it hands its jobs over)."""

    def __init__(
        self,
        writer: JobMappingWriter,
        interval: float = 1.0,
        *,
        clear_on_stop: bool = True,
        health: LoopHealth | None = None,
    ) -> None:
        self.writer = writer
        self.interval = interval
        self.clear_on_stop = clear_on_stop
        self._loop = Periodic(
            "dcgm-job-mapping",
            writer.write,
            interval,
            what="writing the DCGM job mapping",
            immediately=True,
            health=health,
            logger=log,
        )
        self.name = self._loop.name

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS, *, clear: bool | None = None) -> None:
        """Stop writing; with `clear` (default: `clear_on_stop`), remove the files (no job is
        known to hold the GPUs)."""
        self._loop.stop(timeout)
        if self.clear_on_stop if clear is None else clear:
            self.writer.clear()
