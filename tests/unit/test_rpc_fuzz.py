"""Fuzzing the RPC server's framing and dispatch with raw bytes over real loopback TCP.

Before authentication any bytes must end in one connection error frame (or a plain
close), never a welcome; after a real handshake every request frame gets exactly the
response the protocol (rpc/protocol.py's docstring) prescribes. After every example a normal
RpcClient still gets its answer, and nothing in the server's log is a traceback.
"""

from __future__ import annotations

import json
import logging
import math
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from herd_operator.auth import Identity, new_nonce, prove
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import MAX_FRAME_BYTES, Handler, NotFound
from herd_operator.rpc.server import RpcServer
from tests.unit.test_rpc import _add, _echo

# A failing example's repr may hold a 190 kB frame; hypothesis warns that it is large.
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")

TOKEN = bytes(range(32))
GUARD_S = 10.0
"""Hang guard for each blocking socket step; never a speed expectation."""

FUZZ = settings(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CONNECTION_CODES = {"bad_request", "unauthenticated", "timeout"}
LABEL = re.compile(r"[A-Za-z0-9._:@\[\]/-]{1,128}")
"""A client label the protocol accepts (rpc/protocol.py's docstring)."""


def _lookup(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
    raise NotFound(f"no {args.get('name')!r}")


HANDLERS: dict[str, Handler] = {"echo": _echo, "add": _add, "lookup": _lookup}


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def problems(self) -> list[str]:
        """Records that show a bug: a traceback, or an ERROR nobody asked for."""
        found = []
        for record in self.records:
            expected_error = "returned a result that is not JSON" in record.getMessage()
            if record.exc_info or (record.levelno >= logging.ERROR and not expected_error):
                found.append(f"{record.levelname} {record.name}: {record.getMessage()}")
        return found


@dataclass
class Rig:
    server: RpcServer
    client: RpcClient
    log: Records

    def check_healthy(self) -> None:
        """A legitimate call still works, and the log holds no traceback."""
        assert self.client.call("add", x=2, y=3) == {"sum": 5}
        assert self.log.problems() == []


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    log = Records()
    loggers = [logging.getLogger("herd_operator.rpc"), logging.getLogger("asyncio")]
    for logger in loggers:
        logger.addHandler(log)
    # Short deadlines so a half-sent frame ends its connection quickly.
    server = RpcServer(TOKEN, HANDLERS, read_timeout=2.0, handshake_timeout=2.0)
    server.start()
    client = RpcClient(server.address, TOKEN, client="fuzz-check", timeout=GUARD_S)
    try:
        yield Rig(server, client, log)
    finally:
        client.close()
        server.stop()
        for logger in loggers:
            logger.removeHandler(log)


class Peer:
    """A raw connection: send bytes, read frames until the server closes."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address, timeout=GUARD_S)
        self.buffer = b""
        self.reset = False

    def close(self) -> None:
        self.sock.close()

    def frame(self) -> dict[str, Any] | None:
        """The next frame, or None once the server closed (or reset) the connection."""
        while b"\n" not in self.buffer:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                self.reset = True
                return None
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        decoded = json.loads(line)
        assert isinstance(decoded, dict), line
        return decoded

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.reset = True

    def finish_sending(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.reset = True  # the server already ended the connection

    def authenticate(self) -> None:
        challenge = self.frame()
        assert challenge is not None and challenge["type"] == "challenge"
        nonce = new_nonce()
        proof = prove(TOKEN, "client", challenge["nonce"], nonce, "fuzz", "admin")
        hello = {
            "type": "auth",
            "identity": "admin",
            "client": "fuzz",
            "nonce": nonce,
            "proof": proof,
        }
        self.send(json.dumps(hello).encode() + b"\n")
        welcome = self.frame()
        assert welcome is not None and welcome["type"] == "welcome", welcome


# ---- strategies ----

JSON_VALUES: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
# Lengths well away from the frame limit, on either side, so the expected outcome is clear.
HUGE = st.integers(MAX_FRAME_BYTES + 16, 3 * MAX_FRAME_BYTES)


def _encode(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8")


GARBAGE_LINES = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda n: b"x" * n, HUGE),
    st.builds(lambda n: b"[" * n, st.integers(1000, 60_000)),
    st.builds(lambda n: b'{"a":' * n, st.integers(1000, 10_000)),
    st.sampled_from(
        [
            b"",
            b"\xff\xfe",
            b'{"type": "\xc3\x28"}',
            b'{"type": "auth", "proof": "\xed\xa0\x80"}',
            b"null",
            b"[]",
            b'"auth"',
            b"1e999",
            b"9" * 5000,
            b"NaN",
            b'{"id": 1, "op": "add"',
            b"\x00" * 64,
            b"\r",
            b'{"id":1}{"id":2}',
        ]
    ),
)
AUTH_LIKE = st.fixed_dictionaries(
    {"type": st.one_of(st.just("auth"), JSON_VALUES)},
    optional={
        "identity": st.one_of(
            st.sampled_from(["admin", "job:a", "agent:node-1", "job:A", "agent:a b", "root", ""]),
            JSON_VALUES,
        ),
        "client": st.one_of(st.sampled_from(["fuzz", "a b", "x" * 129, ""]), JSON_VALUES),
        "nonce": st.one_of(JSON_VALUES, st.text(min_size=100, max_size=200)),
        "proof": st.one_of(JSON_VALUES, st.text(alphabet="0123456789abcdef", min_size=64)),
        "v": JSON_VALUES,
        "id": JSON_VALUES,
        "op": JSON_VALUES,
    },
)
PRE_AUTH_LINES = st.one_of(
    GARBAGE_LINES,
    st.builds(_encode, JSON_VALUES, st.booleans()),
    st.builds(_encode, AUTH_LIKE, st.booleans()),
)


@st.composite
def pre_auth_blobs(draw: st.DrawFn) -> bytes:
    """One to three lines, the last one maybe without its newline."""
    lines = draw(st.lists(PRE_AUTH_LINES, min_size=1, max_size=3))
    blob = b"\n".join(lines)
    return blob if draw(st.booleans()) else blob + b"\n"


OPS = st.one_of(st.sampled_from(["echo", "add", "lookup", "", "ECHO", "add "]), JSON_VALUES)
REQUESTS = st.fixed_dictionaries(
    {},
    optional={
        "id": st.one_of(st.integers(), st.integers(-(2**80), 2**80), JSON_VALUES),
        "op": OPS,
        "args": st.one_of(
            st.fixed_dictionaries({}, optional={"x": JSON_VALUES, "y": JSON_VALUES}),
            st.fixed_dictionaries({"x": st.integers(), "y": st.integers()}),
            JSON_VALUES,
        ),
        "type": JSON_VALUES,
        "extra": JSON_VALUES,
    },
)


JSON_OBJECTS = st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=5)


# ---- the model of the protocol ----


def expected_connection_error(line: bytes) -> str:
    """The code of the error frame the server must answer one line with, before auth."""
    if len(line) > MAX_FRAME_BYTES:
        return "bad_request"
    try:
        decoded = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):
        return "bad_request"
    if not isinstance(decoded, dict):
        return "bad_request"
    if decoded.get("type") != "auth":
        return "unauthenticated"
    nonce, proof, identity = decoded.get("nonce"), decoded.get("proof"), decoded.get("identity")
    if not (
        isinstance(nonce, str)
        and 0 < len(nonce) <= 128
        and isinstance(proof, str)
        and isinstance(identity, str)
    ):
        return "unauthenticated"  # a malformed auth frame
    label = decoded.get("client")
    if not isinstance(label, str) or LABEL.fullmatch(label) is None:
        return "bad_request"
    try:
        Identity.parse(identity)
    except ValueError:
        return "bad_request"
    return "unauthenticated"  # a well-formed hello, but the proof cannot be right


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(item) for item in value)
    if isinstance(value, dict):
        return all(_finite(item) for item in value.values())
    return True


def expected_response(request: dict[str, Any]) -> tuple[Any, str, Any]:
    """(id, outcome, result) the server must answer; outcome is "ok" or an error code."""
    request_id, op = request.get("id"), request.get("op")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        return None, "bad_request", None
    args = request.get("args", {})
    if not isinstance(op, str) or not isinstance(args, dict):
        return request_id, "bad_request", None
    if op not in HANDLERS:
        return request_id, "unknown_op", None
    if op == "lookup":
        return request_id, "not_found", None
    if op == "add":
        x, y = args.get("x"), args.get("y")
        if isinstance(x, int) and isinstance(y, int):
            return request_id, "ok", {"sum": x + y}
        return request_id, "bad_request", None
    # echo: the arguments come back, unless they cannot be sent as JSON (NaN, Infinity).
    return (request_id, "ok", args) if _finite(args) else (request_id, "internal", None)


def _same_json(left: Any, right: Any) -> bool:
    return json.dumps(left, sort_keys=True) == json.dumps(right, sort_keys=True)


# ---- tests ----


@settings(FUZZ, max_examples=200)
@given(blob=pre_auth_blobs())
def test_bytes_before_authentication_end_in_an_error_frame_or_a_close(
    rig: Rig, blob: bytes
) -> None:
    peer = Peer(rig.server.address)
    try:
        challenge = peer.frame()
        assert challenge is not None and challenge["type"] == "challenge"
        peer.send(blob)
        peer.finish_sending()
        answer = peer.frame()
        after = peer.frame() if answer is not None else None
    finally:
        peer.close()
    first, newline, rest = blob.partition(b"\n")
    if not newline and len(first) <= MAX_FRAME_BYTES:
        # An unfinished frame at the end of the stream: a plain close.
        assert answer is None
    elif answer is None:
        # Unread bytes after the offending line may make the close a reset, which
        # discards the error frame in flight; the server still ended the connection.
        assert peer.reset and (rest or len(first) > MAX_FRAME_BYTES), blob[:200]
    else:
        assert answer["type"] == "error", answer
        assert answer["error"]["code"] == expected_connection_error(first), (answer, blob[:200])
        assert after is None, "the server must close after a connection error"
    rig.check_healthy()


@settings(FUZZ, max_examples=200)
@given(
    requests=st.lists(
        st.one_of(REQUESTS, JSON_VALUES.filter(lambda v: isinstance(v, dict))), max_size=6
    ),
    ascii_only=st.booleans(),
    garbage=st.one_of(st.none(), GARBAGE_LINES),
)
def test_requests_after_authentication_get_the_prescribed_answer(
    rig: Rig, requests: list[dict[str, Any]], ascii_only: bool, garbage: bytes | None
) -> None:
    peer = Peer(rig.server.address)
    try:
        peer.authenticate()
        for request in requests:
            peer.send(_encode(request, ascii_only) + b"\n")
            response = peer.frame()
            assert response is not None, f"closed after {request!r}"
            request_id, outcome, result = expected_response(request)
            assert response.get("id") == request_id, (request, response)
            if outcome == "ok":
                assert response["ok"] is True, (request, response)
                assert _same_json(response["result"], result), (request, response)
            else:
                assert response["ok"] is False, (request, response)
                assert response["error"]["code"] == outcome, (request, response)
                assert isinstance(response["error"]["message"], str)
        if garbage is not None and b"\n" not in garbage:
            peer.send(garbage + b"\n")
            answer = peer.frame()
            try:
                decoded = json.loads(garbage.decode("utf-8"))
            except (ValueError, RecursionError):
                decoded = None
            if isinstance(decoded, dict) and len(garbage) <= MAX_FRAME_BYTES:
                assert answer is not None and "ok" in answer, (garbage[:200], answer)
            elif answer is None:
                assert peer.reset and len(garbage) > MAX_FRAME_BYTES, garbage[:200]
            else:
                assert answer["type"] == "error", answer
                assert answer["error"]["code"] in CONNECTION_CODES, answer
                assert peer.frame() is None, "the server must close after a connection error"
    finally:
        peer.close()
    rig.check_healthy()


def test_a_frame_that_trickles_in_is_cut_off(rig: Rig) -> None:
    """Half a frame and then silence: the read deadline ends it with a timeout error."""
    peer = Peer(rig.server.address)
    try:
        peer.authenticate()
        peer.send(b'{"id": 1, "op": "add"')
        answer = peer.frame()
        assert answer is not None and answer["error"]["code"] == "timeout", answer
        assert peer.frame() is None
    finally:
        peer.close()
    rig.check_healthy()


def test_an_unanswered_challenge_times_out(rig: Rig) -> None:
    peer = Peer(rig.server.address)
    try:
        assert (peer.frame() or {}).get("type") == "challenge"
        answer = peer.frame()
        assert answer is not None and answer["error"]["code"] == "timeout", answer
    finally:
        peer.close()
    rig.check_healthy()


def test_stopping_with_a_connection_open_logs_no_traceback() -> None:
    log = Records()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(log)
    try:
        with RpcServer(TOKEN, HANDLERS) as server:
            client = RpcClient(server.address, TOKEN, timeout=GUARD_S)
            assert client.call("add", x=1, y=1) == {"sum": 2}
        client.close()
    finally:
        asyncio_logger.removeHandler(log)
    assert log.problems() == []


def _warnings_from(connections: int, payload: bytes, **options: Any) -> list[str]:
    """The RPC server's warning lines after `connections` peers each sent `payload`."""
    log = Records()
    rpc_logger = logging.getLogger("herd_operator.rpc")
    rpc_logger.addHandler(log)
    try:
        with RpcServer(TOKEN, HANDLERS, **options) as server:
            for _ in range(connections):
                peer = Peer(server.address)
                try:
                    assert (peer.frame() or {}).get("type") == "challenge"
                    peer.send(payload)
                    while peer.frame() is not None:
                        pass
                finally:
                    peer.close()
    finally:
        rpc_logger.removeHandler(log)
    return [r.getMessage() for r in log.records if r.levelno >= logging.WARNING]


def test_the_handshake_timeout_is_logged_with_its_own_deadline() -> None:
    lines = _warnings_from(1, b"", read_timeout=3.0, handshake_timeout=0.5)
    assert any("no auth frame within 0.5 s" in line for line in lines), lines


def test_garbage_before_authentication_is_logged_at_a_bounded_rate() -> None:
    # A frozen clock: a limiter like the one for auth failures would allow one line.
    def frozen() -> float:
        return 1000.0

    malformed_auth = _warnings_from(30, b'{"type": "auth"}\n', clock=frozen)
    assert len(malformed_auth) == 1, malformed_auth  # the limiter as it works today
    garbage = _warnings_from(30, b"not json\n", clock=frozen)
    assert len(garbage) <= 2, f"{len(garbage)} lines, e.g. {garbage[:2]}"
