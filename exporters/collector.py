"""Prometheus collector for GPU readings: reads its source at scrape time.

Series are labelled `host, gpu, uuid, kind, herd_job`: `herd_job` is the HERD job
that holds the GPU ("" when none). Not `job`, which Prometheus reserves for the
scrape job and would rename to `exported_job`.

Per-process memory (`herd_gpu_process_memory_used_bytes`, labelled `pid`) is off unless
asked for (`per_process=True`): every restart of a job's workers brings new pids, so each
would start new series that Prometheus keeps for its whole retention. By default a GPU's
processes are counted instead (`herd_gpu_processes`), whose labels stay the same.

Given the workers' pids (`pid_owners`), each GPU's memory is also attributed to the jobs whose
workers use it (exporters/attribution.py): `herd_job_gpu_memory_used_bytes` (one series per
job and GPU, gone with the job's workers; none while a worker's memory cannot be read),
`herd_job_gpu_utilization_ratio` (the job's processes' share of the GPU's time, 0-1: NVML's
per-process SM utilization, or the GPU's own where the job is alone on it; none when unknown),
`herd_gpu_jobs` (how many jobs have a worker on the GPU: above 1 on a shared GPU) and
`herd_gpu_unattributed_memory_bytes` (processes of no job). Their labels are `host, gpu,
uuid, kind` and, for the first, `herd_job`: the job the memory is charged to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from herd_operator.exporters.attribution import PidOwners, attribute
from herd_operator.exporters.gpu import GpuReading, GpuSource

log = logging.getLogger(__name__)

GPU_LABELS = ["host", "gpu", "uuid", "kind", "herd_job"]
SHARED_GPU_LABELS = ["host", "gpu", "uuid", "kind"]
READ_FAILED = "read_failed"
"""The reason under which the collector counts a source's `read()` raising."""


@dataclass(frozen=True)
class _Read:
    readings: list[GpuReading]
    up: bool
    duration_seconds: float
    at: float


