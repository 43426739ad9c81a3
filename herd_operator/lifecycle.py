"""One lifecycle for every long-running part of the operator, after controller-runtime's
Manager of Runnables.

- `Runnable`: a part with a `name` that is started once and stopped once, within a timeout.
- `Periodic`: a runnable that runs one step every `interval` seconds on a thread of its own,
  the one way a loop of ours handles errors: a failing step is logged (the first failure of
  a streak with its traceback, or in one line when it is an error the loop expects, such as
  a full disk; then at most once a minute), counted and backed off (the wait doubles, up to
  a cap); a loop that dies (a `BaseException` out of its step) says so once, and its
  liveness (`LoopHealth`, exported as `herd_loop_*` by the operator's metrics) shows it.
- `Manager`: starts runnables in the order they are added, stops them in reverse, each
  within its timeout, and runs the clean-ups registered between them (remove a file,
  release a lock) exactly once, whether a start failed half-way or the operator stops.

Apart, at the bottom of the layers, and importing nothing of ours, because the runtime
(the operator's loops), the store (its checkpoint thread) and the exporters (dcgm-exporter's
job mapping, which the node agent writes too) all run loops the same way.

The operator's start and stop order, which locks each loop's thread takes and the order
of those locks are in docs/mechanisms.md ("One lifecycle", "Where each loop's thread
takes locks", "Lock order").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

log = logging.getLogger(__name__)

STOP_SECONDS = 5.0
"""How long a runnable may take to stop before the manager goes on without it."""
MAX_BACKOFF_SECONDS = 30.0
"""The longest a failing loop waits between two steps (never shorter than its interval)."""
ERROR_LOG_SECONDS = 60.0
"""While a loop keeps failing, it says so at most this often after the first failure."""
STOP_GRACE_SECONDS = 1.0
"""Beyond a runnable's timeout, how long the manager waits for its stop to return (the
stop's own joins give up at the timeout)."""


class Runnable(Protocol):
    """A long-running part: started once, stopped once within `timeout` seconds.

    A `start()` that raises must leave nothing running: the manager does not stop a part
    whose start failed (it stops every part started before it)."""

    @property
    def name(self) -> str: ...

    def start(self) -> None: ...

    def stop(self, timeout: float) -> None: ...


@dataclass(frozen=True)
class LoopState:
    """What a loop last did, for its liveness metrics."""

    running: bool = False
    died: bool = False
    errors: int = 0
    """Failed steps since the loop started (a counter)."""
    last_success: float | None = None
    """Wall-clock time of the last step that succeeded."""


