"""Running requests on the server: the op table, the grouped ops' shared commit, the error
responses, and the counts by op and outcome.

Apart from the connections: what a request does once it is framed and its sender known.

Grouped ops (``RpcServer(grouped_ops=..., commit_group=...)``, e.g. ``report`` and the
store's transaction): the requests for them that arrive in one turn of the server's loop
are run together inside one ``commit_group()`` context (one SQLite commit for all), and
each is answered only after that context has exited: a reply never precedes the commit
of what it reports. If the exit raises (the commit failed), every request of the group
that its handler had served gets the error that request would have got had its own write
failed (``internal``, details in the server's log). A connection with a request in a
group reads its next request only after the group, so replies stay in request order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol

from herd_operator.auth import Identity
from herd_operator.rpc.protocol import (
    MAX_FRAME_BYTES,
    BadRequest,
    Forbidden,
    Handler,
    NotFound,
    Unavailable,
    encode_frame,
    error_body,
)

CommitGroup = Callable[[], AbstractContextManager[object]]
"""Opens one commit for a group of requests (e.g. ``Store.transaction``); its exit commits,
and raises if the commit failed."""

# Distinct (identity, op) refusals logged; further ones are only counted.
_MAX_FORBIDDEN_LOGGED = 1024
_UNKNOWN_OP_LABEL = "<unknown>"

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


class Requester(Protocol):
    """The connection a request came on, as the dispatcher sees it."""

    @property
    def peer(self) -> str:
        """The peer's address, for the log."""

    def answer_grouped(self, response: bytes) -> None:
        """The reply to its request in the group, after the group's commit."""


class Dispatcher:
    """Runs each request's handler and encodes its answer; runs grouped ops in groups."""

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        grouped_ops: Collection[str] = (),
        commit_group: CommitGroup | None = None,
    ) -> None:
        unknown = sorted(set(grouped_ops) - set(handlers))
        if unknown:
            raise ValueError(f"grouped_ops {unknown} name no handler; handlers: {sorted(handlers)}")
        if bool(grouped_ops) != (commit_group is not None):
            raise ValueError("grouped_ops and commit_group go together: give both or neither")
        self._handlers = dict(handlers)
        self._grouped_ops = frozenset(grouped_ops)
        self._commit_group = commit_group
        # Grouped requests of this loop turn: (requester, id, op, handler, args, identity).
        self._group: list[tuple[Requester, int, str, Handler, dict[str, Any], Identity]] = []
        self._counts: Counter[tuple[str, str]] = Counter()
        self._counts_lock = threading.Lock()
        self._forbidden_logged: set[tuple[str, str]] = set()

    def counts(self) -> dict[tuple[str, str], int]:
        """Requests served so far by (op, outcome); outcome is ``ok`` or an error code."""
        with self._counts_lock:
            return dict(self._counts)

    def dispatch(
        self, request: dict[str, Any], identity: Identity, requester: Requester
    ) -> bytes | None:
        """Run one request and return the encoded response frame; or, for a grouped op, put
        it in this turn's group and return None (the requester gets its answer later)."""
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
            self._group.append((requester, request_id, op, handler, args, identity))
            return None
        frame, outcome = self._invoke(request_id, op, handler, args, identity, requester.peer)
        self._count(op, outcome)
        return frame

    def _run_group(self) -> None:
        """Run this turn's grouped requests in one commit, then answer each."""
        group, self._group = self._group, []
        assert self._commit_group is not None
        answers: list[tuple[bytes, str]] = []
        try:
            with self._commit_group():
                for requester, request_id, op, handler, args, identity in group:
                    answers.append(
                        self._invoke(request_id, op, handler, args, identity, requester.peer)
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
        for (frame, outcome), (requester, _, op, *_) in zip(answers, group, strict=True):
            self._count(op, outcome)
            requester.answer_grouped(frame)

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
        return encode_frame({"id": request_id, "ok": False, "error": error_body(code, message)})

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


def _encode_result(request_id: int, result: object) -> bytes:
    """Encode a success response; raises ValueError saying why ``result`` cannot be sent."""
    if not isinstance(result, dict):
        raise ValueError(f"returned {type(result).__name__}, not a dict")
    try:
        frame = encode_frame({"id": request_id, "ok": True, "result": result})
    except (TypeError, ValueError) as error:
        raise ValueError(f"returned a result that is not JSON: {error}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise ValueError(
            f"returned a result of {len(frame)} bytes, over the {MAX_FRAME_BYTES}-byte limit"
        )
    return frame


def _clip(text: str, limit: int = 200) -> str:
    """Shorten peer- or handler-supplied text so an error response stays small."""
    return text if len(text) <= limit else text[:limit] + "..."
