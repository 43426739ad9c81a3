"""A fake `pynvml` module (the `nvidia-ml-py` API surface NvmlGpuSource uses), driven by a config.

`make_module(config)` builds a module to put in `sys.modules["pynvml"]`; the `install_nvml`
fixture (shared through tests/unit/conftest.py) puts it there for one test. Errors follow
the real module: `NVMLError` carries the NVML return code in `.value`, and each
subclass (same names as pynvml's) is constructed without arguments.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, get_args

import pytest

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

# The real value: sizeof(nvmlMemory_v2_t) | 2 << 24.
nvmlMemory_v2 = 0x02000028
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
"""What NVML puts in a process's usedGpuMemory when it cannot say (some drivers, MIG, MPS)."""


class NVMLError(Exception):
    value = NVML_ERROR_UNKNOWN

    def __str__(self) -> str:
        return f"NVML error {self.value} ({type(self).__name__})"


class NVMLError_Uninitialized(NVMLError):
    value = NVML_ERROR_UNINITIALIZED


class NVMLError_NotSupported(NVMLError):
    value = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):
    value = NVML_ERROR_NO_PERMISSION


class NVMLError_NotFound(NVMLError):
    value = NVML_ERROR_NOT_FOUND


class NVMLError_DriverNotLoaded(NVMLError):
    value = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_LibraryNotFound(NVMLError):
    value = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    value = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    value = NVML_ERROR_GPU_IS_LOST


ERROR_CLASSES: tuple[type[NVMLError], ...] = (
    NVMLError_Uninitialized,
    NVMLError_NotSupported,
    NVMLError_NoPermission,
    NVMLError_NotFound,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    NVMLError_FunctionNotFound,
    NVMLError_GpuIsLost,
)

# What a fake GPU can be told to fail on, one name per NVML call.
Call = Literal[
    "handle",
    "uuid",
    "memory",
    "memory_v2",
    "utilization",
    "power",
    "processes",
    "process_utilization",
]
ALL_CALLS: tuple[Call, ...] = get_args(Call)


@dataclass
class FakeGpu:
    uuid: str
    total_bytes: int
    used_bytes: int
    """What v2 reports as used; v1 also counts `reserved_bytes` as used."""
    reserved_bytes: int = 0
    utilization_percent: int = 0
    power_milliwatts: int = 0
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    """(pid, usedGpuMemory) of each compute process, as NVML lists them (a pid once per MIG
    instance; NVML_VALUE_NOT_AVAILABLE where the driver cannot say, None without the
    permission)."""
    process_samples: list[tuple[int, int, int]] = field(default_factory=list)
    """(pid, smUtil percent, timeStamp in microseconds) of each per-process utilization sample
    NVML keeps; a call returns those newer than its lastSeenTimeStamp, NOT_FOUND when none."""
    process_utilization_calls: list[int] = field(default_factory=list)
    """The lastSeenTimeStamp of each nvmlDeviceGetProcessUtilization call."""
    failures: dict[Call, type[NVMLError]] = field(default_factory=dict)

    def lose(self) -> None:
        """The GPU fell off the bus: every call on it fails with GPU_IS_LOST."""
        self.failures = dict.fromkeys(ALL_CALLS, NVMLError_GpuIsLost)


@dataclass
class FakeNvmlConfig:
    gpus: list[FakeGpu]
    v2: Literal["supported", "driver_lacks", "module_lacks"] = "supported"
    """driver_lacks: the v2 call raises FunctionNotFound (old driver); module_lacks: an old
    nvidia-ml-py without `nvmlMemory_v2` nor the `version=` keyword."""
    not_available_as_none: bool = True
    """nvidia-ml-py turns NVML_VALUE_NOT_AVAILABLE into None; older pynvml releases pass it on."""
    no_samples: Literal["not_found", "success"] = "not_found"
    """What nvmlDeviceGetProcessUtilization raises when no sample is newer than asked: NVML's
    NOT_FOUND, or an NVMLError of value 0 (NVML_SUCCESS with no samples: nvidia-ml-py raises
    whatever the first call returned unless it was INSUFFICIENT_SIZE)."""
    init_error: type[NVMLError] | None = None
    count_error: type[NVMLError] | None = None
    shutdown_error: type[NVMLError] | None = None
    init_calls: int = 0
    shutdown_calls: int = 0


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _MemoryV1:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _MemoryV2:
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass(frozen=True)
class _Utilization:
    gpu: int
    memory: int


@dataclass(frozen=True)
class _ProcessSample:
    pid: int
    timeStamp: int
    smUtil: int
    memUtil: int
    encUtil: int
    decUtil: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None


