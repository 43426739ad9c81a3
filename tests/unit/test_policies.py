"""The built-in adaptive policies `memory` and `schedule`, and the example plug-in policy."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.base import Decision, JobObservations, Policy, PolicyError
from herd_operator.policies.memory import MemoryPolicy
from herd_operator.policies.registry import load_policy
from herd_operator.policies.schedule import SchedulePolicy
from herd_operator.specs import HerdJob, PolicyRef
from herd_operator.specs.values import Report, UsageSample

GIB = 1 << 30
PROPERTY_SETTINGS = settings(max_examples=100, deadline=None)


def make_job(low: int = 1, high: int = 4) -> HerdJob:
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "train"},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": low, "max": high}},
        }
    )


def memory(**params: Any) -> Policy:
    policy = load_policy(PolicyRef(name="memory", params=params))
    assert isinstance(policy, MemoryPolicy)
    return policy


def schedule(**params: Any) -> Policy:
    policy = load_policy(PolicyRef(name="schedule", params=params))
    assert isinstance(policy, SchedulePolicy)
    return policy


def policy_error(name: str, params: dict[str, Any]) -> PolicyError:
    with pytest.raises(PolicyError) as caught:
        load_policy(PolicyRef(name=name, params=params))
    return caught.value


def epoch_ends(*times: float, world_size: int = 4) -> list[Report]:
    """Epochs 0, 1, ... ending at the given times."""
    return [Report(number, time, world_size) for number, time in enumerate(times)]


def samples(
    utilization: float, gpus: int, times: Sequence[float], total: int = 100 * GIB
) -> list[UsageSample]:
    return [UsageSample(time, gpus, round(utilization * total), total) for time in times]


def decide(
    policy: Policy,
    now: float,
    *,
    allocated: int,
    job: HerdJob | None = None,
    started_at: float = 0.0,
    last_resize: float | None = None,
    epochs: Sequence[Report] = (),
    usage: Sequence[UsageSample] = (),
) -> Decision:
    observed = JobObservations(
        started_at=started_at,
        allocated=allocated,
        last_resize=last_resize,
        epochs=tuple(epochs),
        usage=tuple(usage),
    )
    return policy.desired(job or make_job(1, 4), observed, now)


# --- memory: decisions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "low", "high", "gpus", "reason"),
    [
        ({}, 1, 4, 4, "memory: starting at 4"),
        ({"initial": "min"}, 2, 4, 2, "memory: starting at 2"),
        ({"initial": 3}, 1, 4, 3, "memory: starting at 3"),
        ({"initial": 8}, 1, 4, 4, "memory: starting at 4 (8 asked, at max)"),
        ({"initial": 1}, 2, 4, 2, "memory: starting at 2 (1 asked, at min)"),
    ],
)
def test_memory_asks_for_initial_before_it_holds_gpus(
    params: dict[str, Any], low: int, high: int, gpus: int, reason: str
) -> None:
    # Usage and a recent resize must not matter while nothing is allocated.
    decision = decide(
        memory(**params),
        100.0,
        allocated=0,
        job=make_job(low, high),
        last_resize=99.0,
        epochs=epoch_ends(50, 90),
        usage=samples(0.01, 4, [60, 70, 80]),
    )
    assert decision == Decision(gpus, reason)


@pytest.mark.parametrize(
    ("now", "reason"),
    [
        (110.0, "memory: cooldown, 20s left"),
        (110.5, "memory: cooldown, 20s left"),
        (129.9, "memory: cooldown, 1s left"),
    ],
)
def test_memory_holds_during_the_cooldown_after_a_resize(now: float, reason: str) -> None:
    # A full epoch of very low usage after the resize would shrink the job without cooldown.
    decision = decide(
        memory(),
        now,
        allocated=3,
        last_resize=100.0,
        epochs=epoch_ends(100, 105),
        usage=samples(0.01, 3, [101, 102, 103, 104]),
    )
    assert decision == Decision(3, reason)


def test_memory_cooldown_ends_exactly_after_cooldown_seconds() -> None:
    decision = decide(
        memory(cooldownSeconds=30),
        130.0,
        allocated=3,
        last_resize=100.0,
        epochs=epoch_ends(100, 105),
        usage=samples(0.01, 3, [101, 102, 103, 104]),
    )
    assert decision == Decision(2, "memory 0.01 < 0.25 over epoch 1: 3 -> 2")


@pytest.mark.parametrize(
    ("utilization", "allocated", "low", "high", "params", "gpus", "reason"),
    [
        (0.18, 4, 1, 4, {}, 3, "memory 0.18 < 0.25 over epoch 1: 4 -> 3"),
        (0.91, 2, 1, 4, {}, 3, "memory 0.91 > 0.75 over epoch 1: 2 -> 3"),
        (0.40, 2, 1, 4, {}, 2, "memory 0.40 within [0.25, 0.75] over epoch 1: holding 2"),
        (0.18, 1, 1, 4, {}, 1, "memory 0.18 < 0.25 over epoch 1: at min 1"),
        (0.91, 4, 1, 4, {}, 4, "memory 0.91 > 0.75 over epoch 1: at max 4"),
        (0.10, 3, 2, 8, {"step": 2}, 2, "memory 0.10 < 0.25 over epoch 1: 3 -> 2, at min"),
        (0.90, 3, 1, 4, {"step": 2}, 4, "memory 0.90 > 0.75 over epoch 1: 3 -> 4, at max"),
        (0.90, 2, 1, 8, {"step": 3}, 5, "memory 0.90 > 0.75 over epoch 1: 2 -> 5"),
        (0.40, 6, 1, 4, {}, 4, "memory 0.40 within [0.25, 0.75] over epoch 1: 6 -> 4, at max"),
        (0.25, 2, 1, 4, {}, 2, "memory 0.25 within [0.25, 0.75] over epoch 1: holding 2"),
        (0.75, 2, 1, 4, {}, 2, "memory 0.75 within [0.25, 0.75] over epoch 1: holding 2"),
        (0.2499, 2, 1, 4, {}, 1, "memory 0.2499 < 0.25 over epoch 1: 2 -> 1"),
        (0.45, 2, 1, 4, {"low": 0.5, "high": 0.9}, 1, "memory 0.45 < 0.5 over epoch 1: 2 -> 1"),
    ],
)
def test_memory_moves_by_the_last_epochs_mean_utilization(
    utilization: float,
    allocated: int,
    low: int,
    high: int,
    params: dict[str, Any],
    gpus: int,
    reason: str,
) -> None:
    decision = decide(
        memory(**params),
        100.0,
        allocated=allocated,
        job=make_job(low, high),
        epochs=epoch_ends(10, 20),
        usage=samples(utilization, allocated, [12, 14, 16, 18, 20]),
    )
    assert decision == Decision(gpus, reason)


def test_memory_averages_only_the_last_epochs_samples_at_the_current_size() -> None:
    usage = [
        *samples(0.90, 4, [5, 10]),  # epoch 0 (0, 10]: not the last epoch
        *samples(0.10, 4, [12, 16]),
        *samples(0.30, 4, [14, 18]),  # epoch 1 (10, 20]: mean 0.20
        *samples(0.99, 3, [13, 17]),  # another size: ignored
        *samples(0.90, 4, [21, 25]),  # epoch 2 is still running
    ]
    decision = decide(memory(), 25.0, allocated=4, epochs=epoch_ends(10, 20), usage=usage)
    assert decision == Decision(3, "memory 0.20 < 0.25 over epoch 1: 4 -> 3")


def test_memory_first_epoch_spans_from_the_start_of_the_run() -> None:
    usage = [*samples(0.10, 2, [99]), *samples(0.90, 2, [101, 105, 110])]
    decision = decide(
        memory(), 111.0, allocated=2, started_at=100.0, epochs=epoch_ends(110), usage=usage
    )
    assert decision == Decision(3, "memory 0.90 > 0.75 over epoch 0: 2 -> 3")


@pytest.mark.parametrize(
    "usage",
    [
        [],
        samples(0.01, 4, [5, 21]),  # only outside epoch 1 (10..20)
        samples(0.01, 2, [12, 15]),  # only at another size
    ],
    ids=["none", "outside-window", "other-size"],
)
def test_memory_holds_without_samples_in_the_window(usage: list[UsageSample]) -> None:
    decision = decide(memory(), 30.0, allocated=4, epochs=epoch_ends(10, 20), usage=usage)
    assert decision == Decision(4, "memory: no samples over epoch 1 (holding)")


@pytest.mark.parametrize(
    ("params", "last_resize", "ends", "reason"),
    [
        ({}, 15.0, (10, 20), "memory: waiting for a full epoch since the resize"),
        ({}, 25.0, (10, 20), "memory: waiting for a full epoch since the resize"),
        (
            {"cooldownEpochs": 2},
            15.0,
            (10, 20, 30),
            "memory: waiting for 2 full epochs since the resize (1 so far)",
        ),
        (
            {"cooldownEpochs": 2},
            None,
            (10,),
            "memory: waiting for 2 full epochs since the start (1 so far)",
        ),
    ],
)
def test_memory_waits_for_full_epochs_after_a_resize(
    params: dict[str, Any], last_resize: float | None, ends: tuple[float, ...], reason: str
) -> None:
    usage = samples(0.01, 4, [t + 0.5 for t in range(0, 40)])
    decision = decide(
        memory(cooldownSeconds=0, **params),
        40.0,
        allocated=4,
        last_resize=last_resize,
        epochs=epoch_ends(*ends),
        usage=usage,
    )
    assert decision == Decision(4, reason)


@pytest.mark.parametrize(
    ("params", "last_resize", "ends", "label"),
    [
        ({}, 15.0, (10, 20, 30), "epoch 2"),  # epoch 2 (20..30) began after the resize
        ({}, 20.0, (10, 20, 30), "epoch 2"),  # a window starting at the resize counts
        ({"cooldownEpochs": 0}, 15.0, (10, 20), "epoch 1"),  # the interrupted epoch counts
        ({"cooldownEpochs": 2}, 15.0, (10, 20, 30, 40), "epoch 3"),
    ],
)
def test_memory_reads_the_last_epoch_once_enough_ran_since_the_resize(
    params: dict[str, Any], last_resize: float, ends: tuple[float, ...], label: str
) -> None:
    usage = samples(0.01, 4, [t + 0.5 for t in range(0, 40)])
    decision = decide(
        memory(cooldownSeconds=0, **params),
        45.0,
        allocated=4,
        last_resize=last_resize,
        epochs=epoch_ends(*ends),
        usage=usage,
    )
    assert decision == Decision(3, f"memory 0.01 < 0.25 over {label}: 4 -> 3")


@pytest.mark.parametrize("shift", [0.0, -15.0], ids=["resize-at-15", "resize-at-0"])
def test_memory_ignores_samples_from_before_the_resize_in_an_interrupted_epoch(
    shift: float,
) -> None:
    # Back at 4 GPUs since t=15 (after a stint at 3); epoch 1 began at 4 GPUs before that.
    usage = [
        *samples(0.01, 4, [11 + shift, 13 + shift, 15 + shift]),
        *samples(0.50, 4, [16 + shift, 18 + shift, 20 + shift]),
    ]
    decision = decide(
        memory(cooldownEpochs=0, cooldownSeconds=0),
        21.0 + shift,
        allocated=4,
        started_at=shift,
        last_resize=15.0 + shift,
        epochs=epoch_ends(10 + shift, 20 + shift),
        usage=usage,
    )
    assert decision == Decision(4, "memory 0.50 within [0.25, 0.75] over epoch 1: holding 4")


@pytest.mark.parametrize(
    ("now", "last_resize", "params", "decision"),
    [
        (100.0, None, {}, Decision(1, "memory 0.20 < 0.25 over the last 60s: 2 -> 1")),
        (50.0, None, {}, Decision(2, "memory: waiting for a full 60s window")),
        (100.0, 50.0, {}, Decision(2, "memory: waiting for a full 60s window")),
        (110.0, 50.0, {}, Decision(1, "memory 0.20 < 0.25 over the last 60s: 2 -> 1")),
        (
            100.0,
            80.0,
            {"windowSeconds": 12.5, "cooldownSeconds": 15},
            Decision(1, "memory 0.20 < 0.25 over the last 12.5s: 2 -> 1"),
        ),
    ],
)
def test_memory_uses_a_time_window_when_the_job_reports_no_epochs(
    now: float, last_resize: float | None, params: dict[str, Any], decision: Decision
) -> None:
    # 0.9 before t=35 falls outside every window that counts here.
    usage = [*samples(0.9, 2, range(0, 35)), *samples(0.2, 2, range(35, 120))]
    observed = decide(memory(**params), now, allocated=2, last_resize=last_resize, usage=usage)
    assert observed == decision


def test_memory_holds_without_samples_in_a_time_window() -> None:
    decision = decide(memory(), 100.0, allocated=2, usage=samples(0.01, 2, [10, 39.9]))
    assert decision == Decision(2, "memory: no samples over the last 60s (holding)")


@pytest.mark.parametrize(
    "reason",
    ["cooldown", "waiting", "no-samples"],
)
def test_memory_holds_bring_an_out_of_range_count_back_into_min_max(reason: str) -> None:
    # The spec's max dropped from 8 to 4 while the job held 6 GPUs.
    expected = {
        "cooldown": "memory: cooldown, 20s left: 6 -> 4, at max",
        "waiting": "memory: waiting for a full epoch since the resize: 6 -> 4, at max",
        "no-samples": "memory: no samples over epoch 1 (holding): 6 -> 4, at max",
    }[reason]
    now = {"cooldown": 110.0, "waiting": 200.0, "no-samples": 30.0}[reason]
    last_resize = {"cooldown": 100.0, "waiting": 150.0, "no-samples": None}[reason]
    decision = decide(
        memory(), now, allocated=6, last_resize=last_resize, epochs=epoch_ends(10, 20)
    )
    assert decision == Decision(4, expected)


# --- memory: hysteresis -------------------------------------------------------------------


def simulate(
    policy: Policy,
    job: HerdJob,
    utilization: Callable[[int, int], float],
    epochs: int = 12,
    epoch_seconds: int = 10,
) -> list[tuple[int, int]]:
    """Run a fake job for `epochs`, reconciling every 3 s; return the (time, gpus) resizes.

    `utilization(epoch, gpus)` is the job's memory utilization during that epoch at that size.
    """
    started_at = 0
    allocated = policy.desired(job, JobObservations(started_at=0, allocated=0), 0).gpus
    last_resize: int | None = None
    ends: list[Report] = []
    usage: list[UsageSample] = []
    resizes: list[tuple[int, int]] = []
    for now in range(1, epochs * epoch_seconds + 1):
        epoch = (now - 1) // epoch_seconds
        used = round(utilization(epoch, allocated) * allocated * 80 * GIB)
        usage.append(UsageSample(now, allocated, used, allocated * 80 * GIB))
        if now % epoch_seconds == 0:
            ends.append(Report(epoch, now, allocated))
        if now % 3 == 0:
            observed = JobObservations(started_at, allocated, allocated, last_resize, ends, usage)
            wanted = policy.desired(job, observed, now).gpus
            if wanted != allocated:
                allocated, last_resize = wanted, now
                resizes.append((now, wanted))
    return resizes


def test_memory_shrinks_a_job_using_fixed_memory_once_and_settles() -> None:
    # 60 GiB of model and activations spread over however many 80 GiB GPUs it gets.
    def fixed_60_gib(epoch: int, gpus: int) -> float:
        return 60 / (80 * gpus)

    resizes = simulate(memory(cooldownSeconds=5), make_job(1, 8), fixed_60_gib)
    # 8 GPUs: 0.09, 7: 0.11, 6: 0.125, 5: 0.15, 4: 0.19, 3: 0.25 (not below low): stop.
    assert [gpus for _, gpus in resizes] == [7, 6, 5, 4, 3]
    # Each resize waited for a full epoch at the new size: the interrupted one does not count.
    assert [time for time, _ in resizes] == [12, 30, 42, 60, 72]


@given(used_gib=st.floats(1, 640), initial=st.sampled_from(["max", "min", 4]))
@PROPERTY_SETTINGS
def test_memory_never_reverses_on_a_job_using_fixed_memory(used_gib: float, initial: Any) -> None:
    # high = 3 * low: one GPU more or less changes utilization by at most 2x, so a job whose
    # total memory use is fixed moves in one direction only.
    def fixed(epoch: int, gpus: int) -> float:
        return min(1.0, used_gib / (80 * gpus))

    resizes = simulate(memory(initial=initial, cooldownSeconds=5), make_job(1, 8), fixed)
    sizes = [gpus for _, gpus in resizes]
    assert sizes in (sorted(sizes), sorted(sizes, reverse=True))


@pytest.mark.parametrize(
    "utilization",
    [0.25, 0.75, 0.2500001, 0.7499999],
    ids=["at-low", "at-high", "just-above-low", "just-below-high"],
)
def test_memory_does_not_flap_at_a_threshold(utilization: float) -> None:
    resizes = simulate(memory(), make_job(1, 8), lambda epoch, gpus: utilization)
    assert resizes == []


def test_memory_does_not_flap_on_a_signal_oscillating_inside_the_band() -> None:
    def oscillating(epoch: int, gpus: int) -> float:
        return 0.3 if epoch % 2 else 0.7

    assert simulate(memory(), make_job(1, 8), oscillating) == []


@given(
    signals=st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
    cooldown_epochs=st.integers(0, 3),
    cooldown_seconds=st.integers(0, 25),
)
@PROPERTY_SETTINGS
def test_memory_resizes_are_spaced_by_both_cooldowns(
    signals: list[float], cooldown_epochs: int, cooldown_seconds: int
) -> None:
    policy = memory(cooldownEpochs=cooldown_epochs, cooldownSeconds=cooldown_seconds)
    resizes = simulate(policy, make_job(1, 8), lambda epoch, gpus: signals[epoch])
    times = [time for time, _ in resizes]
    for before, after in itertools.pairwise(times):
        assert after - before >= cooldown_seconds
        # Epochs end every 10 s: a new signal needs an epoch end in between, and
        # `cooldown_epochs` whole epochs when that is asked for.
        assert after // 10 > before // 10
        full_epochs_between = (after // 10) - -(-before // 10)
        assert full_epochs_between >= cooldown_epochs


# --- memory: params ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({"low": 0}, "spec.policy.params.low", "must be greater than 0, got integer 0"),
        ({"high": 1.5}, "spec.policy.params.high", "Input should be less than or equal to 1"),
        ({"low": "0.2"}, "spec.policy.params.low", "expected a number, got string '0.2'"),
        ({"low": 0.8, "high": 0.5}, "spec.policy.params", "low (0.8) must be below high (0.5)"),
        ({"low": 0.5, "high": 0.5}, "spec.policy.params", "low (0.5) must be below high (0.5)"),
        ({"high": 0.2}, "spec.policy.params", "low (0.25) must be below high (0.2)"),
        ({"step": 0}, "spec.policy.params.step", "must be at least 1, got integer 0"),
        (
            {"cooldownEpochs": -1},
            "spec.policy.params.cooldownEpochs",
            "must be at least 0, got integer -1",
        ),
        (
            {"cooldownSeconds": -0.5},
            "spec.policy.params.cooldownSeconds",
            "must be at least 0, got number -0.5",
        ),
        (
            {"cooldownSeconds": float("inf")},
            "spec.policy.params.cooldownSeconds",
            "Input should be a finite number",
        ),
        (
            {"windowSeconds": 0},
            "spec.policy.params.windowSeconds",
            "must be greater than 0, got integer 0",
        ),
        (
            {"initial": "maximum"},
            "spec.policy.params.initial",
            "must be 'max', 'min' or a GPU count of at least 1, got 'maximum'",
        ),
        (
            {"initial": 0},
            "spec.policy.params.initial",
            "must be 'max', 'min' or a GPU count of at least 1, got 0",
        ),
        (
            {"initial": True},
            "spec.policy.params.initial",
            "must be 'max', 'min' or a GPU count of at least 1, got True",
        ),
        (
            {"lowWater": 0.1},
            "spec.policy.params.lowWater",
            "unknown field (allowed: low, high, step, cooldownEpochs, cooldownSeconds,"
            " windowSeconds, initial)",
        ),
    ],
)
def test_memory_rejects_bad_params_naming_them(
    params: dict[str, Any], field: str, message: str
) -> None:
    error = policy_error("memory", params)
    assert (error.field, error.message) == (field, message)


def test_memory_params_take_camel_case_and_snake_case_names() -> None:
    by_alias = memory(cooldownSeconds=5, windowSeconds=10, cooldownEpochs=0)
    by_name = memory(cooldown_seconds=5, window_seconds=10, cooldown_epochs=0)
    assert isinstance(by_alias, MemoryPolicy) and isinstance(by_name, MemoryPolicy)
    assert by_alias.params == by_name.params
    assert (by_alias.params.cooldown_seconds, by_alias.params.window_seconds) == (5.0, 10.0)


# --- schedule ----------------------------------------------------------------------------

ISSUE_EXAMPLE = {"initial": 2, "steps": [{"atEpoch": 3, "gpus": 4}, {"atEpoch": 6, "gpus": 2}]}


@pytest.mark.parametrize(
    ("reported", "decision"),
    [
        (0, Decision(2, "schedule: initial 2 GPUs")),
        (2, Decision(2, "schedule: initial 2 GPUs")),  # epochs 0 and 1 ended
        (3, Decision(4, "schedule: 4 GPUs from epoch 3")),  # epoch 2 ended: epoch 3 runs
        (5, Decision(4, "schedule: 4 GPUs from epoch 3")),
        (6, Decision(2, "schedule: 2 GPUs from epoch 6")),
        (9, Decision(2, "schedule: 2 GPUs from epoch 6")),
    ],
)
def test_schedule_reproduces_the_issue_example(reported: int, decision: Decision) -> None:
    ends = epoch_ends(*(10 * (n + 1) for n in range(reported)))
    observed = decide(
        schedule(**ISSUE_EXAMPLE), 1000.0, allocated=2, job=make_job(1, 8), epochs=ends
    )
    assert observed == decision


@pytest.mark.parametrize(
    ("params", "now", "ends", "decision"),
    [
        ({"steps": [{"atEpoch": 5, "gpus": 3}]}, 0.0, (), Decision(1, "schedule: initial 1 GPU")),
        (
            {"steps": [{"atEpoch": 0, "gpus": 3}]},
            0.0,
            (),
            Decision(3, "schedule: 3 GPUs from epoch 0"),
        ),
        (
            {"steps": [{"afterSeconds": 120, "gpus": 2}]},
            119.9,
            (),
            Decision(1, "schedule: initial 1 GPU"),
        ),
        (
            {"steps": [{"afterSeconds": 120, "gpus": 2}]},
            120.0,
            (),
            Decision(2, "schedule: 2 GPUs after 120s"),
        ),
        (
            {"steps": [{"afterSeconds": 1.5, "gpus": 2}]},
            2.0,
            (),
            Decision(2, "schedule: 2 GPUs after 1.5s"),
        ),
        # The epoch step triggered at t=50, the time step at t=100: the later one wins.
        (
            {"steps": [{"afterSeconds": 100, "gpus": 2}, {"atEpoch": 2, "gpus": 3}]},
            150.0,
            (30, 50),
            Decision(2, "schedule: 2 GPUs after 100s"),
        ),
        # Epoch 1 ends (epoch 2 begins) at t=130, after the time step's t=100.
        (
            {"steps": [{"afterSeconds": 100, "gpus": 2}, {"atEpoch": 2, "gpus": 3}]},
            150.0,
            (60, 130),
            Decision(3, "schedule: 3 GPUs from epoch 2"),
        ),
        # Both trigger at the start: the later one in the list wins.
        (
            {"steps": [{"atEpoch": 0, "gpus": 3}, {"afterSeconds": 0, "gpus": 2}]},
            0.0,
            (),
            Decision(2, "schedule: 2 GPUs after 0s"),
        ),
        (
            {"steps": [{"afterSeconds": 0, "gpus": 2}, {"atEpoch": 0, "gpus": 3}]},
            0.0,
            (),
            Decision(3, "schedule: 3 GPUs from epoch 0"),
        ),
        (
            {"steps": [{"atEpoch": 1, "gpus": 8}]},
            20.0,
            (10,),
            Decision(4, "schedule: 8 GPUs from epoch 1, at max 4"),
        ),
        (
            {"initial": 9, "steps": [{"atEpoch": 1, "gpus": 2}]},
            0.0,
            (),
            Decision(4, "schedule: initial 9 GPUs, at max 4"),
        ),
    ],
)
def test_schedule_asks_for_the_step_that_applied_last(
    params: dict[str, Any], now: float, ends: tuple[float, ...], decision: Decision
) -> None:
    assert decide(schedule(**params), now, allocated=1, epochs=epoch_ends(*ends)) == decision


def test_schedule_clamps_the_initial_default_and_steps_into_min() -> None:
    policy = schedule(initial=1, steps=[{"afterSeconds": 10, "gpus": 1}])
    job = make_job(2, 4)
    assert decide(policy, 0.0, allocated=2, job=job) == Decision(
        2, "schedule: initial 1 GPU, at min 2"
    )
    assert decide(policy, 10.0, allocated=2, job=job) == Decision(
        2, "schedule: 1 GPU after 10s, at min 2"
    )


def test_schedule_counts_time_from_the_start_of_the_run() -> None:
    policy = schedule(steps=[{"afterSeconds": 60, "gpus": 3}])
    assert decide(policy, 1059.0, allocated=1, started_at=1000.0).gpus == 1
    assert decide(policy, 1060.0, allocated=1, started_at=1000.0).gpus == 3


@pytest.mark.parametrize(
    ("params", "field", "message"),
    [
        ({}, "spec.policy.params.steps", "required"),
        (
            {"steps": []},
            "spec.policy.params.steps",
            "must not be empty",
        ),
        (
            {"steps": [{"gpus": 2}]},
            "spec.policy.params.steps[0]",
            "a step needs exactly one of atEpoch or afterSeconds, got neither",
        ),
        (
            {"steps": [{"atEpoch": 1, "gpus": 2}, {"atEpoch": 2, "afterSeconds": 5, "gpus": 2}]},
            "spec.policy.params.steps[1]",
            "a step needs exactly one of atEpoch or afterSeconds, got both",
        ),
        (
            {"steps": [{"atEpoch": 1}]},
            "spec.policy.params.steps[0].gpus",
            "required",
        ),
        (
            {"steps": [{"atEpoch": 1, "gpus": 0}]},
            "spec.policy.params.steps[0].gpus",
            "must be at least 1, got integer 0",
        ),
        (
            {"steps": [{"atEpoch": -1, "gpus": 1}]},
            "spec.policy.params.steps[0].atEpoch",
            "must be at least 0, got integer -1",
        ),
        (
            {"steps": [{"atEpoch": "3", "gpus": 1}]},
            "spec.policy.params.steps[0].atEpoch",
            "expected an integer, got string '3'",
        ),
        (
            {"steps": [{"afterSeconds": float("nan"), "gpus": 1}]},
            "spec.policy.params.steps[0].afterSeconds",
            "Input should be a finite number",
        ),
        (
            {"steps": [{"epoch": 3, "gpus": 1}]},
            "spec.policy.params.steps[0].epoch",
            "unknown field (allowed: atEpoch, afterSeconds, gpus)",
        ),
        (
            {"initial": 0, "steps": [{"atEpoch": 3, "gpus": 1}]},
            "spec.policy.params.initial",
            "must be at least 1, got integer 0",
        ),
        (
            {
                "steps": [
                    {"atEpoch": 5, "gpus": 2},
                    {"afterSeconds": 10, "gpus": 3},
                    {"atEpoch": 3, "gpus": 4},
                ]
            },
            "spec.policy.params.steps",
            "steps[2]: atEpoch 3 must be greater than the 5 of steps[0] "
            "(steps of one kind must be strictly increasing)",
        ),
        (
            {"steps": [{"afterSeconds": 60, "gpus": 2}, {"afterSeconds": 60, "gpus": 3}]},
            "spec.policy.params.steps",
            "steps[1]: afterSeconds 60 must be greater than the 60 of steps[0] "
            "(steps of one kind must be strictly increasing)",
        ),
    ],
)
def test_schedule_rejects_bad_params_naming_them(
    params: dict[str, Any], field: str, message: str
) -> None:
    error = policy_error("schedule", params)
    assert (error.field, error.message) == (field, message)


def test_schedule_steps_of_different_kinds_need_no_common_order() -> None:
    policy = schedule(
        steps=[
            {"afterSeconds": 300, "gpus": 2},
            {"atEpoch": 1, "gpus": 3},
            {"afterSeconds": 400, "gpus": 4},
        ]
    )
    assert isinstance(policy, SchedulePolicy)
    assert [step.gpus for step in policy.params.steps] == [2, 3, 4]


# --- properties of both ------------------------------------------------------------------


@st.composite
def jobs(draw: st.DrawFn) -> HerdJob:
    low = draw(st.integers(1, 6))
    return make_job(low, draw(st.integers(low, 8)))


@st.composite
def observations(draw: st.DrawFn) -> tuple[JobObservations, float]:
    """A run started at 0 with epochs, usage and perhaps a resize, and a time to decide at."""
    epoch_times = sorted(draw(st.lists(st.integers(1, 200), max_size=8, unique=True)))
    sample_times = draw(st.lists(st.integers(0, 200), max_size=30))
    allocated = draw(st.integers(0, 10))
    usage = tuple(
        UsageSample(
            time,
            draw(st.sampled_from([allocated, allocated + 1])),
            draw(st.integers(0, 100)),
            draw(st.sampled_from([0, 100])),
        )
        for time in sorted(sample_times)
    )
    observed = JobObservations(
        started_at=0.0,
        allocated=allocated,
        last_resize=draw(st.none() | st.floats(0, 200)),
        epochs=tuple(Report(n, time, allocated) for n, time in enumerate(epoch_times)),
        usage=usage,
    )
    now = max([200.0, *(float(t) for t in epoch_times)]) + draw(st.floats(0, 100))
    return observed, now


memory_params = st.fixed_dictionaries(
    {},
    optional={
        "low": st.sampled_from([0.1, 0.25]),
        "high": st.sampled_from([0.5, 0.75, 1.0]),
        "step": st.integers(1, 3),
        "cooldownEpochs": st.integers(0, 3),
        "cooldownSeconds": st.integers(0, 120),
        "windowSeconds": st.integers(1, 300),
        "initial": st.sampled_from(["max", "min", 1, 5, 12]),
    },
)
schedule_params = st.fixed_dictionaries(
    {
        "steps": st.lists(
            st.tuples(st.booleans(), st.integers(0, 250), st.integers(1, 12)),
            min_size=1,
            max_size=5,
            unique_by=lambda step: (step[0], step[1]),
        ).map(
            lambda steps: [
                {"atEpoch" if by_epoch else "afterSeconds": point, "gpus": gpus}
                for by_epoch, point, gpus in sorted(steps)
            ]
        )
    },
    optional={"initial": st.integers(1, 12)},
)
any_policy = st.one_of(
    memory_params.map(lambda p: memory(**p)), schedule_params.map(lambda p: schedule(**p))
)


@given(policy=any_policy, job=jobs(), situation=observations())
@PROPERTY_SETTINGS
def test_every_decision_is_within_min_max_and_deterministic(
    policy: Policy, job: HerdJob, situation: tuple[JobObservations, float]
) -> None:
    observed, now = situation
    decision = policy.desired(job, observed, now)
    assert job.spec.gpus.min <= decision.gpus <= job.spec.gpus.max
    assert decision.reason
    assert policy.desired(job, observed, now) == decision


@given(params=memory_params, job=jobs(), situation=observations(), into_cooldown=st.floats(0, 1))
@PROPERTY_SETTINGS
def test_memory_never_changes_the_count_during_a_cooldown(
    params: dict[str, Any],
    job: HerdJob,
    situation: tuple[JobObservations, float],
    into_cooldown: float,
) -> None:
    observed, now = situation
    seconds = max(float(params.get("cooldownSeconds", 30)), 1.0)
    allocated = min(max(observed.allocated, job.spec.gpus.min), job.spec.gpus.max)
    resized = JobObservations(
        started_at=observed.started_at,
        allocated=allocated,
        last_resize=now - seconds * into_cooldown * 0.999,
        epochs=observed.epochs,
        usage=observed.usage,
    )
    decision = memory(**{**params, "cooldownSeconds": seconds}).desired(job, resized, now)
    assert decision.gpus == allocated
    assert decision.reason.startswith("memory: cooldown, ")


@given(
    params=memory_params,
    job=jobs(),
    situation=observations(),
    window=st.sampled_from(["no-samples", "partial-epoch", "partial-time"]),
)
@PROPERTY_SETTINGS
def test_memory_never_moves_on_an_empty_or_partial_window(
    params: dict[str, Any],
    job: HerdJob,
    situation: tuple[JobObservations, float],
    window: str,
) -> None:
    observed, now = situation
    allocated = min(max(observed.allocated, job.spec.gpus.min), job.spec.gpus.max)
    policy = memory(**{**params, "cooldownSeconds": 0})
    epochs = observed.epochs or (Report(0, 10.0, allocated),)
    if window == "no-samples":
        changed = JobObservations(observed.started_at, allocated, epochs=epochs)
    elif window == "partial-epoch":
        # The resize came after the last epoch began: no full epoch since.
        last_start = epochs[-2].time if len(epochs) > 1 else observed.started_at
        changed = JobObservations(
            observed.started_at,
            allocated,
            last_resize=last_start + 0.5,
            epochs=epochs,
            usage=observed.usage,
        )
        policy = memory(**{**params, "cooldownSeconds": 0, "cooldownEpochs": 1})
    else:
        seconds = float(params.get("windowSeconds", 60))
        changed = JobObservations(
            observed.started_at, allocated, last_resize=now - seconds / 2, usage=observed.usage
        )
    decision = policy.desired(job, changed, now)
    assert decision.gpus == allocated
    assert decision.reason.startswith(("memory: no samples", "memory: waiting"))


# --- the example plug-in -----------------------------------------------------------------


def test_example_plugin_loads_by_its_entry_point_and_grows_on_a_plateau(
    example_plugin_installed: Path,
) -> None:
    policy = load_policy(PolicyRef(name="loss-plateau", params={"patience": 2}))
    losses = [1.0, 0.5, 0.499, 0.498]
    ends = [Report(n, 10.0 * (n + 1), 2, {"loss": loss}) for n, loss in enumerate(losses)]
    plateau = JobObservations(started_at=0.0, allocated=2, epochs=ends)
    assert policy.desired(make_job(1, 4), plateau, 50.0) == Decision(
        3, "loss plateau: loss improved by only 0.002 over 2 epochs: 2 -> 3"
    )
    improving = JobObservations(started_at=0.0, allocated=2, epochs=ends[:3])
    assert policy.desired(make_job(1, 4), improving, 50.0) == Decision(
        2, "loss plateau: loss improved by 0.501 over 2 epochs (holding 2)"
    )
