"""Which of the pool's nodes may be given GPUs: a node is suspect at once when its workers
vanish or its agent is late, and gets no grant until it is heard from again.

Evidence against a node:

- its agent (`herd-operator exporter`, one per node) is *late*: the agent calls every few
  seconds (it says how often, `every`; 5 s) and has missed `late_after_heartbeats` (2)
  calls in a row;
- its workers *vanished*: a job with workers there ended in failure (the reconciler asks
  `exit_verdict` before it records that end), or the allocator saw a job's world size
  drop and took its lost workers' GPUs back (`workers_vanished`, its WorkerLost).

A node with evidence newer than the last time it was heard from is *suspect*: none of its
free GPUs is granted (the allocator asks `unavailable()` in every decision), and it is
probed at once: a TCP connection to its agent's port, or, where no agent ever called, to
its ssh port, where a refusal is an answer too (the node is up). A probe that gets no
answer makes it *lost*: a `NodeLost` event, and it stays cordoned, probed every
`reprobe_seconds`, until it is heard again (its agent's call or an answered probe). It is
then back (`NodeBack`) if its pool source still lists it: Slurm may have taken it out of
the allocation meanwhile. An agent silent for `timeout` (30 s) makes its node lost whatever
the probes say: the node may answer, but nothing there watches its GPUs. The operator's own
node is never suspected for vanished workers: its workers' processes are seen directly.

Jobs running on a suspect or lost node are not moved (see `Allocator.cordon`): Horovod
drops the workers it lost, and the allocator takes their GPUs back when the job's world
size drops. A job that ended because a node of its was lost is not failed for it (the
reconciler relaunches it without counting a restart).

The decisions are pure functions of what was heard and when (`judge`, `probe_due`,
`verdict`); `NodeWatch` applies them: it probes, cordons and tells.
"""

from __future__ import annotations

import enum
import logging
import math
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace

from herd_operator.controllers.ports import NodeVerdict
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.specs.values import Pool

log = logging.getLogger(__name__)

DEFAULT_NODE_TIMEOUT_SECONDS = 30.0
DEFAULT_AGENT_EVERY_SECONDS = 5.0
"""How often an agent calls when it does not say (agents before `every` was sent)."""
LATE_AFTER_HEARTBEATS = 2.0
"""An agent that missed this many calls in a row is late: its node is suspect."""
REPROBE_SECONDS = 2.0
PROBE_TIMEOUT_SECONDS = 2.0
VERDICT_SECONDS = 15.0
"""The longest an exit verdict waits for a node to be heard: no answer by then is a loss."""
SSH_PORT = 22
CHECK_SECONDS = 0.5
EXITS_KEPT = 4096
"""Launches whose exit verdict is kept (a verdict asked again gives the same answer), and
jobs whose lost workers' nodes are kept: the newest, so a long run's memory stays bounded."""

NodeListener = Callable[[str, bool, str], None]
"""(host, lost, why): told when a node is lost (lost=True) or back."""
Probe = Callable[[str, int, float, bool], bool]
"""(host, port, timeout, refusal answers) -> whether the node answered."""


class NodeState(enum.Enum):
    OK = "ok"
    SUSPECT = "suspect"
    LOST = "lost"


@dataclass(frozen=True)
class NodeFacts:
    """What was heard of one node and when (monotonic seconds)."""

    agent_heard: float | None = None
    """The agent's last call; None: no agent ever called."""
    agent_every: float | None = None
    """How often the agent said it calls."""
    agent_port: int | None = None
    """Where the agent serves (the probe's target)."""
    answered: float | None = None
    """When the latest probe that got an answer was started."""
    unanswered: float | None = None
    """When the latest probe that got no answer was started."""
    vanished: float | None = None
    """When workers there were last seen to vanish."""
    probing: bool = False
    """A probe is under way."""


@dataclass(frozen=True)
class WatchRules:
    late_after_heartbeats: float = LATE_AFTER_HEARTBEATS
    timeout: float = DEFAULT_NODE_TIMEOUT_SECONDS
    reprobe_seconds: float = REPROBE_SECONDS
    verdict_seconds: float = VERDICT_SECONDS


@dataclass(frozen=True)
class Judgement:
    state: NodeState
    why: str = ""
    since: float = -math.inf
    """When the evidence that makes it suspect or lost arose."""
    probe_helps: bool = True
    """False when only the agent's own call can clear it (silent past the timeout)."""


OK = Judgement(NodeState.OK)


