"""A load generator for the allocator's RPC: many connections per process, on asyncio.

A thread per client under one GIL measures the interpreter's thread switching more
than the server (at 64 `RpcClient` threads the generator, not the server, was the
bottleneck: see docs/benchmarks.md). This driver works like `redis-benchmark`: each
process multiplexes many connections on one event loop (uvloop), every connection with one
request in flight at a time, and the work is spread over several processes so the
generator is not what saturates. It speaks the real protocol: the v2 handshake with a
real HMAC proof, then JSON-lines requests, checking each response's id and `ok`.

Run as ``python -m herd_operator.bench.rpcdrive CONFIG_JSON``; the parent
(`drive_processes`) starts the processes, waits for each to print ``ready``, writes
``go`` to all at once, and reads one JSON line of results from each.

Modes:

- ``calls``: connect and authenticate (not timed), then on ``go`` every connection
  makes ``calls`` requests back to back; results: the latency of each request and the
  time from ``go`` until this process's last response.
- ``raw``: the same with no handshake, sending ``raw_request`` and waiting for a line
  that starts with ``expect`` (a baseline: an echo server, or Redis with ``PING``).
- ``burst``: on ``go`` every connection connects, authenticates, makes one request and
  closes, all at once, as the shims of a starting job do; connection ``k`` (counting
  from ``first`` over all processes) binds local rank ``k % 4`` on host
  ``host_format.format(k // 4)``. Results: each connection's time from ``go`` to its
  response. A connection refused as ``busy`` tries again after a short pause, as
  ``RpcClient`` does. Besides, per connection, the time from ``go`` at which each phase
  ended (``PHASES``: the TCP connect as the client saw it, the challenge, the welcome,
  the response; a retried connection's last try) and how many tries it took, so a slow
  burst can be split into where its seconds went.
- ``raw-burst``: the same burst of connections with no handshake, one ``raw_request``
  each (the baseline of ``burst``; its phases are ``connect`` and ``done`` only).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import uvloop

from herd_operator.auth import new_nonce, prove

Mode = Literal["calls", "raw", "burst", "raw-burst"]
READY = b"ready\n"
GO = b"go\n"
_CONNECT_RETRIES = 8
"""Tries of a connection refused before its welcome, as many as RpcClient's default."""
_RETRY_FIRST_PAUSE_S = 0.05
_RETRY_MAX_PAUSE_S = 2.0
PHASES = ("connect", "challenge", "welcome", "done")
"""A burst connection's steps, in order; ``connect`` ends when the kernel completed the
TCP handshake on the client's side, which can be before the server accepted it."""


class DriveError(Exception):
    """A connection got an error or an unexpected frame; the text says which."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry
        """Whether RpcClient would try again (refused as busy, or closed before welcome)."""


@dataclass(frozen=True)
class DriveConfig:
    """What one driver process does; crosses the process boundary as JSON."""

    mode: Mode
    host: str
    port: int
    connections: int
    calls: int
    request: dict[str, Any]
    """The request's ``op`` and ``args``; the driver adds the ``id``."""
    token_hex: str = ""
    identity: str = "admin"
    label: str = "drive"
    raw_request: str = ""
    expect: str = ""
    host_format: str = ""
    first: int = 0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> DriveConfig:
        return cls(**json.loads(text))


