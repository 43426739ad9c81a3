"""`rpc-flood`: authenticated clients keep calling while idle connections flood the server.

An attacker on a node can open connections to the allocator's port without knowing the
token and hold them open, reconnecting whenever the server drops them. The server keeps
those in a pool of its own (256 by default; a newcomer takes the slot of a silent one
older than a second, or waits in line for a slot, and after the 5 s handshake deadline
there takes the oldest slot whatever its age: `herd_operator/rpc/pool.py`), so workers
should still get through.
This benchmark measures it: N authenticated clients call the real `bind` and `report`
handlers for D seconds, first alone (the baseline), then while M unauthenticated
connections are held open and reopened as soon as the server drops them. Everything runs
on loopback in this process; it ends with the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from devtools.bench.rpcload import JOB, TOKEN, job_handlers
from herd_operator import rpc
from herd_operator.bench.harness import Context, Row, Stats, paired_ratio_figures, percentile
from herd_operator.layout import StateLayout
from herd_operator.rpc.client import RpcClient
from herd_operator.rpc.protocol import RpcError
from herd_operator.rpc.server import RpcServer
from herd_operator.runtime.handlers import GROUPED_OPS, for_anyone
from herd_operator.runtime.operator import STORE_CHECKPOINT_SECONDS
from herd_operator.runtime.store import Store

FULL = {"clients": 256, "idlers": 1100, "seconds": 60.0}
QUICK = {"clients": 16, "idlers": 150, "seconds": 5.0}
CLIENT_TIMEOUT_S = 30.0
"""A client call that takes longer than this counts as failed (timeout)."""
HANG_GUARD_S = 120.0
"""How long past its deadline any thread of the benchmark may take to stop."""
SETTLE_S = 30.0
"""At most this long for every idler to have connected once before the clients start."""
RETRY_PAUSE_S = 0.05
"""A client that failed waits this long before its next call, as a worker would."""
DESCRIPTORS_PER_CLIENT = 2  # the client's socket and the server's end of it
DESCRIPTOR_MARGIN = 256  # the store, the listener, the interpreter's own files


@dataclass
class Phase:
    """What one timed phase (with or without idlers) measured."""

    seconds: float = 0.0
    calls_ok: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    """Failure messages, with numbers blanked out so that alike ones count together."""
    latencies: list[float] = field(default_factory=list)
    idler_connections: int = 0
    idler_drops: int = 0
    idler_connect_errors: int = 0
    stop_tracebacks: int = 0
    server_warnings: int = 0

    @property
    def calls_failed(self) -> int:
        return sum(self.failures.values())

    @property
    def rate(self) -> float:
        return self.calls_ok / self.seconds if self.seconds > 0 else 0.0


class _Tally(logging.Filter):
    """Counts the records of one logger that `wanted` picks, and keeps them off the output."""

    def __init__(self, wanted: Callable[[logging.LogRecord], bool]) -> None:
        super().__init__()
        self.wanted = wanted
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.wanted(record):
            self.count += 1
            return False
        return True


def _cancelled_callback(record: logging.LogRecord) -> bool:
    """asyncio's traceback for a cancelled connection task.

    On Python 3.11, `asyncio.start_server`'s done-callback calls `task.exception()`,
    which raises CancelledError for a cancelled task; RpcServer.stop cancels the tasks
    of connections still open, so each one logs a traceback (fixed in 3.12).
    """
    error = record.exc_info[1] if record.exc_info else None
    return isinstance(error, asyncio.CancelledError)


def _warning(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING


@contextlib.contextmanager
def tallying_server_logs() -> Iterator[tuple[_Tally, _Tally]]:
    """(stop tracebacks, RPC server warnings) while the block runs: an idler the server
    drops for its handshake deadline is one warning line, and there are thousands."""
    tracebacks, warnings = _Tally(_cancelled_callback), _Tally(_warning)
    asyncio_logger, rpc_logger = logging.getLogger("asyncio"), logging.getLogger(rpc.__name__)
    asyncio_logger.addFilter(tracebacks)
    rpc_logger.addFilter(warnings)
    try:
        yield tracebacks, warnings
    finally:
        asyncio_logger.removeFilter(tracebacks)
        rpc_logger.removeFilter(warnings)


def ensure_descriptors(wanted: int) -> tuple[int, str]:
    """Raise the soft limit on open files to `wanted` if the hard limit allows.

    Returns the soft limit now in force and a sentence saying what was done.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return (wanted if soft == resource.RLIM_INFINITY else soft), (
            f"open-file limit {soft} already covers the {wanted} needed"
        )
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    note = f"raised the open-file soft limit from {soft} to {target} (hard limit {hard})"
    if target < wanted:
        note += f"; {wanted} were wanted, so fewer idle connections are held"
    return target, note


