"""Where the operator keeps its state on disk.

Everything lives under one state directory, so that a restarted operator, the
CLI and the workers on other nodes (through a shared file system) find it;
except the grant files and discovery scripts. Horovod reads those once a
second per job, only on the host that runs `horovodrun` (the operator's), and
the operator rewrites them after a restart, so they live in a private runtime
directory on local tmpfs when there is one: no metadata traffic to a parallel
file system for every job every second, and no disk journal in the way of a
burst of new grants.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from herd_operator.auth import checked_job_name, is_host
from herd_operator.environment import STATE_DIR_ENV

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = ".herd-state"


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


RUNTIME_PREFIX = "herd-operator-"
"""Name prefix of runtime directories (tempfile.mkdtemp adds a random suffix)."""
SHARED_MEMORY = Path("/dev/shm")


@dataclass(frozen=True)
class StateLayout:
    root: Path
    runtime: Path | None = None
    """The operator's private runtime directory, or None: the grants live under `root`."""

    @property
    def database(self) -> Path:
        return self.root / "state.db"

    @property
    def token_file(self) -> Path:
        return self.root / "allocator.token"

    @property
    def secrets_dir(self) -> Path:
        """Keys derived from the token and the jobs' spec env, one 0600 file each.

        In the state dir, not the runtime dir: workers on other nodes read them."""
        return self.root / "secrets"

    @property
    def legacy_agent_token_file(self) -> Path:
        """Where operators before per-host agent keys put the one key of every agent; a new
        operator removes it (no server accepts it any more)."""
        return self.secrets_dir / "agent.token"

    def agent_token_file(self, host: str) -> Path:
        """The key of ``host``'s node agent: proves ``agent:<host>`` and nothing more."""
        if not is_host(host):
            raise ValueError(f"{host!r} is not a host name")
        return self.secrets_dir / f"agent-{host}.token"

    def job_token_file(self, job: str) -> Path:
        """The job's key: proves ``job:<job>`` and nothing more."""
        return self.secrets_dir / f"job-{checked_job_name(job)}.token"

    def job_env_file(self, job: str) -> Path:
        """The spec's `env` of the job's current launch, for the shim to load."""
        return self.secrets_dir / f"job-{checked_job_name(job)}.env.json"

    @property
    def endpoint_file(self) -> Path:
        """The allocator's address, for CLI commands and workers started by hand."""
        return self.root / "allocator.json"

    @property
    def scrape_targets_file(self) -> Path:
        """Prometheus file_sd targets (the operator and the node exporters)."""
        return self.root / "prometheus" / "targets.json"

    @property
    def grants_dir(self) -> Path:
        return (self.runtime or self.root) / "grants"

    @property
    def runtime_record(self) -> Path:
        """Names the runtime directory in use, so the next operator can remove it after a
        crash."""
        return self.root / "runtime-dir"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    @property
    def launches_dir(self) -> Path:
        """One record per running launch and the exit status its keeper wrote, so a restarted
        operator adopts the jobs instead of starting them again."""
        return self.root / "launches"

    def grant_file(self, job: str) -> Path:
        return self.grants_dir / f"{checked_job_name(job)}.hosts"

    def discovery_script(self, job: str) -> Path:
        return self.grants_dir / f"{checked_job_name(job)}.discover.sh"

    def log_file(self, job: str) -> Path:
        return self.logs_dir / f"{checked_job_name(job)}.log"

    def create(self) -> None:
        for directory in (
            self.root,
            self.grants_dir,
            self.logs_dir,
            self.launches_dir,
            self.scrape_targets_file.parent,
            self.secrets_dir,
        ):
            if directory.exists() and not directory.is_dir():
                # mkdir would say "File exists", as if all were well.
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(directory))
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Whatever existed before: the state dir holds every spec's env, the logs and
            # the allocator's address; other users of a shared node must not read them.
            os.chmod(directory, 0o700)


def runtime_base(requested: Path | None) -> Path | None:
    """Where to make a runtime directory: `requested`, else the user's `$XDG_RUNTIME_DIR`,
    else /dev/shm; None when neither is a usable directory (the state dir serves then)."""
    if requested is not None:
        return requested
    candidates = [Path(xdg)] if (xdg := os.environ.get("XDG_RUNTIME_DIR")) else []
    for candidate in [*candidates, SHARED_MEMORY]:
        if candidate.is_dir() and os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    return None


def make_runtime_dir(base: Path) -> Path:
    """A new private (0700) directory in `base`; mkdtemp makes it safe in a shared /dev/shm."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=RUNTIME_PREFIX, dir=base))


def is_runtime_dir(path: Path) -> bool:
    """Whether `path` is a runtime directory this user made (not a link, private)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and stat.S_IMODE(info.st_mode) & 0o077 == 0
        and path.name.startswith(RUNTIME_PREFIX)
    )


def remove_runtime_dir(path: Path) -> None:
    """Remove a runtime directory that this user made; anything else is left alone."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if (
        not stat.S_ISDIR(info.st_mode)  # a symlink is not followed
        or info.st_uid != os.getuid()
        or not path.name.startswith(RUNTIME_PREFIX)
    ):
        log.warning("not removing %s: not a runtime directory of this user", path)
        return
    shutil.rmtree(path, ignore_errors=True)


def write_atomically(path: Path, text: str, mode: int = 0o644, *, durable: bool = True) -> None:
    """Write via a temporary file and rename, so readers never see half a file.

    `durable` also fsyncs before the rename (the content survives a crash), which costs
    a few milliseconds on many file systems.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            if durable:
                os.fsync(handle.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
