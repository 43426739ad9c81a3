"""Bounds what deleted jobs leave behind over a long allocation, the way Kubernetes bounds
finished objects (`ttlSecondsAfterFinished`) and events (a TTL).

A job whose spec file is deleted leaves its grant history in the store and its log under
the state dir (and, after a crash, maybe its key and env files). Once a deleted job has
been quiet for the retention period, the pruner removes them. It runs on its own thread,
in small steps: one store transaction looks at a bounded number of job names
(`PRUNE_BATCH_JOBS`), and between steps the store's lock is free for the control loop and
the RPC thread, so a prune never stalls them.

What counts as deleted: no record in the store (the reconciler removes a job's record once
its processes are gone) and no process in the launcher. What counts as quiet: the newest
grant change (store) or the file's modification time (files) is older than the retention.
A job declared again under the same name has a record, so nothing of it is touched.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from herd_operator.layout import StateLayout
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.runtime.store import Store, StoreError

log = logging.getLogger(__name__)

DEFAULT_RETENTION_SECONDS = 24 * 3600.0
"""How long a deleted job's grant history and files are kept (`run --deleted-job-retention`)."""
PRUNE_INTERVAL_SECONDS = 60.0
"""How often the pruner walks the store and the state dir."""
PAUSE_SECONDS = 0.01
"""Between two steps of a walk: the store's lock is free for the loop meanwhile."""
FILES_PER_STEP = 500

_EXIT_FILE = re.compile(r"(?P<job>.+)\.[0-9a-f]{32}\.exit")


@dataclass(frozen=True)
class PruneResult:
    histories: int
    files: int
    bytes: int


class Pruner:
    """Removes deleted jobs' grant history and files once they are older than the
    retention; `prune_once` is one full walk, `start` walks every `interval` seconds (a
    `Periodic`: a failing walk is logged and retried)."""

    def __init__(
        self,
        store: Store,
        layout: StateLayout,
        running: Callable[[], Collection[str]],
        *,
        retention_seconds: float = DEFAULT_RETENTION_SECONDS,
        interval_seconds: float = PRUNE_INTERVAL_SECONDS,
        pause_seconds: float = PAUSE_SECONDS,
        clock: Callable[[], float] = time.time,
        health: LoopHealth | None = None,
    ) -> None:
        if retention_seconds < 0:
            raise ValueError(f"retention_seconds must be >= 0, got {retention_seconds}")
        self.store = store
        self.layout = layout
        self.running = running
        self.retention_seconds = retention_seconds
        self.interval_seconds = interval_seconds
        self.pause_seconds = pause_seconds
        self.clock = clock
        self._loop = Periodic(
            "pruner",
            self._walk,
            interval_seconds,
            what="pruning deleted jobs' history and files",
            # A full disk, a busy database: the next walk retries.
            expected=(StoreError,),
            health=health,
        )
        self._stop = self._loop.stopping

    @property
    def name(self) -> str:
        return self._loop.name

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        self._loop.stop(timeout)

    def _walk(self) -> None:
        result = self.prune_once()
        if result.histories or result.files:
            log.info(
                "pruned %d deleted job(s)' grant history and %d file(s) (%d bytes)"
                " older than %.0f s",
                result.histories,
                result.files,
                result.bytes,
                self.retention_seconds,
            )

    def prune_once(self) -> PruneResult:
        """One walk over the grant history and the per-job files, in small steps."""
        cutoff = self.clock() - self.retention_seconds
        histories = 0
        after: str | None = ""
        while after is not None and not self._stop.is_set():
            pruned, after = self.store.prune_deleted_history(cutoff, after)
            histories += len(pruned)
            if after is not None:
                self._stop.wait(self.pause_seconds)
        files = size = 0
        # Once per walk: most old files belong to declared jobs, which need no store read
        # each (a job declared after this is asked about again before its file goes).
        declared = {record.name for record in self.store.list_jobs()}
        for directory, job_of in (
            (self.layout.logs_dir, _suffixed(".log")),
            (self.layout.secrets_dir, _job_secret),
            (self.layout.launches_dir, _stray_exit_file(self.layout.launches_dir)),
        ):
            removed, freed = self._prune_files(directory, job_of, cutoff, declared)
            files += removed
            size += freed
        return PruneResult(histories, files, size)

    def _prune_files(
        self,
        directory: Path,
        job_of: Callable[[str], str | None],
        cutoff: float,
        declared: Collection[str],
    ) -> tuple[int, int]:
        try:
            entries = os.scandir(directory)
        except FileNotFoundError:
            return 0, 0
        removed = freed = seen = 0
        with entries:
            for entry in entries:
                seen += 1
                if seen % FILES_PER_STEP == 0:
                    self._stop.wait(self.pause_seconds)
                    if self._stop.is_set():
                        break
                job = job_of(entry.name)
                if job is None or job in declared:
                    continue
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if info.st_mtime >= cutoff or not entry.is_file(follow_symlinks=False):
                    continue
                # Asked last, per file: a job declared again since has a record.
                if job in self.running() or self.store.get_job(job) is not None:
                    continue
                try:
                    os.unlink(entry.path)
                except OSError as err:
                    log.warning("cannot remove %s of deleted job %s: %s", entry.path, job, err)
                    continue
                removed += 1
                freed += info.st_size
        return removed, freed


def _suffixed(suffix: str) -> Callable[[str], str | None]:
    def job_of(name: str) -> str | None:
        if name.startswith(".") or not name.endswith(suffix) or name == suffix:
            return None
        return name[: -len(suffix)]

    return job_of


def _job_secret(name: str) -> str | None:
    """`job-<job>.token` and `job-<job>.env.json` (see `StateLayout`)."""
    if not name.startswith("job-"):
        return None
    for suffix in (".env.json", ".token"):
        if name.endswith(suffix) and len(name) > len("job-") + len(suffix):
            return name[len("job-") : -len(suffix)]
    return None


def _stray_exit_file(launches: Path) -> Callable[[str], str | None]:
    """An exit file whose launch record is gone (a crash between removing the two)."""

    def job_of(name: str) -> str | None:
        match = _EXIT_FILE.fullmatch(name)
        if match is None or (launches / f"{match['job']}.json").exists():
            return None
        return match["job"]

    return job_of
