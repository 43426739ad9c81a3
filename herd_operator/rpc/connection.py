"""One client connection on the server, driven by the event loop's callbacks: challenge,
hello, requests; and what the connections of one server share.

Apart from the server's lifecycle (``server.py``): this is the state machine of one
connection, its deadlines and its end; the pool it waits in, the check of its hello and
the running of its requests are the modules it calls.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from herd_operator.auth import Identity, new_nonce, prove
from herd_operator.rpc.dispatch import Dispatcher
from herd_operator.rpc.handshake import Authenticator, Rejected, RejectionLog
from herd_operator.rpc.pool import UnauthenticatedPool
from herd_operator.rpc.protocol import (
    CHALLENGE_FRAME,
    MAX_FRAME_BYTES,
    WELCOME_FRAME,
    decode_frame,
    encode_frame,
    error_body,
)

_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
"""recv's flags for a look without a read or a wait (an int: the enum's ``|`` costs more
than the look)."""

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


@dataclass(frozen=True)
class Limits:
    """The server's deadlines (seconds) and its bound on authenticated connections."""

    read_timeout: float
    idle_timeout: float
    handshake_timeout: float
    eviction_age: float
    max_wait: float
    """The longest a newcomer waits in line before it takes the oldest place, whatever its age."""
    max_connections: int


class ConnectionObserver:
    """Hears of connection events on the server's thread, as they happen: a diagnostic seam
    (``scripts/burst_probe.py`` times and counts a burst with it). Each method here does
    nothing; a subclass overrides what it wants, and must return quickly and not raise."""

    def accepted(self) -> None:
        """A connection was accepted (before any check of it)."""

    def challenged(self) -> None:
        """A connection got its place in the unauthenticated pool, and its challenge."""

    def rechecked(self) -> None:
        """A connection waiting in line looked again for a place (every eviction age)."""

    def evicted(self) -> None:
        """A silent connection lost its place in the pool to a newcomer, as an idler."""

    def authenticated(self, answer_s: float) -> None:
        """A hello was proved; ``answer_s``: from its challenge to its hello, by the
        server's clock."""


@dataclass(eq=False)
class Serving:
    """What the connections of one server share, from its start to its stop."""

    limits: Limits
    pool: UnauthenticatedPool
    authenticator: Authenticator
    rejections: RejectionLog
    dispatcher: Dispatcher
    observer: ConnectionObserver
    clock: Callable[[], float]
    """Ages in the pool (the loop's timers keep the loop's own clock)."""
    connections: set[Connection] = field(default_factory=set)
    authenticated: int = 0
    """How many of ``connections`` have authenticated (``max_connections`` bounds these;
    the others are bounded by the pool and its line)."""
    shutting_down: bool = False
    """Set by the server's stop: a connection accepted from then on is dropped at once."""


