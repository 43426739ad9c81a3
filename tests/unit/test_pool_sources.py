"""Pool sources: a new one is its own module plus one registry line, and the operator and
the allocator follow a pool that changes while they run (a node lost, or back).

`LosingNodePool` below stands for a source such as Slurm with per-node agents: it is
defined here, registered with one line, and nothing else changes to use it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.pools import (
    POOL_SOURCES,
    PoolListener,
    PoolOptions,
    PoolSource,
    discover_pool,
    hosts,
    local,
)
from herd_operator.specs.values import Demand, Pool
from tests.integration.harness import OperatorHarness

TWO_NODES = Pool.from_counts({"node-a": 2, "node-b": 2})
NODE_A = Pool.from_counts({"node-a": 2})


class LosingNodePool:
    """Two nodes; the test says when node-b is lost and when it is back."""

    virtual = True
    description = "two test nodes"

    def __init__(self) -> None:
        self._pool = TWO_NODES
        self._listener: PoolListener | None = None
        self.started = threading.Event()
        self.stopped = False

    @property
    def pool(self) -> Pool:
        return self._pool

    def start(self, on_change: PoolListener) -> None:
        self._listener = on_change
        self.started.set()

    def stop(self) -> None:
        self.stopped = True

    def change(self, pool: Pool) -> None:
        self._pool = pool
        assert self._listener is not None, "the source was not started"
        self._listener(pool)


def detect_test_nodes(options: PoolOptions) -> PoolSource | None:
    return LosingNodePool()


def test_a_registered_source_is_found_without_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (hosts, local):
        monkeypatch.setattr(module, "nvml_gpu_count", lambda: 0)
    monkeypatch.setitem(POOL_SOURCES, "test-nodes", detect_test_nodes)  # the one line
    source = discover_pool(None, 4)
    assert isinstance(source, LosingNodePool)
    assert discover_pool("localhost:2", 4).pool == Pool.from_counts({"localhost": 2})


def test_the_fallback_is_virtual_gpus_on_localhost(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (hosts, local):
        monkeypatch.setattr(module, "nvml_gpu_count", lambda: 0)
    source = discover_pool(None, 3)
    assert (source.pool, source.virtual) == (Pool.from_counts({"localhost": 3}), True)


@pytest.fixture
def allocator(tmp_path: Path) -> Allocator:
    layout = StateLayout(tmp_path)
    layout.create()
    return Allocator(TWO_NODES, GrantPublisher(layout), virtual=True, drain_seconds=0)


def test_jobs_on_a_lost_node_shrink_or_wait_and_grow_back(allocator: Allocator) -> None:
    woken: list[str] = []
    allocator.watch(lambda job, grant: woken.append(job))
    allocator.request(Demand("wide", 1, 4, 3, arrival=1.0))
    allocator.request(Demand("pair", 1, 1, 1, arrival=2.0))
    before = allocator.placements()
    assert before["wide"].size == 3 and before["pair"].size == 1

    allocator.set_pool(NODE_A)

    after = allocator.placements()
    assert all(host == "node-a" for p in after.values() for host, _ in p.hosts)
    assert after["wide"].size + after["pair"].size == 2
    assert sorted(woken) == sorted(job for job in after if after[job] != before[job]), (
        "every job whose placement changed is woken"
    )
    # wide keeps what it had on node-a (no reshuffle); pair, whose one GPU was on node-b,
    # is admitted again on one of wide's extras (admitted jobs keep only their min).
    assert set(after["wide"].slots()) <= set(before["wide"].slots())
    assert before["pair"].hosts[0][0] == "node-b" and after["pair"].size == 1

    woken.clear()
    allocator.set_pool(TWO_NODES)  # node-b is back

    back = allocator.placements()
    assert (back["wide"].size, back["pair"].size) == (3, 1)
    assert woken, "jobs that grow again are woken"


def test_a_job_whose_min_no_longer_fits_is_pending_again(allocator: Allocator) -> None:
    allocator.request(Demand("big", 4, 4, 4, arrival=1.0))
    allocator.set_pool(NODE_A)
    grant = allocator.grant("big")
    assert grant is not None and not grant.admitted
    allocator.set_pool(TWO_NODES)
    grant = allocator.grant("big")
    assert grant is not None and grant.placement.size == 4


def test_an_unchanged_pool_decides_nothing(allocator: Allocator) -> None:
    woken: list[str] = []
    allocator.watch(lambda job, grant: woken.append(job))
    allocator.request(Demand("a", 1, 4, 4))
    allocator.set_pool(Pool.from_counts({"node-a": 2, "node-b": 2}))
    assert woken == []


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[tuple[OperatorHarness, LosingNodePool]]:
    source = LosingNodePool()
    operator = OperatorHarness(tmp_path, overrides={"pool": source, "metrics_port": 0})
    operator.start()
    try:
        yield operator, source
    finally:
        operator.stop()


def test_the_operator_follows_a_pool_that_changes_while_it_runs(
    harness: tuple[OperatorHarness, LosingNodePool],
) -> None:
    operator, source = harness
    assert source.started.wait(10)
    allocator = operator.operator.allocator
    assert allocator is not None and allocator.pool == TWO_NODES
    registry = operator.operator.metrics.registry

    def free_gpus() -> float | None:
        return registry.get_sample_value("herd_pool_gpus", {"state": "free"})

    assert free_gpus() == 4
    source.change(NODE_A)
    deadline = time.monotonic() + 10
    while allocator.pool != NODE_A and time.monotonic() < deadline:
        time.sleep(0.05)
    assert allocator.pool == NODE_A
    assert free_gpus() == 2
    operator.stop()
    assert source.stopped


def test_a_static_pool_is_a_source_too() -> None:
    source = discover_pool("node-a:2,node-b:2", 4)
    source.start(lambda pool: pytest.fail("a static pool never changes"))
    source.stop()
    assert source.pool == TWO_NODES
