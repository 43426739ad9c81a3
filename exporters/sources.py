"""The observation side: GPU readings rebuilt from the exported metrics.

`ScrapeGpuSource` reads the exporters' `/metrics` pages directly;
`PrometheusGpuSource` asks a Prometheus server that scrapes them. Both give back
the `GpuReading`s that `GpuCollector` exported, and both drop what is too old:
stale metrics must make the policies hold, never guess.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families

from herd_operator.exporters.gpu import GpuKind, GpuReading, ProcessMemory

log = logging.getLogger(__name__)

K = TypeVar("K")

MAX_PARALLEL_SCRAPES = 16

# Exported family -> the GpuReading field it fills ("" for the identity-only info series).
_FIELD_OF_FAMILY = {
    "herd_gpu_info": "",
    "herd_gpu_memory_used_bytes": "memory_used_bytes",
    "herd_gpu_memory_total_bytes": "memory_total_bytes",
    "herd_gpu_utilization_ratio": "utilization_ratio",
    "herd_gpu_power_watts": "power_watts",
    "herd_gpu_process_memory_used_bytes": "processes",
}

# Where a network failure surfaces: URLError and timeouts are OSErrors; a peer that
# speaks broken HTTP raises HTTPException.
_UNREACHABLE = (OSError, http.client.HTTPException)


class PromQLError(RuntimeError):
    """Prometheus answered, but not with the series asked for."""


class _Malformed(ValueError):
    """A metrics page or query result that cannot be read as GPU readings."""


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: Mapping[str, str]
    value: float
    timestamp: float | None
    """Seconds since the epoch; None for a sample that is as fresh as its page."""


@dataclass
class _GpuParts:
    uuid: str
    kind: GpuKind
    # field -> (timestamp, value): the newest sample wins (several scrapers of one GPU).
    values: dict[str, tuple[float, float]] = field(default_factory=dict)
    processes: dict[int, tuple[float, float]] = field(default_factory=dict)

    def reading(self, host: str, index: int) -> GpuReading:
        def value(name: str) -> float | None:
            return self.values[name][1] if name in self.values else None

        used, total = value("memory_used_bytes"), value("memory_total_bytes")
        return GpuReading(
            host=host,
            index=index,
            uuid=self.uuid,
            kind=self.kind,
            memory_used_bytes=None if used is None else int(used),
            memory_total_bytes=None if total is None else int(total),
            utilization_ratio=value("utilization_ratio"),
            power_watts=value("power_watts"),
            processes=tuple(
                ProcessMemory(pid, int(process_used))
                for pid, (_, process_used) in self.processes.items()
            ),
        )


def _keep_newest(into: dict[K, tuple[float, float]], key: K, when: float, value: float) -> None:
    if key not in into or when > into[key][0]:
        into[key] = (when, value)


def _kind(labels: Mapping[str, str]) -> GpuKind:
    kind = labels.get("kind")
    if kind == "nvml":
        return "nvml"
    if kind == "virtual":
        return "virtual"
    raise _Malformed(f"unknown GPU kind {kind!r} in {dict(labels)}")


def _readings(samples: Iterable[_Sample], now: float, max_age: float) -> list[GpuReading]:
    """One reading per (host, gpu) in order of first appearance, from fresh samples only."""
    gpus: dict[tuple[str, int], _GpuParts] = {}
    for sample in samples:
        field_name = _FIELD_OF_FAMILY.get(sample.name)
        if field_name is None:
            continue
        when = now if sample.timestamp is None else sample.timestamp
        if now - when > max_age:
            continue
        try:
            host, index, uuid = (
                sample.labels["host"],
                int(sample.labels["gpu"]),
                sample.labels["uuid"],
            )
            pid = int(sample.labels["pid"]) if field_name == "processes" else 0
        except (KeyError, ValueError) as err:
            raise _Malformed(f"{sample.name}{dict(sample.labels)}: bad or missing {err}") from err
        parts = gpus.setdefault((host, index), _GpuParts(uuid, _kind(sample.labels)))
        if not field_name or not math.isfinite(sample.value):
            continue  # NaN or Inf says "unknown", like an absent series
        if field_name == "processes":
            _keep_newest(parts.processes, pid, when, sample.value)
        else:
            _keep_newest(parts.values, field_name, when, sample.value)
    return [parts.reading(host, index) for (host, index), parts in gpus.items()]


class _Health:
    """Error counts by reason, and one log line per change of an endpoint's state."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.failing: dict[str, str] = {}

    def failed(self, endpoint: str, reason: str, err: BaseException) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.failing.get(endpoint) != reason:
            log.warning("GPU metrics from %s unavailable (%s): %s", endpoint, reason, err)
        self.failing[endpoint] = reason

    def answered(self, endpoint: str) -> None:
        if self.failing.pop(endpoint, None) is not None:
            log.info("GPU metrics from %s available again", endpoint)

    def forget_all_but(self, endpoints: Iterable[str]) -> None:
        keep = set(endpoints)
        self.failing = {e: r for e, r in self.failing.items() if e in keep}