class Connection(asyncio.Protocol):
    """One client connection, driven by the loop's callbacks: challenge, hello, requests.

    A protocol object rather than a stream task per connection: a request is parsed,
    dispatched and answered in one ``data_received`` call, with no task switch, no
    future and no timer per request. The deadlines are timers armed only when they can
    matter (the handshake, a frame left half-read, a peer that stops reading), and the
    idle timer is checked against the time of the last request only when it fires.
    """

    def __init__(self, serving: Serving, loop: asyncio.AbstractEventLoop) -> None:
        self._serving = serving
        self._limits = serving.limits
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.peer = "?"
        self.admitted = serving.clock()
        """``serving.clock()`` when it got its place in the unauthenticated pool, and with it
        its challenge: its age there, for eviction, counts from then, not from its accept,
        so one that waited in line is not taken for an idler before it could answer."""
        self.speaking = False
        """Whether the first byte of its hello has arrived: never evicted from then on."""
        self.waiting = False
        """Whether it waits in line for a place in the unauthenticated pool."""
        self._queued_at = 0.0
        self._identity: Identity | None = None
        self._server_nonce = ""
        self._buffer = b""
        self._closing = False
        self._write_paused = False
        self._held = False
        """A request of this connection waits in the server's commit group: the next one is
        read only after the group's replies are sent."""
        self._last_request = 0.0
        # The handshake deadline before authentication, then the partial-frame one.
        self._deadline: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._drain_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None

    @property
    def authenticated(self) -> bool:
        return self._identity is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = stream = cast(asyncio.Transport, transport)
        self.peer = _peer_label(stream.get_extra_info("peername"))
        serving = self._serving
        serving.observer.accepted()
        if serving.shutting_down:
            stream.abort()
            return
        serving.connections.add(self)
        limits = self._limits
        if serving.authenticated >= limits.max_connections:
            self._reject(
                Rejected(
                    "unavailable",
                    "server is busy",
                    f"at the limit of {limits.max_connections} authenticated connections",
                )
            )
            return
        # A place in the pool (greet() sends the challenge), or a wait in line, silent, for
        # one rather than be refused and come back, which in a burst of thousands of shims
        # costs more than the handshakes themselves.
        self.waiting = True
        self._queued_at = self._loop.time()
        serving.pool.arrive(
            self, serving.clock(), line_room=limits.max_connections - serving.authenticated
        )
        if self.waiting and not self._closing:
            self._deadline = self._loop.call_later(
                min(limits.eviction_age, limits.max_wait), self._waited
            )

    def greet(self) -> None:
        """Send the challenge: the connection has its place in the unauthenticated pool."""
        assert self._transport is not None
        self.waiting = False
        if self._deadline is not None:
            self._deadline.cancel()
        self._server_nonce = new_nonce()
        self._serving.observer.challenged()
        self._transport.write(CHALLENGE_FRAME % self._server_nonce.encode("ascii"))
        self._deadline = self._loop.call_later(
            self._limits.handshake_timeout, self._handshake_expired
        )
        if self._buffer:
            self._process()  # it spoke before its challenge: no hello can verify

    def _waited(self) -> None:
        """Another eviction_age in line: the line takes the places of idlers old enough now.
        After max_wait in line, take the oldest place whatever its age."""
        self._deadline = None
        serving = self._serving
        serving.observer.rechecked()
        serving.pool.recheck(serving.clock())
        if not self.waiting or self._closing:
            return  # it got a place
        limits = self._limits
        remaining = self._queued_at + limits.max_wait - self._loop.time()
        if remaining <= 0:
            serving.pool.expire(self, serving.clock())
        else:
            self._deadline = self._loop.call_later(
                min(limits.eviction_age, remaining), self._waited
            )

    def evict(self) -> None:
        """Cut off a connection whose place in the pool a newcomer took."""
        self._serving.observer.evicted()
        self.abort()

    def refuse(self, reason: str) -> None:
        """Refuse a connection that waited in line as busy (RpcClient tries again)."""
        self.waiting = False
        self._reject(
            Rejected("busy", "too many connections are authenticating; retry shortly", reason)
        )

    def unread(self) -> bool:
        """Whether bytes from the peer wait unread in the kernel: a hello that arrived while
        the loop was busy accepting (it accepts a whole backlog in one turn, then reads)."""
        transport = self._transport
        if transport is None or self._closing:
            return False
        sock = transport.get_extra_info("socket")
        if sock is None or sock.fileno() < 0:
            return False
        # A socket object over the same descriptor, detached again, to peek without reading:
        # the loop's transport reads for itself and offers no peek.
        peeker = socket.socket(fileno=sock.fileno())
        try:
            return bool(peeker.recv(1, _PEEK))
        except OSError:  # nothing yet (BlockingIOError), or the peer is gone
            return False
        finally:
            peeker.detach()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self.waiting:
            self._buffer += data
            return
        self._buffer = self._buffer + data if self._buffer else data
        if self.speaking:
            self._process()
            return
        self.speaking = True
        self._serving.pool.spoke(self)
        self._process()
        if self._identity is None and not self._closing:
            # The rest of the hello gets the handshake's short deadline from its first byte:
            # one byte must not buy an idler a long stay in the pool of strangers. (A hello
            # that came whole, as nearly all do, needs no timer.)
            self._rearm_deadline(self._limits.handshake_timeout, self._handshake_expired)

    def _process(self) -> None:
        """Answer every complete frame in the buffer, unless the peer is not reading."""
        buffer = self._buffer
        try:
            while not self._closing and not self._write_paused and not self._held:
                end = buffer.find(b"\n")
                if end < 0:
                    break
                line = buffer[:end]
                buffer = buffer[end + 1 :]
                if end > MAX_FRAME_BYTES:
                    raise _oversize()
                try:
                    frame = decode_frame(line)
                except ValueError as error:
                    raise Rejected("bad_request", str(error), str(error)) from None
                identity = self._identity
                if identity is None:
                    self._authenticate(frame)
                else:
                    assert self._transport is not None
                    response = self._serving.dispatcher.dispatch(frame, identity, self)
                    if response is None:
                        self._held = True  # answered after the group's commit
                    else:
                        self._transport.write(response + b"\n")
                    self._last_request = self._loop.time()
                    if self._deadline is not None:
                        self._deadline.cancel()
                        self._deadline = None
        except Rejected as rejected:
            self._buffer = b""
            self._reject(rejected)
            return
        self._buffer = buffer
        if not buffer or self._closing or self._write_paused or self._held:
            return
        if len(buffer) > MAX_FRAME_BYTES:
            self._buffer = b""
            self._reject(_oversize())
        elif self._identity is not None and self._deadline is None:
            # A frame has begun: the rest must follow within read_timeout so a trickling
            # peer cannot hold the connection.
            self._deadline = self._loop.call_later(self._limits.read_timeout, self._frame_expired)

    def _authenticate(self, hello: dict[str, Any]) -> None:
        serving = self._serving
        hello_at = serving.clock()
        client_nonce, label, identity, key = serving.authenticator.check(hello, self._server_nonce)
        serving.observer.authenticated(hello_at - self.admitted)
        self._identity = identity
        serving.authenticated += 1
        serving.pool.release(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        proof = prove(key, "server", self._server_nonce, client_nonce)
        assert self._transport is not None
        self._transport.write(WELCOME_FRAME % proof.encode("ascii"))
        logger.debug("authenticated client %s as %s from %s", label, identity, self.peer)
        self._last_request = self._loop.time()
        self._idle_timer = self._loop.call_later(self._limits.idle_timeout, self._idle_check)

    def answer_grouped(self, response: bytes) -> None:
        """The reply to the request this connection had in the commit group; then read on."""
        self._held = False
        if self._closing or self._transport is None:
            return
        self._transport.write(response + b"\n")
        if self._buffer and not self._write_paused:
            self._process()

    def _rearm_deadline(self, delay: float, callback: Callable[[], None]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self._loop.call_later(delay, callback)

    def _handshake_expired(self) -> None:
        self._deadline = None
        timeout = self._limits.handshake_timeout
        if self.speaking:
            rejected = Rejected(
                "timeout",
                "timed out reading a frame",
                f"frame not completed within {timeout:g} s",
                in_handshake=True,
            )
        else:
            rejected = Rejected(
                "timeout",
                "timed out waiting for authentication",
                f"no auth frame within {timeout:g} s",
                in_handshake=True,
            )
        self._reject(rejected)

    def _frame_expired(self) -> None:
        self._deadline = None
        timeout = self._limits.read_timeout
        self._reject(
            Rejected(
                "timeout", "timed out reading a frame", f"frame not completed within {timeout:g} s"
            )
        )

    def _idle_check(self) -> None:
        """Close the connection if no request came for idle_timeout; else look again later."""
        self._idle_timer = None
        if self._closing:
            return
        idle_timeout = self._limits.idle_timeout
        due = self._last_request + idle_timeout
        if self._buffer or self._write_paused or due > self._loop.time():
            # A frame in progress or unread responses have deadlines of their own.
            self._idle_timer = self._loop.call_at(
                max(due, self._loop.time() + idle_timeout / 4), self._idle_check
            )
            return
        logger.debug("closing idle connection from %s", self.peer)
        self._close_with(_connection_error("idle_timeout", "connection closed after idling"))

    def _reject(self, rejected: Rejected) -> None:
        if rejected.in_handshake or self._identity is None:
            # Anyone who can reach the port can cause these: rate-limited per host.
            self._serving.rejections.rejected(self.peer, rejected.reason)
        else:
            logger.warning("rejected connection from %s: %s", self.peer, rejected.reason)
        self._close_with(_connection_error(rejected.code, rejected.client_message))

    def _close_with(self, frame: bytes) -> None:
        """Send a last frame and close; a peer that does not read it is cut off later."""
        if self._closing or self._transport is None:
            return
        self._closing = True
        self._serving.pool.release(self)
        self._cancel_timers()
        transport = self._transport
        transport.write(frame + b"\n")
        transport.close()
        self._abort_timer = self._loop.call_later(self._limits.read_timeout, transport.abort)

    def abort(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    def _cancel_timers(self) -> None:
        for timer in (self._deadline, self._idle_timer, self._drain_timer):
            if timer is not None:
                timer.cancel()
        self._deadline = self._idle_timer = self._drain_timer = None

    def eof_received(self) -> bool | None:
        logger.debug("connection from %s ended by the peer", self.peer)
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._cancel_timers()
        if self._abort_timer is not None:
            self._abort_timer.cancel()
            self._abort_timer = None
        self._serving.connections.discard(self)
        if self._identity is not None:
            self._serving.authenticated -= 1
        self._serving.pool.release(self)
        if exc is not None:
            logger.debug("connection from %s ended: %r", self.peer, exc)

    def pause_writing(self) -> None:
        # The peer is not reading its responses: read no more requests until it does.
        self._write_paused = True
        if self._closing or self._transport is None:
            return
        self._transport.pause_reading()
        self._drain_timer = self._loop.call_later(self._limits.read_timeout, self._drain_expired)

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None
        if self._closing or self._transport is None:
            return
        self._transport.resume_reading()
        self._process()

    def _drain_expired(self) -> None:
        self._drain_timer = None
        logger.warning(
            "closing connection from %s: it left responses unread for %g s",
            self.peer,
            self._limits.read_timeout,
        )
        self.abort()


def _oversize() -> Rejected:
    message = f"frame longer than {MAX_FRAME_BYTES} bytes"
    return Rejected("bad_request", message, message)


def _connection_error(code: str, message: str) -> bytes:
    return encode_frame({"type": "error", "error": error_body(code, message)})


def _peer_label(peername: object) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)
