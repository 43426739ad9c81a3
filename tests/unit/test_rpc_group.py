"""Grouped ops: the requests of one loop turn share one store commit, answered after it."""

from __future__ import annotations

import contextlib
import logging
import re
import select
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from herd_operator.auth import Identity
from herd_operator.layout import StateLayout
from herd_operator.rpc.protocol import BadRequest
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import GROUPED_OPS, ReportHandler, for_own_job, store_group
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Pool
from tests.unit.full_disk import fail_commits, refuse_writes
from tests.unit.test_rpc import GUARD_S, TOKEN, RawPeer
from tests.unit.test_store import make_spec

JOB = "train"


class Gate:
    """A real store's commit group that can be held shut and made to fail (SQLite rolls the
    group back, as on an I/O error: the store's exit then raises its StoreError), and that
    records the size of every group."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.sizes: list[int] = []
        self.in_group = 0
        self.exiting = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.fail_group: int | None = None
        """The number of the group (from 1) whose commit fails."""

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        self.in_group = 0
        with self.store.transaction():
            yield
            self.sizes.append(self.in_group)
            self.exiting.set()
            assert self.release.wait(GUARD_S)
            if len(self.sizes) == self.fail_group:
                self.store._conn.execute("ROLLBACK")

    def hold(self, peer: RawPeer, epoch: int) -> None:
        """``peer`` reports ``epoch``; return once its group's commit is held shut."""
        self.release.clear()
        peer.send({"id": 1, "op": "report", "args": {"epoch": epoch}})
        assert self.exiting.wait(GUARD_S)  # the handler ran; the commit is held
        self.exiting.clear()

    def report(self, args: dict[str, Any], caller: Identity) -> dict[str, Any]:
        self.in_group += 1
        epoch = args.get("epoch")
        if not isinstance(epoch, int):
            raise BadRequest("'epoch' must be an integer")
        self.store.add_report(JOB, epoch, 1, 0, {}, time.time())
        return {"epoch": epoch}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store(tmp_path / "state.db") as opened:
        opened.record_spec(JOB, "jobs/train.yaml", make_spec(name=JOB), "fp", time.time())
        yield opened


@pytest.fixture
def gated(store: Store) -> Iterator[tuple[RpcServer, Gate]]:
    gate = Gate(store)
    handlers = {"report": gate.report, "ping": lambda args, caller: {"pong": True}}
    with RpcServer(TOKEN, handlers, grouped_ops={"report"}, commit_group=gate.group) as server:
        yield server, gate


def _peers(server: RpcServer, count: int) -> list[RawPeer]:
    peers = [RawPeer.connect(server.address) for _ in range(count)]
    for peer in peers:
        peer.authenticate()
    return peers


def _committed_epochs(path: Path) -> list[int]:
    """What another connection to the database sees: only committed reports."""
    with Store.open_readonly(path) as reader:
        return sorted(report.epoch or 0 for report in reader.reports(JOB))


def test_a_reply_is_sent_only_after_its_group_is_committed(
    gated: tuple[RpcServer, Gate], store: Store
) -> None:
    server, gate = gated
    (peer,) = _peers(server, 1)
    try:
        gate.hold(peer, 7)
        # The reply would be on the socket by now had it been written before the commit.
        assert select.select([peer.sock], [], [], 0.2)[0] == []
        assert _committed_epochs(store.path) == []
        gate.release.set()
        assert peer.read() == {"id": 1, "ok": True, "result": {"epoch": 7}}
        assert _committed_epochs(store.path) == [7]
    finally:
        gate.release.set()
        peer.close()


def test_requests_of_one_loop_turn_share_one_commit(gated: tuple[RpcServer, Gate]) -> None:
    server, gate = gated
    first, *others = _peers(server, 6)
    try:
        gate.hold(first, 0)
        # The loop is held in the first group's commit: these five arrive meanwhile and are
        # all read in the loop's next turn.
        for index, peer in enumerate(others, start=1):
            peer.send({"id": 1, "op": "report", "args": {"epoch": index}})
        gate.release.set()
        assert [peer.read() for peer in [first, *others]] == [
            {"id": 1, "ok": True, "result": {"epoch": index}} for index in range(6)
        ]
        assert gate.sizes == [1, 5]
        assert server.request_counts() == {("report", "ok"): 6}
    finally:
        gate.release.set()
        for peer in [first, *others]:
            peer.close()


