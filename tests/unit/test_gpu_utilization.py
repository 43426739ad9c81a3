"""Per-job GPU utilization (issue 30): NVML's per-process SM utilization attributed to jobs,
the device's where NVML has no per-process figures and the job is alone, the smoothed high
of a run, and its way into the sharing jobs' demands and the packing's utilization cap
(`run --max-gpu-utilization`).

NVML is the fake `pynvml` (tests/unit/fake_pynvml.py) read by the real `NvmlGpuSource`.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.cli.arguments import UsageError
from herd_operator.cli.main import build_parser
from herd_operator.cli.run import sharing_limits
from herd_operator.controllers.job_status import ReconcilerBase
from herd_operator.exporters.attribution import Attribution, attribute
from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.gpu import GpuReading, ProcessMemory
from herd_operator.exporters.nvml import NvmlGpuSource
from herd_operator.policies.sharing import SharingLimits
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.gpu_memory import (
    PeakGpuMemory,
    RunUtilization,
    accumulate_utilization,
)
from herd_operator.specs.loading import load_spec_text
from herd_operator.specs.values import Demand, Pool
from tests.unit import fake_pynvml
from tests.unit.fake_pynvml import FakeGpu, FakeNvmlConfig, Install
from tests.unit.sinks import RecordingSink
from tests.unit.test_gpu_memory import families
from tests.unit.test_spec_loading import job_yaml

GIB = 1 << 30


def wall() -> float:
    """The epoch seconds of every read: NVML's samples below are at 9.1-9.3 s (microseconds)."""
    return 10.0


OWNERS = {("n1", 10): "a", ("n1", 11): "a", ("n1", 20): "b", ("n1", 21): "b"}


def gpus() -> list[FakeGpu]:
    """GPU 0 shared by a (pid 10) and b (pid 20); GPU 1 holds b alone (21); GPU 2 holds a (11)
    beside a stranger (99)."""
    return [
        FakeGpu(
            "GPU-0",
            80 * GIB,
            10 * GIB,
            utilization_percent=90,
            processes=[(10, 6 * GIB), (20, 4 * GIB)],
            process_samples=[(10, 60, 9_100_000), (20, 20, 9_200_000), (20, 30, 9_300_000)],
        ),
        FakeGpu(
            "GPU-1",
            80 * GIB,
            4 * GIB,
            utilization_percent=70,
            processes=[(21, 4 * GIB)],
            process_samples=[(21, 70, 9_100_000)],
        ),
        FakeGpu(
            "GPU-2",
            80 * GIB,
            7 * GIB,
            utilization_percent=50,
            processes=[(11, 6 * GIB), (99, GIB)],
            process_samples=[(99, 50, 9_100_000)],
        ),
    ]


def test_each_job_gets_its_own_processes_sm_utilization(install_nvml: Install) -> None:
    install_nvml(FakeNvmlConfig(gpus=gpus()))
    attribution = attribute(NvmlGpuSource("n1", wall=wall).read(), OWNERS)
    # b's highest sample on GPU 0; a ran no kernel on GPU 2 (the stranger's 50% is not a's).
    assert attribution.utilization_by_job() == {
        "a": {("n1", 0): 0.6, ("n1", 2): 0.0},
        "b": {("n1", 0): 0.3, ("n1", 1): 0.7},
    }


def test_without_per_process_figures_a_job_alone_gets_the_device_s_else_unknown(
    install_nvml: Install,
) -> None:
    config = FakeNvmlConfig(gpus=gpus())
    for gpu in config.gpus:
        gpu.failures["process_utilization"] = fake_pynvml.NVMLError_NotSupported
    install_nvml(config)
    attribution = attribute(NvmlGpuSource("n1", wall=wall).read(), OWNERS)
    # GPU 0 is shared and GPU 2 has a stranger's memory: neither is the job's alone.
    assert attribution.utilization_by_job() == {
        "a": {("n1", 0): None, ("n1", 2): None},
        "b": {("n1", 0): None, ("n1", 1): 0.7},
    }


