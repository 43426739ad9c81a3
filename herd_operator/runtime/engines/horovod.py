"""Elastic Horovod: `horovodrun` polls a discovery script that prints the job's grant.

The job is one `horovodrun` process that starts the workers (each through the shim,
which binds it to the allocator's GPU). A placement reaches it as a `host:slots` grant
file that the job's discovery script `cat`s; Horovod runs that script every second and
resizes the job when the answer changes.

Horovod blacklists a whole host when one of its workers fails, and a job whose hosts
are all blacklisted stops. So the slots of one machine are presented under several of
its names (`localhost`, `127.0.0.1`, its host name, its interface addresses: Horovod
starts a worker without ssh when the name resolves to a local address): a failed worker
costs the job only the slots shown under its name, and `--blacklist-cooldown-range`
lets that name come back. The allocator keeps its pool per real host; `present` maps a
placement to the names, and the shim's bind maps (name, local rank) back to a GPU
through the same function.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import shutil
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import psutil

from herd_operator.layout import StateLayout, write_atomically
from herd_operator.runtime.engines.base import (
    EngineContext,
    launch_mismatch,
    training_at_launch,
)
from herd_operator.specs import HerdJob, HerdJobSpec
from herd_operator.specs.values import Placement, ResizeMode, Slot

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
BLACKLIST_COOLDOWN_SECONDS = (10, 30)
"""Horovod's cool-down range for a blacklisted host name: the first blacklisting lasts 20 to
30 s (twice the lower bound plus jitter, capped by the upper), each later one the upper."""
DRIVER_MODULE = "herd_operator.runtime.engines.hvd_driver"
"""Our driver, run as a module (not imported here: it imports Horovod)."""
DRIVER_NAME = "hvd-driver"
"""What events and logs call a job's process under our driver."""
FIXED_AT_LAUNCH_CHANGED = "command, env, training, workingDir, gpus.min or horovod options changed"


def horovodrun_executable() -> str:
    """The `horovodrun` of this Python's environment, else the one on PATH."""
    beside = Path(sys.executable).with_name("horovodrun")
    if beside.exists():
        return str(beside)
    found = shutil.which("horovodrun")
    if not found:
        raise FileNotFoundError("horovodrun not found: install Horovod (scripts/bootstrap.sh)")
    return found


def horovodrun_argv(
    spec: HerdJobSpec,
    np: int,
    discovery_script: Path | None,
    hosts: Sequence[str],
    horovodrun: str,
    python: str,
    network_interface: str | None = None,
) -> list[str]:
    """The argument list (never a shell string) that starts the job.

    `hosts` are the pool's, to decide whether Horovod may talk over loopback only;
    `network_interface` is the one Horovod uses between the hosts of a larger pool.
    Without a discovery script the hosts come from elsewhere (the driver's grant file).
    """
    argv = [horovodrun, "-np", str(np), "--min-np", str(spec.gpus.min)]
    argv += ["--max-np", str(spec.gpus.max)]
    if discovery_script is not None:
        argv += ["--host-discovery-script", str(discovery_script)]
    argv += ["--elastic-timeout", str(spec.horovod.elastic_timeout_seconds)]
    if "--gloo-timeout-seconds" not in spec.horovod.extra_args:
        # Horovod exports it to the workers, over the operator's HOROVOD_GLOO_TIMEOUT_SECONDS.
        argv += ["--gloo-timeout-seconds", str(spec.horovod.gloo_timeout_seconds)]
    if "--blacklist-cooldown-range" not in spec.horovod.extra_args:
        # Without it a host name blacklisted after a worker failure never comes back.
        low, high = BLACKLIST_COOLDOWN_SECONDS
        argv += ["--blacklist-cooldown-range", str(low), str(high)]
    if spec.horovod.reset_limit is not None:
        argv += ["--reset-limit", str(spec.horovod.reset_limit)]
    if hosts and all(host in LOCAL_HOSTS for host in hosts):
        # Without it an elastic job on one host waits for a second host forever.
        argv += ["--network-interface", "lo"]
    elif network_interface and "--network-interface" not in spec.horovod.extra_args:
        # Without it Horovod probes every interface of every host at each start (~9 s).
        argv += ["--network-interface", network_interface]
    argv += spec.horovod.extra_args
    argv += [python, "-m", "herd_operator.agent.shim", "--", *spec.command]
    return argv


