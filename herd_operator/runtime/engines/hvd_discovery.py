"""How the job's driver learns its hosts: the operator's grant file, and a host change
Horovod dropped delivered once a worker can hear it.

Apart from the driver's entry point (`hvd_driver`) because it is the driver's one channel
from the operator: what it reads (`parse_grant`), how often (`DEFAULT_POLL_SECONDS`), and
what happens to a change seen before the first workers listen (`MissedUpdateRedelivery`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.worker import HostUpdateResult

DEFAULT_POLL_SECONDS = 0.05
"""How often the grant file is `stat`ed. 20 stats a second cost well under 0.1% of a
core (see docs/benchmarks.md, driver-idle-cpu) and bound how late a grant is seen."""
REDELIVER_SECONDS = 5.0
"""How long a host change told to the coordinator may go unanswered (no reset: the workers
still run with the old assignments) before it is told again (`MissedUpdateRedelivery`)."""

# The driver's one logger (its entry point gives it a handler), whichever module logs.
log = logging.getLogger("herd.hvd_driver")


class GrantFileError(ValueError):
    """The grant file holds a line that is not `host` or `host:slots`."""


def parse_grant(text: str, default_slots: int, source: Path) -> dict[str, int]:
    """Host -> slots from `host:slots` lines (a bare `host` gets `default_slots`), as
    Horovod reads a discovery script's output; blank lines are skipped."""
    slots: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, sep, count = line.partition(":")
        if not host:
            raise GrantFileError(f"{source}:{number}: {line!r} has no host name")
        if not sep:
            slots[host] = default_slots
            continue
        if not count.isdigit():
            raise GrantFileError(
                f"{source}:{number}: slots in {line!r} must be a whole number >= 0"
            )
        slots[host] = int(count)
    return slots


class GrantFileDiscovery(HostDiscovery):  # type: ignore[misc]
    """Horovod's host discovery from the operator's grant file: no process per call.

    The file is replaced atomically (write and rename), so a new (inode, mtime, size)
    is a new grant and the same one is the same grant: a poll is one `stat` unless the
    grant changed. A file that disappears after the first read (the operator withdrew the
    grant: the job is being stopped) keeps the last grant, as horovodrun keeps the last
    hosts when its script fails; the first read must succeed, as horovodrun's first
    discovery must.
    """

    def __init__(
        self,
        path: Path,
        default_slots: int = 1,
        on_change: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.default_slots = default_slots
        self.on_change = on_change
        self._seen: tuple[int, int, int] | None = None
        self._slots: dict[str, int] = {}
        self._missing_reported = False

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is None:
                raise
            if not self._missing_reported:
                log.warning("grant file %s is gone; keeping the last grant", self.path)
                self._missing_reported = True
            return dict(self._slots)
        self._missing_reported = False
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            slots = parse_grant(self.path.read_text(), self.default_slots, self.path)
            self._seen = key
            if slots != self._slots:
                self._slots = slots
                if self.on_change is not None:
                    self.on_change(dict(slots))
        return dict(self._slots)


class MissedUpdateRedelivery:
    """Tells the coordinator worker of a host change that Horovod could not tell it, or that
    the coordinator lost.

    Horovod's driver notifies only when discovery sees a change, and drops the notice when
    no coordinator worker has registered yet (the workers are still starting: importing
    torch takes seconds). A grant changed then would wait for the next change, which may
    never come. This wraps the driver's notifier to remember a dropped notice, and once a
    coordinator has been registered for a whole poll (its listener is then in place),
    delivers it if the hosts still call for other assignments.

    A notice that reaches the coordinator is lost too when it lands while the worker resets:
    Horovod's `State.on_reset` empties the queue of host messages after the worker's new
    rendezvous, so a change seen between the driver's answer to that rendezvous and the
    end of the worker's reset is never acted on (a grow given up, then offered again as its
    worker ended, hit this under load: the job stayed at its old size). So a notice still
    not acted on after `redeliver_seconds` (the workers run with the assignments of before
    it) is told again, until they act on it; a worker that had queued it acts once.
    """

    def __init__(
        self,
        driver: Any,
        period: float,
        redeliver_seconds: float = REDELIVER_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.driver = driver
        self.period = period
        self.redeliver_seconds = redeliver_seconds
        self.clock = clock
        self._notify = driver._notify_workers_host_changes
        self._dropped = HostUpdateResult.no_update
        self._told = HostUpdateResult.no_update
        """What the notices sent to a coordinator and not yet acted on said."""
        self._told_at = 0.0
        self._lock = threading.Lock()
        driver._notify_workers_host_changes = self._notify_and_remember

    def _coordinator_client(self) -> Any:
        coordinator = self.driver.get_coordinator_info()
        return None if coordinator is None else self.driver.get_worker_client(coordinator)

    def _notify_and_remember(self, current_hosts: Any, update_res: Any) -> None:
        heard = self._coordinator_client() is not None
        self._notify(current_hosts, update_res)
        with self._lock:
            if heard:
                self._dropped = HostUpdateResult.no_update
                self._told |= update_res
                self._told_at = self.clock()
            else:
                self._dropped |= update_res

    def _assignments_would_change(self) -> bool:
        """Whether the current hosts give other assignments than the workers run with.

        The same test Horovod's notifier makes before it tells anyone: a notice dropped at
        start-up for the hosts the first workers were started on is stale, not missed.
        """
        hosts = self.driver._host_manager.current_hosts
        next_assignments: dict[str, Any] = {}
        if hosts.count_available_slots() >= self.driver._min_num_proc:
            next_assignments, _ = self.driver._get_host_assignments(hosts)
        return bool(next_assignments != self.driver.host_assignments)

    def poll(self, seen_client: bool) -> bool:
        """One look: deliver a dropped notice if it is still due, and again one told
        `redeliver_seconds` ago that the workers have not acted on; whether a coordinator
        is registered now (a notice is delivered only after it was seen for a whole period)."""
        client = self._coordinator_client() is not None
        with self._lock:
            dropped, told = self._dropped, self._told
            told_long_ago = self.clock() - self._told_at >= self.redeliver_seconds
        if dropped != HostUpdateResult.no_update and client and seen_client:
            with self.driver._wait_hosts_cond:
                if self._assignments_would_change():
                    log.info("telling the workers of a host change they missed while starting")
                    self._notify_and_remember(self.driver._host_manager.current_hosts, dropped)
                else:
                    with self._lock:
                        self._dropped = HostUpdateResult.no_update
        elif told != HostUpdateResult.no_update and client and told_long_ago:
            with self.driver._wait_hosts_cond:
                if self._assignments_would_change():
                    log.info(
                        "telling the workers again of a host change not acted on in %.0f s",
                        self.redeliver_seconds,
                    )
                    self._notify_and_remember(self.driver._host_manager.current_hosts, told)
                else:
                    with self._lock:
                        self._told = HostUpdateResult.no_update
        return client

    def run(self) -> None:
        seen_client = False
        while not self.driver._shutdown.wait(self.period):
            seen_client = self.poll(seen_client)

    def start(self) -> None:
        threading.Thread(target=self.run, name="missed-updates", daemon=True).start()
