"""The driver's side of a job's zygote (`herd_operator.agent.zygote`, which says why and how).

The runtime does not import the agent (the layers say so): the zygote is started by its
module name, and the few words of its protocol are spelled again here.
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from herd_operator.runtime.engines.parent_death import dies_with_parent

ZYGOTE_MODULE = "herd_operator.agent.zygote"
SHIM_PREFIX = ("-m", "herd_operator.agent.shim", "--")
READY = b"R"
READY_WAIT_SECONDS = 300.0
"""How long a worker's start waits for a zygote still importing (then it starts the usual way)."""

log = logging.getLogger("herd.hvd_driver")


def _is_this_python(program: str, path: str | None) -> bool:
    """Whether `program` (as the worker's PATH finds it) is this interpreter: the same file
    in the same folder, so a virtual environment's `python` is not taken for its base's
    (same binary, other site-packages)."""
    found = shutil.which(program, path=path)
    if found is None:
        return False
    found, ours = os.path.abspath(found), os.path.abspath(sys.executable)
    if found == ours:
        return True
    return os.path.dirname(found) == os.path.dirname(ours) and os.path.samefile(found, ours)


def forkable(command: Sequence[str], env: Mapping[str, str]) -> tuple[list[str], bool] | None:
    """(the script and its arguments, whether the shim binds it first) when `command` runs
    a script with this interpreter, as the zygote can: `python SCRIPT ARGS...`, optionally
    behind `python -m herd_operator.agent.shim --`. None for anything else (`python -m`,
    interpreter options, another program or Python), which starts the usual way."""
    argv = list(command)
    path = env.get("PATH")
    shim = len(argv) > 4 and tuple(argv[1:4]) == SHIM_PREFIX and _is_this_python(argv[0], path)
    if shim:
        argv = argv[4:]
    if len(argv) < 2 or argv[1].startswith("-") or not _is_this_python(argv[0], path):
        return None
    return argv[1:], shim


@dataclass
class ForkedWorker:
    """A worker forked by the zygote: not the driver's child, its status comes by socket."""

    pid: int
    channel: socket.socket

    def wait(self) -> int | None:
        """Its status as `subprocess` gives it (-N: killed by signal N); None when the zygote
        died first (the worker then got SIGTERM from its parent-death signal)."""
        with self.channel.makefile("rb") as replies:
            line = replies.readline().decode(errors="replace")
        self.channel.close()
        kind, _, value = line.partition(" ")
        return int(value) if kind == "exit" else None


class Zygote:
    """One job's fork server on this host, started by the driver's main thread (a
    parent-death signal follows the thread that forked: the main one lives as long as the
    driver)."""

    def __init__(self, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.control, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", ZYGOTE_MODULE, "--control-fd", str(zygote_end.fileno())]
        argv += ["--preload", ",".join(preload)]
        try:
            self.process = subprocess.Popen(
                dies_with_parent(argv, signal.SIGKILL),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                pass_fds=[zygote_end.fileno()],
            )
        finally:
            zygote_end.close()
        self._lock = threading.Lock()
        self._state = "starting"
        self._told_gone = False

    def ready(self, wait: float = 0.0) -> bool:
        """Whether it has its imports done and still lives; waits up to `wait` seconds
        while it is still importing."""
        with self._lock:
            if self._state == "starting" and select.select([self.control], [], [], wait)[0]:
                self._state = "ready" if self.control.recv(1) == READY else "gone"
                log.info("zygote %s", self._state)
            if self._state == "ready" and self.process.poll() is not None:
                self._state = "gone"
            if self._state == "gone" and not self._told_gone:
                self._told_gone = True
                code = self.process.poll()
                log.warning("the zygote is gone (status %s): workers start the usual way", code)
            return self._state == "ready"

    def fork(
        self,
        script: Sequence[str],
        env: Mapping[str, str],
        cwd: str,
        shim: bool,
        stdio: Sequence[int],
    ) -> ForkedWorker | None:
        """Have a worker forked with `stdio` (stdin, stdout, stderr); None if the zygote could
        not (gone, or it refused: the caller starts the worker the usual way)."""
        # A zygote still importing is waited for: it is further along than a new interpreter
        # would be, and one import at a time leaves the cores to the job.
        if not self.ready(wait=READY_WAIT_SECONDS):
            return None
        channel, zygote_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        request = {"argv": list(script), "env": dict(env), "cwd": cwd, "shim": shim}
        try:
            fds = array.array("i", [zygote_end.fileno(), *stdio])
            with self._lock:
                self.control.sendmsg([b"W"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            zygote_end.close()
            channel.sendall(json.dumps(request).encode() + b"\n")
            reply = b""
            while not reply.endswith(b"\n"):  # one short line, before any other
                chunk = channel.recv(1)
                if not chunk:
                    break
                reply += chunk
        except OSError as err:
            log.warning("the zygote cannot fork a worker: %s", err)
            channel.close()
            zygote_end.close()
            return None
        kind, _, value = reply.decode(errors="replace").strip().partition(" ")
        if kind != "pid":
            log.warning("the zygote did not fork a worker: %s", value or "it is gone")
            channel.close()
            return None
        return ForkedWorker(int(value), channel)

    def close(self) -> None:
        """Let it go: it exits when the control socket closes (its workers are its own)."""
        self.control.close()
