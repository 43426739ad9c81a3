"""Which nodes may be given GPUs: suspect at once when workers vanish there or the agent is
late, lost when a probe then gets no answer, back when heard again (issue 25, item 2).

The decisions (`judge`, `probe_due`, `verdict`) are pure and tested on every combination of
what was heard and when; `NodeWatch` is driven with a clock that moves only when told and
probes that answer as the test says, with the real allocator where grants matter.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.controllers.ports import NodeVerdict
from herd_operator.layout import StateLayout
from herd_operator.rpc.protocol import BadRequest
from herd_operator.runtime.allocator import Allocator
from herd_operator.runtime.engines.horovod import GrantPublisher
from herd_operator.runtime.handlers import heard_from
from herd_operator.runtime.pools.heartbeat import (
    SSH_PORT,
    NodeFacts,
    NodeState,
    NodeWatch,
    WatchRules,
    heard,
    judge,
    probe_due,
    tcp_probe,
    verdict,
)
from herd_operator.specs.values import Demand, Placement, Pool

THREE = Pool.from_counts({"h1": 2, "h2": 2, "h3": 2})
RULES = WatchRules(late_after_heartbeats=2, timeout=30, reprobe_seconds=2, verdict_seconds=15)
EVERY = 5.0
GUARD_S = 10.0
"""A hang guard for threads that must finish; never a performance expectation."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---- judge: OK, suspect or lost, from what was heard and when ----


def test_a_node_nothing_was_heard_of_and_nothing_vanished_on_is_ok() -> None:
    assert judge(NodeFacts(), 1e9, RULES).state is NodeState.OK


def test_an_agent_is_late_after_two_missed_calls_not_after_the_timeout() -> None:
    facts = NodeFacts(agent_heard=100.0, agent_every=EVERY)
    assert judge(facts, 110.0, RULES).state is NodeState.OK  # two intervals, not more
    late = judge(facts, 110.1, RULES)
    assert late.state is NodeState.SUSPECT and late.since == 110.0
    assert "has not called for 10 s" in late.why
    # An agent that did not say how often it calls is taken to call every 5 s.
    assert judge(NodeFacts(agent_heard=100.0), 110.1, RULES).state is NodeState.SUSPECT


def test_workers_vanished_after_the_last_word_make_a_node_suspect() -> None:
    assert judge(NodeFacts(vanished=50.0), 51.0, RULES).state is NodeState.SUSPECT
    # Heard after it: the node is fine (a worker's own crash).
    answered = NodeFacts(vanished=50.0, answered=50.5)
    assert judge(answered, 51.0, RULES).state is NodeState.OK
    called = NodeFacts(vanished=50.0, agent_heard=52.0, agent_every=EVERY)
    assert judge(called, 53.0, RULES).state is NodeState.OK
    # Heard only before it: suspect.
    before = NodeFacts(vanished=50.0, agent_heard=49.0, agent_every=EVERY)
    assert judge(before, 51.0, RULES).state is NodeState.SUSPECT


def test_a_probe_started_after_the_evidence_that_got_no_answer_makes_it_lost() -> None:
    lost = judge(NodeFacts(vanished=50.0, unanswered=50.0), 53.0, RULES)
    assert lost.state is NodeState.LOST and "a probe got no answer" in lost.why
    # A probe started before the evidence says nothing about it.
    assert judge(NodeFacts(vanished=50.0, unanswered=49.0), 53.0, RULES).state is (
        NodeState.SUSPECT
    )
    # Answered after it failed: back.
    back = NodeFacts(vanished=50.0, unanswered=50.0, answered=60.0)
    assert judge(back, 61.0, RULES).state is NodeState.OK


def test_an_agent_silent_past_the_timeout_is_lost_whatever_the_probes_say() -> None:
    facts = NodeFacts(agent_heard=100.0, agent_every=EVERY, answered=125.0)
    assert judge(facts, 129.0, RULES).state is NodeState.OK  # late, but a probe answered
    silent = judge(facts, 130.5, RULES)
    assert (silent.state, silent.probe_helps) == (NodeState.LOST, False)
    assert judge(NodeFacts(agent_heard=131.0, agent_every=EVERY), 131.5, RULES).state is (
        NodeState.OK
    )


times = st.one_of(st.none(), st.sampled_from([0.0, 10.0, 20.0, 25.0, 40.0, 60.0]))


