"""The operator's own RPC operations: workers' reports and node exporters' registrations.

(The allocator serves `bind`, `grant` and `placements` itself.) Each handler checks
its arguments and answers `BadRequest` naming the field and what is allowed.

Who may call what is decided here, from the identity the client proved in the
handshake (see `herd_operator.auth`): the admin (the master token) anything; a job's
processes `bind`, `report` and `grant` for that job only; a node exporter
`placements`, `register_exporter` and `unregister_exporter` for its own host only.
Anyone authenticated may `ping`.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeGuard

from herd_operator.auth import Identity
from herd_operator.layout import write_atomically
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.rpc.protocol import (
    BadRequest,
    Forbidden,
    Handler,
    NotFound,
    Unavailable,
    host_arg,
)
from herd_operator.runtime.allocator import Allocator, NotJobsProcess
from herd_operator.runtime.bindings import NoSuchWorker
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs.models import MAX_GPUS
from herd_operator.specs.values import Pool

log = logging.getLogger(__name__)

MAX_METRICS_PER_REPORT = 64
MAX_METRIC_NAME_CHARS = 128
MAX_EPOCH = 2**31 - 1
MAX_WORLD_SIZE = MAX_GPUS
"""Bounds on what a report may say: every number is stored, compared and exported."""

GROUPED_OPS = frozenset({"report"})
"""Ops whose store writes the RPC server commits together, the requests of one turn of its
loop in one transaction (each answered after the commit): a report is one small write.
A report's other effects (the allocator learns the world size, the job is woken) happen
when its handler runs, just before the commit; if the commit fails they stay (what the
worker said is still true, and a reconcile reads only committed reports), and the worker
gets an error."""


@contextmanager
def said_by_the_store(store: Store) -> Iterator[None]:
    """A store error while the store refuses writes (a full disk) is `Unavailable`: the
    server answers it without a traceback per request or group, since the store says that
    writes fail itself, once a minute at most."""
    try:
        yield
    except StoreError as err:
        if store.writable:
            raise
        raise Unavailable(str(err)) from err


@contextmanager
def store_group(store: Store) -> Iterator[None]:
    """`store.transaction()` for the RPC server's groups of `GROUPED_OPS`."""
    with said_by_the_store(store), store.transaction():
        yield


PlainHandler = Callable[[dict[str, Any]], dict[str, Any]]
"""An op's work, blind to who asks; the wrappers below decide who may ask."""


