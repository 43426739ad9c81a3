"""The watched spec directory: the source of desired state.

A full relist is the source of truth (inotify does not work on NFS or Lustre);
watchdog events only make the next relist happen sooner. A relist re-reads
only files whose (inode, size, mtime) changed, so it stays cheap with many
files, and it reports the job names whose view changed.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from herd_operator.controllers.ports import SpecView
from herd_operator.lifecycle import STOP_SECONDS, LoopHealth, Periodic
from herd_operator.policies.base import PolicyError
from herd_operator.policies.registry import load_policy
from herd_operator.runtime.engines import engine_problems
from herd_operator.runtime.store import Store, StoreError
from herd_operator.specs import (
    SpecError,
    SpecFile,
    SpecIndex,
    index_specs,
    is_spec_filename,
    spec_fingerprint,
)
from herd_operator.specs.loading import FILE_FIELD, file_kind, load_spec_descriptor
from herd_operator.specs.models import is_job_name

log = logging.getLogger(__name__)

_LINK_LOOP = "a symlink loop, or a chain of links too long to follow"
_READ_ONLY_EVENTS = frozenset({"opened", "closed_no_write"})
"""watchdog's event types for a file opened, or closed unchanged (watchdog 5 and later)."""


def _ignore_problem(reason: str, message: str) -> None:
    """No one to tell (tests, tools): the log has said it."""


@dataclass(frozen=True)
class _Stamp:
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


