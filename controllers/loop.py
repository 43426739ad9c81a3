"""The control loop: take job names off the work queue, reconcile them, act on the outcome.

controller-runtime's `reconcileHandler`, for one process: `handle(key)` runs one
reconcile and maps its result or error to a queue action, and counts each outcome:

    outcome           queue action
    success           forget the key's backoff (unless the result keeps it: a launch just
                      started); requeue after `requeue_after` if set
    permanent_error   forget the key (the reconciler showed it as `Stalled`); no retry
    temporary_error   requeue with the key's exponential backoff, on the error's own
                      schedule if it has one (a launch failure: 1, 2, 4 ... 60 s)
    unexpected_error  logged with its traceback; requeued with backoff like a temporary one;
                      from the `STALL_AFTER_FAILURES`-th failure in a row (the reconciler
                      then shows `Stalled`), at the queue's longest delay, one line a try
    lost              the store could not commit the group the reconcile was in: requeued
                      after 1, 2, 4 ... 60 s

Each key taken off the queue is counted once, with the outcome that stood: a reconcile
whose group was lost counts as `lost` only. Each reconcile is told how many of the key's
reconciles failed in a row before it (the queue's count behind the backoff), so what it
shows of a retry (a launch failure's next try) is what the queue does.

A burst of keys (a restart, many new specs) is reconciled under one allocator decision
(`Batcher.batch()`) and few store commits (`Transactions.transaction()`, one per
`group_seconds` of reconciles). A reconcile's queue action waits for its group: a key's
backoff is forgotten only once the writes of its success are committed, and the keys of a
group the store lost (a full disk) wait 1, 2, 4 ... 60 s, whatever their reconciles asked
for, since what they decided (a launch failure's retry time) was not stored. While the
store refuses writes (`Transactions.writable`), a reconcile that failed is retried on the
same slow schedule and the loop says nothing of the store: the store says it (once a
minute at most), so the log stays bounded however long the disk is full. A store error that
is also a `PermanentError` (a damaged store) is not retried, for a group either.

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
from dataclasses import dataclass, field
from typing import Protocol

from herd_operator.controllers.errors import STALL_AFTER_FAILURES, PermanentError, TemporaryError
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
store refuses writes) is retried after 1, 2, 4 ... 60 s, its count of failures in a row
going on (a launch failing on a full disk keeps the launch's own schedule). The queue's
own 50 ms base made a job whose launch failed on a full disk retry about ten times a
second."""


class Outcome(enum.StrEnum):
    """How one reconcile ended; the label of the loop's per-outcome counter."""

    SUCCESS = "success"
    PERMANENT_ERROR = "permanent_error"
    TEMPORARY_ERROR = "temporary_error"
    UNEXPECTED_ERROR = "unexpected_error"
    LOST = "lost"


class Reconciler(Protocol):
    def reconcile(self, name: str, failures: int) -> Result:
        """One reconcile of `name`; `failures`: how many of its reconciles failed in a row
        just before this one (the queue's count behind the key's backoff)."""
        ...

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
    """One reconcile, before its queue action and its count: taken once its store group's
    fate is known."""

    name: str
    outcome: Outcome
    seconds: float
    failures: int
    """The key's failures in a row before this reconcile."""
    result: Result | None = None
    error: BaseException | None = None


