"""Reading a goodput curve past a dip (`policies/concave.py`): hand-made curves with a node's
edge in them, and the majorant's properties on any curve."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.policies.concave import (
    concave_majorant,
    hull_vertices,
    majorant_knee,
    running_max,
)

# Goodput at 4..8 GPUs on 4-GPU nodes (in share of one GPU's): the 5th GPU brings the sync
# across nodes and costs more than it adds; 8 beat 4 by 0.45 per GPU on average.
EDGE = (3.6, 3.2, 4.0, 4.6, 5.4)


def test_the_running_max_counts_the_gpus_past_a_dip_from_the_best_before_it() -> None:
    assert running_max(EDGE) == (3.6, 3.6, 4.0, 4.6, 5.4)
    assert running_max([]) == ()


def test_the_majorant_spreads_the_gain_across_a_node_edge_over_its_gpus() -> None:
    assert hull_vertices(EDGE) == (0, 4)
    assert concave_majorant(EDGE) == pytest.approx((3.6, 4.05, 4.5, 4.95, 5.4))
    # The knee past the dip: each GPU of 5..8 adds 0.45 on average.
    assert majorant_knee(EDGE, 0.45) == 4
    assert majorant_knee(running_max(EDGE), 0.45) == 4
    # A GPU-by-GPU walk would stop at the edge, 4 GPUs: the 5th adds nothing.
    assert majorant_knee(EDGE, 0.46) == 0
    # Past the hull's vertex at 8 the knee never stops inside the chord.
    assert majorant_knee((*EDGE, 5.6), 0.45) == 4


def test_a_concave_curve_is_its_own_majorant_and_its_knee_is_the_gpu_by_gpu_one() -> None:
    curve = (1.0, 1.9, 2.7, 3.4, 4.0, 4.5)
    assert concave_majorant(curve) == pytest.approx(curve)
    assert majorant_knee(curve, 0.6) == 4  # the 5th step adds 0.5
    assert majorant_knee(curve, 0.95) == 0
    assert majorant_knee(curve, 0.1) == 5
    assert majorant_knee((2.0,), 0.5) == 0 and concave_majorant([]) == ()


CURVES = st.lists(st.floats(0.0, 100.0), min_size=1, max_size=12)


@given(CURVES, st.floats(0.01, 1.0))
@settings(max_examples=300, deadline=None)
def test_the_majorant_is_concave_above_the_curve_and_its_knee_on_it(
    values: list[float], min_gain: float
) -> None:
    hull = concave_majorant(values)
    assert len(hull) == len(values)
    tol = 1e-9 * (1.0 + max(values))
    assert all(h >= v - tol for h, v in zip(hull, values, strict=True))
    gains = [after - before for before, after in itertools.pairwise(hull)]
    assert all(later <= earlier + tol for earlier, later in itertools.pairwise(gains))
    vertices = hull_vertices(values)
    assert vertices[0] == 0 and vertices[-1] == len(values) - 1
    assert all(hull[i] == values[i] for i in vertices)
    knee = majorant_knee(values, min_gain)
    assert knee in vertices
    # Each size past the knee gains less than min_gain per GPU on average from it.
    assert all(
        values[n] - values[knee] < min_gain * (n - knee) + tol for n in range(knee + 1, len(values))
    )


@given(st.lists(st.floats(0.0, 1.0), max_size=10), st.floats(0.01, 1.0))
@settings(max_examples=300, deadline=None)
def test_on_gains_that_do_not_rise_the_knee_is_the_gpu_by_gpu_one(
    gains: list[float], min_gain: float
) -> None:
    gains.sort(reverse=True)
    values = [1.0]
    for gain in gains:
        values.append(values[-1] + gain)
    walked = 0
    while walked < len(gains) and gains[walked] >= min_gain:
        walked += 1
    assert majorant_knee(values, min_gain) == walked or any(
        abs(gain - min_gain) < 1e-9 for gain in gains
    )
