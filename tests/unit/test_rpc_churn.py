"""The RPC server's pool of unauthenticated connections under churn (issue 27.6): who gets a
place and who loses one (the pure decision and the pool, with hypothesis), the peek that
keeps a hello waiting unread, and a real flood of connections that never answer and
reconnect the moment they are dropped, from the workers' own address."""

from __future__ import annotations

import errno
import multiprocessing
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.synchronize import Event
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from herd_operator.auth import Identity
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.pool import UnauthenticatedPool, choose_victim
from herd_operator.rpc.protocol import RpcError
from herd_operator.rpc.server import RpcServer

TOKEN = bytes(range(32))
# Hang guard for every blocking step; never a performance expectation.
GUARD_S = 30.0


# --- the decision -------------------------------------------------------------------------


@given(
    silent_age=st.none() | st.floats(min_value=0, max_value=10),
    speaking=st.booleans(),
    eviction_age=st.floats(min_value=0.001, max_value=5),
    forced=st.booleans(),
)
def test_who_loses_a_place(
    silent_age: float | None, speaking: bool, eviction_age: float, forced: bool
) -> None:
    now = 100.0
    oldest_silent = None if silent_age is None else ("silent", now - silent_age)
    victim = choose_victim(
        oldest_silent,
        "speaking" if speaking else None,
        now=now,
        eviction_age=eviction_age,
        forced=forced,
    )
    if oldest_silent is not None and (forced or now - oldest_silent[1] >= eviction_age):
        assert victim == "silent"  # a silent one always goes first
    elif forced:
        assert victim == ("speaking" if speaking else None)  # forced: the oldest place turns
    else:
        assert victim is None  # a speaking one, or a young silent one, keeps its place


# --- the pool, with members that are data -------------------------------------------------


@dataclass(eq=False)
class Member:
    number: int
    peer: str = "127.0.0.1:1"
    admitted: float = 0.0
    has_unread: bool = False
    events: list[str] = field(default_factory=list)

    def greet(self) -> None:
        self.events.append("greeted")

    def evict(self) -> None:
        self.events.append("evicted")

    def refuse(self, reason: str) -> None:
        self.events.append("refused")

    def unread(self) -> bool:
        return self.has_unread


class PoolRun:
    """A pool driven by a sequence of steps, recording each member's admission number."""

    def __init__(self, capacity: int, eviction_age: float) -> None:
        self.now = 0.0
        self.capacity = capacity
        self.eviction_age = eviction_age
        self.pool = UnauthenticatedPool(capacity, eviction_age, lambda: self.now)
        self.members: list[Member] = []
        self.admissions: dict[int, int] = {}
        """Member number -> how many admissions came before its own."""
        self.admitted = 0
        self.spoken: set[int] = set()

    def settle(self) -> None:
        """Record who was admitted (greeted) since the last step."""
        for member in self.members:
            if "greeted" in member.events and member.number not in self.admissions:
                self.admissions[member.number] = self.admitted
                self.admitted += 1

    def gone(self, member: Member) -> bool:
        return bool({"evicted", "refused", "left"} & set(member.events))