@given(
    agent_heard=times,
    every=st.sampled_from([None, 1.0, 5.0, 20.0]),
    answered=times,
    unanswered=times,
    vanished=times,
    now=st.sampled_from([0.0, 15.0, 30.0, 45.0, 61.0, 100.0]),
)
def test_a_node_is_ok_exactly_when_it_was_heard_after_all_evidence(
    agent_heard: float | None,
    every: float | None,
    answered: float | None,
    unanswered: float | None,
    vanished: float | None,
    now: float,
) -> None:
    """The promise, on every combination: a node gets grants (OK) only when it was heard
    after every piece of evidence against it and its agent is not silent past the timeout;
    it is lost only when a probe after the evidence went unanswered, or past the timeout."""
    facts = NodeFacts(agent_heard, every, None, answered, unanswered, vanished)
    state = judge(facts, now, RULES).state
    evidence_times = [t for t in (vanished,) if t is not None]
    if agent_heard is not None:
        late_at = agent_heard + RULES.late_after_heartbeats * (every or EVERY)
        if now > late_at:
            evidence_times.append(late_at)
    last = heard(facts)
    silent = agent_heard is not None and now - agent_heard > RULES.timeout
    cleared = not evidence_times or (last is not None and last >= max(evidence_times))
    assert (state is NodeState.OK) == (cleared and not silent)
    if state is NodeState.LOST and not silent:
        assert unanswered is not None and unanswered >= max(evidence_times)


# ---- probe_due ----


@pytest.mark.parametrize(
    ("facts", "now", "due"),
    [
        (NodeFacts(), 10.0, False),  # OK: never probed
        (NodeFacts(vanished=5.0), 10.0, True),  # suspect: at once
        (NodeFacts(vanished=5.0, probing=True), 10.0, False),  # one at a time
        (NodeFacts(vanished=5.0, unanswered=5.0), 6.0, False),  # lost: every 2 s
        (NodeFacts(vanished=5.0, unanswered=5.0), 7.0, True),
        (NodeFacts(agent_heard=0.0, agent_every=EVERY, answered=50.0), 40.0, False),
        (NodeFacts(agent_heard=0.0, agent_every=EVERY), 31.0, False),  # only its call helps
    ],
)
def test_a_probe_is_due_when_suspect_at_once_and_when_lost_every_few_seconds(
    facts: NodeFacts, now: float, due: bool
) -> None:
    assert probe_due(facts, judge(facts, now, RULES), now, RULES) is due


# ---- verdict: was a failed job's end its node's? ----


def test_the_verdict_on_a_failed_jobs_nodes() -> None:
    facts = {
        "heard": NodeFacts(vanished=10.0, answered=10.5),
        "called": NodeFacts(vanished=10.0, agent_heard=12.0, agent_every=EVERY),
        "mute": NodeFacts(vanished=10.0, unanswered=10.0),
        "waiting": NodeFacts(vanished=10.0),
        "lost-before": NodeFacts(vanished=10.0, answered=11.0),
    }
    result = verdict(facts, [*facts, "gone"], 10.0, 12.0, RULES, lost={"lost-before"})
    assert result == NodeVerdict(lost=("gone", "lost-before", "mute"), waiting=("waiting",))
    # No answer within verdict_seconds is a loss.
    assert verdict(facts, ["waiting"], 10.0, 25.1, RULES) == NodeVerdict(lost=("waiting",))
    assert verdict(facts, ["heard", "called"], 10.0, 11.0, RULES) == NodeVerdict()


# ---- NodeWatch ----


