"""The `/metrics` HTTP server of the operator and the node exporter, with bounds.

prometheus_client's own server starts a thread for every connection and waits on it
without a deadline: on a shared node, anyone can hold hundreds of idle connections
open and as many threads with them. This one serves at most `max_connections` at once
(more are closed at once: Prometheus retries at its next scrape) and drops a
connection that sends nothing for `timeout_seconds`.
"""

from __future__ import annotations

import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

MAX_CONNECTIONS = 16
TIMEOUT_SECONDS = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = TIMEOUT_SECONDS  # StreamRequestHandler applies it to the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape would drown the operator's log


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def server_activate(self) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().server_activate()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: refuse rather than start a thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    max_connections: int = MAX_CONNECTIONS,
    timeout_seconds: float = TIMEOUT_SECONDS,
) -> WSGIServer:
    """Serve `registry` at http://host:port/metrics on a daemon thread; `shutdown()` and
    `server_close()` stop it. Port 0 picks a free port (`server_port` says which)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type(
        "MetricsServer",
        (_BoundedServer,),
        {"address_family": family, "max_connections": max_connections},
    )
    handler_class = type("MetricsHandler", (_QuietHandler,), {"timeout": timeout_seconds})
    server: WSGIServer = make_server(
        host, port, make_wsgi_app(registry), server_class, handler_class=handler_class
    )
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
