"""torch.distributed.elastic (`torchrun`): one agent per granted GPU at the job's own rendezvous.

The job is one process, our torchrun driver (`torchrun_driver`): it hosts the job's c10d
store (the rendezvous), on a port the kernel picks when it binds it and that is freed
when the driver exits, and keeps one `torchrun` agent running per GPU of the job's grant,
each a node of `--nnodes=gpus.min:gpus.max` with `--nproc-per-node=1`. A placement reaches
it as a grant file (one `HOST GPU` line per slot) that it `stat`s, as the Horovod driver
does; the file stays the only channel from the operator, so a driver outlives the
operator that launched it and is adopted by the next.

Why an agent per GPU and not per host: a grant change then is exactly a change of
torchrun's membership, which torchrun handles itself. A grow starts agents; they wait at
the rendezvous while the job trains, and the running agents see them waiting and restart
their workers at the new world size (not counted as a failure), which resume from the
job's own snapshot. A shrink stops agents (SIGTERM: an agent stopped so leaves the
rendezvous open); the survivors' workers lose a peer, their agents restart them (one of
`maxRestarts`) once the stopped agents' heartbeats lapse. No agent is ever restarted to
change its size, so a resize costs the worker restart alone, as a bare `torchrun` job
resized by starting and stopping agents by hand; and the spec's [min, max] is torchrun's
own `--nnodes`. The cost is one agent process per GPU (docs/benchmarks.md).

The store lives in the driver, not in an agent (`is_host=false` for all of them): the
agent that would host it is the one a shrink may stop.

Each agent runs its worker through the shim (`--no-python python -m
herd_operator.agent.shim -- COMMAND`), which binds it to the allocator's GPU as it binds a
Horovod worker: each GPU is shown to the workers under a name of its own (`slot_name`),
local rank 0, which the driver gives its agent (`HERD_WORKER_HOST`). So the script is a
plain torchrun script: it reads RANK, LOCAL_RANK (0), WORLD_SIZE, and its one visible GPU
is device 0.

Across hosts: the driver runs where the operator does and starts the agents of other
hosts' slots over ssh, as the Horovod driver starts its workers there (`torchrun_driver`);
the store listens on the operator's host, at its address on `--network-interface`, and
the workers' Gloo uses that interface (`GLOO_SOCKET_IFNAME`).

Neither this module nor the engine's process imports Horovod; the driver imports torch.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from herd_operator.layout import StateLayout, write_atomically
from herd_operator.runtime.engines.base import (
    EngineContext,
    launch_mismatch,
    training_at_launch,
)
from herd_operator.runtime.engines.horovod import LOCAL_HOSTS
from herd_operator.runtime.engines.torchrun_options import TorchrunOptions, torchrun_options
from herd_operator.specs import HerdJob, HerdJobSpec
from herd_operator.specs.values import Placement, ResizeMode, Slot

DRIVER_MODULE = "herd_operator.runtime.engines.torchrun_driver"
"""Our driver, run as a module (not imported here: it imports torch)."""
DRIVER_NAME = "torchrun-driver"
"""What events and logs call a torchrun job's process."""
AGENT_MODULE = "torch.distributed.run"
"""torchrun itself, run by the job's Python (`torchrun` is its console script)."""
SHIM_MODULE = "herd_operator.agent.shim"
KEEP_ALIVE_ATTEMPTS = 3
"""Heartbeats an agent may miss before the rendezvous drops it (c10d's default)."""
LOOPBACK = "127.0.0.1"
FIXED_AT_LAUNCH_CHANGED = "command, env, training, workingDir, gpus.min or torchrun options changed"


def slot_name(host: str, gpu: int) -> str:
    """The name GPU `gpu` of `host` is shown under to its worker (one worker per name)."""
    return f"{host}:gpu{gpu}"


def slot_host(name: str) -> str | None:
    """The host of a name `slot_name` made (`h2:gpu1` -> `h2`); None for another name."""
    host, sep, gpu = name.rpartition(":gpu")
    return host if sep and host and gpu.isdigit() else None


def present(placement: Placement) -> dict[str, tuple[Slot, ...]]:
    """Each GPU of the placement under its own name: its agent's one worker binds with
    (that name, local rank 0)."""
    return {slot_name(host, gpu): ((host, gpu),) for host, gpu in placement.slots()}


def grant_text(placement: Placement) -> str:
    """The grant file the driver reads: one `HOST GPU` line per slot, in placement order."""
    return "".join(f"{host} {gpu}\n" for host, gpu in placement.slots())


class GrantFileError(ValueError):
    """A line of the grant file is not `HOST GPU`."""


def parse_grant(text: str, source: Path | str = "grant") -> tuple[Slot, ...]:
    """The slots of a grant file, in its order; blank lines are skipped."""
    slots: list[Slot] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, _, gpu = line.partition(" ")
        if not host or not gpu.strip().isdigit():
            raise GrantFileError(f"{source}:{number}: {line!r} is not 'HOST GPU'")
        slots.append((host, int(gpu)))
    return tuple(slots)


