"""What a GPU looks like at one instant, and where readings come from.

Two sources share one shape: NVML on machines with NVIDIA GPUs, and virtual
GPUs on CPU machines, whose "used memory" is the real memory of the worker
processes bound to them (measured from the process, not declared), so the
memory policy runs on a real signal everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import psutil

GpuKind = Literal["nvml", "virtual", "dcgm"]
"""nvml: read here with NVML; virtual: a CPU machine's stand-in; dcgm: read back from NVIDIA's
dcgm-exporter (exporters/dcgm.py)."""


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    used_bytes: int


@dataclass(frozen=True)
class ProcessUtilization:
    pid: int
    sm_ratio: float
    """The share of the GPU's time (0-1) a kernel of this process ran, over NVML's last
    sampling window (`nvmlDeviceGetProcessUtilization`'s smUtil)."""


@dataclass(frozen=True)
class GpuReading:
    host: str
    index: int
    uuid: str
    kind: GpuKind
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    utilization_ratio: float | None = None
    power_watts: float | None = None
    processes: tuple[ProcessMemory, ...] = field(default=())
    unknown_pids: tuple[int, ...] = field(default=())
    """Processes on the GPU whose memory the source cannot say (NVML without the permission,
    or NVML_VALUE_NOT_AVAILABLE under some drivers, MIG and MPS): not in `processes`, so
    that nobody reads them as using nothing (exporters/attribution.py)."""
    process_utilization: tuple[ProcessUtilization, ...] | None = None
    """Each process's SM utilization where the source reads it per process (a process not
    listed ran no kernel in the window); None where it cannot (NVML without the call: MIG,
    old drivers; virtual GPUs): a job's utilization is then the GPU's when it is alone there."""


class GpuSource(Protocol):
    def read(self) -> list[GpuReading]:
        """One reading per GPU of this host; a GPU that cannot be read is left out."""
        ...


def process_tree_rss(pid: int) -> int | None:
    """Resident memory of a process and its children (data loader workers), or None if gone
    (or no process at all: a pid comes from a job's worker, and -1 makes psutil raise
    ValueError)."""
    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        for child in proc.children(recursive=True):
            try:
                total += child.memory_info().rss
            except psutil.Error:
                continue
        return int(total)
    except (psutil.Error, ValueError, OverflowError):
        return None


class VirtualGpuSource:
    """Virtual GPUs of one host: a fixed capacity each; used = memory of the bound workers."""

    def __init__(
        self,
        host: str,
        count: int,
        capacity_bytes: int,
        bound_pids: Callable[[], Mapping[int, Sequence[int]]],
    ) -> None:
        if count < 1 or capacity_bytes < 1:
            raise ValueError("a virtual GPU pool needs at least one GPU and a positive capacity")
        self.host = host
        self.count = count
        self.capacity_bytes = capacity_bytes
        self._bound_pids = bound_pids

    def read(self) -> list[GpuReading]:
        bound = self._bound_pids()
        readings = []
        for index in range(self.count):
            processes = []
            for pid in bound.get(index, ()):
                rss = process_tree_rss(pid)
                if rss is not None:
                    processes.append(ProcessMemory(pid, rss))
            readings.append(
                GpuReading(
                    host=self.host,
                    index=index,
                    uuid=f"VGPU-{self.host}-{index}",
                    kind="virtual",
                    memory_used_bytes=sum(p.used_bytes for p in processes),
                    memory_total_bytes=self.capacity_bytes,
                    processes=tuple(processes),
                )
            )
        return readings
