"""Scrapes of the /metrics server while other local addresses flood it with idle
connections (issue 27.5's probe, as a figure for docs/reliability.md).

    PYTHONPATH=$PWD nice python scripts/metrics_flood_probe.py --peers 1 --idle 16

The server is `serve_metrics` with the defaults the operator and the exporter run, on
127.0.0.1. A flood process keeps `--idle` connections that never send a byte open from each
of `--peers` loopback addresses (127.0.1.1, 127.0.1.2, ...), opening another the moment the
server closes one; once the server has closed one (it keeps all it will keep), a scraper
on 127.0.0.3 scrapes `--scrapes` times, `--interval` seconds apart, each with Prometheus'
default timeout (10 s). Prints one JSON line: scrapes ok and failed (with the reasons),
scrape latency, the flood's connections, the load average before and after. Loopback
only; the flood stops when the scrapes end (at most `--max-opens` connections).
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import multiprocessing
import os
import selectors
import socket
import sys
import time
from collections import Counter
from collections.abc import Sequence
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event

from prometheus_client import CollectorRegistry, Gauge

from herd_operator.exporters.http import serve_metrics

SCRAPER = "127.0.0.3"
SCRAPE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0


def flood_sources(peers: int) -> list[str]:
    return [f"127.0.{1 + n // 250}.{1 + n % 250}" for n in range(peers)]


def flood(
    port: int,
    sources: Sequence[str],
    idle: int,
    max_opens: int,
    full: Event,
    stop: Event,
    opens: Synchronized,  # type: ignore[type-arg]
    reopens: Synchronized,  # type: ignore[type-arg]
) -> None:
    """The flood process: the first connections one at a time, then a new one (without
    waiting for its connect) for each the server closes."""
    selector = selectors.DefaultSelector()

    def reopen(source: str) -> None:
        opens.value += 1
        sock = socket.socket()
        sock.setblocking(False)
        sock.bind((source, 0))
        if sock.connect_ex(("127.0.0.1", port)) in (0, errno.EINPROGRESS):
            selector.register(sock, selectors.EVENT_READ, source)
        else:
            sock.close()

    for source in sources:
        for _ in range(idle):
            opens.value += 1
            sock = socket.socket()
            sock.bind((source, 0))
            sock.settimeout(CONNECT_TIMEOUT_S)
            try:
                sock.connect(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, source)
    while not stop.is_set() and opens.value < max_opens:
        for key, _ in selector.select(0.05):
            sock = key.fileobj  # type: ignore[assignment]
            try:
                if sock.recv(1024):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            reopens.value += 1
            reopen(key.data)
        if reopens.value:
            full.set()
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    full.set()


def scrape(port: int) -> None:
    connection = http.client.HTTPConnection(
        "127.0.0.1", port, timeout=SCRAPE_TIMEOUT_S, source_address=(SCRAPER, 0)
    )
    try:
        connection.request("GET", "/metrics", headers={"Accept": "text/plain"})
        response = connection.getresponse()
        body = response.read()
    finally:
        connection.close()
    if response.status != 200 or b"herd_probe_value" not in body:
        raise OSError(f"HTTP {response.status}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=1, help="flooding addresses (default: 1)")
    parser.add_argument("--idle", type=int, default=16, help="idle connections per address")
    parser.add_argument("--scrapes", type=int, default=20)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes")
    parser.add_argument("--max-opens", type=int, default=2_000_000)
    parser.add_argument(
        "--same-address",
        action="store_true",
        help="flood from the scraper's own address (one peer): what per-address limits cannot "
        "tell apart",
    )
    args = parser.parse_args(argv)

    registry = CollectorRegistry()
    Gauge("herd_probe_value", "A value to scrape.", registry=registry).set(1)
    server = serve_metrics(registry, "127.0.0.1", 0)
    context = multiprocessing.get_context("fork")
    full, stop = context.Event(), context.Event()
    opens, reopens = context.Value("q", 0), context.Value("q", 0)
    sources = [SCRAPER] * args.peers if args.same_address else flood_sources(args.peers)
    load_before = os.getloadavg()
    flooder = context.Process(
        target=flood,
        args=(server.server_port, sources, args.idle, args.max_opens, full, stop, opens, reopens),
        daemon=True,
    )
    flooder.start()
    ok, failed, latencies = 0, Counter[str](), []
    try:
        if not full.wait(120):
            print("the flood did not fill the server in 120 s", file=sys.stderr)
            return 1
        for n in range(args.scrapes):
            if n:
                time.sleep(args.interval)  # the scrape interval, not a wait for a condition
            started = time.monotonic()
            try:
                scrape(server.server_port)
                ok += 1
                latencies.append(time.monotonic() - started)
            except (OSError, http.client.HTTPException) as err:
                failed[type(err).__name__] += 1
    finally:
        stop.set()
        flooder.join(30)
        if flooder.is_alive():
            flooder.kill()
        server.shutdown()
        server.server_close()
    latencies.sort()
    stats: dict[str, int] = getattr(server, "stats", dict)()  # the tree before has none
    print(
        json.dumps(
            {
                "peers": args.peers,
                "same_address": args.same_address,
                "idle_per_peer": args.idle,
                "scrapes_ok": ok,
                "scrapes_failed": sum(failed.values()),
                "failures": dict(failed),
                "scrape_ms_p50": round(1000 * latencies[len(latencies) // 2], 2)
                if latencies
                else None,
                "scrape_ms_max": round(1000 * latencies[-1], 2) if latencies else None,
                "flood_connections": opens.value,
                "flood_reopens": reopens.value,
                "server": stats,
                "load_before": [round(x, 2) for x in load_before],
                "load_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
