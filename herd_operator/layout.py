"""Where the operator keeps its state on disk.

Everything lives under one state directory, so that a restarted operator, the
CLI and the workers on other nodes (through a shared file system) find it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

STATE_DIR_ENV = "HERD_STATE_DIR"
DEFAULT_STATE_DIR = ".herd-state"


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_DIR_ENV, DEFAULT_STATE_DIR))


@dataclass(frozen=True)
class StateLayout:
    root: Path

    @property
    def database(self) -> Path:
        return self.root / "state.db"

    @property
    def token_file(self) -> Path:
        return self.root / "allocator.token"

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
        return self.root / "grants"

    @property
    def logs_dir(self) -> Path:
        return self.root / "logs"

    def grant_file(self, job: str) -> Path:
        return self.grants_dir / f"{job}.hosts"

    def discovery_script(self, job: str) -> Path:
        return self.grants_dir / f"{job}.discover.sh"

    def log_file(self, job: str) -> Path:
        return self.logs_dir / f"{job}.log"

    def create(self) -> None:
        for directory in (
            self.root,
            self.grants_dir,
            self.logs_dir,
            self.scrape_targets_file.parent,
        ):
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)


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