class _Connection(asyncio.Protocol):
    """One client connection: the handshake (unless echo), then requests one at a time."""

    def __init__(
        self,
        config: DriveConfig,
        index: int,
        results: list[float],
        phases: dict[str, float] | None = None,
    ) -> None:
        self._config = config
        self._phases = phases
        self._raw = config.mode in ("raw", "raw-burst")
        self._token = bytes.fromhex(config.token_hex)
        self._label = f"{config.label}-{os.getpid()}-{index}"
        self._results = results
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self._server_nonce = ""
        self._client_nonce = ""
        self._state = "ready" if self._raw else "challenge"
        self._remaining = 0
        self._next_id = 1
        self._sent_at = 0.0
        loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        if self._raw:
            self.ready.set_result(None)
        self._raw_request: bytes = config.raw_request.encode()
        self._expect: bytes = config.expect.encode()
        args = dict(config.request.get("args", {}))
        if config.host_format:
            worker = config.first + index
            args.update(host=config.host_format.format(worker // 4), local_rank=worker % 4)
        body = json.dumps({"op": config.request["op"], "args": args}, separators=(",", ":"))
        # {"id":N,<body without its opening brace>: formatted per request, cheaply.
        self._request_tail = ("," + body[1:] + "\n").encode()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        error = DriveError(
            f"connection closed in state {self._state}: {exc!r}",
            retry=self._state in ("challenge", "welcome"),
        )
        for future in (self.ready, self.done):
            if not future.done():
                future.set_exception(error)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                return
            line, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
            try:
                self._on_line(line)
            except DriveError as error:
                for future in (self.ready, self.done):
                    if not future.done():
                        future.set_exception(error)
                assert self._transport is not None
                self._transport.abort()
                return

    def start(self, calls: int) -> None:
        """Make ``calls`` requests, one after another; ``done`` resolves after the last."""
        self._remaining = calls
        self._state = "running"
        self._send_request()

    def _send_request(self) -> None:
        assert self._transport is not None
        self._sent_at = time.perf_counter()
        if self._raw:
            self._transport.write(self._raw_request)
        else:
            self._transport.write(b'{"id":%d' % self._next_id + self._request_tail)

    def _on_line(self, line: bytes) -> None:
        if self._state == "running":
            now = time.perf_counter()
            expected = self._expect if self._raw else b'{"id":%d,"ok":true' % self._next_id
            if not line.startswith(expected):
                raise DriveError(f"unexpected response: {line[:200]!r}")
            self._results.append(now - self._sent_at)
            self._next_id += 1
            self._remaining -= 1
            if self._remaining > 0:
                self._send_request()
            elif not self.done.done():
                self.done.set_result(None)
            return
        frame = json.loads(line)
        if frame.get("type") == "error":
            code = frame.get("error", {}).get("code")
            raise DriveError(f"server refused the connection: {code}", retry=code == "busy")
        if self._state == "challenge":
            self._mark("challenge")
            self._server_nonce = frame["nonce"]
            self._client_nonce = new_nonce()
            identity, label = self._config.identity, self._label
            proof = prove(
                self._token, "client", self._server_nonce, self._client_nonce, label, identity
            )
            hello = {
                "type": "auth",
                "identity": identity,
                "client": label,
                "nonce": self._client_nonce,
                "proof": proof,
            }
            assert self._transport is not None
            self._transport.write(json.dumps(hello).encode() + b"\n")
            self._state = "welcome"
        elif self._state == "welcome":
            server_proof = prove(self._token, "server", self._server_nonce, self._client_nonce)
            if frame.get("type") != "welcome" or frame.get("proof") != server_proof:
                raise DriveError("the server did not prove it knows the token")
            self._mark("welcome")
            self._state = "ready"
            self.ready.set_result(None)
        else:
            raise DriveError(f"unexpected frame in state {self._state}: {line[:200]!r}")

    def _mark(self, phase: str) -> None:
        if self._phases is not None:
            self._phases[phase] = time.perf_counter()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def _open(
    config: DriveConfig,
    index: int,
    results: list[float],
    phases: dict[str, float] | None = None,
) -> _Connection:
    """Connect and authenticate one connection.

    As ``RpcClient`` does: a connection refused as ``busy``, or closed or reset before
    the welcome, is tried again after a jittered pause that doubles each time.
    ``phases`` (if given) gets the time each phase ended and ``tries``.
    """
    loop = asyncio.get_running_loop()
    for attempt in range(_CONNECT_RETRIES):
        if phases is not None:
            phases.clear()
            phases["tries"] = attempt + 1
        try:
            _, connection = await loop.create_connection(
                lambda: _Connection(config, index, results, phases), config.host, config.port
            )
            connection._mark("connect")
            await connection.ready
            return connection
        except (DriveError, ConnectionError) as error:
            retry = isinstance(error, ConnectionError) or error.retry
            if not retry or attempt == _CONNECT_RETRIES - 1:
                raise
        pause = min(_RETRY_MAX_PAUSE_S, _RETRY_FIRST_PAUSE_S * 2**attempt)
        await asyncio.sleep(pause * random.uniform(0.5, 1.0))
    raise AssertionError("unreachable")


async def _burst_one(
    config: DriveConfig,
    index: int,
    go: float,
    done_at: list[float],
    failures: list[str],
    phase_times: dict[str, list[float]],
) -> None:
    latencies: list[float] = []
    phases: dict[str, float] = {}
    try:
        connection = await _open(config, index, latencies, phases)
        connection.start(1)
        await connection.done
    except (OSError, DriveError) as error:
        failures.append(f"{type(error).__name__}: {error}")
        return
    done = time.perf_counter()
    done_at.append(done - go)
    phases["done"] = done
    for phase in PHASES:
        if phase in phases:
            phase_times[phase].append(phases[phase] - go)
    phase_times["tries"].append(phases["tries"])
    connection.close()


async def _run(config: DriveConfig) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    if config.mode in ("burst", "raw-burst"):
        sys.stdout.buffer.write(READY)
        sys.stdout.flush()
        await reader.readline()
        go = time.perf_counter()
        done_at: list[float] = []
        failures: list[str] = []
        phase_times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "tries")}
        await asyncio.gather(
            *(
                _burst_one(config, index, go, done_at, failures, phase_times)
                for index in range(config.connections)
            )
        )
        return {
            "latencies": done_at,
            "elapsed": max(done_at, default=0.0),
            "failures": failures,
            "phases": phase_times,
            "cpu_s": time.process_time(),
        }
    latencies: list[float] = []
    connections = [await _open(config, index, latencies) for index in range(config.connections)]
    sys.stdout.buffer.write(READY)
    sys.stdout.flush()
    await reader.readline()
    go = time.perf_counter()
    for connection in connections:
        connection.start(config.calls)
    await asyncio.gather(*(connection.done for connection in connections))
    elapsed = time.perf_counter() - go
    for connection in connections:
        connection.close()
    return {
        "latencies": latencies,
        "elapsed": elapsed,
        "failures": [],
        "cpu_s": time.process_time(),
    }


