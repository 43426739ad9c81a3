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
    monkeypatch.setattr(slurm, "read_job_details", lambda job_id: None)  # no Slurm client
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
    code = exporter.run_exporter(tmp_path, "h1", "127.0.0.1", 0, None, 1 << 30, stop)
    assert code == 2


# ---- the allocation as Slurm says it now: `scontrol show job -d` ----

OUTPUT = Path(__file__).parent / "slurm_output"
"""Captured from the test cluster's real Slurm (Debian's 22.05, `bench/cluster.py`):
`sbatch -N3 --gpus=4`, `sbatch -N3 --gres=gpu:2 --no-kill`, and the latter after
`scontrol update NodeName=h3 State=DOWN` ("Removing failed node h3 from JobId=2")."""


def captured(name: str) -> str:
    return (OUTPUT / name).read_text()


def test_gpus_spread_unevenly_over_the_nodes_are_read_per_node() -> None:
    """`sbatch -N3 --gpus=4`: Slurm gave h1 two GPUs and h2, h3 one each, while the batch
    script's SLURM_GPUS_ON_NODE says 2 (3 x 2 was the old reading)."""
    allocation = slurm.parse_job_details(captured("show_job_gpus4_over_3_nodes.txt"))
    assert (allocation.job_id, allocation.state) == ("1", "RUNNING")
    assert allocation.nodes == ("h1", "h2", "h3")
    assert allocation.pool() == Pool((("h1", (0, 1)), ("h2", (0,)), ("h3", (0,))))


def test_a_node_slurm_removed_from_the_job_is_not_in_the_pool() -> None:
    before = slurm.parse_job_details(captured("show_job_gres2_3_nodes.txt"))
    assert before.pool() == Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})
    after = slurm.parse_job_details(captured("show_job_gres2_h3_removed.txt"))
    assert after.nodes == ("h1", "h2") and after.pool() == Pool.from_counts({"h1": 2, "h2": 2})


@pytest.mark.parametrize(
    ("gres", "indices"),
    [
        ("gpu:4(IDX:0-3)", (0, 1, 2, 3)),
        ("gpu:a100:4(IDX:0-3)", (0, 1, 2, 3)),
        ("gpu:2(IDX:2-3)", (2, 3)),  # the other half of a shared node
        ("gpu:3(IDX:0,2-3)", (0, 2, 3)),
        ("gpu(IDX:0-1)", (0, 1)),  # Slurm 18's GRES_IDX
        ("gpu:a100:1(IDX:0),gpu:v100:1(IDX:1)", (0, 1)),
        ("nic:1,gpu:2(IDX:0-1)", (0, 1)),
        ("gpu:2", (0, 1)),  # no IDX: numbered from 0
        ("gpu:a100:2", (0, 1)),
        ("", ()),
        ("nic:1", ()),
    ],
)
def test_a_nodes_gres_gives_its_gpu_indices(gres: str, indices: tuple[int, ...]) -> None:
    assert slurm.parse_gres_gpus(gres) == indices


