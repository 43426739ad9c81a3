"""The client: a synchronous, thread-safe ``RpcClient`` and its retry policy.

What runs inside jobs (the shim, the worker API) and on nodes (the exporter) imports this
module and ``protocol`` only: blocking sockets, no event loop, no server code.
"""

from __future__ import annotations

import itertools
import logging
import random
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from herd_operator.auth import ADMIN, Identity, new_nonce, prove, verify
from herd_operator.rpc.protocol import (
    CLIENT_LABEL_RULE,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AuthError,
    RpcError,
    decode_frame,
    encode_frame,
    is_client_label,
)

if TYPE_CHECKING:
    from tenacity import RetryCallState

# RpcClient's retries of a refused connection: the first pause is about this long...
_RETRY_FIRST_PAUSE_S = 0.05
# ...and it doubles with each retry up to this.
_RETRY_MAX_PAUSE_S = 2.0

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


class _Refused(ConnectionError):
    """The server refused or dropped the connection; before its welcome, worth a retry."""


class _ConnectTimeout(TimeoutError):
    """A connect timed out; worth a retry."""


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
            raise ValueError(f"client label {client!r} must be {CLIENT_LABEL_RULE}")
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
            payload = encode_frame({"id": request_id, "op": op, "args": args})
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
            sock.sendall(encode_frame(hello) + b"\n")
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
                return decode_frame(line)
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
