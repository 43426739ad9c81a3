"""A job that ended with its node is not failed for its code (issue 25, item 2).

The reconciler, the allocator and the node watch are the real ones; the job's processes
are faked (tests/unit/test_reconciler.py's launcher) and the watch's probes answer as the
test says, at once. The pool is h1 (the operator's node) and h2.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from herd_operator.controllers.ports import NodeVerdict, ProcessPhase, Result
from herd_operator.controllers.reconciler import NODE_VERDICT_POLL_SECONDS, JobReconciler
from herd_operator.layout import StateLayout
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.pools.heartbeat import NodeWatch, WatchRules
from herd_operator.runtime.store import Store
from herd_operator.specs import ConditionType, is_true
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Pool
from tests.unit.test_node_watch import Clock, Probes
from tests.unit.test_reconciler import FakeClock, FakeLauncher, FakeSpecs, herd_job

POOL = Pool.from_counts({"h1": 2, "h2": 2})


@dataclass
class Cluster:
    store: Store
    allocator: Allocator
    specs: FakeSpecs
    launcher: FakeLauncher
    reconciler: JobReconciler
    watch: NodeWatch
    probes: Probes
    watch_clock: Clock
    told: list[tuple[str, bool]]

    def start(self, name: str, gpus: int, restart: dict[str, object] | None = None) -> None:
        self.specs.put(herd_job(name, gpus=(gpus, gpus), restart=restart))
        self.reconciler.reconcile(name)
        assert self.launcher.state(name).phase == ProcessPhase.RUNNING

    def hosts(self, name: str) -> list[str]:
        grant = self.allocator.grant(name)
        return [host for host, _ in grant.placement.hosts] if grant is not None else []

    def settle(self) -> None:
        """Probe what is due, then judge the answers (the watch thread does it every 0.5 s)."""
        self.watch.check()
        self.watch.check()

    def status(self, name: str) -> HerdJobStatus:
        record = self.store.get_job(name)
        assert record is not None, name
        return record.status

    def reasons(self, name: str) -> list[str]:
        return [event.reason for event in self.store.events(name)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    layout = StateLayout(tmp_path)
    layout.create()
    probes = Probes()
    watch_clock = Clock()
    told: list[tuple[str, bool]] = []
    watch = NodeWatch(
        POOL,
        lambda hosts: None,
        on_node=lambda host, lost, why: told.append((host, lost)),
        clock=watch_clock,
        local_hosts={"h1"},
        probe=probes,
        run_probe=lambda work: work(),
        rules=WatchRules(),
    )
    allocator = Allocator(
        POOL,
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=0,
        unavailable_hosts=watch.unavailable,
        on_workers_lost=watch.workers_vanished,
    )
    watch.cordon = allocator.cordon
    clock = FakeClock()
    specs = FakeSpecs()
    launcher = FakeLauncher(clock)
    with Store(tmp_path / "state.db") as store:
        reconciler = JobReconciler(
            specs, store, allocator, launcher, clock=clock, resync_seconds=5.0, nodes=watch
        )
        made = Cluster(
            store, allocator, specs, launcher, reconciler, watch, probes, watch_clock, told
        )
        # `by` fills the operator's node; `solo` runs alone on h2.
        made.start("by", 2)
        made.start("solo", 2, restart={"onFailure": False})
        assert (made.hosts("by"), made.hosts("solo")) == (["h1"], ["h2"])
        yield made


def test_a_job_whose_node_was_lost_is_launched_again_not_failed(cluster: Cluster) -> None:
    cluster.probes.down = {"h2"}
    cluster.launcher.exit("solo", 1)

    # Its node is not heard from yet: nothing is decided, its GPUs stay its own, and h2 is
    # suspect, so none of its free GPUs could go to another job meanwhile.
    assert cluster.reconciler.reconcile("solo") == Result(requeue_after=NODE_VERDICT_POLL_SECONDS)
    assert cluster.hosts("solo") == ["h2"] and cluster.watch.unavailable() == {"h2"}
    assert not is_true(cluster.status("solo").conditions, ConditionType.Failed)

    cluster.settle()  # the probe of h2 gets no answer: lost
    assert cluster.told == [("h2", True)]
    cluster.reconciler.reconcile("solo")

    status = cluster.status("solo")
    assert not is_true(status.conditions, ConditionType.Failed)
    assert (status.restarts, status.finished_at) == (0, None)
    assert cluster.reasons("solo")[-2:] == ["NodeLost", "Pending"]
    message = cluster.store.events("solo")[-2].message
    assert "node(s) h2" in message and "not counted as a failure" in message
    # Launched again on the nodes left: none is free (h1 is by's), so it waits; h2 is
    # granted to nobody.
    assert cluster.hosts("solo") == [] and cluster.launcher.starts[-1][0] == "solo"
    assert len(cluster.launcher.starts) == 2

    # h2 answers again: solo is granted it and launched.
    cluster.probes.down = set()
    cluster.watch_clock.now += 5
    cluster.settle()
    assert cluster.told[-1] == ("h2", False)
    cluster.reconciler.reconcile("solo")
    assert cluster.hosts("solo") == ["h2"] and len(cluster.launcher.starts) == 3
    assert cluster.status("solo").restarts == 0


def test_a_failure_on_a_node_that_answers_is_the_jobs_own(cluster: Cluster) -> None:
    cluster.launcher.exit("solo", 1)
    assert cluster.reconciler.reconcile("solo") == Result(requeue_after=NODE_VERDICT_POLL_SECONDS)
    cluster.settle()  # h2 answers
    cluster.watch_clock.now += 1
    cluster.reconciler.reconcile("solo")
    status = cluster.status("solo")
    assert is_true(status.conditions, ConditionType.Failed)
    assert cluster.reasons("solo")[-1] == "Failed" and "NodeLost" not in cluster.reasons("solo")
    assert cluster.told == [] and cluster.watch.unavailable() == set()


def test_a_node_loss_does_not_count_against_the_backoff_limit(cluster: Cluster) -> None:
    cluster.specs.put(herd_job("solo", gpus=(2, 2), restart={"onFailure": True, "backoffLimit": 0}))
    cluster.probes.down = {"h2"}
    cluster.launcher.exit("solo", 1)
    cluster.reconciler.reconcile("solo")
    cluster.settle()
    cluster.reconciler.reconcile("solo")
    status = cluster.status("solo")
    assert status.restarts == 0 and not is_true(status.conditions, ConditionType.Failed)
    assert "BackOff" not in cluster.reasons("solo")


def test_a_job_on_the_operators_node_alone_is_not_held_up_by_the_node_watch(
    cluster: Cluster,
) -> None:
    """`by` runs on h1 only: its failure is recorded at once (nothing to ask), and it is
    its own."""
    cluster.launcher.exit("by", 1)
    cluster.reconciler.reconcile("by")
    status = cluster.status("by")
    assert is_true(status.conditions, ConditionType.Failed)


def test_the_exit_of_a_job_relaunched_for_its_node_is_not_acted_on_twice(
    cluster: Cluster,
) -> None:
    """The operator was killed after recording the node loss and before dropping the
    launch's record: the next one adopts the same exit, which must not launch it again."""
    cluster.probes.down = {"h2"}
    cluster.launcher.exit("solo", 1)
    ended = cluster.launcher.states["solo"]
    cluster.reconciler.reconcile("solo")
    cluster.settle()
    cluster.reconciler.reconcile("solo")
    events = cluster.store.events("solo")
    starts = list(cluster.launcher.starts)
    cluster.launcher.states["solo"] = ended  # adopted again from its record
    cluster.reconciler.reconcile("solo")
    assert cluster.store.events("solo") == events and cluster.launcher.starts == starts


def test_a_job_that_stopped_on_our_word_is_not_asked_about(cluster: Cluster) -> None:
    asked: list[str] = []

    class Nodes:
        def exit_verdict(self, key: str, job: str, hosts: object) -> NodeVerdict:
            asked.append(job)
            return NodeVerdict()

    cluster.reconciler.nodes = Nodes()
    cluster.launcher.exit("solo", 0)
    cluster.reconciler.reconcile("solo")
    assert asked == []
