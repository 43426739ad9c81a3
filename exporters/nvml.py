"""GPU readings from NVML (the `pynvml` module of the `nvidia-ml-py` package).

`pynvml` is imported lazily: CPU machines have neither the package nor a driver,
and the source then reports itself down (`up == False`) with no readings.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from herd_operator.exporters.gpu import GpuReading, ProcessMemory, ProcessUtilization

log = logging.getLogger(__name__)

INIT_RETRY_SECONDS = 30.0
UTILIZATION_WINDOW_SECONDS = 2.0
"""How far back a read asks NVML for per-process utilization samples: by the wall clock, not
from the last read's newest sample, so that two readers of one source (the operator's
sampling loop and a scrape) each see the last two seconds rather than splitting them."""

# pynvml error class name -> the reason label it is counted under; first match wins.
_REASONS: tuple[tuple[str, str], ...] = (
    ("NVMLError_NotSupported", "not_supported"),
    ("NVMLError_FunctionNotFound", "not_supported"),
    ("NVMLError_GpuIsLost", "gpu_lost"),
    ("NVMLError_NoPermission", "no_permission"),
    ("NVMLError_LibraryNotFound", "library"),
    ("NVMLError_DriverNotLoaded", "driver"),
    ("NVMLError_Uninitialized", "driver"),
)


class _GpuLost(Exception):
    """This GPU cannot be read at all this round."""


class NvmlGpuSource:
    """The NVIDIA GPUs of this host, read field by field through NVML."""

    def __init__(
        self,
        host: str,
        *,
        init_retry_seconds: float = INIT_RETRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`wall`: the epoch seconds NVML's sample timestamps (microseconds) count in."""
        self.host = host
        self._wall = wall
        self.up = True
        self._init_retry_seconds = init_retry_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._last_init_attempt: float | None = None
        self._memory_v2 = True
        self._errors: dict[str, int] = {}
        self._unreadable: set[int] = set()
        self._process_utilization = True

    def errors(self) -> dict[str, int]:
        """Failed NVML calls so far, by reason (not_supported, gpu_lost, driver, ...)."""
        with self._lock:
            return dict(self._errors)

    def read(self) -> list[GpuReading]:
        with self._lock:
            nvml = self._initialized()
            if nvml is None:
                return []
            try:
                count = int(nvml.nvmlDeviceGetCount())
            except nvml.NVMLError as err:
                self._count(nvml, err)
                self._go_down(f"cannot count GPUs: {err}")
                self._release(nvml)
                self._last_init_attempt = self._clock()
                return []
            readings = []
            for index in range(count):
                try:
                    readings.append(self._read_gpu(nvml, index))
                except _GpuLost as lost:
                    if index not in self._unreadable:
                        log.warning("GPU %d of %s cannot be read: %s", index, self.host, lost)
                    self._unreadable.add(index)
                    continue
                if index in self._unreadable:
                    log.info("GPU %d of %s can be read again", index, self.host)
                    self._unreadable.discard(index)
            return readings

    def close(self) -> None:
        """Release NVML (pynvml counts init/shutdown pairs, so other users are unaffected)."""
        with self._lock:
            if self._nvml is not None:
                self._nvml.nvmlShutdown()
                self._nvml = None

    def _release(self, nvml: Any) -> None:
        """Give back a broken NVML session so a later nvmlInit starts a fresh one."""
        self._nvml = None
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as err:
            log.debug("nvmlShutdown after a failure: %s", err)

    def _initialized(self) -> Any:
        """The pynvml module once nvmlInit succeeded; None while NVML is unavailable."""
        if self._nvml is not None:
            return self._nvml
        now = self._clock()
        if (
            self._last_init_attempt is not None
            and now - self._last_init_attempt < self._init_retry_seconds
        ):
            return None
        self._last_init_attempt = now
        try:
            import pynvml
        except ImportError as err:
            self._errors["library"] = self._errors.get("library", 0) + 1
            self._go_down(f"the pynvml module (package nvidia-ml-py) is missing: {err}")
            return None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            self._count(pynvml, err, default="driver")
            self._go_down(f"nvmlInit failed: {err}")
            return None
        if not self.up:
            log.info("NVML on %s is available again", self.host)
        self.up = True
        self._nvml = pynvml
        return pynvml

    def _go_down(self, why: str) -> None:
        if self.up:
            log.warning("no GPU metrics from NVML on %s: %s; retrying", self.host, why)
        self.up = False

    def _count(self, nvml: Any, err: Exception, default: str = "other") -> str:
        reason = default
        for class_name, candidate in _REASONS:
            error_class = getattr(nvml, class_name, None)
            if error_class is not None and isinstance(err, error_class):
                reason = candidate
                break
        self._errors[reason] = self._errors.get(reason, 0) + 1
        return reason

    def _field(self, nvml: Any, call: Callable[[], Any]) -> Any:
        """One NVML call: its result, or None when NVML cannot say (counted)."""
        try:
            return call()
        except nvml.NVMLError as err:
            if self._count(nvml, err) == "gpu_lost":
                raise _GpuLost(err) from err
            return None

    def _read_gpu(self, nvml: Any, index: int) -> GpuReading:
        handle = self._field(nvml, lambda: nvml.nvmlDeviceGetHandleByIndex(index))
        uuid = None if handle is None else self._field(nvml, lambda: nvml.nvmlDeviceGetUUID(handle))
        if uuid is None:
            raise _GpuLost("no handle or UUID")
        memory = self._field(nvml, lambda: self._memory_info(nvml, handle))
        utilization = self._field(nvml, lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
        power = self._field(nvml, lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        processes = self._field(nvml, lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        known, unknown = _process_memory(processes or ())
        per_process = self._process_utilization_of(nvml, handle)
        return GpuReading(
            host=self.host,
            index=index,
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
            kind="nvml",
            memory_used_bytes=None if memory is None else int(memory.used),
            memory_total_bytes=None if memory is None else int(memory.total),
            utilization_ratio=None if utilization is None else utilization.gpu / 100,
            power_watts=None if power is None else power / 1000,
            processes=known,
            unknown_pids=unknown,
            process_utilization=per_process,
        )

    def _process_utilization_of(
        self, nvml: Any, handle: Any
    ) -> tuple[ProcessUtilization, ...] | None:
        """Each process's SM utilization over the last `UTILIZATION_WINDOW_SECONDS`, its
        highest sample (a busy job is never read as a light one; NVML keeps samples only of
        processes that ran a kernel, so one not listed ran none); () when none did (NVML says
        NOT_FOUND); None where the driver has no per-process figures (MIG, old drivers:
        asked once, not again)."""
        if not self._process_utilization:
            return None
        call = getattr(nvml, "nvmlDeviceGetProcessUtilization", None)
        not_found = getattr(nvml, "NVMLError_NotFound", None)
        if call is None:
            self._process_utilization = False
            return None
        try:
            since = max(0, int((self._wall() - UTILIZATION_WINDOW_SECONDS) * 1_000_000))
            samples = call(handle, since)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as err:
            self._count(nvml, err)
            self._process_utilization = False  # the driver is the same for every GPU
            return None
        except nvml.NVMLError as err:
            # No sample since `since`: NOT_FOUND, or NVML_SUCCESS with no samples, which
            # nvidia-ml-py raises as an NVMLError of value 0.
            if (not_found is not None and isinstance(err, not_found)) or getattr(
                err, "value", None
            ) == NVML_SUCCESS:
                return ()
            if self._count(nvml, err) == "gpu_lost":
                raise _GpuLost(err) from err
            return None
        highest: dict[int, float] = {}
        for sample in samples:
            pid = int(sample.pid)
            highest[pid] = max(highest.get(pid, 0.0), min(100, int(sample.smUtil)) / 100)
        return tuple(ProcessUtilization(pid, ratio) for pid, ratio in sorted(highest.items()))

    def _memory_info(self, nvml: Any, handle: Any) -> Any:
        """v2 memory info where the driver has it (its `used` leaves out driver-reserved
        memory, which v1 counts as used); v1 otherwise."""
        version = getattr(nvml, "nvmlMemory_v2", None)
        if self._memory_v2 and version is not None:
            try:
                return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            except (nvml.NVMLError_FunctionNotFound, nvml.NVMLError_NotSupported):
                self._memory_v2 = False  # the driver is the same for every GPU: ask once
        return nvml.nvmlDeviceGetMemoryInfo(handle)


NVML_SUCCESS = 0
NVML_VALUE_NOT_AVAILABLE = 2**64 - 1
"""What NVML puts in `usedGpuMemory` when it cannot say (nvidia-ml-py turns it into None;
older pynvml releases pass it through)."""


def _process_memory(processes: Any) -> tuple[tuple[ProcessMemory, ...], tuple[int, ...]]:
    """Compute processes with known memory, one entry per pid (MIG lists a pid per instance),
    and the pids listed without a memory figure.

    NVML reports no memory for a process without the permission to see it, and none under
    some drivers with MIG or MPS; such a process is kept apart rather than reported as using
    nothing (a job's memory on its GPU is then unknown, not small).
    """
    used_by_pid: dict[int, int] = {}
    unknown: set[int] = set()
    for process in processes:
        pid = int(process.pid)
        used = process.usedGpuMemory
        if used is None or int(used) >= NVML_VALUE_NOT_AVAILABLE:
            unknown.add(pid)
            continue
        used_by_pid[pid] = used_by_pid.get(pid, 0) + int(used)
    # A pid with one readable entry and one unreadable (two MIG instances) is unknown in all.
    known = tuple(
        ProcessMemory(pid, used) for pid, used in used_by_pid.items() if pid not in unknown
    )
    return known, tuple(sorted(unknown))


def nvml_gpu_count() -> int:
    """GPUs NVML sees on this host; 0 without the library, a driver or devices."""
    return _nvml_gpus()[0]


def _nvml_gpus() -> tuple[int, str]:
    """GPUs NVML sees on this host, and why there are none ('' when there are some)."""
    try:
        import pynvml
    except ImportError:
        return 0, "the nvidia-ml-py package is not installed (pip install 'herd-operator[gpu]')"
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError has many subclasses; any of them means "no GPUs here"
        log.debug("NVML unavailable: %s", err)
        return 0, f"NVML cannot start: {err}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
    return count, "" if count else "NVML sees no GPU"


NVIDIA_DEVICE = re.compile(r"^nvidia[0-9]+$")


def nvidia_device_files(dev: Path = Path("/dev")) -> list[Path]:
    """The NVIDIA GPU device files of this host (`/dev/nvidia0`, ...), sorted."""
    try:
        return sorted(path for path in dev.iterdir() if NVIDIA_DEVICE.match(path.name))
    except OSError:
        return []


def nvml_failure() -> str:
    """Why NVML gives no GPUs here, in words ('' when it gives some)."""
    return _nvml_gpus()[1]


def check_no_unseen_gpus(dev: Path = Path("/dev")) -> None:
    """Refuse virtual GPUs on a host that has NVIDIA devices NVML cannot read.

    Training there on virtual GPUs would put every worker on the CPU (or on GPUs nobody
    accounts for) without a word; the fix is nearly always the missing package or driver.
    Raises ValueError naming both the devices and why NVML failed.
    """
    devices = nvidia_device_files(dev)
    if not devices:
        return
    reason = nvml_failure()
    if not reason:
        return
    shown = ", ".join(str(path) for path in devices[:4]) + (", ..." if len(devices) > 4 else "")
    raise ValueError(
        f"this host has NVIDIA devices ({shown}) but {reason}; fix that, or pass "
        "--virtual-gpus N to share virtual GPUs on purpose"
    )
