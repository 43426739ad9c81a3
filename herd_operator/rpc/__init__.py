"""The allocator's wire protocol: an authenticated JSON-lines RPC over TCP.

Framing: every frame is one JSON object encoded as UTF-8 and terminated by a newline
(``\\n``); the encoded object, without the newline, is at most ``MAX_FRAME_BYTES``.

Handshake (mutual authentication; no key ever crosses the wire):

1. server -> ``{"v": 2, "type": "challenge", "nonce": S}``
2. client -> ``{"type": "auth", "identity": I, "client": C, "nonce": N,
   "proof": prove(key, "client", S, N, C, I)}`` where I is who the client speaks for
   (``admin``, ``job:<name>`` or ``agent:<host>``, see ``herd_operator.auth``), key is
   that identity's key (``derive_key(master, I)``), and C is a short label for logs
   such as ``shim:job-a:host1:0`` (1 to 128 characters of letters, digits and
   ``._:@[]/-``).
3. server -> ``{"type": "welcome", "proof": prove(key, "server", S, N)}``, which the
   client checks, or ``{"type": "error", "error": {"code": "unauthenticated", ...}}``
   and the server closes the connection.

Handlers get the proved identity with every request, never from the request itself.

Requests, any number after the handshake, answered in order:
``{"id": int, "op": str, "args": {...}}`` -> ``{"id": id, "ok": true, "result": {...}}``
or ``{"id": id, "ok": false, "error": {"code": str, "message": str}}``. ``args`` may be
omitted (empty). Request error codes: ``bad_request`` (missing or mistyped fields, or
the handler raised ``BadRequest``), ``unknown_op``, ``not_found`` (the handler raised
``NotFound``), ``forbidden`` (the identity may not do this: the handler raised
``Forbidden``), ``internal`` (anything else; details are logged on the server only).

Connection errors: the server answers ``{"type": "error", "error": {"code", "message"}}``
and closes the connection when a frame is too long, not UTF-8 JSON, or not an object
(``bad_request``), when the handshake fails or a request comes before it
(``unauthenticated``), when the server is at its connection limit (``unavailable``),
when too many connections are in their handshake and none can be dropped for this one
(``busy``: a client may retry shortly, and ``RpcClient`` does),
when a started frame or the handshake takes longer than ``read_timeout`` (``timeout``),
and when an authenticated connection sits idle longer than ``idle_timeout``
(``idle_timeout``). The last one is only sent while no byte of a next request has been
read, so a client that gets it in place of a response knows its request was not
processed and may resend it on a new connection.

Grouped ops (``RpcServer(grouped_ops=..., commit_group=...)``, e.g. ``report`` and the
store's transaction): the requests for them that arrive in one turn of the server's loop
are run together inside one ``commit_group()`` context (one SQLite commit for all), and
each is answered only after that context has exited: a reply never precedes the commit
of what it reports. If the exit raises (the commit failed), every request of the group
that its handler had served gets the error that request would have got had its own write
failed (``internal``, details in the server's log). A connection with a request in a
group reads its next request only after the group, so replies stay in request order.

Connections that have not authenticated yet are a pool of their own (``max_unauthenticated``)
since anyone who can reach the port can open them. When the pool is full, a newcomer takes
the slot of the oldest connection that has sent no byte of its hello and is older than
``eviction_age`` (a real client answers the challenge in milliseconds, so that one is an
idler); a connection whose hello has begun is never dropped for a newcomer (its handshake
deadline still applies). If there is no such idler, the newcomer waits in line, silent,
and gets its challenge as soon as a place frees, or every ``eviction_age`` takes the
place of an idler that has become old enough; after ``handshake_timeout`` in line it is
refused with ``busy``. ``RpcClient`` retries a connection refused or dropped before the
welcome, with jittered exponential backoff, so a burst of workers larger than the pool
all get in.

The eviction age is fixed on purpose. One that stretched with the answer times of recent
successful handshakes (which strangers cannot feed) was built and measured against it in a
slow 7,168-worker burst (commit 8535ad8, docs/benchmarks.md): it did not stop the churn
(thousands of challenges went unanswered either way), bursts took longer (median 29.6 s
against 16.1 s over 7 pairs), and two of them left workers unserved. A longer age holds
the pool's places longer, and the line behind them waits out its deadline more often.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import random
import re
import resource
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from herd_operator.auth import ADMIN, Identity, derive_key, is_host, new_nonce, prove, verify

if TYPE_CHECKING:
    from tenacity import RetryCallState

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 1024
_MAX_CLIENT_LABEL = 128
# Labels are logged: nothing that could end a line, quote or escape.
_CLIENT_LABEL_PATTERN = re.compile(rf"[A-Za-z0-9._:@\[\]/-]{{1,{_MAX_CLIENT_LABEL}}}")
# Distinct (identity, op) refusals logged; further ones are only counted.
_MAX_FORBIDDEN_LOGGED = 1024
_MAX_NONCE_CHARS = 128
# Derived keys kept (a job's 7,168 workers share one); the cache is emptied when full.
_MAX_CACHED_KEYS = 4096
# Connects the kernel queues before accept: a starting job's shims (four per node, over
# a whole allocation) connect at once, and a connect beyond the queue waits for a SYN
# retransmit (1 s) instead of milliseconds. The kernel caps it at net.core.somaxconn.
_LISTEN_BACKLOG = 4096
_ABSENT = object()
# Open files the server's process needs besides its connections (store, logs, listener).
_DESCRIPTOR_MARGIN = 256
DEFAULT_MAX_CONNECTIONS = 16384
"""Enough for every shim of a 1,792-node x 4-GPU allocation binding at once (7,168), with
room for the agents and for a flood of strangers; bounded by the open-file limit."""
_AUTH_LOG_INTERVAL_S = 1.0
_UNKNOWN_OP_LABEL = "<unknown>"
# RpcClient's retries of a refused connection: the first pause is about this long...
_RETRY_FIRST_PAUSE_S = 0.05
# ...and it doubles with each retry up to this.
_RETRY_MAX_PAUSE_S = 2.0
# The clock of the auth-failure log limiter (a module attribute so tests can drive it).
_log_clock = time.monotonic
# The clock that ages unauthenticated connections (a module attribute for the same reason).
_pool_clock = time.monotonic


# The server's event loop. libuv's accepts, reads and writes run in C: a burst of 7,168
# workers binding cost the server's thread a fifth to a third less CPU on uvloop than on
# asyncio's own loop (docs/benchmarks.md, run 15). A module attribute so that
# scripts/burst_probe.py can measure either.
def _uvloop() -> asyncio.AbstractEventLoop:
    # Imported here: the workers' shim imports this module for its client, and never serves.
    import uvloop

    return uvloop.new_event_loop()


_new_event_loop: Callable[[], asyncio.AbstractEventLoop] = _uvloop

Handler = Callable[[dict[str, Any], Identity], dict[str, Any]]
"""Answers one op: gets the request's arguments and the identity the client proved."""

