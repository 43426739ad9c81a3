"""`allocator-rpc`: the allocator's RPC under 1, 64 and 256 clients and a burst of binds,
against Redis.

Redis is the baseline because it is what a single-threaded event-loop server on this
machine does with the same kernel, the same loopback and a load generator written for
it: `redis-benchmark -t ping` (C, many connections per process, one request in flight
on each). Ours is driven the same way by `rpcdrive` (several processes, asyncio, the
real handshake and JSON-lines protocol), so the ratio compares the servers. Redis runs
from Debian's `redis-server` on a private loopback port, without persistence, in the
run's scratch dir, and is stopped afterwards; without it the benchmark is skipped with
a message saying what to install.
"""

from __future__ import annotations

import contextlib
import csv
import io
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from herd_operator.auth import derive_key, job_identity
from herd_operator.bench.harness import Context, Row, Skip, Stats, percentile
from herd_operator.bench.jobs import bench_job
from herd_operator.bench.rpcdrive import DriveConfig, DriveResult, drive_processes, split
from herd_operator.bench.rpcflood import ensure_descriptors
from herd_operator.bench.rpcload import JOB, TOKEN, echo_server, measure_op, report_handler
from herd_operator.layout import StateLayout
from herd_operator.rpc import RpcServer
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import for_own_job
from herd_operator.runtime.store import Store
from specs.values import Demand, Pool

DRIVER_PROCESSES = 2
"""Load-generator processes (this machine has 2 cores; the server has its own thread)."""
HANG_GUARD_S = 300.0
REDIS_START_S = 10.0
BURST_NODES, QUICK_BURST_NODES = 1792, 16
GPUS_PER_NODE = 4
HOST_FORMAT = "node{:04d}"
DESCRIPTORS_PER_BURST_CLIENT = 2  # the client's socket and the server's end of it
DESCRIPTOR_MARGIN = 512
BURST_REPEAT = 2
"""At most this many bursts of each (a slow burst takes a minute)."""


def _need_redis() -> tuple[str, str]:
    server, bench = shutil.which("redis-server"), shutil.which("redis-benchmark")
    if server is None or bench is None:
        raise Skip(
            "the Redis baseline needs redis-server and redis-benchmark, which are missing:"
            " apt-get install redis-server (scripts/bootstrap.sh installs it)"
        )
    return server, bench


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextlib.contextmanager
def redis_server(executable: str, scratch: Path) -> Iterator[int]:
    """A private Redis on loopback (no persistence, no disk); yields its port."""
    workdir = scratch / "redis"
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    command = [
        executable,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--maxclients",
        "10000",
        "--logfile",
        str(workdir / "redis.log"),
    ]
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + REDIS_START_S
        while True:
            if process.poll() is not None:
                log = (workdir / "redis.log").read_text(errors="replace")[-1000:]
                raise RuntimeError(f"redis-server exited with {process.returncode}: {log}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=1.0) as probe,
            ):
                probe.sendall(b"PING\r\n")
                if probe.recv(64).startswith(b"+PONG"):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {REDIS_START_S} s")
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(10.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def redis_ping(bench: str, port: int, clients: int, requests: int) -> tuple[float, float, float]:
    """`redis-benchmark -t ping` (inline PING, a line like ours): (req/s, p50 ms, p99 ms)."""
    command = [bench, "-h", "127.0.0.1", "-p", str(port), "-t", "ping_inline"]
    command += ["-c", str(clients), "-n", str(requests), "--csv"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)
    rows = [row for row in csv.DictReader(io.StringIO(done.stdout)) if row.get("rps")]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"redis-benchmark failed ({done.returncode}): {done.stderr[-500:]}")
    row = rows[0]
    return float(row["rps"]), float(row["p50_latency_ms"]), float(row["p99_latency_ms"])


def _configs(
    mode: str, port: int, clients: int, calls: int, request: dict[str, Any]
) -> list[DriveConfig]:
    key = derive_key(TOKEN, job_identity(JOB))
    return [
        DriveConfig(
            "calls",
            "127.0.0.1",
            port,
            share,
            calls,
            request,
            key.hex(),
            identity=str(job_identity(JOB)),
        )
        for share in split(clients, DRIVER_PROCESSES)
    ]


