"""The stretched eviction age of the unauthenticated pool, with plain numbers: no sockets,
no clock."""

from __future__ import annotations

import pytest

from herd_operator import rpc
from herd_operator.rpc import stretched_eviction_age

BASE, CEILING = 1.0, 5.0


@pytest.mark.parametrize(
    ("answer_times", "stretch", "expected"),
    [
        ([], 2.0, BASE),  # nothing authenticated yet: the fixed age
        ([0.002] * 64, 2.0, BASE),  # workers answer in milliseconds: the fixed age
        ([0.4] * 10, 2.0, BASE),  # 0.8 s is still below the base
        ([0.5] * 10, 2.0, BASE),  # exactly the base
        ([0.75] * 10, 2.0, 1.5),  # a slow burst: twice its slow end
        ([1.2] * 10, 3.0, 3.6),  # the factor is the caller's
        ([2.0] * 10, 2.0, 4.0),
        ([3.0] * 10, 2.0, CEILING),  # never past the handshake deadline
        ([60.0], 2.0, CEILING),
        ([3.0] * 10, 0.0, BASE),  # stretch 0: fixed
        # The 90th percentile of 10 is the slowest; of 20, one straggler is left out.
        ([0.01] * 9 + [2.0], 2.0, 4.0),
        ([0.01] * 19 + [2.0], 2.0, BASE),
        ([0.01] * 18 + [2.0] * 2, 2.0, 4.0),
        # Order does not matter.
        ([2.0] + [0.01] * 9, 2.0, 4.0),
    ],
)
def test_the_eviction_age_is_the_clamped_stretch_of_the_slow_end_of_recent_answers(
    answer_times: list[float], stretch: float, expected: float
) -> None:
    age = stretched_eviction_age(answer_times, base=BASE, ceiling=CEILING, stretch=stretch)
    assert age == pytest.approx(expected)


@pytest.mark.parametrize("answer", [0.0, 0.1, 0.49, 0.5, 0.51, 1.0, 2.49, 2.5, 2.51, 10.0, 1e9])
def test_the_eviction_age_stays_within_the_base_and_the_handshake_deadline(answer: float) -> None:
    age = stretched_eviction_age([answer], base=BASE, ceiling=CEILING)
    assert BASE <= age <= CEILING
    assert age == pytest.approx(min(max(2 * answer, BASE), CEILING))


def test_a_handshake_deadline_below_the_base_leaves_the_base() -> None:
    # eviction_age above the handshake deadline: idlers leave by the deadline; never below.
    assert stretched_eviction_age([3.0], base=BASE, ceiling=0.5) == BASE
    assert stretched_eviction_age([], base=BASE, ceiling=0.5) == BASE


def test_the_quantile_is_the_callers() -> None:
    answers = [0.1 * n for n in range(1, 11)]  # 0.1 .. 1.0
    assert stretched_eviction_age(answers, base=0.01, ceiling=CEILING, quantile=0.0) == (
        pytest.approx(0.2)
    )
    assert stretched_eviction_age(answers, base=0.01, ceiling=CEILING, quantile=0.5) == (
        pytest.approx(1.2)
    )
    assert stretched_eviction_age(answers, base=0.01, ceiling=CEILING, quantile=1.0) == (
        pytest.approx(2.0)
    )


@pytest.mark.parametrize(
    ("keyword", "value", "message"),
    [
        ("quantile", 1.5, r"quantile must be in \[0, 1\], got 1.5"),
        ("quantile", -0.1, r"quantile must be in \[0, 1\], got -0.1"),
        ("stretch", -1.0, r"stretch must be >= 0, got -1.0"),
    ],
)
def test_bad_parameters_are_refused_by_name(keyword: str, value: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        stretched_eviction_age([1.0], base=BASE, ceiling=CEILING, **{keyword: value})


def test_the_window_stretches_with_slow_answers_and_comes_back_as_fast_ones_return() -> None:
    window = rpc._AnswerTimes(BASE, CEILING, 2.0)
    now = 100.0
    assert window.eviction_age(now) == BASE
    for _ in range(rpc._ANSWER_WINDOW):  # a slow burst: answers take 1.5 s
        window.add(now, 1.5)
    assert window.eviction_age(now) == pytest.approx(3.0)
    # Fast answers return: once they are more than 90% of the window, the base is back.
    fast_needed = int(rpc._ANSWER_WINDOW * rpc._ANSWER_QUANTILE) + 1
    for _ in range(fast_needed - 1):
        window.add(now, 0.003)
    assert window.eviction_age(now) == pytest.approx(3.0)
    window.add(now, 0.003)
    assert window.eviction_age(now) == BASE


def test_the_window_forgets_answers_older_than_its_horizon() -> None:
    window = rpc._AnswerTimes(BASE, CEILING, 2.0)
    window.add(100.0, 2.0)
    window.add(105.0, 1.0)
    assert window.eviction_age(105.0) == pytest.approx(4.0)
    # Nothing authenticates for a while (a flood of strangers only): the slow one expires...
    assert window.eviction_age(100.0 + rpc._ANSWER_HORIZON_S + 0.1) == pytest.approx(2.0)
    # ...and then the other.
    assert window.eviction_age(105.0 + rpc._ANSWER_HORIZON_S + 0.1) == BASE


def test_a_window_with_stretch_zero_keeps_the_base() -> None:
    window = rpc._AnswerTimes(BASE, CEILING, 0.0)
    window.add(100.0, 4.0)
    assert window.eviction_age(100.0) == BASE


@pytest.mark.parametrize("stretch", [-1.0, float("nan")])
def test_the_server_refuses_a_bad_eviction_stretch_by_name(stretch: float) -> None:
    with pytest.raises(ValueError, match=r"eviction_stretch must be >= 0 \(0 = fixed\)"):
        rpc.RpcServer(b"t" * 32, {}, eviction_stretch=stretch)
