"""An operator on one of its own pool's nodes, as a batch script runs on an allocation's
first node: a job placed on that node alone must start, grow onto another node over ssh,
and shrink back.

Stock horovodrun cannot start such a job (with `--network-interface eth0` and only local
hosts it looks for 127.0.0.1 on eth0 and exits); the operator's own driver must. Two
network-namespace hosts with an sshd each, no Slurm (test_slurm covers the allocation).

While the job runs on both hosts, no value of the spec's `env` or of the operator's
environment is on any process's command line (the hosts share one process table): the
driver starts the other host's workers with their environment on ssh's stdin, where
Horovod's ssh line held `env K=V ...`; the workers there still get both values.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from devtools.bench.multinode import job_environment
from devtools.cluster import NamespaceCluster, cluster_unavailable, namespace_cluster
from herd_operator.bench.harness import stop_session
from herd_operator.environment import STATE_DIR_ENV
from tests.integration.harness import (
    HERD,
    REPO,
    OperatorHarness,
    digits_command,
    marked_processes,
    spec_document,
    workers_by_host,
)

# Built, not literal: the pytest process's own command line must not hold them either.
SPEC_MARKER = "-".join(["spec", "env", "marker", "5f1c"])
OPERATOR_MARKER = "-".join(["operator", "env", "marker", "9d2e"])

BATCH_SLURM = {"SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "h1", "SLURM_PROCID": "0"}
"""What a batch script on h1 has (the pool still comes from --hosts: no SLURM_JOB_NODELIST)."""

UNAVAILABLE = cluster_unavailable(slurm=False)
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no test hosts: {UNAVAILABLE}")


@pytest.fixture
def cluster() -> Iterator[NamespaceCluster]:
    # Slurm's and munge's sockets live under the cluster's root, and a Unix socket path has
    # at most 108 bytes: pytest's tmp_path (under xdist, .../popen-gwN/<test>0/) is too long.
    root = Path(tempfile.mkdtemp(prefix="herd-cluster-"))
    try:
        with namespace_cluster(root, compute=2, gpus=2, slurm=False) as made:
            yield made
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.timeout(420)
def test_a_job_on_the_operators_own_node_starts_grows_onto_another_and_shrinks_back(
    tmp_path: Path, cluster: NamespaceCluster
) -> None:
    herd = OperatorHarness(tmp_path / "herd")  # its store and spec helpers; the operator runs on h1
    herd.specs_dir.mkdir(parents=True)
    operator = cluster.spawn(
        "h1",
        [
            HERD, "run", "--specs-dir", str(herd.specs_dir), "--state-dir", str(herd.layout.root),
            "--hosts", "h1:2,h2:2", "--network-interface", "eth0",
            "--resync-seconds", "0.5", "--relist-seconds", "1", "--grace-seconds", "5",
            "--min-resize-interval", "1", "--metrics-port", "0",
        ],
        "operator.log",
        {**job_environment(cluster), "HERD_TEST_OPERATOR_MARKER": OPERATOR_MARKER, **BATCH_SLURM},
    )  # fmt: skip
    log = cluster.root / "log" / "operator.log"
    # Training that only has to go on: 5 steps a second, not 20, costs less CPU.
    command = digits_command(10_000, "--step-delay", "0.2", "--batch-size", "64")

    def job_at(gpus: int, hosts: list[str]) -> bool:
        job = herd.job("home")
        reports = herd.reports("home")
        return (
            job is not None
            and sorted(job["placement"]) == hosts
            and job["gpus"]["allocated"] == gpus
            and bool(reports)
            and reports[-1].world_size == gpus
        )

    def at(gpus: int) -> dict[str, object]:
        return spec_document(
            "home", 2, 4, command, policy={"name": "static", "params": {"gpus": gpus}},
            env={"HERD_TEST_SPEC_MARKER": SPEC_MARKER},
        )  # fmt: skip

    try:
        herd.wait_for(herd.layout.endpoint_file.exists, "the operator's endpoint file", 60)
        # An empty pool places a 2-GPU job on its first node: the operator's own.
        herd.write_spec(at(2))
        herd.wait_for(lambda: job_at(2, ["h1"]), "home training at 2 on h1", 150, job="home")
        assert workers_by_host(herd.layout.root) == {"h1": 2}

        herd.write_spec(at(4))
        herd.wait_for(lambda: job_at(4, ["h1", "h2"]), "home at 4 on h1 and h2", 150, job="home")
        assert workers_by_host(herd.layout.root) == {"h1": 2, "h2": 2}
        assert command_lines_with_a_marker() == []
        remote = remote_worker_environments(herd.layout.root, "h2")
        assert len(remote) == 2
        for env in remote:
            assert env.get("HERD_TEST_SPEC_MARKER") == SPEC_MARKER
            assert env.get("HERD_TEST_OPERATOR_MARKER") == OPERATOR_MARKER
            # The allocation's job id, not the batch node's name or task: h1's, not h2's.
            assert env.get("SLURM_JOB_ID") == BATCH_SLURM["SLURM_JOB_ID"]
            assert "SLURMD_NODENAME" not in env and "SLURM_PROCID" not in env
        local = remote_worker_environments(herd.layout.root, "h1")
        assert local and all(env.get("SLURMD_NODENAME") == "h1" for env in local), "true there"

        herd.write_spec(at(2))
        herd.wait_for(lambda: job_at(2, ["h1"]), "home back at 2 on h1", 120, job="home")
        herd.wait_for(
            lambda: workers_by_host(herd.layout.root) == {"h1": 2},
            "h2's workers to exit",
            60,
            job="home",
        )

        (herd.specs_dir / "home.yaml").unlink()
        herd.wait_for(
            lambda: not workers_by_host(herd.layout.root), "every worker on every host to exit", 60
        )
    finally:
        with contextlib.suppress(Exception):
            stop_session(operator)
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]


def command_lines_with_a_marker() -> list[tuple[int, list[str]]]:
    """Every live process, on any host, whose command line holds a marker's value."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            if any(SPEC_MARKER in part or OPERATOR_MARKER in part for part in cmdline):
                found.append((proc.pid, cmdline))
    return found