class SpecDirectory:
    def __init__(
        self,
        directory: Path,
        *,
        owner_uid: int | None = None,
        on_problem: Callable[[str, str], None] | None = None,
    ) -> None:
        self.directory = directory
        self._on_problem = on_problem or _ignore_problem
        """Told (an event's reason, its message) of each entry skipped and each file that
        cannot be read far enough to name a job, once per problem: a job's own file shows
        on the job (SpecValid=False), but these may have no job to show them on."""
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
        self._version = 0

    def view(self, name: str) -> SpecView | None:
        with self._lock:
            return self._views.get(name)

    @property
    def version(self) -> int:
        """How many relists changed a job's view (new, edited, invalid or deleted): what a
        reader derived from the views is current while this stays the same."""
        with self._lock:
            return self._version

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._views)

    @staticmethod
    def _examine(
        entry: os.DirEntry[str], directory: Path
    ) -> tuple[Path, os.stat_result] | str | None:
        """The path to read for an entry named like a spec and its stat; or why it is
        skipped; or None when it is gone (removed since it was listed).

        A link is read at the target it was checked to have, not through the link again,
        so it cannot be turned out of the directory between the check and the read.
        """
        path = Path(entry.path)
        if entry.is_symlink():
            try:
                path = path.resolve()
            except RuntimeError:  # Python 3.11's "Symlink loop from ..."
                return _LINK_LOOP
            if directory not in path.parents:
                # The operator's user may read what the spec's author may not (the token
                # file, say); and errors would quote the target's lines into the log.
                return f"a link to {path}, outside the spec directory"
        try:
            # Through the link the way the kernel follows it: a loop, or a chain of more
            # links than it follows (40), fails here whatever resolve() made of it.
            status = os.stat(entry.path)
        except FileNotFoundError:
            return "a dangling link" if os.path.lexists(entry.path) else None
        except OSError as err:
            if err.errno == errno.ELOOP:
                return _LINK_LOOP
            return f"cannot be examined: {err.strerror or err}"
        if not stat.S_ISREG(status.st_mode):
            return f"not a regular file ({file_kind(status.st_mode)})"
        return path, status

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
        # Said once per entry and reason, not at every relist.
        new_skipped = sorted(
            (file_name, reason)
            for file_name, reason in skipped.items()
            if self._skipped.get(file_name) != reason
        )
        spec_files, fingerprints, declared = self._declared_by(files, skipped)
        self._skipped = skipped
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
            self._version += bool(changed)
            self._declared = declared
        for file_name, reason in new_skipped:
            log.warning("spec directory: skipping %s: %s", file_name, reason)
            self._on_problem("SpecFileSkipped", f"{self.directory / file_name}: not read: {reason}")
        for message in sorted(new_unnamed):
            log.warning("invalid spec file: %s", message)
            self._on_problem("InvalidSpecFile", message)
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
                read = self._read_one(entry, directory)
            except Exception as err:
                # One entry, whatever it is, must not stop the relist of all the others (a
                # link loop once did, in every relist): it is skipped, and said.
                read = f"cannot be examined: {type(err).__name__}: {err}"
            if isinstance(read, str):
                skipped[entry.name] = read
            elif read is not None:
                files[entry.name] = read
        return files, skipped

    def _read_one(
        self, entry: os.DirEntry[str], directory: Path
    ) -> tuple[_Stamp, SpecFile, str] | str | None:
        """What one entry gives: its stamp, file and fingerprint; why it is skipped; or None
        when it is gone."""
        examined = self._examine(entry, directory)
        if examined is None or isinstance(examined, str):
            return examined
        path, st = examined
        if st.st_uid != self.owner_uid:
            # A spec's command runs as the operator's user: a file someone else wrote
            # (in a shared or group-writable directory) must not make us run it.
            return (
                f"owned by uid {st.st_uid}, not by the operator's user (uid"
                f" {os.geteuid()}); its command would run as the operator's user"
            )
        stamp = _Stamp(st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        cached = self._files.get(entry.name)
        if cached is not None and cached[0] == stamp:
            return cached
        loaded = _load_if_unchanged(path, st)
        if loaded is None:
            # Something was moved over the entry while it was examined: it stays what it
            # was until the next relist (which the move's file event brings on), neither
            # read unchecked nor taken for deleted.
            return cached or self._skipped.get(entry.name)
        loaded = with_known_references(loaded)
        fingerprint = spec_fingerprint(loaded.job) if loaded.job is not None else ""
        return stamp, loaded, fingerprint

    def _declared_by(
        self, files: dict[str, tuple[_Stamp, SpecFile, str]], skipped: dict[str, str]
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
        for file_name, reason in skipped.items():
            name = self._declared.get(file_name)
            if name is None:
                continue
            # An entry that is there but is not read (a FIFO, a link out of the directory,
            # another user's file, moved over the job's file) is an invalid edit, not a
            # deletion: the job keeps its last good spec. Only an entry that is gone
            # deletes the job.
            path = self.directory / file_name
            error = SpecError(str(path), FILE_FIELD, f"not read: {reason}")
            spec_files.append(SpecFile(path=path, name=name, job=None, errors=(error,)))
            declared[file_name] = name
        return spec_files, fingerprints, declared


def _load_if_unchanged(path: Path, examined: os.stat_result) -> SpecFile | None:
    """The spec file at `path`, if it is still the file `examined` (None if not). Opened
    without following a link and checked on the descriptor: what is read is the file whose
    kind and owner were checked, whatever is renamed over it meanwhile."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:  # gone, or a link now (ELOOP)
        return None
    try:
        opened = os.fstat(descriptor)
        if (opened.st_dev, opened.st_ino) != (examined.st_dev, examined.st_ino):
            return None
        return load_spec_descriptor(descriptor, path)
    finally:
        os.close(descriptor)


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


def problems_as_events(store: Store) -> Callable[[str, str], None]:
    """`SpecDirectory`'s `on_problem` for the operator: each problem as a Warning event of
    no job, which `herd-operator events` shows with the file's path in its message."""

    def record(reason: str, message: str) -> None:
        try:
            store.add_event(None, "Warning", reason, message, time.time())
        except StoreError as err:  # a full disk must not stop the relist: the log has it
            log.warning("could not record a spec file's problem as an event: %s", err)

    return record


class DirectoryWatcher:
    """Wakes the relist loop on file events (watchdog) and every `relist_seconds` regardless.

    No file events for a directory on a network file system (runtime/mounts.py): inotify
    sees only this node's writes there, and a spec written from a login node would wait
    for the relist anyway."""

    def __init__(
        self,
        specs: SpecDirectory,
        on_changed: Callable[[set[str]], None],
        *,
        relist_seconds: float = 10.0,
        use_events: bool = True,
        health: LoopHealth | None = None,
        mountinfo: Path | None = None,
    ) -> None:
        self.specs = specs
        self.on_changed = on_changed
        self.relist_seconds = relist_seconds
        self.use_events = use_events
        self.mountinfo = mountinfo
        """The mount table that says whether the directory is on a network file system
        (None: this process's, /proc/self/mountinfo)."""
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
        from herd_operator.runtime.mounts import MOUNTINFO, network_filesystem

        shared = network_filesystem(self.specs.directory, self.mountinfo or MOUNTINFO)
        if shared is not None:  # inotify would report this node's writes only
            log.info(
                "%s is on %s, where a file written on another node makes no event here: "
                "relisting every %.0fs instead (--relist-seconds)",
                self.specs.directory,
                shared,
                self.relist_seconds,
            )
            return
        from watchdog.events import FileSystemEvent, FileSystemEventHandler
        from watchdog.observers import Observer

        on_event = self._file_event

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                on_event(event.event_type)

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

    def _file_event(self, event_type: str) -> None:
        """Wake the relist, unless the event is of a file being read: the relist's own reads
        (watchdog reports opens and closes) would wake it again, and a relist that reads a
        file every time (one that failed did, before it cached anything) would never rest."""
        if event_type not in _READ_ONLY_EVENTS:
            self._loop.wake()

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
