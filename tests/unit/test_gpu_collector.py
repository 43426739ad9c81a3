"""GpuCollector: the exposition, series by series, for a fake source."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.gpu import GpuReading, ProcessMemory

GIB = 1 << 30

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


class FakeSource:
    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings
        self.reads = 0
        self.up = True
        self.error_counts: dict[str, int] = {}

    def read(self) -> list[GpuReading]:
        self.reads += 1
        return list(self.readings)

    def errors(self) -> dict[str, int]:
        return dict(self.error_counts)


class BrokenSource:
    def __init__(self) -> None:
        self.broken = True

    def read(self) -> list[GpuReading]:
        if self.broken:
            raise RuntimeError("the GPU went away")
        return []


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def gpu(
    host: str,
    index: int,
    used: int | None,
    total: int | None = 40 * GIB,
    utilization: float | None = None,
    power: float | None = None,
    processes: tuple[ProcessMemory, ...] = (),
) -> GpuReading:
    return GpuReading(host, index, f"GPU-{host}-{index}", "nvml", used, total, utilization, power,
                      processes)  # fmt: skip


def two_hosts() -> list[GpuReading]:
    return [
        gpu("n1", 0, 10 * GIB, utilization=0.5, power=120.25,
            processes=(ProcessMemory(100, 6 * GIB), ProcessMemory(101, 4 * GIB))),
        gpu("n1", 1, 30 * GIB, utilization=1.0, power=300.0),
        gpu("n2", 0, 0, utilization=0.0, power=55.5),
        gpu("n2", 1, 20 * GIB, utilization=0.25, power=200.0,
            processes=(ProcessMemory(200, 20 * GIB),)),
    ]  # fmt: skip


OWNERS: Mapping[tuple[str, int], str] = {
    ("n1", 0): "resnet",
    ("n1", 1): "resnet",
    ("n2", 1): "bert",
}


def series(text: str, prefix: str = "herd_") -> Series:
    """Every sample of the exposition as {(name, labels): value}; fails on duplicates."""
    found: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.name, frozenset(sample.labels.items()))
            assert key not in found, f"duplicate series {key}"
            if sample.name.startswith(prefix):
                found[key] = sample.value
    return found


def labels(host: str, index: int, job: str, **extra: str) -> frozenset[tuple[str, str]]:
    return frozenset(
        {"host": host, "gpu": str(index), "uuid": f"GPU-{host}-{index}", "kind": "nvml",
         "herd_job": job, **extra}.items()
    )  # fmt: skip


def test_exposition_series_by_series_for_two_hosts() -> None:
    source = FakeSource(two_hosts())
    source.error_counts = {"not_supported": 2}

    found = series(exposition(GpuCollector(source, lambda: OWNERS, per_process=True)))
    duration = found.pop(("herd_exporter_read_duration_seconds", frozenset()))

    expected: Series = {}
    for host, index, job, used, util, power, processes in [
        ("n1", 0, "resnet", 10, 0.5, 120.25, 2),
        ("n1", 1, "resnet", 30, 1.0, 300.0, 0),
        ("n2", 0, "", 0, 0.0, 55.5, 0),
        ("n2", 1, "bert", 20, 0.25, 200.0, 1),
    ]:
        gpu_labels = labels(host, index, job)
        expected[("herd_gpu_processes", gpu_labels)] = processes
        expected[("herd_gpu_info", gpu_labels)] = 1
        expected[("herd_gpu_memory_used_bytes", gpu_labels)] = used * GIB
        expected[("herd_gpu_memory_total_bytes", gpu_labels)] = 40 * GIB
        expected[("herd_gpu_memory_utilization_ratio", gpu_labels)] = used / 40
        expected[("herd_gpu_utilization_ratio", gpu_labels)] = util
        expected[("herd_gpu_power_watts", gpu_labels)] = power
    for host, index, job, pid, used in [
        ("n1", 0, "resnet", 100, 6),
        ("n1", 0, "resnet", 101, 4),
        ("n2", 1, "bert", 200, 20),
    ]:
        expected[("herd_gpu_process_memory_used_bytes", labels(host, index, job, pid=str(pid)))] = (
            used * GIB
        )
    for host in ("n1", "n2"):
        expected[("herd_gpus", frozenset({"host": host, "kind": "nvml"}.items()))] = 2
    expected[("herd_exporter_up", frozenset())] = 1
    expected[("herd_exporter_read_errors_total", frozenset({("reason", "not_supported")}))] = 2
    assert found == expected
    assert 0 <= duration < 60


def test_without_per_process_no_series_has_a_pid_and_a_restart_adds_no_series() -> None:
    """pids change with every restart of a job's workers; the count of processes does not."""
    source = FakeSource(two_hosts())
    collector = GpuCollector(source, lambda: OWNERS)

    before = series(exposition(collector))
    source.readings = [
        dataclasses.replace(
            reading,
            processes=tuple(ProcessMemory(p.pid + 1000, p.used_bytes) for p in reading.processes),
        )
        for reading in source.readings
    ]
    after = series(exposition(collector))

    assert not [key for key in before if "pid" in dict(key[1])]
    assert set(before) == set(after)
    assert before[("herd_gpu_processes", labels("n1", 0, "resnet"))] == 2
    with_pids = series(exposition(GpuCollector(source, lambda: OWNERS, per_process=True)))
    assert {dict(key[1]).get("pid") for key in with_pids} >= {"1100", "1101", "1200"}


