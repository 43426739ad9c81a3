"""Pollux's applications fitted from its traces: the fit, the table, and the trace loader."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd_operator.simulate.calibration import (
    DEFAULT_BATCH,
    FIT_TOLERANCE,
    POLLUX_CALIBRATIONS,
    derive,
    fit_amdahl,
    iteration_time,
)
from herd_operator.simulate.workload import load_trace


def test_the_fit_recovers_amdahls_parameters_from_exact_points() -> None:
    points = [(n, 10.0 * (0.08 + 0.92 / n)) for n in (1, 2, 4, 8, 16)]
    serial, single = fit_amdahl(points)
    assert (serial, single) == (pytest.approx(0.08), pytest.approx(10.0))
    # Perfect scaling and no scaling at all are the two ends.
    assert fit_amdahl([(1, 4.0), (2, 2.0), (4, 1.0)]) == (pytest.approx(0.0), pytest.approx(4.0))
    assert fit_amdahl([(1, 1.0), (2, 1.1), (4, 1.2)])[0] == 1.0
    with pytest.raises(ValueError, match="need times at two sizes at least"):
        fit_amdahl([(4, 1.0)])


@pytest.mark.parametrize("key", sorted(POLLUX_CALIBRATIONS))
def test_each_calibration_reproduces_the_traces_points_within_the_tolerance(
    key: tuple[str, int],
) -> None:
    fit = POLLUX_CALIBRATIONS[key]
    assert (fit.application, fit.batch_size) == key
    # The stored parameters are the fit of the stored points (to the table's rounding) ...
    serial, single = fit_amdahl(fit.measured)
    assert serial == pytest.approx(fit.serial_fraction, abs=1e-4)
    assert single == pytest.approx(fit.iteration_seconds, rel=1e-3)
    # ... and reproduce every point, 1 GPU to the fastest size, within FIT_TOLERANCE (25%).
    assert fit.worst_error() <= FIT_TOLERANCE
    # No point past the fastest size was fitted.
    assert fit.measured[-1][1] == min(seconds for _, seconds in fit.measured)
    assert fit.work == pytest.approx(fit.iterations * fit.iteration_seconds)


def test_every_application_has_its_default_batch_calibrated() -> None:
    assert {(app, batch) for app, batch in DEFAULT_BATCH.items()} <= set(POLLUX_CALIBRATIONS)


def synthetic_trace(name: str) -> str:
    """Trace files of an application whose iteration takes 0.5 + 8 / n s at a global batch
    of 64 (step time linear in the local batch, sync 0.1 s), up to 16 GPUs; 64 GPUs slower."""
    if name == "placements.csv":
        rows = ["placement,local_bsz,step_time,sync_time"]
        for placement, gpus in (("1", 1), ("2", 2), ("4", 4), ("44", 8), ("4444", 16)):
            for local in (4, 32):
                # At local 64 / n the step is 0.5 + 8 / n; a line through it in the local batch.
                rows.append(f"{placement},{local},{0.5 + 0.125 * local},0.1")
            if gpus == 1:
                rows.append(f"{placement},64,{0.5 + 0.125 * 64},0.1")
        return "\n".join(rows) + "\n"
    if name == "scalability.csv":
        return "num_nodes,num_replicas,local_bsz,step_time,sync_time\n16,64,1,5.0,4.0\n"
    if name == "validation-64.csv":
        lines = "\n".join(f"{e},{100 * e},0.5,1,1" for e in range(1, 11))
        return "progress,iteration,metric,grad_sqr,grad_var\n" + lines + "\n"
    raise FileNotFoundError(name)


def test_derive_fits_the_iteration_times_up_to_the_fastest_size() -> None:
    fit = derive("toy", 64, synthetic_trace, epochs=10)
    assert [gpus for gpus, _ in fit.measured] == [1, 2, 4, 8, 16]  # 64 GPUs is slower: cut
    for gpus, seconds in fit.measured:
        assert seconds == pytest.approx(0.5 + 8.0 / gpus)
    assert fit.serial_fraction == pytest.approx(0.5 / 8.5)
    assert fit.iteration_seconds == pytest.approx(8.5)
    assert (fit.iterations, fit.epochs) == (1000, 10)
    assert fit.work == pytest.approx(8500.0)


def test_a_local_batch_above_the_largest_measured_runs_in_several_steps() -> None:
    curve = [(8.0, 1.0, 0.2), (16.0, 2.0, 0.2)]
    assert iteration_time(curve, 16.0, cap=1 << 30) == pytest.approx(2.0)
    # 32 samples in two steps of 16: the second costs its step less the synchronisation.
    assert iteration_time(curve, 32.0, cap=1 << 30) == pytest.approx(2.0 + 1.8)
    # A cap below the largest measured (Pollux's yolov3) splits earlier.
    assert iteration_time(curve, 16.0, cap=8) == pytest.approx(1.0 + 0.8)


def test_a_pollux_trace_loads_with_its_calibrated_work_and_a_bad_batch_is_named(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "workload.csv"
    trace.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "cifar10-0,107,cifar10,6,4096\n"
        "ncf-1,135,ncf,1,\n"
    )
    cifar, ncf = load_trace(trace, pool_gpus=64)
    fit = POLLUX_CALIBRATIONS["cifar10", 4096]
    assert cifar.work == pytest.approx(fit.work)
    assert cifar.serial_fraction == fit.serial_fraction and cifar.epochs == fit.epochs
    # No batch given: the application's default one.
    assert ncf.work == pytest.approx(POLLUX_CALIBRATIONS["ncf", DEFAULT_BATCH["ncf"]].work)
    trace.write_text("name,time,application,num_replicas,batch_size\nx,1,cifar10,2,100\n")
    with pytest.raises(
        ValueError, match=r"workload.csv:2: batch_size 100 of cifar10 is not calibrated;"
        r" calibrated: 2048, 4096"
    ):  # fmt: skip
        load_trace(trace, pool_gpus=64)
