"""Samples the memory of each job's GPUs, for the policies' memory signal.

Every `interval` seconds it reads the GPUs of this host (NVML, or virtual GPUs
measured from their workers' memory) and records, per job, the summed used and
total memory of the GPUs the job holds. A job with a GPU that could not be read
gets no sample that round: the memory policy then holds instead of guessing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from herd_operator.exporters.gpu import GpuReading, GpuSource
from herd_operator.specs.values import Placement

log = logging.getLogger(__name__)

RecordUsage = Callable[[str, int, int, int, float], None]
"""(job, gpus, used_bytes, total_bytes, now)"""


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
    ) -> None:
        self.source = source
        self.placements = placements
        self.record = record
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="usage-observer", daemon=True)

    def sample_once(self) -> None:
        now = time.time()
        for job, (gpus, used, total) in job_usage(self.source.read(), self.placements()).items():
            try:
                self.record(job, gpus, used, total, now)
            except KeyError:
                continue  # the job was deleted between the read and the record

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample_once()
            except Exception:
                log.exception("GPU usage sampling failed; will retry")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
