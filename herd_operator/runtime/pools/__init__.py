"""Where the operator's GPUs come from, and how that pool changes while it runs.

A `PoolSource` gives the pool at start and may report changes later (a node lost, or
back); the operator hands each change to the allocator, which decides again for every
job. Sources, one module each:

- `hosts`: an explicit `--hosts` list (NVML GPUs when this host has any, else virtual);
- `slurm`: the nodes and GPUs of the Slurm allocation the operator runs in;
- `local`: this host's NVML GPUs, or `localhost` with virtual GPUs (CPU machines: CI,
  laptops), the fallback.

Without `--hosts`, the detectors in `POOL_SOURCES` are asked in order and the first
that finds its kind of pool wins; virtual GPUs are the fallback. A new source is one
module plus one line there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from herd_operator.exporters.nvml import check_no_unseen_gpus
from herd_operator.runtime.pools import hosts, local, slurm
from herd_operator.runtime.pools.base import (
    DEFAULT_VIRTUAL_GPUS,
    PoolListener,
    PoolOptions,
    PoolSource,
    StaticPool,
)

__all__ = [
    "DEFAULT_VIRTUAL_GPUS",
    "POOL_SOURCES",
    "PoolListener",
    "PoolOptions",
    "PoolSource",
    "StaticPool",
    "discover_pool",
]

log = logging.getLogger(__name__)

PoolDetector = Callable[[PoolOptions], PoolSource | None]

POOL_SOURCES: dict[str, PoolDetector] = {
    "slurm": slurm.detect_slurm,
    "nvml": local.detect_nvml,
}
"""Auto-detected sources, asked in this order when no `--hosts` is given."""


def discover_pool(
    hosts_text: str | None,
    virtual_gpus: int = DEFAULT_VIRTUAL_GPUS,
    options: PoolOptions | None = None,
) -> PoolSource:
    """The pool to run on: `--hosts` when given, else the first detector that finds one,
    else `localhost` with `virtual_gpus` virtual GPUs.

    Raises ValueError for a pool that cannot be used as asked: a bad `--hosts`, Slurm
    variables that do not parse, or virtual GPUs on a host whose NVIDIA devices NVML
    cannot read (unless `options.virtual_requested`).
    """
    options = options or PoolOptions(virtual_gpus)
    source = _find_source(hosts_text, options)
    if source.virtual and not options.virtual_requested:
        check_no_unseen_gpus()
    return source


def _find_source(hosts_text: str | None, options: PoolOptions) -> PoolSource:
    if hosts_text is not None:
        pool, virtual, description = hosts.host_list(hosts_text)
        return StaticPool(pool, virtual, description)
    for name, detect in POOL_SOURCES.items():
        source = detect(options)
        if source is not None:
            log.debug("pool source %s: %s", name, source.description)
            return source
    pool, description = local.virtual(options.virtual_gpus)
    return StaticPool(pool, True, description)
