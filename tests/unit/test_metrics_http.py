"""The /metrics server: scrapes work, and neither idle connections nor a flood of them from
other addresses keep a scraper out (issue 27.5). Real sockets on loopback: 127.0.0.2,
127.0.0.3 and the rest of 127/8 are all this host on Linux, and count as different peers."""

from __future__ import annotations

import errno
import http.client
import selectors
import socket
import threading
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge

from herd_operator.exporters import http as metrics_http
from herd_operator.exporters.http import serve_metrics

GUARD_S = 10.0
"""What any single wait in these tests is allowed, far above what it takes."""
SCRAPER = "127.0.0.3"
SCRAPES = 20


def registry() -> CollectorRegistry:
    served = CollectorRegistry()
    Gauge("herd_test_value", "A value to scrape.", registry=served).set(3)
    return served


@contextmanager
def serving(**limits: Any) -> Iterator[Any]:
    server = serve_metrics(registry(), "127.0.0.1", 0, **limits)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def scrape(port: int, source: str = "127.0.0.1") -> str:
    """One scrape as Prometheus makes it: connect, send the request at once, read."""
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=GUARD_S, source_address=(source, 0)
    )
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        body = response.read().decode()
    finally:
        connection.close()
    if response.status != 200:
        raise OSError(f"HTTP {response.status}")
    return body


def connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.settimeout(GUARD_S)
    sock.connect(("127.0.0.1", port))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (waits up to GUARD_S for it)."""
    sock.settimeout(GUARD_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def still_open(sock: socket.socket) -> bool:
    """Whether the server has neither closed `sock` nor sent on it (without waiting)."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.settimeout(GUARD_S)
    return False


