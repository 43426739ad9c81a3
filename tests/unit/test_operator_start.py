"""What the operator sets up for itself before it serves, and what a refused start undoes."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import resource
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from herd_operator.auth import agent_key, read_token_file
from herd_operator.layout import StateLayout, make_runtime_dir
from herd_operator.policies.queueing import QueueConfig
from herd_operator.runtime.config import OperatorConfig, OperatorError
from herd_operator.runtime.operator import Operator, raise_descriptor_limit
from herd_operator.runtime.pools import StaticPool
from herd_operator.specs import ConditionStatus, ConditionType, HerdJob, set_condition
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Pool
from tests.unit.full_disk import refuse_writes

GUARD_S = 30.0
"""Hang guard for waiting on the operator; never a performance expectation."""


def test_the_operator_lifts_its_open_file_limit_within_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
        got = raise_descriptor_limit(4096)
        expected = 4096 if hard == resource.RLIM_INFINITY else min(4096, hard)
        assert got == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def refused_start_config(tmp_path: Path, **options: Any) -> OperatorConfig:
    options.setdefault("pool", StaticPool(Pool.from_counts({"localhost": 1}), True, "test pool"))
    return OperatorConfig(
        specs_dir=tmp_path / "specs",
        state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "runtime",
        **options,
    )


def rpc_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("rpc-")]


def test_a_damaged_store_refuses_the_start_and_the_start_leaves_nothing_behind(
    tmp_path: Path,
) -> None:
    config = refused_start_config(tmp_path)
    database = StateLayout(config.state_dir).database
    database.parent.mkdir(parents=True)
    database.write_bytes(b"not a database, " * 100)
    for _ in range(2):  # the first released the state dir's lock: the second gets as far
        with pytest.raises(OperatorError) as refused:
            Operator(config).run(threading.Event())
        assert str(refused.value).startswith(
            f"state store {database} is damaged: file is not a database."
        )
    assert list((tmp_path / "runtime").iterdir()) == []
    assert not StateLayout(config.state_dir).runtime_record.exists()


def test_a_store_truncated_to_0_bytes_refuses_the_start(tmp_path: Path) -> None:
    config = refused_start_config(tmp_path)
    layout = StateLayout(config.state_dir)
    layout.root.mkdir(parents=True)
    layout.token_file.write_text("from the run that set the store up")
    layout.database.write_bytes(b"")
    with pytest.raises(OperatorError, match=r"is damaged: it is empty \(0 bytes\), yet"):
        Operator(config).run(threading.Event())
    assert layout.database.stat().st_size == 0


def test_a_start_refused_for_a_port_in_use_stops_its_servers_and_keeps_a_crashed_runs_dir(
    tmp_path: Path,
) -> None:
    base = tmp_path / "runtime"
    crashed = make_runtime_dir(base)  # a crashed operator's, named in the record
    layout = StateLayout(tmp_path / "state")
    layout.root.mkdir(parents=True)
    layout.runtime_record.write_text(f"{crashed}\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = refused_start_config(tmp_path, metrics_port=taken.getsockname()[1])
        with pytest.raises(OSError):
            Operator(config).run(threading.Event())
    assert list(base.iterdir()) == [crashed]  # for the next start to deal with
    assert layout.runtime_record.read_text() == f"{crashed}\n"
    assert rpc_threads() == []


def test_a_shutdown_the_store_cannot_record_still_removes_the_runtime_dir_and_endpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store refuses writes for real (SQLITE_READONLY, see tests/unit/full_disk.py)."""
    operator = Operator(refused_start_config(tmp_path))
    operator._open()
    store, layout = operator.store, operator.layout
    assert store is not None and layout.runtime is not None
    job = HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": "a"},
            "spec": {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 1}},
        }
    )
    store.record_spec("a", "a.yaml", job, "fp", 1.0)
    running = set_condition((), ConditionType.Running, ConditionStatus.TRUE, "Started", "", 1, 1.0)
    store.put_status("a", HerdJobStatus(conditions=running), 1.0)
    refuse_writes(store)

    operator._shutdown()

    assert not layout.runtime.exists() and not layout.runtime_record.exists()
    assert not layout.endpoint_file.exists()
    assert rpc_threads() == []
    said = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("cannot record the shutdown in the state store") for m in said)
    assert any(m.startswith("cannot record in the state store that every GPU") for m in said)