def driver_argv(
    spec: HerdJobSpec,
    np: int,
    grant_file: Path,
    hosts: Sequence[str],
    python: str,
    network_interface: str | None = None,
) -> list[str]:
    """The argument list that starts the job under our in-process driver (`hvd_driver`):
    horovodrun's own arguments, with the grant file in place of the discovery script."""
    horovod_args = horovodrun_argv(spec, np, None, hosts, "horovodrun", python, network_interface)
    ours = ["--grant-file", str(grant_file)]
    ours += ["--grow-timeout-seconds", str(spec.horovod.grow_timeout_seconds)]
    if spec.horovod.preload:
        ours += ["--preload", ",".join(spec.horovod.preload)]
    return [python, "-m", DRIVER_MODULE, *ours, "--", *horovod_args[1:]]


Presentation = dict[str, tuple[Slot, ...]]
"""Host name as Horovod sees it -> the slots shown under it, in local-rank order."""


def present(placement: Placement, aliases: Mapping[str, Sequence[str]]) -> Presentation:
    """The names under which Horovod sees the placement's slots.

    GPU g of a host with names n_0..n_k-1 is shown under n_(g mod k): a GPU keeps its
    name whatever else the placement holds, so a running worker (known to Horovod by
    name and local rank) keeps its slot when the placement changes elsewhere.
    """
    presented: dict[str, list[Slot]] = {}
    for host, gpus in placement.hosts:
        names = aliases.get(host) or (host,)
        for gpu in gpus:
            presented.setdefault(names[gpu % len(names)], []).append((host, gpu))
    return {name: tuple(slots) for name, slots in presented.items()}


def discovery_lines(placement: Placement, aliases: Mapping[str, Sequence[str]] = {}) -> list[str]:
    """What a Horovod host-discovery script prints for this placement."""
    return [f"{name}:{len(slots)}" for name, slots in present(placement, aliases).items()]


