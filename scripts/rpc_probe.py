"""Where a request's time goes on the allocator's RPC server: `bind` or `report` at N
clients, as `python -m devtools.bench --only allocator-rpc` serves them, with the server
thread's CPU per request split into user and system time, and an A/B of the store's
background checkpoints (the operator's setting) against SQLite's own checkpoints in the
committing thread.

    PYTHONPATH=$PWD nice python scripts/rpc_probe.py --op report --clients 64 --rounds 3
        [--checkpoints both|thread|commit]

Each round drives 20,000 requests from `rpcdrive`'s processes; each arm keeps its server
and store for the whole run (as the operator does), and the arms alternate. Prints one
JSON line per round and arm: requests/s, p50/p99 in ms, and the server thread's CPU per
request in µs (user, system; from /proc/self/task/TID/stat, so Linux only). A diagnostic,
not a benchmark row: no baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from devtools.bench.rpcdrive import drive_processes
from devtools.bench.rpcload import TOKEN, job_handlers
from devtools.bench.rpcscale import BIND, REPORT, call_configs, cpu_times
from herd_operator.bench.harness import percentile
from herd_operator.layout import StateLayout
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.handlers import GROUPED_OPS, for_own_job
from herd_operator.runtime.operator import STORE_CHECKPOINT_SECONDS
from herd_operator.runtime.store import Store

REQUESTS = 20_000
TIMEOUT_S = 300.0
ARMS = {"thread": STORE_CHECKPOINT_SECONDS, "commit": None}
"""Checkpoints from the store's own thread (the operator's setting), or SQLite's automatic
ones, run by whichever commit finds the log over 1,000 pages."""


class Arm:
    """One arm's store, allocator and server, kept for the whole run: the operator's store
    lives as long as the allocation, so each round adds to the same tables and log."""

    def __init__(self, name: str, scratch: Path) -> None:
        self.name = name
        layout = StateLayout(scratch / f"state-{name}")
        layout.create()
        self.store = Store(layout.database, checkpoint_seconds=ARMS[name])
        handlers = job_handlers(self.store, layout, for_own_job)
        self.server = RpcServer(
            TOKEN, handlers, grouped_ops=GROUPED_OPS, commit_group=self.store.transaction
        )
        self.server.start()

    def close(self) -> None:
        self.server.stop()
        self.store.close()

    def round(self, op: str, clients: int) -> dict[str, object]:
        request = BIND if op == "bind" else REPORT
        configs = call_configs(self.server.address[1], clients, REQUESTS // clients, request)
        thread = self.server._thread
        assert thread is not None and thread.native_id is not None
        stat = Path(f"/proc/self/task/{thread.native_id}/stat")
        user, system = cpu_times(stat)
        result = drive_processes(configs, timeout=TIMEOUT_S)
        user_after, system_after = cpu_times(stat)
        latencies = sorted(result.latencies)
        return {
            "op": op,
            "clients": clients,
            "checkpoints": self.name,
            "load": round(os.getloadavg()[0], 1),
            "req_per_s": round(result.rate),
            "p50_ms": round(percentile(latencies, 50) * 1000, 2),
            "p99_ms": round(percentile(latencies, 99) * 1000, 2),
            "user_us_per_req": round((user_after - user) / result.requests * 1e6, 1),
            "system_us_per_req": round((system_after - system) / result.requests * 1e6, 1),
        }


def main(argv: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=("bind", "report"), default="report")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--checkpoints", choices=(*ARMS, "both"), default="both")
    options = parser.parse_args(argv)
    if options.clients < 1 or options.rounds < 1:
        parser.error("--clients and --rounds must be at least 1")
    arms = list(ARMS) if options.checkpoints == "both" else [options.checkpoints]
    with tempfile.TemporaryDirectory(prefix="rpc-probe-") as scratch:
        opened: list[Arm] = []
        try:
            for name in arms:
                opened.append(Arm(name, Path(scratch)))
            for _ in range(options.rounds):
                for arm in opened:
                    print(json.dumps(arm.round(options.op, options.clients)), flush=True)
        finally:
            for arm in opened:
                arm.close()


if __name__ == "__main__":
    main(sys.argv[1:])
