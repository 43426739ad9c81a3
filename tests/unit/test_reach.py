"""Where the allocator listens and which interface Horovod uses, for one host and for many."""

from __future__ import annotations

import pytest

from herd_operator.runtime.engines.horovod import horovodrun_argv
from herd_operator.runtime.reach import Reach, plan_reach
from herd_operator.specs import HerdJobSpec

LOCAL_NAMES = ("localhost", "127.0.0.1", "10.200.0.11", "h1")
INTERFACES = {"lo": ["127.0.0.1"], "eth0": ["10.200.0.11"], "ib0": ["192.168.5.1"]}
NODES = ("h1", "h2", "h3")


def plan(
    hosts: tuple[str, ...] = NODES,
    *,
    listen: str | None = None,
    advertise: str | None = None,
    interface: str | None = None,
    own: str | None = "10.200.0.11",
) -> Reach:
    return plan_reach(
        hosts,
        LOCAL_NAMES,
        INTERFACES,
        listen=listen,
        advertise=advertise,
        network_interface=interface,
        own_address=own,
    )


@pytest.mark.parametrize("hosts", [("localhost",), ("h1",), ("localhost", "127.0.0.1")])
def test_a_pool_on_this_host_stays_on_loopback(hosts: tuple[str, ...]) -> None:
    assert plan(hosts) == Reach("127.0.0.1", "127.0.0.1", None)
    assert plan(hosts, listen="0.0.0.0") == Reach("0.0.0.0", "127.0.0.1", None)


def test_several_nodes_listen_on_this_nodes_address_and_use_its_interface() -> None:
    assert plan() == Reach("10.200.0.11", "10.200.0.11", "eth0")


def test_the_interface_given_decides_the_address() -> None:
    assert plan(interface="ib0") == Reach("192.168.5.1", "192.168.5.1", "ib0")


def test_a_listen_address_names_its_interface() -> None:
    assert plan(listen="192.168.5.1") == Reach("192.168.5.1", "192.168.5.1", "ib0")


def test_a_wildcard_listen_advertises_a_reachable_address() -> None:
    assert plan(listen="0.0.0.0") == Reach("0.0.0.0", "10.200.0.11", "eth0")
    assert plan(listen="0.0.0.0", interface="ib0").advertise == "192.168.5.1"


@pytest.mark.parametrize("listen", ["127.0.0.1", "localhost", "127.0.1.1", "::1"])
def test_a_loopback_listen_with_other_nodes_is_refused(listen: str) -> None:
    with pytest.raises(ValueError, match=r"loopback address, but the pool has other nodes \(h2"):
        plan(listen=listen)


def test_a_loopback_advertise_with_other_nodes_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--advertise 127\.0\.0\.1 is a loopback"):
        plan(listen="0.0.0.0", advertise="127.0.0.1")


def test_an_unknown_interface_lists_the_ones_there() -> None:
    with pytest.raises(ValueError, match=r"hsn0: this host has no such interface \(it has eth0"):
        plan(interface="hsn0")


def test_no_address_at_all_asks_for_one() -> None:
    # The host name resolves to loopback (Debian's 127.0.1.1) and nothing else is known.
    with pytest.raises(ValueError, match="pass --listen ADDRESS or --network-interface"):
        plan(own="127.0.1.1")


def test_an_unknown_interface_is_a_warning_not_a_silent_probe() -> None:
    reach = plan(listen="10.9.9.9", own=None)
    assert reach.network_interface is None
    assert reach.listen == "10.9.9.9"
    assert any("about 9 s" in warning for warning in reach.warnings)


def test_the_interface_reaches_horovodrun_for_several_nodes_only() -> None:
    spec = HerdJobSpec.model_validate(
        {"command": ["python", "train.py"], "gpus": {"min": 1, "max": 4}}
    )

    def argv(hosts: tuple[str, ...], interface: str | None) -> list[str]:
        return horovodrun_argv(spec, 2, "d.sh", hosts, "horovodrun", "python", interface)  # type: ignore[arg-type]

    def interface_of(line: list[str]) -> str | None:
        return (
            line[line.index("--network-interface") + 1] if "--network-interface" in line else None
        )

    assert interface_of(argv(("localhost",), None)) == "lo"
    assert interface_of(argv(NODES, "eth0")) == "eth0"
    assert interface_of(argv(NODES, None)) is None
    # The spec's own choice wins.
    spec = spec.model_copy(
        update={
            "horovod": spec.horovod.model_copy(
                update={"extra_args": ["--network-interface", "ib0"]}
            )
        }
    )
    line = argv(NODES, "eth0")
    assert line.count("--network-interface") == 1 and interface_of(line) == "ib0"
