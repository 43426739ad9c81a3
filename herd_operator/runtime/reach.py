"""How the pool's hosts reach the operator: the allocator's address and Horovod's interface.

A pool on this host alone talks over loopback. A pool of several nodes needs an address
the other nodes can reach and one network interface that Horovod uses between them
(`hsn0` on Perlmutter, `eth0` on the test hosts): without it, Horovod probes every
interface of every host on each start (about 9 s). `plan_reach` decides both from the
command line and this host's interfaces, as a pure function; the CLI reads the world.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil

from herd_operator.runtime.engines.horovod import LOCAL_HOSTS

WILDCARDS = frozenset({"0.0.0.0", "::", ""})

Interfaces = Mapping[str, Sequence[str]]
"""Interface name -> its IPv4 addresses, in the order the system lists them."""


@dataclass(frozen=True)
class Reach:
    listen: str
    """Where the allocator listens."""
    advertise: str
    """The address workers are told to call (never a wildcard)."""
    network_interface: str | None
    """Horovod's `--network-interface` for a pool of several nodes; None on one host."""
    warnings: tuple[str, ...] = ()


def is_loopback(address: str) -> bool:
    if address in LOCAL_HOSTS:
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def pool_is_local(hosts: Sequence[str], local_names: Sequence[str]) -> bool:
    """True when the pool is this machine alone: loopback names only, or one host that is
    one of this machine's names."""
    return all(host in LOCAL_HOSTS for host in hosts) or (
        len(hosts) == 1 and hosts[0] in local_names
    )


def interface_of(address: str, interfaces: Interfaces) -> str | None:
    """The interface that holds `address`, None if none does."""
    for name, addresses in interfaces.items():
        if address in addresses:
            return name
    return None


def plan_reach(
    hosts: Sequence[str],
    local_names: Sequence[str],
    interfaces: Interfaces,
    *,
    listen: str | None,
    advertise: str | None,
    network_interface: str | None,
    own_address: str | None,
) -> Reach:
    """Where to listen, what to advertise and which interface Horovod uses.

    `own_address` is what this host's name resolves to (None if it does not resolve).
    Raises ValueError with the fix when the pool's other nodes could not reach the
    allocator: a loopback `--listen`, or an interface this host does not have.
    """
    if pool_is_local(hosts, local_names):
        chosen = listen or "127.0.0.1"
        return Reach(chosen, advertise or ("127.0.0.1" if chosen in WILDCARDS else chosen), None)

    remote = [host for host in hosts if host not in local_names and host not in LOCAL_HOSTS]
    shown = ", ".join(remote[:3]) + (", ..." if len(remote) > 3 else "")
    _refuse_unreachable(shown, interfaces, listen, advertise, network_interface)

    warnings: list[str] = []
    interface = network_interface
    if interface is None:
        interface = _interface_of_first(interfaces, listen, advertise, own_address)
    if interface is None:
        warnings.append(
            "no --network-interface given or found: Horovod will probe the interfaces of "
            "every host at each job start (about 9 s); pass --network-interface (hsn0 on "
            "Perlmutter)"
        )

    addresses = list(interfaces.get(interface, ())) if interface else []
    chosen_listen = _listen_address(shown, addresses, listen, own_address)
    if advertise is None and chosen_listen in WILDCARDS:
        advertise = _advertise_for_wildcard(chosen_listen, addresses, own_address)
    return Reach(chosen_listen, advertise or chosen_listen, interface, tuple(warnings))


def _refuse_unreachable(
    shown: str,
    interfaces: Interfaces,
    listen: str | None,
    advertise: str | None,
    network_interface: str | None,
) -> None:
    """Raise ValueError for flags the pool's other nodes (`shown`) could not reach us by."""
    if network_interface is not None and network_interface not in interfaces:
        raise ValueError(
            f"--network-interface {network_interface}: this host has no such interface "
            f"(it has {', '.join(sorted(interfaces)) or 'none'})"
        )
    if listen is not None and is_loopback(listen):
        raise ValueError(
            f"--listen {listen} is a loopback address, but the pool has other nodes "
            f"({shown}) whose workers must reach the allocator: pass --listen with an "
            "address of this node they reach (or --network-interface NAME)"
        )
    if advertise is not None and is_loopback(advertise):
        raise ValueError(
            f"--advertise {advertise} is a loopback address, but the pool has other nodes "
            f"({shown}): advertise an address of this node they reach"
        )


def _interface_of_first(
    interfaces: Interfaces, listen: str | None, advertise: str | None, own_address: str | None
) -> str | None:
    """The interface of the first of a specific `listen`, `advertise` and this host's own
    address that is not loopback and that an interface holds."""
    specific = listen if listen not in (None, *WILDCARDS) else None
    for candidate in (specific, advertise, own_address):
        if candidate and not is_loopback(candidate):
            interface = interface_of(candidate, interfaces)
            if interface:
                return interface
    return None


def _listen_address(
    shown: str, addresses: Sequence[str], listen: str | None, own_address: str | None
) -> str:
    """`listen` if given; else the interface's first address, else this host's own."""
    if listen is not None:
        return listen
    fallback = own_address if own_address and not is_loopback(own_address) else None
    chosen = addresses[0] if addresses else fallback
    if chosen is None:
        raise ValueError(
            f"the pool has other nodes ({shown}) but no address of this node was found "
            "for them to reach the allocator: pass --listen ADDRESS or "
            "--network-interface NAME"
        )
    return chosen


def _advertise_for_wildcard(listen: str, addresses: Sequence[str], own_address: str | None) -> str:
    """What to tell workers to call when the allocator listens on a wildcard `listen`."""
    advertise = addresses[0] if addresses else own_address
    if advertise is None or is_loopback(advertise):
        raise ValueError(
            f"--listen {listen or '*'} gives the workers no address to call: "
            "pass --advertise ADDRESS"
        )
    return advertise


def local_interfaces() -> dict[str, list[str]]:
    """This host's interfaces and their IPv4 addresses."""
    return {
        name: [entry.address for entry in entries if entry.family == socket.AF_INET]
        for name, entries in psutil.net_if_addrs().items()
    }


def own_address() -> str | None:
    """The address this host's name resolves to, None if it does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