def remote_worker_environments(state: Path, host: str) -> list[dict[str, str]]:
    """The environments of the job's workers that Horovod started for `host`."""
    wanted = str(state.resolve())
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            env = proc.environ()
            if (
                env.get(STATE_DIR_ENV) == wanted
                and "HOROVOD_RANK" in env
                and env.get("HOROVOD_HOSTNAME") == host
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(env)
    return found


# ---- the torchrun engine across hosts ----


def torchrun_agents(state: Path) -> dict[str, psutil.Process]:
    """The job's live torchrun agents, on any host: their GPU's name -> the process."""
    wanted = str(state.resolve())
    found = {}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
            env = proc.environ()
            if (
                env.get(STATE_DIR_ENV) == wanted
                and "torch.distributed.run" in cmdline
                and "HERD_WORKER_HOST" in env
                and proc.status() != psutil.STATUS_ZOMBIE
            ):
                found[env["HERD_WORKER_HOST"]] = proc
    return found


@pytest.mark.timeout(480)
def test_a_torchrun_job_grows_onto_another_host_and_goes_on_smaller_when_a_gpu_there_dies(
    tmp_path: Path, cluster: NamespaceCluster
) -> None:
    """The operator on h1 (one GPU), h2 (two) reached over ssh: a torchrun job grows 1 -> 3
    onto h2, whose agents the driver starts there through ssh (their rendezvous is the
    store on h1's eth0 address, their Gloo on eth0); one h2 GPU's agent and worker are
    SIGKILLed, and the job trains on at 2 from its snapshot, no epoch lost or repeated.
    Deleted then: every agent on every host ends."""
    herd = OperatorHarness(tmp_path / "herd")
    herd.specs_dir.mkdir(parents=True)
    snapshot = tmp_path / "tr.pt"
    epochs = 1000  # never reached: the test deletes the job once it has seen enough
    operator = cluster.spawn(
        "h1",
        [
            HERD, "run", "--specs-dir", str(herd.specs_dir), "--state-dir", str(herd.layout.root),
            "--hosts", "h1:1,h2:2", "--network-interface", "eth0",
            "--resync-seconds", "0.5", "--relist-seconds", "1", "--grace-seconds", "5",
            "--min-resize-interval", "1", "--metrics-port", "0",
        ],
        "operator.log",
        job_environment(cluster),
    )  # fmt: skip
    log = cluster.root / "log" / "operator.log"

    def at(gpus: int) -> dict[str, object]:
        command = [
            "python", str(REPO / "examples" / "train_torchrun.py"), "--epochs", str(epochs),
            "--snapshot", str(snapshot), "--step-delay", "0.03",
        ]  # fmt: skip
        return spec_document(
            "tr", 1, 3, command, policy={"name": "static", "params": {"gpus": gpus}},
            engine={"kind": "torchrun", "options": {"lastCallSeconds": 3}},
        )  # fmt: skip

    def epoch_at(world: int, after: int = -1) -> bool:
        return any(
            r.epoch is not None and r.epoch > after and r.world_size == world
            for r in herd.reports("tr")
        )

    try:
        herd.wait_for(herd.layout.endpoint_file.exists, "the operator's endpoint file", 60)
        herd.write_spec(at(1))
        herd.wait_for(lambda: epoch_at(1), "an epoch at 1 on h1", 180, job="tr")
        herd.write_spec(at(3))
        herd.wait_for(lambda: epoch_at(3), "an epoch at 3 on h1 and h2", 240, job="tr")
        job = herd.job("tr")
        assert job is not None and sorted(job["placement"]) == ["h1", "h2"], job
        agents = torchrun_agents(herd.layout.root)
        assert sorted(agents) == ["h1:gpu0", "h2:gpu0", "h2:gpu1"]
        h1_address = cluster.address("h1")
        for name, agent in agents.items():
            endpoint = [arg for arg in agent.cmdline() if arg.startswith("--rdzv-endpoint=")]
            assert endpoint and endpoint[0].startswith(f"--rdzv-endpoint={h1_address}:"), name
        assert "--local-addr=h2" in agents["h2:gpu1"].cmdline()
        worker = agents["h2:gpu1"].children()[0]
        assert worker.environ().get("GLOO_SOCKET_IFNAME") == "eth0"

        # One GPU of h2 dies: its agent and its worker SIGKILLed.
        before = max(r.epoch for r in herd.reports("tr") if r.epoch is not None)
        victims = [agents["h2:gpu1"], *agents["h2:gpu1"].children(recursive=True)]
        for victim in victims:
            victim.kill()
        herd.wait_for(lambda: epoch_at(2, after=before), "an epoch at 2 after the kill", 180, "tr")
        # Enough seen: the job is deleted (its end is the one-host test's business), and
        # every process of it on every host ends with it (the remote agents stopped through
        # their ssh sessions, their workers by them).
        (herd.specs_dir / "tr.yaml").unlink()
        herd.wait_for(
            lambda: not marked_processes(herd.layout.root),
            "every process on every host to exit",
            60,
        )
    finally:
        with contextlib.suppress(Exception):
            stop_session(operator)
    import torch  # here, not at collection: every xdist worker collects this file

    saved = torch.load(snapshot, map_location="cpu", weights_only=False)
    epochs_run = [(int(epoch), int(world)) for epoch, world in saved["history"]]
    assert [epoch for epoch, _ in epochs_run] == list(range(len(epochs_run))), "lost or repeated"
    worlds = [world for _, world in epochs_run]
    changes = [world for i, world in enumerate(worlds) if i == 0 or world != worlds[i - 1]]
    assert changes == [1, 3, 2], f"world sizes by epoch: {worlds}"
    text = log.read_text()
    assert "Traceback" not in text, text[-4000:]
