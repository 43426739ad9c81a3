"""The pool of a Slurm allocation: host lists as Slurm writes them, GPUs per node from each
of Slurm's variables, and the checks that keep a GPU node off virtual GPUs."""

from __future__ import annotations

import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from herd_operator.exporters import nvml
from herd_operator.runtime.pools import PoolOptions, discover_pool, hosts, local, slurm
from herd_operator.runtime.pools.hosts import parse_hosts
from herd_operator.runtime.pools.slurm import (
    HostListError,
    expand_hostlist,
    gpus_per_node,
    slurm_pool,
)
from herd_operator.specs.values import Pool

FORMS = [
    "nid001234",
    "nid[001234-001236,001240]",
    "h[1-3]",
    "a[1-2]b[01-02]",
    "x9y[8-11]",
    "z[08-10]",
    "q[9-10]",
    "a[001-2]",
    "a[1-02]",
    "n1[0-1]",
    "a-b[1-2]",
    "a.b[1-2]",
    "A[1,3-4,7]",
    "a[0]",
    "a[5-5]",
    "a,b,,c",
    "nid[001-002],login[1-2],gpu07",
    "r[1-2]n[1-2]g[1-2]",
    "node[099-101]",
]
# Rejected by Slurm too. (Slurm reads an unclosed `a[1-2` as the host `a]`; we reject it.)
REJECTED = ["a[1-3-4]", "a[3-1]", "a[1-2]0,b", "a[1-2]]", "a[1-2]-c", "a[]", "a[x]"]


@pytest.fixture(scope="module")
def scontrol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """`scontrol show hostnames`, which needs a configuration to read but no controller."""
    binary = shutil.which("scontrol")
    if binary is None:
        pytest.skip("Slurm's scontrol is not installed (scripts/bootstrap.sh installs it as root)")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=n1 CPUs=1\n")
    yield ["env", f"SLURM_CONF={conf}", binary, "show", "hostnames"]


def slurms_expansion(scontrol: list[str], text: str) -> list[str] | None:
    """Slurm's expansion, duplicates dropped as in a pool; None when Slurm rejects it."""
    result = subprocess.run([*scontrol, text], capture_output=True, text=True, timeout=30)
    if "Invalid hostlist" in result.stdout + result.stderr or result.returncode:
        return None
    return list(dict.fromkeys(result.stdout.split()))


def generated_forms(count: int, seed: int) -> list[str]:
    """Host lists of the shapes Slurm writes: prefixes with digits, padding, several groups,
    commas inside and outside brackets."""
    rng = random.Random(seed)
    forms = []
    for _ in range(count):
        entries = []
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(["nid", "gpu", "h", "x1y", "rack-", "cn.", "a"])
            for _ in range(rng.randint(0, 2)):
                width = rng.randint(1, 4)
                ranges = []
                for _ in range(rng.randint(1, 3)):
                    low = rng.randint(0, 30)
                    high = low + rng.randint(0, 4)
                    low_text, high_text = str(low).zfill(width), str(high).zfill(width)
                    ranges.append(low_text if low == high else f"{low_text}-{high_text}")
                name += "[" + ",".join(ranges) + "]" + rng.choice(["", "", "n", "-p"])
            entries.append(name.rstrip("n-p") if not name.endswith("]") else name)
        forms.append(",".join(entries))
    return forms


@pytest.mark.parametrize("text", FORMS + REJECTED + generated_forms(40, seed=7))
def test_host_lists_expand_as_slurms_own_scontrol(scontrol: list[str], text: str) -> None:
    expected = slurms_expansion(scontrol, text)
    if expected is None:
        with pytest.raises(HostListError):
            expand_hostlist(text)
    else:
        assert expand_hostlist(text) == expected


def test_zero_padding_and_order_are_kept() -> None:
    assert expand_hostlist("nid[001234-001236,001240]") == [
        "nid001234",
        "nid001235",
        "nid001236",
        "nid001240",
    ]
    assert expand_hostlist("n[8-10]") == ["n8", "n9", "n10"]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty"),
        ("a[1-2", "'[' without ']'"),
        ("a]", "']' without '['"),
        ("a[[1]]", "cannot nest"),
        ("a[3-1]", "backwards"),
        ("a[1-9999999]", "too large"),
        ("a b", "character"),
        (",,", "names no host"),
    ],
)
def test_bad_host_lists_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(HostListError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        expand_hostlist(text)


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_GPUS_PER_NODE": "4"}, (4, "SLURM_GPUS_PER_NODE")),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, (4, "SLURM_GPUS_PER_NODE")),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, (3, "SLURM_GPUS_PER_NODE")),
        ({"SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_GPUS": "0,1,2"}, (2, "SLURM_GPUS_ON_NODE")),
        ({"SLURM_JOB_GPUS": "0,1,2,3"}, (4, "SLURM_JOB_GPUS")),
        ({"SLURM_JOB_GPUS": ""}, None),
        ({}, None),
    ],
)
def test_gpus_per_node_from_each_of_slurms_variables(
    environ: dict[str, str], expected: tuple[int, str] | None
) -> None:
    assert gpus_per_node(environ) == expected


