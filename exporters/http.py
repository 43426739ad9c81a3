"""The `/metrics` HTTP server of the operator and the node exporter, bounded per peer.

On a shared node any local user can connect to `/metrics`. prometheus_client's own server
starts a thread for every connection and waits on it without a deadline; a server with a
thread per connection and a cap (this module's first version, 16) is blinded instead: 16
idle sockets, reopened whenever dropped, made 19 of 20 Prometheus scrapes fail (issue 27).

Here a connection takes no thread until its whole request head has arrived. Until then it
waits in a bounded pool that one selector thread watches, with OpenSSH's MaxStartups as
the model: at most `max_waiting` connections in all and `max_waiting_per_peer` from one
address. A newcomer whose address has its whole share waiting closes that address's
oldest waiting connection; one that finds the pool full closes the oldest of the address
holding the most. A connection whose request head has not all arrived `timeout_seconds`
after its accept is closed (a whole-head deadline, so trickling a byte at a time does not
keep it). Complete requests go to a few handler threads, taken from the addresses in turn
(a peer that floods requests delays another's by one request per round), and a response
is written within `timeout_seconds` too. Prometheus sends its request as soon as it
connects, so its scrapes get through while idle connections from other addresses churn.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import selectors
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

HANDLER_THREADS = 4
"""Threads that answer complete requests: rendering a page takes about a millisecond, and
a response fits the socket's buffers, so a few serve any number of scrapers."""
MAX_WAITING = 256
MAX_WAITING_PER_PEER = 8
"""A scraper opens one connection per scrape (the server closes it after the response),
so an address with a few Prometheus servers and the operator has a few at once."""
TIMEOUT_SECONDS = 10.0
MAX_HEAD_BYTES = 16 * 1024
"""A scrape's request head is a few hundred bytes; a longer one is not a scrape."""
LISTEN_BACKLOG = 128
"""socketserver's 5 would drop a scraper's SYN (a retry a second later) while a flood keeps
the accept queue full."""
ACCEPTS_PER_ROUND = 64
"""Accepts per wake-up of the selector: requests that arrived are read between rounds."""
FLOOD_LOG_SECONDS = 60.0
"""At most one warning this often about connections closed unread."""

_HEAD_END = re.compile(rb"\n\r?\n")
"""The empty line that ends a request head (`\\r\\n\\r\\n`, or bare newlines)."""

_Outcome = Literal["waiting", "complete", "ended", "too_long", "evicted", "expired"]
"""What became of a connection in the pool (the last four are counted in `stats`)."""


def peer_to_evict(
    waiting: Mapping[str, Collection[int]],
    newcomer: str,
    *,
    held: int,
    per_peer: int,
    total: int,
) -> str | None:
    """Whose oldest waiting connection is closed to make room for one more from `newcomer`;
    None when there is room.

    `waiting`: each peer address with the arrival numbers of its waiting connections;
    `held`: how many connections wait in all (the sum of their counts). The newcomer's own
    oldest when its address holds `per_peer` already; else, with `total` waiting, the
    oldest of the address holding the most (of two that hold as many, the one whose oldest
    came first): one address cannot push another's connections out while it holds more.
    """
    if len(waiting.get(newcomer, ())) >= per_peer:
        return newcomer
    if held < total:
        return None
    return max(
        (peer for peer, arrivals in waiting.items() if arrivals),
        key=lambda peer: (len(waiting[peer]), -min(waiting[peer])),
    )


@dataclass(eq=False)
class Pending:
    """An accepted connection and the part of its request head read so far."""

    sock: socket.socket
    address: Any
    """What accept() returned: (host, port) or, for IPv6, (host, port, flow, scope)."""
    seq: int
    """Arrival number: smaller is older."""
    deadline: float
    head: bytearray = field(default_factory=bytearray)

    @property
    def peer(self) -> str:
        return str(self.address[0])


