"""Whose GPU memory is whose: each process a GPU lists, charged to the job whose worker it is.

Pure: GPU readings and the table of the workers' pids (from their bindings: each worker
binds with its own pid, which the shim's exec keeps) in, per-job memory per GPU out. Apart
from the collector because the operator's memory accounting (runtime/gpu_memory.py) reads
the same answer, and neither may decide differently whose memory a process is.

A process no job's worker is (another user's, a leftover of an ended launch, the MPS server)
is unattributed: counted per GPU as such, never charged to a job. A process listed without a
memory figure (`GpuReading.unknown_pids`: NVML without the permission, NVML_VALUE_NOT_AVAILABLE
under some drivers, MIG or MPS) makes its job's memory on that GPU unknown (None), never 0.

A job's GPU utilization on a GPU is its processes' summed SM utilization where the source
reads it per process (NVML's process utilization); where it does not (MIG, old drivers,
virtual GPUs), the GPU's own utilization when the job is alone on it (no other job's process,
no unattributed memory), else unknown (None): a neighbour's kernels are not the job's.

Pids are the host's: a worker in a container with its own pid namespace binds with a pid NVML
does not list, and its memory shows as unattributed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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
    utilization: Mapping[tuple[str, str, int], float | None] = field(default_factory=dict)
    """(job, host, gpu) -> the job's GPU utilization there (0-1), None when it cannot be
    told apart; the same keys as `jobs`."""

    def utilization_by_job(self) -> dict[str, dict[GpuKey, float | None]]:
        """Each job's utilization on each GPU it has a process on."""
        result: dict[str, dict[GpuKey, float | None]] = {}
        for (job, host, gpu), ratio in self.utilization.items():
            result.setdefault(job, {})[host, gpu] = ratio
        return result

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
    utilization: dict[tuple[str, str, int], float | None] = {}
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
        utilization.update(_utilization(reading, owners, unattributed[host, gpu]))
    return Attribution(jobs, unattributed, utilization)


def _utilization(
    reading: GpuReading, owners: PidOwners, unattributed_bytes: int
) -> dict[tuple[str, str, int], float | None]:
    """The utilization of each job with a process on the GPU of `reading` (its processes'
    owners, read from this GPU's own lists, not by a scan of every job's keys)."""
    host, gpu = reading.host, reading.index
    pids = [*(process.pid for process in reading.processes), *reading.unknown_pids]
    here = {(job, host, gpu) for pid in pids if (job := owners.get((host, pid))) is not None}
    if reading.process_utilization is not None:
        summed = dict.fromkeys(here, 0.0)
        for process in reading.process_utilization:
            job = owners.get((host, process.pid))
            if job is not None and (job, host, gpu) in summed:
                summed[job, host, gpu] += process.sm_ratio
        return {key: min(1.0, ratio) for key, ratio in summed.items()}
    foreign = unattributed_bytes > 0 or any(
        (host, pid) not in owners for pid in reading.unknown_pids
    )
    alone = len(here) == 1 and not foreign
    device = reading.utilization_ratio
    return {key: device if alone and device is not None else None for key in here}
