"""The allocator's wire protocol: an authenticated JSON-lines RPC over TCP.

What both ends share, and all a client needs: the framing, the constants, the errors a
handler raises and the client sees, and the parsing of addresses and labels. Apart from
the server so that what runs inside jobs (the shim, the worker API) loads no server code.

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
(``busy``: a client may retry shortly, and ``RpcClient`` does; ``pool.py`` says when),
when a started frame or the handshake takes longer than ``read_timeout`` (``timeout``),
and when an authenticated connection sits idle longer than ``idle_timeout``
(``idle_timeout``). The last one is only sent while no byte of a next request has been
read, so a client that gets it in place of a response knows its request was not
processed and may resend it on a new connection.

A reply to a grouped op (``dispatch.py``) comes only after the commit of what it reports.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

from herd_operator.auth import Identity, is_host

PROTOCOL_VERSION = 2
MAX_FRAME_BYTES = 64 * 1024
MAX_CLIENT_LABEL = 128
CLIENT_LABEL_RULE = f"1 to {MAX_CLIENT_LABEL} characters of letters, digits and ._:@[]/-"
"""What a client label may be, as both ends' error messages say it."""
# Labels are logged: nothing that could end a line, quote or escape.
_CLIENT_LABEL_PATTERN = re.compile(rf"[A-Za-z0-9._:@\[\]/-]{{1,{MAX_CLIENT_LABEL}}}")

Handler = Callable[[dict[str, Any], Identity], dict[str, Any]]
"""Answers one op: gets the request's arguments and the identity the client proved."""


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
CHALLENGE_FRAME = b'{"v":%d,"type":"challenge","nonce":"%%s"}\n' % PROTOCOL_VERSION
"""The server's challenge with its newline: ``CHALLENGE_FRAME % nonce_ascii``."""
WELCOME_FRAME = b'{"type":"welcome","proof":"%s"}\n'
"""The server's welcome with its newline: ``WELCOME_FRAME % proof_ascii``."""


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """One frame, without its newline; raises TypeError or ValueError if not JSON."""
    return _FRAME_ENCODER.encode(message).encode("utf-8")


def decode_frame(line: bytes) -> dict[str, Any]:
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


def error_body(code: str, message: str) -> dict[str, str]:
    """The ``error`` object of an error response or a connection error."""
    return {"code": code, "message": message}