class GpuCollector:
    """Exposes `source`'s GPUs, each labelled with the job that `owners()` says holds it.

    With `stale_after > 0`, a read younger than that many seconds is served again
    instead of reading the source once more (several scrapers, one NVML read). With
    `per_process`, each process's memory is exported too, labelled with its pid.
    """

    def __init__(
        self,
        source: GpuSource,
        owners: Callable[[], Mapping[tuple[str, int], str]] = dict,
        *,
        stale_after: float = 0,
        per_process: bool = False,
        pid_owners: Callable[[], PidOwners] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.pid_owners = pid_owners
        self.per_process = per_process
        self.owners = owners
        self.stale_after = stale_after
        self._clock = clock
        self._lock = threading.Lock()
        self._last: _Read | None = None
        self._read_failures = 0
        self._read_failing = False
        self._owners_failing = False

    def describe(self) -> Iterator[Metric]:
        """The families without samples, so registering does not read the GPUs."""
        yield from _families().all(self.per_process)
        if self.pid_owners is not None:
            yield from _JobFamilies().all()

    def collect(self) -> Iterator[Metric]:
        read = self._read()
        families = _families()
        owners = self._owners()
        per_host_kind: Counter[tuple[str, str]] = Counter()
        for reading in read.readings:
            labels = [
                reading.host,
                str(reading.index),
                reading.uuid,
                reading.kind,
                owners.get((reading.host, reading.index), ""),
            ]
            per_host_kind[reading.host, reading.kind] += 1
            families.info.add_metric(labels, 1)
            used, total = reading.memory_used_bytes, reading.memory_total_bytes
            if used is not None:
                families.used.add_metric(labels, used)
            if total is not None:
                families.total.add_metric(labels, total)
            if used is not None and total:
                families.memory_ratio.add_metric(labels, used / total)
            if reading.utilization_ratio is not None:
                families.utilization.add_metric(labels, reading.utilization_ratio)
            if reading.power_watts is not None:
                families.power.add_metric(labels, reading.power_watts)
            process_used: dict[int, int] = {}
            for process in reading.processes:  # one series per pid, even if listed twice
                process_used[process.pid] = process_used.get(process.pid, 0) + process.used_bytes
            families.processes.add_metric(labels, len(process_used))
            if self.per_process:
                for pid, process_bytes in process_used.items():
                    families.process_used.add_metric([*labels, str(pid)], process_bytes)
        for (host, kind), count in per_host_kind.items():
            families.gpus.add_metric([host, kind], count)
        families.up.add_metric([], 1 if read.up else 0)
        for reason, count in sorted(self._error_counts().items()):
            families.errors.add_metric([reason], count)
        families.duration.add_metric([], read.duration_seconds)
        yield from families.all(self.per_process)
        if self.pid_owners is not None:
            yield from self._job_memory(read.readings, self.pid_owners)

    def _job_memory(
        self, readings: list[GpuReading], pid_owners: Callable[[], PidOwners]
    ) -> list[Metric]:
        families = _JobFamilies()
        try:
            owners = pid_owners()
        except Exception:
            # Like the GPUs' owners: the memory is then charged to no job, not to a wrong one.
            log.exception("asking whose workers the processes are failed")
            owners = {}
        attribution = attribute(readings, owners)
        by_gpu = attribution.by_gpu()
        for reading in readings:
            labels = [reading.host, str(reading.index), reading.uuid, reading.kind]
            jobs = by_gpu.get((reading.host, reading.index), {})
            families.jobs.add_metric(labels, len(jobs))
            families.unattributed.add_metric(
                labels, attribution.unattributed.get((reading.host, reading.index), 0)
            )
            for job, used in sorted(jobs.items()):
                if used is not None:
                    families.used.add_metric([*labels, job], used)
                ratio = attribution.utilization.get((job, reading.host, reading.index))
                if ratio is not None:
                    families.utilization.add_metric([*labels, job], ratio)
        return families.all()

    def _read(self) -> _Read:
        with self._lock:
            now = self._clock()
            last = self._last
            if last is not None and self.stale_after > 0 and now - last.at < self.stale_after:
                return last
            started = time.perf_counter()
            try:
                readings = self.source.read()
            except Exception:
                # A broken source must not break the scrape: the scrape reports it instead.
                # Logged when it starts failing, not at every scrape.
                if not self._read_failing:
                    log.exception("reading GPUs from %r failed", self.source)
                self._read_failing = True
                self._read_failures += 1
                self._last = None
                return _Read([], False, time.perf_counter() - started, now)
            if self._read_failing:
                log.info("reading GPUs from %r works again", self.source)
            self._read_failing = False
            up = bool(getattr(self.source, "up", True))
            self._last = _Read(readings, up, time.perf_counter() - started, now)
            return self._last

    def _owners(self) -> Mapping[tuple[str, int], str]:
        try:
            owners = self.owners()
        except Exception:
            # Unknown owners leave the job label empty; the GPU metrics are still true.
            if not self._owners_failing:
                log.exception("asking who owns the GPUs failed")
            self._owners_failing = True
            return {}
        self._owners_failing = False
        return owners

    def _error_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        errors = getattr(self.source, "errors", None)
        if callable(errors):
            counts.update({str(reason): int(count) for reason, count in errors().items()})
        with self._lock:
            if self._read_failures:
                counts[READ_FAILED] = counts.get(READ_FAILED, 0) + self._read_failures
        return counts


@dataclass(frozen=True)
class _Families:
    info: GaugeMetricFamily
    used: GaugeMetricFamily
    total: GaugeMetricFamily
    memory_ratio: GaugeMetricFamily
    utilization: GaugeMetricFamily
    power: GaugeMetricFamily
    processes: GaugeMetricFamily
    process_used: GaugeMetricFamily
    gpus: GaugeMetricFamily
    up: GaugeMetricFamily
    errors: CounterMetricFamily
    duration: GaugeMetricFamily

    def all(self, per_process: bool) -> list[Metric]:
        return [
            getattr(self, name.name)
            for name in fields(self)
            if per_process or name.name != "process_used"
        ]


class _JobFamilies:
    """The families of the GPUs' memory charged to jobs."""

    def __init__(self) -> None:
        self.used = GaugeMetricFamily(
            "herd_job_gpu_memory_used_bytes",
            "GPU memory used by one job's worker processes on one GPU.",
            labels=[*SHARED_GPU_LABELS, "herd_job"],
        )
        self.utilization = GaugeMetricFamily(
            "herd_job_gpu_utilization_ratio",
            "Share of the last seconds one job's worker processes ran a kernel on one GPU (0..1).",
            labels=[*SHARED_GPU_LABELS, "herd_job"],
        )
        self.jobs = GaugeMetricFamily(
            "herd_gpu_jobs",
            "Jobs with a worker process on the GPU (above 1: a shared GPU).",
            labels=SHARED_GPU_LABELS,
        )
        self.unattributed = GaugeMetricFamily(
            "herd_gpu_unattributed_memory_bytes",
            "GPU memory of processes that are no job's worker.",
            labels=SHARED_GPU_LABELS,
        )

    def all(self) -> list[Metric]:
        return [self.used, self.utilization, self.jobs, self.unattributed]


def _families() -> _Families:
    def gpu_gauge(name: str, documentation: str) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, documentation, labels=GPU_LABELS)

    return _Families(
        info=gpu_gauge("herd_gpu_info", "1 for every GPU read, with its identity and job."),
        used=gpu_gauge("herd_gpu_memory_used_bytes", "GPU memory in use."),
        total=gpu_gauge("herd_gpu_memory_total_bytes", "GPU memory size."),
        memory_ratio=gpu_gauge(
            "herd_gpu_memory_utilization_ratio", "Used over total GPU memory (0..1)."
        ),
        utilization=gpu_gauge(
            "herd_gpu_utilization_ratio", "Share of the last sample period a kernel ran (0..1)."
        ),
        power=gpu_gauge("herd_gpu_power_watts", "GPU power draw."),
        processes=gpu_gauge("herd_gpu_processes", "Processes using the GPU."),
        process_used=GaugeMetricFamily(
            "herd_gpu_process_memory_used_bytes",
            "GPU memory used by one process.",
            labels=[*GPU_LABELS, "pid"],
        ),
        gpus=GaugeMetricFamily(
            "herd_gpus", "GPUs read on each host, by kind.", labels=["host", "kind"]
        ),
        up=GaugeMetricFamily("herd_exporter_up", "1 if the GPU source could be read."),
        errors=CounterMetricFamily(
            "herd_exporter_read_errors",
            "Failed GPU reads (a field, a GPU or the whole source), by reason.",
            labels=["reason"],
        ),
        duration=GaugeMetricFamily(
            "herd_exporter_read_duration_seconds", "How long the last GPU read took."
        ),
    )


def exposition(collector: Collector) -> str:
    """The Prometheus text exposition of one collector, as a scrape would return it."""
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()
