"""A node whose agent goes silent is cordoned, and freed when its agent is heard again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import heard_from
from herd_operator.runtime.pools.heartbeat import NodeWatch, lost_nodes
from specs.values import Demand, Pool

THREE = Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("heard", "now", "expected"),
    [
        ({}, 50.0, set()),
        ({"h1": 10.0, "h2": 15.0}, 40.0, {"h1"}),
        ({"h1": 10.0}, 39.9, set()),
        ({"h1": 10.0, "h2": 30.0}, 70.0, {"h1", "h2"}),
    ],
)
def test_lost_nodes_are_those_heard_and_then_silent_too_long(
    heard: dict[str, float], now: float, expected: set[str]
) -> None:
    assert lost_nodes(heard, now, 29.9) == expected


def test_the_timeout_is_a_strict_bound() -> None:
    assert lost_nodes({"h1": 0.0}, 30.0, 30.0) == set()
    assert lost_nodes({"h1": 0.0}, 30.01, 30.0) == {"h1"}


Watch = tuple[NodeWatch, Clock, list[set[str]], list[tuple[str, bool]]]


@pytest.fixture
def watch() -> Watch:
    clock = Clock()
    cordons: list[set[str]] = []
    told: list[tuple[str, bool]] = []
    nodes = NodeWatch(
        THREE,
        cordons.append,
        timeout=30.0,
        on_node=lambda host, lost, why: told.append((host, lost)),
        clock=clock,
    )
    return nodes, clock, cordons, told


def test_a_silent_node_is_cordoned_and_freed_when_heard_again(watch: Watch) -> None:
    nodes, clock, cordons, told = watch
    for host in ("h1", "h2"):
        nodes.heartbeat(host)
    clock.now += 20
    nodes.heartbeat("h1")
    assert nodes.check() == set() and not cordons
    clock.now += 15  # h2 silent for 35 s, h1 for 15 s; h3 never heard: never cordoned
    assert nodes.check() == {"h2"}
    assert cordons == [{"h2"}] and told == [("h2", True)] and nodes.lost() == {"h2"}
    assert nodes.check() == set() and len(cordons) == 1  # said once, not at every check
    nodes.heartbeat("h2")
    assert cordons[-1] == set() and told[-1] == ("h2", False) and not nodes.lost()


def test_a_host_outside_the_pool_is_ignored(watch: Watch) -> None:
    nodes, clock, cordons, told = watch
    nodes.heartbeat("login1")
    clock.now += 100
    assert nodes.check() == set() and not told and not cordons


def test_registration_is_the_heartbeat() -> None:
    heard: list[str] = []

    class Nodes:
        def heartbeat(self, host: str) -> None:
            heard.append(host)

    def register(args: dict[str, Any]) -> dict[str, Any]:
        return {"ok": args["port"]}

    assert heard_from(Nodes(), register)({"host": "h2", "port": 9411}) == {"ok": 9411}
    assert heard == ["h2"]


@pytest.fixture
def allocator(tmp_path: Path) -> Allocator:
    layout = StateLayout(tmp_path)
    layout.create()
    return Allocator(
        THREE, GrantPublisher(layout), virtual=True, drain_seconds=0, min_resize_interval=0
    )


def test_a_cordoned_node_keeps_its_jobs_until_their_workers_are_seen_gone(
    allocator: Allocator,
) -> None:
    allocator.request(Demand("wide", 2, 6, 6, arrival=1.0))
    allocator.observe_world_size("wide", 6)
    before = allocator.placements()["wide"]
    assert before.size == 6
    allocator.cordon({"h3"})
    # Not told to shrink: Horovod recovers best by dropping the lost workers itself.
    assert allocator.placements()["wide"] == before
    # It did: the GPUs it lost on h3 are taken back, and not granted again while cordoned.
    allocator.observe_world_size("wide", 4)
    after = allocator.placements()["wide"]
    assert after.size == 4 and "h3" not in dict(after.hosts)
    # A decision runs (a changed demand; the same one again would decide nothing): h3's
    # free GPUs are the only ones, and a cordoned host's free GPUs go to nobody.
    allocator.request(Demand("wide", 2, 6, 5, arrival=1.0))
    assert allocator.placements()["wide"].size == 4
    allocator.request(Demand("wide", 2, 6, 6, arrival=1.0))
    assert allocator.placements()["wide"].size == 4
    # Back: its GPUs are granted again.
    allocator.cordon(set())
    assert allocator.placements()["wide"].size == 6


@pytest.mark.parametrize("batched", [False, True])
def test_gpus_of_a_job_released_on_a_lost_node_go_to_nobody(
    allocator: Allocator, batched: bool
) -> None:
    """`solo` ran alone on h3 and ended with it; its release must not hand h3's GPUs to
    `by`, which wants more (what killed the bystander in issue 25: `by` grown onto h3)."""
    allocator.request(Demand("by", 2, 3, 2, arrival=1.0))
    allocator.request(Demand("wide", 2, 2, 2, arrival=2.0))
    allocator.request(Demand("solo", 2, 2, 2, arrival=3.0))
    assert dict(allocator.placements()["solo"].hosts) == {"h3": (0, 1)}
    allocator.request(Demand("by", 2, 3, 3, arrival=1.0))
    allocator.cordon({"h3"})
    if batched:
        with allocator.batch():
            allocator.release("solo")
    else:
        allocator.release("solo")
    assert allocator.placements()["by"].size == 2 and "solo" not in allocator.placements()
    allocator.cordon(set())
    assert allocator.placements()["by"].size == 3


def test_gpus_a_shrink_takes_back_on_a_cordoned_node_go_to_nobody(allocator: Allocator) -> None:
    """h3 is cordoned while `wide` runs there; Horovod drops its workers on h3 and the
    allocator takes their GPUs back (WorkerLost). That same decision must not hand them to
    `pair`, which waits for GPUs."""
    allocator.request(Demand("wide", 2, 6, 6, arrival=1.0, priority=1))
    allocator.request(Demand("pair", 2, 2, 2, arrival=2.0))
    allocator.observe_world_size("wide", 6)
    allocator.cordon({"h3"})
    allocator.observe_world_size("wide", 4)
    assert "h3" not in dict(allocator.placements()["wide"].hosts)
    assert not allocator.placements()["pair"].size
