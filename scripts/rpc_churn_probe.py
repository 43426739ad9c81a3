"""Fresh authenticated RPC connections while unauthenticated ones churn from the same address
(issue 27.6's probe, as a figure for docs/reliability.md).

    PYTHONPATH=$PWD nice python scripts/rpc_churn_probe.py --churners 4096 --calls 100 --parallel 20

The server is `RpcServer` with the operator's defaults on 127.0.0.1. A flood process keeps
`--churners` connections from 127.0.0.1 (the workers' own address) that never send a byte,
opening another the moment the server drops one (without waiting for its connect), as an
attacker on the node would. Once the server has dropped one of them (its pool is full), the
probe opens `--calls` fresh `RpcClient` connections from a process of their own (as
workers are), `--parallel` at a time, each making one call with the client's defaults (10 s
timeout, its retries of `busy`). Prints one JSON line: calls ok and failed (with the
reasons), p50/p99/max of connect + handshake + call, the flood's reconnects, the server's
connection events, the load average before and after.
Loopback only; the flood stops when the calls end, after `--max-seconds`, or after
`--max-reconnects` connections, whichever comes first.
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing
import os
import selectors
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

from herd_operator.auth import Identity
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.connection import ConnectionObserver
from herd_operator.rpc.protocol import RpcError
from herd_operator.rpc.server import RpcServer

TOKEN = bytes(range(32))
HOST = "127.0.0.1"


def churn(
    port: int,
    count: int,
    max_reconnects: int,
    until: float,
    full: Event,
    stop: Event,
    reconnects: Synchronized,  # type: ignore[type-arg]
) -> None:
    """The flood: `count` silent connections, each replaced at once when the server drops it.
    Runs until `stop`, the monotonic deadline `until`, or `max_reconnects`."""
    selector = selectors.DefaultSelector()

    def open_one() -> None:
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex((HOST, port)) in (0, errno.EINPROGRESS):
            selector.register(sock, selectors.EVENT_READ)
        else:
            sock.close()  # out of ports for a moment: the next drop opens one again

    for _ in range(count):
        open_one()
    dropped = 0
    while not stop.is_set() and dropped < max_reconnects and time.monotonic() < until:
        for key, _ in selector.select(0.05):
            sock: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                if sock.recv(4096):
                    continue  # a challenge: never answered
            except BlockingIOError:
                continue
            except OSError:
                pass
            selector.unregister(sock)
            sock.close()
            dropped += 1
            open_one()
        # Topped up too: a connect refused outright left a gap.
        while len(selector.get_map()) < count:
            open_one()
        if dropped:
            reconnects.value = dropped
            full.set()
    reconnects.value = dropped
    for key in list(selector.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    full.set()


class Counts(ConnectionObserver):
    """The server's connection events, counted (its observer seam)."""

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()

    def accepted(self) -> None:
        self.events["accepted"] += 1

    def challenged(self) -> None:
        self.events["challenged"] += 1

    def evicted(self) -> None:
        self.events["evicted"] += 1

    def authenticated(self, answer_s: float) -> None:
        self.events["authenticated"] += 1


def _ping(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
    return {"pong": True}


def one_call(address: tuple[str, int], index: int) -> tuple[float, str | None]:
    """One fresh connection and one call: (seconds, None) or (seconds, why it failed)."""
    started = time.monotonic()
    try:
        with RpcClient(address, TOKEN, client=f"fresh-{index}") as client:
            client.call("ping")
    except (RpcError, OSError) as error:
        return time.monotonic() - started, f"{type(error).__name__}: {error}"
    return time.monotonic() - started, None


def call_all(
    address: tuple[str, int],
    calls: int,
    parallel: int,
    results: Connection,
) -> None:
    """The fresh clients, in a process of their own (as workers are): sends back
    [(seconds, error or None)] for each call."""
    with ThreadPoolExecutor(max_workers=parallel) as pool:
        results.send(list(pool.map(lambda n: one_call(address, n), range(calls))))
    results.close()


def quantile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--churners", type=int, default=1024, help="silent connections held")
    parser.add_argument("--calls", type=int, default=100, help="fresh authenticated calls")
    parser.add_argument("--parallel", type=int, default=10, help="calls at a time")
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--max-reconnects", type=int, default=5_000_000)
    args = parser.parse_args(argv)

    counts = Counts()
    server = RpcServer(TOKEN, {"ping": _ping}, HOST, 0, observer=counts)
    address = server.start()
    context = multiprocessing.get_context("spawn")
    full, stop = context.Event(), context.Event()
    reconnects = context.Value("q", 0)
    load_before = os.getloadavg()
    flooder = context.Process(
        target=churn,
        args=(
            address[1],
            args.churners,
            args.max_reconnects,
            time.monotonic() + args.max_seconds,
            full,
            stop,
            reconnects,
        ),
        daemon=True,
    )
    flooder.start()
    results: list[tuple[float, str | None]] = []
    started = time.monotonic()
    try:
        if not full.wait(120):
            print("the flood did not fill the server's pool in 120 s", file=sys.stderr)
            return 1
        started = time.monotonic()
        receiving, sending = context.Pipe(duplex=False)
        caller = context.Process(
            target=call_all, args=(address, args.calls, args.parallel, sending), daemon=True
        )
        caller.start()
        sending.close()
        if receiving.poll(args.max_seconds):
            results = receiving.recv()
        caller.join(30)
        if caller.is_alive():
            caller.kill()
    finally:
        elapsed = time.monotonic() - started
        stop.set()
        flooder.join(30)
        if flooder.is_alive():
            flooder.kill()
        server.stop()
    latencies = [seconds for seconds, error in results if error is None]
    failures = Counter(error for _, error in results if error is not None)
    ms = {q: quantile(latencies, q) for q in (0.5, 0.99)}
    print(
        json.dumps(
            {
                "churners": args.churners,
                "calls_ok": len(latencies),
                "calls_failed": sum(failures.values()),
                "failures": dict(failures),
                "call_ms_p50": None if ms[0.5] is None else round(1000 * ms[0.5], 1),
                "call_ms_p99": None if ms[0.99] is None else round(1000 * ms[0.99], 1),
                "call_ms_max": round(1000 * max(latencies), 1) if latencies else None,
                "calls_seconds": round(elapsed, 1),
                "flood_reconnects": reconnects.value,
                "server": dict(counts.events),
                "threads_left": threading.active_count(),
                "load_before": [round(x, 2) for x in load_before],
                "load_after": [round(x, 2) for x in os.getloadavg()],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