def _fetch(url: str, timeout: float) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def _exposition_samples(text: str) -> list[_Sample]:
    try:
        return [
            _Sample(
                sample.name,
                sample.labels,
                float(sample.value),
                None if sample.timestamp is None else float(sample.timestamp),
            )
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except ValueError as err:
        raise _Malformed(f"not a Prometheus text exposition: {err}") from err


class ScrapeGpuSource:
    """GPU readings scraped from the exporters' `/metrics` pages.

    `urls` (or a function giving them, for exporters that register later) are the
    full URLs of the pages. An endpoint that cannot be reached or read is skipped
    and counted; `up` is False only when no endpoint answered. Samples that carry
    a timestamp (a federating Prometheus, say) older than `max_age` seconds are
    dropped; samples without one are as fresh as the page.
    """

    def __init__(
        self,
        urls: Sequence[str] | Callable[[], Sequence[str]],
        timeout: float = 2.0,
        max_age: float = 30.0,
    ) -> None:
        self._urls = urls
        self.timeout = timeout
        self.max_age = max_age
        self.up = True
        self._lock = threading.Lock()
        self._health = _Health()

    def errors(self) -> dict[str, int]:
        """Skipped endpoints so far, by reason (unreachable, http_error, malformed)."""
        with self._lock:
            return dict(self._health.counts)

    def read(self) -> list[GpuReading]:
        urls = list(self._urls() if callable(self._urls) else self._urls)
        with self._lock:
            self._health.forget_all_but(urls)
        if len(urls) > 1:
            with ThreadPoolExecutor(min(len(urls), MAX_PARALLEL_SCRAPES), "gpu-scrape") as pool:
                pages = list(pool.map(self._scrape, urls))
        else:
            pages = [self._scrape(url) for url in urls]
        readings: list[GpuReading] = []
        seen: set[tuple[str, int]] = set()
        for page in pages:
            for reading in page or ():  # the first endpoint to report a GPU wins
                if (reading.host, reading.index) not in seen:
                    seen.add((reading.host, reading.index))
                    readings.append(reading)
        self.up = any(page is not None for page in pages)
        return readings

    def _scrape(self, url: str) -> list[GpuReading] | None:
        """The readings on one page; None (counted, logged on change) if it cannot be read."""
        try:
            text = _fetch(url, self.timeout).decode("utf-8")
            readings = self.page_readings(_exposition_samples(text), url)
        except urllib.error.HTTPError as err:
            self._failed(url, "http_error", err)
        except _UNREACHABLE as err:
            self._failed(url, "unreachable", err)
        except (_Malformed, UnicodeDecodeError) as err:
            self._failed(url, "malformed", err)
        else:
            with self._lock:
                self._health.answered(url)
            return readings
        return None

    def _failed(self, url: str, reason: str, err: Exception) -> None:
        with self._lock:
            self._health.failed(url, reason, err)

    def page_readings(self, samples: list[_Sample], url: str) -> list[GpuReading]:
        """The GPU readings on the page at `url` (herd's exporters' series)."""
        return _readings(samples, time.time(), self.max_age)


def promql(
    base_url: str, query: str, timeout: float = 2.0
) -> list[tuple[dict[str, str], float, float]]:
    """An instant query: (labels, timestamp, value) per series.

    For a range selector (`metric[30s]`, a matrix) each series gives its newest raw
    sample, with the time it was scraped. An instant vector's timestamp is the
    evaluation time, not the sample's. Raises PromQLError when Prometheus refuses
    the query or answers something else than series; network errors propagate.
    """
    url = f"{base_url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': query})}"
    try:
        body = _fetch(url, timeout)
    except urllib.error.HTTPError as err:
        body = err.read()  # Prometheus explains a refused query in a JSON body (400, 422, 503)
        if not body.lstrip().startswith(b"{"):
            raise PromQLError(f"query {query!r}: HTTP {err.code} {err.reason}") from err
    try:
        payload = json.loads(body)
        if payload.get("status") != "success":
            raise PromQLError(
                f"query {query!r} failed: {payload.get('errorType', 'unknown error')}: "
                f"{payload.get('error', '(no message)')}"
            )
        data = payload["data"]
        result_type = data["resultType"]
        if result_type == "vector":
            points = [(series["metric"], series["value"]) for series in data["result"]]
        elif result_type == "matrix":
            points = [(series["metric"], series["values"][-1]) for series in data["result"]]
        else:
            raise PromQLError(f"query {query!r} gave a {result_type}, not series")
        return [
            ({str(k): str(v) for k, v in labels.items()}, float(point[0]), float(point[1]))
            for labels, point in points
        ]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as err:
        raise PromQLError(f"query {query!r}: not a Prometheus API answer: {err!r}") from err


class PrometheusGpuSource:
    """GPU readings from a Prometheus server that scrapes the exporters.

    One query fetches the newest raw sample of each GPU series within the last
    `max_age_seconds`, with the time it was scraped; older samples are dropped.
    """

    def __init__(self, base_url: str, timeout: float = 2.0, max_age_seconds: float = 30) -> None:
        if max_age_seconds <= 0:
            raise ValueError(f"max_age_seconds must be positive, not {max_age_seconds}")
        self.base_url = base_url
        self.timeout = timeout
        self.max_age_seconds = max_age_seconds
        self.up = True
        self._lock = threading.Lock()
        self._health = _Health()

    families: tuple[str, ...] = tuple(_FIELD_OF_FAMILY)
    """The metric names the query asks for."""

    @property
    def query(self) -> str:
        names = "|".join(self.families)
        window_ms = math.ceil(self.max_age_seconds * 1000)
        return f'{{__name__=~"{names}"}}[{window_ms}ms]'

    def series_readings(self, samples: list[_Sample]) -> list[GpuReading]:
        """The GPU readings in the series the query returned (herd's exporters' series)."""
        return _readings(samples, time.time(), self.max_age_seconds)

    def errors(self) -> dict[str, int]:
        """Failed reads so far, by reason (unreachable, query_error)."""
        with self._lock:
            return dict(self._health.counts)

    def read(self) -> list[GpuReading]:
        with self._lock:
            try:
                series = promql(self.base_url, self.query, self.timeout)
                samples = [
                    _Sample(labels.get("__name__", ""), labels, value, timestamp)
                    for labels, timestamp, value in series
                ]
                readings = self.series_readings(samples)
            except _UNREACHABLE as err:
                self._health.failed(self.base_url, "unreachable", err)
            except (PromQLError, _Malformed) as err:
                self._health.failed(self.base_url, "query_error", err)
            else:
                self._health.answered(self.base_url)
                self.up = True
                # Prometheus returns series in no particular order; sort, so reads compare.
                return sorted(
                    (
                        dataclasses.replace(r, processes=tuple(sorted(r.processes, key=_pid)))
                        for r in readings
                    ),
                    key=lambda r: (r.host, r.index),
                )
            self.up = False
            return []


def _pid(process: ProcessMemory) -> int:
    return process.pid
