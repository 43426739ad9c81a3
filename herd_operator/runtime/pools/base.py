"""The pool source protocol, and the simplest source: a pool that never changes."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from herd_operator.specs.values import Pool

DEFAULT_VIRTUAL_GPUS = 4

PoolListener = Callable[[Pool], None]


class PoolSource(Protocol):
    @property
    def pool(self) -> Pool:
        """The pool now."""
        ...

    @property
    def virtual(self) -> bool:
        """True when the GPUs are virtual (CPU workers); False for real devices."""
        ...

    @property
    def description(self) -> str:
        """One line for logs and the endpoint file, e.g. `nid001: 4 GPUs from NVML`."""
        ...

    def start(self, on_change: PoolListener) -> None:
        """Begin watching; call `on_change(pool)` from any thread when the pool changes."""
        ...

    def stop(self) -> None: ...


@runtime_checkable
class ListsHosts(Protocol):
    """A source that can take a node out of its pool (Slurm) says whether it still lists
    one; a node it no longer lists is never back, whatever its agent says."""

    def still_lists(self, host: str) -> bool:
        """Whether `host` is in the pool, asked of the source's authority now (may block a
        few seconds)."""
        ...


@dataclass(frozen=True)
class PoolOptions:
    """What the command line says about the pool."""

    virtual_gpus: int = DEFAULT_VIRTUAL_GPUS
    virtual_requested: bool = False
    """`--virtual-gpus` was given: virtual GPUs are wanted even on a host with NVIDIA devices."""
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    """Where a source finds its allocation (Slurm's SLURM_* variables)."""


@dataclass(frozen=True)
class StaticPool:
    """A pool that never changes while the operator runs."""

    pool: Pool
    virtual: bool
    description: str

    def start(self, on_change: PoolListener) -> None:
        pass

    def stop(self) -> None:
        pass
