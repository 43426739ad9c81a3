"""What an operator holds on its state dir, and what it leaves to the next one.

Three things: the state dir's lock (one operator per dir), the runtime directory where
its jobs' grants and discovery scripts live (with the record that names it), and the
endpoint file (where it serves: the CLI, node agents and the next operator read it; its
port is the one the jobs' workers know). Crash-only: a killed operator leaves all three,
and the next start takes them over (it uses the runtime dir again when its jobs run on).

Each is taken with a clean-up registered on the operator's `Manager`, and how the
operator ends (`Ending`) decides what the clean-ups leave. Apart from the operator's
wiring because this is the part of a start and of a teardown that the next operator
depends on (tests/unit/test_operator_start.py, tests/integration/test_runtime_dir.py).
"""

from __future__ import annotations

import enum
import fcntl
import json
import logging
import os
from pathlib import Path

from herd_operator.layout import (
    StateLayout,
    is_runtime_dir,
    make_runtime_dir,
    remove_runtime_dir,
    runtime_base,
    write_atomically,
)
from herd_operator.lifecycle import Manager
from herd_operator.rpc.protocol import parse_address
from herd_operator.runtime.config import OperatorError

log = logging.getLogger(__name__)


class Ending(enum.Enum):
    """How the operator ends, which decides what its clean-ups leave for the next one."""

    REFUSED = "refused"
    """The start failed: jobs a previous operator left run on (adopted or not), so what it
    left (its runtime dir, its endpoint file) stays as it was; what this start made goes."""
    STOPPED = "stopped"
    """The jobs are stopped with the operator: nothing is left for a next one."""
    HANDED_OVER = "handed over"
    """`--leave-jobs-running` with jobs running: the next operator adopts them, and needs
    their grants where their discovery scripts read them and the port their workers know."""


class Handover:
    """The state dir at `root` as one operator holds it; `ending` is set before the
    manager's stop runs the clean-ups (STOPPED until then)."""

    def __init__(self, root: Path, manager: Manager) -> None:
        self.layout = StateLayout(root)
        self.ending = Ending.STOPPED
        self._manager = manager

    def lock(self) -> None:
        """Take the state dir's lock (released last): one operator a state dir."""
        root = self.layout.root
        if root.exists() and not root.is_dir():  # mkdir would say only "File exists"
            raise OperatorError(f"the state dir {root} is not a directory")
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        handle = open(root / "operator.lock", "w")  # noqa: SIM115
        self._manager.defer("the state dir's lock", handle.close)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise OperatorError(f"another herd-operator is running on state dir {root}") from err

    def use_runtime_dir(self, requested: Path | None) -> Path | None:
        """Pick this run's runtime directory (in `requested`, else the default base) and
        record it; returns the one recorded before, and `layout` now names this one.

        The previous operator's is used again when it is still there: the jobs it started
        run on (they are adopted) and their discovery scripts read their grants from it.
        """
        record = self.layout.runtime_record
        try:
            previous: Path | None = Path(record.read_text().strip())
        except FileNotFoundError:
            previous = None
        base = runtime_base(requested)
        runtime = None
        if previous is not None and is_runtime_dir(previous):
            runtime = previous
        elif base is not None:
            try:
                runtime = make_runtime_dir(base)
            except OSError as err:
                if requested is not None:
                    raise OperatorError(
                        f"cannot make a runtime directory in {base}: {err}"
                    ) from err
                log.warning(
                    "no runtime directory in %s (%s); grants go to the state dir", base, err
                )
        self.layout = StateLayout(self.layout.root, runtime)
        if runtime is None:
            record.unlink(missing_ok=True)
        else:
            write_atomically(record, f"{runtime}\n")
        self._manager.defer("the runtime dir", lambda: self._release_runtime_dir(previous))
        log.info("grants and discovery scripts in %s", self.layout.grants_dir)
        return previous

    def previous_port(self) -> int | None:
        """The port in the endpoint file a previous operator left (after a crash)."""
        try:
            endpoint = json.loads(self.layout.endpoint_file.read_text(encoding="utf-8"))
            return parse_address(str(endpoint["address"]))[1]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write_endpoint(self, address: str, metrics: str | None, pool: str) -> None:
        """Say where this operator serves (its RPC address, its metrics, its pid)."""
        endpoint = self.layout.endpoint_file
        try:
            previous: str | None = endpoint.read_text(encoding="utf-8")
        except FileNotFoundError:
            previous = None
        fields = {"address": address, "metrics": metrics, "pid": os.getpid(), "pool": pool}
        write_atomically(endpoint, json.dumps(fields), mode=0o600)
        self._manager.defer("the endpoint file", lambda: self._release_endpoint(previous))

    def _release_endpoint(self, previous: str | None) -> None:
        """Kept when handing over (the port the workers know); after a refused start, the
        file a previous operator left is put back; else removed."""
        endpoint = self.layout.endpoint_file
        if self.ending is Ending.HANDED_OVER:
            return
        if self.ending is Ending.REFUSED and previous is not None:
            write_atomically(endpoint, previous, mode=0o600)
        else:
            endpoint.unlink(missing_ok=True)

    def _release_runtime_dir(self, previous: Path | None) -> None:
        """Remove this run's runtime dir, unless the jobs left running read their grants
        there: handed over, or the previous operator's dir after a refused start (for the
        next start to deal with: it adopts the jobs, or removes it)."""
        made = self.layout.runtime
        if self.ending is Ending.HANDED_OVER:
            return
        if self.ending is Ending.REFUSED and made == previous:
            return
        if made is not None:
            remove_runtime_dir(made)
        record = self.layout.runtime_record
        if self.ending is Ending.REFUSED and previous is not None:
            write_atomically(record, f"{previous}\n")
        else:
            record.unlink(missing_ok=True)
