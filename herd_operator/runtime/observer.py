"""Samples the memory of each job's GPUs, for the policies' memory signal.

Every `interval` seconds it reads the GPUs of this host (NVML, or virtual GPUs
measured from their workers' memory) and records, per job, the summed used and
total memory of the GPUs the job holds. A job with a GPU that could not be read
gets no sample that round: the memory policy then holds instead of guessing. A round
the store cannot record (a full disk) is skipped without a word: the store says that
writes fail, once a minute at most, and a traceback a second said it again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from herd_operator.controllers.errors import TemporaryError
from herd_operator.exporters.gpu import GpuReading, GpuSource
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.specs.values import Placement

log = logging.getLogger(__name__)

RecordUsage = Callable[[str, int, int, int, float], None]
"""(job, gpus, used_bytes, total_bytes, now)"""
ObserveReadings = Callable[[list[GpuReading], float], None]
"""(readings, now): also given each round's readings (runtime/gpu_memory.GpuMemoryWatch)."""


def job_usage(
    readings: list[GpuReading], placements: Mapping[str, Placement]
) -> dict[str, tuple[int, int, int]]:
    """Per job with GPUs: (gpus, used_bytes, total_bytes), only where every GPU was read."""
    by_slot = {(reading.host, reading.index): reading for reading in readings}
    usage = {}
    for job, placement in placements.items():
        if not placement.size:
            continue
        found = [by_slot.get(slot) for slot in placement.slots()]
        if any(r is None or r.memory_used_bytes is None or not r.memory_total_bytes for r in found):
            continue
        used = sum(r.memory_used_bytes or 0 for r in found if r is not None)
        total = sum(r.memory_total_bytes or 0 for r in found if r is not None)
        usage[job] = (placement.size, used, total)
    return usage


class UsageObserver:
    def __init__(
        self,
        source: GpuSource,
        placements: Callable[[], Mapping[str, Placement]],
        record: RecordUsage,
        *,
        interval: float = 1.0,
        health: LoopHealth | None = None,
        also: ObserveReadings | None = None,
    ) -> None:
        self.source = source
        self.also = also
        self.placements = placements
        self.record = record
        self.interval = interval
        self._loop = Periodic(
            "usage-observer",
            self.sample_once,
            interval,
            what="sampling GPU usage",
            health=health,
            # Back within seconds of a source that failed: a job's samples go stale in 15.
            max_backoff=5.0,
        )

    @property
    def name(self) -> str:
        return self._loop.name

    def sample_once(self) -> None:
        now = time.time()
        readings = self.source.read()
        if self.also is not None:
            try:
                self.also(readings, now)
            except TemporaryError as err:  # the store refuses writes: it says so itself
                log.debug("GPU memory events not recorded this round: %s", err)
        for job, (gpus, used, total) in job_usage(readings, self.placements()).items():
            try:
                self.record(job, gpus, used, total, now)
            except KeyError:
                continue  # the job was deleted between the read and the record
            except TemporaryError as err:  # the store refuses writes: it says so itself
                log.debug("GPU usage not recorded this round: %s", err)
                return

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self._loop.stop(timeout)