class PeerQueues:
    """Connections kept per peer address in arrival order, at most `per_peer` for one
    address and `total` in all (`peer_to_evict` says who makes room); `take` serves the
    addresses in turn. Not thread-safe: `ReadyRequests` locks around it."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer = per_peer
        self.total = total
        self._by_peer: OrderedDict[str, OrderedDict[int, Pending]] = OrderedDict()
        """Peers in the order they are served; each one's connections, oldest first."""
        self._all: OrderedDict[int, Pending] = OrderedDict()
        """Every connection, oldest first."""

    def __len__(self) -> int:
        return len(self._all)

    def victim_for(self, peer: str) -> Pending | None:
        """The connection that makes room for one more from `peer`; None while there is room."""
        loser = peer_to_evict(
            self._by_peer, peer, held=len(self), per_peer=self.per_peer, total=self.total
        )
        return None if loser is None else next(iter(self._by_peer[loser].values()))

    def add(self, pending: Pending) -> None:
        """Keep `pending` (with room made first: `victim_for`)."""
        self._by_peer.setdefault(pending.peer, OrderedDict())[pending.seq] = pending
        self._all[pending.seq] = pending

    def remove(self, pending: Pending) -> None:
        del self._all[pending.seq]
        queue = self._by_peer[pending.peer]
        del queue[pending.seq]
        if not queue:
            del self._by_peer[pending.peer]

    def oldest(self) -> Pending | None:
        return next(iter(self._all.values()), None)

    def take(self) -> Pending | None:
        """The oldest connection of the next address in turn; that address goes to the back."""
        if not self._by_peer:
            return None
        peer, queue = next(iter(self._by_peer.items()))
        pending = next(iter(queue.values()))
        self.remove(pending)
        if peer in self._by_peer:
            self._by_peer.move_to_end(peer)
        return pending

    def drain(self) -> list[Pending]:
        everything = list(self._all.values())
        self._by_peer.clear()
        self._all.clear()
        return everything


class ReadyRequests:
    """Complete requests waiting for a handler thread (bounded as `PeerQueues`)."""

    def __init__(self, per_peer: int, total: int) -> None:
        self._queues = PeerQueues(per_peer, total)
        self._changed = threading.Condition()
        self._closed = False

    def put(self, pending: Pending) -> Pending | None:
        """Queue `pending`; returns a connection to close: the one it displaced, or
        `pending` itself once closed."""
        with self._changed:
            if self._closed:
                return pending
            victim = self._queues.victim_for(pending.peer)
            if victim is not None:
                self._queues.remove(victim)
            self._queues.add(pending)
            self._changed.notify()
            return victim

    def take(self) -> Pending | None:
        """The next request in turn, waiting for one; None once closed."""
        with self._changed:
            while not self._closed:
                pending = self._queues.take()
                if pending is not None:
                    return pending
                self._changed.wait()
            return None

    def close(self) -> list[Pending]:
        """Stop: `take` answers None from now on; returns what was queued, to be closed."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            return self._queues.drain()


class _Handler(WSGIRequestHandler):
    """wsgiref's handler for one request whose head the selector thread has read."""

    def __init__(self, request: Any, client_address: Any, server: Any, head: bytes = b"") -> None:
        self._head = head
        self._timeout: float = server.timeout_seconds
        super().__init__(request, client_address, server)

    def setup(self) -> None:
        super().setup()
        # The deadline of the response: sendall's timeout bounds the whole write.
        self.connection.settimeout(self._timeout)
        self.rfile.close()  # the socket's reader: the head is all there is to read
        self.rfile = io.BytesIO(self._head)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the operator's log


