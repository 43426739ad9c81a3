"""`allocator-rpc`'s RpcClient-thread rows (against a raw TCP echo) and the handlers and
server parts the RPC benchmarks share."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from herd_operator.bench.harness import Row, Stats, percentile
from herd_operator.bench.jobs import bench_job
from herd_operator.layout import StateLayout
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import Handler
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import AllocatorOps, PlainHandler, ReportHandler
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Demand, Pool

TOKEN = b"bench-token-0123456789abcdef0123"
HANG_GUARD_S = 120.0
JOB = "bench"


def job_handlers(
    store: Store, layout: StateLayout, access: Callable[[PlainHandler], Handler]
) -> dict[str, Handler]:
    """Job JOB, recorded in ``store`` and holding the 4 GPUs of a one-host pool, and the
    operator's own `bind` and `report` handlers for it, each behind ``access`` (who may
    call). The report handler checks the fields, writes the store and tells the allocator
    the world size; its wake-up of the job's reconcile (a queue insert in the operator) is
    left out, as no reconcile runs here."""
    store.record_spec(JOB, "jobs/bench.yaml", bench_job(JOB), "fingerprint", time.time())
    # The synthetic workers are no processes of the job: every pid passes (the check a
    # real bind of a local worker costs, one read of /proc, is not in these figures).
    allocator = Allocator(
        Pool.from_counts({"localhost": 4}),
        GrantPublisher(layout),
        virtual=True,
        belongs=lambda job, pid: True,
    )
    allocator.request(Demand(JOB, 1, 4, 4))
    return {
        "bind": access(AllocatorOps(allocator).bind),
        "report": access(ReportHandler(store, allocator, lambda job: None)),
    }


@contextlib.contextmanager
def echo_server() -> Iterator[tuple[str, int]]:
    """An asyncio server that answers each line with the same line: a round trip, nothing else."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    address: list[tuple[str, int]] = []
    stopped = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        bound = server.sockets[0].getsockname()
        address.append((bound[0], bound[1]))
        ready.set()
        await stopped.wait()
        server.close()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    ready.wait(HANG_GUARD_S)
    try:
        yield address[0]
    finally:
        loop.call_soon_threadsafe(stopped.set)
        thread.join(HANG_GUARD_S)


class EchoClient:
    """Sends one frame and reads one line back, like RpcClient without JSON or auth."""

    def __init__(self, address: tuple[str, int], frame: bytes) -> None:
        self._sock = socket.create_connection(address, timeout=HANG_GUARD_S)
        self._frame = frame + b"\n"

    def call(self) -> None:
        self._sock.sendall(self._frame)
        received = b""
        while not received.endswith(b"\n"):
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError("echo server closed the connection")
            received += chunk

    def close(self) -> None:
        self._sock.close()


def drive(calls: Sequence[Callable[[], object]], per_client: int) -> tuple[float, list[float]]:
    """Run `per_client` calls on each client at once; returns (requests/s, latencies in s)."""
    barrier = threading.Barrier(len(calls) + 1)
    latencies: list[list[float]] = [[] for _ in calls]
    errors: list[BaseException] = []

    def client(index: int) -> None:
        call = calls[index]
        try:
            call()  # connect and authenticate outside the measurement
            barrier.wait(HANG_GUARD_S)
            mine = latencies[index]
            for _ in range(per_client):
                started = time.perf_counter()
                call()
                mine.append(time.perf_counter() - started)
        except BaseException as err:
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    barrier.wait(HANG_GUARD_S)
    started = time.perf_counter()
    for thread in threads:
        thread.join(HANG_GUARD_S)
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"a client failed: {errors[0]!r}") from errors[0]
    flat = [value for values in latencies for value in values]
    return len(flat) / elapsed, flat


def measure_op(
    server: tuple[str, int],
    echo: tuple[str, int],
    request: tuple[str, dict[str, Any]],
    clients: int,
    per_client: int,
    repeat: int,
) -> Row:
    """`clients` threads doing `per_client` calls each, ours and the echo alternately."""
    op, args = request
    frame = json.dumps({"id": 1, "op": op, "args": args}, separators=(",", ":")).encode()
    ours_rates, echo_rates = [], []
    ours_latency: list[float] = []
    echo_latency: list[float] = []
    for _ in range(repeat):
        rpc_clients = [RpcClient(server, TOKEN, client=f"bench-{i}") for i in range(clients)]
        echo_clients = [EchoClient(echo, frame) for _ in range(clients)]
        try:
            calls = [functools.partial(client.call, op, **args) for client in rpc_clients]
            rate, latency = drive(calls, per_client)
            ours_rates.append(rate)
            ours_latency += latency
            rate, latency = drive([client.call for client in echo_clients], per_client)
            echo_rates.append(rate)
            echo_latency += latency
        finally:
            for rpc_client in rpc_clients:
                rpc_client.close()
            for echo_client in echo_clients:
                echo_client.close()
    ours_latency.sort()
    echo_latency.sort()
    return Row(
        name=f"allocator-rpc {op}, {clients} RpcClient threads",
        what=f"authenticated `{op}` round trips on loopback, one RpcClient per thread",
        unit="req/s",
        better="higher",
        baseline_label="raw TCP line echo",
        baseline=Stats.of(echo_rates),
        ours=Stats.of(ours_rates),
        extra={
            "ours_p50_ms": percentile(ours_latency, 50) * 1000,
            "ours_p99_ms": percentile(ours_latency, 99) * 1000,
            "baseline_p50_ms": percentile(echo_latency, 50) * 1000,
            "baseline_p99_ms": percentile(echo_latency, 99) * 1000,
        },
    )
