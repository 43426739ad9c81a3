"""The allocator's RPC server: ``RpcServer`` serves handlers to authenticated clients from an
event loop (uvloop) in a thread of its own.

This module is the server's lifecycle and its public face: binding, the loop's thread,
the open-file limit, stopping, and the figures it keeps. What one connection does is in
``connection.py``; the pool of connections still in their handshake in ``pool.py``; the
check of a hello in ``handshake.py``; the running of requests (and grouped ops) in
``dispatch.py``; the wire format in ``protocol.py``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import TracebackType

from herd_operator.rpc.connection import Connection, ConnectionObserver, Limits, Serving
from herd_operator.rpc.dispatch import CommitGroup, Dispatcher
from herd_operator.rpc.handshake import Authenticator, RejectionLog
from herd_operator.rpc.pool import UnauthenticatedPool
from herd_operator.rpc.protocol import Handler

# Connects the kernel queues before accept: a starting job's shims (four per node, over
# a whole allocation) connect at once, and a connect beyond the queue waits for a SYN
# retransmit (1 s) instead of milliseconds. The kernel caps it at net.core.somaxconn.
_LISTEN_BACKLOG = 4096
# Open files the server's process needs besides its connections (store, logs, listener).
_DESCRIPTOR_MARGIN = 256
DEFAULT_MAX_CONNECTIONS = 16384
"""Authenticated connections and those waiting in line for a place in the pool: enough for
every shim of a 1,792-node x 4-GPU allocation binding at once (7,168), with room for the
agents; the pool of connections in their handshake comes on top. Strangers cannot take
these places from workers: they are a line's at most while no worker needs them (see
``pool.py``). Bounded by the open-file limit."""

# The package's one logger (operators' filters name it; a logger's filters do not see its
# children's records).
logger = logging.getLogger("herd_operator.rpc")


def uvloop_event_loop() -> asyncio.AbstractEventLoop:
    """The server's event loop by default. libuv's accepts, reads and writes run in C: a
    burst of 7,168 workers binding cost the server's thread a fifth to a third less CPU on
    uvloop than on asyncio's own loop (docs/benchmarks.md, run 15)."""
    # Imported here: only a server that starts needs it.
    import uvloop

    return uvloop.new_event_loop()


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
        max_wait: float | None = None,
        grouped_ops: Collection[str] = (),
        commit_group: CommitGroup | None = None,
        new_event_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop_event_loop,
        clock: Callable[[], float] = time.monotonic,
        observer: ConnectionObserver | None = None,
    ) -> None:
        """``grouped_ops``: ops whose requests of one loop turn share one ``commit_group()``
        and are answered after it (see ``dispatch.py``); both or neither.

        ``max_connections``: authenticated connections, and those that wait in line for a
        place in the pool. ``max_unauthenticated``, ``eviction_age``, ``max_wait``,
        ``handshake_timeout``: the pool of connections in their handshake and its line (see
        ``pool.py``); ``max_wait`` is the handshake deadline unless a shorter one is given.
        ``new_event_loop`` makes the loop the server runs on. ``clock`` (seconds, monotonic)
        ages the connections in that pool and spaces the log lines of refused handshakes;
        the loop's timers keep the loop's own clock. ``observer`` hears of each
        connection's events (a diagnostic).
        """
        self._dispatcher = Dispatcher(handlers, grouped_ops, commit_group)
        self._master_token = master_token
        self._host = host
        self._port = port
        # Connections that have not proved the token yet are a pool of their own, with a
        # short deadline: anyone on the node can open them, and they must not crowd out
        # workers (see pool.py).
        self._max_unauthenticated = max_unauthenticated
        self._limits = Limits(
            read_timeout=read_timeout,
            idle_timeout=idle_timeout,
            handshake_timeout=min(handshake_timeout, read_timeout),
            eviction_age=eviction_age,
            max_wait=min(
                handshake_timeout if max_wait is None else max_wait,
                handshake_timeout,
                read_timeout,
            ),
            max_connections=max_connections,
        )
        self._new_event_loop = new_event_loop
        self._clock = clock
        self._observer = ConnectionObserver() if observer is None else observer
        self._lifecycle_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._serving: Serving | None = None
        self._address: tuple[str, int] | None = None
        self._stopped = False

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
            limits = self._limits
            self._serving = Serving(
                limits=limits,
                pool=UnauthenticatedPool(
                    self._max_unauthenticated, limits.eviction_age, self._clock
                ),
                authenticator=Authenticator(self._master_token),
                rejections=RejectionLog(self._clock, limits.max_connections),
                dispatcher=self._dispatcher,
                observer=self._observer,
                clock=self._clock,
            )
            loop = self._new_event_loop()
            ready = threading.Event()
            bind_errors: list[OSError] = []
            thread = threading.Thread(
                target=self._run_loop,
                args=(loop, self._serving, ready, bind_errors),
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
        max_connections = self._limits.max_connections
        wanted = max_connections + self._max_unauthenticated + _DESCRIPTOR_MARGIN
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft >= wanted:
            return
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            logger.info("raised the open-file soft limit from %d to %d", soft, target)
        if target < wanted:
            allowed = max(1, target - _DESCRIPTOR_MARGIN - self._max_unauthenticated)
            logger.warning(
                "the open-file hard limit %d allows %d connections, not %d",
                hard,
                allowed,
                max_connections,
            )
            self._limits = replace(self._limits, max_connections=allowed)

    def stop(self) -> None:
        """Close the listener and every connection, and join the thread; idempotent."""
        with self._lifecycle_lock:
            self._stopped = True
            loop, thread, serving = self._loop, self._thread, self._serving
            self._loop = None
            if loop is None or thread is None or serving is None:
                return
            asyncio.run_coroutine_threadsafe(self._shutdown(serving), loop).result()
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
        return self._dispatcher.counts()

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
        self,
        loop: asyncio.AbstractEventLoop,
        serving: Serving,
        ready: threading.Event,
        bind_errors: list[OSError],
    ) -> None:
        asyncio.set_event_loop(loop)
        try:
            try:
                server = loop.run_until_complete(
                    loop.create_server(
                        lambda: Connection(serving, loop),
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

    async def _shutdown(self, serving: Serving) -> None:
        serving.shutting_down = True  # a connection accepted from now on is dropped at once
        if self._server is not None:
            self._server.close()
        for connection in list(serving.connections):
            connection.abort()
        # Let the aborted transports run connection_lost, which closes their sockets.
        while serving.connections:
            await asyncio.sleep(0)
        if self._server is not None:
            await self._server.wait_closed()
        asyncio.get_running_loop().stop()
