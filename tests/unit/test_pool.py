"""Pool discovery: `--hosts` parsing, NVML, and the virtual-GPU fallback."""

from __future__ import annotations

import socket
import sys
import types

import pytest

from herd_operator.exporters.nvml import nvml_gpu_count
from herd_operator.runtime.pools import discover_pool, hosts, local
from herd_operator.runtime.pools.hosts import parse_hosts

EXAMPLE = " (for example localhost:4, nid001:4,nid002:4, 'nid[001-004]:4' or nodeA:a100:4)"


def nvml_sees(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """NVML finds `count` GPUs on this host, for every pool source that asks."""
    for module in (hosts, local):
        monkeypatch.setattr(module, "nvml_gpu_count", lambda: count)


def test_parse_hosts_single_host() -> None:
    assert parse_hosts("localhost:4").hosts == (("localhost", (0, 1, 2, 3)),)


def test_parse_hosts_keeps_the_order_given() -> None:
    assert parse_hosts("b:2,a:4").hosts == (("b", (0, 1)), ("a", (0, 1, 2, 3)))
    assert parse_hosts("a:2, b:4").hosts == (("a", (0, 1)), ("b", (0, 1, 2, 3)))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bad", "--hosts: 'bad' is not HOSTS:GPUS" + EXAMPLE),
        ("", "--hosts: '' is not HOSTS:GPUS" + EXAMPLE),
        ("a:2,", "--hosts: '' is not HOSTS:GPUS" + EXAMPLE),
        ("a:-1", "--hosts: 'a:-1' is not HOSTS:GPUS" + EXAMPLE),
        ("a:two", "--hosts: 'a:two' is not HOSTS:GPUS" + EXAMPLE),
        (":4", "--hosts: ':4' is not HOSTS:GPUS" + EXAMPLE),
        ("-a:4", "--hosts: '-a:4' is not HOSTS:GPUS" + EXAMPLE),
        ("a b:4", "--hosts: 'a b:4' is not HOSTS:GPUS" + EXAMPLE),
        ("a:0", "--hosts: a has 0 GPUs; each host needs at least 1"),
        ("a:2,b:1,a:3", "--hosts: a is listed twice"),
    ],
)
def test_parse_hosts_rejects_with_exact_message(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_hosts(text)
    assert str(caught.value) == message


def test_discover_pool_without_nvml_gives_localhost_virtual_gpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml_sees(monkeypatch, 0)
    source = discover_pool(None, 3)
    assert source.pool.hosts == (("localhost", (0, 1, 2)),)
    assert source.virtual is True
    assert source.description == "localhost: 3 virtual GPUs (no NVML GPUs found)"


def test_discover_pool_explicit_hosts_are_virtual_without_nvml(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nvml_sees(monkeypatch, 0)
    source = discover_pool("nid001:2,nid002:1", 8)
    assert source.pool.hosts == (("nid001", (0, 1)), ("nid002", (0,)))
    assert source.virtual is True
    assert source.description == "--hosts nid001:2,nid002:1 (virtual GPUs)"


def test_discover_pool_explicit_hosts_are_real_with_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_sees(monkeypatch, 4)
    source = discover_pool("nid001:4", 8)
    assert source.virtual is False
    assert source.description == "--hosts nid001:4 (NVML GPUs)"


def test_discover_pool_propagates_bad_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_sees(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"^--hosts: 'x' is not HOSTS:GPUS"):
        discover_pool("x", 4)


class FakeNvml:
    """Stands in for the `pynvml` module: the boundary `nvml_gpu_count` talks to."""

    def __init__(self, count: int, init_error: Exception | None = None) -> None:
        self.count = count
        self.init_error = init_error
        self.calls: list[str] = []

    def module(self) -> types.ModuleType:
        fake = types.ModuleType("pynvml")
        fake.nvmlInit = self.init  # type: ignore[attr-defined]
        fake.nvmlDeviceGetCount = self.device_count  # type: ignore[attr-defined]
        fake.nvmlShutdown = self.shutdown  # type: ignore[attr-defined]
        return fake

    def init(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise self.init_error

    def device_count(self) -> int:
        self.calls.append("count")
        return self.count

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class NVMLError_DriverNotLoaded(Exception):
    pass


def test_nvml_init_failure_counts_as_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(8, init_error=NVMLError_DriverNotLoaded("Driver Not Loaded"))
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    assert nvml_gpu_count() == 0
    assert nvml.calls == ["init"]
    source = discover_pool(None, 2)
    assert source.pool.hosts == (("localhost", (0, 1)),)
    assert source.virtual is True


def test_nvml_missing_module_counts_as_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import pynvml` raise ImportError.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert nvml_gpu_count() == 0


def test_nvml_gpus_make_a_real_pool_on_this_host(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = FakeNvml(2)
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module())
    assert nvml_gpu_count() == 2
    assert nvml.calls == ["init", "count", "shutdown"]
    source = discover_pool(None, 4)
    host = socket.gethostname()
    assert source.pool.hosts == ((host, (0, 1)),)
    assert source.virtual is False
    assert source.description == f"{host}: 2 GPUs from NVML"


def test_explicitly_empty_hosts_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml_sees(monkeypatch, 0)
    with pytest.raises(ValueError, match=r"^--hosts: '' is not HOSTS:GPUS"):
        discover_pool("", 4)