def test_a_gpu_count_that_does_not_parse_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"SLURM_GPUS_PER_NODE='a100'.*TYPE:COUNT"):
        gpus_per_node({"SLURM_GPUS_PER_NODE": "a100"})


def test_the_allocation_is_the_pool() -> None:
    source = slurm_pool(
        {
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "nid[001234-001235]",
            "SLURM_GPUS_PER_NODE": "a100:4",
        },
        virtual=False,
    )
    assert source is not None
    assert source.pool == Pool.from_counts({"nid001234": 4, "nid001235": 4})
    assert not source.virtual
    assert source.description == (
        "Slurm job 42: 2 nodes (nid[001234-001235]) x 4 GPUs (SLURM_GPUS_PER_NODE)"
    )
    assert slurm_pool({"SLURM_GPUS_PER_NODE": "4"}) is None  # not inside an allocation


def test_an_allocation_without_gpu_variables_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"--gpus-per-node=N, or pass --hosts 'NODELIST:N'"):
        slurm_pool({"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "h[1-2]"})
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        slurm_pool({"SLURM_JOB_NODELIST": "h[2-1]", "SLURM_GPUS_ON_NODE": "2"})


def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (hosts, local, slurm):
        monkeypatch.setattr(module, "nvml_gpu_count", lambda: 0)


def test_without_hosts_the_slurm_allocation_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    no_nvml(monkeypatch)
    monkeypatch.setattr(nvml, "nvidia_device_files", lambda dev=Path("/dev"): [])
    environ = {"SLURM_JOB_NODELIST": "h[1-3]", "SLURM_GPUS_ON_NODE": "2", "SLURM_JOB_ID": "5"}
    source = discover_pool(None, 4, PoolOptions(4, environ=environ))
    assert source.pool == Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})
    assert source.virtual  # no NVML GPU on this node: CPU workers stand in
    # --hosts still overrides it.
    override = discover_pool("h1:1", 4, PoolOptions(4, environ=environ))
    assert override.pool == Pool.from_counts({"h1": 1})
    # Outside an allocation: this host's virtual GPUs, as before.
    assert discover_pool(None, 3, PoolOptions(3, environ={})).pool == Pool.from_counts(
        {"localhost": 3}
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nid[001-002]:4", {"nid001": 4, "nid002": 4}),
        ("nodeA:a100:4,nodeB:2", {"nodeA": 4, "nodeB": 2}),
        ("h[1-2]:1,login:2", {"h1": 1, "h2": 1, "login": 2}),
        ("localhost:4", {"localhost": 4}),
    ],
)
def test_hosts_accepts_slurm_host_lists_and_gpu_types(text: str, expected: dict[str, int]) -> None:
    assert parse_hosts(text) == Pool.from_counts(expected)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("h[1-2]:4,h2:1", "h2 is listed twice"),
        ("h[1-2", "without"),
        ("nodeA:a100", "is not HOSTS:GPUS"),
        ("a:b:c:1", "is not HOSTS:GPUS"),
    ],
)
def test_bad_hosts_say_what_is_wrong(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[")):
        parse_hosts(text)


class BrokenNvml:
    """`pynvml` on a node whose driver does not load."""

    class NVMLError(Exception):
        pass

    def nvmlInit(self) -> None:
        raise self.NVMLError("Driver Not Loaded")


def test_a_node_with_nvidia_devices_but_no_nvml_refuses_virtual_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    monkeypatch.setitem(__import__("sys").modules, "pynvml", BrokenNvml())
    assert nvml.nvidia_device_files(tmp_path) == [tmp_path / "nvidia0"]
    with pytest.raises(ValueError, match=r"nvidia0\).*Driver Not Loaded.*--virtual-gpus N"):
        nvml.check_no_unseen_gpus(tmp_path)
    # No devices: virtual GPUs are the right answer.
    nvml.check_no_unseen_gpus(tmp_path / "empty")


def test_a_missing_nvml_package_names_the_gpu_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # import fails
    assert "herd-operator[gpu]" in nvml.nvml_failure()


def test_the_pool_refuses_virtual_gpus_on_a_gpu_node_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_nvml(monkeypatch)
    calls: list[Any] = []

    def refuse(dev: Path = Path("/dev")) -> None:
        calls.append(dev)
        raise ValueError("this host has NVIDIA devices")

    monkeypatch.setattr("herd_operator.runtime.pools.check_no_unseen_gpus", refuse)
    with pytest.raises(ValueError, match="NVIDIA devices"):
        discover_pool(None, 4, PoolOptions(4, environ={}))
    asked = discover_pool(None, 4, PoolOptions(4, virtual_requested=True, environ={}))
    assert asked.virtual and len(calls) == 1


def test_the_exporter_refuses_virtual_gpus_on_a_gpu_node(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import threading

    from herd_operator.agent import exporter

    monkeypatch.setattr(exporter, "nvml_gpu_count", lambda: 0)

    def refuse() -> None:
        raise ValueError("this host has NVIDIA devices (/dev/nvidia0) but NVML cannot start")

    monkeypatch.setattr(exporter, "check_no_unseen_gpus", refuse)
    stop = threading.Event()
    stop.set()
    code = exporter.run_exporter(tmp_path, "h1", "127.0.0.1", 0, 4, 1 << 30, stop)
    assert code == 2
