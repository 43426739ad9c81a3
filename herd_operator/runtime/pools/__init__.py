"""Discovers the pool of GPUs the operator owns.

Sources, in order: an explicit `--hosts` list; the GPUs that NVML sees on this
host; else `localhost` with virtual GPUs (CPU machines: CI, laptops). A Slurm
allocation is a later source behind the same `PoolSource` result.
"""

from __future__ import annotations

import logging
import re
import socket
from dataclasses import dataclass

from exporters.nvml import nvml_gpu_count
from specs.values import Pool

log = logging.getLogger(__name__)

DEFAULT_VIRTUAL_GPUS = 4
_HOST_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9._-]*):(?P<count>[0-9]+)$")


@dataclass(frozen=True)
class PoolSource:
    pool: Pool
    virtual: bool
    """True when the GPUs are virtual (CPU workers); False for real devices."""
    description: str


def parse_hosts(text: str) -> Pool:
    """Parse `host:gpus[,host:gpus...]`, e.g. `localhost:4` or `nid001:4,nid002:4`."""
    counts: dict[str, int] = {}
    for raw in text.split(","):
        entry = raw.strip()
        match = _HOST_ENTRY.match(entry)
        if not match:
            raise ValueError(
                f"--hosts: {entry!r} is not HOST:GPUS"
                " (for example localhost:4 or nid001:4,nid002:4)"
            )
        host, count = match["host"], int(match["count"])
        if count < 1:
            raise ValueError(f"--hosts: {host} has {count} GPUs; each host needs at least 1")
        if host in counts:
            raise ValueError(f"--hosts: {host} is listed twice")
        counts[host] = count
    return Pool.from_counts(counts)


def discover_pool(hosts: str | None, virtual_gpus: int = DEFAULT_VIRTUAL_GPUS) -> PoolSource:
    if hosts is not None:
        pool = parse_hosts(hosts)
        virtual = nvml_gpu_count() == 0
        kind = "virtual" if virtual else "NVML"
        return PoolSource(pool, virtual, f"--hosts {hosts} ({kind} GPUs)")
    count = nvml_gpu_count()
    if count:
        host = socket.gethostname()
        return PoolSource(Pool.from_counts({host: count}), False, f"{host}: {count} GPUs from NVML")
    return PoolSource(
        Pool.from_counts({"localhost": virtual_gpus}),
        True,
        f"localhost: {virtual_gpus} virtual GPUs (no NVML GPUs found)",
    )
