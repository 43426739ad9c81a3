"""The torchrun engine's options (`spec.engine.options` of a `kind: torchrun` job), and
their check where specs are loaded.

Apart from the engine because the spec directory and `validate` check a spec's options
without an engine (no operator, no state dir), and because `specs` keeps only the
built-in horovod engine's options: an engine's options are its own (`engines.__init__`'s
`OPTION_CHECKS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, field_validator

from herd_operator.specs.api_model import ApiModel
from herd_operator.specs.loading import error_message, format_location

OPTIONS_FIELD = "spec.engine.options"
MAX_TIMEOUT_SECONDS = 7 * 24 * 3600
MAX_RESTARTS = 1_000_000

MANAGED_ARGS = frozenset(
    {
        "--nnodes", "--nproc-per-node", "--nproc_per_node", "--rdzv-backend", "--rdzv_backend",
        "--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
        "--rdzv_conf", "--standalone", "--max-restarts", "--max_restarts", "--monitor-interval",
        "--monitor_interval", "--no-python", "--no_python", "--module", "-m", "--node-rank",
        "--node_rank", "--master-addr", "--master_addr", "--master-port", "--master_port",
        "--local-addr", "--local_addr",
    }
)  # fmt: skip
"""`torchrun` arguments the engine sets itself: one agent per GPU at the job's own
rendezvous, the worker command run through the shim."""


class TorchrunOptions(ApiModel):
    """Options of the torchrun engine: each granted GPU is one `torchrun` agent (a node of
    `--nnodes=gpus.min:gpus.max` with `--nproc-per-node=1`), and the agents of a job meet at
    the job's own c10d rendezvous."""

    max_restarts: int = Field(default=100, strict=True, ge=0, le=MAX_RESTARTS)
    """How many times each agent may restart its worker after a failure (`torchrun
    --max-restarts`). A shrink costs each surviving agent one (its worker loses a peer in a
    collective); a grow costs none (torchrun restarts for new nodes without counting)."""
    monitor_interval_seconds: float = Field(default=0.5, strict=True, gt=0, le=60)
    """How often each agent looks at its worker and at the rendezvous for new nodes
    (`torchrun --monitor-interval`): how late an agent notices a grow or a failed worker."""
    last_call_seconds: int = Field(default=3, strict=True, ge=0, le=MAX_TIMEOUT_SECONDS)
    """How long a rendezvous that has `gpus.min` agents, but fewer than `gpus.max`, waits for
    more before it closes (c10d's `last_call_timeout`; torchrun's own default is 30). Agents
    look at the rendezvous once a second: below 2 an agent that restarts late may miss the
    round and cost the job one more restart."""
    keep_alive_seconds: int = Field(default=2, strict=True, ge=1, le=3600)
    """Each agent's heartbeat period (c10d's `keep_alive_interval`). An agent silent for
    three of them is dropped from the rendezvous: how long a stopped agent holds up the
    round after a shrink."""
    join_timeout_seconds: int = Field(default=600, strict=True, gt=0, le=MAX_TIMEOUT_SECONDS)
    """How long an agent waits for its rendezvous to complete before it fails (c10d's
    `join_timeout`)."""
    extra_args: list[str] = Field(default_factory=list)
    """More `torchrun` arguments (`--log-dir`, `--local-ranks-filter`...), placed before the
    command; not those the engine sets (`--nnodes`, `--nproc-per-node`, `--rdzv-*`,
    `--max-restarts`, `--monitor-interval`, `--no-python`...)."""

    @field_validator("extra_args")
    @classmethod
    def _not_the_engines_own(cls, extra_args: list[str]) -> list[str]:
        for arg in extra_args:
            if "\x00" in arg:
                raise ValueError("an argument must not contain a NUL byte (\\0)")
            if arg.partition("=")[0] in MANAGED_ARGS:
                raise ValueError(
                    f"{arg!r} is set by the torchrun engine (one agent per GPU at the job's "
                    "own rendezvous); use the engine's options instead"
                )
        return extra_args


def torchrun_options(options: Mapping[str, Any]) -> TorchrunOptions:
    """A torchrun job's `engine.options`, parsed (checked when the spec was loaded)."""
    return TorchrunOptions.model_validate(dict(options))


def option_problems(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(field, what is wrong) for each problem of a torchrun job's `engine.options`, the
    field as the spec's path (`spec.engine.options.maxRestarts`); none: they are good."""
    try:
        TorchrunOptions.model_validate(dict(options))
    except ValidationError as err:
        problems = []
        for error in err.errors():
            # The options are a mapping: an error's place starts with an option's name.
            where = format_location(tuple(error["loc"]))
            field = f"{OPTIONS_FIELD}.{where}" if error["loc"] else OPTIONS_FIELD
            problems.append((field, error_message(error, TorchrunOptions)))
        return problems
    return []
