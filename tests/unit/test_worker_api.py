"""The worker side: `herd_operator.worker` and the shim, against a real allocator server."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from herd_operator.agent import worker
from herd_operator.agent.exporter import REGISTER_EVERY_SECONDS
from herd_operator.agent.worker import (
    DeviceBinding,
    bind_device,
    report_epoch,
    report_measurement,
    report_reset,
)
from herd_operator.auth import (
    ADMIN,
    Identity,
    agent_identity,
    agent_key,
    ensure_token_file,
    job_identity,
    job_key,
    read_token_file,
    write_token_file,
)
from herd_operator.environment import ALLOCATOR_ENV, ENV_FILE_ENV, JOB_ENV, TOKEN_FILE_ENV
from herd_operator.layout import StateLayout, write_atomically
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import AuthError, NotFound, RpcError
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import (
    EXPORTER_EXPIRY_SECONDS,
    AllocatorOps,
    ExporterRegistry,
    for_agents,
    for_own_host,
    for_own_job,
)
from herd_operator.specs.values import Demand, Pool

REPO_ROOT = Path(__file__).resolve().parents[2]
# Hang guard for the shim subprocesses; never a performance expectation.
GUARD_S = 30.0
SHOW_ENV = (
    "import os, json; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('HERD', 'CUDA'))}))"
)
OPERATOR_PREFIXES = ("HERD_", "CUDA_", "HOROVOD_")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No operator variables from the outside, and no shared client left behind."""
    for name in list(os.environ):
        if name.startswith(OPERATOR_PREFIXES):
            monkeypatch.delenv(name)
    monkeypatch.setattr(worker, "_client", None)
    yield
    client = worker._client
    if client is not None:
        client.close()


# ---- outside the operator ----


