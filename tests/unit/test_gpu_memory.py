"""Per-job GPU memory (issue 30): processes attributed to jobs, the peaks per worker over a
run, workers over their share and the warning events, the per-job metric families.

The GPUs are NVML's through the fake `pynvml` (tests/unit/fake_pynvml.py): the readings go
through the real `NvmlGpuSource`, so what NVML may answer (a process without a memory
figure, NVML_VALUE_NOT_AVAILABLE, a pid listed twice under MIG) is what is attributed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.attribution import Attribution, attribute
from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.gpu import GpuReading, ProcessMemory
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.runtime.gpu_memory import (
    GpuMemoryWatch,
    OverShare,
    PeakGpuMemory,
    RunPeak,
    accumulate,
    over_share,
)
from herd_operator.runtime.telemetry import memory_feed
from tests.unit.fake_pynvml import NVML_VALUE_NOT_AVAILABLE, FakeGpu, FakeNvmlConfig, Install

GIB = 1 << 30


def shared_gpus() -> list[FakeGpu]:
    """GPU 0 shared by jobs a (pid 10) and b (pid 20), with a stranger (pid 99); GPU 1 holds
    b's second worker (21), whose memory NVML cannot say."""
    return [
        FakeGpu("GPU-0", 80 * GIB, 15 * GIB, processes=[(10, 6 * GIB), (20, 4 * GIB), (99, GIB)]),
        FakeGpu("GPU-1", 80 * GIB, 9 * GIB, processes=[(21, NVML_VALUE_NOT_AVAILABLE)]),
    ]


OWNERS = {("n1", 10): "a", ("n1", 20): "b", ("n1", 21): "b"}


@pytest.mark.parametrize("not_available_as_none", [True, False], ids=["nvidia-ml-py", "old-pynvml"])
def test_each_process_is_charged_to_its_job_and_a_stranger_to_none(
    install_nvml: Install, not_available_as_none: bool
) -> None:
    install_nvml(FakeNvmlConfig(gpus=shared_gpus(), not_available_as_none=not_available_as_none))

    attribution = attribute(NvmlGpuSource("n1").read(), OWNERS)

    assert attribution.jobs == {
        ("a", "n1", 0): 6 * GIB,
        ("b", "n1", 0): 4 * GIB,
        ("b", "n1", 1): None,
    }
    assert attribution.unattributed == {("n1", 0): GIB, ("n1", 1): 0}
    assert attribution.jobs_on("n1", 0) == {"a": 6 * GIB, "b": 4 * GIB}
    assert attribution.by_gpu() == {
        ("n1", 0): {"a": 6 * GIB, "b": 4 * GIB},
        ("n1", 1): {"b": None},
    }
    assert attribution.by_job() == {
        "a": {("n1", 0): 6 * GIB},
        "b": {("n1", 0): 4 * GIB, ("n1", 1): None},
    }


def test_a_process_without_a_memory_figure_makes_its_job_unknown_on_that_gpu_not_small(
    install_nvml: Install,
) -> None:
    gpus = shared_gpus()
    # MIG lists a pid once per instance: one readable entry does not make the pid readable.
    gpus[0].processes = [(10, 6 * GIB), (10, None), (20, 4 * GIB), (20, GIB), (30, None)]
    install_nvml(FakeNvmlConfig(gpus=gpus))

    reading = NvmlGpuSource("n1").read()[0]
    attribution = attribute([reading], {**OWNERS, ("n1", 30): "c"})

    assert reading.processes == (ProcessMemory(20, 5 * GIB),)
    assert reading.unknown_pids == (10, 30)
    assert attribution.jobs == {("a", "n1", 0): None, ("b", "n1", 0): 5 * GIB, ("c", "n1", 0): None}


def test_the_same_pid_on_another_host_is_not_the_job_s() -> None:
    reading = GpuReading(
        "n2", 0, "GPU-9", "nvml", GIB, 80 * GIB, processes=(ProcessMemory(10, GIB),)
    )
    attribution = attribute([reading], OWNERS)
    assert attribution.jobs == {}
    assert attribution.unattributed == {("n2", 0): GIB}