def _throughput_rows(ctx: Context, server: RpcServer, bench: str, redis_port: int) -> list[Row]:
    requests: list[dict[str, Any]] = [
        {"op": "bind", "args": {"job": JOB, "host": "localhost", "local_rank": 1, "pid": 1234}},
        {
            "op": "report",
            "args": {"job": JOB, "epoch": 3, "world_size": 4, "rank": 0, "metrics": {}},
        },
    ]
    ours_total = 400 if ctx.quick else 20000
    redis_total = 2000 if ctx.quick else 100000
    concurrency = (1, 8) if ctx.quick else (1, 64, 256)
    rows = []
    for clients in concurrency:
        for request in requests:
            configs = _configs(
                "calls", server.address[1], clients, max(5, ours_total // clients), request
            )
            ours_rates, redis_rates, redis_p50, redis_p99 = [], [], [], []
            ours_latency: list[float] = []
            for _ in range(ctx.repeat):
                result = drive_processes(configs, timeout=HANG_GUARD_S)
                ours_rates.append(result.rate)
                ours_latency += result.latencies
                rate, p50, p99 = redis_ping(bench, redis_port, clients, redis_total)
                redis_rates.append(rate)
                redis_p50.append(p50)
                redis_p99.append(p99)
            ours_latency.sort()
            rows.append(
                Row(
                    name=f"allocator-rpc {request['op']}, {clients} client(s)",
                    what=f"authenticated `{request['op']}` round trips on loopback (rpcdrive)",
                    unit="req/s",
                    better="higher",
                    baseline_label="Redis PING (redis-benchmark)",
                    baseline=Stats.of(redis_rates),
                    ours=Stats.of(ours_rates),
                    extra={
                        "ours_p50_ms": percentile(ours_latency, 50) * 1000,
                        "ours_p99_ms": percentile(ours_latency, 99) * 1000,
                        "baseline_p50_ms": Stats.of(redis_p50).median,
                        "baseline_p99_ms": Stats.of(redis_p99).median,
                    },
                )
            )
            ctx.progress(f"allocator-rpc: {request['op']} with {clients} client(s) done")
    return rows


def _burst(configs: list[DriveConfig], ctx: Context, who: str) -> DriveResult:
    result = drive_processes(configs, timeout=HANG_GUARD_S)
    if result.failures:
        ctx.progress(
            f"allocator-rpc burst: {len(result.failures)} of"
            f" {result.requests + len(result.failures)} connections to {who} got no answer,"
            f" e.g. {result.failures[0]}"
        )
    return result


def _burst_row(ctx: Context, redis_port: int) -> Row:
    """Every worker of a full allocation binds at once, on a fresh server each time."""
    nodes = QUICK_BURST_NODES if ctx.quick else BURST_NODES
    workers = nodes * GPUS_PER_NODE
    limit, note = ensure_descriptors(workers * DESCRIPTORS_PER_BURST_CLIENT + DESCRIPTOR_MARGIN)
    ctx.progress(f"allocator-rpc burst: {note}")
    if limit < workers * DESCRIPTORS_PER_BURST_CLIENT:
        raise Skip(f"the burst of {workers} needs more open files than the limit {limit}")
    layout = StateLayout(ctx.scratch / "burst-state")
    layout.create()
    pool = Pool.from_counts({HOST_FORMAT.format(n): GPUS_PER_NODE for n in range(nodes)})
    allocator = Allocator(pool, GrantPublisher(layout), virtual=True)
    allocator.request(Demand(JOB, 1, workers, workers))
    key = derive_key(TOKEN, job_identity(JOB))
    request: dict[str, Any] = {"op": "bind", "args": {"job": JOB, "pid": 1}}
    ours: list[float] = []
    baseline: list[float] = []
    ours_latency: list[float] = []
    failed = 0
    for _ in range(min(ctx.repeat, BURST_REPEAT)):
        with RpcServer(TOKEN, {"bind": for_own_job(allocator.handle_bind)}) as server:
            configs, first = [], 0
            for share in split(workers, DRIVER_PROCESSES):
                configs.append(
                    DriveConfig(
                        "burst",
                        "127.0.0.1",
                        server.address[1],
                        share,
                        1,
                        request,
                        key.hex(),
                        identity=str(job_identity(JOB)),
                        host_format=HOST_FORMAT,
                        first=first,
                    )
                )
                first += share
            result = _burst(configs, ctx, "ours")
            failed += len(result.failures)
            ours.append(result.elapsed)
            ours_latency += result.latencies
        raw = [
            DriveConfig(
                "raw-burst",
                "127.0.0.1",
                redis_port,
                share,
                1,
                request,
                raw_request="PING\r\n",
                expect="+PONG",
            )
            for share in split(workers, DRIVER_PROCESSES)
        ]
        baseline.append(_burst(raw, ctx, "Redis").elapsed)
    ours_latency.sort()
    return Row(
        name=f"allocator-rpc burst: {workers:,} workers bind at once",
        what=f"connect, handshake and `bind` on a {nodes:,}x{GPUS_PER_NODE} pool:"
        " time until the last is served",
        unit="s",
        better="lower",
        baseline_label="the same burst of connect + PING to Redis",
        baseline=Stats.of(baseline),
        ours=Stats.of(ours),
        extra={
            "ours_p50_s": percentile(ours_latency, 50),
            "ours_p99_s": percentile(ours_latency, 99),
            "ours_failed_connections": failed,
        },
    )


def run_allocator_rpc(ctx: Context) -> list[Row]:
    _, bench = _need_redis()
    executable = shutil.which("redis-server")
    assert executable is not None
    layout = StateLayout(ctx.scratch / "state")
    layout.create()
    store = Store(layout.database)
    store.record_spec(JOB, "jobs/bench.yaml", bench_job(JOB), "fingerprint", time.time())
    allocator = Allocator(Pool.from_counts({"localhost": 4}), GrantPublisher(layout), virtual=True)
    allocator.request(Demand(JOB, 1, 4, 4))
    handlers = {
        "bind": for_own_job(allocator.handle_bind),
        "report": for_own_job(report_handler(store)),
    }
    rows = []
    try:
        with redis_server(executable, ctx.scratch) as redis_port:
            with RpcServer(TOKEN, handlers) as server:
                rows += _throughput_rows(ctx, server, bench, redis_port)
                # What one RpcClient per thread sees: the generator the rows above replaced.
                with echo_server() as echo:
                    clients = 8 if ctx.quick else 64
                    thread_row = measure_op(
                        server.address,
                        echo,
                        ("bind", {"job": JOB, "host": "localhost", "local_rank": 1, "pid": 1234}),
                        clients,
                        max(5, (200 if ctx.quick else 2560) // clients),
                        ctx.repeat,
                    )
                rows.append(thread_row)
            rows.append(_burst_row(ctx, redis_port))
            ctx.progress("allocator-rpc: burst done")
    finally:
        store.close()
    return rows
