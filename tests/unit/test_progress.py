"""Tests for controllers.progress: epoch times, the ETA and the reported metrics kept, on
hand-made reports with known answers."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.controllers.progress import (
    ETA_EPOCHS,
    done_fraction,
    epoch_seconds,
    estimate_progress,
    eta_seconds,
    latest_metrics,
)
from herd_operator.specs.status import MAX_JOB_METRICS, Progress
from herd_operator.specs.values import Report


def end(epoch: int, time: float, size: int = 2, **metrics: float) -> Report:
    return Report(epoch=epoch, time=time, world_size=size, metrics=MappingProxyType(metrics))


def reset(time: float, size: int) -> Report:
    return Report(epoch=None, time=time, world_size=size)


def test_epochs_in_a_row_at_one_size_are_measured() -> None:
    reports = [end(0, 100.0), end(1, 110.0), end(2, 130.0)]
    assert epoch_seconds(reports) == [(2, 10.0), (2, 20.0)]


def test_a_reset_between_two_epoch_ends_measures_nothing() -> None:
    reports = [end(0, 100.0), reset(105.0, 2), end(1, 112.0), end(2, 122.0)]
    assert epoch_seconds(reports) == [(2, 10.0)]


def test_a_measurement_within_an_epoch_is_no_reset() -> None:
    measured = Report(None, 104.0, 2, MappingProxyType({"step_seconds": 0.5}), measurement=True)
    reports = [end(0, 100.0), measured, end(1, 110.0), end(2, 130.0)]
    assert epoch_seconds(reports) == [(2, 10.0), (2, 20.0)]
    assert latest_metrics({}, [end(0, 100.0, loss=1.0), measured]) == {"loss": 1.0}


def test_a_measurement_names_no_epoch() -> None:
    with pytest.raises(ValueError, match="its epoch must be None"):
        Report(3, 1.0, 2, measurement=True)


def test_a_size_change_between_two_epoch_ends_measures_nothing() -> None:
    reports = [end(0, 100.0, size=2), end(1, 110.0, size=3), end(2, 117.0, size=3)]
    assert epoch_seconds(reports) == [(3, 7.0)]


def test_an_epoch_that_went_back_measures_nothing() -> None:
    # A rollback to the last commit reports an epoch again: no time is negative or double.
    reports = [end(3, 100.0), end(3, 120.0), end(2, 125.0), end(3, 131.0)]
    assert epoch_seconds(reports) == [(2, 6.0)]


def test_skipped_epochs_share_the_time_between_reports() -> None:
    # A script that reports every other epoch: each of the two took half the time.
    assert epoch_seconds([end(1, 100.0), end(3, 120.0)]) == [(2, 10.0), (2, 10.0)]


def test_eta_is_the_median_epoch_time_at_the_current_size_times_epochs_left() -> None:
    reports = [end(0, 100.0), end(1, 110.0), end(2, 150.0), end(3, 162.0)]
    # Measured: 10, 40, 12 -> median 12; 4 of 10 done; 6 left from the last end at 162.
    progress = estimate_progress(10, reports, last_epoch=3)
    assert progress == Progress(
        epochs=10, completed=4, epoch_seconds=12.0, world_size=2, estimated_completion=234.0
    )
    assert eta_seconds(progress, now=200.0) == 34.0


def test_eta_uses_only_the_last_epochs_measured() -> None:
    # Six slow epochs, then ETA_EPOCHS fast ones: only the fast ones count.
    slow = [end(epoch, 100.0 * epoch) for epoch in range(6)]
    fast = [end(5 + n, 500.0 + 2.0 * n) for n in range(1, ETA_EPOCHS + 1)]
    progress = estimate_progress(20, slow + fast, last_epoch=5 + ETA_EPOCHS)
    assert progress.epoch_seconds == 2.0


def test_eta_after_a_resize_waits_for_an_epoch_at_the_new_size() -> None:
    before = [end(0, 100.0, size=2), end(1, 110.0, size=2)]
    grown = [*before, reset(111.0, 4), end(2, 118.0, size=4)]
    progress = estimate_progress(10, grown, last_epoch=2)
    assert (progress.completed, progress.epoch_seconds, progress.estimated_completion) == (
        3,
        None,
        None,
    )
    measured = estimate_progress(10, [*grown, end(3, 123.0, size=4)], last_epoch=3)
    assert measured.epoch_seconds == 5.0
    assert measured.world_size == 4
    assert measured.estimated_completion == 123.0 + 6 * 5.0


def test_an_earlier_measure_at_the_size_come_back_to_counts() -> None:
    reports = [
        end(0, 100.0, size=2),
        end(1, 110.0, size=2),
        reset(111.0, 4),
        end(2, 115.0, size=4),
        reset(116.0, 2),
        end(3, 127.0, size=2),
    ]
    progress = estimate_progress(5, reports, last_epoch=3)
    assert progress.epoch_seconds == 10.0
    assert progress.estimated_completion == 127.0 + 10.0


def test_no_reports_or_no_epochs_give_no_eta() -> None:
    assert estimate_progress(10, [], last_epoch=None) == Progress(epochs=10, completed=0)
    only_resets = estimate_progress(10, [reset(100.0, 2)], last_epoch=None)
    assert (only_resets.completed, only_resets.estimated_completion) == (0, None)
    # A relaunch: the last epoch of the run before counts as done; nothing measured yet.
    relaunched = estimate_progress(10, [], last_epoch=4)
    assert (relaunched.completed, relaunched.estimated_completion) == (5, None)
    assert eta_seconds(relaunched, now=1e9) is None
    assert eta_seconds(None, now=0.0) is None


def test_all_expected_epochs_done_ends_at_the_last_epoch() -> None:
    progress = estimate_progress(2, [end(0, 100.0), end(1, 110.0)], last_epoch=1)
    assert (progress.completed, progress.estimated_completion) == (2, 110.0)
    # More epochs than expected: still done then, never a negative ETA.
    beyond = estimate_progress(2, [end(4, 100.0), end(5, 110.0)], last_epoch=5)
    assert beyond.estimated_completion == 110.0
    assert eta_seconds(beyond, now=500.0) == 0.0


@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.integers(0, 20)),
            st.floats(0.0, 5.0),
            st.integers(1, 4),
        ),
        max_size=30,
    ),
    st.integers(1, 30),
)
def test_the_estimate_never_runs_backwards(
    steps: list[tuple[int | None, float, int]], expected: int
) -> None:
    time, reports = 1000.0, []
    for epoch, gap, size in steps:
        time += gap
        reports.append(Report(epoch=epoch, time=time, world_size=size))
    epochs = [report.epoch for report in reports if report.epoch is not None]
    progress = estimate_progress(expected, reports, epochs[-1] if epochs else None)
    assert all(seconds >= 0.0 for _, seconds in epoch_seconds(reports))
    if progress.estimated_completion is not None:
        last_end = max(report.time for report in reports if report.epoch is not None)
        assert progress.estimated_completion >= last_end


def test_metrics_keep_the_latest_value_of_each_name() -> None:
    reports = [end(0, 1.0, loss=2.0), reset(2.0, 3), end(1, 3.0, loss=1.5, acc=0.4)]
    assert latest_metrics({}, reports) == {"loss": 1.5, "acc": 0.4}
    # A reset report carries no metrics; what was kept stays when nothing new comes.
    assert latest_metrics({"loss": 1.5}, [reset(4.0, 2)]) == {"loss": 1.5}


def test_metrics_are_bounded_per_job_first_names_kept() -> None:
    kept = {f"m{index}": 0.0 for index in range(MAX_JOB_METRICS - 1)}
    reports = [end(0, 1.0, new=1.0), end(1, 2.0, newer=2.0, new=3.0)]
    shown = latest_metrics(kept, reports)
    assert len(shown) == MAX_JOB_METRICS
    assert shown["new"] == 3.0 and "newer" not in shown


@pytest.mark.parametrize("limit", [1, 3])
def test_a_script_reporting_a_new_name_each_epoch_holds_the_bound(limit: int) -> None:
    reports = [end(epoch, float(epoch), **{f"name{epoch}": 1.0}) for epoch in range(50)]
    assert list(latest_metrics({}, reports, limit)) == [f"name{i}" for i in range(limit)]


def test_done_fraction_is_the_share_of_expected_epochs_completed_and_none_without_them() -> None:
    assert done_fraction(None) is None
    assert done_fraction(Progress(epochs=8, completed=2)) == 0.25
    assert done_fraction(Progress(epochs=8, completed=9)) == 1.0  # more reported than expected