def for_anyone(handler: PlainHandler) -> Handler:
    def serve(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
        return handler(args)

    return serve


def for_own_job(handler: PlainHandler) -> Handler:
    """Admin, or a job's processes for that job (the request's `job`); no agent."""

    def serve(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
        if caller.kind == "job":
            job = args.get("job")
            if job != caller.name:
                raise Forbidden(
                    f"{caller} may only speak for job {caller.name!r}, not {_shown(job)}"
                )
        elif caller.kind != "admin":
            raise Forbidden(f"{caller} may not do this: it is for a job's own processes")
        return handler(args)

    return serve


def for_agents(handler: PlainHandler) -> Handler:
    """Admin or node exporters; not jobs (the answer is about every job)."""

    def serve(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
        if caller.kind == "job":
            raise Forbidden(f"{caller} may not do this: it is for node exporters")
        return handler(args)

    return serve


def for_own_host(handler: PlainHandler) -> Handler:
    """Admin, or a node exporter for its own host (the request's `host`); not jobs."""

    def serve(args: dict[str, Any], caller: Identity) -> dict[str, Any]:
        if caller.kind == "agent":
            host = host_arg(args, "host")
            if host != caller.name:
                raise Forbidden(f"{caller} may only register host {caller.name!r}, not {host!r}")
        elif caller.kind != "admin":
            raise Forbidden(f"{caller} may not do this: it is for node exporters")
        return handler(args)

    return serve


def _shown(value: object) -> str:
    """A client's value for an error message: quoted, escaped, short."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


class ReportHandler:
    """`report`: a job's rank 0 says an epoch ended, the world size changed, or (with
    `measurement`: true) what it measured a few steps into a new configuration.

    The report is stored for the policies, tells the allocator the job's real size (a
    finished shrink frees the GPUs it was draining) and wakes the job's reconcile.
    """

    def __init__(
        self,
        store: Store,
        allocator: Allocator,
        wake: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.allocator = allocator
        self.wake = wake
        self.clock = clock

    def __call__(self, args: dict[str, Any]) -> dict[str, Any]:
        job = args.get("job")
        epoch = args.get("epoch")
        world_size = args.get("world_size")
        rank = args.get("rank", 0)
        metrics = args.get("metrics") or {}
        measurement = args.get("measurement", False)
        if not isinstance(job, str) or not job:
            raise BadRequest("'job' must be a non-empty string")
        if not isinstance(measurement, bool):
            raise BadRequest("'measurement' must be true or false")
        if measurement and epoch is not None:
            raise BadRequest("'epoch' must be null in a measurement (it is made within an epoch)")
        if epoch is not None and not _integer_in(epoch, 0, MAX_EPOCH):
            raise BadRequest(f"'epoch' must be an integer from 0 to {MAX_EPOCH}, or null")
        if not _integer_in(world_size, 1, MAX_WORLD_SIZE):
            raise BadRequest(f"'world_size' must be an integer from 1 to {MAX_WORLD_SIZE}")
        if not _integer_in(rank, 0, MAX_WORLD_SIZE - 1):
            raise BadRequest(f"'rank' must be an integer from 0 to {MAX_WORLD_SIZE - 1}")
        if (
            not isinstance(metrics, dict)
            or len(metrics) > MAX_METRICS_PER_REPORT
            or not all(
                isinstance(k, str)
                and 0 < len(k) <= MAX_METRIC_NAME_CHARS
                and isinstance(v, int | float)
                and not isinstance(v, bool)
                and _finite(v)
                for k, v in metrics.items()
            )
        ):
            raise BadRequest(
                f"'metrics' must map at most {MAX_METRICS_PER_REPORT} names of 1 to"
                f" {MAX_METRIC_NAME_CHARS} characters to finite numbers"
            )
        with said_by_the_store(self.store):
            try:
                # The store refuses a report of no job itself (a foreign key): no read first.
                self.store.add_report(
                    job, epoch, world_size, rank, metrics, self.clock(), measurement
                )
            except KeyError:
                raise NotFound(f"no job {job!r}") from None
            self.allocator.observe_world_size(job, world_size)  # may record a decision
        self.wake(job)
        return {}


class BatchHandler:
    """`batch`: the global batch the job's policy last picked, and for how many GPUs (an
    adaptive-batch job's rank 0 asks at each reset and epoch end); empty when none."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(self, args: dict[str, Any]) -> dict[str, Any]:
        job = args.get("job")
        if not isinstance(job, str) or not job:
            raise BadRequest("'job' must be a non-empty string")
        with said_by_the_store(self.store):
            record = self.store.get_job(job)
        if record is None:
            raise NotFound(f"no job {job!r}")
        choice = record.status.batch
        return {} if choice is None else {"gpus": choice.gpus, "batch_size": choice.size}


MAX_PID = 2**22
"""Linux's largest pid_max: a pid a worker says is at most this (and above 0)."""
MAX_LOCAL_RANK = MAX_GPUS - 1


class AllocatorOps:
    """The allocator's RPC operations: `bind`, `grant` and `placements`.

    Every field comes from a job's or an agent's process and is untrusted: each is checked
    (type, range) and refused naming the field, and a worker's pid on this host must be a
    process of its own job (`Allocator.bind`). The allocator's own errors become the
    protocol's here: it raises none.
    """

    def __init__(self, allocator: Allocator) -> None:
        self.allocator = allocator

    def bind(self, args: dict[str, Any]) -> dict[str, Any]:
        """Which GPU is a worker's: by (job, host, local_rank), as Horovod numbers them."""
        job = _job_arg(args)
        host = host_arg(args, "host")
        local_rank = args.get("local_rank")
        if not _integer_in(local_rank, 0, MAX_LOCAL_RANK):
            raise BadRequest(f"'local_rank' must be an integer from 0 to {MAX_LOCAL_RANK}")
        pid = args.get("pid")
        if pid is not None and not _integer_in(pid, 1, MAX_PID):
            raise BadRequest(f"'pid' must be an integer from 1 to {MAX_PID}, or absent")
        try:
            slots = self.allocator.bind(job, host, local_rank, pid)
        except NoSuchWorker as err:
            raise NotFound(str(err)) from None
        except NotJobsProcess as err:
            raise BadRequest(str(err)) from None
        return {
            "gpu": slots[local_rank][1],
            "gpus": [gpu for _, gpu in slots],
            "virtual": self.allocator.virtual,
        }

    def grant(self, args: dict[str, Any]) -> dict[str, Any]:
        job = _job_arg(args)
        grant = self.allocator.grant(job)
        if grant is None:
            raise NotFound(f"no job {job!r}")
        return {"placement": grant.placement.to_json(), "reason": grant.reason}

    def placements(self, args: dict[str, Any]) -> dict[str, Any]:
        """Every job's GPUs, for node exporters labelling GPUs with their job."""
        placements, bindings = self.allocator.placements(), self.allocator.bindings()
        return {
            "placements": {
                job: placement.to_json() for job, placement in placements.items() if placement.size
            },
            "bindings": [[b.job, b.host, b.local_rank, b.gpu, b.pid] for b in bindings],
        }


def _job_arg(args: dict[str, Any]) -> str:
    job = args.get("job")
    if not isinstance(job, str) or not job:
        raise BadRequest("'job' must be a non-empty string")
    return job


def _integer_in(value: object, low: int, high: int) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


class Heartbeats(Protocol):
    def heartbeat(self, host: str, port: int | None = None, every: float | None = None) -> None: ...


MAX_HEARTBEAT_SECONDS = 3600.0


def heard_from(nodes: Heartbeats, handler: PlainHandler) -> PlainHandler:
    """`handler`, after telling `nodes` that the request's host was heard (its agent's
    periodic registration is its heartbeat), where the agent serves (`port`, which the node
    watch probes) and how often it calls (`every`, optional: agents before it did not say)."""

    def serve(args: dict[str, Any]) -> dict[str, Any]:
        reply = handler(args)  # checks `host` and `port`
        every = args.get("every")
        if every is not None and not (
            isinstance(every, int | float)
            and not isinstance(every, bool)
            and 0 < every <= MAX_HEARTBEAT_SECONDS
        ):
            raise BadRequest(f"'every' must be seconds in (0, {MAX_HEARTBEAT_SECONDS:g}]")
        port = args.get("port")
        nodes.heartbeat(
            host_arg(args, "host"),
            port if isinstance(port, int) else None,
            float(every) if every is not None else None,
        )
        return reply

    return serve


EXPORTER_EXPIRY_SECONDS = 90.0
"""A node exporter not heard from for this long is dropped from the scrape targets and the
scraped URLs. Exporters register again every 5 s (`REGISTER_EVERY_SECONDS` in
herd_operator/agent/exporter.py, their heartbeat): long silence means it stopped."""
EXPORTER_EXPIRE_EVERY_SECONDS = 5.0


def _exporter_address(args: dict[str, Any]) -> str:
    host, port = host_arg(args, "host"), args.get("port")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise BadRequest("'port' must be a TCP port number")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ExporterRegistry:
    """`register_exporter`: node exporters say where they serve (answered, given the pool,
    with `{"gpus": N, "indices": [...]}`, the GPUs the pool has on the exporter's host and
    their numbers there: 0 and [] outside it).

    Kept as Prometheus file_sd targets (with the operator's own endpoint) and as the
    URLs the usage observer scrapes when the pool spans several hosts. An exporter that
    stops registering (its node or its agent stopped) expires after `expire_after`
    seconds: `expire()` (every `expire_every` seconds from `start()` to `stop()`, and on
    each registration and each `urls()`) drops it and rewrites the targets file.
    """

    def __init__(
        self,
        targets_file: Path,
        operator_address: str | None,
        *,
        expire_after: float = EXPORTER_EXPIRY_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        pool: Callable[[], Pool] | None = None,
        expire_every: float = EXPORTER_EXPIRE_EVERY_SECONDS,
        health: LoopHealth | None = None,
    ) -> None:
        self.targets_file = targets_file
        self.operator_address = operator_address
        self._pool = pool
        """The pool now (it can change): each registration is answered with the GPUs it
        has on the exporter's host, which a node agent without NVML serves as virtual GPUs."""
        self.expire_after = expire_after
        self._clock = clock
        self._exporters: dict[str, float] = {}
        """address -> when it last registered"""
        self._lock = threading.Lock()
        self._expiry = Periodic(
            "exporter-expiry",
            self.expire,
            expire_every,
            what="expiring silent node exporters",
            # The targets file could not be written: the next round tries again.
            expected=(OSError,),
            health=health,
        )
        self.name = self._expiry.name

    def urls(self) -> list[str]:
        self.expire()
        with self._lock:
            return [f"http://{address}/metrics" for address in sorted(self._exporters)]

    def __call__(self, args: dict[str, Any]) -> dict[str, Any]:
        address = _exporter_address(args)
        with self._lock:
            known = address in self._exporters
            self._exporters[address] = self._clock()
        if not known:
            log.info("exporter registered: %s", address)
            self.write_targets()
        self.expire()
        if self._pool is None:
            return {}
        gpus = dict(self._pool().hosts).get(host_arg(args, "host"), ())
        return {"gpus": len(gpus), "indices": list(gpus)}

    def unregister(self, args: dict[str, Any]) -> dict[str, Any]:
        """`unregister_exporter`: an exporter that stops says so, and leaves the targets now
        rather than when it expires."""
        address = _exporter_address(args)
        with self._lock:
            known = self._exporters.pop(address, None) is not None
        if known:
            log.info("exporter unregistered: %s", address)
            self.write_targets()
        return {}

    def expire(self) -> list[str]:
        """Drop the exporters not heard from within `expire_after`; returns their addresses."""
        now = self._clock()
        with self._lock:
            gone = [a for a, seen in self._exporters.items() if now - seen > self.expire_after]
            for address in gone:
                del self._exporters[address]
        if gone:
            log.info(
                "exporter(s) %s not heard from for %gs: no longer scraped",
                ", ".join(sorted(gone)),
                self.expire_after,
            )
            self.write_targets()
        return gone

    def start(self) -> None:
        """Expire exporters every `expire_every` seconds on a thread, until `stop()`."""
        self._expiry.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self._expiry.stop(timeout)

    def write_targets(self) -> None:
        """Prometheus file_sd targets: the operator and every registered node exporter."""
        groups = []
        if self.operator_address:
            groups.append({"targets": [self.operator_address], "labels": {"herd_role": "operator"}})
        with self._lock:
            exporters = sorted(self._exporters)
        if exporters:
            groups.append({"targets": exporters, "labels": {"herd_role": "exporter"}})
        write_atomically(self.targets_file, json.dumps(groups, indent=2) + "\n")
