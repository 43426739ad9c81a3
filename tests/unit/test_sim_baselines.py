"""The baselines of Pollux's artifact (`simulate/baselines.py`) on hand-made cases whose
answers are worked out by hand."""

from __future__ import annotations

import pytest

from herd_operator.simulate.baselines import (
    RESTART_SECONDS,
    TIRESIAS_THRESHOLD_GPU_SECONDS,
    BaselineJob,
    optimus_sizes,
    run_baseline,
    tiresias_sizes,
)
from herd_operator.simulate.model import JobModel


def model(
    name: str, asked: int, work: float, arrival: float = 0.0, serial: float = 0.0
) -> JobModel:
    return JobModel(
        name=name,
        arrival=arrival,
        requested=asked,
        min_gpus=asked,
        max_gpus=asked,
        work=work,
        epochs=1,
        serial_fraction=0.0,
        mem_fixed=0.1,
        mem_batch=0.1,
    )


def test_tiresias_runs_whatever_fits_in_queue_order() -> None:
    jobs = [
        BaselineJob(model("a", 3, 100.0), entered=0.0),
        BaselineJob(model("b", 2, 100.0), entered=1.0),  # does not fit after a
        BaselineJob(model("c", 1, 100.0), entered=2.0),  # fits after b was skipped
    ]
    assert tiresias_sizes(jobs, 4) == {"a": 3, "b": 0, "c": 1}


def test_tiresias_serves_the_first_queue_before_the_second() -> None:
    demoted = BaselineJob(model("old", 4, 100.0), queue=1, entered=0.0)
    fresh = BaselineJob(model("new", 2, 100.0), queue=0, entered=50.0)
    assert tiresias_sizes([demoted, fresh], 4) == {"new": 2, "old": 0}


def test_optimus_gives_each_gpu_to_the_largest_cut_in_remaining_time() -> None:
    # Linear scaling: a GPU more takes a job from left/n to left/(n+1). After one GPU each,
    # a's gains are 50, 16.7, 8.3 and b's 5: a gets the next three.
    jobs = [BaselineJob(model("a", 1, 100.0)), BaselineJob(model("b", 1, 10.0, arrival=1.0))]
    assert optimus_sizes(jobs, 5, {"a": 8, "b": 8}) == {"a": 4, "b": 1}
    assert optimus_sizes(jobs, 5, {"a": 2, "b": 8}) == {"a": 2, "b": 3}, "up to its limit"


def test_optimus_gives_one_gpu_each_in_arrival_order_while_they_last() -> None:
    jobs = [BaselineJob(model(name, 1, 10.0, arrival=t)) for name, t in (("b", 2.0), ("a", 1.0))]
    assert optimus_sizes(jobs, 1, {"a": 4, "b": 4}) == {"a": 1, "b": 0}


@pytest.mark.parametrize("name", ["tiresias", "optimus"])
def test_one_job_runs_its_work_after_the_restart_stall(name: str) -> None:
    result = run_baseline(name, [model("a", 1, 600.0)], 4)
    (outcome,) = result.jobs
    assert outcome.admitted == 0.0
    assert outcome.finished == pytest.approx(RESTART_SECONDS + 600.0)


def test_tiresias_preempts_a_job_that_outgrew_the_first_queue() -> None:
    """One GPU; a 20 h job, then a 10 min one. The short one waits in the first queue behind
    the long one until the long one's service reaches the threshold (16 GPU-hours), then
    preempts it; the long one resumes from where it stopped, after a restart stall."""
    threshold = TIRESIAS_THRESHOLD_GPU_SECONDS
    long, short = model("long", 1, 20 * 3600.0), model("short", 1, 600.0, arrival=60.0)
    result = run_baseline("tiresias", [long, short], 1)
    by_name = {job.name: job for job in result.jobs}
    assert by_name["short"].admitted == threshold
    assert by_name["short"].finished == pytest.approx(threshold + RESTART_SECONDS + 600.0)
    done_before = threshold - RESTART_SECONDS
    resumed = threshold + 660.0  # the first round after the short job ended
    assert by_name["long"].finished == pytest.approx(
        resumed + RESTART_SECONDS + 20 * 3600.0 - done_before
    )
    assert by_name["long"].resizes == 1, "one restart after its preemption"


def test_an_unknown_baseline_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="baseline 'pollux'"):
        run_baseline("pollux", [model("a", 1, 1.0)], 1)
