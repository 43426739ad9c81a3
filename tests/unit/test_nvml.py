"""NvmlGpuSource against a fake pynvml: field by field, v2 memory, lost GPUs, no driver."""

from __future__ import annotations

import logging
import sys
from typing import Literal

import pytest

from herd_operator.exporters.gpu import GpuReading, ProcessMemory, ProcessUtilization
from herd_operator.exporters.nvml import NvmlGpuSource
from tests.unit import fake_pynvml
from tests.unit.fake_pynvml import FakeGpu, FakeNvmlConfig, Install

GIB = 1 << 30


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def two_gpus() -> list[FakeGpu]:
    return [
        FakeGpu(
            uuid="GPU-aaaa",
            total_bytes=80 * GIB,
            used_bytes=10 * GIB,
            reserved_bytes=GIB // 2,
            utilization_percent=37,
            power_milliwatts=251_500,
            processes=[(4242, 6 * GIB), (4243, 4 * GIB)],
            # microseconds; the source below reads at 10 s, so from 8 s
            process_samples=[(4242, 30, 9_000_000), (4242, 45, 9_500_000), (4243, 5, 9_900_000)],
        ),
        FakeGpu(
            uuid="GPU-bbbb",
            total_bytes=80 * GIB,
            used_bytes=0,
            reserved_bytes=GIB // 2,
            utilization_percent=0,
            power_milliwatts=70_000,
        ),
    ]


def test_reads_every_gpu_field_by_field_with_v2_memory(install_nvml: Install) -> None:
    install_nvml(FakeNvmlConfig(gpus=two_gpus()))
    source = NvmlGpuSource("node1", wall=lambda: 10.0)

    assert source.read() == [
        GpuReading(
            host="node1",
            index=0,
            uuid="GPU-aaaa",
            kind="nvml",
            memory_used_bytes=10 * GIB,
            memory_total_bytes=80 * GIB,
            utilization_ratio=0.37,
            power_watts=251.5,
            processes=(ProcessMemory(4242, 6 * GIB), ProcessMemory(4243, 4 * GIB)),
            # each pid's highest sample in the window
            process_utilization=(ProcessUtilization(4242, 0.45), ProcessUtilization(4243, 0.05)),
        ),
        GpuReading(
            host="node1",
            index=1,
            uuid="GPU-bbbb",
            kind="nvml",
            memory_used_bytes=0,
            memory_total_bytes=80 * GIB,
            utilization_ratio=0.0,
            power_watts=70.0,
            process_utilization=(),  # NOT_FOUND: no process ran a kernel
        ),
    ]
    assert source.up is True
    assert source.errors() == {}


@pytest.mark.parametrize("no_samples", ["not_found", "success"])
def test_per_process_utilization_is_the_last_two_seconds_for_every_reader(
    install_nvml: Install, no_samples: Literal["not_found", "success"]
) -> None:
    config = install_nvml(FakeNvmlConfig(gpus=two_gpus(), no_samples=no_samples))
    wall = Clock()
    wall.now = 10.0
    source = NvmlGpuSource("node1", wall=wall)
    gpu = config.gpus[0]
    gpu.process_samples = [(4242, 45, 9_500_000), (4243, 80, 11_000_000)]
    (first, _) = source.read()
    (again, _) = source.read()  # a second reader (a scrape) sees the same window
    assert (
        first.process_utilization
        == again.process_utilization
        == (
            ProcessUtilization(4242, 0.45),
            ProcessUtilization(4243, 0.8),
        )
    )
    wall.now = 12.5
    (later, _) = source.read()
    assert later.process_utilization == (ProcessUtilization(4243, 0.8),)
    wall.now = 14.0
    (idle, _) = source.read()
    assert idle.process_utilization == ()  # no sample: no kernel ran since 12 s
    assert gpu.process_utilization_calls == [8_000_000, 8_000_000, 10_500_000, 12_000_000]
    assert source.errors() == {}