class IdleFlood:
    """From each source address, `per_source` connections that never send a byte, each
    opened again as soon as the server closes it: the probe of issue 27. Bounded: at most
    `max_opens` connections in all, and it stops when its `with` block ends."""

    def __init__(
        self, port: int, sources: Sequence[str], per_source: int, max_opens: int = 500_000
    ) -> None:
        self.port = port
        self.sources = sources
        self.per_source = per_source
        self.max_opens = max_opens
        self.opens = 0
        self.reopens = 0
        self.connect_errors = 0
        self.holding = threading.Event()
        """Set once every first connection is open and the server has closed one of them:
        it keeps as many of the flood's as it will keep."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-flood", daemon=True)

    def __enter__(self) -> IdleFlood:
        self._thread.start()
        assert self.holding.wait(GUARD_S * 3), "the server did not fill up with the flood"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(GUARD_S)
        assert not self._thread.is_alive()

    def _open(self, selector: selectors.BaseSelector, source: str) -> None:
        """Connect without waiting (a server that does not accept leaves it pending in the
        kernel's queue); it is watched for writing until connected, then for reading."""
        self.opens += 1
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        if sock.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
            sock.close()
            self.connect_errors += 1
            return
        selector.register(sock, selectors.EVENT_WRITE, source)

    def _event(self, selector: selectors.BaseSelector, key: selectors.SelectorKey) -> None:
        sock: socket.socket = key.fileobj  # type: ignore[assignment]
        if key.events == selectors.EVENT_WRITE:  # the connect finished
            if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                selector.modify(sock, selectors.EVENT_READ, key.data)
                return
        else:
            try:
                if sock.recv(1024):
                    return  # whatever the server says, the connection stays idle
            except BlockingIOError:
                return
            except OSError:
                pass
        selector.unregister(sock)  # refused or dropped: open another at once
        sock.close()
        self.reopens += 1
        self._open(selector, key.data)

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            try:
                # The first ones one at a time, as a probe holding sockets would: a burst
                # would overflow the first version's listen backlog (5) and arrive late.
                for source in self.sources:
                    for _ in range(self.per_source):
                        self.opens += 1
                        try:
                            sock = connect_from(source, self.port)
                        except OSError:
                            self.connect_errors += 1
                            continue
                        sock.setblocking(False)
                        selector.register(sock, selectors.EVENT_READ, source)
                while not self._stop.is_set() and self.opens < self.max_opens:
                    for key, _ in selector.select(0.05):  # the stop flag is looked at between
                        self._event(selector, key)
                    if self.reopens:
                        self.holding.set()
            finally:
                for key in list(selector.get_map().values()):
                    key.fileobj.close()  # type: ignore[union-attr]


FLOODS = {
    # The probe's idle sockets from one address, more than the first version's limit (16).
    "one address, 24 idle sockets": (["127.0.0.2"], 24),
    # A local user can send from any address of 127/8: more peers than the pool holds.
    "300 addresses, one idle socket each": (
        [f"127.0.{2 + n // 250}.{1 + n % 250}" for n in range(300)],
        1,
    ),
}


@pytest.mark.parametrize("sources, per_source", FLOODS.values(), ids=FLOODS.keys())
def test_scrapes_from_one_address_get_through_a_flood_of_idle_connections_from_others(
    sources: list[str], per_source: int
) -> None:
    """The server as the operator and the exporter run it (its defaults). Before issue 27.5
    (a thread per connection, at most 16): 0 of 20 scrapes got through either flood."""
    with serving() as server, IdleFlood(server.server_port, sources, per_source) as flood:
        failures = []
        for _ in range(SCRAPES):
            try:
                assert "herd_test_value 3.0" in scrape(server.server_port, SCRAPER)
            except (OSError, http.client.HTTPException) as err:
                failures.append(repr(err))
        reopens, connect_errors = flood.reopens, flood.connect_errors
    assert failures == [], f"{len(failures)} of {SCRAPES} scrapes failed"
    assert connect_errors == 0
    stats = server.stats()
    assert stats["served"] == SCRAPES
    # More idlers than the pool keeps: they churned all along.
    assert stats["evicted"] > 0 and reopens > 0


def test_a_newcomer_displaces_the_oldest_waiting_connection_of_its_own_address() -> None:
    with serving(max_waiting=4, max_waiting_per_peer=2) as server, ExitStack() as stack:
        port = server.server_port

        def connect(source: str, accepted: int) -> socket.socket:
            sock = stack.enter_context(connect_from(source, port))
            # In the pool, in this order, before the next one arrives.
            assert server.wait_for_stats(lambda s: s["accepted"] >= accepted, GUARD_S)
            return sock

        first = connect("127.0.0.2", 1)
        second = connect("127.0.0.2", 2)
        other = connect("127.0.0.4", 3)
        third = connect("127.0.0.2", 4)
        assert closed_by_server(first)
        assert server.wait_for_stats(lambda s: s["evicted"] == 1, GUARD_S)
        assert still_open(second) and still_open(third) and still_open(other)
        # Its share stays full of idle ones; another address's scrape gets in.
        assert "herd_test_value" in scrape(port, SCRAPER)
        assert still_open(other)


def test_a_full_pool_displaces_the_oldest_of_the_address_holding_the_most() -> None:
    with serving(max_waiting=4, max_waiting_per_peer=2) as server, ExitStack() as stack:
        port = server.server_port
        held: dict[str, socket.socket] = {}
        for count, (name, source) in enumerate(
            [("a1", "127.0.0.2"), ("a2", "127.0.0.2"), ("b1", "127.0.0.4"), ("c1", "127.0.0.5")],
            start=1,
        ):
            held[name] = stack.enter_context(connect_from(source, port))
            assert server.wait_for_stats(lambda s, n=count: s["accepted"] >= n, GUARD_S)
        # Full: a newcomer from a fourth address takes the place of A's oldest (A holds 2).
        held["d1"] = stack.enter_context(connect_from("127.0.0.6", port))
        assert closed_by_server(held["a1"])
        # Now each address holds one: the oldest of all goes, a2.
        held["b2"] = stack.enter_context(connect_from("127.0.0.4", port))
        assert closed_by_server(held["a2"])
        assert server.wait_for_stats(lambda s: s["evicted"] == 2, GUARD_S)
        assert all(still_open(held[name]) for name in ("b1", "b2", "c1", "d1"))
        # B holds the most now: a newcomer from C's address takes b1's place.
        held["c2"] = stack.enter_context(connect_from("127.0.0.5", port))
        assert closed_by_server(held["b1"])
        assert server.wait_for_stats(lambda s: s["evicted"] == 3, GUARD_S)
        assert all(still_open(held[name]) for name in ("b2", "c1", "c2", "d1"))
        # Full of idle ones, and a scrape from any of these addresses gets in.
        assert "herd_test_value" in scrape(port, "127.0.0.4")


def test_a_request_that_has_arrived_is_answered_not_displaced() -> None:
    """The oldest of an address is read before it is closed for a newcomer: a scraper that
    shares its address with a flood loses no request that reached the server."""
    with serving(max_waiting_per_peer=1) as server, ExitStack() as stack:
        first = stack.enter_context(connect_from("127.0.0.2", server.server_port))
        assert server.wait_for_stats(lambda s: s["accepted"] == 1, GUARD_S)
        first.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        # Whether the server reads it first or finds it when it makes room for the next:
        second = stack.enter_context(connect_from("127.0.0.2", server.server_port))
        first.settimeout(GUARD_S)
        assert first.makefile("rb").readline().startswith(b"HTTP/1.0 200")
        assert server.wait_for_stats(lambda s: s["served"] == 1, GUARD_S)
        assert still_open(second)
        assert server.stats().get("evicted", 0) == 0


def test_a_request_head_not_all_in_by_the_deadline_is_closed() -> None:
    with serving(timeout_seconds=0.3) as server:
        with connect_from("127.0.0.2", server.server_port) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the empty line
            assert closed_by_server(sock)
        assert server.wait_for_stats(lambda s: s["expired"] == 1, GUARD_S)
        assert "herd_test_value" in scrape(server.server_port, SCRAPER)


def test_idle_connections_take_no_thread() -> None:
    def server_threads() -> int:
        return sum(t.name.startswith("metrics-http") for t in threading.enumerate())

    with serving(handler_threads=2) as server, ExitStack() as stack:
        before = server_threads()
        assert before == 3  # the selector and the two handler threads
        for _ in range(20):  # a slowloris: connect, send nothing
            stack.enter_context(connect_from("127.0.0.2", server.server_port))
        assert server.wait_for_stats(lambda s: s["accepted"] == 20, GUARD_S)
        assert server_threads() == before
        # Its share (8) waits; the 12 older ones made room for newer ones of the same address.
        assert server.wait_for_stats(lambda s: s["evicted"] == 12, GUARD_S)
        assert "herd_test_value" in scrape(server.server_port, SCRAPER)


def test_a_scrape_gets_the_registry() -> None:
    with serving() as server:
        assert "herd_test_value 3.0" in scrape(server.server_port)


def test_a_request_head_over_the_limit_is_closed_unanswered() -> None:
    with serving() as server, connect_from("127.0.0.2", server.server_port) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"y" * metrics_http.MAX_HEAD_BYTES)
        assert closed_by_server(sock)
        assert server.wait_for_stats(lambda s: s["too_long"] == 1, GUARD_S)
        assert server.stats().get("served", 0) == 0


