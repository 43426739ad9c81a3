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
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.bench.rpcdrive import PHASES, DriveConfig, DriveResult, drive_processes, split
from devtools.bench.rpcflood import ensure_descriptors
from devtools.bench.rpcload import JOB, TOKEN, echo_server, job_handlers, measure_op
from herd_operator.auth import derive_key, job_identity
from herd_operator.bench.harness import Context, Row, Skip, Stats, percentile
from herd_operator.layout import StateLayout
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import GROUPED_OPS, AllocatorOps, for_own_job
from herd_operator.runtime.operator import STORE_CHECKPOINT_SECONDS
from herd_operator.runtime.store import Store
from herd_operator.specs.values import Demand, Pool

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


@dataclass(frozen=True)
class Redis:
    port: int
    pid: int

    def cpu_seconds(self) -> float:
        """CPU time the Redis process has used so far (Linux: from /proc)."""
        return sum(cpu_times(Path(f"/proc/{self.pid}/stat")))


def cpu_times(stat: Path) -> tuple[float, float]:
    """User and system CPU seconds from a /proc stat file (a process's or a thread's)."""
    # utime and stime, fields 14 and 15, counted after the parenthesised command name.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


LISTEN_COUNTERS = ("ListenOverflows", "ListenDrops", "SyncookiesSent", "TCPSynRetrans")
"""The kernel's TcpExt counters that say connects waited: a full accept queue (overflows,
drops: the client's final ACK is dropped and the server's SYN/ACK is retransmitted after
1, 3, 7 s), a full SYN queue (cookies sent), and SYN retransmits."""


