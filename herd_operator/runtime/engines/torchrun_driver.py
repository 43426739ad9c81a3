"""The job's launch process under the torchrun engine: its rendezvous store, and one
torchrun agent per GPU of its grant.

    python -m herd_operator.runtime.engines.torchrun_driver --grant-file F --store-host H \\
        -- <torchrun arguments> --no-python PYTHON -m herd_operator.agent.shim -- COMMAND

It starts the job's c10d store (a `TCPStore` on port 0: the kernel picks a free port,
freed when this process exits) and runs, for each slot of the grant file, `python -m
torch.distributed.run --rdzv-endpoint=H:PORT --local-addr=A <torchrun arguments>` with
`HERD_WORKER_HOST` naming the slot (its worker binds its GPU by that name). It reads the
grant file on a `stat` every `--poll-seconds`: a slot that appears gets an agent, an
agent whose slot is gone is stopped (SIGTERM; torchrun then leaves the rendezvous open
for the others). torchrun does the rest (see `torchrun.py`).

A slot on another host of the pool gets its agent there as the Horovod driver starts a
worker there: `ssh HOST` runs `env_exec`, which reads the agent's environment from ssh's
stdin (no value on any command line) and execs the agent under `setpriv --pdeathsig TERM`,
so the agent is stopped, like a local one, by SIGTERM to its ssh client here (its sshd
session ends, the parent-death signal fires). It advertises HOST (`--local-addr`): where
its workers' store is reached when it is rank 0. The store (`--store-host`) is this host's
address on the operator's `--network-interface`.

An agent that ends by itself is not started again for the same grant: 0 means the job's
workers finished (the driver then starts nothing more and exits 0 once every agent has
ended), anything else that its restarts ran out (the others go on without it while
`gpus.min` still fits; the operator sees the missing worker and takes its GPU back).
When no agent runs and none can start, the driver exits with the first failure's status.
SIGTERM or SIGINT stop every agent (and their workers) and the driver exits 1, as the
Horovod engine's driver does.

Imports torch (the store), never Horovod.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from herd_operator.environment import WORKER_HOST_ENV
from herd_operator.runtime.engines import env_exec
from herd_operator.runtime.engines.horovod import LOCAL_HOSTS, local_names
from herd_operator.runtime.engines.parent_death import dies_with_parent
from herd_operator.runtime.engines.remote_start import feed, for_another_node, remote_argv
from herd_operator.runtime.engines.torchrun import (
    AGENT_MODULE,
    LOOPBACK,
    parse_grant,
    slot_name,
)
from herd_operator.specs.values import Slot

DEFAULT_POLL_SECONDS = 0.05
"""How often the grant file is `stat`ed and the agents looked at (as the Horovod driver's)."""
STOP_GRACE_SECONDS = 10.0
"""How long a stopped agent has to stop its worker and exit before both are killed."""

AGENT_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torch 2.13's agents share their rendezvous store with the workers by default, and then
deadlock on every grow: the agent that stays rank 0 publishes the workers' store address
only at its first rendezvous, while an agent that joins later waits for it under the new
round's keys (60 s, then both fail). Without sharing, rank 0 publishes it every round."""

REMOTE_SETPRIV = "setpriv"
"""util-linux's `setpriv`, found on the other host's PATH (the driver's, carried there)."""

log = logging.getLogger("herd.torchrun_driver")


class GrantFile:
    """The operator's grant file, read again only when it was replaced (atomically: a new
    (inode, mtime, size) is a new grant). A file gone after the first read keeps the last
    grant (the operator is withdrawing it: the job is being stopped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._slots: tuple[Slot, ...] = ()

    def slots(self) -> tuple[Slot, ...]:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is None:
                raise
            return self._slots
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            self._slots = parse_grant(self.path.read_text(), self.path)
            self._seen = key
        return self._slots


@dataclass(frozen=True)
class Plan:
    start: tuple[Slot, ...]
    stop: tuple[Slot, ...]


def plan(
    granted: Sequence[Slot],
    running: Set[Slot],
    stopping: Set[Slot],
    ended: Set[Slot],
    finishing: bool,
) -> Plan:
    """What to do for the grant: an agent for each granted slot that has none (not while an
    agent of it is still stopping, nor for a slot whose agent ended by itself under this
    grant, nor once the job is finishing), and stop the agents of slots no longer granted."""
    wanted = set(granted)
    start: tuple[Slot, ...] = ()
    if not finishing:
        start = tuple(
            slot
            for slot in granted
            if slot not in running and slot not in stopping and slot not in ended
        )
    stop = tuple(sorted(slot for slot in running if slot not in wanted and slot not in stopping))
    return Plan(start, stop)


def outcome(exits: Mapping[Slot, int], running: bool, startable: bool) -> int | None:
    """The driver's exit status once it is over, None while it is not: over when no agent
    runs and none is to start; 0 if an agent ended 0 (the workers finished), else the first
    failure's status (1 when there was none: no slot could be run)."""
    if running or startable:
        return None
    if any(code == 0 for code in exits.values()):
        return 0
    return next((code for code in exits.values() if code != 0), 1)


def failure_summary(exits: Mapping[Slot, int]) -> str:
    """The driver's last line when the job is over and no agent finished (printed after
    `herd-torchrun: `; the operator shows it with the exit status): how each agent ended."""
    if not exits:
        return "no agent could be started"
    ended = ", ".join(f"{slot_name(*slot)} with status {code}" for slot, code in exits.items())
    return (
        f"every agent ended and none finished: {ended} (an agent fails when its rendezvous"
        " does not complete within joinTimeoutSeconds or its worker's restarts are spent;"
        " its traceback is above)"
    )


NOT_CARRIED = ("BASH_FUNC_", "OLDPWD", "CUDA_VISIBLE_DEVICES")
"""Variables of the driver's environment an agent on another host does not get (what
Horovod leaves out of a remote worker's): shell functions, the driver's previous directory,
and its GPUs (the shim sets the worker's own there)."""


def remote_environment(env: Mapping[str, str]) -> dict[str, str]:
    """What an agent on another host gets: the driver's environment as a local agent gets
    it, less what is true of this host only (`NOT_CARRIED`, the batch step's Slurm
    variables)."""
    carried = {key: value for key, value in env.items() if not key.startswith(NOT_CARRIED)}
    return for_another_node(carried)


def remote_agent_argv(host: str, agent: Sequence[str]) -> list[str]:
    """The ssh line that starts an agent on `host`: through `env_exec` (its environment on
    ssh's stdin, nothing on a command line), under `setpriv --pdeathsig TERM` there, so the
    agent gets SIGTERM when its sshd session ends: when the driver stops the agent (SIGTERM
    to the ssh client) or dies (the client dies with it). SIGTERM is how a local agent is
    stopped: torchrun stops its worker and leaves the rendezvous open for the others."""
    remote = [REMOTE_SETPRIV, "--pdeathsig", "TERM", "--", *agent]
    # Plain `ssh HOST`: the port, key and user come from the user's ssh configuration, as
    # for the Horovod engine's workers.
    return remote_argv(host, remote, python=agent[0])


def start_remote(
    host: str, agent: Sequence[str], env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    """The agent started on `host` over ssh (the client dies with this process); its output
    comes back through ssh to this process's own."""
    popen = subprocess.Popen(
        dies_with_parent(remote_agent_argv(host, agent)), stdin=subprocess.PIPE
    )
    assert popen.stdin is not None
    payload = env_exec.encode_payload(remote_environment(env), os.getcwd())
    threading.Thread(target=feed, args=(popen.stdin, payload), daemon=True).start()
    return popen


@dataclass
class _Agent:
    slot: Slot
    popen: subprocess.Popen[bytes]
    stop_sent_at: float | None = None


@dataclass
class Agents:
    """The running agents of the job, one per slot, and how the others ended."""

    store_endpoint: str
    local_addr: str
    torchrun_args: Sequence[str]
    local_hosts: Set[str]
    python: str = sys.executable
    stop_grace: float = STOP_GRACE_SECONDS
    running: dict[Slot, _Agent] = field(default_factory=dict)
    exits: dict[Slot, int] = field(default_factory=dict)
    """How agents that ended by themselves ended, in order."""

    def argv(self, local_addr: str | None = None) -> list[str]:
        """An agent's command: torchrun at the job's store, advertising `local_addr` (the
        address its workers' store is reached at when it is rank 0; this host's by default)."""
        return [
            self.python,
            "-m",
            AGENT_MODULE,
            f"--rdzv-endpoint={self.store_endpoint}",
            f"--local-addr={local_addr or self.local_addr}",
            *self.torchrun_args,
        ]

    def start(self, slot: Slot) -> None:
        host, _ = slot
        env = {**os.environ, **AGENT_ENV, WORKER_HOST_ENV: slot_name(*slot)}
        try:
            if host in self.local_hosts:
                # Dies with this process, however it ends (its worker is signalled by torchrun).
                # A session of its own, as a bare agent started from a shell has: under CFS
                # autogroup (on by default on many kernels) a session is one CPU share, and
                # a grow's new agents sharing this process's session imported torch 1-2.5 s
                # slower than bare ones while the old workers trained (docs/benchmarks.md,
                # run 19). It still stops on SIGTERM from here, and the operator's SIGKILL
                # of what outlives a stop finds it by descent and its launch id.
                popen = subprocess.Popen(
                    dies_with_parent(self.argv()),
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            else:
                popen = start_remote(host, self.argv(local_addr=host), env)
        except OSError as err:
            log.error("cannot start the agent for %s: %s", slot_name(*slot), err)
            self.exits[slot] = 1
            return
        self.running[slot] = _Agent(slot, popen)
        where = "" if host in self.local_hosts else " over ssh"
        log.info("agent for %s started%s: pid %d", slot_name(*slot), where, popen.pid)

    def stop(self, slot: Slot, now: float) -> None:
        agent = self.running.get(slot)
        if agent is None or agent.stop_sent_at is not None:
            return
        agent.stop_sent_at = now
        log.info("stopping the agent for %s (pid %d)", slot_name(*slot), agent.popen.pid)
        with contextlib.suppress(ProcessLookupError):
            agent.popen.send_signal(signal.SIGTERM)

    def stopping(self) -> set[Slot]:
        return {slot for slot, agent in self.running.items() if agent.stop_sent_at is not None}

    def reap(self, now: float) -> list[tuple[Slot, int, bool]]:
        """Agents that ended since the last look: (slot, status, whether it was stopped);
        stopped ones past the grace are killed with their workers."""
        ended = []
        for slot, agent in list(self.running.items()):
            code = agent.popen.poll()
            if code is None:
                if agent.stop_sent_at is not None and now - agent.stop_sent_at > self.stop_grace:
                    _kill_tree(agent.popen.pid)
                continue
            del self.running[slot]
            stopped = agent.stop_sent_at is not None
            if not stopped:
                self.exits[slot] = code
            ended.append((slot, code, stopped))
        return ended

    def stop_all(self, deadline: float) -> None:
        now = time.monotonic()
        for slot in list(self.running):
            self.stop(slot, now)
        while self.running and time.monotonic() < deadline:
            self.reap(time.monotonic())
            time.sleep(0.05)
        for agent in self.running.values():
            _kill_tree(agent.popen.pid)


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.Error):
        process = psutil.Process(pid)
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        process.kill()


def run(grant: GrantFile, agents: Agents, poll_seconds: float, stop: threading.Event) -> int:
    """Keep an agent per granted slot until the job is over or `stop` is set; the exit
    status."""
    finishing = False
    granted: tuple[Slot, ...] = ()
    while not stop.is_set():
        now = time.monotonic()
        slots = grant.slots()
        if slots != granted:
            log.info("grant seen: %s", ", ".join(slot_name(*slot) for slot in slots) or "none")
            # A slot granted anew gets an agent again, even if one of it ended before.
            for slot in set(slots) - set(granted):
                agents.exits.pop(slot, None)
            granted = slots
        for slot, code, stopped in agents.reap(now):
            how = "stopped" if stopped else "ended"
            log.info("agent for %s %s with status %s", slot_name(*slot), how, code)
            if code == 0 and not stopped:
                finishing = True
        todo = plan(granted, set(agents.running), agents.stopping(), set(agents.exits), finishing)
        for slot in todo.stop:
            agents.stop(slot, now)
        for slot in todo.start:
            agents.start(slot)
        status = outcome(agents.exits, bool(agents.running), bool(todo.start))
        if status is not None:
            if status != 0:  # what the job's BackOff or Failed says (`exit_cause`)
                print(f"herd-torchrun: {failure_summary(agents.exits)}", file=sys.stderr)
            return status
        stop.wait(poll_seconds)
    agents.stop_all(time.monotonic() + agents.stop_grace)
    return 1


def start_store(host: str) -> tuple[object, int]:
    """The job's c10d store, listening on a port the kernel picks: (store, port)."""
    # Here, not at the top: the import takes seconds, and the driver's pure parts are
    # imported by tests without it.
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    store = TCPStore(host, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    return store, int(store.port)


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """(our options, the agents' torchrun arguments) from `[ours...] -- [torchrun's...]`."""
    argv = list(argv)
    prog = "python -m herd_operator.runtime.engines.torchrun_driver"
    if "--" not in argv:
        raise SystemExit(
            f"usage: {prog} --grant-file FILE --store-host HOST -- <torchrun arguments>"
        )
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--grant-file", type=Path, required=True)
    parser.add_argument("--store-host", required=True)
    parser.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_SECONDS)
    ours = parser.parse_args(argv[:split])
    if not 0 < ours.poll_seconds <= 60:
        parser.error(f"--poll-seconds must be > 0 and <= 60, got {ours.poll_seconds}")
    torchrun_args = argv[split + 1 :]
    if "--no-python" not in torchrun_args:
        parser.error("the torchrun arguments must end with --no-python and the command")
    return ours, torchrun_args


def main(argv: Sequence[str] | None = None) -> int:
    ours, torchrun_args = parse_args(sys.argv[1:] if argv is None else argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(created).3f herd-torchrun: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    grant = GrantFile(ours.grant_file)
    try:
        grant.slots()
    except (OSError, ValueError) as err:
        print(f"herd-torchrun: cannot read the grant file: {err}", file=sys.stderr)
        return 1
    store, port = start_store(ours.store_host)
    local_addr = LOOPBACK if ours.store_host == LOOPBACK else ours.store_host
    log.info("rendezvous store at %s:%d", ours.store_host, port)
    agents = Agents(
        f"{ours.store_host}:{port}",
        local_addr,
        torchrun_args,
        frozenset({*LOCAL_HOSTS, *local_names()}),
    )
    try:
        return run(grant, agents, ours.poll_seconds, stop)
    finally:
        del store  # the port is free from here on


if __name__ == "__main__":
    sys.exit(main())
