"""Where `herd-operator exporter` serves without --listen (issue 27.5): where the operator and
Prometheus scrape it, not on every interface of a shared node."""

from __future__ import annotations

import ipaddress
import itertools
import json
from pathlib import Path

import pytest

from herd_operator.agent.exporter import WILDCARD, choose_listen, default_listen, is_loopback
from herd_operator.cli.main import build_parser
from herd_operator.layout import StateLayout

LOCAL = frozenset({"127.0.0.1", "10.0.0.2", "fe80::1"})
"""This node's addresses (as psutil lists them): loopback and one on the cluster network."""

CASES = {
    # host, what it resolves to here, the operator's address, this node's route to it
    "a cluster node: its name's address": (
        ("nid002", "10.0.0.2", "10.0.0.1", "10.0.0.2"),
        "10.0.0.2",
    ),
    "a cluster node before the operator wrote its address": (
        ("nid002", "10.0.0.2", None, None),
        "10.0.0.2",
    ),
    "the operator's own node in a pool of several": (
        ("nid001", "10.0.0.2", "10.0.0.2", "10.0.0.2"),
        "10.0.0.2",
    ),
    "a pool on this node alone (localhost)": (
        ("localhost", "127.0.0.1", "127.0.0.1", "127.0.0.1"),
        "127.0.0.1",
    ),
    "localhost before the operator wrote its address": (
        ("localhost", "127.0.0.1", None, None),
        "127.0.0.1",
    ),
    "a name on 127.0.1.1 (Debian's /etc/hosts), the operator here": (
        ("vm", "127.0.1.1", "127.0.0.1", "127.0.0.1"),
        "127.0.1.1",
    ),
    "a name on 127.0.1.1, the operator on another node": (
        ("vm", "127.0.1.1", "10.0.0.1", "10.0.0.2"),
        "10.0.0.2",
    ),
    "a name that does not resolve here": (("nid002", None, "10.0.0.1", "10.0.0.2"), "10.0.0.2"),
    "a name on an address this node does not have (NAT)": (
        ("nid002", "192.0.2.7", "10.0.0.1", "10.0.0.2"),
        "10.0.0.2",
    ),
    "a name on 127.0.1.1, no operator yet": (("vm", "127.0.1.1", None, None), WILDCARD),
    "nothing known": (("nid002", None, None, None), WILDCARD),
}


@pytest.mark.parametrize("inputs, expected", CASES.values(), ids=CASES.keys())
def test_the_default_address(
    inputs: tuple[str, str | None, str | None, str | None], expected: str
) -> None:
    host, resolved, operator, route = inputs
    chosen = default_listen(host, resolved, operator, route, LOCAL)
    assert chosen.address == expected
    assert (chosen.warning is not None) == (expected == WILDCARD)
    if chosen.warning is not None:
        assert "--listen" in chosen.warning


HOSTS = ["localhost", "nid002"]
RESOLVED = [None, "127.0.0.1", "127.0.1.1", "10.0.0.2", "192.0.2.7"]
OPERATORS = [None, "127.0.0.1", "10.0.0.2", "10.0.0.1", "fd00::1"]
ROUTES = [None, "10.0.0.2", "fe80::1"]


@pytest.mark.parametrize(
    "host, resolved, operator, route", list(itertools.product(HOSTS, RESOLVED, OPERATORS, ROUTES))
)
def test_the_default_is_one_address_of_this_node_where_one_is_known(
    host: str, resolved: str | None, operator: str | None, route: str | None
) -> None:
    chosen = default_listen(host, resolved, operator, route, LOCAL)
    own = resolved if resolved in LOCAL or (resolved and is_loopback(resolved)) else None
    if chosen.address == WILDCARD:
        # Every interface only when neither the name nor the operator gives an address here.
        assert (own is None or is_loopback(own)) and route is None
        assert chosen.warning is not None
        return
    assert chosen.warning is None
    assert chosen.address in LOCAL or is_loopback(chosen.address) or chosen.address == route
    if own is not None and not is_loopback(own):
        assert chosen.address == own  # where the operator and Prometheus scrape it
    if is_loopback(chosen.address):
        # Loopback only for a pool on this node: other nodes could not scrape it.
        assert (operator is None and host == "localhost") or (
            operator is not None
            and (operator in LOCAL or ipaddress.ip_address(operator).is_loopback)
        )


NOT_HERE = "192.0.2.7"
"""A --host that resolves (without DNS: it is an address) to no address of this node."""


def test_choose_listen_reads_the_operators_address_from_the_state_dir(tmp_path: Path) -> None:
    layout = StateLayout(tmp_path)
    layout.endpoint_file.write_text(json.dumps({"address": "127.0.0.1:4567"}))
    # The route to an operator on loopback is loopback.
    chosen = choose_listen(NOT_HERE, layout)
    assert chosen.address == "127.0.0.1"
    assert "reaches the operator at 127.0.0.1" in chosen.reason
    assert choose_listen("localhost", layout).address == "127.0.0.1"


@pytest.mark.parametrize("endpoint", [None, "", "{}", '{"address": "no port"}', "[1, 2]"])
def test_without_a_readable_endpoint_there_is_no_operator_to_go_by(
    tmp_path: Path, endpoint: str | None
) -> None:
    layout = StateLayout(tmp_path)
    if endpoint is not None:
        layout.endpoint_file.write_text(endpoint)
    chosen = choose_listen(NOT_HERE, layout)
    assert chosen.address == WILDCARD and chosen.warning is not None


def test_the_cli_leaves_the_default_to_the_exporter() -> None:
    args = build_parser().parse_args(["exporter"])
    assert args.listen is None
    assert build_parser().parse_args(["exporter", "--listen", "0.0.0.0"]).listen == "0.0.0.0"