class Idlers:
    """`count` connections that never authenticate, reopened whenever the server drops one.

    They run on an asyncio loop in a thread of their own until `stop` (or `until`, a
    monotonic deadline, whichever comes first).
    """

    def __init__(self, address: tuple[str, int], count: int, until: float) -> None:
        self._address = address
        self._count = count
        self._until = until
        self._loop = asyncio.new_event_loop()
        self._stopping: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="rpc-flood-idlers", daemon=True)
        self._started = threading.Event()
        self._all_open = threading.Event()
        self._open_now = 0
        self.connections = 0
        self.drops = 0
        self.connect_errors = 0

    def start(self, settle_timeout: float) -> bool:
        """Start; True once every idler has been connected at least once."""
        self._thread.start()
        self._started.wait(HANG_GUARD_S)
        return self._all_open.wait(settle_timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            stopping = self._stopping
            if stopping is not None:
                self._loop.call_soon_threadsafe(stopping.set)
            self._thread.join(HANG_GUARD_S)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        self._started.set()
        first_open = [False] * self._count
        tasks = [asyncio.create_task(self._hold(i, first_open)) for i in range(self._count)]
        remaining = max(0.0, self._until - time.monotonic())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining):
                await self._stopping.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _hold(self, index: int, first_open: list[bool]) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(*self._address)
            except OSError:
                self.connect_errors += 1
                await asyncio.sleep(RETRY_PAUSE_S)  # out of ports or descriptors: back off
                continue
            self.connections += 1
            if not first_open[index]:
                first_open[index] = True
                self._open_now += 1
                if self._open_now == self._count:
                    self._all_open.set()
            try:
                # Read and ignore the challenge; stay until the server hangs up.
                while await reader.read(4096):
                    pass
            except OSError:
                pass
            finally:
                writer.transport.abort()
            self.drops += 1


def _client_loop(
    client: RpcClient,
    index: int,
    start: threading.Barrier,
    deadline: list[float],
    phase: Phase,
    lock: threading.Lock,
) -> None:
    requests: list[tuple[str, dict[str, Any]]] = [
        ("bind", {"job": JOB, "host": "localhost", "local_rank": index % 4, "pid": 1000 + index}),
        ("report", {"job": JOB, "epoch": 1, "world_size": 4, "rank": index % 4, "metrics": {}}),
    ]
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    ok = 0
    try:
        start.wait(HANG_GUARD_S)
    except threading.BrokenBarrierError:
        return
    end = deadline[0]
    first = True
    turn = 0
    while time.monotonic() < end:
        op, args = requests[turn % 2]
        turn += 1
        began = time.perf_counter()
        try:
            client.call(op, **args)
        except RpcError as error:
            failures[f"rpc:{error.code}"] += 1
            reasons[_shape(error)] += 1
        except TimeoutError as error:
            failures["timeout"] += 1
            reasons[_shape(error)] += 1
        except ConnectionError as error:
            failures["connection"] += 1
            reasons[_shape(error)] += 1
        else:
            ok += 1
            # The first call connects and authenticates: counted, not timed.
            if not first:
                latencies.append(time.perf_counter() - began)
            first = False
            continue
        first = True  # the next call reconnects
        time.sleep(RETRY_PAUSE_S)
    with lock:
        phase.calls_ok += ok
        phase.failures.update(failures)
        phase.reasons.update(reasons)
        phase.latencies.extend(latencies)