@dataclass
class _Burst:
    """The keys of a burst the loop reconciled (taken off the queue and run) and those whose
    queue action and count are taken (their group committed, or the store cannot be
    helped): what a lost group or decision hands back, and how."""

    reconciled: dict[str, _Reconciled] = field(default_factory=dict)
    settled: set[str] = field(default_factory=set)


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
        """Run one reconcile; the key is done, its queue action and count left for
        `_settle` (or `_hand_back`, when its group is lost)."""
        failures = self.queue.failures(name)
        started = time.perf_counter()
        result: Result | None = None
        error: BaseException | None = None
        try:
            result = self.reconciler.reconcile(name, failures)
        except PermanentError as err:
            outcome, error = Outcome.PERMANENT_ERROR, err
            log.error("%s: %s (not retried until the spec changes)", name, err)
        except TemporaryError as err:
            outcome, error = Outcome.TEMPORARY_ERROR, err
        except (Exception, SystemExit) as err:
            # SystemExit too: plug-in code (a policy) may call sys.exit; one job's bug must
            # not end the loop and stop every job. (Ctrl-C and signals stop the operator
            # through its stop event, not through exceptions here.)
            outcome, error = Outcome.UNEXPECTED_ERROR, err
            if failures < STALL_AFTER_FAILURES:  # then the job shows it: a line a try
                log.error("%s: reconcile failed", name, exc_info=err)
            else:
                log.error("%s: reconcile failed again (stalled): %r", name, err)
        else:
            outcome = Outcome.SUCCESS
        finally:
            self.queue.done(name)
        elapsed = time.perf_counter() - started
        log.debug("reconciled %s in %.1f ms: %s", name, elapsed * 1000, outcome)
        return _Reconciled(name, outcome, elapsed, failures, result, error)

    def _settle(self, reconciled: _Reconciled) -> None:
        """Count a reconcile whose writes were committed (or made outside a group) and take
        its queue action: a success (unless it keeps the backoff) or a permanent error
        forgets the key's backoff, a failure backs off (see `_retry_delay`)."""
        self.observer.reconciled(reconciled.outcome, reconciled.seconds)
        name = reconciled.name
        result = reconciled.result
        if result is not None:
            if not result.keep_backoff:
                self.queue.forget(name)
            if result.requeue_after is not None:
                self.queue.add_after(name, result.requeue_after)
        elif reconciled.outcome == Outcome.PERMANENT_ERROR:
            self.queue.forget(name)
        else:
            self.queue.add_after(name, self._retry_delay(reconciled))

    def _retry_delay(self, reconciled: _Reconciled) -> float:
        """Count the failure and say when to try again: on the error's own schedule (a
        launch failure's 1, 2, 4 ... 60 s) or the queue's; at the queue's longest delay once
        a bug has stalled the job; slowly while the store refuses writes (see
        STORE_RETRY_SECONDS), without a line of its own (the store says it)."""
        name, error = reconciled.name, reconciled.error
        if not self.transactions.writable:
            delay = self._store_backoff(name)
            log.debug("%s: %s; retrying in %.1fs", name, error, delay)
            return delay
        if isinstance(error, TemporaryError):
            backoff = error.backoff
            delay = (
                self.queue.backoff(name)
                if backoff is None
                else self.queue.backoff(
                    name, base_delay=backoff.base_seconds, max_delay=backoff.max_seconds
                )
            )
            # A line of its own unless the reconciler said it already (a Warning event).
            (log.info if error.shown else log.warning)(
                "%s: %s; retrying in %.1fs", name, error, delay
            )
            return delay
        delay = self.queue.backoff(name)
        if reconciled.failures + 1 >= STALL_AFTER_FAILURES:
            delay = self.queue.max_delay  # the reconciler showed the job Stalled
        log.info("%s: retrying in %.1fs", name, delay)  # its traceback is logged
        return delay

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
        burst = _Burst()
        try:
            with self.batcher.batch():
                lost = self._reconcile_in_groups(keys, burst)
        except TemporaryError as err:
            # The batch's decision could not be recorded (the store refused its write): every
            # job of the burst is reconciled again, which decides again.
            lost = self._lose(keys, err, burst, "allocator decision")
        self._hand_back(lost, burst)
        return lost

    def _reconcile_grouped(self, keys: Sequence[str]) -> list[str]:
        """Reconcile ``keys`` in store groups without a shared allocator decision."""
        burst = _Burst()
        lost = self._reconcile_in_groups(keys, burst)
        self._hand_back(lost, burst)
        return lost

    def _reconcile_in_groups(self, keys: Sequence[str], burst: _Burst) -> list[str]:
        """Handle ``keys`` one store group (``group_seconds``) at a time, noting each in
        ``burst`` as it is reconciled and settled; returns the keys whose group was lost.

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
                        group.append(self._reconcile(keys[index]))
                        burst.reconciled[keys[index]] = group[-1]
                        index += 1
                        if time.monotonic() >= group_ends:
                            break
            except TemporaryError as err:
                failed = keys[first:index] if index > first else keys[first:]
                lost += self._lose(failed, err, burst, "state store")
                index = first + len(failed)
            else:
                for reconciled in group:
                    self._settle(reconciled)
                    burst.settled.add(reconciled.name)
        return lost

    def _lose(
        self, keys: Sequence[str], err: TemporaryError, burst: _Burst, what: str
    ) -> list[str]:
        """The store lost the writes of ``keys`` (``what`` failed): returns those to hand
        back, all of them unless the store is damaged (a `PermanentError` too): waiting
        cannot mend that, so its keys are counted as permanent errors and forgotten, as a
        reconcile that raised it would be."""
        if not isinstance(err, PermanentError):
            # While the store refuses writes it says so itself, once a minute at most.
            (log.error if self.transactions.writable else log.debug)(
                "%s: %s; reconciling %d job(s) again", what, err, len(keys)
            )
            return list(keys)
        log.error("%s: %s (%d job(s) not retried until their specs change)", what, err, len(keys))
        for key in keys:
            if key in burst.settled:
                continue
            reconciled = burst.reconciled.get(key)
            if reconciled is None:  # taken off the queue, never reconciled: hand it back
                self.queue.done(key)
            seconds = reconciled.seconds if reconciled is not None else 0.0
            self.observer.reconciled(Outcome.PERMANENT_ERROR, seconds)
            self.queue.forget(key)
            burst.settled.add(key)
        return []

    def _hand_back(self, lost: Sequence[str], burst: _Burst) -> None:
        """Requeue after 1, 2, 4 ... 60 s the keys whose writes were lost, counting as `lost`
        each one whose outcome was not counted yet (a key whose group committed before the
        burst's decision was lost counted its own)."""
        for key in dict.fromkeys(lost):
            if key not in burst.settled:
                if key not in burst.reconciled:  # taken off the queue, never reconciled
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