def tcp_counters() -> dict[str, int]:
    """The `LISTEN_COUNTERS` now, machine-wide (empty where /proc/net/netstat is missing)."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return {}
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return {name: int(table[name]) for name in LISTEN_COUNTERS if name in table}
    return {}


@contextlib.contextmanager
def redis_server(executable: str, scratch: Path) -> Iterator[Redis]:
    """A private Redis on loopback (no persistence, no disk); yields its port and pid."""
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
        yield Redis(port, process.pid)
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


def call_configs(port: int, clients: int, calls: int, request: dict[str, Any]) -> list[DriveConfig]:
    """`clients` connections split over DRIVER_PROCESSES drivers, each making `calls`
    requests back to back as job JOB with its key."""
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


BIND: dict[str, Any] = {
    "op": "bind",
    "args": {"job": JOB, "host": "localhost", "local_rank": 1, "pid": 1234},
}
REPORT: dict[str, Any] = {
    "op": "report",
    "args": {"job": JOB, "epoch": 3, "world_size": 4, "rank": 0, "metrics": {}},
}


def _throughput_rows(
    ctx: Context,
    servers: list[tuple[str, RpcServer, dict[str, Any]]],
    bench: str,
    redis: Redis,
) -> list[Row]:
    """For each (label, server, request), at each concurrency: ours and Redis, alternately.

    Besides the rates, the CPU time per request of our server's thread and of the Redis
    process: on a shared machine the wall clock is partly the other tenants', CPU less so.
    """
    ours_total = 400 if ctx.quick else 20000
    redis_total = 2000 if ctx.quick else 100000
    concurrency = (1, 8) if ctx.quick else (1, 64, 256)
    rows = []
    for clients in concurrency:
        for label, server, request in servers:
            configs = call_configs(
                server.address[1], clients, max(5, ours_total // clients), request
            )
            ours_rates, redis_rates, redis_p50, redis_p99 = [], [], [], []
            ours_cpu, redis_cpu = [], []
            ours_latency: list[float] = []
            for _ in range(ctx.repeat):
                before = server.cpu_seconds()
                result = drive_processes(configs, timeout=HANG_GUARD_S)
                ours_cpu.append((server.cpu_seconds() - before) / result.requests)
                ours_rates.append(result.rate)
                ours_latency += result.latencies
                before = redis.cpu_seconds()
                rate, p50, p99 = redis_ping(bench, redis.port, clients, redis_total)
                redis_cpu.append((redis.cpu_seconds() - before) / redis_total)
                redis_rates.append(rate)
                redis_p50.append(p50)
                redis_p99.append(p99)
            ours_latency.sort()
            rows.append(
                Row(
                    name=f"allocator-rpc {label}, {clients} client(s)",
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
                        "ours_server_cpu_us_per_req": Stats.of(ours_cpu).median * 1e6,
                        "baseline_server_cpu_us_per_req": Stats.of(redis_cpu).median * 1e6,
                    },
                )
            )
            ctx.progress(f"allocator-rpc: {label} with {clients} client(s) done")
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


def _burst_row(ctx: Context, redis: Redis) -> Row:
    """Every worker of a full allocation binds at once, on a fresh server each time.

    Beside the time until the last is served: when each phase of a connection ended
    (`rpcdrive.PHASES`), how many connections needed more than one try, the CPU of the
    server (its thread; Redis: its process) and of the driver processes, and how far the
    kernel's listen counters moved (machine-wide: another tenant's burst would show too).
    """
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
    phases: dict[str, list[float]] = {}
    baseline_phases: dict[str, list[float]] = {}
    figures: dict[str, list[float]] = {}

    def record(name: str, value: float) -> None:
        figures.setdefault(name, []).append(value)

    def counted(before: dict[str, int], who: str) -> None:
        after = tcp_counters()
        for name, value in after.items():
            record(f"{who}_kernel_{name}", value - before.get(name, value))

    failed = 0
    for _ in range(min(ctx.repeat, BURST_REPEAT)):
        with RpcServer(TOKEN, {"bind": for_own_job(AllocatorOps(allocator).bind)}) as server:
            configs = burst_configs(server.address[1], workers, request, key)
            counters, cpu = tcp_counters(), server.cpu_seconds()
            result = _burst(configs, ctx, "ours")
            record("ours_server_cpu_s", server.cpu_seconds() - cpu)
            counted(counters, "ours")
            record("ours_driver_cpu_s", result.driver_cpu_s)
            record(
                "ours_retried_connections", sum(1 for tries in result.phases["tries"] if tries > 1)
            )
            failed += len(result.failures)
            ours.append(result.elapsed)
            for phase, times in result.phases.items():
                phases.setdefault(phase, []).extend(times)
        raw = redis_burst_configs(redis.port, workers, request)
        counters, cpu = tcp_counters(), redis.cpu_seconds()
        result = _burst(raw, ctx, "Redis")
        record("baseline_server_cpu_s", redis.cpu_seconds() - cpu)
        counted(counters, "baseline")
        record("baseline_driver_cpu_s", result.driver_cpu_s)
        baseline.append(result.elapsed)
        for phase, times in result.phases.items():
            baseline_phases.setdefault(phase, []).extend(times)
    extra: dict[str, float] = {"ours_failed_connections": failed}
    for who, timings in (("ours", phases), ("baseline", baseline_phases)):
        for phase in PHASES:
            times = sorted(timings.get(phase, []))
            if times:
                extra[f"{who}_{phase}_p50_s"] = percentile(times, 50)
                extra[f"{who}_{phase}_p99_s"] = percentile(times, 99)
    extra |= {name: Stats.of(values).median for name, values in figures.items()}
    return Row(
        name=f"allocator-rpc burst: {workers:,} workers bind at once",
        what=f"connect, handshake and `bind` on a {nodes:,}x{GPUS_PER_NODE} pool:"
        " time until the last is served",
        unit="s",
        better="lower",
        baseline_label="the same burst of connect + PING to Redis",
        baseline=Stats.of(baseline),
        ours=Stats.of(ours),
        extra=extra,
    )


def run_allocator_rpc(ctx: Context) -> list[Row]:
    _, bench = _need_redis()
    executable = shutil.which("redis-server")
    assert executable is not None
    layout = StateLayout(ctx.scratch / "state")
    layout.create()
    # As the operator opens it: checkpoints in the store's own thread.
    store = Store(layout.database, checkpoint_seconds=STORE_CHECKPOINT_SECONDS)
    handlers = job_handlers(store, layout, for_own_job)
    rows = []
    try:
        with (
            redis_server(executable, ctx.scratch) as redis,
            # As the operator serves: the reports of one loop turn share one commit.
            RpcServer(
                TOKEN, handlers, grouped_ops=GROUPED_OPS, commit_group=store.transaction
            ) as server,
            # The same without grouping: one commit per report, as before group commit.
            RpcServer(TOKEN, handlers) as ungrouped,
        ):
            servers = [
                ("bind", server, BIND),
                ("report", server, REPORT),
                ("report, a commit per report", ungrouped, REPORT),
            ]
            rows += _throughput_rows(ctx, servers, bench, redis)
            # What one RpcClient per thread sees: the generator the rows above replaced.
            with echo_server() as echo:
                clients = 8 if ctx.quick else 64
                thread_row = measure_op(
                    server.address,
                    echo,
                    (BIND["op"], BIND["args"]),
                    clients,
                    max(5, (200 if ctx.quick else 2560) // clients),
                    ctx.repeat,
                )
            rows.append(thread_row)
            rows.append(_burst_row(ctx, redis))
            ctx.progress("allocator-rpc: burst done")
    finally:
        store.close()
    return rows


def burst_configs(
    port: int, workers: int, request: dict[str, Any], key: bytes
) -> list[DriveConfig]:
    """The burst's load: `workers` connections split over DRIVER_PROCESSES drivers, each
    worker binding its own (host, local rank) of the pool, as job JOB with its key."""
    configs, first = [], 0
    for share in split(workers, DRIVER_PROCESSES):
        configs.append(
            DriveConfig(
                "burst",
                "127.0.0.1",
                port,
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
    return configs


def redis_burst_configs(port: int, workers: int, request: dict[str, Any]) -> list[DriveConfig]:
    """The baseline's burst: the same connections from the same drivers, each sending
    Redis a PING and closing."""
    return [
        DriveConfig(
            "raw-burst",
            "127.0.0.1",
            port,
            share,
            1,
            request,
            raw_request="PING\r\n",
            expect="+PONG",
        )
        for share in split(workers, DRIVER_PROCESSES)
    ]
