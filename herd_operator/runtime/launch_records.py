"""What a launch leaves on disk for the operator after this one: its record and its exit file.

A records directory holds, per job, `JOB.json` (0600: the spec with its env; launch id,
pid and start time, generation, command) and, per launch, `JOB.LAUNCH_ID.exit`, which the
keeper (`keeper.py`) writes when the command ends. A restarted operator reads both to adopt
the launches still running and to learn how the others ended.

Apart from the launcher (`launcher.py`), which decides when a record is written, read or
removed: this module is the format and the paths, so the launcher's supervision does not
also carry a file format, and what adoption reads is written in one place.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pydantic

from herd_operator.auth import checked_job_name
from herd_operator.controllers.ports import LaunchInfo
from herd_operator.layout import write_atomically
from herd_operator.runtime.keeper import read_exit_file, read_exit_time, read_launch_error
from herd_operator.specs import HerdJobSpec

_LAUNCH_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A launch id: a uuid4's hex here, a test's or a benchmark's name there; never a path."""


@dataclass(frozen=True)
class LaunchRecord:
    """A launch record: `pid` and `started_at` are None while it is starting (written
    before the process exists)."""

    job: str
    launch_id: str
    pid: int | None
    started_at: float | None
    generation: int
    command: str
    spec: HerdJobSpec

    def info(self) -> LaunchInfo:
        return LaunchInfo(
            launch_id=self.launch_id,
            pid=self.pid or 0,
            started_at=self.started_at or 0.0,
            generation=self.generation,
            command=self.command,
            spec=self.spec,
        )


def read_record(path: Path) -> LaunchRecord:
    """A launch record written by `LaunchRecords.write`; ValueError if it is not one."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    try:
        pid, started_at = data["pid"], data["started_at"]
        launch_id = str(data["launch_id"])
        if _LAUNCH_ID.fullmatch(launch_id) is None:  # it names the exit file
            raise ValueError(f"launch_id {launch_id[:64]!r} is not a launch id")
        return LaunchRecord(
            job=checked_job_name(path.stem),
            launch_id=launch_id,
            pid=None if pid is None else int(pid),
            started_at=None if started_at is None else float(started_at),
            generation=int(data["generation"]),
            command=str(data["command"]),
            spec=HerdJobSpec.model_validate(data["spec"]),
        )
    except (KeyError, TypeError, pydantic.ValidationError) as err:
        raise ValueError(f"not a launch record: {err}") from err


class LaunchRecords:
    """The launch records and exit files of one records directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def record_file(self, job: str) -> Path:
        return self.directory / f"{checked_job_name(job)}.json"

    def exit_file(self, job: str, launch_id: str) -> Path:
        return self.directory / f"{checked_job_name(job)}.{launch_id}.exit"

    def keeper_argv(self, job: str, launch_id: str, argv: list[str]) -> list[str]:
        """`argv` run through a keeper that writes the launch's exit file."""
        exit_file = self.exit_file(job, launch_id)
        return [sys.executable, "-m", "herd_operator.runtime.keeper", str(exit_file), "--", *argv]

    def write(self, record: LaunchRecord, *, durable: bool) -> None:
        data = {
            "launch_id": record.launch_id,
            "pid": record.pid,
            "started_at": record.started_at,
            "generation": record.generation,
            "command": record.command,
            "spec": record.spec.model_dump(mode="json", by_alias=True),
        }
        # 0600: it holds the spec's env.
        write_atomically(
            self.record_file(record.job), json.dumps(data), mode=0o600, durable=durable
        )

    def recorded(self) -> list[Path]:
        """Every record file, in order of job name (none when the directory is absent)."""
        if not self.directory.is_dir():
            return []
        return sorted(self.directory.glob("*.json"))

    def exit_code(self, job: str, launch_id: str) -> int | None:
        return read_exit_file(self.exit_file(job, launch_id))

    def launch_error(self, job: str, launch_id: str) -> str | None:
        return read_launch_error(self.exit_file(job, launch_id))

    def exit_time(self, job: str, launch_id: str) -> float | None:
        return read_exit_time(self.exit_file(job, launch_id))

    def keeper_failure(self, job: str, launch_id: str, code: int | None) -> str | None:
        """Why our keeper child ended with an error and no exit file: it could not start
        (its Python failed, say), so the command never ran. (A keeper that ran the command
        but could not write the file, on a full disk, looks the same; it is then tried
        again with backoff instead of being marked Failed, which errs on the side of the
        job.)"""
        if code is None or code <= 0:
            return None
        if self.exit_file(job, launch_id).exists():
            return None
        return (
            f"the keeper ({sys.executable} -m herd_operator.runtime.keeper) exited with "
            f"status {code} before it ran the command; its output is in the job's log"
        )

    def remove(self, job: str, launch_id: str) -> None:
        """Remove the record and exit file of a launch whose exit is recorded elsewhere."""
        record = self.record_file(job)
        # A launch of the job since then wrote its own record under the same name.
        with contextlib.suppress(OSError, ValueError):
            if read_record(record).launch_id == launch_id:
                record.unlink(missing_ok=True)
        self.exit_file(job, launch_id).unlink(missing_ok=True)
