"""An explicit host list: `--hosts nid001:4,nid002:4` or `--hosts 'nid[001-004]:a100:4'`."""

from __future__ import annotations

import re

from herd_operator.exporters.nvml import nvml_gpu_count
from herd_operator.runtime.pools.slurm import HostListError, expand_hostlist, split_hostlist_entries
from herd_operator.specs.values import Pool

# HOSTS:GPUS or HOSTS:TYPE:GPUS, where HOSTS is a name or a Slurm host list (nid[001-004]).
_HOST_ENTRY = re.compile(
    r"^(?P<hosts>[A-Za-z0-9][A-Za-z0-9._\[\],-]*?)(?::(?P<type>[A-Za-z][A-Za-z0-9_.-]*))?"
    r":(?P<count>[0-9]+)$"
)
_EXAMPLES = "for example localhost:4, nid001:4,nid002:4, 'nid[001-004]:4' or nodeA:a100:4"


def parse_hosts(text: str) -> Pool:
    """Parse `HOSTS:GPUS[,HOSTS:GPUS...]`; HOSTS may be a Slurm host list, and the GPUs
    may name their type as Slurm's `--gpus-per-node` does (`a100:4`)."""
    counts: dict[str, int] = {}
    try:
        entries = split_hostlist_entries(text)
    except HostListError as err:
        raise ValueError(f"--hosts: {err}") from None
    for raw in entries:
        entry = raw.strip()
        match = _HOST_ENTRY.match(entry)
        if not match:
            raise ValueError(f"--hosts: {entry!r} is not HOSTS:GPUS ({_EXAMPLES})")
        try:
            names = expand_hostlist(match["hosts"])
        except HostListError as err:
            raise ValueError(f"--hosts: {err}") from None
        count = int(match["count"])
        for host in names:
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
