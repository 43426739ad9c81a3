"""The simulator's co-location model (herd_operator/simulate/colocation.py): the interference
slowdown, a job's pace on several GPUs, the GPU occupancy, utilizations and memory
estimates."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.policies.sharing import worker_memory_at
from herd_operator.simulate.colocation import (
    CUDA_CONTEXT_BYTES,
    INTERFERENCE_POINTS,
    MAX_ACTIVATION_FRACTION,
    POLLUX_APPS,
    GpuOccupancy,
    interference_slowdown,
    job_slowdown,
    sharing_request,
    utilization_within,
    with_published_memory,
    with_utilization,
    worker_memory_bytes,
)
from herd_operator.simulate.model import GPU_MEMORY_BYTES, MAX_MEMORY_FRACTION, JobModel
from herd_operator.simulate.workload import perlmutter_mix
from herd_operator.specs.values import Demand


def test_alone_runs_at_full_speed() -> None:
    assert interference_slowdown(()) == 1.0
    assert interference_slowdown((1.0,)) == 1.0
    assert interference_slowdown((0.0, 0.0)) == 1.0


def test_the_table_points_and_between() -> None:
    # Two busy jobs: the mean of Gavel's measured pairs; half busy each: our 10%.
    assert interference_slowdown((1.0, 1.0)) == pytest.approx(1.61)
    assert interference_slowdown((0.5, 0.5)) == pytest.approx(1.10)
    assert interference_slowdown((0.25, 0.25)) == pytest.approx(1.05)
    assert interference_slowdown((0.75, 0.75)) == pytest.approx((1.10 + 1.61) / 2)
    # Past the table a saturated GPU time-slices: one more unit of busy time, one more unit.
    assert interference_slowdown((1.0, 1.0, 1.0)) == pytest.approx(2.61)
    assert INTERFERENCE_POINTS[0] == (0.0, 1.0)


@given(st.lists(st.floats(0.0, 1.0), min_size=2, max_size=6), st.floats(0.0, 1.0))
def test_a_busier_neighbour_never_slows_less(utilizations: list[float], more: float) -> None:
    base = interference_slowdown(utilizations)
    assert base >= 1.0
    busier = [*utilizations[:-1], max(utilizations[-1], more)]
    assert interference_slowdown(busier) >= base - 1e-12
    assert interference_slowdown([*utilizations, more]) >= base - 1e-12
    # Order of the jobs does not matter.
    assert interference_slowdown(list(reversed(utilizations))) == pytest.approx(base)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_a_bad_utilization_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="utilization"):
        interference_slowdown((0.5, bad))


def test_a_job_steps_at_its_slowest_gpu() -> None:
    assert job_slowdown([]) == 1.0
    assert job_slowdown([1.0, 1.3, 1.1]) == 1.3


def test_occupancy_tracks_neighbours_and_slowdowns() -> None:
    occupancy = GpuOccupancy()
    assert occupancy.place("a", [("n0", 0), ("n0", 1)], 0.5) == {"a"}
    assert occupancy.slowdown("a") == 1.0 and occupancy.occupied == 2
    # b joins one of a's GPUs: both must be computed again; a is slowed on that GPU only,
    # and steps at that pace.
    assert occupancy.place("b", [("n0", 1)], 0.5) == {"a", "b"}
    assert occupancy.slowdown("a") == pytest.approx(1.10)
    assert occupancy.slowdown("b") == pytest.approx(1.10)
    assert occupancy.sharing("a") == 2 and occupancy.occupied == 2
    # c elsewhere touches nobody else.
    assert occupancy.place("c", [("n1", 0)], 1.0) == {"c"}
    # b moves next to c: a, b and c all change.
    assert occupancy.place("b", [("n1", 0)], 0.5) == {"a", "b", "c"}
    assert occupancy.slowdown("a") == 1.0
    assert occupancy.slowdown("c") == pytest.approx(interference_slowdown((1.0, 0.5)))
    # c leaves: b alone again; a job holding nothing is not slowed.
    assert occupancy.place("c", (), 0.0) == {"b", "c"}
    assert occupancy.slowdown("b") == 1.0 and occupancy.slowdown("c") == 1.0
    assert occupancy.sharing("c") == 0 and occupancy.occupied == 3


def _mix(count: int = 200) -> list[JobModel]:
    return perlmutter_mix(count, 64, seed=3)


def test_utilizations_are_seeded_apart_from_the_mix() -> None:
    jobs = _mix()
    first, again = with_utilization(jobs, 3), with_utilization(jobs, 3)
    assert first == again
    assert with_utilization(jobs, 4) != first
    # Only the utilization changes: the mix is what its seed made.
    assert [dataclasses.replace(job, gpu_utilization=1.0) for job in first] == jobs
    for job in first:
        used = job.memory_fraction(job.requested)
        low, high = (0.15, 0.65) if used <= 0.25 else (0.40, 1.0)
        assert low <= job.gpu_utilization <= high


def test_worker_memory_from_published_sizes() -> None:
    # cifar10 at its trace batch 2048 on 4 GPUs: context + 11.2 M x 12 B + 512 x 8 MB.
    expected = CUDA_CONTEXT_BYTES + 11.2e6 * 12 + 512 * 8e6
    assert worker_memory_bytes("cifar10", 2048, 4) == int(expected)
    # More workers, less each (batch preserving).
    assert worker_memory_bytes("bert", 384, 64) < worker_memory_bytes("bert", 384, 32)
    # ImageNet's 6400 on one GPU does not fit: it runs in micro-batches, capped.
    capped = worker_memory_bytes("imagenet", 6400, 1)
    assert capped == pytest.approx(MAX_ACTIVATION_FRACTION * GPU_MEMORY_BYTES, abs=1)
    with pytest.raises(ValueError, match="known"):
        worker_memory_bytes("gpt5", 1, 1)
    with pytest.raises(ValueError, match="workers"):
        worker_memory_bytes("ncf", 32768, 0)


def _trace_job(application: str, batch: int, requested: int) -> JobModel:
    return JobModel(
        name=f"{application}-{requested}",
        arrival=0.0,
        requested=requested,
        min_gpus=1,
        max_gpus=requested,
        work=3600.0,
        epochs=10,
        serial_fraction=0.05,
        mem_fixed=0.2,
        mem_batch=0.4,
        application=application,
        batch_size=batch,
    )


@pytest.mark.parametrize(
    ("application", "batch", "requested"),
    list(itertools.product(sorted(POLLUX_APPS), [64, 384, 2048, 6400], [1, 4, 16])),
)
def test_published_memory_replaces_the_guess(application: str, batch: int, requested: int) -> None:
    job = _trace_job(application, batch, requested)
    (out,) = with_published_memory([job])
    estimate = worker_memory_bytes(application, batch, requested) / GPU_MEMORY_BYTES
    assert out.memory_fraction(requested) == pytest.approx(min(estimate, MAX_MEMORY_FRACTION))
    assert out.gpu_utilization == POLLUX_APPS[application].utilization
    assert 1 <= out.min_gpus <= out.max_gpus == requested
    assert out.memory_fraction(out.min_gpus) <= MAX_MEMORY_FRACTION + 1e-9


def test_jobs_without_an_application_keep_their_memory() -> None:
    jobs = _mix(20)
    assert with_published_memory(jobs) == jobs


@pytest.mark.parametrize("limit", [1.05, 1.10, 1.25, 1.61, 2.5])
def test_the_utilization_cap_for_a_slowdown_inverts_the_table(limit: float) -> None:
    cap = utilization_within(limit)
    assert interference_slowdown((cap / 3,) * 3) == pytest.approx(limit)
    assert interference_slowdown((cap / 3, cap / 3, cap / 3 + 0.01)) > limit
    assert utilization_within(1.25) == pytest.approx(1 + 0.15 / 0.51)
    with pytest.raises(ValueError, match="slowdown must be finite and > 1"):
        utilization_within(1.0)


def test_a_sharing_request_covers_what_a_worker_holds_at_every_size() -> None:
    for job in with_utilization(perlmutter_mix(200, 64, seed=3), 3):
        share, memory, _, utilization, split = sharing_request(job, True, 1.0)
        assert share and memory is not None and utilization == job.gpu_utilization
        demand = Demand(job.name, job.min_gpus, job.max_gpus, job.max_gpus, share=True,
                        memory_bytes=memory, memory_split_bytes=split)  # fmt: skip
        for size in range(job.min_gpus, job.max_gpus + 1):
            held = job.memory_fraction(size) * GPU_MEMORY_BYTES
            assert held <= worker_memory_at(demand, size, 0.0) <= held + 4, (
                job.name,
                size,
            )  # rounding
    assert sharing_request(job, True, job.gpu_utilization - 0.01)[0] is False
