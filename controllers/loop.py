"""The control loop: take job names off the work queue, reconcile them, act on the outcome.

controller-runtime's `reconcileHandler`, for one process: `handle(key)` runs one
reconcile and maps its result or error to a queue action, and counts each outcome:

    outcome           queue action
    success           forget the key's backoff; requeue after `requeue_after` if set
    permanent_error   forget the key (the reconciler showed it as `Stalled`); no retry
    temporary_error   requeue with the key's exponential backoff
    unexpected_error  logged with its traceback; requeued with backoff like a temporary one
    lost              the store could not commit the group the reconcile was in: requeued

A burst of keys (a restart, many new specs) is reconciled under one allocator decision
(`Batcher.batch()`) and few store commits (`Transactions.transaction()`, one per
`group_seconds` of reconciles). The allocator calls `wake(job)` when it changes the
grant of a job other than the one asking, so that job converges too. Nothing here
knows the runtime: the parts come in through the protocols below.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
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

    def transaction(self) -> AbstractContextManager[None]: ...


class LoopObserver(Protocol):
    """Hears how each reconcile ended and how long it took (metrics)."""

    def reconciled(self, outcome: Outcome, seconds: float) -> None: ...


class NoLoopObserver:
    def reconciled(self, outcome: Outcome, seconds: float) -> None:
        pass


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
        """Reconcile one key and turn what came of it into a queue action."""
        started = time.perf_counter()
        requeue_after: float | None = None
        try:
            result = self.reconciler.reconcile(name)
        except PermanentError as err:
            outcome = Outcome.PERMANENT_ERROR
            log.error("%s: %s (not retried until the spec changes)", name, err)
            self.queue.forget(name)
        except TemporaryError as err:
            outcome = Outcome.TEMPORARY_ERROR
            requeue_after = self.queue.backoff(name)
            log.warning("%s: %s; retrying in %.1fs", name, err, requeue_after)
        except (Exception, SystemExit):
            # SystemExit too: plug-in code (a policy) may call sys.exit; one job's bug must
            # not end the loop and stop every job. (Ctrl-C and signals stop the operator
            # through its stop event, not through exceptions here.)
            outcome = Outcome.UNEXPECTED_ERROR
            requeue_after = self.queue.backoff(name)
            log.exception("%s: reconcile failed; retrying in %.1fs", name, requeue_after)
        else:
            outcome = Outcome.SUCCESS
            self.queue.forget(name)
            requeue_after = result.requeue_after
        finally:
            self.queue.done(name)
        if requeue_after is not None:
            self.queue.add_after(name, requeue_after)
        elapsed = time.perf_counter() - started
        self.observer.reconciled(outcome, elapsed)
        log.debug("reconciled %s in %.1f ms: %s", name, elapsed * 1000, outcome)
        return outcome

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
            log.error("allocator decision: %s; reconciling %d job(s) again", err, len(keys))
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
        ``handled`` as it is taken; returns the keys whose group was lost."""
        lost: list[str] = []
        index = 0
        while index < len(keys):
            first = index
            try:
                with self.transactions.transaction():
                    group_ends = time.monotonic() + self.group_seconds
                    while index < len(keys):
                        handled.add(keys[index])
                        self.handle(keys[index])
                        index += 1
                        if time.monotonic() >= group_ends:
                            break
            except TemporaryError as err:
                failed = list(keys[first:index]) if index > first else list(keys[first:])
                log.error("state store: %s; reconciling %d job(s) again", err, len(failed))
                lost += failed
                index = first + len(failed)
        return lost

    def _hand_back(self, lost: Sequence[str], handled: set[str]) -> None:
        """Requeue with backoff the keys whose writes were lost."""
        for key in dict.fromkeys(lost):
            if key not in handled:  # taken off the queue, never reconciled: hand it back
                self.queue.done(key)
            self.observer.reconciled(Outcome.LOST, 0.0)
            self.queue.add_after(key, self.queue.backoff(key))

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