CommitGroup = Callable[[], AbstractContextManager[object]]
"""Opens one commit for a group of requests (e.g. ``Store.transaction``); its exit commits,
and raises if the commit failed."""

logger = logging.getLogger(__name__)


class RpcError(Exception):
    """An error response from the server, raised by the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class AuthError(RpcError):
    """The server rejected our credentials, or failed to prove it knows the token."""


class BadRequest(Exception):
    """Raised by a handler when the request's arguments are invalid."""


class NotFound(Exception):
    """Raised by a handler when the thing a request names does not exist."""


class Forbidden(Exception):
    """Raised by a handler when the caller's identity may not do what it asked."""


class Unavailable(Exception):
    """Raised by a handler (or a group's commit) that cannot serve now for a reason said
    already where it is known (a state store that refuses writes says so itself, once a
    minute at most): answered as an internal error, logged at debug instead of with a
    traceback per request."""


def host_arg(args: Mapping[str, Any], key: str) -> str:
    """The host name in ``args[key]``; raises BadRequest naming the field if it is not one."""
    value = args.get(key)
    if not isinstance(value, str) or not is_host(value):
        raise BadRequest(
            f"'{key}' must be a host name or IP address (letters, digits, '.', '-', '_',"
            " ':', '%'; at most 253 characters)"
        )
    return value


def is_client_label(text: object) -> TypeGuard[str]:
    return isinstance(text, str) and _CLIENT_LABEL_PATTERN.fullmatch(text) is not None


def parse_address(text: str) -> tuple[str, int]:
    """Parse ``host:port`` or ``[ipv6]:port``."""
    usage = f"invalid address {text!r}: expected HOST:PORT or [IPV6]:PORT"
    if text.startswith("["):
        host, separator, port_text = text[1:].partition("]:")
        if not separator:
            raise ValueError(usage)
    else:
        host, separator, port_text = text.rpartition(":")
        if not separator:
            raise ValueError(usage)
        if ":" in host:
            raise ValueError(f"{usage} (put IPv6 addresses in brackets)")
    if not host:
        raise ValueError(f"{usage} (empty host)")
    if not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"{usage} (port is not a number)")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{usage} (port must be in 1..65535)")
    return host, port


# One encoder for every frame: json.dumps with options builds a new one per call.
_FRAME_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


# The two frames every connection gets, formatted without the encoder: their only field is
# hex (a nonce, a proof), which JSON carries as it is. Every worker of a starting job opens a
# connection, so they count in a burst (tests/unit/test_rpc.py checks they decode as the
# encoder's would).
_CHALLENGE_FRAME = b'{"v":%d,"type":"challenge","nonce":"%%s"}\n' % PROTOCOL_VERSION
_WELCOME_FRAME = b'{"type":"welcome","proof":"%s"}\n'


def _encode_frame(message: Mapping[str, Any]) -> bytes:
    return _FRAME_ENCODER.encode(message).encode("utf-8")


def _decode_frame(line: bytes) -> dict[str, Any]:
    """Parse one frame (without its newline); raises ValueError with a short reason."""
    try:
        decoded = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("frame is not valid UTF-8") from None
    except (ValueError, RecursionError):
        raise ValueError("frame is not valid JSON") from None
    if not isinstance(decoded, dict):
        raise ValueError("frame is not a JSON object")
    return decoded