STEPS = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "arrive", "tick", "speak", "leave", "unread"]),
        st.integers(min_value=0, max_value=10_000),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    steps=STEPS,
    capacity=st.integers(min_value=1, max_value=6),
    line_room=st.integers(min_value=0, max_value=8),
)
def test_the_pool_keeps_its_bounds_and_gives_each_place_its_time_or_its_arrivals(
    steps: list[tuple[str, int]], capacity: int, line_room: int
) -> None:
    """Whatever arrives, speaks, leaves or ages: the pool never holds more than its
    capacity, the line waits only while the pool is full, a hello waiting unread and a
    connection that has left are never dropped, and a silent connection loses its place
    only once it is older than the eviction age or ``capacity - 1`` later ones have got
    theirs (a speaking one only when none is silent)."""
    run = PoolRun(capacity, eviction_age=1.0)
    pool = run.pool
    for action, pick in steps:
        live = [m for m in run.members if not run.gone(m) and "greeted" in m.events]
        seen = {m.number: len(m.events) for m in run.members}
        if action == "arrive":
            member = Member(len(run.members))
            run.members.append(member)
            pool.arrive(member, run.now, line_room=line_room)
        elif action == "tick":
            run.now += (pick % 7) * 0.25
            pool.recheck(run.now)
        elif action == "speak" and live:
            member = live[pick % len(live)]
            run.spoken.add(member.number)
            pool.spoke(member)
        elif action == "unread" and live:
            live[pick % len(live)].has_unread = True
        elif action == "leave" and live:
            member = live[pick % len(live)]
            member.events.append("left")
            pool.release(member)
        run.settle()
        new = {m.number: m.events[seen.get(m.number, 0) :] for m in run.members}
        after = [m for m in run.members if not run.gone(m) and "greeted" in m.events]
        speaking = {m.number for m in after if m.number in run.spoken or m.has_unread}
        for member in run.members:
            if "evicted" not in new[member.number]:
                continue
            assert not member.has_unread, "a hello waiting unread was dropped"
            assert "left" not in member.events
            if member.number in run.spoken:
                # Only when no place is silent, but those given in this very step.
                assert all("greeted" in new[m.number] for m in after if m.number not in speaking), (
                    "a speaking connection was dropped while a silent one held a place"
                )
                continue
            own = run.admissions[member.number]
            older_speaking = any(run.admissions[m] < own for m in speaking)
            # Admissions after its own, before its replacement's.
            later = run.admitted - 2 - own
            assert (
                run.now - member.admitted >= run.eviction_age
                or older_speaking
                or later >= capacity - 1
            ), f"dropped after {later} later admissions at age {run.now - member.admitted}"
        assert len(pool) == len(after) <= capacity
        assert pool.waiting() == 0 or len(pool) == capacity
        assert pool.waiting() <= line_room


def test_a_hello_waiting_unread_is_never_dropped_and_the_next_place_goes() -> None:
    run = PoolRun(capacity=2, eviction_age=1.0)
    first, second, newcomer = Member(0), Member(1), Member(2)
    run.pool.arrive(first, 0.0, line_room=10)
    run.pool.arrive(second, 0.0, line_room=10)
    first.has_unread = True  # its hello came while the server's loop was busy accepting
    run.pool.arrive(newcomer, 5.0, line_room=10)
    assert first.events == ["greeted"]
    assert second.events == ["greeted", "evicted"]
    assert newcomer.events == ["greeted"]


def test_a_waiter_takes_the_oldest_place_at_its_deadline_and_a_full_line_at_once() -> None:
    run = PoolRun(capacity=2, eviction_age=1.0)
    members = [Member(n) for n in range(5)]
    for member in members[:3]:
        run.pool.arrive(member, 0.0, line_room=2)
    assert members[2].events == []  # waits: both places are young
    run.pool.expire(members[2], 0.5)  # its max_wait is over: the oldest place, young as it is
    assert members[0].events == ["greeted", "evicted"]
    assert members[2].events == ["greeted"]
    run.pool.arrive(members[3], 0.6, line_room=0)  # no room to wait: takes a place at once
    assert members[1].events == ["greeted", "evicted"]
    assert members[3].events == ["greeted"]
    for member in members[2:4]:
        member.has_unread = True  # every place's hello waits unread: nobody can be dropped
    run.pool.arrive(members[4], 0.7, line_room=0)
    assert members[4].events == ["refused"]


# --- the peek ------------------------------------------------------------------------------


def test_the_peek_sees_bytes_waiting_and_leaves_them_there() -> None:
    from herd_operator.rpc.connection import Connection

    class Transport:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> Any:
            assert name == "socket"
            return self.sock

    ours, theirs = socket.socketpair()
    try:
        connection = Connection.__new__(Connection)
        connection._transport = Transport(ours)  # type: ignore[assignment]
        connection._closing = False
        assert connection.unread() is False
        theirs.sendall(b'{"type":"auth"}\n')
        assert connection.unread() is True
        assert ours.recv(64) == b'{"type":"auth"}\n'  # still there for the loop to read
        assert ours.fileno() >= 0  # the peek closed nothing
    finally:
        ours.close()
        theirs.close()


