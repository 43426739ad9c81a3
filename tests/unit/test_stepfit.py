"""Pollux's step-time form in the `goodput` policy (policies/stepfit.py): a known model
recovered from the reports it would give, the priors for placements not seen, reports
without the compute seconds, and properties of any fit (positive steps, more nodes never
faster)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.base import JobObservations
from herd_operator.policies.goodput import (
    BatchProfile,
    GoodputParams,
    GoodputPolicy,
    StepTime,
    batch_profile,
    choose_batch,
    goodput,
    goodput_knee,
)
from herd_operator.policies.stepfit import (
    OVERLAPS,
    SyncStepTime,
    fit_sync_step_time,
    overlapped,
    packed_nodes,
    reported_gpus_per_node,
)
from herd_operator.specs import HerdJob
from herd_operator.specs.values import (
    BASE_BATCH_METRIC,
    BATCH_SIZE_METRIC,
    COMPUTE_SECONDS_METRIC,
    GRADIENT_NOISE_SCALE_METRIC,
    NODES_METRIC,
    STEP_SECONDS_METRIC,
    Report,
)

TRUTH = SyncStepTime(0.28, 0.05, 0.02, 0.004, 1.2, 0.01, 2.0, gpus_per_node=4)
"""bert-like: a cheap sync within a node, a costly one across, overlapped (g = 2)."""


def report(
    model: SyncStepTime, nodes: int, gpus: int, batch: int, *, noise: float = 2000.0
) -> Report:
    metrics = {
        GRADIENT_NOISE_SCALE_METRIC: noise,
        BATCH_SIZE_METRIC: float(batch),
        BASE_BATCH_METRIC: 16.0,
        STEP_SECONDS_METRIC: model.step(nodes, gpus, batch),
        COMPUTE_SECONDS_METRIC: model.compute(batch / gpus),
        NODES_METRIC: float(nodes),
    }
    return Report(0, 0.0, gpus, metrics)


def reports(model: SyncStepTime, placements: list[tuple[int, int, int]]) -> list[Report]:
    return [report(model, nodes, gpus, batch) for nodes, gpus, batch in placements]


def rates(model: SyncStepTime) -> list[float]:
    return [
        model.compute_fixed,
        model.compute_per_sample,
        model.node_fixed,
        model.node_per_gpu,
        model.network_fixed,
        model.network_per_gpu,
    ]


def make_job(low: int = 1, high: int = 64) -> HerdJob:
    spec: dict[str, Any] = {
        "command": ["python", "t.py"],
        "gpus": {"min": low, "max": high},
        "training": {"maxBatch": 4096},
    }
    return HerdJob.model_validate(
        {"apiVersion": "herd/v1alpha1", "kind": "HerdJob", "metadata": {"name": "t"}, "spec": spec}
    )


@pytest.mark.parametrize("overlap", [1.0, 2.0, 3.0, 4.0])
def test_a_known_model_is_recovered_from_its_reports(overlap: float) -> None:
    truth = SyncStepTime(0.28, 0.05, 0.02, 0.004, 1.2, 0.01, overlap, gpus_per_node=4)
    seen = [
        (1, 1, 16),
        (1, 2, 32),
        (1, 4, 64),
        (1, 4, 256),
        (2, 8, 128),
        (2, 8, 512),
        (4, 16, 256),
    ]
    fitted = fit_sync_step_time(reports(truth, seen), 4, 0.5)
    assert fitted is not None
    assert fitted.overlap == overlap
    assert rates(fitted) == pytest.approx(rates(truth), rel=1e-6, abs=1e-9)
    # So it predicts what it never saw: 64 GPUs over 16 nodes, a batch of 2,048.
    assert fitted.seconds(64, 2048) == pytest.approx(truth.step(16, 64, 2048), rel=1e-6)


def test_one_local_batch_takes_half_its_compute_as_fixed() -> None:
    fitted = fit_sync_step_time(reports(TRUTH, [(1, 2, 32), (1, 4, 64)]), 4, 0.5)
    assert fitted is not None
    compute = TRUTH.compute(16)
    assert (fitted.compute_fixed, fitted.compute_per_sample) == pytest.approx(
        (compute / 2, compute / 2 / 16)
    )


def test_across_nodes_is_taken_as_within_one_until_seen() -> None:
    fitted = fit_sync_step_time(reports(TRUTH, [(1, 1, 16), (1, 2, 64), (1, 4, 64)]), 4, 0.5)
    assert fitted is not None
    assert (fitted.network_fixed, fitted.network_per_gpu) == (
        fitted.node_fixed,
        fitted.node_per_gpu,
    )
    assert fitted.node_fixed > 0 and fitted.node_per_gpu > 0
    # Seen across nodes at one GPU count: that fixed cost, the per-GPU rate within a node.
    seen = [(1, 1, 16), (1, 2, 64), (1, 4, 64), (1, 4, 256), (2, 8, 64)]
    truth = SyncStepTime(0.28, 0.05, 0.5, 0.1, 1.2, 0.1, 2.0, gpus_per_node=4)
    fitted = fit_sync_step_time(reports(truth, seen), 4, 0.5)
    assert fitted is not None and fitted.overlap == 2.0
    assert fitted.network_per_gpu == pytest.approx(0.1, rel=1e-6)
    assert fitted.network_fixed == pytest.approx(1.2, rel=1e-6)


def test_a_job_that_only_ran_across_nodes_syncs_within_one_as_across() -> None:
    fitted = fit_sync_step_time(reports(TRUTH, [(2, 8, 128), (4, 16, 256), (2, 8, 64)]), 4, 0.5)
    assert fitted is not None
    assert (fitted.node_fixed, fitted.node_per_gpu) == (
        fitted.network_fixed,
        fitted.network_per_gpu,
    )


def test_a_job_on_one_gpu_has_no_sync_and_its_compute_is_its_step() -> None:
    fitted = fit_sync_step_time(reports(TRUTH, [(1, 1, 16), (1, 1, 64)]), 4, 0.5)
    assert fitted is not None
    assert rates(fitted)[2:] == [0.0, 0.0, 0.0, 0.0]
    assert fitted.seconds(8, 64) == pytest.approx(TRUTH.compute(8))


def test_reports_without_the_compute_keep_the_line() -> None:
    old = [
        Report(
            0,
            0.0,
            2,
            {
                GRADIENT_NOISE_SCALE_METRIC: 500.0,
                BATCH_SIZE_METRIC: 32.0,
                STEP_SECONDS_METRIC: 0.5,
            },
        )
    ]
    assert fit_sync_step_time(old, 4, 0.5) is None
    profile = batch_profile(make_job(), old, step_model="pollux", gpus_per_node=4)
    assert profile is not None
    assert profile.step_time == StepTime(0.25, 0.25 / 16)


def test_the_nodes_a_size_spans() -> None:
    assert [packed_nodes(g, 4) for g in (1, 4, 5, 8, 9, 64)] == [1, 1, 2, 2, 3, 16]
    assert packed_nodes(64, None) == 1
    seen = reports(TRUTH, [(1, 2, 32), (3, 10, 160)])
    assert reported_gpus_per_node(seen) == 4
    assert reported_gpus_per_node([Report(0, 0.0, 4, {})]) is None
    # Without the pool's count, the reports' is what sizes are packed on.
    fitted = fit_sync_step_time(seen, None, 0.5)
    assert fitted is not None and fitted.gpus_per_node == 4


def test_reports_without_the_node_count_are_taken_as_packed() -> None:
    seen = [report(TRUTH, nodes, gpus, batch) for nodes, gpus, batch in [(1, 2, 32), (2, 8, 64)]]
    unsaid = [
        Report(0, 0.0, r.world_size, {k: v for k, v in r.metrics.items() if k != NODES_METRIC})
        for r in seen
    ]
    assert fit_sync_step_time(unsaid, 4, 0.5) == fit_sync_step_time(seen, 4, 0.5)


def test_the_overlap_form() -> None:
    assert overlapped(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert overlapped(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert overlapped(3.0, 0.0, 2.0) == 3.0
    # No overflow at the largest overlap and long steps.
    assert overlapped(1e6, 2e6, 10.0) == pytest.approx(2e6 * (1 + 2.0**-10) ** 0.1)


def test_the_policy_crosses_a_node_only_where_the_gpus_across_pay_on_average() -> None:
    # Measured on one node and across two: the 5th GPU, past the node's 4, adds a 1.2 s
    # sync to steps of well under a second and gains little; the GPUs after it gain more.
    # The knee is where the GPUs past the node's edge still add `minGain` each on average
    # (the least concave majorant), not where the 5th alone falls short: at a minGain of
    # 0.5 the job crosses, at 0.6 it stays on one node. The line, fitted through the same
    # steps, has no node boundary and asks for more either way.
    seen = reports(TRUTH, [(1, 2, 32), (1, 4, 64), (1, 4, 128), (2, 8, 128)])
    job = make_job(low=2, high=32)
    observed = JobObservations(0.0, allocated=4, epochs=seen, gpus_per_node=4)
    profile = batch_profile(job, seen, step_model="pollux", gpus_per_node=4)
    assert profile is not None and isinstance(profile.step_time, SyncStepTime)
    one = goodput(1, choose_batch(1, profile), profile)
    best = {n: goodput(n, choose_batch(n, profile), profile) / one for n in range(2, 33)}
    assert best[5] - best[4] < 0.5  # the 5th GPU alone does not pay
    for min_gain in (0.5, 0.6):
        params = GoodputParams(min_gain=min_gain)
        pollux = GoodputPolicy(params).desired(job, observed, 0.0)  # the default form
        line = GoodputPolicy(GoodputParams(min_gain=min_gain, step_model="line"))
        size = goodput_knee(profile, min_gain, 2, 32)[0]
        assert pollux.gpus == size
        assert pollux.batch_size == choose_batch(4, profile)
        # The knee: from 4, the largest size whose goodput beats 4's by min_gain per GPU
        # on average, none of the sizes past it by as much from it.
        average = {n: (best[n] - best[4]) / (n - 4) for n in range(5, 33)}
        if min_gain == 0.5:
            assert size > 4 and average[size] >= min_gain
            assert all((best[n] - best[size]) / (n - size) < min_gain for n in range(size + 1, 33))
        else:
            assert size == 4 and max(average.values()) < min_gain
        assert line.desired(job, observed, 0.0).gpus > 4


def test_a_gpu_that_slows_the_job_gains_nothing_rather_than_less_than_nothing() -> None:
    profile = BatchProfile(16, 200.0, TRUTH, max_batch=4096)
    best = {n: goodput(n, choose_batch(n, profile), profile) for n in (4, 5)}
    assert best[5] < best[4]  # the fifth GPU crosses to a second node
    _, gains, _ = goodput_knee(profile, 0.5, 1, 32)
    assert gains[5 - 2] == 0.0
    assert min(gains) >= 0.0


placements = st.lists(
    st.tuples(
        st.integers(1, 64),  # gpus
        st.integers(1, 16),  # nodes (at most the gpus)
        st.integers(1, 4096),  # batch
        st.floats(1e-3, 100),  # step
        st.floats(0.05, 1.0),  # compute, in share of the step
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=200, deadline=None)
@given(seen=placements, per_node=st.one_of(st.none(), st.integers(1, 8)), share=st.floats(0, 0.9))
def test_any_fit_gives_positive_steps_and_more_nodes_are_never_faster(
    seen: list[tuple[int, int, int, float, float]], per_node: int | None, share: float
) -> None:
    epochs = [
        Report(
            0,
            0.0,
            gpus,
            {
                STEP_SECONDS_METRIC: step,
                COMPUTE_SECONDS_METRIC: step * part,
                BATCH_SIZE_METRIC: float(batch),
                NODES_METRIC: float(min(nodes, gpus)),
            },
        )
        for gpus, nodes, batch, step, part in seen
    ]
    fitted = fit_sync_step_time(epochs, per_node, share)
    assert fitted is not None and fitted.overlap in OVERLAPS
    for gpus in (1, 2, 3, 4, 5, 8, 16, 64):
        for batch in (1, 64, 4096):
            seconds = [fitted.step(nodes, gpus, batch) for nodes in range(1, min(gpus, 16) + 1)]
            assert all(math.isfinite(s) and s > 0 for s in seconds)
            assert seconds == sorted(seconds)
            assert fitted.seconds(gpus, batch) > 0