def test_other_forms_of_the_per_node_lines() -> None:
    text = (
        "JobId=77 JobName=x\n   JobState=RUNNING Reason=None\n   ReqNodeList=(null)"
        " ExcNodeList=n9\n   NodeList=nid[001-003]\n"
        "     Nodes=nid001 CPU_IDs=0-63 Mem=0 GRES_IDX=gpu(IDX:0-3)\n"
        "     Nodes=nid[002-003] CPU_IDs=0-63 Mem=0 GRES=gpu:a100:2(IDX:2-3)\n"
    )
    allocation = slurm.parse_job_details(text)
    assert allocation.pool() == Pool(
        (("nid001", (0, 1, 2, 3)), ("nid002", (2, 3)), ("nid003", (2, 3)))
    )
    # A node of the job without a GRES line has no GPU: it is not in the pool.
    assert slurm.parse_job_details(text.replace("nid[001-003]", "nid[001-004]")).pool().size == 8


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("JobName=x NodeList=h1", "no JobId"),
        ("JobId=1 NodeList=h[2-1]", "NodeList"),
        ("JobId=1 NodeList=h1\n  Nodes=h1 CPU_IDs=0 GRES=gpu:2(IDX:x)", "is not an index"),
        ("JobId=1 NodeList=h1\n  Nodes=h1 CPU_IDs=0 GRES=gpu:a100", "neither IDX nor a count"),
    ],
)
def test_output_that_cannot_be_read_says_which_field(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        slurm.parse_job_details(text)


class SlurmAnswers:
    """What `scontrol show job -d` answers, in turn; None: Slurm could not be asked."""

    def __init__(self, *answers: str | None) -> None:
        self.answers = list(answers)
        self.asked = 0

    def __call__(self, job_id: str) -> str | None:
        self.asked += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_the_pool_follows_slurm_and_a_removed_node_never_comes_back() -> None:
    clock = [0.0]
    answers = SlurmAnswers(
        None,  # slurmctld busy: the pool stays
        captured("show_job_gres2_3_nodes.txt"),
        captured("show_job_gres2_h3_removed.txt"),
    )
    source = slurm.SlurmPool(
        "2",
        slurm.parse_job_details(captured("show_job_gres2_3_nodes.txt")),
        virtual=True,
        nodelist="h[1-3]",
        read=answers,
        clock=lambda: clock[0],
    )
    assert source.description == (
        "Slurm job 2: 3 nodes (h[1-3]) x 2 virtual GPUs (scontrol show job -d)"
    )
    changes: list[Pool] = []
    source._listener = changes.append  # as start() sets it, without the polling thread
    three = Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})
    assert source.refresh() == three and source.refresh() == three and changes == []
    assert source.refresh() == Pool.from_counts({"h1": 2, "h2": 2})
    assert changes == [Pool.from_counts({"h1": 2, "h2": 2})]
    # h3's link is back and its agent calls: Slurm does not list it, so it stays out.
    assert not source.still_lists("h3") and source.still_lists("h1")
    asked = answers.asked
    assert not source.still_lists("h3")  # within a second: the last answer, not Slurm again
    assert answers.asked == asked
    clock[0] += 1.0
    assert not source.still_lists("h3") and answers.asked == asked + 1
    assert changes == [Pool.from_counts({"h1": 2, "h2": 2})]


def test_an_answer_of_a_job_that_ends_or_lost_its_gpus_keeps_the_pool() -> None:
    ending = captured("show_job_gres2_h3_removed.txt").replace("RUNNING", "COMPLETING")
    source = slurm.SlurmPool(
        "2",
        slurm.parse_job_details(captured("show_job_gres2_3_nodes.txt")),
        virtual=True,
        read=SlurmAnswers(ending, "JobId=2 JobState=RUNNING NodeList=h1", "garbage"),
    )
    three = Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})
    assert source.refresh() == three and source.refresh() == three
    assert source.refresh() == three


def test_slurm_is_asked_first_and_its_per_node_gpus_win(monkeypatch: pytest.MonkeyPatch) -> None:
    no_nvml(monkeypatch)
    monkeypatch.setattr(nvml, "nvidia_device_files", lambda dev=Path("/dev"): [])
    environ = {
        "SLURM_JOB_ID": "1",
        "SLURM_JOB_NODELIST": "h[1-3]",
        "SLURM_GPUS": "4",
        "SLURM_GPUS_ON_NODE": "2",
        "SLURM_JOB_GPUS": "0,1",
    }  # as the batch script of `sbatch -N3 --gpus=4` has them
    monkeypatch.setattr(
        slurm, "read_job_details", lambda job_id: captured("show_job_gpus4_over_3_nodes.txt")
    )
    source = discover_pool(None, 4, PoolOptions(4, environ=environ))
    assert source.pool == Pool((("h1", (0, 1)), ("h2", (0,)), ("h3", (0,))))
    assert source.description == (
        "Slurm job 1: 3 nodes (h[1-3]), 4 virtual GPUs: h1 x 2, h2 x 1, h3 x 1"
        " (scontrol show job -d)"
    )
    # Without Slurm's client the variables cannot tell the nodes apart: refused, not 3 x 2.
    monkeypatch.setattr(slurm, "read_job_details", lambda job_id: None)
    with pytest.raises(ValueError, match=r"4 GPUs \(SLURM_GPUS\) over 3 nodes, not 2 on each"):
        discover_pool(None, 4, PoolOptions(4, environ=environ))
    alike = {**environ, "SLURM_GPUS": "6"}
    assert discover_pool(None, 4, PoolOptions(4, environ=alike)).pool == Pool.from_counts(
        {"h1": 2, "h2": 2, "h3": 2}
    )
