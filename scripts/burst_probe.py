"""Where a burst of binds spends its seconds: one burst against our RPC server, then the same
connects + PING against Redis, with what `python -m devtools.bench --only allocator-rpc` does not
show: when the server accepted each connection, and how often it challenged, authenticated,
dropped (as an idler) and re-checked waiting connections.

    PYTHONPATH=$PWD nice python scripts/burst_probe.py --nodes 1792 [--pool 256] [--only ours]
        [--server-loop uvloop|asyncio|both]

Prints one JSON line per burst. Times are seconds from the start of the burst; each phase is
(p50, p99, max, histogram) with the histogram's buckets ending at 0.25, 0.5, 1, 2, 4, 8, 16 s
and beyond; `answer` is, for each handshake that authenticated, the seconds from its
challenge to its hello as the server saw them. `kernel` is how far the machine-wide TcpExt
listen counters moved. A diagnostic: it hears the server's connection events through its
observer (`RpcServer(observer=...)`) and counts them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from devtools.bench import rpcscale
from devtools.bench.rpcdrive import DriveResult, drive_processes
from devtools.bench.rpcload import JOB, TOKEN
from herd_operator.auth import derive_key, job_identity
from herd_operator.layout import StateLayout
from herd_operator.rpc.connection import ConnectionObserver
from herd_operator.rpc.server import RpcServer, uvloop_event_loop
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import AllocatorOps, for_own_job
from herd_operator.specs.values import Demand, Pool

BUCKETS_S = (0.25, 0.5, 1, 2, 4, 8, 16, float("inf"))
SERVER_LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop_event_loop,
    "asyncio": asyncio.new_event_loop,
}
TIMEOUT_S = 300.0


def histogram(times: Sequence[float]) -> list[int]:
    counts, low = [], 0.0
    for high in BUCKETS_S:
        counts.append(sum(1 for t in times if low <= t < high))
        low = high
    return counts


def quantile(times: Sequence[float], q: float) -> float:
    return times[min(len(times) - 1, int(q * len(times)))] if times else float("nan")


def spread(times: Sequence[float]) -> list[Any]:
    ordered = sorted(times)
    last = round(ordered[-1], 3) if ordered else None
    p50, p99 = round(quantile(ordered, 0.5), 3), round(quantile(ordered, 0.99), 3)
    return [p50, p99, last, histogram(ordered)]


def summary(result: DriveResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "elapsed_s": round(result.elapsed, 2),
        "unserved": len(result.failures),
        "driver_cpu_s": round(result.driver_cpu_s, 2),
    }
    for phase, times in result.phases.items():
        if phase == "tries":
            out["retried"] = sum(1 for tries in times if tries > 1)
        elif times:
            out[phase] = spread(times)
    return out


def counted(before: dict[str, int]) -> dict[str, int]:
    return {
        name: value - before.get(name, value) for name, value in rpcscale.tcp_counters().items()
    }


class ServerEvents(ConnectionObserver):
    """The server's connection events: accept times, how often each kind came, and each
    authenticated handshake's answer time (challenge to hello, on the server)."""

    def __init__(self) -> None:
        self.accepted_at: list[float] = []
        self.answers: list[float] = []
        self.calls: Counter[str] = Counter()

    def accepted(self) -> None:
        self.accepted_at.append(time.perf_counter())

    def challenged(self) -> None:
        self.calls["challenged"] += 1

    def rechecked(self) -> None:
        self.calls["rechecked"] += 1

    def evicted(self) -> None:
        self.calls["evicted"] += 1

    def authenticated(self, answer_s: float) -> None:
        self.calls["authenticated"] += 1
        self.answers.append(answer_s)

    def clear(self) -> None:
        self.accepted_at.clear()
        self.answers.clear()
        self.calls.clear()


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=rpcscale.BURST_NODES)
    parser.add_argument("--pool", type=int, default=256, help="max_unauthenticated")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", choices=("ours", "redis"))
    parser.add_argument(
        "--server-loop",
        choices=(*SERVER_LOOPS, "both"),
        default="uvloop",
        help="our server's event loop; both: one burst on each per round, alternating",
    )
    options = parser.parse_args(argv)
    workers = options.nodes * rpcscale.GPUS_PER_NODE
    events = ServerEvents()
    redis_executable = shutil.which("redis-server")
    if redis_executable is None:
        sys.exit("needs redis-server (apt-get install redis-server)")
    with tempfile.TemporaryDirectory(prefix="burst-probe-") as scratch_dir:
        scratch = Path(scratch_dir)
        layout = StateLayout(scratch / "state")
        layout.create()
        hosts = {
            rpcscale.HOST_FORMAT.format(n): rpcscale.GPUS_PER_NODE for n in range(options.nodes)
        }
        allocator = Allocator(Pool.from_counts(hosts), GrantPublisher(layout), virtual=True)
        allocator.request(Demand(JOB, 1, workers, workers))
        key = derive_key(TOKEN, job_identity(JOB))
        request: dict[str, Any] = {"op": "bind", "args": {"job": JOB, "pid": 1}}
        with rpcscale.redis_server(redis_executable, scratch) as redis:
            for _ in range(options.rounds):
                ours = [] if options.only == "redis" else list(SERVER_LOOPS)
                if options.server_loop != "both":
                    ours = ours and [options.server_loop]
                for loop_name in ours:
                    handlers = {"bind": for_own_job(AllocatorOps(allocator).bind)}
                    with RpcServer(
                        TOKEN,
                        handlers,
                        max_unauthenticated=options.pool,
                        new_event_loop=SERVER_LOOPS[loop_name],
                        observer=events,
                    ) as server:
                        configs = rpcscale.burst_configs(server.address[1], workers, request, key)
                        events.clear()
                        load, counters = os.getloadavg()[0], rpcscale.tcp_counters()
                        cpu, started = server.cpu_seconds(), time.perf_counter()
                        result = drive_processes(configs, timeout=TIMEOUT_S)
                        line = {
                            "who": "ours",
                            "server_loop": loop_name,
                            "pool": options.pool,
                            "load": round(load, 1),
                            **summary(result),
                            "server_cpu_s": round(server.cpu_seconds() - cpu, 2),
                            "kernel": counted(counters),
                            "accepted": spread([t - started for t in events.accepted_at]),
                            "answer": spread(events.answers),
                            "server_calls": dict(events.calls),
                        }
                        print(json.dumps(line), flush=True)
                if options.only != "ours":
                    raw = rpcscale.redis_burst_configs(redis.port, workers, request)
                    load, counters = os.getloadavg()[0], rpcscale.tcp_counters()
                    cpu = redis.cpu_seconds()
                    result = drive_processes(raw, timeout=TIMEOUT_S)
                    line = {
                        "who": "redis",
                        "load": round(load, 1),
                        **summary(result),
                        "server_cpu_s": round(redis.cpu_seconds() - cpu, 2),
                        "kernel": counted(counters),
                    }
                    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