def host_aliases(hosts: Iterable[str], local_names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Each pool host's names for Horovod: its own first, then this machine's other names
    if it is the pool's only host and a local one.

    Only a lone host: in a pool of several nodes, Horovod's local ranks and the job's
    placement per node must follow real node names, and a failed worker costs the job one
    node's slots for the cool-down, not all of them.
    """
    hosts = list(hosts)
    aliases: dict[str, tuple[str, ...]] = {host: (host,) for host in hosts}
    if len(hosts) == 1 and (hosts[0] in local_names or hosts[0] in LOCAL_HOSTS):
        (host,) = hosts
        aliases[host] = (host, *(name for name in local_names if name != host))
    return aliases


def local_names() -> tuple[str, ...]:
    """Names of this machine that Horovod starts workers under without ssh.

    Horovod runs a worker locally when its host name resolves to an IPv4 address of a local
    interface (`horovod.runner.util.network.get_local_host_addresses`): `localhost`, the
    interface addresses, the host name when it resolves to one of them. Another loopback
    address such as 127.0.0.2 is not an interface address: Horovod would ssh to it.
    """
    addresses = [
        address.address
        for entries in psutil.net_if_addrs().values()
        for address in entries
        if address.family == socket.AF_INET
    ]
    return local_names_of(addresses, socket.gethostname(), socket.gethostbyname)


DOCUMENTATION_NETWORKS = tuple(
    ipaddress.IPv4Network(network)
    for network in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
)
"""TEST-NET-1, -2 and -3 (RFC 5737): addresses for examples, never on a real network, but
given to the interfaces of some containers and sandboxes (this project's development VM's
eth0 is 192.0.2.2)."""


def local_names_of(
    addresses: Sequence[str], hostname: str, resolve: Callable[[str], str]
) -> tuple[str, ...]:
    """`local_names` from this machine's IPv4 interface addresses, its host name and a
    resolver (`socket.gethostbyname`): the names that resolve to one of the addresses.

    An address of a documentation network is left out. The names are Horovod's host names
    for the job's workers, so they are what a job's log shows (`grant seen: {...}`,
    `starting worker NAME[0]`): an example address there looks like a host that does not
    exist. Leaving it out costs one alias of a lone host, which keeps the others."""
    shown = [a for a in addresses if not _is_documentation_address(a)]
    found: list[str] = []
    for name in ["localhost", *shown, hostname]:
        try:
            resolved = resolve(name)
        except OSError:
            continue
        if resolved in addresses and name not in found:
            found.append(name)
    return tuple(found)


def _is_documentation_address(address: str) -> bool:
    try:
        parsed = ipaddress.IPv4Address(address)
    except ValueError:
        return False
    return any(parsed in network for network in DOCUMENTATION_NETWORKS)


def fixed_at_launch(spec: HerdJobSpec) -> dict[str, object]:
    """What `horovodrun` fixes at launch: a change here needs a relaunch.

    `gpus.max` is not in it: lowering max is applied live through the grant;
    raising it past the launched `--max-np` is checked on its own.
    """
    return {
        "command": spec.command,
        "workingDir": spec.working_dir,
        "env": spec.env,
        "training": training_at_launch(spec),
        "min": spec.gpus.min,
        "horovod": spec.horovod.model_dump(by_alias=True),
    }


def relaunch_reason(launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
    """Why a `horovodrun` started for `launched` cannot follow `wanted` ('' if it can)."""
    return launch_mismatch(launched, wanted, fixed_at_launch, FIXED_AT_LAUNCH_CHANGED, "--max-np")


class GrantPublisher:
    """Publishes grants as files: one `host:slots` file and one discovery script per job.

    Horovod runs the discovery script every second for the life of the job, so
    it is a two-line shell script that `cat`s the grant file: no Python start-up
    per call. The grant file is replaced atomically, so a reader never sees half
    of it.
    """

    def __init__(self, layout: StateLayout, aliases: Mapping[str, Sequence[str]] = {}) -> None:
        self.layout = layout
        self.aliases = aliases

    def discovery_script(self, job: str) -> Path:
        script = self.layout.discovery_script(job)
        if not script.exists():
            grant = shlex.quote(str(self.layout.grant_file(job).resolve()))
            write_atomically(script, f"#!/bin/sh\nexec cat {grant}\n", mode=0o755)
        return script

    def publish(self, job: str, placement: Placement) -> None:
        lines = discovery_lines(placement, self.aliases)
        # Atomic, not durable: after a crash the operator decides and publishes again.
        write_atomically(
            self.layout.grant_file(job), "".join(f"{line}\n" for line in lines), durable=False
        )

    def withdraw(self, job: str) -> None:
        self.layout.grant_file(job).unlink(missing_ok=True)
        self.layout.discovery_script(job).unlink(missing_ok=True)


class HorovodEngine:
    """Runs a job under our in-process Horovod driver (`hvd_driver`), or under
    `horovodrun --min-np --max-np --host-discovery-script` (`spec.horovod.launcher`)."""

    resize_mode = ResizeMode.LIVE
    """Horovod's elastic reset keeps the staying workers' processes; new ones join them."""

    def __init__(self, context: EngineContext) -> None:
        self.hosts = context.hosts
        self.aliases = host_aliases(context.hosts, local_names())
        self.grants = GrantPublisher(context.layout, self.aliases)
        self.python = context.python
        self.network_interface = context.network_interface

    def process_name(self, job: HerdJob) -> str:
        """`hvd-driver` for our driver, `horovodrun` for the bare launch: what `describe`
        and the events say was started (and exited), so a user looks for the right one."""
        return DRIVER_NAME if job.spec.horovod.launcher == "driver" else "horovodrun"

    def launch_argv(self, job: HerdJob, np: int) -> list[str]:
        if job.spec.horovod.launcher == "driver":
            # The driver runs Horovod's runner, installed with `horovodrun`: a launch
            # where it is missing fails here, with the same message as the bare launch.
            horovodrun_executable()
            return driver_argv(
                job.spec,
                np,
                self.grants.layout.grant_file(job.name).resolve(),
                self.hosts,
                self.python,
                self.network_interface,
            )
        script = self.grants.discovery_script(job.name)
        return horovodrun_argv(
            job.spec,
            np,
            script,
            self.hosts,
            horovodrun_executable(),
            self.python,
            self.network_interface,
        )

    def environment(self, job: HerdJob, env: Mapping[str, str]) -> dict[str, str]:
        return {
            "PYTHONUNBUFFERED": "1",
            # The job's `python` is this environment's, where Horovod and the shim are.
            "PATH": os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")]),
        }

    def relaunch_reason(self, launched: HerdJobSpec, wanted: HerdJobSpec) -> str:
        return relaunch_reason(launched, wanted)

    def present(self, job: str, placement: Placement) -> Presentation:
        return present(placement, self.aliases)

    def publish(self, job: str, placement: Placement) -> None:
        self.grants.publish(job, placement)

    def withdraw(self, job: str) -> None:
        self.grants.withdraw(job)