def _shape(error: Exception) -> str:
    return re.sub(r"\d+", "N", f"{type(error).__name__}: {error}")[:160]


def run_phase(address: tuple[str, int], clients: int, idlers: int, seconds: float) -> Phase:
    """`clients` threads calling for `seconds`, with `idlers` unauthenticated connections."""
    phase = Phase()
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    deadline = [0.0]
    rpc_clients = [
        RpcClient(address, TOKEN, client=f"flood-{i}", timeout=CLIENT_TIMEOUT_S)
        for i in range(clients)
    ]
    threads = [
        threading.Thread(
            target=_client_loop,
            args=(rpc_clients[i], i, start, deadline, phase, lock),
            name=f"rpc-flood-client-{i}",
            daemon=True,
        )
        for i in range(clients)
    ]
    flood = Idlers(address, idlers, time.monotonic() + seconds + HANG_GUARD_S) if idlers else None
    try:
        if flood is not None:
            # Idlers are in place before the workers connect, as an attacker would be.
            flood.start(settle_timeout=SETTLE_S)
        for thread in threads:
            thread.start()
        began = time.monotonic()
        deadline[0] = began + seconds
        start.wait(HANG_GUARD_S)
        for thread in threads:
            thread.join(max(0.0, deadline[0] - time.monotonic()) + HANG_GUARD_S)
        phase.seconds = time.monotonic() - began
        if any(thread.is_alive() for thread in threads):
            raise RuntimeError("a client thread did not stop within the hang guard")
    finally:
        start.abort()
        if flood is not None:
            flood.stop()
            phase.idler_connections = flood.connections
            phase.idler_drops = flood.drops
            phase.idler_connect_errors = flood.connect_errors
        for rpc_client in rpc_clients:
            rpc_client.close()
    phase.latencies.sort()
    return phase


def _p(latencies: list[float], q: float) -> float:
    """The q-th percentile in ms; a phase in which no call succeeded has none to give."""
    if not latencies:
        raise RuntimeError("no call succeeded in a phase: no latency to report")
    return percentile(latencies, q) * 1000


