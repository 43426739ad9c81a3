"""A measurement within an epoch on the worker's side (issue 31): an adaptive-batch job's rank 0
reports its adaptive metrics `measure_steps` full steps into each new configuration, and as
many steps later every rank takes the batch the operator picked (`batching.measure_action`,
`training._BatchSteps`). The samplers here are the torchrun engine's, as two ranks in one
process with a fake broadcast and a fake operator; no torch."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from herd_operator.agent.batching import MEASURE_RETRIES, BatchSettings, measure_action
from herd_operator.agent.training import DistributedBatches
from herd_operator.specs.values import (
    BATCH_SIZE_METRIC,
    DEFAULT_MEASURE_STEPS,
    STEP_SECONDS_METRIC,
)

EPOCH = 3200
"""Samples: 100 base steps of 32, so that no epoch ends within these tests."""


@pytest.mark.parametrize(
    ("measure_steps", "timed", "measured", "reported", "asked"),
    list(itertools.product(range(4), range(26), (False, True), (False, True), range(3))),
)
def test_measure_action_reports_at_n_steps_and_refreshes_n_later_then_twice_as_late(
    measure_steps: int, timed: int, measured: bool, reported: bool, asked: int
) -> None:
    action = measure_action(measure_steps, timed, measured, reported, asked)
    if measure_steps == 0:
        assert action is None  # at epoch ends only
    elif timed == measure_steps and not measured:
        assert action == "report"
    elif timed == 2 * measure_steps * 2**asked and reported:
        assert action == "refresh"
    else:
        assert action is None


def test_measure_steps_default_and_bounds() -> None:
    assert BatchSettings("adaptive", 16, 0.1).measure_steps == DEFAULT_MEASURE_STEPS == 20
    assert BatchSettings("adaptive", 16, 0.1, measure_steps=0).measure_steps == 0
    with pytest.raises(ValueError, match="measure_steps must be >= 0, got -1"):
        BatchSettings("adaptive", 16, 0.1, measure_steps=-1)


class Rank(DistributedBatches):
    """One of two ranks: rank 0's broadcast puts its object on `channel`, rank 1's takes it
    (the ranks are driven in lock step, rank 0 first); rank 0 reports to `reports`."""

    def __init__(
        self,
        rank: int,
        settings: BatchSettings,
        channel: list[Any],
        operator: Callable[[], tuple[int, int] | None],
        reports: list[tuple[int, dict[str, float], int]],
    ) -> None:
        self.channel, self.reports, self.step_index = channel, reports, 0
        self.refreshed_at: list[int] = []
        self.asked, self.me = 0, rank

        def ask() -> tuple[int, int] | None:
            self.asked += 1
            return operator()

        super().__init__(EPOCH, settings, seed=1, ask=ask)
        self.rank = rank  # torch.distributed would have said so

    def _world(self) -> int:
        return 2

    def _from_rank0(self, value: Any) -> Any:
        self.refreshed_at.append(self.step_index)
        if self.me == 0:
            self.channel.append(value)
            return value
        return self.channel.pop(0)

    def _report_measurement(self, metrics: dict[str, float], world_size: int) -> None:
        self.reports.append((self.step_index, metrics, world_size))


class Job:
    """Two ranks and an operator that picks `picks[batch reported]` for 2 GPUs."""

    def __init__(self, settings: BatchSettings, picks: dict[float, int]) -> None:
        self.picks, self.heard = picks, 0
        self.decided: tuple[int, int] | None = None
        self.reports: list[tuple[int, dict[str, float], int]] = []
        channel: list[Any] = []
        self.ranks = [Rank(r, settings, channel, self.answer, self.reports) for r in (0, 1)]
        self.iterators = [rank.steps() for rank in self.ranks]
        self.batches: list[int] = []

    def answer(self) -> tuple[int, int] | None:
        if len(self.reports) > self.heard:  # the operator decides on a new report
            self.heard = len(self.reports)
            self.decided = (2, self.picks[self.reports[-1][1][BATCH_SIZE_METRIC]])
        return self.decided

    def run(self, steps: int) -> None:
        for _ in range(steps):
            taken = [next(iterator) for iterator in self.iterators]
            assert taken[0].count == taken[1].count
            self.batches.append(taken[0].count)
            for rank, step in zip(self.ranks, taken, strict=True):
                rank.step_index += 1
                rank.record_step(step)


def adaptive(measure_steps: int = 3, policy: str = "adaptive") -> BatchSettings:
    return BatchSettings(
        policy,  # type: ignore[arg-type]
        16, 0.1, reference_workers=2, max_batch=256, measure_steps=measure_steps,
    )  # fmt: skip


def test_a_report_n_steps_into_each_configuration_and_the_operators_batch_n_later() -> None:
    job = Job(adaptive(), {32.0: 64, 64.0: 64})
    job.run(40)
    # The first step after a start or a refresh is not timed: timed steps 1-3 are steps 2-4.
    # The report of batch 32 at step 4, the refresh (to 64) at step 7; the first step at 64
    # (8) is not timed, so the next report is at step 11 and its refresh at 14, which keeps
    # 64 (the configuration is measured): no report more, and a question again 12 timed
    # steps later (27) in case the operator had not decided yet; the next would be at 52.
    assert [(at, metrics[BATCH_SIZE_METRIC], world) for at, metrics, world in job.reports] == [
        (4, 32.0, 2),
        (11, 64.0, 2),
    ]
    assert all(STEP_SECONDS_METRIC in metrics for _, metrics, _ in job.reports)
    assert job.batches == [32] * 7 + [64] * 33
    # Every rank takes the batch at the same steps (a collective); only rank 0 asks.
    assert job.ranks[0].refreshed_at == job.ranks[1].refreshed_at == [0, 7, 14, 27]
    assert job.ranks[0].asked == 4
    assert job.ranks[1].asked == 1  # at its construction, before its rank was known


def test_an_epoch_end_that_changes_the_batch_starts_a_measurement_and_one_that_keeps_it_not(
) -> None:  # fmt: skip
    job = Job(adaptive(), {32.0: 32})
    job.run(5)  # reported at step 4 (32); the operator keeps 32
    for rank in job.ranks:
        rank.set_epoch(1)  # before the refresh at 7: the same batch, measured
    job.run(20)
    assert [at for at, _, _ in job.reports] == [4]
    assert job.ranks[0].refreshed_at == job.ranks[1].refreshed_at == [0, 5]
    # A new batch at an epoch's end is measured anew, and taken after it.
    job.picks[96.0] = 128
    job.decided = (2, 96)
    for rank in job.ranks:
        rank.set_epoch(2)
    job.run(8)
    assert [(at, m[BATCH_SIZE_METRIC]) for at, m, _ in job.reports] == [(4, 32.0), (29, 96.0)]
    assert job.ranks[1].refreshed_at == [0, 5, 25, 32]
    assert job.batches[-2:] == [96, 128]


def test_an_operator_slower_than_the_steps_is_asked_again_twice_as_late_a_few_times() -> None:
    job = Job(adaptive(), {32.0: 64, 64.0: 64})
    late = job.answer
    calls = 0

    def slow() -> tuple[int, int] | None:  # not decided at the first question after a report
        nonlocal calls
        calls += 1
        return None if calls == 1 else late()

    job.ranks[0]._ask = slow  # type: ignore[method-assign]
    job.run(30)
    # Reported at 4; asked at 7 (no answer yet: the batch stays 32), again 12 timed steps
    # later (20): 64 from step 21 on, then measured at 24 and asked at 27.
    assert [at for at, _, _ in job.reports] == [4, 24]
    assert job.ranks[0].refreshed_at == job.ranks[1].refreshed_at == [0, 7, 20, 27]
    assert job.batches == [32] * 20 + [64] * 10
    # An operator that keeps the batch is asked 1 + MEASURE_RETRIES times after a report,
    # 2, 4, 8 and 16 timed steps apart (each refresh's next step is not timed), then no more.
    kept = Job(adaptive(measure_steps=1), {32.0: 32})
    kept.run(90)
    assert kept.ranks[0].refreshed_at == [0, 3, 8, 17, 34]
    assert len(kept.ranks[0].refreshed_at) == 2 + MEASURE_RETRIES


def test_an_epoch_end_before_the_report_leaves_it_due() -> None:
    job = Job(adaptive(measure_steps=4), {32.0: 32})
    job.run(3)
    for rank in job.ranks:
        rank.set_epoch(1)
    job.run(6)  # step 4 after the epoch's end is not timed: 4 timed at step 8
    assert [at for at, _, _ in job.reports] == [8]


@pytest.mark.parametrize("settings", [adaptive(0), adaptive(3, "preserve-batch")])
def test_no_measurement_without_steps_or_the_adaptive_policy(settings: BatchSettings) -> None:
    job = Job(settings, {})
    job.run(30)
    assert job.reports == []
    expected = [0] if settings.policy == "adaptive" else []
    assert job.ranks[0].refreshed_at == job.ranks[1].refreshed_at == expected