def make_module(config: FakeNvmlConfig) -> types.ModuleType:
    """A `pynvml` stand-in reading and recording through `config`."""
    module = types.ModuleType("pynvml")
    error_classes: list[type[NVMLError]] = [NVMLError, *ERROR_CLASSES]
    for error_class in error_classes:
        setattr(module, error_class.__name__, error_class)

    def gpu_for(handle: _Handle, call: Call) -> FakeGpu:
        gpu = config.gpus[handle.index]
        failure = gpu.failures.get(call)
        if failure is not None:
            raise failure()
        return gpu

    def nvml_init() -> None:
        config.init_calls += 1
        if config.init_error is not None:
            raise config.init_error()

    def nvml_shutdown() -> None:
        config.shutdown_calls += 1
        if config.shutdown_error is not None:
            raise config.shutdown_error()

    def device_get_count() -> int:
        if config.count_error is not None:
            raise config.count_error()
        return len(config.gpus)

    def get_handle_by_index(index: int) -> _Handle:
        handle = _Handle(index)
        gpu_for(handle, "handle")
        return handle

    def get_uuid(handle: _Handle) -> str:
        return gpu_for(handle, "uuid").uuid

    def memory_v1(handle: _Handle) -> _MemoryV1:
        gpu = gpu_for(handle, "memory")
        used = gpu.used_bytes + gpu.reserved_bytes
        return _MemoryV1(total=gpu.total_bytes, free=gpu.total_bytes - used, used=used)

    def get_memory_info(handle: _Handle, version: int | None = None) -> _MemoryV1 | _MemoryV2:
        if version is None:
            return memory_v1(handle)
        if version != nvmlMemory_v2:
            raise NVMLError()
        if config.v2 == "driver_lacks":
            raise NVMLError_FunctionNotFound()
        gpu = gpu_for(handle, "memory_v2")
        free = gpu.total_bytes - gpu.used_bytes - gpu.reserved_bytes
        return _MemoryV2(version, gpu.total_bytes, gpu.reserved_bytes, free, gpu.used_bytes)

    def get_utilization_rates(handle: _Handle) -> _Utilization:
        return _Utilization(gpu=gpu_for(handle, "utilization").utilization_percent, memory=0)

    def get_power_usage(handle: _Handle) -> int:
        return gpu_for(handle, "power").power_milliwatts

    def get_compute_running_processes(handle: _Handle) -> list[_Process]:
        def shown(used: int | None) -> int | None:
            if used == NVML_VALUE_NOT_AVAILABLE and config.not_available_as_none:
                return None
            return used

        return [_Process(pid, shown(used)) for pid, used in gpu_for(handle, "processes").processes]

    def get_process_utilization(handle: _Handle, last_seen: int) -> list[_ProcessSample]:
        gpu = gpu_for(handle, "process_utilization")
        gpu.process_utilization_calls.append(last_seen)
        newer = [
            _ProcessSample(pid, stamp, sm, 0, 0, 0)
            for pid, sm, stamp in gpu.process_samples
            if stamp > last_seen
        ]
        if not newer and config.no_samples == "success":
            empty = NVMLError()
            empty.value = 0
            raise empty
        if not newer:
            raise NVMLError_NotFound()
        return newer

    functions: dict[str, object] = {
        "nvmlInit": nvml_init,
        "nvmlShutdown": nvml_shutdown,
        "nvmlDeviceGetCount": device_get_count,
        "nvmlDeviceGetHandleByIndex": get_handle_by_index,
        "nvmlDeviceGetUUID": get_uuid,
        "nvmlDeviceGetUtilizationRates": get_utilization_rates,
        "nvmlDeviceGetPowerUsage": get_power_usage,
        "nvmlDeviceGetComputeRunningProcesses": get_compute_running_processes,
        "nvmlDeviceGetProcessUtilization": get_process_utilization,
    }
    if config.v2 == "module_lacks":
        functions["nvmlDeviceGetMemoryInfo"] = memory_v1
    else:
        functions["nvmlDeviceGetMemoryInfo"] = get_memory_info
        functions["nvmlMemory_v2"] = nvmlMemory_v2
    for name, value in functions.items():
        setattr(module, name, value)
    return module


Install = Callable[[FakeNvmlConfig], FakeNvmlConfig]


@pytest.fixture
def install_nvml(monkeypatch: pytest.MonkeyPatch) -> Install:
    """Put a fake pynvml built from a config into sys.modules; returns the config."""

    def install(config: FakeNvmlConfig) -> FakeNvmlConfig:
        monkeypatch.setitem(sys.modules, "pynvml", make_module(config))
        return config

    return install