def test_a_stranger_nvml_cannot_read_also_makes_the_device_s_figure_not_the_job_s() -> None:
    def reading(unknown: tuple[int, ...]) -> GpuReading:
        return GpuReading(
            "n1", 0, "GPU-0", "nvml", GIB, 80 * GIB, utilization_ratio=0.8,
            processes=(ProcessMemory(10, GIB),), unknown_pids=unknown,
        )  # fmt: skip

    assert attribute([reading(())], OWNERS).utilization == {("a", "n1", 0): 0.8}
    assert attribute([reading((99,))], OWNERS).utilization == {("a", "n1", 0): None}


def rounds(*values: dict[str, float | None]) -> list[Attribution]:
    """One attribution per round: each job's utilization on GPU 0 of n1."""
    return [
        Attribution(
            dict.fromkeys(((job, "n1", 0) for job in round_), GIB),
            {},
            {(job, "n1", 0): ratio for job, ratio in round_.items()},
        )
        for round_ in values
    ]


def test_the_smoothed_high_of_a_run_starts_over_with_a_new_run_and_ignores_unknown() -> None:
    kept: dict[str, RunUtilization] = {}
    runs = {"a": "r1", "b": "r1"}
    history = rounds({"a": 0.5, "b": None}, {"a": 1.0}, {"a": 0.0, "b": 0.4}, {"a": None})
    highs = []
    for attribution in history:
        kept = accumulate_utilization(kept, attribution, runs, smoothing=0.5)
        highs.append({job: (run.smoothed, run.high) for job, run in kept.items()})
    assert highs == [
        {"a": (0.5, 0.5)},  # b unknown: not measured yet
        {"a": (0.75, 0.75)},
        {"a": (0.375, 0.75), "b": (0.4, 0.4)},  # idle a round: the high stays
        {"a": (0.375, 0.75), "b": (0.4, 0.4)},  # unknown: nothing changes
    ]
    restarted = accumulate_utilization(kept, rounds({"a": 0.1})[0], {"a": "r2"})
    assert restarted == {"a": RunUtilization("r2", 0.1, 0.1)}  # b left: forgotten
    with pytest.raises(ValueError, match="smoothing must be in"):
        accumulate_utilization(kept, history[0], runs, smoothing=0)