def test_a_running_operator_prunes_a_deleted_jobs_history_and_log(tmp_path: Path) -> None:
    """The settings reach the store and the pruner: a job deleted before this start (no
    record, a grant history and a log) is gone after a walk."""
    config = refused_start_config(
        tmp_path,
        deleted_job_retention_seconds=0.0,
        prune_interval_seconds=0.05,
        grant_history_per_job=5,
        metrics_port=None,
    )
    layout = StateLayout(config.state_dir)
    layout.create()
    gone = layout.log_file("gone")
    gone.write_text("its output\n")
    config.specs_dir.mkdir()
    with running_operator(config) as operator:
        assert operator.store is not None
        operator.store.add_grant_change("gone", 1, "admitted", 1.0)
        for step in range(7):
            operator.store.add_grant_change("kept", step, "resized", 2.0 + step)
        deadline = time.monotonic() + GUARD_S
        while gone.exists() or operator.store.grant_history("gone"):
            assert time.monotonic() < deadline, "the deleted job's log and history stayed"
            time.sleep(0.05)
        # "kept" is pruned too (no record): its event, which outlives it, shows the bound.
        (trimmed,) = [e for e in operator.store.events("kept") if e.reason == "GrantHistoryTrimmed"]
        assert "the newest 5 grant changes" in trimmed.message


@contextlib.contextmanager
def running_operator(config: OperatorConfig) -> Iterator[Operator]:
    """An operator started in a thread and up; stopped, and checked gone, on leaving."""
    operator = Operator(config)
    stop = threading.Event()
    runner = threading.Thread(target=operator.run, args=(stop,))
    runner.start()
    try:
        assert operator.ready.wait(GUARD_S), "the operator did not start"
        yield operator
    finally:
        stop.set()
        runner.join(GUARD_S)
    assert not runner.is_alive()


def test_each_pool_host_gets_its_own_private_agent_key_and_the_shared_one_goes(
    tmp_path: Path,
) -> None:
    pool = StaticPool(Pool.from_counts({"nid001": 1, "nid002": 1}), True, "two hosts")
    config = refused_start_config(tmp_path, metrics_port=None, pool=pool)
    config.specs_dir.mkdir()
    layout = StateLayout(config.state_dir)
    layout.create()
    layout.legacy_agent_token_file.write_text("ab" * 32 + "\n")  # an older operator's
    with running_operator(config):
        pass
    master = read_token_file(layout.token_file)
    for host in ("nid001", "nid002"):
        key_file = layout.agent_token_file(host)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert read_token_file(key_file) == agent_key(master, host)
    assert not layout.legacy_agent_token_file.exists()

    # Agents that get their keys on stdin: none is left on the (shared) state dir.
    with running_operator(dataclasses.replace(config, agent_key_files=False)):
        pass
    assert not any(layout.secrets_dir.glob("agent*"))


