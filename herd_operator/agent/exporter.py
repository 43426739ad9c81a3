"""`herd-operator exporter`: one node's GPU metrics, for Prometheus and the operator.

The thing `srun --overlap` starts on every node of the allocation. It serves
this node's GPUs (NVML, or virtual GPUs on CPU nodes) at `/metrics`, labelled
with the job that holds each GPU (asked of the allocator), and registers itself
with the operator, which adds it to Prometheus' file_sd targets and scrapes it
for the policies' memory signal. Without a reachable operator it still serves,
with empty job labels. With `--dcgm-job-mapping-dir` it also keeps dcgm-exporter's HPC
job mapping files for this node's GPUs (exporters/dcgm.py).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from herd_operator.auth import TokenFileError, agent_identity, read_token_file
from herd_operator.exporters.collector import GpuCollector
from herd_operator.exporters.dcgm import JobMappingLoop, JobMappingWriter
from herd_operator.exporters.gpu import GpuSource, VirtualGpuSource
from herd_operator.exporters.http import serve_metrics
from herd_operator.exporters.nvml import NvmlGpuSource, check_no_unseen_gpus, nvml_gpu_count
from herd_operator.layout import StateLayout
from herd_operator.rpc import RpcClient, parse_address
from herd_operator.specs.values import Placement

log = logging.getLogger(__name__)

REGISTER_EVERY_SECONDS = 5.0
"""The registration is also the node's heartbeat, and says this interval: a node whose
agent missed two calls is suspect (no GPU of it granted) until it answers a probe or calls
again, and one silent for the operator's --node-timeout (30 s) is lost."""
OWNERS_MAX_AGE_SECONDS = 1.0


class AllocatorView:
    """What the allocator says about this host's GPUs, refreshed at most once a second."""

    def __init__(self, layout: StateLayout, host: str, key: bytes | None = None) -> None:
        self.layout = layout
        self.host = host
        self._key = key
        """This host's agent key when given on stdin; None: read from the state dir."""
        self._said_no_key = False
        self._lock = threading.Lock()
        self._client: RpcClient | None = None
        self._fetched = 0.0
        self._owners: dict[tuple[str, int], str] = {}
        self._pids: dict[int, list[int]] = {}
        self.reachable = False
        """Whether the allocator answered the last time it was asked."""

    def _call(self, op: str, **args: Any) -> dict[str, Any] | None:
        try:
            if self._client is None:
                endpoint = json.loads(self.layout.endpoint_file.read_text())
                # This host's agent key: it may label GPUs and register this host, nothing more.
                token = self._key or self._read_key()
                if token is None:
                    return None
                self._client = RpcClient(
                    parse_address(endpoint["address"]),
                    token,
                    identity=agent_identity(self.host),
                    client=f"exporter:{self.host}",
                )
            return self._client.call(op, **args)
        except Exception as err:  # no operator (yet, or any more): serve without job labels
            log.debug("allocator unavailable: %s", err)
            if self._client is not None:
                self._client.close()
            self._client = None
            return None

    def _read_key(self) -> bytes | None:
        """The key the operator wrote for this host; None (said once) while there is none."""
        path = self.layout.agent_token_file(self.host)
        try:
            key = read_token_file(path)
        except TokenFileError as err:
            if not self._said_no_key:
                log.warning(
                    "no key for agent:%s (%s): the operator writes one for each host of its"
                    " pool (pass --host with this node's name in the pool, or give a key on"
                    " stdin with --key-stdin); serving without job labels until there is one",
                    self.host, err,
                )  # fmt: skip
                self._said_no_key = True
            return None
        self._said_no_key = False
        return key

    def _refresh(self) -> None:
        with self._lock:
            if time.monotonic() - self._fetched < OWNERS_MAX_AGE_SECONDS:
                return
            self._fetched = time.monotonic()
            reply = self._call("placements")
            self.reachable = reply is not None
            if reply is None:
                self._owners, self._pids = {}, {}
                return
            owners = {}
            for job, data in reply["placements"].items():
                for slot in Placement.from_json(data).slots():
                    owners[slot] = job
            pids: dict[int, list[int]] = {}
            for _job, host, _rank, gpu, pid in reply["bindings"]:
                if host == self.host and isinstance(pid, int):
                    pids.setdefault(gpu, []).append(pid)
            self._owners, self._pids = owners, pids

    def owners(self) -> dict[tuple[str, int], str]:
        self._refresh()
        return dict(self._owners)

    def gpu_owners(self) -> dict[int, str] | None:
        """The job holding each GPU index of this host (for dcgm-exporter's job mapping);
        None while the allocator cannot be asked."""
        owners = self.owners()
        if not self.reachable:
            return None
        return {index: job for (host, index), job in owners.items() if host == self.host}

    def bound_pids(self) -> dict[int, list[int]]:
        self._refresh()
        return {gpu: list(pids) for gpu, pids in self._pids.items()}

    def register(self, port: int) -> bool:
        with self._lock:
            return (
                self._call(
                    "register_exporter", host=self.host, port=port, every=REGISTER_EVERY_SECONDS
                )
                is not None
            )

    def unregister(self, port: int) -> bool:
        """Leave the operator's scrape targets now (they would expire otherwise)."""
        with self._lock:
            return self._call("unregister_exporter", host=self.host, port=port) is not None


def run_exporter(
    state_dir: Path,
    host: str | None,
    listen: str,
    port: int,
    virtual_gpus: int,
    virtual_gpu_memory: int,
    stop: threading.Event,
    *,
    virtual_requested: bool = False,
    per_process: bool = False,
    dcgm_job_mapping_dir: Path | None = None,
    key: bytes | None = None,
) -> int:
    host = host or socket.gethostname()
    try:
        agent_identity(host)
    except ValueError:
        log.error("%r is not a host name the operator accepts; pass --host", host)
        return 2
    view = AllocatorView(StateLayout(state_dir), host, key)
    source: GpuSource
    if nvml_gpu_count():
        source = NvmlGpuSource(host)
        kind = "NVML"
    else:
        if not virtual_requested:
            try:
                check_no_unseen_gpus()
            except ValueError as err:
                log.error("%s", err)
                return 2
        source = VirtualGpuSource(host, virtual_gpus, virtual_gpu_memory, view.bound_pids)
        kind = f"{virtual_gpus} virtual"
    registry = CollectorRegistry()
    registry.register(GpuCollector(source, view.owners, per_process=per_process))
    server = serve_metrics(registry, listen, port)
    bound = server.server_port
    log.info("exporter for %s (%s GPUs) on http://%s:%d/metrics", host, kind, listen, bound)
    mapping: JobMappingLoop | None = None
    if dcgm_job_mapping_dir is not None:
        mapping = JobMappingLoop(JobMappingWriter(dcgm_job_mapping_dir, view.gpu_owners))
        mapping.start()
        log.info("writing dcgm-exporter's job mapping files in %s", dcgm_job_mapping_dir)
    registered = False
    try:
        while not stop.is_set():
            ok = view.register(bound)
            if ok and not registered:
                log.info("registered with the operator")
            registered = ok
            stop.wait(REGISTER_EVERY_SECONDS if ok else 2.0)
    finally:
        if registered and view.unregister(bound):
            log.info("unregistered from the operator")
        if mapping is not None:
            mapping.stop()
        server.shutdown()
        server.server_close()
    return 0
