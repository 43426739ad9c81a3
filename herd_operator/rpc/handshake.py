"""The server's side of the handshake: checking a hello against the identity's key, and the
log of the refusals that anyone who can reach the port can cause, rate-limited per host.

Apart from the connection's callbacks: this is where the token's keys are, and what a
stranger's garbage turns into (a refusal and at most one log line a second per host).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from herd_operator.auth import Identity, derive_key, verify
from herd_operator.rpc.protocol import CLIENT_LABEL_RULE, is_client_label

_MAX_NONCE_CHARS = 128
# Derived keys kept (a job's 7,168 workers share one); the cache is emptied when full.
_MAX_CACHED_KEYS = 4096
_AUTH_LOG_INTERVAL_S = 1.0

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


class Rejected(Exception):
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


class Authenticator:
    """Checks hellos against the keys derived from the master token."""

    def __init__(self, master_token: bytes) -> None:
        self._master_token = master_token
        # Identity -> its derived key: every worker of a job proves the same one.
        self._keys: dict[Identity, bytes] = {}

    def check(self, hello: dict[str, Any], server_nonce: str) -> tuple[str, str, Identity, bytes]:
        """Validate the auth frame; return (client nonce, label, identity, its key).

        Raises Rejected saying why not.
        """
        if hello.get("type") != "auth":
            raise Rejected(
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
            raise Rejected("unauthenticated", "malformed auth frame", "malformed auth frame")
        if not is_client_label(label):
            message = f"'client' must be {CLIENT_LABEL_RULE}"
            raise Rejected("bad_request", message, "malformed client label", in_handshake=True)
        try:
            identity = Identity.parse(claimed)
        except ValueError as error:
            raise Rejected(
                "bad_request", f"'identity': {error}", "malformed identity", in_handshake=True
            ) from None
        key = self._keys.get(identity)
        if key is None:
            if len(self._keys) >= _MAX_CACHED_KEYS:
                self._keys.clear()
            key = self._keys[identity] = derive_key(self._master_token, identity)
        if not verify(key, proof, "client", server_nonce, client_nonce, label, claimed):
            raise Rejected(
                "unauthenticated",
                "authentication failed",
                f"authentication failed for client {label} as {identity} (wrong token?)",
            )
        return client_nonce, label, identity, key


class RejectionLog:
    """Logs refusals that anyone can cause: at most one line a second per peer host, which
    counts the ones it held back; remembers at most about ``max_hosts`` hosts."""

    def __init__(self, clock: Callable[[], float], max_hosts: int) -> None:
        self._clock = clock
        self._max_hosts = max_hosts
        # Peer host -> (time of the last auth-failure log line, lines suppressed since).
        self._state: dict[str, tuple[float, int]] = {}

    def rejected(self, peer: str, reason: str) -> None:
        host = peer.rpartition(":")[0]
        now = self._clock()
        last, suppressed = self._state.get(host, (-_AUTH_LOG_INTERVAL_S, 0))
        if now - last < _AUTH_LOG_INTERVAL_S:
            self._state[host] = (last, suppressed + 1)
            return
        if len(self._state) > self._max_hosts:
            # Forget quiet hosts so a scan from many addresses cannot grow this forever.
            self._state = {
                key: value
                for key, value in self._state.items()
                if now - value[0] < _AUTH_LOG_INTERVAL_S
            }
        self._state[host] = (now, 0)
        more = f" ({suppressed} similar rejections suppressed)" if suppressed else ""
        logger.warning("rejected connection from %s: %s%s", peer, reason, more)
