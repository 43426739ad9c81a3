"""The command horovodrun starts on each host, before the user's command.

    python -m herd_operator.agent.shim -- python train.py ...

It asks the allocator which GPUs this job holds on this host, exports them in
local-rank order as CUDA_VISIBLE_DEVICES (so that an unmodified script calling
`torch.cuda.set_device(hvd.local_rank())` lands on the allocator's GPU), and
execs the user's command in its place. On CPU machines the virtual GPU indices
are exported the same way.

The spec's `env` comes in a 0600 file named by HERD_ENV_FILE, not on the command
line that Horovod builds for each worker (which every user can read in `ps`): the
shim adds it to the environment the user's command gets.

It must not fail for a passing reason: Horovod blacklists a host where a
worker fails. When the grant shrank between Horovod's discovery and this
start, the local rank is no longer granted and Horovod is about to remove this
worker: the shim waits (to be bound if the grant grows back, or to be stopped
by Horovod) instead of failing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_delay,
    wait_fixed,
)

from herd_operator.agent import worker
from herd_operator.auth import TokenFileError
from herd_operator.environment import (
    ENV_FILE_ENV,
    GPU_ENV,
    GPU_MEMORY_LIMIT_ENV,
    GPUS_ENV,
    JOB_ENV,
    VIRTUAL_ENV,
    worker_local_rank,
)
from herd_operator.rpc.protocol import AuthError, RpcError

BIND_WAIT_SECONDS = float(os.environ.get("HERD_BIND_TIMEOUT", "600"))
BIND_RETRY_SECONDS = 0.5
# A spec is at most a few MiB; an env file is a part of one.
_MAX_ENV_FILE_BYTES = 16 * 1024 * 1024


TORCHRUN_WORKER_ENV = "TORCHELASTIC_RUN_ID"
"""Set by a torchrun agent in the environment of each worker it starts."""
AGENT_DEATH_SIGNAL = signal.SIGTERM
"""What a torchrun worker gets when its agent dies: as when the agent stops it."""
PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int, parent: int) -> None:
    """Get `sig` when the parent dies; exit at once if it already has (the fork raced it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os._exit(128 + sig)


def die_with_agent(environ: Mapping[str, str]) -> None:
    """Under a torchrun agent, make this process (the worker, after the exec) get SIGTERM
    when the agent dies, however it dies: torch starts each worker in a session of its own,
    so the worker of a SIGKILLed agent trained on, an orphan on its GPU that nobody stops.
    The signal is tied to the agent's thread that started us (torch's main loop) and
    survives the exec. The Horovod engine's driver sets its workers' own."""
    if TORCHRUN_WORKER_ENV in environ:
        set_parent_death_signal(AGENT_DEATH_SIGNAL, os.getppid())


class EnvFileError(Exception):
    """The spec's env file is missing, unreadable or not what the operator writes."""


def read_env_file(path: Path) -> dict[str, str]:
    """The spec's `env` from the operator's file: a JSON object of strings."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_ENV_FILE_BYTES + 1)
    except OSError as err:
        raise EnvFileError(f"cannot read the job's env file {path}: {err.strerror}") from err
    try:
        if len(raw) > _MAX_ENV_FILE_BYTES:
            raise ValueError("too large")
        decoded = json.loads(raw.decode("utf-8"))
    except ValueError:
        # Its content is never quoted: it holds the spec's values.
        raise EnvFileError(f"the job's env file {path} is malformed") from None
    if not isinstance(decoded, dict) or not all(
        isinstance(name, str) and isinstance(value, str) for name, value in decoded.items()
    ):
        raise EnvFileError(f"the job's env file {path} is not an object of strings")
    return decoded


MPS_MEMORY_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


def bind_environment(env: dict[str, str], reply: dict[str, object], local_rank: int) -> None:
    gpus = [str(gpu) for gpu in reply["gpus"]]  # type: ignore[attr-defined]
    env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    env[GPUS_ENV] = ",".join(gpus)
    env[GPU_ENV] = str(reply["gpu"])
    env[VIRTUAL_ENV] = "1" if reply["virtual"] else "0"
    limit = env.get(GPU_MEMORY_LIMIT_ENV, "").strip()
    if limit.isdigit() and int(limit) > 0 and not reply["virtual"] and env[GPU_ENV] in gpus:
        # Where an MPS server runs, it enforces the limit on any CUDA program, torch or not;
        # elsewhere CUDA ignores the variable. Its device numbers are the visible ones.
        ordinal = gpus.index(env[GPU_ENV])
        env.setdefault(MPS_MEMORY_LIMIT_ENV, f"{ordinal}={max(1, int(limit) >> 20)}M")


class ShimExit(Exception):
    """The worker must not run: the message is printed, `code` is its exit status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def bound_environment(environ: dict[str, str]) -> dict[str, str]:
    """The worker's environment: `environ` with the spec's env file loaded and, under the
    operator, its GPUs bound (waiting for the allocator as long as it may be coming)."""
    env = dict(environ)
    env_file = env.pop(ENV_FILE_ENV, None)
    if env_file:
        try:
            env.update(read_env_file(Path(env_file)))
        except EnvFileError as err:
            print(f"herd shim: {err}", file=sys.stderr)
            raise ShimExit(1) from None
    if not worker.under_operator():
        return env
    local_rank = worker_local_rank(env)
    try:
        client = worker.client_from_env(f"shim:{env[JOB_ENV]}:{worker.host_name()}:{local_rank}")
    except (ValueError, TokenFileError) as err:  # no retry makes these right
        print(f"herd shim: {err}", file=sys.stderr)
        raise ShimExit(1) from None

    def warn_once(state: RetryCallState) -> None:
        if state.attempt_number == 1:  # once: a wait of minutes would flood the log
            error = state.outcome.exception() if state.outcome is not None else None
            print(
                f"herd shim: waiting for a GPU for local rank {local_rank}: {error}",
                file=sys.stderr,
                flush=True,
            )

    binding = Retrying(
        # Until the allocator answers (it may be restarting, or the GPU still draining);
        # a wrong token does not fix itself.
        retry=retry_if_exception_type((RpcError, OSError)) & retry_if_not_exception_type(AuthError),
        stop=stop_after_delay(BIND_WAIT_SECONDS),
        wait=wait_fixed(BIND_RETRY_SECONDS),
        before_sleep=warn_once,
        reraise=True,
    )
    try:
        reply = binding(
            client.call,
            "bind",
            job=env[JOB_ENV],
            host=worker.host_name(),
            local_rank=local_rank,
            pid=os.getpid(),  # exec (or the zygote's fork) keeps the pid: this is the worker's
        )
    except AuthError as err:
        print(f"herd shim: the allocator refused us: {err}", file=sys.stderr)
        raise ShimExit(1) from None
    except (RpcError, OSError) as err:
        print(f"herd shim: cannot bind local rank {local_rank}: {err}", file=sys.stderr)
        raise ShimExit(1) from None
    client.close()
    bind_environment(env, reply, local_rank)
    return env


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m herd_operator.agent.shim -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    die_with_agent(os.environ)
    try:
        env = bound_environment(dict(os.environ))
    except ShimExit as stop:
        return stop.code
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as err:
        print(f"herd shim: cannot run {argv[0]!r}: {err}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