def test_a_failed_commit_fails_every_served_request_of_the_group(
    gated: tuple[RpcServer, Gate], store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    server, gate = gated
    first, *others = _peers(server, 4)
    try:
        gate.hold(first, 0)
        for index, peer in enumerate(others[:2], start=1):
            peer.send({"id": 1, "op": "report", "args": {"epoch": index}})
        others[2].send({"id": 1, "op": "report", "args": {"epoch": "three"}})
        gate.fail_group = 2
        with caplog.at_level(logging.ERROR, logger="herd_operator.rpc"):
            gate.release.set()  # the first group commits; the second's commit fails
            assert first.read() == {"id": 1, "ok": True, "result": {"epoch": 0}}
            internal = {"code": "internal", "message": "internal error in op 'report'"}
            assert [peer.read() for peer in others] == [
                {"id": 1, "ok": False, "error": internal},
                {"id": 1, "ok": False, "error": internal},
                {
                    "id": 1,
                    "ok": False,
                    "error": {"code": "bad_request", "message": "'epoch' must be an integer"},
                },
            ]
        assert gate.sizes == [1, 3]
        assert _committed_epochs(store.path) == [0]
        assert "a failed write rolled back the group" in caplog.text
        assert server.request_counts() == {
            ("report", "ok"): 1,
            ("report", "internal"): 2,
            ("report", "bad_request"): 1,
        }
        # The connections stay usable, and the next group commits.
        others[0].send({"id": 2, "op": "report", "args": {"epoch": 9}})
        assert others[0].read() == {"id": 2, "ok": True, "result": {"epoch": 9}}
        assert _committed_epochs(store.path) == [0, 9]
    finally:
        gate.release.set()
        for peer in [first, *others]:
            peer.close()


def test_pipelined_requests_are_answered_in_order_around_a_group(
    gated: tuple[RpcServer, Gate],
) -> None:
    server, gate = gated
    (peer,) = _peers(server, 1)
    try:
        frames = [
            b'{"id":1,"op":"report","args":{"epoch":1}}',
            b'{"id":2,"op":"ping"}',
            b'{"id":3,"op":"report","args":{"epoch":3}}',
            b'{"id":4,"op":"ping"}',
        ]
        peer.sock.sendall(b"\n".join(frames) + b"\n")  # one segment: read in one turn
        replies = [peer.read() for _ in frames]
        assert [reply["id"] for reply in replies if reply is not None] == [1, 2, 3, 4]
        assert all(reply is not None and reply["ok"] for reply in replies)
        # A connection's next request waits for its group: one report per group here.
        assert gate.sizes == [1, 1]
    finally:
        peer.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grouped_ops": {"ping"}}, "give both or neither"),
        ({"commit_group": contextlib.nullcontext}, "give both or neither"),
        (
            {"grouped_ops": {"reprot"}, "commit_group": contextlib.nullcontext},
            "grouped_ops ['reprot'] name no handler; handlers: ['ping']",
        ),
    ],
)
def test_grouping_options_are_checked(options: dict[str, Any], message: str) -> None:
    ping: Callable[[dict[str, Any], Identity], dict[str, Any]] = lambda args, caller: {}  # noqa: E731
    with pytest.raises(ValueError, match=re.escape(message)):
        RpcServer(TOKEN, {"ping": ping}, **options)


@pytest.mark.parametrize("unwritable", [fail_commits, refuse_writes], ids=["full", "read-only"])
def test_reports_on_a_full_disk_are_refused_without_a_traceback_each(
    store: Store,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    unwritable: Callable[[Store], None],
) -> None:
    """The operator's report handler and group commit on a store that refuses writes: each
    report gets an internal error (its worker reports again at its next epoch), and the log
    gets the store's `writes fail`, not a traceback per group or request."""
    allocator = Allocator(
        Pool.from_counts({"localhost": 1}), GrantPublisher(StateLayout(tmp_path)), virtual=True
    )
    handler = for_own_job(ReportHandler(store, allocator, wake=lambda job: None))
    unwritable(store)
    with (
        caplog.at_level(logging.DEBUG),
        RpcServer(
            TOKEN,
            {"report": handler},
            grouped_ops=GROUPED_OPS,
            commit_group=lambda: store_group(store),
        ) as server,
    ):
        (peer,) = _peers(server, 1)
        try:
            internal = {"code": "internal", "message": "internal error in op 'report'"}
            for epoch in range(5):
                peer.send({"id": epoch, "op": "report", "args": {"job": JOB, "world_size": 1}})
                assert peer.read() == {"id": epoch, "ok": False, "error": internal}
        finally:
            peer.close()
    assert server.request_counts() == {("report", "internal"): 5}
    assert not store.writable
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(said) == 1 and "writes fail" in said[0], said
    assert not [r for r in caplog.records if r.exc_info and r.levelno >= logging.WARNING]