def test_fields_that_are_none_are_not_emitted() -> None:
    source = FakeSource([gpu("n1", 0, None, total=None), gpu("n1", 1, 5 * GIB, total=None)])

    found = series(exposition(GpuCollector(source)))

    per_gpu = sorted((name, dict(lbls)["gpu"]) for name, lbls in found if "gpu" in dict(lbls))
    assert per_gpu == [
        ("herd_gpu_info", "0"),
        ("herd_gpu_info", "1"),
        ("herd_gpu_memory_used_bytes", "1"),
        ("herd_gpu_processes", "0"),
        ("herd_gpu_processes", "1"),
    ]


def test_a_source_that_raises_gives_up_0_and_counts_it(caplog: pytest.LogCaptureFixture) -> None:
    source = BrokenSource()
    collector = GpuCollector(source)

    with caplog.at_level(logging.INFO, logger="herd_operator.exporters.collector"):
        exposition(collector)
        found = series(exposition(collector))
        source.broken = False
        recovered = series(exposition(collector))

    assert found.pop(("herd_exporter_read_duration_seconds", frozenset())) >= 0
    assert found == {
        ("herd_exporter_up", frozenset()): 0,
        ("herd_exporter_read_errors_total", frozenset({("reason", "read_failed")})): 2,
    }
    assert recovered[("herd_exporter_up", frozenset())] == 1
    assert (
        recovered[("herd_exporter_read_errors_total", frozenset({("reason", "read_failed")}))] == 2
    )
    assert [r.levelname for r in caplog.records] == ["ERROR", "INFO"], "logged on changes only"
    assert "the GPU went away" in caplog.text


def test_a_source_that_is_down_reports_up_0_and_its_error_reasons() -> None:
    source = FakeSource([])
    source.up = False
    source.error_counts = {"library": 3, "driver": 1}

    found = series(exposition(GpuCollector(source)))

    assert found[("herd_exporter_up", frozenset())] == 0
    assert found[("herd_exporter_read_errors_total", frozenset({("reason", "library")}))] == 3
    assert found[("herd_exporter_read_errors_total", frozenset({("reason", "driver")}))] == 1
    assert not [name for name, _ in found if name.startswith("herd_gpu")]


def test_failing_owners_leave_the_job_label_empty() -> None:
    def owners() -> Mapping[tuple[str, int], str]:
        raise ConnectionError("allocator gone")

    found = series(exposition(GpuCollector(FakeSource(two_hosts()[:1]), owners)))

    assert found[("herd_gpu_memory_used_bytes", labels("n1", 0, ""))] == 10 * GIB


def test_a_pid_listed_twice_is_one_series() -> None:
    reading = gpu("n1", 0, 3 * GIB, processes=(ProcessMemory(7, GIB), ProcessMemory(7, 2 * GIB)))

    found = series(exposition(GpuCollector(FakeSource([reading]), per_process=True)))

    process_series = {k: v for k, v in found.items() if k[0].startswith("herd_gpu_process")}
    assert process_series == {
        ("herd_gpu_process_memory_used_bytes", labels("n1", 0, "", pid="7")): 3 * GIB,
        ("herd_gpu_processes", labels("n1", 0, "")): 1,
    }


def test_stale_after_reuses_a_recent_read() -> None:
    source = FakeSource(two_hosts())
    clock = Clock()
    collector = GpuCollector(source, stale_after=5, clock=clock)

    exposition(collector)
    clock.now += 4.9
    exposition(collector)
    assert source.reads == 1
    clock.now += 0.1
    exposition(collector)
    assert source.reads == 2

    every_scrape = GpuCollector(source)
    exposition(every_scrape)
    exposition(every_scrape)
    assert source.reads == 4


def test_registering_does_not_read_the_gpus() -> None:
    source = FakeSource(two_hosts())
    registry = CollectorRegistry(auto_describe=True)

    registry.register(GpuCollector(source))

    assert source.reads == 0
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        registry.register(GpuCollector(source))