def test_the_allocator_options_of_run_reach_the_operators_allocator(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`herd-operator run --spare-by-gain --smallest-first --max-wait 90`, then
    `--share-by-gain`: the real command line starts the real operator, stopped as soon as it
    is up, whose allocator has them."""
    cli = importlib.import_module("herd_operator.cli.main")  # the package's `main` is the function
    run_command = importlib.import_module("herd_operator.cli.run")
    started: list[Operator] = []
    original = Operator.run

    def run_then_stop(self: Operator, stop: threading.Event) -> int:
        started.append(self)
        stop.set()
        return original(self, stop)

    monkeypatch.setattr(Operator, "run", run_then_stop)
    # The real handlers would stay installed in the test process after the command returns.
    monkeypatch.setattr(run_command, "stop_on_signals", threading.Event)
    common = ["--hosts", "localhost:2", "--virtual-gpus", "2", "--metrics-port", "0"]
    common += ["--specs-dir", str(tmp_path / "specs"), "--runtime-dir", str(tmp_path / "run")]
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "plain")]) == 0
    flags = ["--spare-by-gain", "--smallest-first", "--max-wait", "90"]
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "opt"), *flags]) == 0
    plain, opted = (operator.allocator for operator in started)
    assert plain is not None and opted is not None
    assert (plain.spare_by_gain, plain.smallest_first, plain.max_wait_seconds) == (
        False, False, 4 * 3600.0
    )  # fmt: skip
    assert (opted.spare_by_gain, opted.smallest_first, opted.max_wait_seconds) == (
        True, True, 90.0
    )  # fmt: skip
    shared = ["--share-by-gain"]
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "share"), *shared]) == 0
    by_gain = started[-1].allocator
    assert by_gain is not None and (by_gain.share_by_gain, by_gain.spare_by_gain) == (True, False)
    assert not plain.share_by_gain
    # The two ways of dividing by gain are one or the other: argparse refuses both.
    with pytest.raises(SystemExit):
        cli.main(["run", *common, "--spare-by-gain", "--share-by-gain"])
    by_speedup = ["--share-by-speedup"]
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "speedup"), *by_speedup]) == 0
    divided = started[-1].allocator
    assert divided is not None and (divided.share_by_speedup, divided.share_by_gain) == (
        True,
        False,
    )
    assert not plain.share_by_speedup
    with pytest.raises(SystemExit):
        cli.main(["run", *common, "--share-by-gain", "--share-by-speedup"])
    assert started[0].config.queue is None  # fifo: no queue, no preemption
    queued = ["--queue", "srpt", "--queue-min-run", "5"]
    caplog.set_level(logging.INFO, logger="herd_operator")
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "srpt"), *queued]) == 0
    assert started[-1].config.queue == QueueConfig("srpt", min_run_seconds=5.0)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pool: ")]
    assert "; queue srpt (preempting after 5 s of a run, at most 8 times" in logged[-1]
    assert "; GPUs not shared; specs from" in logged[-1]
    sharing = ["--share-gpus", "--share-whole-first", "--share-shrink-to-admit"]
    assert cli.main(["run", *common, "--state-dir", str(tmp_path / "shared"), *sharing]) == 0
    limits = started[-1].config.sharing
    assert limits is not None and (limits.whole_first, limits.shrink_to_admit) == (True, True)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pool: ")]
    assert (
        "; GPUs shared by memory (2.0Gi each, at most 4 jobs per GPU, margin 10%, no utilization"
        " cap, whole GPUs first, shrinking sharing jobs to admit); specs from"
    ) in logged[-1]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["run", *common, "--queue", "sjf"])
    assert "argument --queue: invalid choice: 'sjf'" in capsys.readouterr().err


def test_a_start_refused_after_the_store_opened_leaves_no_endpoint_nor_runtime_dir(
    tmp_path: Path,
) -> None:
    """Issue 26, item 3: `--specs-dir` naming a regular file is refused once the operator has
    opened its store, written its endpoint file and made its runtime dir. The refused start
    left `allocator.json` (with its dead pid), the `runtime-dir` record and the runtime dir
    with its grants behind; it must undo them, and a second start then works."""
    config = refused_start_config(tmp_path, metrics_port=None)
    config.specs_dir.write_text("not a directory\n")
    layout = StateLayout(config.state_dir)
    with pytest.raises(NotADirectoryError):
        Operator(config).run(threading.Event())
    assert not layout.endpoint_file.exists()
    assert not layout.runtime_record.exists()
    assert list((tmp_path / "runtime").iterdir()) == []
    assert not layout.grants_dir.exists()
    assert rpc_threads() == []

    config.specs_dir.unlink()
    config.specs_dir.mkdir()
    with running_operator(config) as operator:
        assert operator.layout.runtime is not None and operator.layout.grants_dir.is_dir()
        assert layout.endpoint_file.exists()
    assert not layout.endpoint_file.exists()
    assert list((tmp_path / "runtime").iterdir()) == []


def test_a_refused_start_puts_back_the_endpoint_file_a_crashed_operator_left(
    tmp_path: Path,
) -> None:
    """The workers of a crashed operator's jobs know the port in its endpoint file, which the
    next start listens on again: a start refused after it wrote its own file puts that one
    back (it wrote over it), for the start after it."""
    layout = StateLayout(tmp_path / "state")
    layout.root.mkdir(parents=True)
    config = refused_start_config(tmp_path, metrics_port=None)
    config.specs_dir.write_text("not a directory\n")
    with socket.socket() as taken:  # the crashed operator's port, still held: not reused
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        crashed = f'{{"address": "127.0.0.1:{taken.getsockname()[1]}", "pid": 2147483646}}'
        layout.endpoint_file.write_text(crashed)
        with pytest.raises(NotADirectoryError):
            Operator(config).run(threading.Event())
    assert layout.endpoint_file.read_text() == crashed
    assert rpc_threads() == []
