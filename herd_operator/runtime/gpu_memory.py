"""Each job's measured GPU memory: its peak per worker over its current run, and whether a
worker is over (or near) its memory share.

The allocator's entry point for GPU sharing (issue 30) is `PeakGpuMemory.peak(job)`: the most
GPU memory one worker of the job used on one GPU since its run began, fed every sampling round
by `GpuMemoryWatch` from the readings attributed to jobs (exporters/attribution.py). A worker is
one process per GPU, as the allocator places a job (never two of one job's workers on one GPU),
so a job's bytes on a GPU are its worker's there.

`PeakGpuMemory.utilization(job)` is the job's measured GPU utilization for the packing's cap
on a GPU's summed utilization (`Demand.utilization`): per round the busiest of its GPUs,
smoothed (`SMOOTHING` of each new round, so a one-second burst such as cuDNN's autotuning
counts a fifth), and the highest smoothed value of the run kept. Kept at its high, not its
latest, so that a job idle between epochs (evaluation, checkpoints) is not packed beside a
busy one it would slow as soon as it trains again, and so that a placement does not flip as
the figure wanders; a new run starts over, as the peak does (`accumulate_utilization`, pure).

`accumulate` and `over_share` are pure; `GpuMemoryWatch` is the edge that feeds the peaks and
writes a `MemoryOverShare` Warning when a worker goes over (or near) its share. A job's share
in bytes per worker is an input (`shares`): it comes from the job's memory request or the
allocation's measured share (`Demand.memory_bytes` of the sharing allocator, wired in where
that lands); a job without a share is never warned about. Moving or shrinking a job over its
share is the allocator's decision, not this module's: each round's attributed bytes are handed
to `on_used` (the allocator's `guard_memory`, `policies/sharing_guard.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Literal

from herd_operator.controllers.job_status import Measures
from herd_operator.controllers.ports import EventType
from herd_operator.exporters.attribution import Attribution, GpuKey, PidOwners, attribute
from herd_operator.exporters.gpu import GpuReading
from herd_operator.policies.sharing_guard import NEAR_SHARE_RATIO

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class RunPeak:
    run: Hashable
    """Which run of the job the peak is of: a new token starts a new peak."""
    peak_bytes: int | None
    """The most one worker used on one GPU in this run; None until a reading of it."""


def accumulate(
    peaks: Mapping[str, RunPeak], attribution: Attribution, runs: Mapping[str, Hashable]
) -> dict[str, RunPeak]:
    """The peaks after one round of readings: each job of `runs` (the jobs running, each with
    its run's token) keeps its peak while the token stays, and starts over at a new one; a job
    not in `runs` is forgotten. A GPU whose reading of the job is unknown (None) changes
    nothing: an unreadable process is not a small one. Restarted workers (new pids) of the
    same run keep adding to the same peak."""
    by_job = attribution.by_job()
    result: dict[str, RunPeak] = {}
    for job, run in runs.items():
        before = peaks.get(job)
        peak = before.peak_bytes if before is not None and before.run == run else None
        readable = [used for used in by_job.get(job, {}).values() if used is not None]
        if readable:
            peak = max(peak or 0, *readable)
        result[job] = RunPeak(run, peak)
    return result


SMOOTHING = 0.2
"""The weight of a new round's utilization in a job's smoothed one (about 3 s half-life at the
1 s sampling period)."""


@dataclass(frozen=True)
class RunUtilization:
    run: Hashable
    smoothed: float
    """The exponentially smoothed utilization of the job's busiest GPU, round by round."""
    high: float
    """The highest `smoothed` of the run: what the packing counts."""


def accumulate_utilization(
    before: Mapping[str, RunUtilization],
    attribution: Attribution,
    runs: Mapping[str, Hashable],
    smoothing: float = SMOOTHING,
) -> dict[str, RunUtilization]:
    """The jobs' utilizations after one round, as `accumulate` keeps peaks: a job of `runs`
    starts over at a new run token and is forgotten when it leaves `runs`; a round with no
    known reading of it changes nothing (an unknown neighbour-shared GPU is not an idle one).
    The first reading of a run starts the smoothing at its value."""
    if not 0 < smoothing <= 1:
        raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
    by_job = attribution.utilization_by_job()
    result: dict[str, RunUtilization] = {}
    for job, run in runs.items():
        kept = before.get(job)
        if kept is not None and kept.run != run:
            kept = None
        known = [ratio for ratio in by_job.get(job, {}).values() if ratio is not None]
        if known:
            busiest = max(known)
            smoothed = (
                busiest if kept is None else kept.smoothed + smoothing * (busiest - kept.smoothed)
            )
            kept = RunUtilization(run, smoothed, max(smoothed, 0.0 if kept is None else kept.high))
        if kept is not None:
            result[job] = kept
    return result


class PeakGpuMemory:
    """The jobs' peaks, updated by the sampling loop and read by whoever places jobs (the
    allocator, under its own lock: this lock is a leaf, nothing is called under it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peaks: dict[str, RunPeak] = {}
        self._utilization: dict[str, RunUtilization] = {}

    def observe(self, attribution: Attribution, runs: Mapping[str, Hashable]) -> None:
        with self._lock:
            self._peaks = accumulate(self._peaks, attribution, runs)
            self._utilization = accumulate_utilization(self._utilization, attribution, runs)

    def utilization(self, job: str) -> float | None:
        """`job`'s GPU utilization (0-1) as the packing counts it (None: not read this run)."""
        with self._lock:
            run = self._utilization.get(job)
        return None if run is None else min(1.0, run.high)

    def peak(self, job: str) -> int | None:
        """The most GPU memory one worker of `job` used in its current run (None: not read)."""
        with self._lock:
            run = self._peaks.get(job)
        return None if run is None else run.peak_bytes

    def measures(self) -> Measures:
        """What the reconciler reads of these for the sharing jobs' demands:
        `JobReconciler(**peaks.measures())`."""
        return {"peak_memory": self.peak, "gpu_utilization": self.utilization}

    def peaks(self) -> dict[str, int]:
        """Every job's peak that has been read."""
        with self._lock:
            return {job: run.peak_bytes for job, run in self._peaks.items() if run.peak_bytes}


ShareState = Literal["over", "near"]


@dataclass(frozen=True)
class OverShare:
    """One worker of a job at or near its memory share."""

    job: str
    host: str
    gpu: int
    used_bytes: int
    share_bytes: int
    state: ShareState

    @property
    def message(self) -> str:
        ratio = self.used_bytes / self.share_bytes
        where = "over" if self.state == "over" else "near"
        return (
            f"the worker of {self.job} on {self.host} GPU {self.gpu} uses "
            f"{self.used_bytes / GIB:.2f} GiB, {ratio:.0%} of its {self.share_bytes / GIB:.2f} GiB "
            f"share: {where} it"
        )


def over_share(
    job: str,
    share_bytes: int,
    used: Mapping[GpuKey, int | None],
    near_ratio: float = NEAR_SHARE_RATIO,
) -> tuple[OverShare, ...]:
    """Which of `job`'s workers (by the GPU they are on, with their bytes there; None when
    unknown) use more than `share_bytes` (over) or more than `near_ratio` of it (near),
    sorted by GPU. An unknown reading says nothing either way."""
    if share_bytes <= 0:
        raise ValueError(f"a memory share must be positive, got {share_bytes}")
    if not 0 < near_ratio <= 1:
        raise ValueError(f"near_ratio must be in (0, 1], got {near_ratio}")
    found = []
    for (host, gpu), used_bytes in sorted(used.items()):
        if used_bytes is None:
            continue
        if used_bytes > share_bytes:
            state: ShareState = "over"
        elif used_bytes > near_ratio * share_bytes:
            state = "near"
        else:
            continue
        found.append(OverShare(job, host, gpu, used_bytes, share_bytes, state))
    return tuple(found)


RecordEvent = Callable[[str, EventType, str, str, float], object]
"""(job, type, reason, message, now): the store's `add_event`."""


class GpuMemoryWatch:
    """Fed each sampling round's readings: attributes them, keeps the peaks and warns of
    workers over or near their share, once per worker and state (again only after it went
    back under, or from near to over), so a job at 95% does not write an event a second."""

    def __init__(
        self,
        peaks: PeakGpuMemory,
        owners: Callable[[], PidOwners],
        runs: Callable[[], Mapping[str, Hashable]],
        shares: Callable[[], Mapping[str, int]],
        record_event: RecordEvent,
        *,
        near_ratio: float = NEAR_SHARE_RATIO,
        on_used: Callable[[Mapping[str, Mapping[GpuKey, int | None]]], object] = lambda used: None,
    ) -> None:
        """`on_used(job -> GPU -> bytes)`: each round's attributed memory (None: unknown)."""
        self._on_used = on_used
        self.peaks = peaks
        self._owners = owners
        self._runs = runs
        self._shares = shares
        self._record_event = record_event
        self._near_ratio = near_ratio
        self._warned: dict[tuple[str, str, int], ShareState] = {}

    def observe(self, readings: list[GpuReading], now: float) -> None:
        """One round of readings: attributed to the jobs whose workers' pids they list."""
        attribution = attribute(readings, self._owners())
        # The guard first: a peak the reconciler reads before the guard acted would be placed
        # by `pack` in arrival order, which can push the neighbour out instead of the job
        # that grew.
        self._on_used(attribution.by_job())
        self.peaks.observe(attribution, self._runs())
        shares = self._shares()
        found: dict[tuple[str, str, int], OverShare] = {}
        for job, used in attribution.by_job().items():
            share = shares.get(job)
            if share is None or share <= 0:
                continue
            for worker in over_share(job, share, used, self._near_ratio):
                found[job, worker.host, worker.gpu] = worker
        warned = {}
        for key, worker in found.items():
            before = self._warned.get(key)
            warned[key] = "over" if before == "over" else worker.state
            if before == worker.state or before == "over":
                continue
            self._record_event(worker.job, "Warning", "MemoryOverShare", worker.message, now)
        self._warned = warned
