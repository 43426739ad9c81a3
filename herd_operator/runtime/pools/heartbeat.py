"""Nodes whose agent goes silent are cordoned, and freed when it is heard again.

Each node's agent (`herd-operator exporter`, one per node, e.g. `srun --overlap
--ntasks-per-node=1`) calls the operator every few seconds. `NodeWatch` follows those
calls: a node whose agent was heard once and then not for `timeout` seconds (its link, its
agent or the node is gone) is cordoned (Kubernetes' word for a node that takes no new
work): none of its free GPUs is granted, and its GPUs that jobs gave back stay unused. The
jobs running there are not moved by the operator: Horovod drops the workers it lost
(ssh keepalives, Gloo's timeout), the job's smaller world size is observed, and the
allocator takes those GPUs back. At the agent's next call the node is uncordoned and its
GPUs are granted again. A node whose agent was never heard is never cordoned: agents are
optional on a single node.

`lost_nodes` is the decision, a pure function of the last heartbeats and the clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from herd_operator.specs.values import Pool

log = logging.getLogger(__name__)

DEFAULT_NODE_TIMEOUT_SECONDS = 30.0

NodeListener = Callable[[str, bool, str], None]
"""(host, lost, why): told when a node leaves (lost=True) or comes back."""


def lost_nodes(last_heard: Mapping[str, float], now: float, timeout: float) -> set[str]:
    """The nodes whose agent was heard, but not within `timeout` seconds before `now`."""
    return {host for host, heard in last_heard.items() if now - heard > timeout}


class NodeWatch:
    """Cordons the pool's nodes whose agent went silent (see the module's docstring)."""

    def __init__(
        self,
        pool: Pool,
        cordon: Callable[[set[str]], None],
        timeout: float = DEFAULT_NODE_TIMEOUT_SECONDS,
        on_node: NodeListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.hosts = {host for host, _ in pool.hosts}
        self.cordon = cordon
        self.timeout = timeout
        self.on_node = on_node
        self.clock = clock
        self._heard: dict[str, float] = {}
        self._lost: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def lost(self) -> set[str]:
        with self._lock:
            return set(self._lost)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._watch, name="node-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def heartbeat(self, host: str) -> None:
        """The agent of `host` was heard now (hosts outside the pool are ignored)."""
        if host not in self.hosts:
            return
        with self._lock:
            self._heard[host] = self.clock()
            back = host in self._lost
            self._lost.discard(host)
            lost = set(self._lost)
        if back:
            log.warning("node %s is back: its agent was heard again", host)
            self._tell(host, False, "its agent was heard again")
            self.cordon(lost)

    def check(self) -> set[str]:
        """Cordon the nodes that went silent; returns those newly lost."""
        with self._lock:
            silent = lost_nodes(self._heard, self.clock(), self.timeout)
            newly = silent - self._lost
            self._lost |= newly
            lost = set(self._lost)
        for host in sorted(newly):
            why = f"no word from its agent for over {self.timeout:g} s"
            log.warning("node %s cordoned: %s", host, why)
            self._tell(host, True, why)
        if newly:
            self.cordon(lost)
        return newly

    def _watch(self) -> None:
        interval = max(0.2, min(1.0, self.timeout / 4))
        while not self._stop.wait(interval):
            try:
                self.check()
            except Exception:  # the watch must outlive a failing listener
                log.exception("node watch")

    def _tell(self, host: str, lost: bool, why: str) -> None:
        if self.on_node is not None:
            self.on_node(host, lost, why)