def test_bind_device_outside_the_operator_uses_the_local_rank(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bind_device() == DeviceBinding(gpu=0, ordinal=0, virtual=False)
    monkeypatch.setenv("HOROVOD_LOCAL_RANK", "3")
    assert bind_device() == DeviceBinding(gpu=3, ordinal=3, virtual=False)


def test_report_epoch_outside_the_operator_is_a_no_op(
    clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    report_epoch(1, {"loss": 0.5})
    report_reset()
    # A job name alone (no allocator address) is not "under the operator" either.
    monkeypatch.setenv(JOB_ENV, "train")
    report_epoch(2)
    assert worker._client is None


@pytest.mark.parametrize(
    ("env", "binding"),
    [
        (
            {"HERD_GPU": "2", "CUDA_VISIBLE_DEVICES": "2,3", "HERD_VIRTUAL_GPU": "1"},
            DeviceBinding(gpu=2, ordinal=0, virtual=True),
        ),
        (
            {"HERD_GPU": "3", "CUDA_VISIBLE_DEVICES": "2,3", "HERD_VIRTUAL_GPU": "0"},
            DeviceBinding(gpu=3, ordinal=1, virtual=False),
        ),
        (
            {"HERD_GPU": "2", "HERD_GPUS": "5,2", "HOROVOD_LOCAL_RANK": "1"},
            DeviceBinding(gpu=2, ordinal=1, virtual=False),
        ),
    ],
)
def test_bind_device_uses_what_the_shim_exported(
    clean_env: None, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], binding: DeviceBinding
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert bind_device() == binding


# ---- against a real allocator server ----


class Allocation:
    """A real Allocator behind a real RpcServer on loopback, with its master token and the
    jobs' own token files, wired with the operator's authorization rules."""

    def __init__(self, tmp_path: Path) -> None:
        self.layout = layout = StateLayout(tmp_path / "state")
        layout.create()
        self.master = ensure_token_file(layout.token_file)
        self.allocator = Allocator(
            Pool.from_counts({"localhost": 3}), GrantPublisher(layout), virtual=True
        )
        # "x" takes GPU 0, so job "a" holds GPUs 1 and 2: local rank i is not GPU i.
        self.allocator.request(Demand("x", 1, 1, 1))
        self.allocator.request(Demand("a", 2, 3, 3))
        self.reports: list[dict[str, Any]] = []
        self.exporters = ExporterRegistry(layout.scrape_targets_file, None)
        self.server = RpcServer(
            self.master,
            {
                "bind": for_own_job(AllocatorOps(self.allocator).bind),
                "report": for_own_job(self.report),
                "placements": for_agents(AllocatorOps(self.allocator).placements),
                "register_exporter": for_own_host(self.exporters),
                "unregister_exporter": for_own_host(self.exporters.unregister),
            },
        )

    def report(self, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("job") != "a":
            raise NotFound(f"no job {args.get('job')!r}")
        self.reports.append(args)
        return {}

    def env(self, job: str = "a") -> dict[str, str]:
        """What the operator gives a job's processes: its own key's file, not the master."""
        token_file = self.layout.job_token_file(job)
        write_token_file(token_file, job_key(self.master, job))
        host, port = self.server.address
        return {
            JOB_ENV: job,
            ALLOCATOR_ENV: f"{host}:{port}",
            TOKEN_FILE_ENV: str(token_file),
        }


@pytest.fixture
def allocation(tmp_path: Path) -> Iterator[Allocation]:
    allocation = Allocation(tmp_path)
    with allocation.server:
        yield allocation


def shim(tmp_path: Path, env: dict[str, str], *command: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(OPERATOR_PREFIXES)}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), base.get("PYTHONPATH")]))
    return subprocess.Popen(
        [sys.executable, "-m", "herd_operator.agent.shim", "--", *command],
        cwd=tmp_path,
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return process.returncode, out, err


def test_shim_exports_the_jobs_gpus_in_local_rank_order(
    tmp_path: Path, allocation: Allocation
) -> None:
    env = {**allocation.env(), "HOROVOD_HOSTNAME": "localhost", "HOROVOD_LOCAL_RANK": "1"}
    process = shim(tmp_path, env, sys.executable, "-c", SHOW_ENV)
    code, out, err = finish(process)
    assert (code, err) == (0, "")
    seen = json.loads(out)
    assert seen == {
        **allocation.env(),
        "CUDA_VISIBLE_DEVICES": "1,2",
        "HERD_GPUS": "1,2",
        "HERD_GPU": "2",
        "HERD_VIRTUAL_GPU": "1",
    }
    # exec keeps the pid, so the binding names the user's process.
    (binding,) = allocation.allocator.bindings()
    assert (binding.job, binding.host, binding.local_rank, binding.gpu) == ("a", "localhost", 1, 2)
    assert binding.pid == process.pid


def test_shim_gives_up_after_the_bind_timeout(tmp_path: Path, allocation: Allocation) -> None:
    env = {
        **allocation.env(),
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_LOCAL_RANK": "5",
        "HERD_BIND_TIMEOUT": "1",
    }
    code, out, err = finish(shim(tmp_path, env, sys.executable, "-c", SHOW_ENV))
    problem = "not_found: job 'a' holds 2 GPU(s) on 'localhost'; no local rank 5"
    assert code == 1
    assert out == ""
    *waited, gave_up = err.splitlines()
    # The wait is announced once, unless the very first try already came after the deadline.
    assert waited in ([], [f"herd shim: waiting for a GPU for local rank 5: {problem}"])
    assert gave_up == f"herd shim: cannot bind local rank 5: {problem}"


def test_shim_waits_until_the_grant_grows_back(tmp_path: Path, allocation: Allocation) -> None:
    env = {**allocation.env(), "HOROVOD_HOSTNAME": "localhost", "HOROVOD_LOCAL_RANK": "2"}
    process = shim(tmp_path, env, sys.executable, "-c", SHOW_ENV)
    assert process.stderr is not None
    waiting = process.stderr.readline()
    assert waiting.startswith("herd shim: waiting for a GPU for local rank 2: not_found:")
    allocation.allocator.release("x")  # job "a" grows onto GPU 0 as local rank 2
    code, out, err = finish(process)
    assert (code, err) == (0, "")
    seen = json.loads(out)
    assert (seen["CUDA_VISIBLE_DEVICES"], seen["HERD_GPU"]) == ("1,2,0", "0")


def test_shim_outside_the_operator_runs_the_command_untouched(tmp_path: Path) -> None:
    code, out, err = finish(shim(tmp_path, {}, sys.executable, "-c", SHOW_ENV))
    assert (code, err) == (0, "")
    assert json.loads(out) == {}


def test_shim_usage_and_missing_command(tmp_path: Path) -> None:
    code, out, err = finish(shim(tmp_path, {}))
    assert (code, out, err) == (
        2,
        "",
        "usage: python -m herd_operator.agent.shim -- COMMAND [ARG...]\n",
    )
    code, out, err = finish(shim(tmp_path, {}, "no-such-command-here"))
    assert code == 127
    assert err.startswith("herd shim: cannot run 'no-such-command-here': ")


def test_report_epoch_reaches_the_server(
    clean_env: None, allocation: Allocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {**allocation.env(), "HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    report_epoch(4, {"loss": 1, "accuracy": 0.75})
    report_reset()
    assert allocation.reports == [], "only rank 0 speaks for the job"
    monkeypatch.setenv("HOROVOD_RANK", "0")
    report_epoch(4, {"loss": 1, "accuracy": 0.75})
    report_epoch(5, world_size=2)
    report_reset()
    assert allocation.reports == [
        {
            "job": "a",
            "epoch": 4,
            "world_size": 3,
            "rank": 0,
            "metrics": {"loss": 1.0, "accuracy": 0.75},
        },
        {"job": "a", "epoch": 5, "world_size": 2, "rank": 0, "metrics": {}},
        {"job": "a", "epoch": None, "world_size": 3, "rank": 0, "metrics": {}},
    ]


def test_report_measurement_reaches_the_server_as_a_measurement(
    clean_env: None,
    allocation: Allocation,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from herd_operator import worker as public

    assert public.report_measurement is report_measurement
    assert "report_measurement" in public.__all__
    for name, value in {**allocation.env(), "HOROVOD_RANK": "1", "HOROVOD_SIZE": "3"}.items():
        monkeypatch.setenv(name, value)
    report_measurement({"batch_size": 64})
    assert allocation.reports == [], "only rank 0 speaks for the job"
    monkeypatch.setenv("HOROVOD_RANK", "0")
    report_measurement({"batch_size": 64, "step_seconds": 0.25}, world_size=2)
    report_measurement({"batch_size": 96})
    assert allocation.reports == [
        {
            "job": "a",
            "epoch": None,
            "world_size": 2,
            "rank": 0,
            "metrics": {"batch_size": 64.0, "step_seconds": 0.25},
            "measurement": True,
        },
        {
            "job": "a",
            "epoch": None,
            "world_size": 3,
            "rank": 0,
            "metrics": {"batch_size": 96.0},
            "measurement": True,
        },
    ]
    monkeypatch.setenv(JOB_ENV, "gone")  # refused (another job's name): logged, never raised
    with caplog.at_level(logging.WARNING, logger="herd_operator.agent.worker"):
        report_measurement({"batch_size": 64})
    assert len(allocation.reports) == 2
    said = [r.getMessage() for r in caplog.records if r.name == "herd_operator.agent.worker"]
    assert said == ["herd: report failed: forbidden: job:a may only speak for job 'a', not 'gone'"]


def test_report_failure_never_raises(
    clean_env: None,
    allocation: Allocation,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in allocation.env(job="gone").items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="herd_operator.agent.worker"):
        report_epoch(1)
    assert allocation.reports == []
    assert [record.getMessage() for record in caplog.records] == [
        "herd: report failed: not_found: no job 'gone'"
    ]


# ---- per-job credentials ----


def test_a_jobs_key_binds_and_reports_for_that_job_only(allocation: Allocation) -> None:
    env = allocation.env("a")
    key = read_token_file(Path(env[TOKEN_FILE_ENV]))
    assert key != allocation.master
    with RpcClient(allocation.server.address, key, identity=job_identity("a")) as client:
        assert client.call("bind", job="a", host="localhost", local_rank=0)["gpu"] == 1
        # Job "x" holds GPU 0: job "a" must not claim its workers' slots nor speak for it.
        with pytest.raises(RpcError) as bind_refused:
            client.call("bind", job="x", host="localhost", local_rank=0, pid=1)
        with pytest.raises(RpcError) as report_refused:
            client.call("report", job="x", epoch=1, world_size=1)
    assert (bind_refused.value.code, report_refused.value.code) == ("forbidden", "forbidden")
    assert bind_refused.value.message == "job:a may only speak for job 'a', not 'x'"
    assert [binding.job for binding in allocation.allocator.bindings()] == ["a"]
    assert allocation.reports == []
    counts = allocation.server.request_counts()
    assert counts[("bind", "forbidden")] == 1 and counts[("report", "forbidden")] == 1


def test_a_jobs_key_cannot_claim_another_identity(allocation: Allocation) -> None:
    key = read_token_file(Path(allocation.env("a")[TOKEN_FILE_ENV]))
    for identity in (job_identity("x"), Identity("admin")):
        with (
            RpcClient(allocation.server.address, key, identity=identity) as client,
            pytest.raises(AuthError),
        ):
            client.call("bind", job="x", host="localhost", local_rank=0)
    assert allocation.allocator.bindings() == []


def test_a_refusal_is_logged_once_without_the_key(
    allocation: Allocation, caplog: pytest.LogCaptureFixture
) -> None:
    key = read_token_file(Path(allocation.env("a")[TOKEN_FILE_ENV]))
    with (
        caplog.at_level(logging.WARNING, logger="herd_operator.rpc"),
        RpcClient(allocation.server.address, key, identity=job_identity("a")) as client,
    ):
        for _ in range(3):
            with pytest.raises(RpcError):
                client.call("report", job="x", epoch=1, world_size=1)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith("refused op 'report' to job:a from 127.0.0.1:")
    assert key.hex() not in caplog.text and allocation.master.hex() not in caplog.text
    assert allocation.server.request_counts()[("report", "forbidden")] == 3


def test_a_forged_host_is_refused_before_it_reaches_the_allocator(
    allocation: Allocation,
) -> None:
    key = read_token_file(Path(allocation.env("a")[TOKEN_FILE_ENV]))
    with RpcClient(allocation.server.address, key, identity=job_identity("a")) as client:
        for host in ("localhost\nINFO forged line", "a b", "host/x", "", "h" * 254):
            with pytest.raises(RpcError) as caught:
                client.call("bind", job="a", host=host, local_rank=0)
            assert caught.value.code == "bad_request"
            assert caught.value.message.startswith("'host' must be a host name or IP address")
    assert allocation.allocator.bindings() == []


# ---- the spec's env, by file ----


def test_shim_puts_the_spec_env_file_into_the_commands_environment(
    tmp_path: Path, allocation: Allocation
) -> None:
    env_file = tmp_path / "a.env.json"
    write_atomically(env_file, json.dumps({"HERD_TEST_SECRET": "s3cret value"}), mode=0o600)
    env = {
        **allocation.env(),
        ENV_FILE_ENV: str(env_file),
        "HOROVOD_HOSTNAME": "localhost",
        "HOROVOD_LOCAL_RANK": "0",
    }
    code, out, err = finish(shim(tmp_path, env, sys.executable, "-c", SHOW_ENV))
    assert (code, err) == (0, "")
    seen = json.loads(out)
    assert seen["HERD_TEST_SECRET"] == "s3cret value"
    assert ENV_FILE_ENV not in seen
    assert seen["CUDA_VISIBLE_DEVICES"] == "1,2"


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot read the job's env file"),
        ("{not json s3cret", "is malformed"),
        ('{"A": 1}', "is not an object of strings"),
    ],
    ids=["missing", "not-json", "not-strings"],
)
def test_shim_refuses_a_bad_env_file_without_quoting_it(
    tmp_path: Path, content: str | None, problem: str
) -> None:
    env_file = tmp_path / "a.env.json"
    if content is not None:
        write_atomically(env_file, content, mode=0o600)
    code, out, err = finish(
        shim(tmp_path, {ENV_FILE_ENV: str(env_file)}, sys.executable, "-c", SHOW_ENV)
    )
    assert (code, out) == (1, "")
    assert err.startswith("herd shim: ") and problem in err
    assert "s3cret" not in err


def test_a_node_exporter_registers_its_own_host_only(allocation: Allocation) -> None:
    address = allocation.server.address
    with RpcClient(
        address, agent_key(allocation.master, "node1"), identity=agent_identity("node1")
    ) as agent:
        assert agent.call("register_exporter", host="node1", port=9100) == {}
        with pytest.raises(RpcError) as other_host:
            agent.call("register_exporter", host="node2", port=9100)
        with pytest.raises(RpcError) as bind:
            agent.call("bind", job="a", host="node1", local_rank=0)
        assert set(agent.call("placements")["placements"]) == {"a", "x"}
    assert other_host.value.code == bind.value.code == "forbidden"
    assert other_host.value.message == "agent:node1 may only register host 'node1', not 'node2'"
    assert allocation.exporters.urls() == ["http://node1:9100/metrics"]


def test_an_agents_key_cannot_speak_for_another_host(allocation: Allocation) -> None:
    """node1's agent key proves agent:node1 only: claiming node2 (to keep a dead node2 from
    being cordoned, or to point its scrape target elsewhere) fails the handshake."""
    key = agent_key(allocation.master, "node1")
    for claimed in (agent_identity("node2"), ADMIN, job_identity("a")):
        with (
            RpcClient(allocation.server.address, key, identity=claimed) as client,
            pytest.raises(AuthError),
        ):
            client.call("register_exporter", host="node2", port=9100)
    with RpcClient(allocation.server.address, key, identity=agent_identity("node1")) as client:
        assert client.call("register_exporter", host="node1", port=9100) == {}
    assert allocation.exporters.urls() == ["http://node1:9100/metrics"]


def test_a_node_exporter_that_stops_leaves_the_targets_at_once(allocation: Allocation) -> None:
    address = allocation.server.address
    with (
        RpcClient(
            address, agent_key(allocation.master, "node1"), identity=agent_identity("node1")
        ) as one,
        RpcClient(
            address, agent_key(allocation.master, "node2"), identity=agent_identity("node2")
        ) as two,
    ):
        one.call("register_exporter", host="node1", port=9100)
        two.call("register_exporter", host="node2", port=9100)
        with pytest.raises(RpcError) as other_host:
            two.call("unregister_exporter", host="node1", port=9100)
        assert one.call("unregister_exporter", host="node1", port=9100) == {}
    assert other_host.value.code == "forbidden"
    assert allocation.exporters.urls() == ["http://node2:9100/metrics"]
    targets = json.loads(allocation.layout.scrape_targets_file.read_text())
    assert targets == [{"targets": ["node2:9100"], "labels": {"herd_role": "exporter"}}]


def test_a_job_may_not_register_exporters_nor_read_every_placement(
    allocation: Allocation,
) -> None:
    key = read_token_file(Path(allocation.env("a")[TOKEN_FILE_ENV]))
    with RpcClient(allocation.server.address, key, identity=job_identity("a")) as client:
        for op, args in (("register_exporter", {"host": "evil", "port": 1}), ("placements", {})):
            with pytest.raises(RpcError) as caught:
                client.call(op, **args)
            assert caught.value.code == "forbidden", op
    assert allocation.exporters.urls() == []


def test_a_host_with_a_newline_never_reaches_the_scrape_targets(allocation: Allocation) -> None:
    with RpcClient(allocation.server.address, allocation.master) as admin:
        for host in ("node1\n- targets: [evil:1]", "node1 evil", "evil/x", '"evil"'):
            with pytest.raises(RpcError) as caught:
                admin.call("register_exporter", host=host, port=9100)
            assert caught.value.code == "bad_request"
        admin.call("register_exporter", host="node1", port=9100)
    targets = json.loads(allocation.layout.scrape_targets_file.read_text())
    assert targets == [{"targets": ["node1:9100"], "labels": {"herd_role": "exporter"}}]


def test_an_exporter_that_stops_registering_expires_from_the_targets(tmp_path: Path) -> None:
    targets_file = tmp_path / "targets.json"
    now = [1000.0]
    registry = ExporterRegistry(targets_file, "op:9410", clock=lambda: now[0])
    registry({"host": "node1", "port": 9411})
    registry({"host": "node2", "port": 9411})

    def exporters() -> list[str]:
        groups = json.loads(targets_file.read_text())
        return [t for group in groups if group["labels"]["herd_role"] == "exporter"
                for t in group["targets"]]  # fmt: skip

    assert exporters() == ["node1:9411", "node2:9411"]
    # node1's agent registers every REGISTER_EVERY_SECONDS; node2's stopped.
    while now[0] + REGISTER_EVERY_SECONDS <= 1000.0 + EXPORTER_EXPIRY_SECONDS:
        now[0] += REGISTER_EVERY_SECONDS
        registry({"host": "node1", "port": 9411})
    now[0] = 1000.0 + EXPORTER_EXPIRY_SECONDS
    assert registry.expire() == []  # the limit since node2's last word: not past it yet
    now[0] += 1
    assert registry.expire() == ["node2:9411"]
    assert exporters() == ["node1:9411"]
    assert registry.urls() == ["http://node1:9411/metrics"]
    assert json.loads(targets_file.read_text())[0]["targets"] == ["op:9410"]
    # Back again: registered anew.
    registry({"host": "node2", "port": 9411})
    assert exporters() == ["node1:9411", "node2:9411"]


def test_exporters_expire_only_after_missing_several_registrations() -> None:
    assert EXPORTER_EXPIRY_SECONDS >= 3 * REGISTER_EVERY_SECONDS


def test_shim_without_its_key_says_so_in_one_line(tmp_path: Path, allocation: Allocation) -> None:
    env = {**allocation.env(), TOKEN_FILE_ENV: str(tmp_path / "missing.token")}
    code, out, err = finish(shim(tmp_path, env, sys.executable, "-c", SHOW_ENV))
    assert (code, out) == (1, "")
    assert err.startswith("herd shim: cannot open token file ") and err.count("\n") == 1
