"""This host alone: its NVML GPUs, or virtual GPUs on a machine without any."""

from __future__ import annotations

import socket

from herd_operator.exporters.nvml import nvml_gpu_count
from herd_operator.runtime.pools.base import PoolOptions, StaticPool
from herd_operator.specs.values import Pool


def detect_nvml(options: PoolOptions) -> StaticPool | None:
    """This host's GPUs when NVML sees any (None without the library, a driver or devices)."""
    count = nvml_gpu_count()
    if not count:
        return None
    host = socket.gethostname()
    return StaticPool(Pool.from_counts({host: count}), False, f"{host}: {count} GPUs from NVML")


def virtual(count: int) -> tuple[Pool, str]:
    """`localhost` with `count` virtual GPUs, and its description."""
    return (
        Pool.from_counts({"localhost": count}),
        f"localhost: {count} virtual GPUs (no NVML GPUs found)",
    )