@given(st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_the_high_never_falls_within_a_run_and_stays_within_the_readings(
    readings: list[float],
) -> None:
    kept: dict[str, RunUtilization] = {}
    before = 0.0
    for attribution in rounds(*({"a": value} for value in readings)):
        kept = accumulate_utilization(kept, attribution, {"a": "r"})
        assert kept["a"].high >= before
        before = kept["a"].high
    assert min(readings) - 1e-9 <= before <= max(readings) + 1e-9
    assert before >= readings[0] - 1e-9  # the first reading starts the smoothing


def test_a_one_round_burst_counts_a_fifth() -> None:
    kept: dict[str, RunUtilization] = {}
    for attribution in rounds({"a": 0.1}, {"a": 1.0}, {"a": 0.1}):
        kept = accumulate_utilization(kept, attribution, {"a": "r"})
    assert kept["a"].high == pytest.approx(0.1 + 0.2 * 0.9)


# ---- into the demands and the cap ----


def test_run_max_gpu_utilization_is_the_cap_off_by_default_and_checked() -> None:
    parser = build_parser()
    base = ["run", "--share-gpus", "--gpu-memory", "8GiB"]
    assert sharing_limits(parser.parse_args(base), virtual=False) == SharingLimits(4, 0.1, 8 * GIB)
    capped = parser.parse_args([*base, "--max-gpu-utilization", "1.5"])
    assert sharing_limits(capped, virtual=False) == SharingLimits(
        4, 0.1, 8 * GIB, max_utilization=1.5
    )
    for bad in ("0.5", "inf"):
        with pytest.raises(UsageError, match="--max-gpu-utilization: must be a finite number >= 1"):
            sharing_limits(parser.parse_args([*base, "--max-gpu-utilization", bad]), False)
    alone = parser.parse_args(["run", "--max-gpu-utilization", "1.5"])
    with pytest.raises(UsageError, match="--max-gpu-utilization: only with --share-gpus"):
        sharing_limits(alone, virtual=False)


def test_bad_max_gpu_utilization_is_a_usage_error_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--share-gpus", "--max-gpu-utilization", "-1"])
    assert "--max-gpu-utilization" in capsys.readouterr().err


@pytest.mark.parametrize(("percent", "together"), [(30, True), (90, False)])
def test_measured_utilization_keeps_busy_sharing_jobs_apart_and_lets_light_ones_share(
    install_nvml: Install, percent: int, together: bool
) -> None:
    """NVML's per-process readings -> the peaks -> the reconciler's demands -> the allocator
    under `run --max-gpu-utilization 1.5`. Unmeasured, both jobs count as busy (1.0 each) and
    are kept apart: the light pair shares a GPU only when its measurement reaches the demand."""
    install_nvml(
        FakeNvmlConfig(
            gpus=[
                FakeGpu(
                    "GPU-0",
                    8 * GIB,
                    GIB,
                    processes=[(10, GIB)],
                    process_samples=[(10, percent, 9_100_000)],
                ),
                FakeGpu(
                    "GPU-1",
                    8 * GIB,
                    GIB,
                    processes=[(20, GIB)],
                    process_samples=[(20, percent, 9_100_000)],
                ),
            ]
        )
    )
    peaks = PeakGpuMemory()
    runs = {"a": "r", "b": "r"}
    peaks.observe(
        attribute(NvmlGpuSource("n1", wall=wall).read(), {("n1", 10): "a", ("n1", 20): "b"}), runs
    )
    assert (peaks.utilization("a"), peaks.utilization("b")) == (percent / 100, percent / 100)

    reconciler = ReconcilerBase()
    measures = peaks.measures()  # what the operator gives its JobReconciler
    reconciler.peak_memory = measures["peak_memory"]
    reconciler.gpu_utilization = measures["gpu_utilization"]
    spec = "{command: [x], gpus: {min: 1, max: 1, share: true, memory: 1Gi}}"
    demands = []
    for arrival, name in enumerate("ab"):
        job = load_spec_text(job_yaml(name, spec), f"jobs/{name}.yaml").job
        assert job is not None
        demands.append(
            Demand(name, 1, 1, 1, arrival=float(arrival), **reconciler._sharing(name, job))
        )
    assert [demand.utilization for demand in demands] == [percent / 100] * 2

    args = build_parser().parse_args(
        ["run", "--share-gpus", "--gpu-memory", "8GiB", "--max-gpu-utilization", "1.5"]
    )
    allocator = Allocator(
        Pool.from_counts({"localhost": 2}),
        RecordingSink(),
        virtual=True,
        drain_seconds=0,
        belongs=lambda job, pid: True,
        sharing=sharing_limits(args, virtual=False),
    )
    for demand in demands:
        allocator.request(demand)
    placements = allocator.placements()
    slots = {job: tuple(placements[job].slots()) for job in "ab"}
    assert all(len(held) == 1 for held in slots.values())
    assert (slots["a"] == slots["b"]) is together


def test_each_job_s_utilization_per_gpu_is_exported_at_scrape_time(install_nvml: Install) -> None:
    config = FakeNvmlConfig(gpus=gpus())
    install_nvml(config)
    collector = GpuCollector(NvmlGpuSource("n1", wall=wall), pid_owners=lambda: OWNERS)
    scraped = families(exposition(collector))
    labels = [{"host": "n1", "gpu": str(i), "uuid": f"GPU-{i}", "kind": "nvml"} for i in range(3)]
    assert scraped["herd_job_gpu_utilization_ratio"] == [
        ({**labels[0], "herd_job": "a"}, 0.6),
        ({**labels[0], "herd_job": "b"}, 0.3),
        ({**labels[1], "herd_job": "b"}, 0.7),
        ({**labels[2], "herd_job": "a"}, 0.0),
    ]
    # Without per-process figures only b alone on GPU 1 is known: no series rather than a guess.
    for gpu in config.gpus:
        gpu.failures["process_utilization"] = fake_pynvml.NVMLError_NotSupported
    unsupported = GpuCollector(NvmlGpuSource("n1", wall=wall), pid_owners=lambda: OWNERS)
    scraped = families(exposition(unsupported))
    assert scraped["herd_job_gpu_utilization_ratio"] == [({**labels[1], "herd_job": "b"}, 0.7)]
