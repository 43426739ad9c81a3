"""Reading GPU metrics back: scraping exporters over HTTP, and querying Prometheus."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.gpu import GpuReading, ProcessMemory
from herd_operator.exporters.sources import (
    PrometheusGpuSource,
    PromQLError,
    ScrapeGpuSource,
    promql,
)

GIB = 1 << 30


@dataclass
class Response:
    status: int
    body: str | bytes
    content_type: str = "text/plain; version=0.0.4"


@dataclass
class FakeHttp:
    """Canned answers by path; records the query strings it was asked."""

    base: str
    routes: dict[str, Response] = field(default_factory=dict)
    queries: list[dict[str, list[str]]] = field(default_factory=list)


@pytest.fixture
def http() -> Iterator[FakeHttp]:
    fake = FakeHttp(base="")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            fake.queries.append(urllib.parse.parse_qs(url.query))
            response = fake.routes.get(url.path, Response(404, "not found"))
            body = response.body
            if isinstance(body, str):
                body = body.encode()
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    fake.base = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield fake
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture
def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FixedSource:
    def __init__(self, readings: list[GpuReading]) -> None:
        self.readings = readings

    def read(self) -> list[GpuReading]:
        return list(self.readings)


def node1() -> list[GpuReading]:
    return [
        GpuReading("node1", 0, "GPU-aaaa", "nvml", 10 * GIB + 12345, 80 * GIB, 0.37, 251.5,
                   (ProcessMemory(4243, 4 * GIB), ProcessMemory(4242, 6 * GIB + 12345))),
        GpuReading("node1", 1, "GPU-bbbb", "nvml", None, None, None, None),
        GpuReading("node1", 2, "GPU-cccc", "nvml", 0, 80 * GIB, 0.0, 70.125),
    ]  # fmt: skip


def node2() -> list[GpuReading]:
    return [
        GpuReading("node2", 0, "VGPU-node2-0", "virtual", 123456789, 16 * GIB,
                   processes=(ProcessMemory(77, 123456789),)),
        GpuReading("node2", 1, "VGPU-node2-1", "virtual", 0, 16 * GIB),
    ]  # fmt: skip


def serve_exporter(http: FakeHttp, path: str, readings: list[GpuReading]) -> str:
    owners = {(r.host, r.index): "resnet" for r in readings[:1]}
    http.routes[path] = Response(
        200, exposition(GpuCollector(FixedSource(readings), lambda: owners, per_process=True))
    )
    return http.base + path


def test_scrape_round_trip_reproduces_the_readings_exactly(http: FakeHttp) -> None:
    urls = [
        serve_exporter(http, "/n1/metrics", node1()),
        serve_exporter(http, "/n2/metrics", node2()),
    ]
    source = ScrapeGpuSource(urls)

    assert source.read() == node1() + node2()
    assert (source.up, source.errors()) == (True, {})


def test_urls_can_come_from_a_function_asked_at_every_read(
    http: FakeHttp, closed_port_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    registered: list[str] = []
    source = ScrapeGpuSource(lambda: registered, timeout=10)
    assert source.read() == []
    assert source.up is False, "no exporter answered"

    registered.append(serve_exporter(http, "/metrics", node2()))
    assert source.read() == node2()
    assert source.up is True

    with caplog.at_level(logging.WARNING, logger="herd_operator.exporters.sources"):
        registered.append(closed_port_url)
        source.read()
        source.read()
        registered.remove(closed_port_url)
        source.read()
        registered.append(closed_port_url)
        source.read()
    assert len(caplog.records) == 2, "an endpoint that left and came back is news again"


def test_bad_endpoints_are_skipped_counted_and_logged_once_per_change(
    http: FakeHttp, closed_port_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    good = serve_exporter(http, "/good/metrics", node2())
    http.routes["/html/metrics"] = Response(200, "<html>login first</html>\n", "text/html")
    http.routes["/broken/metrics"] = Response(500, "oops")
    urls = [closed_port_url + "/metrics", http.base + "/html/metrics", good]
    urls.append(http.base + "/broken/metrics")
    source = ScrapeGpuSource(urls, timeout=10)

    with caplog.at_level(logging.INFO, logger="herd_operator.exporters.sources"):
        first = source.read()
        second = source.read()
        http.routes["/broken/metrics"] = http.routes["/good/metrics"]
        third = source.read()

    assert first == second == third == node2()
    assert source.up is True
    assert source.errors() == {"unreachable": 3, "malformed": 3, "http_error": 2}
    logged = sorted((r.levelname, r.getMessage().split(": ")[0]) for r in caplog.records)
    assert logged == sorted([
        ("WARNING", f"GPU metrics from {closed_port_url}/metrics unavailable (unreachable)"),
        ("WARNING", f"GPU metrics from {http.base}/html/metrics unavailable (malformed)"),
        ("WARNING", f"GPU metrics from {http.base}/broken/metrics unavailable (http_error)"),
        ("INFO", f"GPU metrics from {http.base}/broken/metrics available again"),
    ])  # fmt: skip


def test_no_endpoint_answering_means_down_without_an_exception(closed_port_url: str) -> None:
    source = ScrapeGpuSource([closed_port_url + "/metrics"], timeout=10)

    assert source.read() == []
    assert (source.up, source.errors()) == (False, {"unreachable": 1})


def test_a_bad_label_makes_the_page_malformed(http: FakeHttp) -> None:
    http.routes["/kind"] = Response(
        200, 'herd_gpu_memory_used_bytes{host="n",gpu="0",uuid="u",kind="tpu"} 1\n'
    )
    http.routes["/gpu"] = Response(
        200, 'herd_gpu_memory_used_bytes{host="n",gpu="x",uuid="u",kind="nvml"} 1\n'
    )
    http.routes["/latin1"] = Response(200, b'herd_gpu_info{host="n\xe9"} 1\n')
    source = ScrapeGpuSource([http.base + path for path in ("/kind", "/gpu", "/latin1")])

    assert source.read() == []
    assert (source.up, source.errors()) == (False, {"malformed": 3})


def test_timestamped_samples_older_than_max_age_are_dropped(http: FakeHttp) -> None:
    now_ms = int(time.time() * 1000)
    old_ms = now_ms - 120_000
    labels = 'host="n",gpu="0",uuid="GPU-n0",kind="nvml",herd_job=""'
    http.routes["/federate"] = Response(
        200,
        f"herd_gpu_memory_used_bytes{{{labels}}} 5 {old_ms}\n"
        f"herd_gpu_memory_total_bytes{{{labels}}} 100 {now_ms}\n"
        f'herd_gpu_memory_total_bytes{{host="n",gpu="1",uuid="GPU-n1",kind="nvml"}} 100 {old_ms}\n'
        f"herd_gpu_power_watts{{{labels}}} NaN {now_ms}\n",
    )

    readings = ScrapeGpuSource([http.base + "/federate"], max_age=60).read()

    assert readings == [GpuReading("n", 0, "GPU-n0", "nvml", None, 100)]


def series(
    name: str, host: str, gpu: int | str, points: list[tuple[float, str]], **extra: str
) -> object:
    metric = {"__name__": name, "host": host, "gpu": str(gpu), "uuid": f"GPU-{host}-{gpu}"}
    metric |= {"kind": "nvml", "herd_job": "resnet", "instance": f"{host}:9400", **extra}
    return {"metric": metric, "values": [[ts, value] for ts, value in points]}


def matrix(*result: object) -> Response:
    body = {"status": "success", "data": {"resultType": "matrix", "result": list(result)}}
    return Response(200, json.dumps(body), "application/json")


def test_prometheus_joins_used_and_total_and_drops_stale_samples(http: FakeHttp) -> None:
    now = time.time()
    fresh, old = now - 2, now - 100
    http.routes["/prom/api/v1/query"] = matrix(
        series("herd_gpu_memory_used_bytes", "n2", 0, [(old, "1"), (fresh, "3000")]),
        series("herd_gpu_memory_total_bytes", "n1", 1, [(fresh, "8000")]),
        series("herd_gpu_memory_used_bytes", "n1", 1, [(old, "5000")]),
        series("herd_gpu_memory_total_bytes", "n2", 0, [(fresh, "8000")]),
        series("herd_gpu_utilization_ratio", "n2", 0, [(fresh, "0.5")]),
        series("herd_gpu_process_memory_used_bytes", "n2", 0, [(fresh, "2000")], pid="9"),
        series("herd_gpu_process_memory_used_bytes", "n2", 0, [(fresh, "1000")], pid="8"),
        series("herd_gpu_memory_total_bytes", "n3", 0, [(old, "8000")]),
        # The same GPU scraped twice (say, under two instance names): the newest sample wins.
        series("herd_gpu_power_watts", "n2", 0, [(fresh - 1, "90")], instance="a"),
        series("herd_gpu_power_watts", "n2", 0, [(fresh, "95.5")], instance="b"),
    )
    source = PrometheusGpuSource(http.base + "/prom/", max_age_seconds=30)

    readings = source.read()

    assert readings == [
        GpuReading("n1", 1, "GPU-n1-1", "nvml", None, 8000),
        GpuReading("n2", 0, "GPU-n2-0", "nvml", 3000, 8000, 0.5, 95.5,
                   (ProcessMemory(8, 1000), ProcessMemory(9, 2000))),
    ]  # fmt: skip
    assert (source.up, source.errors()) == (True, {})
    [query] = http.queries[-1]["query"]
    assert query == (
        '{__name__=~"herd_gpu_info|herd_gpu_memory_used_bytes|herd_gpu_memory_total_bytes'
        "|herd_gpu_utilization_ratio|herd_gpu_power_watts|herd_gpu_process_memory_used_bytes"
        '"}[30000ms]'
    )


def test_prometheus_error_status_gives_no_readings_and_is_counted(
    http: FakeHttp, caplog: pytest.LogCaptureFixture
) -> None:
    error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
    http.routes["/api/v1/query"] = Response(400, json.dumps(error), "application/json")
    source = PrometheusGpuSource(http.base)

    with caplog.at_level(logging.WARNING, logger="herd_operator.exporters.sources"):
        assert source.read() == []
        assert source.read() == []

    assert (source.up, source.errors()) == (False, {"query_error": 2})
    assert len(caplog.records) == 1
    with pytest.raises(PromQLError) as raised:
        promql(http.base, "up{", timeout=10)
    assert str(raised.value) == "query 'up{' failed: bad_data: parse error at char 3"


def test_prometheus_unreachable_gives_no_readings_and_no_exception(closed_port_url: str) -> None:
    source = PrometheusGpuSource(closed_port_url, timeout=10)

    assert source.read() == []
    assert (source.up, source.errors()) == (False, {"unreachable": 1})


def test_promql_returns_labels_timestamp_value_of_a_vector(http: FakeHttp) -> None:
    result = [
        {"metric": {"__name__": "up", "instance": "a"}, "value": [1700000000.5, "1"]},
        {"metric": {"__name__": "up", "instance": "b"}, "value": [1700000000.5, "NaN"]},
    ]
    body = {"status": "success", "data": {"resultType": "vector", "result": result}}
    http.routes["/api/v1/query"] = Response(200, json.dumps(body), "application/json")

    [a, b] = promql(http.base, "up", timeout=10)

    assert a == ({"__name__": "up", "instance": "a"}, 1700000000.5, 1.0)
    assert b[0] == {"__name__": "up", "instance": "b"}
    assert b[2] != b[2], "NaN comes back as a float NaN"
    assert http.queries[-1] == {"query": ["up"]}


@pytest.mark.parametrize(
    ("response", "message"),
    [
        (
            Response(200, json.dumps({"status": "success", "data": {"resultType": "scalar",
                                                                    "result": [1, "2"]}})),
            "query 'q' gave a scalar, not series",
        ),
        (Response(502, "<html>bad gateway</html>"), "query 'q': HTTP 502 Bad Gateway"),
        (Response(200, "{not json"), "query 'q': not a Prometheus API answer: JSONDecodeError("),
        (
            Response(200, json.dumps({"status": "success", "data": {}})),
            "query 'q': not a Prometheus API answer: KeyError('resultType')",
        ),
    ],
)  # fmt: skip
def test_promql_says_clearly_what_was_wrong(
    http: FakeHttp, response: Response, message: str
) -> None:
    http.routes["/api/v1/query"] = response

    with pytest.raises(PromQLError) as raised:
        promql(http.base, "q", timeout=10)

    assert str(raised.value).startswith(message)


def test_max_age_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_age_seconds must be positive, not 0"):
        PrometheusGpuSource("http://prometheus:9090", max_age_seconds=0)


def test_prometheus_series_with_a_bad_gpu_label_fail_the_read(http: FakeHttp) -> None:
    http.routes["/api/v1/query"] = matrix(
        series("herd_gpu_memory_used_bytes", "n1", "all", [(time.time(), "1")])
    )
    source = PrometheusGpuSource(http.base)

    assert source.read() == []
    assert (source.up, source.errors()) == (False, {"query_error": 1})