def _error_body(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": message}


class _Rejected(Exception):
    """Ends a connection: the peer gets an error frame, the log gets the reason."""

    def __init__(
        self, code: str, client_message: str, reason: str, *, in_handshake: bool = False
    ) -> None:
        super().__init__(reason)
        self.code = code
        self.client_message = client_message
        self.reason = reason
        self.in_handshake = in_handshake or code == "unauthenticated"
        """Anyone can cause it: its log lines are rate-limited per peer host."""


class _Refused(ConnectionError):
    """The server refused or dropped the connection; before its welcome, worth a retry."""


class _ConnectTimeout(TimeoutError):
    """A connect timed out; worth a retry."""


class _Connection(asyncio.Protocol):
    """One client connection, driven by the loop's callbacks: challenge, hello, requests.

    A protocol object rather than a stream task per connection: a request is parsed,
    dispatched and answered in one ``data_received`` call, with no task switch, no
    future and no timer per request. The deadlines are timers armed only when they can
    matter (the handshake, a frame left half-read, a peer that stops reading), and the
    idle timer is checked against the time of the last request only when it fires.
    """

    def __init__(self, server: RpcServer, loop: asyncio.AbstractEventLoop) -> None:
        self._server = server
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self.peer = "?"
        self.admitted = _pool_clock()
        """``_pool_clock()`` when it got its place in the unauthenticated pool, and with it
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
        server = self._server
        if server._shutting_down:
            stream.abort()
            return
        server._connections.add(self)
        try:
            if len(server._connections) > server._max_connections:
                raise _Rejected(
                    "unavailable",
                    "server is busy",
                    f"at the limit of {server._max_connections} connections",
                )
            admitted = server._admit(self, self.admitted, final=False)
        except _Rejected as rejected:
            self._reject(rejected)
            return
        if admitted:
            self.greet()
        else:
            # The pool is full of young handshakes: wait in line (silent, no challenge
            # yet) for a slot rather than be refused and come back, which in a burst of
            # thousands of shims costs more than the handshakes themselves.
            self.waiting = True
            self._queued_at = self._loop.time()
            server._waiting[self] = None
            self._deadline = self._loop.call_later(
                min(server._eviction_age, server._handshake_timeout), self._waited
            )

    def greet(self) -> None:
        """Send the challenge: the connection has its place in the unauthenticated pool."""
        assert self._transport is not None
        self.waiting = False
        if self._deadline is not None:
            self._deadline.cancel()
        self._server_nonce = new_nonce()
        self._transport.write(_CHALLENGE_FRAME % self._server_nonce.encode("ascii"))
        self._deadline = self._loop.call_later(
            self._server._handshake_timeout, self._handshake_expired
        )
        if self._buffer:
            self._process()  # it spoke before its challenge: no hello can verify

    def _waited(self) -> None:
        """Another eviction_age in line: take an idler's place if there is one now. After
        the handshake deadline in line, be refused as busy (RpcClient then tries again)."""
        self._deadline = None
        server = self._server
        remaining = self._queued_at + server._handshake_timeout - self._loop.time()
        final = remaining <= 0
        try:
            admitted = server._admit(self, _pool_clock(), final=final)
        except _Rejected as rejected:
            server._waiting.pop(self, None)
            self._reject(rejected)
            return
        if admitted:
            server._waiting.pop(self, None)
            self.greet()
        else:
            self._deadline = self._loop.call_later(
                min(server._eviction_age, remaining), self._waited
            )

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
        self._process()
        if self._identity is None and not self._closing:
            # The rest of the hello gets the handshake's short deadline from its first byte:
            # one byte must not buy an idler a long stay in the pool of strangers. (A hello
            # that came whole, as nearly all do, needs no timer.)
            self._rearm_deadline(self._server._handshake_timeout, self._handshake_expired)

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
                    raise RpcServer._oversize()
                try:
                    frame = _decode_frame(line)
                except ValueError as error:
                    raise _Rejected("bad_request", str(error), str(error)) from None
                identity = self._identity
                if identity is None:
                    self._authenticate(frame)
                else:
                    assert self._transport is not None
                    response = self._server._dispatch(frame, identity, self)
                    if response is None:
                        self._held = True  # answered after the group's commit
                    else:
                        self._transport.write(response + b"\n")
                    self._last_request = self._loop.time()
                    if self._deadline is not None:
                        self._deadline.cancel()
                        self._deadline = None
        except _Rejected as rejected:
            self._buffer = b""
            self._reject(rejected)
            return
        self._buffer = buffer
        if not buffer or self._closing or self._write_paused or self._held:
            return
        if len(buffer) > MAX_FRAME_BYTES:
            self._buffer = b""
            self._reject(RpcServer._oversize())
        elif self._identity is not None and self._deadline is None:
            # A frame has begun: the rest must follow within read_timeout so a trickling
            # peer cannot hold the connection.
            self._deadline = self._loop.call_later(self._server._read_timeout, self._frame_expired)

    def _authenticate(self, hello: dict[str, Any]) -> None:
        server = self._server
        client_nonce, label, identity, key = server._check_auth(hello, self._server_nonce)
        self._identity = identity
        server._release(self)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        proof = prove(key, "server", self._server_nonce, client_nonce)
        assert self._transport is not None
        self._transport.write(_WELCOME_FRAME % proof.encode("ascii"))
        logger.debug("authenticated client %s as %s from %s", label, identity, self.peer)
        self._last_request = self._loop.time()
        self._idle_timer = self._loop.call_later(server._idle_timeout, self._idle_check)

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
        timeout = self._server._handshake_timeout
        if self.speaking:
            rejected = _Rejected(
                "timeout",
                "timed out reading a frame",
                f"frame not completed within {timeout:g} s",
                in_handshake=True,
            )
        else:
            rejected = _Rejected(
                "timeout",
                "timed out waiting for authentication",
                f"no auth frame within {timeout:g} s",
                in_handshake=True,
            )
        self._reject(rejected)

    def _frame_expired(self) -> None:
        self._deadline = None
        timeout = self._server._read_timeout
        self._reject(
            _Rejected(
                "timeout", "timed out reading a frame", f"frame not completed within {timeout:g} s"
            )
        )

    def _idle_check(self) -> None:
        """Close the connection if no request came for idle_timeout; else look again later."""
        self._idle_timer = None
        if self._closing:
            return
        idle_timeout = self._server._idle_timeout
        due = self._last_request + idle_timeout
        if self._buffer or self._write_paused or due > self._loop.time():
            # A frame in progress or unread responses have deadlines of their own.
            self._idle_timer = self._loop.call_at(
                max(due, self._loop.time() + idle_timeout / 4), self._idle_check
            )
            return
        logger.debug("closing idle connection from %s", self.peer)
        self._close_with(_connection_error("idle_timeout", "connection closed after idling"))

    def _reject(self, rejected: _Rejected) -> None:
        if rejected.in_handshake or self._identity is None:
            # Anyone who can reach the port can cause these: rate-limited per host.
            self._server._log_auth_failure(self.peer, rejected.reason)
        else:
            logger.warning("rejected connection from %s: %s", self.peer, rejected.reason)
        self._close_with(_connection_error(rejected.code, rejected.client_message))

    def _close_with(self, frame: bytes) -> None:
        """Send a last frame and close; a peer that does not read it is cut off later."""
        if self._closing or self._transport is None:
            return
        self._closing = True
        self._server._release(self)
        self._cancel_timers()
        transport = self._transport
        transport.write(frame + b"\n")
        transport.close()
        self._abort_timer = self._loop.call_later(self._server._read_timeout, transport.abort)

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
        self._server._connections.discard(self)
        self._server._release(self)
        if exc is not None:
            logger.debug("connection from %s ended: %r", self.peer, exc)

    def pause_writing(self) -> None:
        # The peer is not reading its responses: read no more requests until it does.
        self._write_paused = True
        if self._closing or self._transport is None:
            return
        self._transport.pause_reading()
        self._drain_timer = self._loop.call_later(self._server._read_timeout, self._drain_expired)

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
            self._server._read_timeout,
        )
        self.abort()


class RpcServer:
    """Serves ``handlers`` to authenticated clients from an event loop (uvloop) in a thread."""

    def __init__(
        self,
        master_token: bytes,
        handlers: Mapping[str, Handler],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        read_timeout: float = 10.0,
        idle_timeout: float = 300.0,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_unauthenticated: int = 256,
        handshake_timeout: float = 5.0,
        eviction_age: float = 1.0,
        grouped_ops: Collection[str] = (),
        commit_group: CommitGroup | None = None,
    ) -> None:
        """``grouped_ops``: ops whose requests of one loop turn share one ``commit_group()``
        and are answered after it (see the module docstring); both or neither."""
        unknown = sorted(set(grouped_ops) - set(handlers))
        if unknown:
            raise ValueError(f"grouped_ops {unknown} name no handler; handlers: {sorted(handlers)}")
        if bool(grouped_ops) != (commit_group is not None):
            raise ValueError("grouped_ops and commit_group go together: give both or neither")
        self._master_token = master_token
        # Identity -> its derived key: every worker of a job proves the same one.
        self._keys: dict[Identity, bytes] = {}
        self._handlers = dict(handlers)
        self._grouped_ops = frozenset(grouped_ops)
        self._commit_group = commit_group
        # Grouped requests of this loop turn: (connection, id, op, handler, args, identity).
        self._group: list[tuple[_Connection, int, str, Handler, dict[str, Any], Identity]] = []
        self._host = host
        self._port = port
        self._read_timeout = read_timeout
        self._idle_timeout = idle_timeout
        self._max_connections = max_connections
        # Connections that have not proved the token yet are a pool of their own, with a
        # short deadline: anyone on the node can open them, and they must not crowd out
        # workers. When it is full, a newcomer takes the slot of the oldest silent one
        # older than eviction_age, or is refused (see the module docstring).
        self._max_unauthenticated = max_unauthenticated
        self._handshake_timeout = min(handshake_timeout, read_timeout)
        self._eviction_age = eviction_age
        # In the order they were admitted (dicts keep it), so the first evictable one is the
        # oldest.
        self._unauthenticated: dict[_Connection, None] = {}
        # Newcomers that found the pool full of young handshakes, in the order they came.
        self._waiting: dict[_Connection, None] = {}
        self._lifecycle_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._address: tuple[str, int] | None = None
        self._stopped = False
        self._connections: set[_Connection] = set()
        self._shutting_down = False
        self._counts: Counter[tuple[str, str]] = Counter()
        self._counts_lock = threading.Lock()
        # Peer host -> (time of the last auth-failure log line, lines suppressed since).
        self._auth_log_state: dict[str, tuple[float, int]] = {}
        self._forbidden_logged: set[tuple[str, str]] = set()

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); only valid once started."""
        if self._address is None:
            raise RuntimeError("RpcServer is not started")
        return self._address

    def start(self) -> tuple[str, int]:
        """Bind and serve in a daemon thread; return the bound address.

        Raises the process's soft limit on open files, within the hard limit, to what
        ``max_connections`` needs; where the hard limit is lower, fewer connections are
        allowed, and a warning says how many.
        """
        with self._lifecycle_lock:
            if self._thread is not None or self._stopped:
                raise RuntimeError("RpcServer can only be started once")
            self._fit_descriptors()
            loop = _new_event_loop()
            ready = threading.Event()
            bind_errors: list[OSError] = []
            thread = threading.Thread(
                target=self._run_loop,
                args=(loop, ready, bind_errors),
                name=f"rpc-server-{self._host}:{self._port}",
                daemon=True,
            )
            thread.start()
            ready.wait()
            if bind_errors:
                thread.join()
                raise bind_errors[0]
            self._loop = loop
            self._thread = thread
            return self.address

    def _fit_descriptors(self) -> None:
        wanted = self._max_connections + _DESCRIPTOR_MARGIN
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= wanted:
            return
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("raised the open-file soft limit from %d to %d", soft, target)
        if target < wanted:
            allowed = max(self._max_unauthenticated, target - _DESCRIPTOR_MARGIN)
            logger.warning(
                "the open-file hard limit %d allows %d connections, not %d",
                hard,
                allowed,
                self._max_connections,
            )
            self._max_connections = allowed

    def stop(self) -> None:
        """Close the listener and every connection, and join the thread; idempotent."""
        with self._lifecycle_lock:
            self._stopped = True
            loop, thread = self._loop, self._thread
            self._loop = None
            if loop is None or thread is None:
                return
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result()
            thread.join()

    def cpu_seconds(self) -> float:
        """CPU time the server's thread has used so far (benchmarks: per request, steadier
        than wall time on a shared machine); raises RuntimeError if not serving."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("RpcServer is not started")

        async def read() -> float:
            return time.thread_time()

        return asyncio.run_coroutine_threadsafe(read(), loop).result()

    def request_counts(self) -> dict[tuple[str, str], int]:
        """Requests served so far by (op, outcome); outcome is ``ok`` or an error code."""
        with self._counts_lock:
            return dict(self._counts)

    def __enter__(self) -> RpcServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _run_loop(
        self, loop: asyncio.AbstractEventLoop, ready: threading.Event, bind_errors: list[OSError]
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(
                    loop.create_server(
                        lambda: _Connection(self, loop),
                        self._host,
                        self._port,
                        backlog=_LISTEN_BACKLOG,
                    )
                )
            except OSError as error:
                bind_errors.append(error)
                ready.set()
                return
            self._server = server
            bound = server.sockets[0].getsockname()
            self._address = (bound[0], bound[1])
            ready.set()
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _shutdown(self) -> None:
        self._shutting_down = True  # a connection accepted from now on is dropped at once
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.abort()
        # Let the aborted transports run connection_lost, which closes their sockets.
        while self._connections:
            await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()
        asyncio.get_running_loop().stop()

    def _admit(self, connection: _Connection, now: float, *, final: bool) -> bool:
        """Put a connection in the unauthenticated pool, in the place of the oldest silent
        one older than eviction_age if it is full; return whether it got in.

        When it cannot get in: raise _Rejected (busy) if ``final``, else return False (it
        may wait in line).
        """
        if len(self._unauthenticated) >= self._max_unauthenticated:
            oldest_allowed = now - self._eviction_age
            for other in self._unauthenticated:
                if other.admitted > oldest_allowed:
                    # This one and every later one is too young to be taken for an idler.
                    if not final:
                        return False
                    raise _Rejected(
                        "busy",
                        "too many connections are authenticating; retry shortly",
                        f"{self._max_unauthenticated} connections are authenticating"
                        f" and none has been silent for {self._eviction_age:g} s",
                    )
                if not other.speaking:
                    del self._unauthenticated[other]
                    other.abort()
                    logger.debug(
                        "dropped a silent unauthenticated connection for %s", connection.peer
                    )
                    break
            else:
                if not final:
                    return False
                raise _Rejected(
                    "busy",
                    "too many connections are authenticating; retry shortly",
                    f"{self._max_unauthenticated} connections are sending their hello",
                )
        connection.admitted = now
        self._unauthenticated[connection] = None
        return True

    def _release(self, connection: _Connection) -> None:
        """``connection`` leaves the pool (or the line): the first in line takes its place."""
        self._waiting.pop(connection, None)
        if self._unauthenticated.pop(connection, _ABSENT) is _ABSENT:
            return
        while self._waiting and len(self._unauthenticated) < self._max_unauthenticated:
            first = next(iter(self._waiting))
            del self._waiting[first]
            first.admitted = _pool_clock()
            self._unauthenticated[first] = None
            first.greet()

    def _check_auth(
        self, hello: dict[str, Any], server_nonce: str
    ) -> tuple[str, str, Identity, bytes]:
        """Validate the auth frame; return (client nonce, label, identity, its key)."""
        if hello.get("type") != "auth":
            raise _Rejected(
                "unauthenticated", "authenticate first", "sent a frame before authenticating"
            )
        label, client_nonce, proof = hello.get("client"), hello.get("nonce"), hello.get("proof")
        claimed = hello.get("identity")
        if not (
            isinstance(client_nonce, str)
            and 0 < len(client_nonce) <= _MAX_NONCE_CHARS
            and isinstance(proof, str)
            and isinstance(claimed, str)
        ):
            raise _Rejected("unauthenticated", "malformed auth frame", "malformed auth frame")
        if not is_client_label(label):
            message = (
                f"'client' must be 1 to {_MAX_CLIENT_LABEL} characters of letters, digits"
                " and ._:@[]/-"
            )
            raise _Rejected("bad_request", message, "malformed client label", in_handshake=True)
        try:
            identity = Identity.parse(claimed)
        except ValueError as error:
            raise _Rejected(
                "bad_request", f"'identity': {error}", "malformed identity", in_handshake=True
            ) from None
        key = self._keys.get(identity)
        if key is None:
            if len(self._keys) >= _MAX_CACHED_KEYS:
                self._keys.clear()
            key = self._keys[identity] = derive_key(self._master_token, identity)
        if not verify(key, proof, "client", server_nonce, client_nonce, label, claimed):
            raise _Rejected(
                "unauthenticated",
                "authentication failed",
                f"authentication failed for client {label} as {identity} (wrong token?)",
            )
        return client_nonce, label, identity, key

    @staticmethod
    def _oversize() -> _Rejected:
        message = f"frame longer than {MAX_FRAME_BYTES} bytes"
        return _Rejected("bad_request", message, message)

    def _dispatch(
        self, request: dict[str, Any], identity: Identity, connection: _Connection
    ) -> bytes | None:
        """Run one request and return the encoded response frame; or, for a grouped op, put
        it in this turn's group and return None (the connection gets its answer later)."""
        request_id = request.get("id")
        op = request.get("op")
        op_label = op if isinstance(op, str) and op in self._handlers else _UNKNOWN_OP_LABEL
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            return self._fail(None, op_label, "bad_request", "'id' must be an integer")
        if not isinstance(op, str):
            return self._fail(request_id, op_label, "bad_request", "'op' must be a string")
        args = request.get("args", {})
        if not isinstance(args, dict):
            return self._fail(request_id, op_label, "bad_request", "'args' must be an object")
        handler = self._handlers.get(op)
        if handler is None:
            return self._fail(request_id, op_label, "unknown_op", f"unknown op {_clip(op)!r}")
        if op in self._grouped_ops:
            if not self._group:
                asyncio.get_running_loop().call_soon(self._run_group)
            self._group.append((connection, request_id, op, handler, args, identity))
            return None
        frame, outcome = self._invoke(request_id, op, handler, args, identity, connection.peer)
        self._count(op, outcome)
        return frame

    def _run_group(self) -> None:
        """Run this turn's grouped requests in one commit, then answer each."""
        group, self._group = self._group, []
        assert self._commit_group is not None
        answers: list[tuple[bytes, str]] = []
        try:
            with self._commit_group():
                for connection, request_id, op, handler, args, identity in group:
                    answers.append(
                        self._invoke(request_id, op, handler, args, identity, connection.peer)
                    )
        except Exception as error:
            if isinstance(error, Unavailable):
                logger.debug("the commit of a group of %d request(s): %s", len(group), error)
            else:
                logger.exception(
                    "the commit of a group of %d request(s) failed; every one of them that"
                    " was served gets an internal error",
                    len(group),
                )
            committed = answers
            answers = []
            for index, (_, request_id, op, *_) in enumerate(group):
                # A request its handler refused keeps its answer; one it served (or that
                # never ran, if the group failed to begin) lost its write with the commit.
                if index < len(committed) and committed[index][1] != "ok":
                    answers.append(committed[index])
                else:
                    answers.append(self._internal(request_id, op))
        for (frame, outcome), (connection, _, op, *_) in zip(answers, group, strict=True):
            self._count(op, outcome)
            connection.answer_grouped(frame)

    def _invoke(
        self,
        request_id: int,
        op: str,
        handler: Handler,
        args: dict[str, Any],
        identity: Identity,
        peer: str,
    ) -> tuple[bytes, str]:
        """Run a handler; return the response frame and the outcome to count."""
        try:
            result = handler(args, identity)
        except BadRequest as error:
            return self._error(request_id, "bad_request", _clip(str(error)))
        except NotFound as error:
            return self._error(request_id, "not_found", _clip(str(error)))
        except Forbidden as error:
            self._log_forbidden(identity, op, peer)
            return self._error(request_id, "forbidden", _clip(str(error)))
        except Unavailable as error:
            logger.debug("op %r unavailable (request from %s): %s", op, peer, error)
            return self._internal(request_id, op)
        except Exception:
            logger.exception("handler for op %r failed (request from %s)", op, peer)
            return self._internal(request_id, op)
        try:
            frame = _encode_result(request_id, result)
        except ValueError as error:
            logger.error("handler for op %r %s (request from %s)", op, error, peer)
            return self._internal(request_id, op)
        return frame, "ok"

    def _fail(self, request_id: int | None, op: str, code: str, message: str) -> bytes:
        self._count(op, code)
        return self._error_frame(request_id, code, message)

    @classmethod
    def _error(cls, request_id: int, code: str, message: str) -> tuple[bytes, str]:
        """An error response and the outcome it is counted as (its code)."""
        return cls._error_frame(request_id, code, message), code

    @classmethod
    def _internal(cls, request_id: int, op: str) -> tuple[bytes, str]:
        """The answer to a request whose handler or write failed: the details stay in the
        server's log."""
        return cls._error(request_id, "internal", f"internal error in op {op!r}")

    @staticmethod
    def _error_frame(request_id: int | None, code: str, message: str) -> bytes:
        return _encode_frame({"id": request_id, "ok": False, "error": _error_body(code, message)})

    def _count(self, op: str, outcome: str) -> None:
        with self._counts_lock:
            self._counts[(op, outcome)] += 1

    def _log_forbidden(self, identity: Identity, op: str, peer: str) -> None:
        """Log the first refusal of each (identity, op); later ones are only counted."""
        key = (str(identity), op)
        if key in self._forbidden_logged or len(self._forbidden_logged) >= _MAX_FORBIDDEN_LOGGED:
            return
        self._forbidden_logged.add(key)
        logger.warning(
            "refused op %r to %s from %s: not its to ask (further refusals only counted)",
            op,
            identity,
            peer,
        )

    def _log_auth_failure(self, peer: str, reason: str) -> None:
        host = peer.rpartition(":")[0]
        now = _log_clock()
        last, suppressed = self._auth_log_state.get(host, (-_AUTH_LOG_INTERVAL_S, 0))
        if now - last < _AUTH_LOG_INTERVAL_S:
            self._auth_log_state[host] = (last, suppressed + 1)
            return
        if len(self._auth_log_state) > self._max_connections:
            # Forget quiet hosts so a scan from many addresses cannot grow this forever.
            self._auth_log_state = {
                key: value
                for key, value in self._auth_log_state.items()
                if now - value[0] < _AUTH_LOG_INTERVAL_S
            }
        self._auth_log_state[host] = (now, 0)
        more = f" ({suppressed} similar rejections suppressed)" if suppressed else ""
        logger.warning("rejected connection from %s: %s%s", peer, reason, more)


def _encode_result(request_id: int, result: object) -> bytes:
    """Encode a success response; raises ValueError saying why ``result`` cannot be sent."""
    if not isinstance(result, dict):
        raise ValueError(f"returned {type(result).__name__}, not a dict")
    try:
        frame = _encode_frame({"id": request_id, "ok": True, "result": result})
    except (TypeError, ValueError) as error:
        raise ValueError(f"returned a result that is not JSON: {error}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ValueError(
            f"returned a result of {len(frame)} bytes, over the {MAX_FRAME_BYTES}-byte limit"
        )
    return frame


def _connection_error(code: str, message: str) -> bytes:
    return _encode_frame({"type": "error", "error": _error_body(code, message)})


def _clip(text: str, limit: int = 200) -> str:
    """Shorten peer- or handler-supplied text so an error response stays small."""
    return text if len(text) <= limit else text[:limit] + "..."


def _peer_label(peername: object) -> str:
    if isinstance(peername, tuple) and len(peername) >= 2:
        host, port = peername[0], peername[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peername)


class RpcClient:
    """A synchronous, thread-safe client; connects and authenticates on first use."""

    def __init__(
        self,
        address: tuple[str, int],
        token: bytes,
        *,
        identity: Identity = ADMIN,
        client: str = "client",
        timeout: float = 10.0,
        connect_attempts: int = 8,
        connect_deadline: float | None = None,
    ) -> None:
        """``token`` is ``identity``'s key: the master token for admin, else a derived one.

        A connection the server refuses as ``busy``, or closes or resets before its
        welcome, or a connect that times out, is tried again up to ``connect_attempts``
        times in all, after a jittered pause that doubles each time, as long as the next
        try starts within ``connect_deadline`` seconds (default: ``timeout``) of the
        first. Authentication failures and other refusals are never retried.
        """
        if connect_attempts < 1:
            raise ValueError("connect_attempts must be at least 1")
        if not is_client_label(client):
            raise ValueError(
                f"client label {client!r} must be 1 to {_MAX_CLIENT_LABEL} characters"
                " of letters, digits and ._:@[]/-"
            )
        self._address = address
        self._token = token
        self._identity = str(identity)
        self._label = client
        self._timeout = timeout
        self._connect_attempts = connect_attempts
        self._connect_deadline = timeout if connect_deadline is None else connect_deadline
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._buffer = bytearray()
        self._ids = itertools.count(1)

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Run ``op`` on the server and return its result.

        Raises RpcError for an error response (AuthError if authentication fails),
        ConnectionError or TimeoutError for transport problems, ValueError if the
        request is larger than a frame.
        """
        with self._lock:
            request_id = next(self._ids)
            payload = _encode_frame({"id": request_id, "op": op, "args": args})
            if len(payload) > MAX_FRAME_BYTES:
                raise ValueError(
                    f"request for op {op!r} is {len(payload)} bytes, "
                    f"over the {MAX_FRAME_BYTES}-byte frame limit"
                )
            may_retry = True
            while True:
                sock = self._connected()
                try:
                    sock.sendall(payload + b"\n")
                except TimeoutError:
                    self._drop()
                    raise TimeoutError(f"sending to {self._where()} timed out") from None
                except OSError as error:
                    self._drop()
                    if may_retry:
                        may_retry = False
                        continue
                    raise ConnectionError(f"sending to {self._where()} failed: {error}") from error
                response = self._receive(f"waiting for the response to op {op!r}")
                if may_retry and _is_idle_close(response):
                    # The server closed the idle connection before reading this request.
                    self._drop()
                    may_retry = False
                    continue
                return self._result(response, request_id)

    def close(self) -> None:
        """Close the connection; a later call reconnects."""
        with self._lock:
            self._drop()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def _where(self) -> str:
        host, port = self._address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def _connection_is_fresh(self) -> bool:
        """Drop the connection if the server closed it or sent something unasked."""
        sock = self._sock
        assert sock is not None
        if self._buffer:
            self._drop()
            return False
        sock.setblocking(False)
        try:
            sock.recv(1)
        except BlockingIOError:
            return True
        except OSError:
            pass
        finally:
            sock.settimeout(self._timeout)
        self._drop()
        return False

    def _connected(self) -> socket.socket:
        if self._sock is not None and self._connection_is_fresh():
            return self._sock
        attempts = 0

        def connect() -> socket.socket:
            nonlocal attempts
            attempts += 1
            return self._connect_once()

        # Here, not at the top: the operator serves without it, and starts sooner.
        from tenacity import (
            Retrying,
            retry_if_exception_type,
            stop_after_attempt,
            stop_before_delay,
        )

        retrying = Retrying(
            retry=retry_if_exception_type((_Refused, _ConnectTimeout)),
            # No try starts past the deadline: stop_before_delay counts the pause to come.
            stop=stop_after_attempt(self._connect_attempts)
            | stop_before_delay(self._connect_deadline),
            wait=_equal_jitter,
            before_sleep=_log_retry,
            reraise=True,
        )
        try:
            return retrying(connect)
        except (_Refused, _ConnectTimeout) as error:
            text = str(error) if attempts == 1 else f"{error} (tried {attempts} times)"
            if isinstance(error, _ConnectTimeout):
                raise TimeoutError(text) from None
            raise ConnectionError(text) from error

    def _connect_once(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._address, timeout=self._timeout)
        except TimeoutError:
            raise _ConnectTimeout(f"connecting to {self._where()} timed out") from None
        except OSError as error:
            raise ConnectionError(f"cannot connect to {self._where()}: {error}") from error
        self._sock = sock
        try:
            self._handshake(sock)
        except BaseException:
            self._drop()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        challenge = self._receive("waiting for the server's challenge")
        if challenge.get("type") == "error":
            self._raise_connection_error(challenge)
        server_nonce = challenge.get("nonce")
        if challenge.get("type") != "challenge" or not isinstance(server_nonce, str):
            raise ConnectionError(f"{self._where()} did not send a challenge")
        if challenge.get("v") != PROTOCOL_VERSION:
            raise ConnectionError(
                f"{self._where()} speaks protocol version {challenge.get('v')!r}, "
                f"not {PROTOCOL_VERSION}"
            )
        client_nonce = new_nonce()
        proof = prove(
            self._token, "client", server_nonce, client_nonce, self._label, self._identity
        )
        hello = {
            "type": "auth",
            "identity": self._identity,
            "client": self._label,
            "nonce": client_nonce,
            "proof": proof,
        }
        try:
            sock.sendall(_encode_frame(hello) + b"\n")
        except TimeoutError:
            raise TimeoutError(f"sending the hello to {self._where()} timed out") from None
        except OSError as error:
            raise _Refused(
                f"connection to {self._where()} broke sending the hello: {error}"
            ) from error
        welcome = self._receive("waiting for the server's welcome")
        if welcome.get("type") == "error":
            self._raise_connection_error(welcome)
        server_proof = welcome.get("proof")
        if (
            welcome.get("type") != "welcome"
            or not isinstance(server_proof, str)
            or not verify(self._token, server_proof, "server", server_nonce, client_nonce)
        ):
            raise AuthError(
                "unauthenticated",
                f"server at {self._where()} failed to prove it knows the token",
            )

    def _raise_connection_error(self, frame: dict[str, Any]) -> None:
        code = _error_code(frame)
        error = frame.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        text = message if isinstance(message, str) else "no message"
        if code == "unauthenticated":
            raise AuthError(code, f"server at {self._where()} rejected us: {text}")
        if code == "busy":
            raise _Refused(f"server at {self._where()} refused the connection: {code}: {text}")
        raise ConnectionError(f"server at {self._where()} refused the connection: {code}: {text}")

    def _receive(self, doing: str) -> dict[str, Any]:
        """Read one frame from the server; on any failure drop the connection."""
        sock = self._sock
        assert sock is not None
        deadline = time.monotonic() + self._timeout
        try:
            while True:
                end = self._buffer.find(b"\n")
                if end >= 0:
                    line = bytes(self._buffer[:end])
                    del self._buffer[: end + 1]
                    break
                if len(self._buffer) > MAX_FRAME_BYTES:
                    raise ConnectionError(f"{self._where()} sent a frame over the limit")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"timed out {doing} from {self._where()}")
                sock.settimeout(remaining)
                try:
                    chunk = sock.recv(MAX_FRAME_BYTES)
                except TimeoutError:
                    raise TimeoutError(f"timed out {doing} from {self._where()}") from None
                except OSError as error:
                    raise _Refused(
                        f"connection to {self._where()} broke {doing}: {error}"
                    ) from error
                if not chunk:
                    raise _Refused(f"{self._where()} closed the connection {doing}")
                self._buffer += chunk
            try:
                return _decode_frame(line)
            except ValueError as error:
                raise ConnectionError(f"{self._where()} sent a bad frame: {error}") from None
        except BaseException:
            self._drop()
            raise
        finally:
            if self._sock is not None:
                self._sock.settimeout(self._timeout)

    def _result(self, response: dict[str, Any], request_id: int) -> dict[str, Any]:
        if response.get("type") == "error":
            self._drop()
            error = response.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            raise RpcError(_error_code(response), message if isinstance(message, str) else "")
        if response.get("id") != request_id:
            self._drop()
            raise ConnectionError(
                f"{self._where()} answered request {response.get('id')!r}, not {request_id}"
            )
        if response.get("ok") is True and isinstance(response.get("result"), dict):
            result: dict[str, Any] = response["result"]
            return result
        error = response.get("error")
        if response.get("ok") is False and isinstance(error, dict):
            code, message = error.get("code"), error.get("message")
            if isinstance(code, str) and isinstance(message, str):
                raise RpcError(code, message)
        self._drop()
        raise ConnectionError(f"{self._where()} sent a malformed response")

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer.clear()


def _equal_jitter(state: RetryCallState) -> float:
    """The pause before the next connect: doubling from the first, at most the last, and
    "equal jitter" (half of it, plus up to as much again at random), so a burst of clients
    refused together spreads out."""
    doubled: float = _RETRY_FIRST_PAUSE_S * 2 ** (state.attempt_number - 1)
    return min(_RETRY_MAX_PAUSE_S, doubled) * random.uniform(0.5, 1.0)


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    logger.debug("%s; trying again in %.2f s", error, state.upcoming_sleep)


def _is_idle_close(frame: Mapping[str, Any]) -> bool:
    return frame.get("type") == "error" and _error_code(frame) == "idle_timeout"


def _error_code(frame: Mapping[str, Any]) -> str:
    error = frame.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "unknown"
