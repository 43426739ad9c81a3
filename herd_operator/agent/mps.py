"""An NVIDIA MPS control daemon for this node, opt-in (`herd-operator run --mps`).

With MPS, the CUDA processes of several jobs on one GPU share its compute at once instead of
taking turns, and each client's memory is capped by `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`, which
the shim sets from the worker's limit (HERD_GPU_MEMORY_LIMIT_BYTES). The daemon gets pipe and
log directories of its own under the operator's runtime directory (not /tmp/nvidia-mps, which
another user's daemon on a shared node may hold); the workers find it through
`CUDA_MPS_PIPE_DIRECTORY`, which the operator adds to their environment (`environment`).

Started with `nvidia-cuda-mps-control -d`, stopped at teardown by writing `quit` to its
control command. A node without the binary refuses `--mps` at start, with the reason.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
PIPE_DIRECTORY_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIRECTORY_ENV = "CUDA_MPS_LOG_DIRECTORY"
START_SECONDS = 30.0

Run = Callable[..., Any]
"""subprocess.run's shape (a seam for the tests' stand-in binary)."""


class MpsError(Exception):
    """The MPS daemon cannot be started here: the message says why."""


def mps_environment(directory: Path) -> dict[str, str]:
    """Where this node's daemon and its clients meet (pipes) and where it logs."""
    return {
        PIPE_DIRECTORY_ENV: str(directory / "pipe"),
        LOG_DIRECTORY_ENV: str(directory / "log"),
    }


def start_argv(binary: str) -> list[str]:
    """The control daemon's start: `-d` makes it a daemon, which returns once it runs."""
    return [binary, "-d"]


class MpsDaemon:
    """A runnable for the operator's manager: starts the node's MPS control daemon in
    `directory`, and stops it (`quit`) at teardown."""

    name = "mps-daemon"

    def __init__(
        self,
        directory: Path,
        *,
        binary: str | None = None,
        run: Run = subprocess.run,
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        self.directory = directory
        self._binary = binary
        self._run = run
        self._environ = environ
        self._started: str | None = None

    def environment(self) -> dict[str, str]:
        """What the jobs' workers need to be this daemon's clients."""
        return {PIPE_DIRECTORY_ENV: mps_environment(self.directory)[PIPE_DIRECTORY_ENV]}

    def start(self) -> None:
        binary = self._binary or shutil.which(MPS_CONTROL, path=self._environ.get("PATH"))
        if binary is None:
            raise MpsError(
                f"--mps: {MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's "
                "utilities); run without --mps, or where MPS is installed"
            )
        env = {**self._environ, **mps_environment(self.directory)}
        for path in (Path(env[PIPE_DIRECTORY_ENV]), Path(env[LOG_DIRECTORY_ENV])):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self._run(
                start_argv(binary),
                env=env,
                check=True,
                timeout=START_SECONDS,
                stdin=subprocess.DEVNULL,
                capture_output=True,
            )
        except (OSError, subprocess.SubprocessError) as err:
            raise MpsError(
                f"--mps: {MPS_CONTROL} -d failed: {err} (its log: {env[LOG_DIRECTORY_ENV]})"
            ) from err
        self._started = binary
        log.info("MPS control daemon started (pipes in %s)", env[PIPE_DIRECTORY_ENV])

    def stop(self, timeout: float) -> None:
        binary, self._started = self._started, None
        if binary is None:
            return
        env = {**self._environ, **mps_environment(self.directory)}
        try:
            # `quit` to the control command stops the daemon and its servers.
            self._run([binary], input=b"quit\n", env=env, timeout=timeout, capture_output=True)
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("stopping the MPS control daemon failed: %s", err)