def test_without_per_process_utilization_the_reading_says_unknown_and_asks_once(
    install_nvml: Install,
) -> None:
    gpus = two_gpus()
    for gpu in gpus:
        gpu.failures["process_utilization"] = fake_pynvml.NVMLError_NotSupported
    install_nvml(FakeNvmlConfig(gpus=gpus))
    source = NvmlGpuSource("node1")
    readings = source.read() + source.read()
    assert [reading.process_utilization for reading in readings] == [None] * 4
    assert [reading.utilization_ratio for reading in readings] == [0.37, 0.0] * 2
    assert source.errors() == {"not_supported": 1}  # MIG or an old driver: not asked again


@pytest.mark.parametrize("v2", ["driver_lacks", "module_lacks"])
def test_falls_back_to_v1_memory_which_counts_reserved_as_used(
    install_nvml: Install, v2: Literal["driver_lacks", "module_lacks"]
) -> None:
    install_nvml(FakeNvmlConfig(gpus=two_gpus(), v2=v2))
    source = NvmlGpuSource("node1")

    readings = source.read()

    assert [r.memory_used_bytes for r in readings] == [10 * GIB + GIB // 2, GIB // 2]
    assert [r.memory_total_bytes for r in readings] == [80 * GIB, 80 * GIB]
    assert source.errors() == {}, "a missing v2 call is a capability, not an error"


def test_unsupported_fields_are_dropped_not_the_gpu(install_nvml: Install) -> None:
    gpus = two_gpus()
    gpus[0].failures = {
        "utilization": fake_pynvml.NVMLError_NotSupported,
        "power": fake_pynvml.NVMLError_NotSupported,
        "processes": fake_pynvml.NVMLError_NoPermission,
    }
    gpus[1].failures = {
        "memory_v2": fake_pynvml.NVMLError_NotSupported,
        "memory": fake_pynvml.NVMLError_NotSupported,
        "power": fake_pynvml.NVMLError,
    }
    install_nvml(FakeNvmlConfig(gpus=gpus))
    source = NvmlGpuSource("node1")

    first, second = source.read()

    assert (first.utilization_ratio, first.power_watts, first.processes) == (None, None, ())
    assert (first.memory_used_bytes, first.memory_total_bytes) == (10 * GIB, 80 * GIB)
    assert (second.memory_used_bytes, second.memory_total_bytes) == (None, None)
    assert (second.utilization_ratio, second.power_watts) == (0.0, None)
    assert source.errors() == {"not_supported": 3, "no_permission": 1, "other": 1}


def test_processes_without_memory_are_left_out_and_pids_are_merged(
    install_nvml: Install,
) -> None:
    gpus = two_gpus()
    gpus[0].processes = [(10, GIB), (11, None), (10, 2 * GIB)]
    install_nvml(FakeNvmlConfig(gpus=gpus))

    reading = NvmlGpuSource("node1").read()[0]

    assert reading.processes == (ProcessMemory(10, 3 * GIB),)
    assert reading.unknown_pids == (11,)  # listed apart: its memory is unknown, not 0


def test_a_gpu_lost_mid_run_disappears_and_is_counted(
    install_nvml: Install, caplog: pytest.LogCaptureFixture
) -> None:
    config = install_nvml(FakeNvmlConfig(gpus=[*two_gpus(), *two_gpus()]))
    source = NvmlGpuSource("node1")
    assert [r.index for r in source.read()] == [0, 1, 2, 3]

    config.gpus[1].lose()
    config.gpus[3].failures = {"memory_v2": fake_pynvml.NVMLError_GpuIsLost}
    with caplog.at_level(logging.WARNING, logger="herd_operator.exporters.nvml"):
        second = source.read()
        third = source.read()

    assert [r.index for r in second] == [0, 2]
    assert [r.index for r in third] == [0, 2]
    assert second[1].memory_used_bytes == 10 * GIB, "the other GPUs are still read in full"
    assert source.errors() == {"gpu_lost": 4}
    assert source.up is True
    assert [r.getMessage() for r in caplog.records] == [
        "GPU 1 of node1 cannot be read: NVML error 15 (NVMLError_GpuIsLost)",
        "GPU 3 of node1 cannot be read: NVML error 15 (NVMLError_GpuIsLost)",
    ]


def test_a_gpu_without_a_uuid_is_left_out(install_nvml: Install) -> None:
    gpus = two_gpus()
    gpus[0].failures = {"uuid": fake_pynvml.NVMLError_NoPermission}
    install_nvml(FakeNvmlConfig(gpus=gpus))
    source = NvmlGpuSource("node1")

    assert [r.uuid for r in source.read()] == ["GPU-bbbb"]
    assert source.errors() == {"no_permission": 1}


def test_without_the_library_no_readings_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    clock = Clock()
    source = NvmlGpuSource("cpu-node", clock=clock)

    with caplog.at_level(logging.WARNING, logger="herd_operator.exporters.nvml"):
        results = []
        for _ in range(3):
            results.append(source.read())
            clock.now += 31

    assert results == [[], [], []]
    assert source.up is False
    assert source.errors() == {"library": 3}, "each retry (every 30 s) tries the import again"
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert message.startswith("no GPU metrics from NVML on cpu-node: the pynvml module")
    assert message.endswith("; retrying")


def test_init_is_retried_at_most_every_30_seconds(install_nvml: Install) -> None:
    config = install_nvml(
        FakeNvmlConfig(gpus=two_gpus(), init_error=fake_pynvml.NVMLError_DriverNotLoaded)
    )
    clock = Clock()
    source = NvmlGpuSource("node1", clock=clock)

    assert source.read() == []
    clock.now += 29.9
    assert source.read() == []
    assert (config.init_calls, source.up) == (1, False)

    config.init_error = None
    clock.now += 0.1
    assert [r.uuid for r in source.read()] == ["GPU-aaaa", "GPU-bbbb"]
    assert (config.init_calls, source.up) == (2, True)
    assert source.read() != []
    assert config.init_calls == 2, "an initialized session is kept"
    assert source.errors() == {"driver": 1}


def test_library_not_found_at_init_is_counted_as_library(install_nvml: Install) -> None:
    install_nvml(FakeNvmlConfig(gpus=two_gpus(), init_error=fake_pynvml.NVMLError_LibraryNotFound))
    source = NvmlGpuSource("node1")

    assert source.read() == []
    assert (source.up, source.errors()) == (False, {"library": 1})


def test_losing_the_driver_after_init_releases_and_retries_later(
    install_nvml: Install, caplog: pytest.LogCaptureFixture
) -> None:
    config = install_nvml(FakeNvmlConfig(gpus=two_gpus()))
    clock = Clock()
    source = NvmlGpuSource("node1", clock=clock)
    assert len(source.read()) == 2

    config.count_error = config.shutdown_error = fake_pynvml.NVMLError_Uninitialized
    with caplog.at_level(logging.INFO, logger="herd_operator.exporters.nvml"):
        assert source.read() == []
        assert source.up is False
        assert config.shutdown_calls == 1
        clock.now += 10
        assert source.read() == []
        assert config.init_calls == 1

        config.count_error = config.shutdown_error = None
        clock.now += 20
        assert len(source.read()) == 2
    assert (config.init_calls, source.up) == (2, True)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert source.errors() == {"driver": 1}


def test_close_shuts_nvml_down_once(install_nvml: Install) -> None:
    config = install_nvml(FakeNvmlConfig(gpus=two_gpus()))
    source = NvmlGpuSource("node1")
    source.read()

    source.close()
    source.close()

    assert config.shutdown_calls == 1


def test_bytes_uuids_from_old_pynvml_are_decoded(
    install_nvml: Install, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_nvml(FakeNvmlConfig(gpus=two_gpus()))
    module = sys.modules["pynvml"]
    str_uuid = module.nvmlDeviceGetUUID
    monkeypatch.setattr(module, "nvmlDeviceGetUUID", lambda handle: str_uuid(handle).encode())

    assert [r.uuid for r in NvmlGpuSource("node1").read()] == ["GPU-aaaa", "GPU-bbbb"]