class Probes:
    """Probes that run at once and answer as the test says; records what was probed."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.calls: list[tuple[str, int, bool]] = []

    def __call__(self, host: str, port: int, timeout: float, refusal_answers: bool) -> bool:
        self.calls.append((host, port, refusal_answers))
        return host not in self.down


class Watched:
    def __init__(self, pool: Pool = THREE, local: set[str] | None = None) -> None:
        self.clock = Clock()
        self.probes = Probes()
        self.cordons: list[set[str]] = []
        self.told: list[tuple[str, bool]] = []
        self.listed = {host for host, _ in pool.hosts}
        self.watch = NodeWatch(
            pool,
            self.cordons.append,
            on_node=lambda host, lost, why: self.told.append((host, lost)),
            clock=self.clock,
            local_hosts=local or set(),
            probe=self.probes,
            run_probe=lambda work: work(),
            still_listed=lambda host: host in self.listed,
            rules=RULES,
        )


def settle(w: Watched) -> None:
    """Probe what is due (the probes answer at once here), then judge their answers."""
    w.watch.check()
    w.watch.check()


def test_a_node_whose_agent_is_late_is_suspect_at_once_and_lost_when_it_does_not_answer() -> None:
    w = Watched()
    for host in ("h1", "h2"):
        w.watch.heartbeat(host, port=9400, every=EVERY)
    w.clock.now += 10.5  # two calls missed: not the 30 s timeout
    w.probes.down = {"h2"}
    w.watch.heartbeat("h1", port=9400, every=EVERY)
    assert w.watch.unavailable() == {"h2"}, "suspect before any probe ran"
    assert w.watch.check() == set()  # probes h2: its answer is judged at the next check
    assert w.watch.check() == {"h2"}
    # The agent's own port is probed: a refusal there is no answer (the agent is gone).
    assert w.probes.calls == [("h2", 9400, False)]
    assert w.told == [("h2", True)] and w.cordons == [{"h2"}] and w.watch.lost() == {"h2"}
    assert w.watch.check() == set() and len(w.told) == 1  # said once
    w.clock.now += 1
    w.watch.heartbeat("h2", port=9400, every=EVERY)
    w.watch.check()
    assert w.told[-1] == ("h2", False) and w.cordons[-1] == set() and not w.watch.lost()


def test_a_node_where_no_agent_runs_is_probed_on_its_ssh_port_and_comes_back_by_a_probe() -> None:
    w = Watched()
    w.watch.workers_vanished("wide", {"h2", "h3"})
    assert w.watch.unavailable() == {"h2", "h3"}
    w.probes.down = {"h3"}
    settle(w)
    assert sorted(w.probes.calls) == [("h2", SSH_PORT, True), ("h3", SSH_PORT, True)]
    assert w.watch.unavailable() == {"h3"} and w.told == [("h3", True)]
    w.probes.down = set()
    w.clock.now += 1.0
    w.watch.check()  # not yet: lost nodes are probed every 2 s
    assert w.watch.lost() == {"h3"}
    w.clock.now += 1.0
    settle(w)  # probed, answered, judged
    assert w.watch.lost() == set() and w.told[-1] == ("h3", False)
    assert w.watch.unavailable() == set() and w.cordons[-1] == set()


def test_the_operators_own_node_is_never_suspected_for_vanished_workers() -> None:
    w = Watched(local={"h1"})
    w.watch.workers_vanished("wide", {"h1", "h2"})
    assert w.watch.unavailable() == {"h2"}
    assert w.watch.exit_verdict("launch-1", "solo", ["h1"]) == NodeVerdict()


def test_a_failed_jobs_verdict_waits_for_its_nodes_and_is_the_same_when_asked_again() -> None:
    w = Watched(local={"h1"})
    w.probes.down = {"h3"}
    first = w.watch.exit_verdict("launch-1", "solo", ["h1", "h3"])
    assert first == NodeVerdict(waiting=("h3",)) and w.watch.unavailable() == {"h3"}
    settle(w)
    assert w.watch.exit_verdict("launch-1", "solo", ["h1", "h3"]) == NodeVerdict(lost=("h3",))
    # It came back since: the verdict on that launch stands (a probe after its end failed).
    w.probes.down = set()
    w.clock.now += 3
    settle(w)
    assert w.watch.lost() == set()
    assert w.watch.exit_verdict("launch-1", "solo", ["h1", "h3"]) == NodeVerdict(lost=("h3",))
    # A later launch's failure on the same, healthy node is the job's own.
    w.clock.now += 60
    assert w.watch.exit_verdict("launch-2", "solo", ["h3"]) == NodeVerdict(waiting=("h3",))
    w.watch.check()
    assert w.watch.exit_verdict("launch-2", "solo", ["h3"]) == NodeVerdict()


def test_a_failed_jobs_verdict_counts_the_nodes_it_lost_workers_on_before() -> None:
    """The job first lost its workers on h3 (WorkerLost: its grant no longer names h3), and
    ended later: h3 is asked too."""
    w = Watched(local={"h1"})
    w.probes.down = {"h3"}
    w.watch.workers_vanished("wide", {"h1", "h2", "h3"})
    settle(w)
    assert w.watch.exit_verdict("launch-1", "wide", ["h1", "h2"]) == NodeVerdict(lost=("h3",))


def test_a_node_its_pool_source_no_longer_lists_is_not_back() -> None:
    w = Watched()
    w.watch.heartbeat("h3", port=9400, every=EVERY)
    w.clock.now += 11
    w.probes.down = {"h3"}
    settle(w)
    assert w.watch.lost() == {"h3"}
    w.listed.discard("h3")  # Slurm took it out of the allocation meanwhile
    w.watch.heartbeat("h3", port=9400, every=EVERY)  # its link is back, and its agent calls
    settle(w)
    assert w.watch.lost() == {"h3"} and ("h3", False) not in w.told
    w.watch.set_pool(Pool.from_counts({"h1": 2, "h2": 2}))
    w.watch.heartbeat("h3", port=9400, every=EVERY)
    w.watch.check()
    assert w.watch.unavailable() == set() and ("h3", False) not in w.told
    assert w.watch.exit_verdict("launch-1", "solo", ["h3"]) == NodeVerdict()


def test_a_host_outside_the_pool_is_ignored() -> None:
    w = Watched()
    w.watch.heartbeat("login1")
    w.watch.workers_vanished("wide", {"login1"})
    w.clock.now += 100
    assert w.watch.check() == set() and not w.told and not w.cordons
    assert w.watch.unavailable() == set()


def test_registration_is_the_heartbeat_with_the_agents_port_and_interval() -> None:
    heard_args: list[tuple[str, int | None, float | None]] = []

    class Nodes:
        def heartbeat(self, host: str, port: int | None = None, every: float | None = None) -> None:
            heard_args.append((host, port, every))

    def register(args: dict[str, Any]) -> dict[str, Any]:
        return {"ok": args["port"]}

    serve = heard_from(Nodes(), register)
    assert serve({"host": "h2", "port": 9411, "every": 5}) == {"ok": 9411}
    assert serve({"host": "h2", "port": 9411}) == {"ok": 9411}  # an agent of before
    assert heard_args == [("h2", 9411, 5.0), ("h2", 9411, None)]
    for bad in (0, -1, True, "5", math.inf, 1e9):
        with pytest.raises(BadRequest, match="'every'"):
            serve({"host": "h2", "port": 9411, "every": bad})


def test_the_tcp_probe_tells_an_answer_a_refusal_and_silence_apart() -> None:
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert tcp_probe("127.0.0.1", port, 2.0, refusal_answers=False)
    # Closed now: refused, which is an answer only where the node's stack is what we ask.
    assert not tcp_probe("127.0.0.1", port, 2.0, refusal_answers=False)
    assert tcp_probe("127.0.0.1", port, 2.0, refusal_answers=True)


# ---- with the allocator ----


def allocator_with(w: Watched, tmp_path: Path, pool: Pool = THREE) -> Allocator:
    layout = StateLayout(tmp_path)
    layout.create()
    allocator = Allocator(
        pool,
        GrantPublisher(layout),
        virtual=True,
        drain_seconds=0,
        min_resize_interval=0,
        unavailable_hosts=w.watch.unavailable,
        on_workers_lost=w.watch.workers_vanished,
    )
    w.watch.cordon = allocator.cordon
    return allocator


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


def test_gpus_given_back_by_workers_that_vanished_go_to_nobody_until_their_node_answers(
    tmp_path: Path,
) -> None:
    """Without agents (`--hosts h1:2,h2:2`, the operator on neither): `wide`'s workers on h2
    vanish with its link. The decision that takes their GPUs back must not hand them to the
    job waiting for GPUs: h2 is suspect from the WorkerLost on, lost once a probe fails."""
    pool = Pool.from_counts({"h1": 2, "h2": 2})
    w = Watched(pool)
    allocator = allocator_with(w, tmp_path, pool)
    allocator.request(Demand("wide", 2, 4, 4, arrival=1.0, priority=1))
    allocator.request(Demand("pair", 2, 2, 2, arrival=2.0))
    assert allocator.placements()["wide"].size == 4 and not allocator.placements()["pair"].size
    allocator.observe_world_size("wide", 4)
    allocator.observe_world_size("wide", 2)  # h2's two workers are gone
    assert dict(allocator.placements()["wide"].hosts) == {"h1": (0, 1)}
    assert not allocator.placements()["pair"].size, "h2's GPUs went to pair before h2 answered"
    w.probes.down = {"h2"}
    settle(w)  # h1 answers, h2 does not
    assert w.told == [("h2", True)]
    allocator.request(Demand("pair", 2, 2, 2, arrival=2.0, priority=-1))
    assert not allocator.placements()["pair"].size
    w.probes.down = set()
    w.clock.now += RULES.reprobe_seconds
    settle(w)
    assert w.told[-1] == ("h2", False)
    # Back: its GPUs are granted again (to wide, which wants them and comes first).
    assert dict(allocator.placements()["wide"].hosts) == {"h1": (0, 1), "h2": (0, 1)}


def test_every_state_pair_of_two_nodes_grants_only_from_ok_nodes(tmp_path: Path) -> None:
    """A decision never grants a free GPU of a suspect or lost node, whichever mix of
    states two nodes are in."""
    pool = Pool.from_counts({"h2": 1, "h3": 1})
    for index, states in enumerate(itertools.product(("ok", "suspect", "lost"), repeat=2)):
        w = Watched(pool)
        allocator = allocator_with(w, tmp_path / str(index), pool)
        hosts = dict(zip(("h2", "h3"), states, strict=True))
        w.probes.down = {host for host, state in hosts.items() if state == "lost"}
        w.watch.workers_vanished("gone", {h for h, state in hosts.items() if state == "lost"})
        settle(w)
        w.watch.workers_vanished("gone", {h for h, state in hosts.items() if state == "suspect"})
        assert {h for h in hosts if judge_of(w, h) != "ok"} == set(w.watch.unavailable())
        allocator.request(Demand("job", 1, 2, 2, arrival=1.0))
        granted = {host for host, _ in allocator.placements()["job"].hosts}
        assert granted == {host for host, state in hosts.items() if state == "ok"}, hosts


def judge_of(w: Watched, host: str) -> str:
    return (
        "ok"
        if host not in w.watch.unavailable()
        else "lost"
        if host in w.watch.lost()
        else "suspect"
    )


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


def test_the_watchs_cordon_takes_the_store_before_the_allocators_lock(tmp_path: Path) -> None:
    """The RPC thread holds a store group (a turn's reports) and then asks the allocator
    (a report's world size); the node watch's cordon, on its own thread, decides and writes
    the decision to the store. Were it to hold the allocator's lock while it waits for the
    store, both would wait for ever: that stopped an operator in a run of the Slurm test."""
    from herd_operator.runtime.config import OperatorConfig
    from herd_operator.runtime.operator import Operator
    from herd_operator.runtime.pools import StaticPool
    from herd_operator.runtime.store import Store

    deciding = threading.Event()
    with Store(tmp_path / "state.db") as store:

        def record(placements: Mapping[str, Placement]) -> None:
            deciding.set()
            store.record_pool_size(THREE.size, 0.0)  # a decision's write, under the store's lock

        layout = StateLayout(tmp_path / "state")
        layout.create()
        allocator = Allocator(
            THREE, GrantPublisher(layout), virtual=True, drain_seconds=0, on_decision=record
        )
        allocator.request(Demand("wide", 2, 6, 6, arrival=1.0))
        operator = Operator(
            OperatorConfig(tmp_path / "jobs", tmp_path / "state", StaticPool(THREE, True, "3"))
        )
        operator.store, operator.allocator = store, allocator
        deciding.clear()
        done: list[str] = []

        def rpc_turn() -> None:
            with store.transaction():
                watch.start()
                deciding.wait(1.0)  # the wrong order decides at once, under the lock
                allocator.observe_world_size("wide", 6)
            done.append("rpc")

        def cordon() -> None:
            operator._cordon({"h3"})
            done.append("watch")

        watch = threading.Thread(target=cordon, daemon=True)
        rpc = threading.Thread(target=rpc_turn, daemon=True)
        rpc.start()
        rpc.join(GUARD_S)
        watch.join(GUARD_S)
        assert sorted(done) == ["rpc", "watch"], "the two threads wait for each other"


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


def test_the_node_lost_event_names_the_jobs_that_still_hold_gpus_there(tmp_path: Path) -> None:
    """Issue 25, item 8: the event said "no GPU of it is granted" while a job held 2 there."""
    from herd_operator.runtime.config import OperatorConfig
    from herd_operator.runtime.operator import Operator
    from herd_operator.runtime.pools import StaticPool
    from herd_operator.runtime.store import Store

    layout = StateLayout(tmp_path / "state")
    layout.create()
    allocator = Allocator(THREE, GrantPublisher(layout), virtual=True, drain_seconds=0)
    allocator.request(Demand("wide", 5, 5, 5, arrival=1.0))
    allocator.request(Demand("solo", 1, 1, 1, arrival=2.0))
    with Store(tmp_path / "state.db") as store:
        operator = Operator(
            OperatorConfig(tmp_path / "jobs", tmp_path / "state", StaticPool(THREE, True, "3"))
        )
        operator.store, operator.allocator = store, allocator
        operator._node_event("h3", True, "workers there vanished, and a probe got no answer")
        operator._node_event("h3", False, "it answered again")
        lost, back = store.events(None)[-2:]
    assert (lost.reason, back.reason) == ("NodeLost", "NodeBack")
    assert lost.message == (
        "node h3 lost: workers there vanished, and a probe got no answer. None of its free GPUs"
        " is granted until it answers; GPUs still held there, by jobs left to Horovod:"
        " solo 1, wide 1"
    )
    assert back.message == "node h3 is back: it answered again"
