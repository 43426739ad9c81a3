"""The control loop: take job names off the work queue, reconcile them, act on the outcome.

controller-runtime's `reconcileHandler`, for one process: `handle(key)` runs one
reconcile and maps its result or error to a queue action, and counts each outcome:

    outcome           queue action
    success           forget the key's backoff; requeue after `requeue_after` if set
    permanent_error   forget the key (the reconciler showed it as `Stalled`); no retry
    temporary_error   requeue with the key's exponential backoff
    unexpected_error  logged with its traceback; requeued with backoff like a temporary one
    lost              the store could not commit the group the reconcile was in: requeued
                      after 1, 2, 4 ... 60 s

A burst of keys (a restart, many new specs) is reconciled under one allocator decision
(`Batcher.batch()`) and few store commits (`Transactions.transaction()`, one per
`group_seconds` of reconciles). A reconcile's queue action waits for its group: a key's
backoff is forgotten only once the writes of its success are committed, and the keys of a
group the store lost (a full disk) wait 1, 2, 4 ... 60 s, whatever their reconciles asked
for, since what they decided (a launch failure's retry time) was not stored. While the
store refuses writes (`Transactions.writable`), a reconcile that failed is retried on the
same slow schedule and the loop says nothing of the store: the store says it (once a
minute at most), so the log stays bounded however long the disk is full.

The allocator calls `wake(job)` when it changes the grant of a job other than the one
asking, so that job converges too. Nothing here knows the runtime: the parts come in
through the protocols below.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from herd_operator.controllers.errors import PermanentError, TemporaryError
from herd_operator.controllers.ports import Result
from herd_operator.controllers.workqueue import WorkQueue
from herd_operator.specs.values import Grant

log = logging.getLogger(__name__)

MAX_BATCH = 10_000
"""Most jobs reconciled under one allocator decision (a decision weighs every job anyway,
so one decision for a whole burst is cheaper and spares the first jobs a grow-then-shrink)."""
STORE_GROUP_SECONDS = 0.02
"""Within a burst, the store commits the reconciles of up to this long at once: one commit
per reconcile was a third of a 10,000-job pass, and the RPC thread, which shares the store,
waits at most this long (plus one reconcile) for it."""
STORE_RETRY_SECONDS = 1.0
STORE_RETRY_MAX_SECONDS = 60.0
"""A key whose writes the store did not take (its group was lost, or it failed while the
store refuses writes) is retried after 1, 2, 4 ... 60 s: the backoff a launch failure's
status would have asked for, had the store kept it. The queue's own 50 ms base made a job
whose launch failed on a full disk retry about ten times a second."""


class Outcome(enum.StrEnum):
    """How one reconcile ended; the label of the loop's per-outcome counter."""

    SUCCESS = "success"
    PERMANENT_ERROR = "permanent_error"
    TEMPORARY_ERROR = "temporary_error"
    UNEXPECTED_ERROR = "unexpected_error"
    LOST = "lost"


class Reconciler(Protocol):
    def reconcile(self, name: str) -> Result: ...

    def record_shutdown(self, name: str) -> None:
        """The operator stopped the job's processes on its way out: say so in its status."""
        ...

    def known_jobs(self) -> list[str]: ...


class Batcher(Protocol):
    """The allocator: one decision for everything requested inside `batch()`."""

    def batch(self) -> AbstractContextManager[None]: ...

    def watch(self, listener: Callable[[str, Grant], None]) -> None:
        """Call `listener` with each job whose grant changed because of another job."""
        ...


class Transactions(Protocol):
    """The store: the writes inside `transaction()` are committed together at its end.

    Raises a `TemporaryError` when the group cannot be begun or committed.
    """

    @property
    def writable(self) -> bool:
        """False from a write the storage refused (a full disk) until a write commits again;
        the store logs those changes itself."""
        ...

    def transaction(self) -> AbstractContextManager[None]: ...


class LoopObserver(Protocol):
    """Hears how each reconcile ended and how long it took (metrics)."""

    def reconciled(self, outcome: Outcome, seconds: float) -> None: ...


class NoLoopObserver:
    def reconciled(self, outcome: Outcome, seconds: float) -> None:
        pass


@dataclass(frozen=True)
class _Reconciled:
    """One reconcile, before its queue action: taken once its store group's fate is known."""

    name: str
    outcome: Outcome
    requeue_after: float | None = None
    error: BaseException | None = None


