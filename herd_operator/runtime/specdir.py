"""The watched spec directory: the source of desired state.

A full relist is the source of truth (inotify does not work on NFS or Lustre);
watchdog events only make the next relist happen sooner. A relist re-reads
only files whose (inode, size, mtime) changed, so it stays cheap with many
files, and it reports the job names whose view changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from herd_operator.controllers.ports import SpecView
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.policies.base import PolicyError
from herd_operator.policies.registry import load_policy
from herd_operator.runtime.engines import engine_problems
from herd_operator.specs import (
    SpecError,
    SpecFile,
    SpecIndex,
    index_specs,
    is_spec_filename,
    load_spec_file,
    spec_fingerprint,
)
from herd_operator.specs.models import is_job_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Stamp:
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


class SpecDirectory:
    def __init__(self, directory: Path, *, owner_uid: int | None = None) -> None:
        self.directory = directory
        self.owner_uid = os.geteuid() if owner_uid is None else owner_uid
        """Only files of this user are read: their commands run as the operator's user."""
        self._lock = threading.Lock()
        # Per file: its stamp, what loading it gave (references checked) and the job's
        # fingerprint ("" without a job): both computed once per change of the file.
        self._files: dict[str, tuple[_Stamp, SpecFile, str]] = {}
        self._views: dict[str, SpecView] = {}
        self._keys: dict[str, tuple[str, ...]] = {}
        self._unnamed: tuple[str, ...] = ()
        # The job name each file declared when it last could be read: a file that no
        # longer parses far enough to show its name still speaks for that job.
        self._declared: dict[str, str] = {}
        # Entries named like specs that are not read, and why: said once, not every relist.
        self._skipped: dict[str, str] = {}
        self._warned_writable = False

    def view(self, name: str) -> SpecView | None:
        with self._lock:
            return self._views.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._views)

    @staticmethod
    def _to_read(entry: os.DirEntry[str], directory: Path) -> tuple[Path | None, str]:
        """The path to read for an entry named like a spec, or None and why it is skipped.

        A link is read at the target it was checked to have, not through the link again,
        so it cannot be turned out of the directory between the check and the read.
        """
        if entry.is_symlink():
            target = Path(entry.path).resolve()
            if directory not in target.parents:
                # The operator's user may read what the spec's author may not (the token
                # file, say); and errors would quote the target's lines into the log.
                return None, f"a link to {target}, outside the spec directory"
            if not target.exists():
                return None, "a dangling link"
            return (target, "") if target.is_file() else (None, "not a regular file")
        if not entry.is_file():
            return None, "not a regular file"
        return Path(entry.path), ""

    def _warn_if_writable_by_others(self, directory: Path) -> None:
        """Say once that others may drop files here; only the operator's user's are read."""
        if self._warned_writable:
            return
        try:
            mode = directory.stat().st_mode
        except OSError:
            return
        if mode & 0o022:
            self._warned_writable = True
            log.warning(
                "spec directory %s is writable by other users (mode %o): only spec files owned"
                " by the operator's user are read; make it private with `chmod go-w %s`",
                directory, mode & 0o777, directory,
            )  # fmt: skip

    def relist(self) -> set[str]:
        """Re-read the directory; returns the names whose view changed (new and deleted too)."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            log.warning("spec directory %s does not exist (yet); no jobs declared", self.directory)
            entries = []
        directory = self.directory.resolve()
        self._warn_if_writable_by_others(directory)
        files, skipped = self._read(entries, directory)
        for file_name in sorted(skipped.keys() - self._skipped.keys()):
            log.warning("spec directory: skipping %s: %s", file_name, skipped[file_name])
        self._skipped = skipped
        spec_files, fingerprints, declared = self._declared_by(files)
        index = index_specs(spec_files)
        views, keys = _views_of(index, fingerprints)
        unnamed = tuple(str(error) for error in index.unnamed)
        with self._lock:
            changed = {
                name
                for name in views.keys() | self._keys.keys()
                if keys.get(name) != self._keys.get(name)
            }
            new_unnamed = set(unnamed) - set(self._unnamed)
            self._files, self._views, self._keys, self._unnamed = files, views, keys, unnamed
            self._declared = declared
        for message in sorted(new_unnamed):
            log.warning("invalid spec file: %s", message)
        return changed

    def _read(
        self, entries: list[os.DirEntry[str]], directory: Path
    ) -> tuple[dict[str, tuple[_Stamp, SpecFile, str]], dict[str, str]]:
        """Per spec file: its stamp, what loading it gave and its job's fingerprint (read
        again only when its stamp changed); and the entries skipped, with why."""
        files: dict[str, tuple[_Stamp, SpecFile, str]] = {}
        skipped: dict[str, str] = {}
        for entry in sorted(entries, key=lambda e: e.name):
            if not is_spec_filename(entry.name):
                continue
            try:
                path, skip = self._to_read(entry, directory)
                st = entry.stat() if path is not None else None
            except OSError:
                continue  # removed between listing and stat
            if st is not None and st.st_uid != self.owner_uid:
                # A spec's command runs as the operator's user: a file someone else wrote
                # (in a shared or group-writable directory) must not make us run it.
                path, skip = (
                    None,
                    (
                        f"owned by uid {st.st_uid}, not by the operator's user (uid"
                        f" {os.geteuid()}); its command would run as the operator's user"
                    ),
                )
            if path is None or st is None:
                skipped[entry.name] = skip
                continue
            stamp = _Stamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            cached = self._files.get(entry.name)
            if cached is not None and cached[0] == stamp:
                files[entry.name] = cached
            else:
                loaded = with_known_references(load_spec_file(path))
                fingerprint = spec_fingerprint(loaded.job) if loaded.job is not None else ""
                files[entry.name] = (stamp, loaded, fingerprint)
        return files, skipped

    def _declared_by(
        self, files: dict[str, tuple[_Stamp, SpecFile, str]]
    ) -> tuple[list[SpecFile], dict[int, str], dict[str, str]]:
        """The files to index, their fingerprints (by the loaded SpecFile's identity) and
        the job name each file declares now."""
        declared: dict[str, str] = {}
        spec_files = []
        fingerprints: dict[int, str] = {}
        for file_name, (_, spec_file, fingerprint) in files.items():
            fingerprints[id(spec_file)] = fingerprint
            if (
                spec_file.job is None
                and file_name in self._declared
                and (spec_file.name is None or not is_job_name(spec_file.name))
            ):
                # A file that no longer names a job (or names one that cannot exist, like
                # `ALPHA`) still speaks for the job it declared: that job keeps its last good
                # spec (SpecValid=False) instead of being deleted.
                spec_file = dataclasses.replace(spec_file, name=self._declared[file_name])
            if spec_file.name is not None:
                declared[file_name] = spec_file.name
            spec_files.append(spec_file)
        return spec_files, fingerprints, declared


def _views_of(
    index: SpecIndex, fingerprints: dict[int, str]
) -> tuple[dict[str, SpecView], dict[str, tuple[str, ...]]]:
    """Each job's view, and the key that says when it changed (its file and fingerprint, or
    its errors)."""
    views: dict[str, SpecView] = {}
    keys: dict[str, tuple[str, ...]] = {}
    for name, spec_file in index.jobs.items():
        assert spec_file.job is not None
        fingerprint = fingerprints[id(spec_file)]
        views[name] = SpecView(name, str(spec_file.path), spec_file.job, (), fingerprint)
        keys[name] = (str(spec_file.path), fingerprint)
    for name, errors in index.invalid.items():
        messages = tuple(str(error) for error in errors)
        views[name] = SpecView(name, errors[0].file if errors else "", None, messages)
        keys[name] = messages
    return views, keys


def with_known_references(spec_file: SpecFile) -> SpecFile:
    """The file as an invalid one if it names a policy or an engine this operator does not
    have, or the policy's params or the engine's options are wrong: spec errors
    (SpecValid=False), and a job that never ran never starts. The one place these references
    are checked, where specs are loaded: the operator's spec directory (once per change of a
    file) and `validate`."""
    if spec_file.job is None:
        return spec_file
    path = str(spec_file.path)
    errors: list[SpecError] = []
    try:
        load_policy(spec_file.job.spec.policy)
    except PolicyError as err:
        errors += [SpecError(path, field, what) for field, what in err.problems]
    errors += [SpecError(path, field, what) for field, what in engine_problems(spec_file.job.spec)]
    if not errors:
        return spec_file
    return dataclasses.replace(spec_file, job=None, errors=tuple(errors))


class DirectoryWatcher:
    """Wakes the relist loop on file events (watchdog) and every `relist_seconds` regardless."""

    def __init__(
        self,
        specs: SpecDirectory,
        on_changed: Callable[[set[str]], None],
        *,
        relist_seconds: float = 10.0,
        use_events: bool = True,
        health: LoopHealth | None = None,
    ) -> None:
        self.specs = specs
        self.on_changed = on_changed
        self.relist_seconds = relist_seconds
        self.use_events = use_events
        self._loop = Periodic(
            "spec-relist",
            self._relist,
            relist_seconds,
            what=f"relist of {specs.directory}",
            health=health,
        )
        self._observer: object | None = None

    @property
    def name(self) -> str:
        return self._loop.name

    def start(self) -> None:
        self.on_changed(self.specs.relist())
        if self.use_events:
            self._start_observer()
        self._loop.start()

    def _start_observer(self) -> None:
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        wake = self._loop.wake

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                wake()

        observer = Observer()
        try:
            observer.schedule(Handler(), str(self.specs.directory), recursive=False)
            observer.start()
        except OSError as err:  # no inotify (limits, NFS): the relist still works
            log.warning(
                "file events unavailable for %s (%s); relisting every %.0fs",
                self.specs.directory,
                err,
                self.relist_seconds,
            )
            return
        self._observer = observer

    def _relist(self) -> None:
        changed = self.specs.relist()
        if changed:
            self.on_changed(changed)

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        observer = self._observer
        if observer is not None:
            observer.stop()  # type: ignore[attr-defined]
            observer.join(timeout=timeout)  # type: ignore[attr-defined]
        self._loop.stop(timeout)