def store_host(hosts: Sequence[str], network_interface: str | None) -> str:
    """Where the job's store listens and its agents reach it: loopback for a pool of this
    host alone, else this host's address on the pool's interface (its name without one)."""
    if not hosts or all(host in LOCAL_HOSTS for host in hosts):
        return LOOPBACK
    if network_interface:
        for address in psutil.net_if_addrs().get(network_interface, []):
            if address.family == socket.AF_INET:
                return str(address.address)
    return socket.gethostname()


def agent_args(job: str, spec: HerdJobSpec, options: TorchrunOptions, python: str) -> list[str]:
    """torchrun's arguments for each agent of the job, all but the two the driver adds per
    agent (`--rdzv-endpoint`, known once its store listens, and `--local-addr`), then the
    worker command through the shim."""
    conf = ",".join(
        [
            "is_host=false",  # the driver hosts the store
            f"join_timeout={options.join_timeout_seconds}",
            f"last_call_timeout={options.last_call_seconds}",
            f"keep_alive_interval={options.keep_alive_seconds}",
            f"keep_alive_max_attempt={KEEP_ALIVE_ATTEMPTS}",
        ]
    )
    return [
        f"--nnodes={spec.gpus.min}:{spec.gpus.max}",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-id={job}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={options.max_restarts}",
        f"--monitor-interval={options.monitor_interval_seconds}",
        *options.extra_args,
        "--no-python",
        python,
        "-m",
        SHIM_MODULE,
        "--",
        *spec.command,
    ]


def driver_argv(job: str, spec: HerdJobSpec, grant_file: Path, python: str, host: str) -> list[str]:
    """The argument list that starts the job's driver: its own options, then `--` and the
    agents' torchrun arguments (`agent_args`)."""
    options = torchrun_options(spec.engine.options)
    ours = ["--grant-file", str(grant_file), "--store-host", host]
    return [python, "-m", DRIVER_MODULE, *ours, "--", *agent_args(job, spec, options, python)]


def fixed_at_launch(spec: HerdJobSpec) -> dict[str, object]:
    """What the agents fix when they start: a change here needs a relaunch. `gpus.max`
    lowered is applied through the grant; raised above the launched one, it is not
    (the agents' `--nnodes`)."""
    return {
        "command": spec.command,
        "workingDir": spec.working_dir,
        "env": spec.env,
        "training": training_at_launch(spec),
        "min": spec.gpus.min,
        "torchrun": torchrun_options(spec.engine.options),
    }


def relaunch_reason(launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
    """Why a driver started for `launched` cannot follow `wanted` ('' if it can)."""
    return launch_mismatch(
        launched, wanted, fixed_at_launch, FIXED_AT_LAUNCH_CHANGED, "--nnodes max"
    )


def gloo_interface(hosts: Sequence[str], network_interface: str | None) -> dict[str, str]:
    """Gloo's interface for the workers (`GLOO_SOCKET_IFNAME`), as the Horovod engine gives
    Horovod's Gloo `--network-interface`: the operator's interface for a pool of several
    hosts; none on a pool of this host alone (Gloo then takes the host name's address)."""
    if network_interface and not all(host in LOCAL_HOSTS for host in hosts):
        return {"GLOO_SOCKET_IFNAME": network_interface}
    return {}


class TorchrunEngine:
    """Runs a job as one torchrun agent per granted GPU under our driver."""

    resize_mode = ResizeMode.RESTART
    """A new membership: every agent restarts its worker at the new world size."""

    def __init__(self, context: EngineContext) -> None:
        self.layout: StateLayout = context.layout
        self.python = context.python
        self.store_host = store_host(context.hosts, context.network_interface)
        self.gloo_interface = gloo_interface(context.hosts, context.network_interface)

    def process_name(self, job: HerdJob) -> str:
        return DRIVER_NAME

    def launch_argv(self, job: HerdJob, np: int) -> list[str]:
        # `np` is the grant's size, which the driver reads from the grant file itself.
        grant_file = self.layout.grant_file(job.name).resolve()
        return driver_argv(job.name, job.spec, grant_file, self.python, self.store_host)

    def environment(self, job: HerdJob, env: Mapping[str, str]) -> dict[str, str]:
        return {
            "PYTHONUNBUFFERED": "1",
            # The job's `python` is this environment's, where torch and the shim are.
            "PATH": os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")]),
            **self.gloo_interface,
        }

    def relaunch_reason(self, launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
        return relaunch_reason(launched, wanted)

    def present(self, job: str, placement: Placement) -> dict[str, tuple[Slot, ...]]:
        return present(placement)

    def publish(self, job: str, placement: Placement) -> None:
        # Atomic, not durable: after a crash the operator decides and publishes again.
        write_atomically(self.layout.grant_file(job), grant_text(placement), durable=False)

    def withdraw(self, job: str) -> None:
        self.layout.grant_file(job).unlink(missing_ok=True)