class ControlLoop:
    """Runs on one thread (decisions never race); other threads only add keys to the queue."""

    def __init__(
        self,
        queue: WorkQueue,
        reconciler: Reconciler,
        batcher: Batcher,
        transactions: Transactions,
        *,
        observer: LoopObserver | None = None,
        max_batch: int = MAX_BATCH,
        group_seconds: float = STORE_GROUP_SECONDS,
    ) -> None:
        self.queue = queue
        self.reconciler = reconciler
        self.batcher = batcher
        self.transactions = transactions
        self.observer: LoopObserver = observer or NoLoopObserver()
        self.max_batch = max_batch
        self.group_seconds = group_seconds
        batcher.watch(self.wake)

    # ---- callbacks from other threads ----

    def wake(self, job: str, grant: Grant | None = None) -> None:
        """Reconcile `job` soon (its grant changed, a worker reported, its process exited)."""
        self.queue.add(job)

    def wake_all(self, jobs: set[str]) -> None:
        for job in sorted(jobs):
            self.queue.add(job)

    # ---- the loop ----

    def run(self, stop: threading.Event, poll_seconds: float = 0.2) -> None:
        """Reconcile until `stop` is set."""
        while not stop.is_set():
            self.run_once(poll_seconds)

    def run_once(self, timeout: float) -> int:
        """Wait up to `timeout` for a key, then reconcile it and every key ready with it.

        Returns how many keys were taken.
        """
        name = self.queue.get(timeout=timeout)
        if name is None:
            return 0
        burst = [name]
        while len(burst) < self.max_batch and (more := self.queue.get(timeout=0)) is not None:
            burst.append(more)
        if len(burst) == 1:
            # Still inside a store group: what the reconcile leaves for after its commit
            # (a finished launch's record) waits for the status that records the exit.
            self._reconcile_grouped(burst)
            return 1
        # Many jobs at once (a restart, a burst of new specs): one allocator decision for
        # all of them instead of one each.
        self.reconcile_burst(burst)
        return len(burst)

    def handle(self, name: str) -> Outcome:
        """Reconcile one key and turn what came of it into a queue action (outside a store
        group: inside one, `_reconcile_in_groups` acts once the group is committed)."""
        reconciled = self._reconcile(name)
        self._settle(reconciled)
        return reconciled.outcome

    def _reconcile(self, name: str) -> _Reconciled:
        """Run one reconcile and count its outcome; the key is done, its queue action left
        for `_settle` (or `_hand_back`, when its group is lost)."""
        started = time.perf_counter()
        try:
            result = self.reconciler.reconcile(name)
        except PermanentError as err:
            reconciled = _Reconciled(name, Outcome.PERMANENT_ERROR)
            log.error("%s: %s (not retried until the spec changes)", name, err)
        except TemporaryError as err:
            reconciled = _Reconciled(name, Outcome.TEMPORARY_ERROR, error=err)
        except (Exception, SystemExit) as err:
            # SystemExit too: plug-in code (a policy) may call sys.exit; one job's bug must
            # not end the loop and stop every job. (Ctrl-C and signals stop the operator
            # through its stop event, not through exceptions here.)
            reconciled = _Reconciled(name, Outcome.UNEXPECTED_ERROR, error=err)
            log.error("%s: reconcile failed", name, exc_info=err)
        else:
            reconciled = _Reconciled(name, Outcome.SUCCESS, result.requeue_after)
        finally:
            self.queue.done(name)
        elapsed = time.perf_counter() - started
        self.observer.reconciled(reconciled.outcome, elapsed)
        log.debug("reconciled %s in %.1f ms: %s", name, elapsed * 1000, reconciled.outcome)
        return reconciled

    def _settle(self, reconciled: _Reconciled) -> None:
        """The queue action of a reconcile whose writes were committed (or made outside a
        group): a success or a permanent error forgets the key's backoff, a failure backs
        off (slowly while the store refuses writes: see STORE_RETRY_SECONDS)."""
        name = reconciled.name
        if reconciled.outcome in (Outcome.SUCCESS, Outcome.PERMANENT_ERROR):
            self.queue.forget(name)
            if reconciled.requeue_after is not None:
                self.queue.add_after(name, reconciled.requeue_after)
            return
        if self.transactions.writable:
            delay = self.queue.backoff(name)
            if reconciled.outcome == Outcome.TEMPORARY_ERROR:
                log.warning("%s: %s; retrying in %.1fs", name, reconciled.error, delay)
            else:
                log.info("%s: retrying in %.1fs", name, delay)  # its traceback is logged
        else:
            # The store says once a minute that writes fail; a line per job and retry
            # would say it again, as often as the jobs retry.
            delay = self._store_backoff(name)
            log.debug("%s: %s; retrying in %.1fs", name, reconciled.error, delay)
        self.queue.add_after(name, delay)

    def _store_backoff(self, name: str) -> float:
        return self.queue.backoff(
            name, base_delay=STORE_RETRY_SECONDS, max_delay=STORE_RETRY_MAX_SECONDS
        )

    def reconcile_burst(self, keys: Sequence[str]) -> list[str]:
        """Reconcile many jobs under one allocator decision and few store commits.

        Returns the keys whose store writes were lost because their group could not be
        committed (or begun: another writer held the database); they are requeued with
        backoff, and the level-triggered reconcile redoes their writes.
        """
        handled: set[str] = set()
        try:
            with self.batcher.batch():
                lost = self._reconcile_in_groups(keys, handled)
        except TemporaryError as err:
            # The batch's decision could not be recorded (the store refused its write): every
            # job of the burst is reconciled again, which decides again.
            (log.error if self.transactions.writable else log.debug)(
                "allocator decision: %s; reconciling %d job(s) again", err, len(keys)
            )
            lost = list(keys)
        self._hand_back(lost, handled)
        return lost

    def _reconcile_grouped(self, keys: Sequence[str]) -> list[str]:
        """Reconcile ``keys`` in store groups without a shared allocator decision."""
        handled: set[str] = set()
        lost = self._reconcile_in_groups(keys, handled)
        self._hand_back(lost, handled)
        return lost

    def _reconcile_in_groups(self, keys: Sequence[str], handled: set[str]) -> list[str]:
        """Handle ``keys`` one store group (``group_seconds``) at a time, adding each to
        ``handled`` as it is taken; returns the keys whose group was lost.

        A reconcile's queue action is taken after its group: a success must not forget the
        key's backoff before its writes are committed, or a store that loses every group
        retries the key at the queue's base delay forever."""
        lost: list[str] = []
        index = 0
        while index < len(keys):
            first = index
            group: list[_Reconciled] = []
            try:
                with self.transactions.transaction():
                    group_ends = time.monotonic() + self.group_seconds
                    while index < len(keys):
                        handled.add(keys[index])
                        group.append(self._reconcile(keys[index]))
                        index += 1
                        if time.monotonic() >= group_ends:
                            break
            except TemporaryError as err:
                failed = list(keys[first:index]) if index > first else list(keys[first:])
                # While the store refuses writes it says so itself, once a minute at most.
                (log.error if self.transactions.writable else log.debug)(
                    "state store: %s; reconciling %d job(s) again", err, len(failed)
                )
                lost += failed
                index = first + len(failed)
            else:
                for reconciled in group:
                    self._settle(reconciled)
        return lost

    def _hand_back(self, lost: Sequence[str], handled: set[str]) -> None:
        """Requeue after 1, 2, 4 ... 60 s the keys whose writes were lost."""
        for key in dict.fromkeys(lost):
            if key not in handled:  # taken off the queue, never reconciled: hand it back
                self.queue.done(key)
            self.observer.reconciled(Outcome.LOST, 0.0)
            self.queue.add_after(key, self._store_backoff(key))

    def record_shutdown(self) -> bool:
        """Every job's status says the operator stopped it (its processes are gone).

        Returns False when the store could not take it (a full disk): the jobs are stopped
        all the same, and the next operator finds no process behind a `Running` status.
        """
        try:
            names = self.reconciler.known_jobs()
            with self.transactions.transaction():
                for name in names:
                    try:
                        self.reconciler.record_shutdown(name)
                    except TemporaryError as err:  # the store: the group is lost anyway
                        log.error("%s: cannot record the shutdown in its status: %s", name, err)
                    except Exception:  # one job's status must not keep the others' unwritten
                        log.exception("%s: cannot record the shutdown in its status", name)
        except TemporaryError as err:
            log.error(
                "cannot record the shutdown in the state store (%s): the jobs were stopped,"
                " but their statuses may still say Running until the next operator starts",
                err,
            )
            return False
        return True
