"""Where the operator's GPUs come from, and how that pool changes while it runs.

A `PoolSource` gives the pool at start and may report changes later (a node lost, or
back); the operator hands each change to the allocator, which decides again for every
job. Sources, one module each:

- `hosts`: an explicit `--hosts` list (NVML GPUs when this host has any, else virtual);
- `local`: this host's NVML GPUs, or `localhost` with virtual GPUs (CPU machines: CI,
  laptops), the fallback.

Without `--hosts`, the detectors in `POOL_SOURCES` are asked in order and the first
that finds its kind of pool wins; virtual GPUs are the fallback. A new source is one
module plus one line there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from herd_operator.runtime.pools import hosts, local
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
    "nvml": local.detect_nvml,
}
"""Auto-detected sources, asked in this order when no `--hosts` is given."""


def discover_pool(hosts_text: str | None, virtual_gpus: int = DEFAULT_VIRTUAL_GPUS) -> PoolSource:
    """The pool to run on: `--hosts` when given, else the first detector that finds one,
    else `localhost` with `virtual_gpus` virtual GPUs."""
    if hosts_text is not None:
        pool, virtual, description = hosts.host_list(hosts_text)
        return StaticPool(pool, virtual, description)
    options = PoolOptions(virtual_gpus)
    for name, detect in POOL_SOURCES.items():
        source = detect(options)
        if source is not None:
            log.debug("pool source %s: %s", name, source.description)
            return source
    pool, description = local.virtual(virtual_gpus)
    return StaticPool(pool, True, description)