def heard(facts: NodeFacts) -> float | None:
    """The last time the node answered: its agent's call or a probe."""
    times = [t for t in (facts.agent_heard, facts.answered) if t is not None]
    return max(times) if times else None


def evidence(facts: NodeFacts, now: float, rules: WatchRules) -> tuple[float, str] | None:
    """The newest evidence against the node, and what it is; None without any."""
    found: list[tuple[float, str]] = []
    if facts.vanished is not None:
        found.append((facts.vanished, "workers there vanished"))
    if facts.agent_heard is not None:
        every = facts.agent_every or DEFAULT_AGENT_EVERY_SECONDS
        late = facts.agent_heard + rules.late_after_heartbeats * every
        if now > late:
            silent = now - facts.agent_heard
            why = f"its agent (which calls every {every:g} s) has not called for {silent:.0f} s"
            found.append((late, why))
    return max(found) if found else None


def judge(facts: NodeFacts, now: float, rules: WatchRules) -> Judgement:
    """Whether the node may be given GPUs (OK), is suspect, or is lost, and why."""
    if facts.agent_heard is not None and now - facts.agent_heard > rules.timeout:
        return Judgement(
            NodeState.LOST,
            f"no call from its agent for over {rules.timeout:g} s",
            facts.agent_heard + rules.timeout,
            probe_helps=False,
        )
    found = evidence(facts, now, rules)
    if found is None:
        return OK
    at, why = found
    last = heard(facts)
    if last is not None and last >= at:
        return OK
    if facts.unanswered is not None and facts.unanswered >= at:
        return Judgement(NodeState.LOST, f"{why}, and a probe got no answer", at)
    return Judgement(NodeState.SUSPECT, why, at)


def probe_due(facts: NodeFacts, judgement: Judgement, now: float, rules: WatchRules) -> bool:
    """Whether to probe the node now: at once when it turns suspect, then every
    `reprobe_seconds` while it is lost (one probe at a time)."""
    if facts.probing or judgement.state is NodeState.OK or not judgement.probe_helps:
        return False
    if judgement.state is NodeState.SUSPECT:
        return True
    starts = [t for t in (facts.answered, facts.unanswered) if t is not None]
    return not starts or now - max(starts) >= rules.reprobe_seconds


def verdict(
    facts: Mapping[str, NodeFacts],
    hosts: Iterable[str],
    at: float,
    now: float,
    rules: WatchRules,
    lost: Collection[str] = (),
) -> NodeVerdict:
    """Which of `hosts`, where a job's workers ran when it ended in failure at `at`, were lost
    (the end is theirs), and which are not heard from since (ask again). A host that left
    the pool (not in `facts`), that is lost now, or that a probe after `at` did not reach was
    lost; one heard after `at` was not; one still silent `verdict_seconds` after `at` was.
    """
    found: list[str] = []
    waiting: list[str] = []
    for host in sorted(set(hosts)):
        node = facts.get(host)
        if node is None or host in lost:
            found.append(host)
            continue
        if judge(node, now, rules).state is NodeState.LOST or (
            node.unanswered is not None and node.unanswered >= at
        ):
            found.append(host)
            continue
        last = heard(node)
        if last is not None and last >= at:
            continue
        (found if now - at > rules.verdict_seconds else waiting).append(host)
    return NodeVerdict(lost=tuple(found), waiting=tuple(waiting))


def tcp_probe(host: str, port: int, timeout: float, refusal_answers: bool) -> bool:
    """Whether `host` answers a TCP connection to `port` within `timeout` seconds (a refused
    connection counts when `refusal_answers`: the node's network stack replied)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return refusal_answers
    except OSError:
        return False


@dataclass(frozen=True)
class _Round:
    """What one check of the watch found (`NodeWatch._judge_all`)."""

    judged: dict[str, Judgement]
    probes: dict[str, int | None]
    """The nodes to probe now, with their agent's port (None: none known)."""
    newly_lost: set[str]
    maybe_back: set[str]
    """Nodes told lost that are judged OK now: back if their pool source still lists them."""
    newly_suspect: set[str]


def _in_a_thread(work: Callable[[], None]) -> None:
    threading.Thread(target=work, name="node-probe", daemon=True).start()


