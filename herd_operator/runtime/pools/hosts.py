"""An explicit host list: `--hosts nid001:4,nid002:4`."""

from __future__ import annotations

import re

from exporters.nvml import nvml_gpu_count
from specs.values import Pool

_HOST_ENTRY = re.compile(r"^(?P<host>[A-Za-z0-9][A-Za-z0-9._-]*):(?P<count>[0-9]+)$")


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


def host_list(text: str) -> tuple[Pool, bool, str]:
    """The pool of a `--hosts` list, whether its GPUs are virtual, and its description.

    The GPUs are taken as real when NVML sees GPUs on this host (the hosts of one
    allocation are alike), else as virtual (CPU workers).
    """
    pool = parse_hosts(text)
    virtual = nvml_gpu_count() == 0
    kind = "virtual" if virtual else "NVML"
    return pool, virtual, f"--hosts {text} ({kind} GPUs)"
