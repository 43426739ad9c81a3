"""The statistical-efficiency model of `policies/efficiency.py`."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.policies.efficiency import statistical_efficiency


def test_the_base_batch_is_fully_efficient() -> None:
    assert statistical_efficiency(1000.0, 64, 64) == 1.0


def test_a_batch_far_above_the_noise_scale_wastes_most_samples() -> None:
    # noise 100, base 100, batch 10,000: (100 + 100) / (100 + 10,000) ~ 0.0198
    assert statistical_efficiency(100.0, 10_000, 100) == pytest.approx(200 / 10_100)


@given(
    noise=st.floats(min_value=0, max_value=1e7),
    base=st.integers(min_value=1, max_value=10_000),
    extra=st.integers(min_value=0, max_value=10_000),
)
def test_efficiency_never_rises_with_the_batch(noise: float, base: int, extra: int) -> None:
    at_base = statistical_efficiency(noise, base, base)
    above = statistical_efficiency(noise, base + extra, base)
    assert above <= at_base + 1e-12
    assert above > 0


@pytest.mark.parametrize(("noise", "batch"), [(-1.0, 8), (float("nan"), 8), (1.0, 0)])
def test_bad_inputs_are_refused(noise: float, batch: int) -> None:
    with pytest.raises(ValueError, match="must be"):
        statistical_efficiency(noise, batch, 8)