@dataclass(frozen=True)
class DriveResult:
    """What all processes of one run measured together."""

    requests: int
    elapsed: float
    """From ``go`` until the last process's last response, in seconds."""
    latencies: list[float]
    """Every request's latency (burst: every connection's time to its response), sorted."""
    failures: list[str]
    """Burst connections that got no response, with why (empty otherwise)."""
    phases: dict[str, list[float]] = field(default_factory=dict)
    """Burst: for each of ``PHASES``, when each served connection ended it (s from
    ``go``, sorted), and ``tries``: how many connects each needed (empty otherwise)."""
    driver_cpu_s: float = 0.0
    """CPU time the driver processes used, start-up and connection set-up included."""

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed if self.elapsed > 0 else 0.0


def split(total: int, parts: int) -> list[int]:
    """``total`` spread over ``parts`` as evenly as integers allow, no part empty."""
    parts = max(1, min(parts, total))
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def drive_processes(
    configs: Sequence[DriveConfig], *, timeout: float, env: Mapping[str, str] | None = None
) -> DriveResult:
    """Run one driver process per config, start them together, and gather the results.

    Raises RuntimeError (with the process's stderr) if any process fails.
    """
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "herd_operator.bench.rpcdrive", config.to_json()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=None if env is None else dict(env),
        )
        for config in configs
    ]
    try:
        outputs = _start_together(processes, timeout)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return _merged(outputs)


def _start_together(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[Any]:
    """Wait for every process to be ready, tell them all to go, and read each one's results.

    Raises RuntimeError (with the process's stderr) if any process fails.
    """
    for process in processes:
        assert process.stdout is not None
        if process.stdout.readline() != READY:
            _, stderr = process.communicate(timeout=timeout)
            raise RuntimeError(f"a driver process failed to start: {stderr.decode()[-2000:]}")
    started = time.perf_counter()
    for process in processes:
        assert process.stdin is not None
        process.stdin.write(GO)
        process.stdin.flush()
    outputs = []
    for process in processes:
        remaining = max(1.0, timeout - (time.perf_counter() - started))
        stdout, stderr = process.communicate(timeout=remaining)
        if process.returncode != 0:
            raise RuntimeError(f"a driver process failed: {stderr.decode()[-2000:]}")
        outputs.append(json.loads(stdout))
    return outputs


def _merged(outputs: list[Any]) -> DriveResult:
    """The results of all processes as one run's."""
    latencies = sorted(value for output in outputs for value in output["latencies"])
    failures = [failure for output in outputs for failure in output["failures"]]
    elapsed = max(output["elapsed"] for output in outputs)
    phases: dict[str, list[float]] = {}
    for output in outputs:
        for phase, times in output.get("phases", {}).items():
            phases.setdefault(phase, []).extend(times)
    for times in phases.values():
        times.sort()
    cpu = sum(output["cpu_s"] for output in outputs)
    return DriveResult(len(latencies), elapsed, latencies, failures, phases, cpu)


def main() -> None:
    config = DriveConfig.from_json(sys.argv[1])
    # On libuv's loop, as the server: the generator's own CPU is part of every burst's
    # time on a small machine, and the Redis baseline's bursts use this driver too.
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result = runner.run(_run(config))
    # After uvloop has run, a write to a full pipe can return early (a partial count,
    # measured here: 64 KiB of a larger result) and sys.stdout drops the rest: write
    # until all of it is out.
    remaining = memoryview(json.dumps(result).encode())
    while remaining:
        remaining = remaining[os.write(sys.stdout.fileno(), remaining) :]


if __name__ == "__main__":
    main()