def attributed(jobs: dict[tuple[str, str, int], int | None]) -> Attribution:
    return Attribution(jobs, {})


def test_peaks_grow_over_restarted_workers_and_start_over_with_a_new_run() -> None:
    peaks: dict[str, RunPeak] = {}
    peaks = accumulate(
        peaks, attributed({("a", "n1", 0): 3 * GIB, ("a", "n1", 1): 5 * GIB}), {"a": 1}
    )
    assert peaks["a"].peak_bytes == 5 * GIB
    # Its workers restarted (new pids, nothing on the GPUs yet), then grew less than before.
    peaks = accumulate(peaks, attributed({}), {"a": 1})
    peaks = accumulate(peaks, attributed({("a", "n1", 0): 4 * GIB}), {"a": 1})
    assert peaks["a"].peak_bytes == 5 * GIB
    # An unknown reading changes nothing; a higher one raises the peak.
    peaks = accumulate(peaks, attributed({("a", "n1", 0): None}), {"a": 1})
    assert peaks["a"].peak_bytes == 5 * GIB
    peaks = accumulate(peaks, attributed({("a", "n1", 0): 7 * GIB}), {"a": 1})
    assert peaks["a"].peak_bytes == 7 * GIB
    # A new run starts over; a job that stopped running is forgotten.
    peaks = accumulate(peaks, attributed({("a", "n1", 0): 2 * GIB}), {"a": 2})
    assert peaks == {"a": RunPeak(2, 2 * GIB)}
    assert accumulate(peaks, attributed({("a", "n1", 0): GIB}), {}) == {}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.dictionaries(
            st.tuples(st.sampled_from("ab"), st.just("n1"), st.integers(0, 2)),
            st.none() | st.integers(0, 80 * GIB),
            max_size=4,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_a_peak_is_the_largest_reading_of_the_run(
    rounds: list[dict[tuple[str, str, int], int | None]],
) -> None:
    peaks: dict[str, RunPeak] = {}
    for jobs in rounds:
        peaks = accumulate(peaks, attributed(jobs), {"a": 0, "b": 0})
    for job in "ab":
        seen = [
            used
            for jobs in rounds
            for (name, _, _), used in jobs.items()
            if name == job and used is not None
        ]
        assert peaks[job].peak_bytes == (max(seen) if seen else None)


def test_over_and_near_a_share_by_worker() -> None:
    used = {("n1", 0): 9 * GIB, ("n1", 1): int(7.5 * GIB), ("n1", 2): 7 * GIB, ("n1", 3): None}

    found = over_share("a", 8 * GIB, used)

    assert found == (
        OverShare("a", "n1", 0, 9 * GIB, 8 * GIB, "over"),
        OverShare("a", "n1", 1, int(7.5 * GIB), 8 * GIB, "near"),
    )
    assert (
        found[0].message
        == "the worker of a on n1 GPU 0 uses 9.00 GiB, 112% of its 8.00 GiB share: over it"
    )
    assert over_share("a", 8 * GIB, used, near_ratio=1.0) == found[:1]
    with pytest.raises(ValueError, match="share must be positive"):
        over_share("a", 0, used)


class Events:
    def __init__(self) -> None:
        self.recorded: list[tuple[str, str, str, str, float]] = []

    def __call__(self, job: str, type: str, reason: str, message: str, now: float) -> None:
        self.recorded.append((job, type, reason, message, now))


def test_the_watch_keeps_peaks_and_warns_once_per_worker_and_state(install_nvml: Install) -> None:
    gpus = shared_gpus()
    install_nvml(FakeNvmlConfig(gpus=gpus))
    source = NvmlGpuSource("n1")
    events = Events()
    shares = {"a": int(6.5 * GIB), "b": 8 * GIB}  # a near (92%), b well under, c has none
    watch = GpuMemoryWatch(
        PeakGpuMemory(), lambda: OWNERS, lambda: {"a": 1, "b": 1}, lambda: shares, events
    )

    watch.observe(source.read(), 1.0)
    watch.observe(source.read(), 2.0)  # still near: said once
    assert watch.peaks.peaks() == {"a": 6 * GIB, "b": 4 * GIB}
    assert [(job, reason, now) for job, _, reason, _, now in events.recorded] == [
        ("a", "MemoryOverShare", 1.0)
    ]
    assert "92% of its 6.50 GiB share: near it" in events.recorded[0][3]

    gpus[0].processes[0] = (10, 7 * GIB)  # over now: said again
    watch.observe(source.read(), 3.0)
    gpus[0].processes[0] = (10, int(6.2 * GIB))  # back to near: nothing new
    watch.observe(source.read(), 4.0)
    gpus[0].processes[0] = (10, GIB)  # under, then over again: said again
    watch.observe(source.read(), 5.0)
    gpus[0].processes[0] = (10, 7 * GIB)
    watch.observe(source.read(), 6.0)

    assert [(job, now) for job, _, _, _, now in events.recorded] == [
        ("a", 1.0),
        ("a", 3.0),
        ("a", 6.0),
    ]
    assert all(type == "Warning" for _, type, _, _, _ in events.recorded)
    assert watch.peaks.peak("a") == 7 * GIB
    assert watch.peaks.peak("c") is None


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    return {
        family.name: [(sample.labels, sample.value) for sample in family.samples]
        for family in text_string_to_metric_families(text)
    }


def test_job_memory_per_gpu_and_jobs_per_gpu_are_exported_at_scrape_time(
    install_nvml: Install,
) -> None:
    install_nvml(FakeNvmlConfig(gpus=shared_gpus()))
    owners = dict(OWNERS)
    collector = GpuCollector(NvmlGpuSource("n1"), pid_owners=lambda: owners)

    scraped = families(exposition(collector))

    gpu0 = {"host": "n1", "gpu": "0", "uuid": "GPU-0", "kind": "nvml"}
    gpu1 = {"host": "n1", "gpu": "1", "uuid": "GPU-1", "kind": "nvml"}
    assert scraped["herd_job_gpu_memory_used_bytes"] == [
        ({**gpu0, "herd_job": "a"}, 6 * GIB),
        ({**gpu0, "herd_job": "b"}, 4 * GIB),
    ]  # b's memory on GPU 1 is unknown: no sample rather than 0
    assert scraped["herd_gpu_jobs"] == [(gpu0, 2), (gpu1, 1)]
    assert scraped["herd_gpu_unattributed_memory_bytes"] == [(gpu0, GIB), (gpu1, 0)]

    # A job whose workers are gone (its bindings with them) drops out at the next scrape.
    del owners["n1", 10]
    scraped = families(exposition(collector))
    assert [labels["herd_job"] for labels, _ in scraped["herd_job_gpu_memory_used_bytes"]] == ["b"]
    assert scraped["herd_gpu_unattributed_memory_bytes"][0] == (gpu0, 7 * GIB)


def test_without_worker_pids_the_collector_exports_no_job_memory(install_nvml: Install) -> None:
    install_nvml(FakeNvmlConfig(gpus=shared_gpus()))
    assert "herd_gpu_jobs" not in families(exposition(GpuCollector(NvmlGpuSource("n1"))))


def test_readings_back_from_prometheus_carry_no_processes_so_this_host_s_are_read(
    install_nvml: Install,
) -> None:
    install_nvml(FakeNvmlConfig(gpus=shared_gpus()))
    local = NvmlGpuSource("n1")
    watch = GpuMemoryWatch(PeakGpuMemory(), lambda: OWNERS, lambda: {"a": 1}, dict, Events())
    from_prometheus = [GpuReading("n1", 0, "GPU-0", "nvml", 15 * GIB, 80 * GIB)]

    memory_feed(watch, local, observed=local)(from_prometheus, 1.0)
    assert watch.peaks.peak("a") is None  # the round's own readings: no processes in them
    memory_feed(watch, local, observed=Gpus(from_prometheus))(from_prometheus, 2.0)
    assert watch.peaks.peak("a") == 6 * GIB


class Gpus:
    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings

    def read(self) -> list[GpuReading]:
        return self.readings
