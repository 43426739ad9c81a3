"""A fork server for a job's local workers: the job's imports done once, before they are needed.

    python -m herd_operator.agent.zygote --control-fd N --preload torch,horovod.torch,torch._dynamo

Our Horovod driver starts one per job (`spec.horovod.preload`): it imports the listed
modules and waits. For each worker that Horovod starts on this host, the driver sends
it the worker's stdin, stdout and stderr and a socket (SCM_RIGHTS over the control
socket), then on that socket the worker's script, arguments, environment and working
directory. The zygote forks; the child takes the descriptors as 0/1/2, takes on the
environment (`os.environ`, so C's `getenv` sees it: Horovod reads its rank there at
`hvd.init()`), binds its GPU as the shim would, and runs the script as `python SCRIPT`
runs it (`runpy.run_path` as `__main__`, `sys.argv` and `sys.path[0]` set). A scale-up
then pays a fork instead of an interpreter start and the imports (seconds on 2 cores).

Why a fork is safe here: the zygote runs nothing but the imports; no CUDA call (the
child sets CUDA_VISIBLE_DEVICES before anything touches the GPU), no `hvd.init()`, no
Gloo context, no parallel torch op. It has no Python thread; a native one (OpenBLAS's
pool, started by `import numpy`) is shut down by OpenBLAS's own `pthread_atfork` hook
and restarted in the child. A zygote with more than one Python thread refuses to fork.
`torch._dynamo`, which torch 2.x's optimizers import on their first call (half of a forked
worker's start when the zygote has not), starts no thread of either kind: the process has
the same 2 tasks before and after its import (torch 2.13).

The zygote reports on the worker's socket `pid N` after the fork and `exit S` when the
child ended (S as `subprocess` gives it: -N for a death by signal N). The child gets
SIGTERM if the zygote dies (`PR_SET_PDEATHSIG`); the zygote gets SIGKILL if its driver
dies, and exits when the driver closes the control socket.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.agent import shim
from herd_operator.environment import ENV_FILE_ENV

FDS_PER_REQUEST = 4
"""The worker's socket, stdin, stdout, stderr."""
READY = b"R"
"""What the zygote sends on the control socket once its imports are done."""
MAX_REQUEST_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class WorkerRequest:
    argv: list[str]
    """The script and its arguments, as `sys.argv`."""
    env: dict[str, str]
    cwd: str
    shim: bool
    """Bind the worker's GPU first, as `python -m herd_operator.agent.shim` does."""

    def encode(self) -> bytes:
        record = {"argv": self.argv, "env": self.env, "cwd": self.cwd, "shim": self.shim}
        return json.dumps(record).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> WorkerRequest:
        data = json.loads(line)
        return cls(list(data["argv"]), dict(data["env"]), str(data["cwd"]), bool(data["shim"]))


def _read_line(sock: socket.socket) -> bytes:
    chunks = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("the driver closed the worker's socket before its request")
        chunks.append(chunk)
        size += len(chunk)
        if chunk.endswith(b"\n"):
            return b"".join(chunks)
        if size > MAX_REQUEST_BYTES:
            raise ValueError("a worker request over 64 MiB")


@dataclass
class _Child:
    pid: int
    reply: socket.socket


def serve(control: socket.socket) -> tuple[WorkerRequest, list[int]] | None:
    """Fork a worker for each request on `control` until the driver closes it.

    Returns in a forked child its request and descriptors (stdin, stdout, stderr); in the
    zygote None, once the control socket is closed and its workers have ended (they get
    SIGTERM when it exits).
    """
    children: dict[int, _Child] = {}  # pidfd -> child
    zygote = os.getpid()
    listening = True
    while listening or children:
        watched: list[socket.socket | int] = [*children, *([control] if listening else [])]
        ready, _, _ = select.select(watched, [], [])
        for pidfd in [fd for fd in ready if fd in children]:
            child = children.pop(pidfd)
            os.close(pidfd)
            _, status = os.waitpid(child.pid, 0)
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):  # else the driver's thread is gone
                child.reply.sendall(f"exit {code}\n".encode())
            child.reply.close()
        if control not in ready:
            continue
        fds = array.array("i")
        message, ancillary, _, _ = control.recvmsg(
            1, socket.CMSG_SPACE(FDS_PER_REQUEST * fds.itemsize)
        )
        if not message:  # the driver is done: no more workers; reap the ones still running
            listening = False
            continue
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        if len(fds) != FDS_PER_REQUEST:
            for fd in fds:
                os.close(fd)
            continue
        reply = socket.socket(fileno=fds[0])
        stdio = list(fds[1:])
        try:
            request = WorkerRequest.decode(_read_line(reply))
        except (OSError, EOFError, ValueError, KeyError, TypeError) as err:
            _refuse(reply, stdio, f"bad request: {err}")
            continue
        if threading.active_count() != 1:
            _refuse(reply, stdio, f"{threading.active_count()} threads: not safe to fork")
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            shim.set_parent_death_signal(signal.SIGTERM, zygote)
            control.close()
            reply.close()
            for pidfd, child in children.items():
                os.close(pidfd)
                child.reply.close()
            return request, stdio
        for fd in stdio:
            os.close(fd)
        with contextlib.suppress(OSError):  # else the driver's thread is gone; reaped all the same
            reply.sendall(f"pid {pid}\n".encode())
        children[os.pidfd_open(pid)] = _Child(pid, reply)
    return None


def _refuse(reply: socket.socket, stdio: Sequence[int], why: str) -> None:
    for fd in stdio:
        os.close(fd)
    with contextlib.suppress(OSError):
        reply.sendall(f"refused {why}\n".encode())
    reply.close()


def become_worker(request: WorkerRequest, stdio: Sequence[int]) -> None:
    """In the forked child: take on the worker's descriptors, environment and binding, and
    run its script as `python SCRIPT ARGS` would. Raises SystemExit as the script does."""
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any Python program
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    if request.shim:
        try:
            env = shim.bound_environment(dict(os.environ))
        except shim.ShimExit as stop:
            raise SystemExit(stop.code) from None
        os.environ.clear()
        os.environ.update(env)
    # Python's `random` reseeds itself in a forked child; NumPy's global generator does not,
    # and every worker would draw the same numbers from it.
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    script = request.argv[0]
    sys.argv = list(request.argv)
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    runpy.run_path(script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m herd_operator.agent.zygote")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--preload", default="", help="modules to import, comma-separated")
    args = parser.parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    # The spec's env too: a library reads some variables once, when it loads (OpenBLAS its
    # thread count, libgomp its OpenMP settings), and in a forked worker that was here.
    env_file = os.environ.get(ENV_FILE_ENV)
    if env_file:
        try:
            os.environ.update(shim.read_env_file(Path(env_file)))
        except shim.EnvFileError as err:
            print(f"herd zygote: {err}", file=sys.stderr, flush=True)
            return 1
    for name in filter(None, args.preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception as err:  # the driver starts workers the usual way then
            print(f"herd zygote: cannot preload {name!r}: {err}", file=sys.stderr, flush=True)
            return 1
    # Stopping the job signals its group: the zygote ends with it (its children too).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    control.sendall(READY)
    work = serve(control)
    if work is None:
        return 0
    request, stdio = work
    become_worker(request, stdio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
