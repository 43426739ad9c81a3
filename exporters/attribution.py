"""Whose GPU memory is whose: each process a GPU lists, charged to the job whose worker it is.

Pure: GPU readings and the table of the workers' pids (from their bindings: each worker
binds with its own pid, which the shim's exec keeps) in, per-job memory per GPU out. Apart
from the collector because the operator's memory accounting (runtime/gpu_memory.py) reads
the same answer, and neither may decide differently whose memory a process is.

A process no job's worker is (another user's, a leftover of an ended launch, the MPS server)
is unattributed: counted per GPU as such, never charged to a job. A process listed without a
memory figure (`GpuReading.unknown_pids`: NVML without the permission, NVML_VALUE_NOT_AVAILABLE
under some drivers, MIG or MPS) makes its job's memory on that GPU unknown (None), never 0.

Pids are the host's: a worker in a container with its own pid namespace binds with a pid NVML
does not list, and its memory shows as unattributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from herd_operator.exporters.gpu import GpuReading

PidOwners = Mapping[tuple[str, int], str]
"""(host, pid) of a job's worker -> the job."""
GpuKey = tuple[str, int]
"""(host, GPU index)."""


@dataclass(frozen=True)
class Attribution:
    """One round of readings, attributed."""

    jobs: Mapping[tuple[str, str, int], int | None]
    """(job, host, gpu) -> the bytes its processes use there; None when one of them could
    not be read. Only jobs with a process listed on the GPU."""
    unattributed: Mapping[GpuKey, int]
    """Per GPU read, the bytes of processes that are no job's worker (0 when none)."""

    def jobs_on(self, host: str, gpu: int) -> dict[str, int | None]:
        """The jobs with a process on one GPU, and their bytes there."""
        return {
            job: used
            for (job, job_host, job_gpu), used in self.jobs.items()
            if (job_host, job_gpu) == (host, gpu)
        }

    def by_gpu(self) -> dict[GpuKey, dict[str, int | None]]:
        """Each GPU's jobs and their bytes there (GPUs with none left out)."""
        result: dict[GpuKey, dict[str, int | None]] = {}
        for (job, host, gpu), used in self.jobs.items():
            result.setdefault((host, gpu), {})[job] = used
        return result

    def by_job(self) -> dict[str, dict[GpuKey, int | None]]:
        """Each job's bytes on each GPU it has a process on."""
        result: dict[str, dict[GpuKey, int | None]] = {}
        for (job, host, gpu), used in self.jobs.items():
            result.setdefault(job, {})[host, gpu] = used
        return result


def attribute(readings: Iterable[GpuReading], owners: PidOwners) -> Attribution:
    """Charge each process of `readings` to the job `owners` says it is a worker of."""
    jobs: dict[tuple[str, str, int], int | None] = {}
    unattributed: dict[GpuKey, int] = {}
    for reading in readings:
        host, gpu = reading.host, reading.index
        unattributed[host, gpu] = 0
        for process in reading.processes:
            job = owners.get((host, process.pid))
            if job is None:
                unattributed[host, gpu] += process.used_bytes
                continue
            key = (job, host, gpu)
            before = jobs.get(key, 0)
            if before is not None:  # None: one of its processes there is unreadable
                jobs[key] = before + process.used_bytes
        for pid in reading.unknown_pids:
            job = owners.get((host, pid))
            if job is not None:
                jobs[job, host, gpu] = None
    return Attribution(jobs, unattributed)