def test_shutdown_closes_the_waiting_connections() -> None:
    server = serve_metrics(registry(), "127.0.0.1", 0)
    try:
        with connect_from("127.0.0.2", server.server_port) as sock:
            assert server.wait_for_stats(lambda s: s["accepted"] == 1, GUARD_S)
            server.shutdown()
            assert closed_by_server(sock)
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "limit", ["handler_threads", "max_waiting", "max_waiting_per_peer", "timeout_seconds"]
)
def test_a_limit_below_one_is_refused_naming_it(limit: str) -> None:
    with pytest.raises(ValueError, match=limit):
        serve_metrics(registry(), "127.0.0.1", 0, **{limit: 0})


def test_requests_are_taken_from_the_addresses_in_turn() -> None:
    """A peer that floods requests delays another's by one request per round at most."""
    with ExitStack() as stack:
        queues = metrics_http.PeerQueues(per_peer=8, total=32)

        def arrive(peer: str, seq: int) -> None:
            sock = stack.enter_context(socket.socket())
            assert queues.victim_for(peer) is None
            queues.add(metrics_http.Pending(sock, (peer, 1000 + seq), seq, 0.0))

        for seq in range(1, 6):
            arrive("a", seq)
        arrive("b", 6)
        taken = [queues.take()]
        arrive("c", 7)
        taken += [queues.take() for _ in range(len(queues))]
        assert queues.take() is None
        # c, arriving after a went to the back, waits for a's turn only.
        assert [(p.peer, p.seq) for p in taken if p is not None] == [
            ("a", 1), ("b", 6), ("a", 2), ("c", 7), ("a", 3), ("a", 4), ("a", 5),
        ]  # fmt: skip


PEERS = st.sampled_from(["p", "q", "r", "s"])


@st.composite
def pools(draw: st.DrawFn) -> tuple[dict[str, list[int]], int, int]:
    """A pool as the server keeps it: no address over its share, no more than the total."""
    per_peer = draw(st.integers(1, 4))
    total = draw(st.integers(1, 10))
    arrivals = iter(draw(st.permutations(range(40))))
    waiting: dict[str, list[int]] = {}
    for peer in draw(st.lists(PEERS, max_size=total)):
        if len(waiting.get(peer, ())) < per_peer:
            waiting.setdefault(peer, []).append(next(arrivals))
    return waiting, per_peer, total


@settings(max_examples=500, deadline=None)
@given(pools(), PEERS)
def test_who_makes_room_for_a_newcomer(
    pool: tuple[dict[str, list[int]], int, int], newcomer: str
) -> None:
    waiting, per_peer, total = pool
    held = sum(len(arrivals) for arrivals in waiting.values())
    own = len(waiting.get(newcomer, ()))
    victim = metrics_http.peer_to_evict(
        waiting, newcomer, held=held, per_peer=per_peer, total=total
    )
    # Room is made exactly when the newcomer's share or the pool is full ...
    assert (victim is None) == (own < per_peer and held < total)
    if victim is None:
        return
    # ... from its own address when that is full, else from an address holding the most
    # (of those, the one whose oldest came first) ...
    if own >= per_peer:
        assert victim == newcomer
    else:
        most = max(len(arrivals) for arrivals in waiting.values())
        candidates = [peer for peer, arrivals in waiting.items() if len(arrivals) == most]
        assert victim == min(candidates, key=lambda peer: min(waiting[peer]))
    # ... and with its oldest gone and the newcomer in, both bounds hold.
    after = {peer: list(arrivals) for peer, arrivals in waiting.items()}
    after[victim].remove(min(after[victim]))
    after.setdefault(newcomer, []).append(max(sum(waiting.values(), [0])) + 1)
    assert len(after[newcomer]) <= per_peer
    assert sum(len(arrivals) for arrivals in after.values()) <= total
