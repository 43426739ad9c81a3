"""The driver's bound on a Horovod round that a failed worker left unfinished: the job fails
instead of waiting for a worker that neither comes nor ends.

Horovod's registry ends a round (its barrier's action: stop the job, or blacklist the failed
hosts and go on with the rest) only once every worker of the round has recorded a state: at
the next rendezvous, or ended. A worker that does neither holds the round, and the job,
forever. At the job's first meeting that is all it takes: a worker held back before
`hvd.init()` (a loaded node, a start stuck in its set-up, a stopped process) has not put its
address on the rendezvous server when the others reach it; they fail on Gloo's timeout
(`Wait timeout after 30 seconds for key(s): 2`, then an abort, status 134), record their
failure and wait at the barrier for the one that is not there. The driver then ran with no
worker training and no end (`test_slurm`'s 6-worker job in CI at 1620f19: Running, "waiting
for the workers' first report", until the test gave up).

A round in which a worker failed, and which still has a worker that recorded nothing, is
given `limit` seconds of quiet to end: counted from its last sign of life, a failure or a
worker putting its Gloo address on the rendezvous server.

- before the job's workers first met (some rank of the round never put its Gloo address,
  and no worker reached `hvd.elastic.run`), the round cannot form any more: each worker of
  it needs every other, and one has failed. A worker at the rendezvous fails within Gloo's
  timeout of putting its address, so that is the limit: a worker that has neither ended
  nor come by then is not coming (held back, or stuck).
- once the job has met, the survivors of a failure reset and meet again at their next
  collective: Horovod's elastic timeout, how long it waits for workers after a reset, is
  the limit.

Past the limit the driver stops the job (Horovod's `stop`, which stops every worker) with an
error naming the workers that failed and those that never came; it exits 1, and the
operator applies the spec's `restartPolicy` (a `BackOff` and a relaunch, or `Failed`) with
that error as the reason.

Apart from the driver's entry point (`hvd_driver`) and its grow hold (`hvd_grow`, which holds
a grow's running workers on purpose, and is not a failed round): it is one rule with its own
clock, pure (`round_formed`, `round_overdue`, `stuck_round_message`), and the watch that
applies it (`RoundWatch`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence, Set
from typing import Any

from herd_operator.runtime.engines.hvd_grow import rendezvous_rank

WATCH_SECONDS = 1.0
"""How often the watch looks at the round (a limit is tens of seconds)."""

# The driver's one logger (its entry point gives it a handler), whichever module logs.
log = logging.getLogger("herd.hvd_driver")


def round_formed(put_ranks: Set[int], world_size: int, registered: bool) -> bool:
    """Whether the job's workers have met: every rank of the round put its Gloo address on
    the rendezvous server (`put_ranks`), or a worker registered its notification server
    (it is past `hvd.init()`, in `hvd.elastic.run`)."""
    return registered or (world_size > 0 and set(range(world_size)) <= put_ranks)


def round_overdue(
    quiet_since: float | None,
    now: float,
    missing: int,
    formed: bool,
    forming_limit: float,
    formed_limit: float,
) -> bool:
    """Whether a round is past its limit at `now`: a worker of it failed, and its last sign
    of life since (a failure, or a worker putting its address) was at `quiet_since` (None:
    no worker of it failed), `missing` of its workers have recorded nothing, and the quiet
    lasted `forming_limit` before the workers first met (`formed` False), `formed_limit`
    after. A round with no worker missing is Horovod's to end (its barrier's action runs,
    with its own timeout where it waits for hosts)."""
    if quiet_since is None or missing <= 0:
        return False
    return now - quiet_since >= (formed_limit if formed else forming_limit)


def stuck_round_message(
    formed: bool, failed: Sequence[str], missing: Sequence[str], quiet: float, limit: str
) -> str:
    """What the job's error says: which workers failed (`rank 0 (localhost[0])`...), which
    have not ended (`missing`), how long the round has been quiet, and which limit."""
    what = "a round after a failure did not end" if formed else "the workers' first meeting failed"
    failures = ", ".join(failed) or "a worker"
    absent = ", ".join(missing) or "a worker"
    return (
        f"{what}: {failures} failed, and {absent} neither came to the rendezvous nor ended in"
        f" the {quiet:.0f} s since the round's last failure or arrival ({limit}); Horovod"
        " waits for every worker of a round, so the driver stopped the job"
    )


def _worker(rank: int, host: str, local_rank: int) -> str:
    return f"rank {rank} ({host}[{local_rank}])"


class RoundWatch:
    """Gives up a round of Horovod's driver that a failed worker left unfinished.

    Notes each failure Horovod records in a round (wrapping its registry's `record_failure`:
    the worker's thread then waits at the barrier) and each Gloo address put (`put_seen`,
    told by the rendezvous handler): the round's signs of life. Looks every
    `period` seconds: a round past its limit (`round_overdue`) is ended by stopping the job
    with the reason as its error, and the barrier where the failed workers' threads wait is
    broken so that they end.
    """

    def __init__(
        self,
        driver: Any,
        forming_limit: float,
        formed_limit: float,
        clock: Callable[[], float] = time.monotonic,
        period: float = WATCH_SECONDS,
    ) -> None:
        self.driver = driver
        self.forming_limit = forming_limit
        self.formed_limit = formed_limit
        self.clock = clock
        self.period = period
        self.gave_up = threading.Event()
        self._lock = threading.Lock()
        self._round: int | None = None
        self._quiet_since: float | None = None
        """The round's last failure or arrival, once a worker of it failed; else None."""
        self._failed: list[tuple[str, int]] = []
        self._put: set[int] = set()
        self._formed = False
        registry = driver._worker_registry
        self._record_failure = registry.record_failure
        registry.record_failure = self._on_failure

    def put_seen(self, scope: str, key: str) -> None:
        """A key put on the rendezvous server: a worker may have put its Gloo address."""
        rank = rendezvous_rank(scope, key)
        if rank is not None:
            with self._lock:
                self._put.add(rank)
                if self._quiet_since is not None:  # it will fail within Gloo's timeout, or meet
                    self._quiet_since = self.clock()

    def _on_failure(self, host: str, slot: int) -> int:
        driver = self.driver
        registry = driver._worker_registry
        # Horovod ignores these two (it returns at once): not a failure that holds a round.
        if not driver.finished() and not driver._host_manager.is_blacklisted(host):
            with self._lock:
                round_id = registry.last_rendezvous()
                if round_id != self._round:
                    self._round, self._failed = round_id, []
                self._quiet_since = self.clock()
                self._failed.append((host, slot))
        try:
            return int(self._record_failure(host, slot))
        except threading.BrokenBarrierError:
            if not self.gave_up.is_set():
                raise
            # Broken by the give-up: the job is stopping, and this worker's end is a result.
            return int(registry.last_rendezvous())

    def formed(self) -> bool:
        with self._lock:
            if not self._formed:
                self._formed = round_formed(
                    self._put, self.driver.world_size(), bool(self.driver._worker_clients)
                )
            return self._formed

    def poll(self) -> str | None:
        """The job's error when the current round is past its limit (the watch then gives
        it up), else None."""
        driver = self.driver
        registry = driver._worker_registry
        formed = self.formed()
        with self._lock:
            if self._quiet_since is not None and registry.last_rendezvous() != self._round:
                self._quiet_since = None  # Horovod ended the round: it went on or stopped
            quiet_since, failed = self._quiet_since, list(self._failed)
        if quiet_since is None or driver.finished():
            return None
        assigned = {
            (host, info.local_rank): info.rank
            for host, infos in driver.host_assignments.items()
            for info in infos
        }
        with registry._lock:  # Horovod's, held only while it records a state
            recorded = set(registry.get_recorded_slots())
        missing = [
            _worker(rank, host, local)
            for (host, local), rank in sorted(assigned.items(), key=lambda item: item[1])
            if (host, local) not in recorded
        ]
        now = self.clock()
        overdue = round_overdue(
            quiet_since, now, len(missing), formed, self.forming_limit, self.formed_limit
        )
        if not overdue:
            return None
        ranked = sorted((assigned.get(key, -1), key) for key in set(failed))
        failures = [_worker(rank, *key) for rank, key in ranked]
        limit = "elasticTimeoutSeconds" if formed else "glooTimeoutSeconds"
        return stuck_round_message(formed, failures, missing, now - quiet_since, limit)

    def give_up(self, message: str) -> None:
        self.gave_up.set()
        log.error("%s", message)
        # Stops every worker (the shutdown event is one of each worker's stop events).
        self.driver.stop(error_message=message)
        barrier = self.driver._worker_registry._barrier
        if barrier is not None:  # made by the first round's reset
            barrier.abort()

    def run(self) -> None:
        shutdown = self.driver._shutdown
        while not shutdown.wait(self.period):
            message = self.poll()
            if message is not None:
                self.give_up(message)
                return

    def start(self) -> None:
        threading.Thread(target=self.run, name="round-watch", daemon=True).start()