class NodeWatch:
    """Follows the pool's nodes (see the module's docstring).

    Thread-safe. `heartbeat` (the RPC thread), `workers_vanished` (the allocator, under its
    lock) and `unavailable` (the allocator's decisions) only read or record, and never call
    out; the watch thread (`check`) probes, publishes the cordon and tells the listener.
    """

    def __init__(
        self,
        pool: Pool,
        cordon: Callable[[set[str]], None],
        timeout: float = DEFAULT_NODE_TIMEOUT_SECONDS,
        on_node: NodeListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        local_hosts: Collection[str] = (),
        probe: Probe = tcp_probe,
        probe_timeout: float = PROBE_TIMEOUT_SECONDS,
        run_probe: Callable[[Callable[[], None]], None] = _in_a_thread,
        still_listed: Callable[[str], bool] = lambda host: True,
        rules: WatchRules | None = None,
        health: LoopHealth | None = None,
    ) -> None:
        """`local_hosts`: this host's names (never suspected for vanished workers).
        `still_listed(host)`: asked before a lost node is back; False keeps it out (its
        pool source no longer lists it). `run_probe` runs a probe (a thread by default)."""
        self.hosts = {host for host, _ in pool.hosts}
        self.cordon = cordon
        self.rules = rules or WatchRules(timeout=timeout)
        self.timeout = self.rules.timeout
        self.on_node = on_node
        self.clock = clock
        self.local_hosts = frozenset(local_hosts)
        self.probe = probe
        self.probe_timeout = probe_timeout
        self.run_probe = run_probe
        self.still_listed = still_listed
        self._facts: dict[str, NodeFacts] = {}
        self._lost: set[str] = set()
        """Nodes told lost (NodeLost) and not yet back."""
        self._suspect: set[str] = set()
        self._published: frozenset[str] = frozenset()
        self._exits: OrderedDict[str, tuple[frozenset[str], float]] = OrderedDict()
        self._vanished_by_job: OrderedDict[str, set[str]] = OrderedDict()
        """Per job, the nodes where it lost workers (asked too when it ends in failure)."""
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._loop = Periodic(
            "node-watch",
            self.check,
            CHECK_SECONDS,
            what="the node watch's check",
            health=health,
            # A lost node must still be said within seconds of a check that works again.
            max_backoff=4 * CHECK_SECONDS,
        )
        self._wake = self._loop.wake
        self.name = self._loop.name

    # ---- what others call ----

    def heartbeat(self, host: str, port: int | None = None, every: float | None = None) -> None:
        """The agent of `host` called now (hosts outside the pool are ignored): it serves on
        `port` and calls every `every` seconds."""
        with self._lock:
            if host not in self.hosts:
                return
            facts = self._facts.get(host, NodeFacts())
            self._facts[host] = replace(
                facts,
                agent_heard=self.clock(),
                agent_every=every if every is not None else facts.agent_every,
                agent_port=port if port is not None else facts.agent_port,
            )
            doubted = host in self._lost or host in self._suspect
        if doubted:
            self._wake()

    def workers_vanished(self, job: str, hosts: Collection[str]) -> None:
        """`job` lost workers that ran on `hosts` (the allocator's WorkerLost): they are
        suspect from now on, until heard from."""
        with self._lock:
            remote = self._remote(hosts)
            self._mark_vanished(remote, self.clock())
            if remote:
                self._vanished_by_job.setdefault(job, set()).update(remote)
                self._vanished_by_job.move_to_end(job)
                while len(self._vanished_by_job) > EXITS_KEPT:
                    self._vanished_by_job.popitem(last=False)
        if remote:
            self._wake()

    def exit_verdict(self, key: str, job: str, hosts: Collection[str]) -> NodeVerdict:
        """A launch (`key`) of `job` whose workers ran on `hosts` ended in failure: which of
        them were lost, and which are not heard from yet (ask again). The first call for a
        launch makes them suspect, with the hosts where the job lost workers before."""
        with self._lock:
            now = self.clock()
            entry = self._exits.get(key)
            if entry is None:
                asked = self._remote(set(hosts) | self._vanished_by_job.pop(job, set()))
                self._mark_vanished(asked, now)
                entry = self._exits[key] = (frozenset(asked), now)
                while len(self._exits) > EXITS_KEPT:
                    self._exits.popitem(last=False)
            considered, at = entry
            result = verdict(self._facts, considered, at, now, self.rules, self._lost)
        if result.waiting:
            self._wake()
        return result

    def unavailable(self) -> frozenset[str]:
        """The nodes none of whose free GPUs may be granted now: suspect or lost."""
        with self._lock:
            now = self.clock()
            doubted = {
                host
                for host, facts in self._facts.items()
                if judge(facts, now, self.rules).state is not NodeState.OK
            }
            return frozenset(doubted | self._lost)

    def lost(self) -> set[str]:
        with self._lock:
            return set(self._lost)

    def set_pool(self, pool: Pool) -> None:
        """The pool changed: nodes that left it are forgotten (and are never back while it
        does not list them: their agents' calls are ignored)."""
        with self._lock:
            self.hosts = {host for host, _ in pool.hosts}
            self._facts = {h: f for h, f in self._facts.items() if h in self.hosts}
            self._lost &= self.hosts
            self._suspect &= self.hosts
        self._wake()

    # ---- the watch ----

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self._loop.stop(timeout)

    def check(self) -> set[str]:
        """Judge every node: probe those due, tell and cordon those lost or back; returns
        the nodes newly lost."""
        with self._lock:
            now = self.clock()
            found = self._judge_all(now)
        judged = found.judged
        for host in sorted(found.newly_suspect):
            log.info("node %s is suspect: %s; no GPU of it is granted until it answers",
                     host, judged[host].why)  # fmt: skip
        for host in sorted(found.newly_lost):
            why = judged[host].why
            log.warning("node %s is lost: %s", host, why)
            self._tell(host, True, why)
        back = {host for host in sorted(found.maybe_back) if self.still_listed(host)}
        if back:
            with self._lock:
                self._lost -= back
            for host in sorted(back):
                log.warning("node %s is back: it answered again", host)
                self._tell(host, False, "it answered again")
        for host, port in found.probes.items():
            self._start_probe(host, port, now)
        self._publish()
        return found.newly_lost

    def _judge_all(self, now: float) -> _Round:
        """(Under the lock.) Judge every node, mark those due a probe as probing, and
        record the nodes newly lost and the suspect ones."""
        judged = {host: judge(facts, now, self.rules) for host, facts in self._facts.items()}
        due = [
            host
            for host, judgement in judged.items()
            if probe_due(self._facts[host], judgement, now, self.rules)
        ]
        for host in due:
            self._facts[host] = replace(self._facts[host], probing=True)
        probes = {host: self._facts[host].agent_port for host in due}
        newly_lost = {
            host
            for host, judgement in judged.items()
            if judgement.state is NodeState.LOST and host not in self._lost
        }
        self._lost |= newly_lost
        maybe_back = {host for host in self._lost if judged.get(host, OK).state is NodeState.OK}
        suspect = {
            h for h, j in judged.items() if j.state is NodeState.SUSPECT and h not in self._lost
        }
        newly_suspect, self._suspect = suspect - self._suspect, suspect
        return _Round(judged, probes, newly_lost, maybe_back, newly_suspect)

    def _publish(self) -> None:
        """Hand the allocator the nodes it may not grant from, when they changed. Serialized,
        and read inside the serialization, so the last cordon is the newest."""
        with self._publish_lock:
            current = self.unavailable()
            if current == self._published:
                return
            try:
                self.cordon(set(current))
            except Exception as err:  # tried again at the next check; the allocator asks
                # `unavailable()` in every decision meanwhile, so no grant goes astray
                log.warning("cannot cordon %s yet: %s", ", ".join(sorted(current)) or "none", err)
                return
            self._published = current

    def _start_probe(self, host: str, port: int | None, started: float) -> None:
        target, refusal_answers = (port, False) if port is not None else (SSH_PORT, True)

        def work() -> None:
            answered = False
            try:
                answered = self.probe(host, target, self.probe_timeout, refusal_answers)
            except Exception:  # a probe that fails is a node that did not answer
                log.exception("probing node %s", host)
            with self._lock:
                facts = self._facts.get(host)
                if facts is None:
                    return  # it left the pool meanwhile
                if answered:
                    facts = replace(facts, answered=max(started, facts.answered or -math.inf))
                else:
                    facts = replace(facts, unanswered=max(started, facts.unanswered or -math.inf))
                self._facts[host] = replace(facts, probing=False)
            log.debug("probe of %s:%d: %s", host, target, "answered" if answered else "no answer")
            self._wake()

        self.run_probe(work)

    # ---- helpers (under the lock) ----

    def _remote(self, hosts: Iterable[str]) -> set[str]:
        return {host for host in hosts if host in self.hosts and host not in self.local_hosts}

    def _mark_vanished(self, hosts: Iterable[str], now: float) -> None:
        for host in hosts:
            facts = self._facts.get(host, NodeFacts())
            self._facts[host] = replace(facts, vanished=max(now, facts.vanished or -math.inf))

    def _tell(self, host: str, lost: bool, why: str) -> None:
        if self.on_node is not None:
            self.on_node(host, lost, why)
