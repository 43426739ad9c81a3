"""The driver's hold of a grow: running workers wait at Horovod's barrier until the new ones
reach the rendezvous, and a grow that does not start in time is given up, not the job.

Apart from the driver's entry point (`hvd_driver`) and from how workers are started
(`hvd_workers`): it is a policy over Horovod's driver with its own decisions, pure and
tested exhaustively (`grow_outcome`, `kept_slots`, `withhold`, `grow_retry_seconds`),
and the two wrappers that apply them (`WithheldSlots` over discovery, `GrowHold` over the
driver's start of new workers).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Any

from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.rendezvous import create_rendezvous_handler

DEFAULT_GROW_TIMEOUT_SECONDS = 120.0
"""How long the running workers of a grow wait for its new workers to reach the rendezvous
(`--grow-timeout-seconds`; the spec's `growTimeoutSeconds`)."""
DEFAULT_GROW_RETRY_SECONDS = 30.0
"""How long the slots of a grow given up are withheld after its first failure (unless the
grant changes first); doubled after each failure in a row, up to `MAX_GROW_RETRY_SECONDS`."""
MAX_GROW_RETRY_SECONDS = 600.0
MAX_GROW_TIMEOUT_SECONDS = 7 * 24 * 3600.0
"""The spec's bound on every timeout."""
GLOO_RENDEZVOUS_SCOPE = "global"
"""The scope under which each worker's `hvd.init()` puts its address on the rendezvous
server (Horovod's Gloo context), with the keys `rank_R` and `R`."""

# The driver's one logger (its entry point gives it a handler), whichever module logs.
log = logging.getLogger("herd.hvd_driver")


def rendezvous_rank(scope: str, key: str) -> int | None:
    """The rank whose worker is at Gloo's rendezvous, from a key it put on the rendezvous
    server (`rank_R` or `R` under `global`); None for every other key."""
    if scope != GLOO_RENDEZVOUS_SCOPE:
        return None
    number = key.removeprefix("rank_")
    return int(number) if number.isascii() and number.isdigit() else None


def kept_slots(new_workers: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Host -> how many of its slots stay in use when the new workers (host, local rank) of a
    grow are given up.

    Horovod numbers the slots of a host 0..n-1 and a grow starts only those no running
    worker holds, so the new workers are the top local ranks of their hosts: each host
    keeps the slots below its lowest new one (none on a host the grow added)."""
    kept: dict[str, int] = {}
    for host, local_rank in new_workers:
        kept[host] = min(local_rank, kept.get(host, local_rank))
    return kept


def withhold(slots: Mapping[str, int], kept: Mapping[str, int]) -> dict[str, int]:
    """`slots` (host -> slots) with at most `kept[host]` on each host `kept` names; a host
    left with none is left out, as a grant without it would be."""
    shown = {host: min(count, kept.get(host, count)) for host, count in slots.items()}
    return {host: count for host, count in shown.items() if count > 0}


def grow_retry_seconds(failures: int, first: float) -> float:
    """How long the slots of a grow given up are withheld after `failures` failed grows in a
    row: `first`, doubled after each further one, at most `MAX_GROW_RETRY_SECONDS` (or
    `first`, if that is longer)."""
    doubled = first * 2.0 ** min(max(failures - 1, 0), 30)
    return max(first, min(doubled, MAX_GROW_RETRY_SECONDS))


class GrowOutcome(enum.Enum):
    WAIT = "wait"
    """Not decided yet: keep the running workers at the barrier."""
    JOINED = "joined"
    """Every new worker is at the rendezvous: let the running ones join it."""
    GIVE_UP = "give up"
    """Stop the new workers; the running ones go on at their old size."""
    LET_GO = "let go"
    """Let the running workers join the rendezvous as Horovod would (the job is stopping,
    or they are too few to go on alone and have waited as long as Horovod waits)."""


def grow_outcome(
    new_ranks: Set[int],
    arrived: Set[int],
    exited: Set[int],
    waited: float,
    timeout: float,
    elastic_timeout: float,
    enough_without: bool,
    stopping: bool,
) -> GrowOutcome:
    """What to do with a grow whose running workers are held at Horovod's barrier.

    `new_ranks`: the ranks of the workers the grow started; `arrived`: those seen at Gloo's
    rendezvous; `exited`: those that ended; `waited`: seconds since they were started;
    `enough_without`: whether the running workers alone make `--min-np`.
    """
    if stopping:
        return GrowOutcome.LET_GO
    if new_ranks & exited:
        return GrowOutcome.GIVE_UP if enough_without else GrowOutcome.LET_GO
    if new_ranks <= arrived:
        return GrowOutcome.JOINED
    if enough_without and waited >= timeout:
        return GrowOutcome.GIVE_UP
    if not enough_without and waited >= elastic_timeout:
        return GrowOutcome.LET_GO
    return GrowOutcome.WAIT


class WithheldSlots(HostDiscovery):  # type: ignore[misc]
    """The job's discovery less the slots of a grow given up (by `GrowHold`).

    They are offered to Horovod again when the grant changes (the operator decided again)
    or when the retry delay has passed, and in either case only once the workers started
    on them have ended: a grow tried again never meets a worker of the one given up.
    """

    def __init__(self, inner: HostDiscovery, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.inner = inner
        self.clock = clock
        self._lock = threading.Lock()
        self._grant: dict[str, int] = {}
        self._kept: dict[str, int] | None = None
        self._withheld_grant: dict[str, int] = {}
        self._until = 0.0
        self._ending = 0

    def withhold(self, kept: Mapping[str, int], seconds: float, workers: int) -> None:
        """Offer at most `kept[host]` slots of each host named there for `seconds`, or until
        the grant changes, and until `workers` workers have told `worker_ended`."""
        with self._lock:
            self._kept = dict(kept)
            self._withheld_grant = dict(self._grant)
            self._until = self.clock() + seconds
            self._ending += workers

    def worker_ended(self) -> None:
        with self._lock:
            self._ending = max(0, self._ending - 1)

    @property
    def withholding(self) -> bool:
        with self._lock:
            return self._kept is not None

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        slots: dict[str, int] = self.inner.find_available_hosts_and_slots()
        with self._lock:
            self._grant = dict(slots)
            if self._kept is None:
                return dict(slots)
            changed = slots != self._withheld_grant
            if self._ending == 0 and (changed or self.clock() >= self._until):
                log.info(
                    "offering the slots of the grow given up again (%s)",
                    "the grant changed" if changed else "retry delay over",
                )
                self._kept = None
                return dict(slots)
            return withhold(slots, self._kept)


class GrowHold:
    """Keeps a grow whose new workers start late from failing the whole job.

    At a grow Horovod's running workers leave its barrier at once, wait at Gloo's
    rendezvous for the new ones, and abort (a C++ exception: nothing to restore from in
    Python) when a new worker is not there within Gloo's timeout; every worker has then
    failed ("failure count == N"), the job ends, and the operator starts it again from its
    first epoch. A new worker on a loaded node can take longer than that to start (the
    interpreter, torch, the script's set-up before `hvd.init()`).

    Horovod starts the new workers inside its barrier's action, while the running ones are
    held at the barrier. This wraps that start to keep them held until every new worker is
    at the rendezvous (it put its address on the rendezvous server): then all meet there
    within seconds, whatever the new ones took to start. A new worker that ends first, or
    that is not there within `timeout` (`--grow-timeout-seconds`), gives the grow up: the new
    workers are stopped, their slots are withheld from Horovod (`WithheldSlots`), the
    running workers are given their old ranks and size and go on with the state they
    hold, and the grow is tried again once the grant changes or after a delay. Running
    workers too few for `--min-np` cannot go on alone: they are held up to
    `elastic_timeout`, then let go as Horovod would.
    """

    def __init__(
        self,
        driver: Any,
        discovery: WithheldSlots,
        timeout: float,
        elastic_timeout: float,
        retry_seconds: float = DEFAULT_GROW_RETRY_SECONDS,
        stopping: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
        period: float = 0.25,
    ) -> None:
        self.driver = driver
        self.discovery = discovery
        self.timeout = timeout
        self.elastic_timeout = elastic_timeout
        self.retry_seconds = retry_seconds
        self.stopping = stopping
        self.clock = clock
        self.period = period
        self.failures = 0
        """Grows given up in a row (the retry delay doubles with each)."""
        self._cond = threading.Condition()
        self._new: dict[int, Any] = {}
        """Rank -> SlotInfo of the workers of the grow being held."""
        self._arrived: set[int] = set()
        self._exited: set[int] = set()
        self._decided = threading.Event()
        self._decided.set()
        self._given_up: set[int] = set()
        """id() of the SlotInfos of workers of grows given up that have not ended yet."""
        self._stops: dict[tuple[str, int], threading.Event] = {}
        self._start = driver._start_worker_processes
        self._record_exit = driver._handle_worker_exit
        driver._start_worker_processes = self._start_and_hold
        driver._handle_worker_exit = self._on_worker_exit

    def stop_events(self, host: str, local_rank: int) -> list[threading.Event]:
        """What stops the worker started last on this slot besides Horovod's events."""
        with self._cond:
            event = self._stops.get((host, local_rank))
        return [] if event is None else [event]

    def put_seen(self, scope: str, key: str) -> None:
        """A key put on the rendezvous server: a new worker may have reached the rendezvous."""
        rank = rendezvous_rank(scope, key)
        if rank is None:
            return
        with self._cond:
            if rank in self._new and rank not in self._arrived:
                self._arrived.add(rank)
                self._cond.notify_all()

    def _start_and_hold(self, pending: Sequence[Any]) -> None:
        pending = list(pending)
        with self._cond:
            for slot in pending:
                self._stops[(slot.hostname, slot.local_rank)] = threading.Event()
        running = self.driver.world_size() - len(pending)
        if not pending or running <= 0:  # the first start: nobody to hold
            self._start(pending)
            return
        decided = threading.Event()
        with self._cond:
            self._new = {slot.rank: slot for slot in pending}
            self._arrived, self._exited = set(), set()
            self._decided = decided
        try:
            began = self.clock()
            self._start(pending)
            size = self.driver.world_size()
            log.info(
                "holding the running workers (%d) until the new ones (%d) reach the "
                "rendezvous, at most %.0f s",
                running,
                len(pending),
                self.timeout,
            )
            outcome, waited, exited = self._wait(began, running >= self.driver._min_num_proc)
            if outcome is GrowOutcome.JOINED:
                self.failures = 0
                log.info(
                    "the new workers are at the rendezvous after %.1f s: %d workers", waited, size
                )
            elif outcome is GrowOutcome.GIVE_UP:
                names = ", ".join(f"{s.hostname}[{s.local_rank}]" for s in pending)
                why = (
                    f"{len(exited)} of its new workers ({names}) ended while starting"
                    if exited
                    else f"its new workers ({names}) were not at the rendezvous in {waited:.0f} s"
                )
                self._give_up(pending, size, why, decided)
            else:
                log.info("letting the running workers join the rendezvous after %.1f s", waited)
        finally:
            with self._cond:
                if self._decided is decided:
                    self._new = {}
            decided.set()

    def _wait(self, began: float, enough_without: bool) -> tuple[GrowOutcome, float, set[int]]:
        with self._cond:
            while True:
                waited = self.clock() - began
                outcome = grow_outcome(
                    set(self._new),
                    self._arrived,
                    self._exited,
                    waited,
                    self.timeout,
                    self.elastic_timeout,
                    enough_without,
                    self.stopping() or self.driver.finished(),
                )
                if outcome is not GrowOutcome.WAIT:
                    return outcome, waited, set(self._exited)
                self._cond.wait(self.period)

    def _give_up(
        self, pending: Sequence[Any], size: int, why: str, decided: threading.Event
    ) -> None:
        self.failures += 1
        retry = grow_retry_seconds(self.failures, self.retry_seconds)
        with self._cond:
            self._given_up.update(id(slot) for slot in pending)
            self._new = {}
            for slot in pending:
                self._stops[(slot.hostname, slot.local_rank)].set()
        driver = self.driver
        with driver._wait_hosts_cond:
            kept = kept_slots((slot.hostname, slot.local_rank) for slot in pending)
            self.discovery.withhold(kept, retry, len(pending))
            driver._host_manager.update_available_hosts()
            more = driver._update_host_assignments(driver._host_manager.current_hosts)
        # The running workers, still at the old barrier, are answered from these
        # assignments: their old size. The next barrier is for them.
        driver._worker_registry.reset(driver.world_size())
        log.warning(
            "gave up the grow to %d: %s; going on at %d, the running workers keep their "
            "state; trying again when the grant changes or in %.0f s",
            size,
            why,
            driver.world_size(),
            retry,
        )
        decided.set()
        if more:  # the grant changed while they were held: start what it adds now
            self._start_and_hold(more)

    def _on_worker_exit(self, slot: Any, exit_code: int, timestamp: float) -> None:
        with self._cond:
            held = self._new.get(slot.rank) is slot
            if held:
                self._exited.add(slot.rank)
                self._cond.notify_all()
            decided = self._decided
        if held:
            decided.wait()
        with self._cond:
            given_up = id(slot) in self._given_up
            self._given_up.discard(id(slot))
        if given_up:
            self.discovery.worker_ended()
            log.info(
                "worker %s[%d] of the grow given up ended (status %d)",
                slot.hostname,
                slot.local_rank,
                exit_code,
            )
            return
        self._record_exit(slot, exit_code, timestamp)


def observed_rendezvous_handler(driver: Any, on_put: Callable[[str, str], None]) -> type:
    """Horovod's elastic rendezvous handler, telling `on_put(scope, key)` of each key put."""
    base: type = create_rendezvous_handler(driver)

    class ObservedHandler(base):  # type: ignore[misc]
        def _put_value(self, scope: str, key: str, value: bytes) -> None:
            super()._put_value(scope, key, value)
            on_put(scope, key)

    return ObservedHandler
