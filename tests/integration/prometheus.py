"""A real Prometheus server (Debian's `prometheus`) on loopback, for tests."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrometheusServer:
    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.process = process
        self.log = log

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query through the HTTP API; the vector result."""
        address = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(address, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=10) as response:
            active: list[dict[str, Any]] = json.load(response)["data"]["activeTargets"]
            return active


@contextmanager
def prometheus(
    workdir: Path, targets_file: Path, scrape_interval: str = "1s"
) -> Iterator[PrometheusServer]:
    """Start Prometheus with file_sd targets; stop it (and check it ran) at the end."""
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed: scripts/bootstrap.sh installs Debian's package"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {scrape_interval}\n  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n  - job_name: herd\n    file_sd_configs:\n"
        f"      - files: [{json.dumps(str(targets_file))}]\n        refresh_interval: 1s\n"
    )
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as log_handle:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log_handle,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert process.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
            assert time.monotonic() < deadline, f"prometheus not ready: {log.read_text()[-2000:]}"
            time.sleep(0.2)
        yield PrometheusServer(url, process, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