def flood_rows(
    ctx: Context, *, clients: int, idlers: int, seconds: float, server_options: dict[str, Any]
) -> list[Row]:
    """Alternate a baseline phase and a flooded one `ctx.repeat` times; two rows."""
    wanted = idlers * DESCRIPTORS_PER_CLIENT + clients * DESCRIPTORS_PER_CLIENT
    limit, note = ensure_descriptors(wanted + DESCRIPTOR_MARGIN)
    ctx.progress(f"rpc-flood: {note}")
    if limit < wanted + DESCRIPTOR_MARGIN:
        idlers = max(0, (limit - DESCRIPTOR_MARGIN) // DESCRIPTORS_PER_CLIENT - clients)
        ctx.progress(f"rpc-flood: holding {idlers} idle connections, all the limit allows")
    layout = StateLayout(ctx.scratch / "state")
    layout.create()
    # As the operator opens it: checkpoints in the store's own thread.
    store = Store(layout.database, checkpoint_seconds=STORE_CHECKPOINT_SECONDS)
    baselines: list[Phase] = []
    floods: list[Phase] = []
    try:
        handlers = job_handlers(store, layout, for_anyone)
        for round_number in range(ctx.repeat):
            for flooded in (False, True):
                with (
                    tallying_server_logs() as (stop_tracebacks, server_warnings),
                    # As the operator serves: the reports of one loop turn share one commit.
                    RpcServer(
                        TOKEN,
                        handlers,
                        grouped_ops=GROUPED_OPS,
                        commit_group=store.transaction,
                        **server_options,
                    ) as server,
                ):
                    phase = run_phase(server.address, clients, idlers if flooded else 0, seconds)
                phase.stop_tracebacks = stop_tracebacks.count
                phase.server_warnings = server_warnings.count
                (floods if flooded else baselines).append(phase)
                ctx.progress(
                    f"rpc-flood: round {round_number + 1} {'flooded' if flooded else 'baseline'}:"
                    f" {phase.calls_ok} calls ok, {phase.calls_failed} failed"
                    f" {dict(phase.failures)}, idler connections {phase.idler_connections}"
                )
                for reason, count in phase.reasons.most_common(5):
                    ctx.progress(f"rpc-flood:   {count} x {reason}")
    finally:
        store.close()
    return _rows(baselines, floods, clients, idlers, seconds, limit)


def _rows(
    baselines: list[Phase],
    floods: list[Phase],
    clients: int,
    idlers: int,
    seconds: float,
    limit: int,
) -> list[Row]:
    base_latency = sorted(value for phase in baselines for value in phase.latencies)
    flood_latency = sorted(value for phase in floods for value in phase.latencies)
    failures: Counter[str] = Counter()
    for phase in floods:
        failures.update(phase.failures)
    extra: dict[str, float] = {
        "clients": clients,
        "idle_connections": idlers,
        "seconds_per_phase": seconds,
        "open_file_limit": limit,
        "calls_ok": sum(phase.calls_ok for phase in floods),
        "calls_failed": sum(phase.calls_failed for phase in floods),
        "calls_refused": failures["connection"] + failures["rpc:unavailable"],
        "calls_timed_out": failures["timeout"],
        "baseline_calls_ok": sum(phase.calls_ok for phase in baselines),
        "baseline_calls_failed": sum(phase.calls_failed for phase in baselines),
        "idler_connections": sum(phase.idler_connections for phase in floods),
        "idler_drops": sum(phase.idler_drops for phase in floods),
        "idler_connect_errors": sum(phase.idler_connect_errors for phase in floods),
        "server_stop_tracebacks": sum(p.stop_tracebacks for p in (*baselines, *floods)),
        "server_warning_lines": sum(phase.server_warnings for phase in floods),
        "baseline_server_warning_lines": sum(phase.server_warnings for phase in baselines),
        "ours_p50_ms": _p(flood_latency, 50),
        "ours_p99_ms": _p(flood_latency, 99),
        "baseline_p50_ms": _p(base_latency, 50),
        "baseline_p99_ms": _p(base_latency, 99),
    }
    rates = [phase.rate for phase in floods]
    base_rates = [phase.rate for phase in baselines]
    throughput = Row(
        name=f"rpc-flood throughput, {clients} clients, {idlers} idle connections",
        what="successful authenticated bind/report calls per second while idlers flood",
        unit="req/s",
        better="higher",
        baseline_label="same clients, no idle connections",
        baseline=Stats.of(base_rates),
        ours=Stats.of(rates),
        extra={**extra, **paired_ratio_figures(rates, base_rates)},
    )
    p99 = [_p(phase.latencies, 99) for phase in floods]
    base_p99 = [_p(phase.latencies, 99) for phase in baselines]
    latency = Row(
        name=f"rpc-flood p99 latency, {clients} clients, {idlers} idle connections",
        what="p99 of one authenticated call while idlers flood",
        unit="ms",
        better="lower",
        baseline_label="same clients, no idle connections",
        baseline=Stats.of(base_p99),
        ours=Stats.of(p99),
        extra={
            "ours_p50_ms": extra["ours_p50_ms"],
            "baseline_p50_ms": extra["baseline_p50_ms"],
            "calls_failed": extra["calls_failed"],
        },
    )
    return [throughput, latency]


def run_rpc_flood(ctx: Context) -> list[Row]:
    size = QUICK if ctx.quick else FULL
    return flood_rows(
        ctx,
        clients=int(size["clients"]),
        idlers=int(size["idlers"]),
        seconds=float(size["seconds"]),
        server_options={},
    )