# --- a real flood ------------------------------------------------------------------------


def _churn(port: int, count: int, until: float, full: Event, stop: Event) -> None:
    """The flood (in a process of its own): ``count`` connections from 127.0.0.1 that never
    send a byte, each replaced the moment the server drops it, until ``stop`` or ``until``."""
    selector = selectors.DefaultSelector()

    def open_one() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS):
            selector.register(sock, selectors.EVENT_READ)
        else:
            sock.close()

    for _ in range(count):
        open_one()
    while not stop.is_set() and time.monotonic() < until:
        for key, _ in selector.select(0.05):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                if sock.recv(4096):
                    continue  # a challenge, never answered
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            full.set()
            open_one()
        while len(selector.get_map()) < count:
            open_one()
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]


@pytest.fixture
def churning() -> Iterator[Callable[[int, int], None]]:
    """Starts a flood of N churning connections against a port; stopped after the test."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    floods: list[Any] = []

    def start(port: int, count: int) -> None:
        full = context.Event()
        flood = context.Process(
            target=_churn,
            args=(port, count, time.monotonic() + 4 * GUARD_S, full, stop),
            daemon=True,
        )
        flood.start()
        floods.append(flood)
        assert full.wait(GUARD_S), "the flood never filled the pool"

    yield start
    stop.set()
    for flood in floods:
        flood.join(GUARD_S)
        if flood.is_alive():
            flood.kill()


def _ping(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
    return {"pong": True}


def test_fresh_clients_get_in_while_strangers_on_their_address_churn(
    churning: Callable[[int, int], None],
) -> None:
    """Issue 27.6: connections that never answer, each reopened the moment it is dropped,
    from the workers' own address, made fresh workers fail with ``busy`` (they waited out
    their handshake deadline in a line the flood kept full, and went back to its end).
    Every one of 100 fresh clients must get in (each as a worker would: its retries, a
    5 s budget for its connect)."""
    with RpcServer(
        TOKEN,
        {"ping": _ping},
        max_unauthenticated=128,
        eviction_age=0.5,
        handshake_timeout=1.0,
    ) as server:
        churning(server.address[1], 1024)

        def call(index: int) -> str | None:
            try:
                with RpcClient(
                    server.address, TOKEN, client=f"fresh-{index}", timeout=5.0
                ) as client:
                    client.call("ping")
            except (RpcError, OSError) as error:
                return f"{type(error).__name__}: {error}"
            return None

        with ThreadPoolExecutor(max_workers=20) as pool:
            failures = [error for error in pool.map(call, range(100)) if error is not None]
        assert failures == [], f"{len(failures)} of 100 failed, e.g. {failures[:3]}"
        assert server.request_counts() == {("ping", "ok"): 100}


def test_strangers_waiting_cannot_take_the_places_of_authenticated_connections(
    churning: Callable[[int, int], None],
) -> None:
    """With every place of ``max_connections`` but one held by an authenticated connection,
    a flood waits in that one place's line, and a fresh client still gets in (it was refused
    as ``unavailable``, which no client retries, once strangers filled the limit)."""
    with RpcServer(TOKEN, {"ping": _ping}, max_connections=4, max_unauthenticated=8) as server:
        held = [RpcClient(server.address, TOKEN, client=f"held-{n}") for n in range(3)]
        try:
            for client in held:
                client.call("ping")
            churning(server.address[1], 64)
            with RpcClient(server.address, TOKEN, client="fresh", timeout=5.0) as fresh:
                assert fresh.call("ping") == {"pong": True}
            for client in held:
                assert client.call("ping") == {"pong": True}  # none of them was touched
        finally:
            for client in held:
                client.close()
