"""A sharing worker's GPU memory limit (issue 30): HERD_GPU_MEMORY_LIMIT_BYTES, read by the
worker API and turned into `torch.cuda.set_per_process_memory_fraction` on its device, and
into MPS's per-device limit by the shim.

No CUDA here: the CUDA side of torch is a stand-in at `torch.cuda` (what the worker API calls
of it: is_available, set_device, get_device_properties, set_per_process_memory_fraction).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from herd_operator.agent.shim import MPS_MEMORY_LIMIT_ENV, bind_environment
from herd_operator.agent.worker import (
    DeviceBinding,
    apply_memory_limit,
    bind_device,
    memory_fraction,
    memory_limit_bytes,
)
from herd_operator.environment import GPU_ENV, GPU_MEMORY_LIMIT_ENV, GPUS_ENV, VIRTUAL_ENV

GIB = 1 << 30


def test_the_fraction_is_the_limit_over_the_device_s_memory() -> None:
    assert memory_fraction(8 * GIB, 80 * GIB) == pytest.approx(0.1)
    assert memory_fraction(20 * GIB, 80 * GIB) == 0.25
    assert memory_fraction(100 * GIB, 80 * GIB) == 1.0  # more than the device: all of it
    with pytest.raises(ValueError, match="device's memory must be positive"):
        memory_fraction(GIB, 0)
    with pytest.raises(ValueError, match="memory limit must be positive"):
        memory_fraction(0, 80 * GIB)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 1 << 50), st.integers(1, 1 << 50))
def test_the_fraction_never_allows_more_than_the_limit_nor_the_device(
    limit: int, total: int
) -> None:
    fraction = memory_fraction(limit, total)
    assert 0 < fraction <= 1
    assert fraction * total <= limit * (1 + 1e-12)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", None), ("8589934592", 8 * GIB), (" 1024 ", 1024)],
)
def test_the_limit_from_the_environment(value: str | None, expected: int | None) -> None:
    environ = {} if value is None else {GPU_MEMORY_LIMIT_ENV: value}
    assert memory_limit_bytes(environ) == expected


@pytest.mark.parametrize("value", ["8Gi", "-5", "0", "1e9"])
def test_a_malformed_limit_names_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=GPU_MEMORY_LIMIT_ENV):
        memory_limit_bytes({GPU_MEMORY_LIMIT_ENV: value})


@dataclass
class FakeCuda:
    """torch.cuda on a machine with one 80 GiB GPU per ordinal, recording what is set."""

    total_bytes: int = 80 * GIB
    calls: list[tuple[str, object, int]] = field(default_factory=list)

    def is_available(self) -> bool:
        return True

    def set_device(self, ordinal: int) -> None:
        self.calls.append(("set_device", None, ordinal))

    def get_device_properties(self, ordinal: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(total_memory=self.total_bytes)

    def set_per_process_memory_fraction(self, fraction: float, ordinal: int) -> None:
        self.calls.append(("fraction", fraction, ordinal))


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake))
    return fake


def test_bind_device_caps_the_bound_device_before_the_script_allocates(
    cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        GPU_ENV: "5",
        GPUS_ENV: "3,5",
        "CUDA_VISIBLE_DEVICES": "3,5",
        VIRTUAL_ENV: "0",
        GPU_MEMORY_LIMIT_ENV: str(20 * GIB),
    }.items():
        monkeypatch.setenv(name, value)

    assert bind_device() == DeviceBinding(gpu=5, ordinal=1, virtual=False)
    assert cuda.calls == [("set_device", None, 1), ("fraction", 0.25, 1)]


def test_without_a_limit_nothing_is_capped(cuda: FakeCuda) -> None:
    assert apply_memory_limit(0, {}) is None
    assert cuda.calls == []


def test_without_torch_the_limit_is_left_to_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert apply_memory_limit(0, {GPU_MEMORY_LIMIT_ENV: str(GIB)}) is None


@pytest.mark.parametrize(
    ("virtual", "limit", "expected"),
    [(False, str(8 * GIB), "1=8192M"), (True, str(8 * GIB), None), (False, "", None)],
)
def test_the_shim_gives_mps_the_limit_of_the_worker_s_visible_device(
    virtual: bool, limit: str, expected: str | None
) -> None:
    env = {GPU_MEMORY_LIMIT_ENV: limit}
    bind_environment(env, {"gpus": [3, 5], "gpu": 5, "virtual": virtual}, 1)
    assert env.get(MPS_MEMORY_LIMIT_ENV) == expected


def test_the_shim_leaves_a_users_own_mps_limit() -> None:
    env = {GPU_MEMORY_LIMIT_ENV: str(8 * GIB), MPS_MEMORY_LIMIT_ENV: "0=2G"}
    bind_environment(env, {"gpus": [5], "gpu": 5, "virtual": False}, 0)
    assert env[MPS_MEMORY_LIMIT_ENV] == "0=2G"
