"""The /metrics server: scrapes work, idle connections cannot pile up threads."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from wsgiref.simple_server import WSGIServer

import pytest
from prometheus_client import CollectorRegistry, Gauge

from herd_operator.exporters.http import serve_metrics

GUARD_S = 10.0


@pytest.fixture
def server() -> Iterator[WSGIServer]:
    registry = CollectorRegistry()
    Gauge("herd_test_value", "A value to scrape.", registry=registry).set(3)
    served = serve_metrics(registry, "127.0.0.1", 0, max_connections=2, timeout_seconds=0.5)
    try:
        yield served
    finally:
        served.shutdown()
        served.server_close()


def scrape(server: WSGIServer) -> str:
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    with urllib.request.urlopen(url, timeout=GUARD_S) as response:
        return str(response.read().decode())


def test_a_scrape_gets_the_registry(server: WSGIServer) -> None:
    assert "herd_test_value 3.0" in scrape(server)


def test_idle_connections_hold_at_most_the_limit_and_are_dropped(server: WSGIServer) -> None:
    before = threading.active_count()
    with ExitStack() as stack:
        idle = []
        for _ in range(20):  # a slowloris: connect, send nothing
            sock = stack.enter_context(
                socket.create_connection(("127.0.0.1", server.server_port), timeout=GUARD_S)
            )
            idle.append(sock)
        time.sleep(0.2)
        assert threading.active_count() - before <= 2, "a thread per idle connection"
        # Past the per-connection deadline the held slots are free again.
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            try:
                if "herd_test_value" in scrape(server):
                    break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("no scrape got through after the idle connections timed out")