class LoopHealth:
    """The liveness of every loop that reports here (thread-safe): whether it runs, its
    errors, its last success. The operator's metrics read it at scrape time."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._loops: dict[str, LoopState] = {}

    def _change(self, name: str, change: Callable[[LoopState], LoopState]) -> None:
        with self._lock:
            self._loops[name] = change(self._loops.get(name, LoopState()))

    def started(self, name: str) -> None:
        self._change(name, lambda state: replace(state, running=True, died=False))

    def succeeded(self, name: str) -> None:
        now = self._clock()
        self._change(name, lambda state: replace(state, last_success=now))

    def failed(self, name: str) -> None:
        self._change(name, lambda state: replace(state, errors=state.errors + 1))

    def ended(self, name: str, *, died: bool) -> None:
        self._change(name, lambda state: replace(state, running=False, died=died))

    def snapshot(self) -> dict[str, LoopState]:
        with self._lock:
            return dict(self._loops)


def backoff(interval: float, failures: int, cap: float) -> float:
    """The wait before the next step of a loop whose last `failures` steps failed in a row:
    the interval, doubled per failure, at most `cap` (or the interval, if that is longer)."""
    if failures <= 0:
        return interval
    return min(interval * 2.0 ** min(failures, 64), max(cap, interval))


class Periodic:
    """Runs `step()` every `interval` seconds on a daemon thread named `name`, until
    `stop()`; `wake()` runs the next step at once (a file event, a node heard from).

    `immediately`: the first step runs at `start()`'s thread start, not after an interval.
    `expected`: errors the loop meets in normal operation (a full disk, a file it cannot
    write yet), logged in one line, without a traceback. Steps that pause inside can wait on
    `stopping`, which `stop()` sets.
    """

    def __init__(
        self,
        name: str,
        step: Callable[[], object],
        interval: float,
        *,
        what: str | None = None,
        immediately: bool = False,
        expected: tuple[type[Exception], ...] = (),
        health: LoopHealth | None = None,
        max_backoff: float = MAX_BACKOFF_SECONDS,
        log_every: float = ERROR_LOG_SECONDS,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger = log,
    ) -> None:
        if not interval > 0:
            raise ValueError(f"{name}: interval must be positive, not {interval}")
        self.name = name
        self.what = what or name
        """What a step does, for the log lines ("pruning deleted jobs' history")."""
        self.interval = interval
        self.stopping = threading.Event()
        self._step = step
        self._immediately = immediately
        self._expected = expected
        self._health = health
        self._max_backoff = max_backoff
        self._log_every = log_every
        self._clock = clock
        self._log = logger
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0
        """Steps failed in a row (0 after a success)."""
        self._last_said: float | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} was started already")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        if self._health is not None:
            self._health.started(self.name)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float | None = STOP_SECONDS) -> bool:
        """Stop after the step under way; wait up to `timeout` seconds (None: for as long as
        it takes). Returns whether the thread has ended (or never started)."""
        self.stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        if thread.is_alive():
            self._log.warning("%s did not stop within %g s", self.name, timeout)
            return False
        return True

    def next_delay(self) -> float:
        """The wait before the next step: the interval, or longer after failures."""
        return backoff(self.interval, self.failures, self._max_backoff)

    def run_step(self) -> bool:
        """One step with the loop's error handling; returns whether it succeeded. A
        `BaseException` (not an `Exception`) is not handled: it ends the loop."""
        try:
            self._step()
        except Exception as err:
            self._failed(err)
            return False
        if self.failures:
            self._log.info("%s works again after %d failure(s)", self.what, self.failures)
        self.failures = 0
        self._last_said = None
        if self._health is not None:
            self._health.succeeded(self.name)
        return True

    def _failed(self, err: Exception) -> None:
        self.failures += 1
        if self._health is not None:
            self._health.failed(self.name)
        now = self._clock()
        retry = self.next_delay()
        if self.failures == 1:
            if isinstance(err, self._expected):
                self._log.warning("%s failed: %s; trying again in %g s", self.what, err, retry)
            else:
                self._log.exception("%s failed; trying again in %g s", self.what, retry)
        elif self._last_said is not None and now - self._last_said < self._log_every:
            return
        else:
            self._log.warning(
                "%s still fails (%d times in a row; the last: %s); trying again in %g s",
                self.what, self.failures, _said(err), retry,
            )  # fmt: skip
        self._last_said = now

    def _run(self) -> None:
        died = False
        try:
            if self._immediately and not self.stopping.is_set():
                self.run_step()
            while not self.stopping.is_set():
                self._wake.wait(self.next_delay())
                self._wake.clear()
                if self.stopping.is_set():
                    break
                self.run_step()
        except BaseException as err:
            died = True
            # Said here, once: the thread ends without the default hook's traceback.
            self._log.critical(
                "loop %s died (%s): %s no longer runs until the operator restarts",
                self.name, _said(err), self.what,
            )  # fmt: skip
        finally:
            if self._health is not None:
                self._health.ended(self.name, died=died)


def _said(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


class Hooks:
    """A runnable made of two functions: a server or a source with start and stop methods
    of its own shapes."""

    def __init__(
        self,
        name: str,
        start: Callable[[], object] = lambda: None,
        stop: Callable[[], object] = lambda: None,
    ) -> None:
        self.name = name
        self._start = start
        self._stop = stop

    def start(self) -> None:
        self._start()

    def stop(self, timeout: float) -> None:
        self._stop()


@dataclass(frozen=True)
class _Started:
    runnable: Runnable
    timeout: float


@dataclass(frozen=True)
class _CleanUp:
    name: str
    action: Callable[[], object]


class Manager:
    """Starts runnables in order and stops them in reverse, with the clean-ups between them.

    `add(runnable)` starts it now, after every part added before it; `defer(name, action)`
    registers a clean-up. `stop()` walks back through both: each runnable is stopped within
    its timeout (a stop that takes longer is left to finish on its own thread, said in the
    log), each clean-up is run, an error in one is logged and the next still runs, and a
    second `stop()` does nothing. So the teardown is the same code whether a start was
    refused half-way or the operator ran and stops.
    """

    def __init__(
        self,
        *,
        stop_timeout: float = STOP_SECONDS,
        grace: float = STOP_GRACE_SECONDS,
        logger: logging.Logger = log,
    ) -> None:
        self.stop_timeout = stop_timeout
        self.grace = grace
        self._log = logger
        self._lock = threading.Lock()
        self._stack: list[_Started | _CleanUp] = []
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def add(self, runnable: Runnable, *, stop_timeout: float | None = None) -> None:
        """Start `runnable`; if its start raises, it is not stopped (nothing of it runs)."""
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"cannot start {runnable.name}: the manager has stopped")
        runnable.start()
        with self._lock:
            timeout = self.stop_timeout if stop_timeout is None else stop_timeout
            self._stack.append(_Started(runnable, timeout))

    def defer(self, name: str, action: Callable[[], object]) -> None:
        """Run `action` on stop, after the parts added later have stopped."""
        with self._lock:
            self._stack.append(_CleanUp(name, action))

    def started(self) -> list[str]:
        """The names of the running parts, in the order they were started."""
        with self._lock:
            return [item.runnable.name for item in self._stack if isinstance(item, _Started)]

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            stack, self._stack = self._stack, []
        for item in reversed(stack):
            if isinstance(item, _Started):
                self._stop_one(item.runnable, item.timeout)
            else:
                try:
                    item.action()
                except Exception:  # the rest of the teardown must still run
                    self._log.exception("clean-up %r failed", item.name)

    def _stop_one(self, runnable: Runnable, timeout: float) -> None:
        """`runnable.stop(timeout)` on a thread of its own, waited for `timeout` seconds (and
        `grace` more, for the stop's own joins to give up)."""
        failed: list[BaseException] = []

        def stop() -> None:
            try:
                runnable.stop(timeout)
            except BaseException as err:  # said below, on the manager's thread
                failed.append(err)

        stopper = threading.Thread(target=stop, name=f"stop-{runnable.name}", daemon=True)
        stopper.start()
        stopper.join(timeout + self.grace)
        if stopper.is_alive():
            self._log.error(
                "%s did not stop within %g s; going on without it", runnable.name, timeout
            )
        elif failed:
            self._log.error("stopping %s failed", runnable.name, exc_info=failed[0])