class MetricsServer(WSGIServer):
    """A WSGI server for `/metrics` (see the module's docstring). `serve_forever()` runs
    the selector (and starts the handler threads); `shutdown()` stops it from another
    thread; `server_close()` closes the socket."""

    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        *,
        handler_threads: int = HANDLER_THREADS,
        max_waiting: int = MAX_WAITING,
        max_waiting_per_peer: int = MAX_WAITING_PER_PEER,
        timeout_seconds: float = TIMEOUT_SECONDS,
    ) -> None:
        for name, value in (
            ("handler_threads", handler_threads),
            ("max_waiting", max_waiting),
            ("max_waiting_per_peer", max_waiting_per_peer),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, not {value}")
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be above 0, not {timeout_seconds}")
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.handler_threads = handler_threads
        self.max_waiting = max_waiting
        self.max_waiting_per_peer = max_waiting_per_peer
        self.timeout_seconds = timeout_seconds
        self._ready = ReadyRequests(max_waiting_per_peer, max_waiting)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._counts: Counter[str] = Counter()
        self._counts_changed = threading.Condition()
        self._closed_unread: Counter[str] = Counter()
        """Peers whose connections were closed unread since the last warning."""
        self._next_flood_log = 0.0
        self._arrivals = 0
        # Before the bind: a bind that fails calls server_close(), which closes these too.
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_writer.setblocking(False)
        super().__init__(address, _Handler)  # binds and listens, or raises OSError

    # ---- what tests and benchmarks read ----

    def stats(self) -> dict[str, int]:
        """Counts since the start: accepted, served, evicted (closed for a newcomer),
        expired (no whole head in time), dropped (a queued request displaced),
        ended (the peer closed first), too_long (a head over MAX_HEAD_BYTES)."""
        with self._counts_changed:
            return dict(self._counts)

    def wait_for_stats(
        self, predicate: Callable[[Mapping[str, int]], bool], timeout: float
    ) -> bool:
        """Wait until `predicate(stats)` holds (checked at each change); False after
        `timeout` seconds without."""
        with self._counts_changed:
            return self._counts_changed.wait_for(lambda: predicate(self._counts), timeout)

    def _count(self, what: str, peer: str | None = None) -> None:
        with self._counts_changed:
            self._counts[what] += 1
            self._counts_changed.notify_all()
        if peer is not None:
            self._closed_unread[peer] += 1

    # ---- the server's life ----

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        for n in range(self.handler_threads):
            threading.Thread(
                target=self._answer_requests, name=f"metrics-http-{n}", daemon=True
            ).start()
        self._started.set()
        waiting = PeerQueues(self.max_waiting_per_peer, self.max_waiting)
        try:
            with selectors.DefaultSelector() as selector:
                self.socket.setblocking(False)
                selector.register(self.socket, selectors.EVENT_READ)
                selector.register(self._wake_reader, selectors.EVENT_READ)
                while not self._stop.is_set():
                    oldest = waiting.oldest()
                    timeout = poll_interval
                    if oldest is not None:
                        timeout = min(timeout, max(0.0, oldest.deadline - time.monotonic()))
                    listener_ready = False
                    for key, _ in selector.select(timeout):
                        if key.fileobj is self.socket:
                            listener_ready = True
                        elif key.fileobj is self._wake_reader:
                            self._wake_reader.recv(4096)
                        else:
                            self._read(key.data, waiting, selector)
                    # Reads before accepts: what has arrived is handed on before a newcomer
                    # looks for room (and a victim is read once more before it is closed).
                    if listener_ready:
                        self._accept(waiting, selector)
                    self._expire(waiting, selector)
                    self._log_flood()
        finally:
            for pending in waiting.drain() + self._ready.close():
                _close(pending.sock)
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait until it has; in-flight responses finish on their
        own (bounded by `timeout_seconds`)."""
        self._stop.set()
        self._wake()
        if self._started.is_set():
            self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        for pending in self._ready.close():
            _close(pending.sock)
        self._wake_reader.close()
        self._wake_writer.close()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # already awake (a full buffer), or closed
            self._wake_writer.send(b"\0")

    # ---- the selector thread ----

    def _accept(self, waiting: PeerQueues, selector: selectors.BaseSelector) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, address = self.socket.accept()
            except BlockingIOError:
                return
            except OSError as err:  # out of descriptors, or a connection reset in the queue
                log.warning("/metrics: accept failed: %s", err)
                return
            sock.setblocking(False)
            self._arrivals += 1
            pending = Pending(
                sock, address, self._arrivals, time.monotonic() + self.timeout_seconds
            )
            self._count("accepted")
            # A scraper's request is often in already: then it never waits in the pool.
            outcome = self._receive(pending)
            if outcome != "waiting":
                self._finish(pending, outcome)
                continue
            victim = waiting.victim_for(pending.peer)
            if victim is not None:
                waiting.remove(victim)
                selector.unregister(victim.sock)
                # Only a silent one goes: one whose request has arrived since the last
                # select is answered instead (room is made either way).
                outcome = self._receive(victim)
                self._finish(victim, "evicted" if outcome == "waiting" else outcome)
            waiting.add(pending)
            selector.register(sock, selectors.EVENT_READ, pending)

    def _read(
        self, pending: Pending, waiting: PeerQueues, selector: selectors.BaseSelector
    ) -> None:
        outcome = self._receive(pending)
        if outcome != "waiting":
            waiting.remove(pending)
            selector.unregister(pending.sock)
            self._finish(pending, outcome)

    def _expire(self, waiting: PeerQueues, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while (oldest := waiting.oldest()) is not None and oldest.deadline <= now:
            waiting.remove(oldest)
            selector.unregister(oldest.sock)
            self._finish(oldest, "expired")

    def _receive(self, pending: Pending) -> _Outcome:
        """Read what has arrived of `pending`'s request head, without waiting."""
        while True:
            try:
                chunk = pending.sock.recv(4096)
            except BlockingIOError:
                return "waiting"
            except OSError:
                return "ended"
            if not chunk:
                return "ended"
            searched = max(0, len(pending.head) - 2)  # the end may straddle two reads
            pending.head += chunk
            if _HEAD_END.search(pending.head, searched):
                return "complete"
            if len(pending.head) > MAX_HEAD_BYTES:
                return "too_long"

    def _finish(self, pending: Pending, outcome: _Outcome) -> None:
        """A connection out of the pool: to the handler threads, or closed and counted."""
        if outcome == "complete":
            displaced = self._ready.put(pending)
            if displaced is not None:
                _close(displaced.sock)
                self._count("dropped", displaced.peer)
            return
        _close(pending.sock)
        self._count(outcome, None if outcome == "ended" else pending.peer)

    def _log_flood(self) -> None:
        """One warning a minute at most: a flood must not flood the log as well."""
        if not self._closed_unread or time.monotonic() < self._next_flood_log:
            return
        (peer, most), *_ = self._closed_unread.most_common(1)
        log.warning(
            "/metrics: closed %d connections that sent no request in time or were displaced "
            "by newer ones, %d of them from %s (a scraper sends its request at once; see "
            "docs/reliability.md)",
            sum(self._closed_unread.values()), most, peer,
        )  # fmt: skip
        self._closed_unread.clear()
        self._next_flood_log = time.monotonic() + FLOOD_LOG_SECONDS

    # ---- the handler threads ----

    def _answer_requests(self) -> None:
        while (pending := self._ready.take()) is not None:
            try:
                _Handler(pending.sock, pending.address, self, bytes(pending.head))
            except OSError as err:  # the peer went away, or did not read within the deadline
                log.debug("/metrics: answer to %s not sent: %s", pending.peer, err)
            except Exception:
                log.exception("/metrics: answering %s failed", pending.peer)
            finally:
                self.shutdown_request(pending.sock)
                self._count("served")


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    handler_threads: int = HANDLER_THREADS,
    max_waiting: int = MAX_WAITING,
    max_waiting_per_peer: int = MAX_WAITING_PER_PEER,
    timeout_seconds: float = TIMEOUT_SECONDS,
) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread; `shutdown()` and
    `server_close()` stop it. Port 0 picks a free port (`server_port` says which)."""
    server = MetricsServer(
        (host, port),
        handler_threads=handler_threads,
        max_waiting=max_waiting,
        max_waiting_per_peer=max_waiting_per_peer,
        timeout_seconds=timeout_seconds,
    )
    server.set_app(make_wsgi_app(registry))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    server._started.wait()  # so that a shutdown() right after this waits for it to stop
    return server
