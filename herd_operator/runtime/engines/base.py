"""What an engine is: the part of running a job that depends on how the job trains.

An engine says how a job is started (its argument list and environment), which spec
changes its running processes cannot follow (they need a relaunch), how a new
placement reaches the running job, and what a resize does to the job's workers (whether
every one of them restarts, which the resize's event and `describe` say). Process
supervision, the allocator and the reconciler are the same for every engine.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from herd_operator.layout import StateLayout
from herd_operator.specs import HerdJob, HerdJobSpec
from herd_operator.specs.models import OPERATOR_ONLY_TRAINING
from herd_operator.specs.values import Placement, ResizeMode, Slot


def training_at_launch(spec: HerdJobSpec) -> dict[str, object] | None:
    """The training options the workers read from their environment when they start, so
    an engine's launch fixes them: not `epochs` nor `resumable`, which only the operator
    reads (changing them relaunches nothing)."""
    if spec.training is None or not spec.training.tells_workers():
        return None
    return spec.training.model_dump(by_alias=True, exclude=set(OPERATOR_ONLY_TRAINING))


def launch_mismatch(
    launched: HerdJobSpec,
    wanted: HerdJobSpec,
    fixed_at_launch: Callable[[HerdJobSpec], object],
    fixed_changed: str,
    max_flag: str,
) -> str:
    """Why a launch of `launched` cannot follow `wanted` ('' if it can), by the engine's
    `fixed_at_launch`: what it fixed changed (`fixed_changed`), or `gpus.max` raised above
    the launched one (its `max_flag`); lowering max is applied live through the grant."""
    if launched is wanted:  # the usual resync: the spec has not changed since the launch
        return ""
    if fixed_at_launch(launched) != fixed_at_launch(wanted):
        return fixed_changed
    if wanted.gpus.max > launched.gpus.max:
        return f"gpus.max raised above the launched {max_flag} {launched.gpus.max}"
    return ""


@dataclass(frozen=True)
class EngineContext:
    """What the operator gives each engine it makes (one engine per kind and operator)."""

    layout: StateLayout
    """The state dir and the private runtime dir, where an engine may keep per-job files."""
    hosts: tuple[str, ...]
    """The pool's hosts, in pool order."""
    python: str = sys.executable
    """The Python of the operator's environment, where the job-side agent is installed."""
    network_interface: str | None = None
    """The interface between the pool's hosts (`hsn0` on Perlmutter); None for a pool on
    this host alone, or where it is not known."""


class Engine(Protocol):
    resize_mode: ResizeMode
    """What a resize of a running job does to its workers: `LIVE` (the staying workers go
    on) or `RESTART` (every worker starts again from the job's snapshot). The reconciler
    reads it through its launcher port (`JobLauncher.resize_mode`) to say what a finished
    resize cost; the time itself is measured, from the grant change to the new world size."""

    def process_name(self, job: HerdJob) -> str:
        """What the process started for `job` is called in events, `describe` and the
        operator's log: "horovodrun exited with status 1", "hvd-driver pid 42 ..."."""
        ...

    def launch_argv(self, job: HerdJob, np: int) -> list[str]:
        """The argument list (never a shell string) that starts `job` on `np` workers.

        It may prepare what the launch needs first (Horovod: the discovery script).
        """
        ...

    def environment(self, job: HerdJob, env: Mapping[str, str]) -> dict[str, str]:
        """Variables the engine sets for the job's processes, on top of `env` (the operator's
        environment, the spec's `env` and the HERD_* variables the agent reads).

        The engine's process gets them but not the spec's `env`, which reaches the
        workers through the shim (HERD_ENV_FILE), off every command line; a variable
        returned here that the spec also sets goes with the spec's."""
        ...

    def relaunch_reason(self, launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
        """Why processes started for `launched` cannot follow `wanted` ('' if they can)."""
        ...

    def present(self, job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
        """The placement as the job's workers name it: each host name a worker binds with ->
        the slots under that name, in local-rank order."""
        ...

    def publish(self, job: str, placement: Placement) -> None:
        """Make the job's new placement reach it (also called once before it starts)."""
        ...

    def withdraw(self, job: str) -> None:
        """The job holds nothing any more: remove what publishing left behind."""
        ...


EngineFactory = Callable[[EngineContext], Engine]


class UnknownEngineError(LookupError):
    """A spec names an engine kind this operator does not have."""

    field = "spec.engine.kind"

    def __init__(self, kind: str, known: list[str]) -> None:
        super().__init__(f"unknown engine kind {kind!r} (known: {', '.join(known)})")
        self.kind = kind

    def __str__(self) -> str:
        return str(self.args[0])
