"""How the job's driver starts and supervises a worker: directly on this host, over ssh
with its environment on ssh's stdin (`env_exec`) elsewhere, or forked by the job's zygote.

Apart from the driver's entry point (`hvd_driver`) and from its discovery and grow hold:
this is where processes are started, signalled and reaped, where their output is
forwarded with horovodrun's prefixes, and where the line `--verbose` echoes is made, so
what reaches a worker's environment and what stays off command lines and logs is
decided in one place (`worker_environment`, `remote_start.remote_argv`, `verbose_echo`).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
from horovod.runner import gloo_run as horovod_gloo
from horovod.runner.common.util import env as env_util
from horovod.runner.elastic.settings import ElasticSettings
from horovod.runner.util import network

from herd_operator.runtime.engines import env_exec
from herd_operator.runtime.engines.forkserver import Zygote, forkable
from herd_operator.runtime.engines.parent_death import dies_with_parent
from herd_operator.runtime.engines.remote_start import feed, for_another_node, remote_argv

GRACEFUL_STOP_SECONDS = 5.0
"""How long a worker told to stop has before it is killed (horovodrun's middleman: 5 s)."""
EVENT_CHECK_SECONDS = 1.0
"""How often a worker's supervisor looks at its stop events (horovodrun's: every 1 s)."""
# The driver's one logger (its entry point gives it a handler), whichever module logs.
log = logging.getLogger("herd.hvd_driver")


def worker_environment(
    env: Mapping[str, str], slot_env: Mapping[str, str], run_env: Mapping[str, object]
) -> dict[str, str]:
    """What a local worker's process gets: the variables horovodrun would put on its
    command line (those Horovod deems exportable, then the rendezvous and the slot's),
    in the same order of precedence, but as its environment."""
    merged = {key: value for key, value in env.items() if env_util.is_exportable(key)}
    merged["PYTHONUNBUFFERED"] = "1"
    merged.update({key: str(value) for key, value in run_env.items()})
    merged.update(slot_env)
    return merged


def verbose_echo(
    host: str,
    argv: Sequence[str],
    slot_env: Mapping[str, str],
    run_env: Mapping[str, object],
    worker_env: Mapping[str, str],
) -> str:
    """The line `--verbose` prints for a worker it starts, as horovodrun prints its command.

    horovodrun echoes `env K=V ... COMMAND` with every exported value, the operator's own
    among them; this prints Horovod's rank and rendezvous variables (nothing secret: who
    and where) with their values, and of the rest only how many there are, so a job's
    log never holds the environment it was given.
    """
    shown = {key: str(value) for key, value in run_env.items()} | dict(slot_env)
    assignments = [f"{key}={shlex.quote(value)}" for key, value in sorted(shown.items())]
    hidden = sum(1 for key in worker_env if key not in shown)
    return (
        f"{host}: {' '.join(assignments)} {shlex.join(argv)}"
        f" (and {hidden} more variables, values not shown)"
    )


def _forward(source: IO[bytes], sink: IO[str], tag: str, timestamp: bool = False) -> None:
    """Copy a worker's output line by line with horovodrun's `[rank]<stdout>:` prefix
    (the operator's log readers and users' tools expect it), after the local time as
    horovodrun writes it with `--prefix-output-with-timestamp`."""

    def prefix() -> str:
        return time.asctime(time.localtime()) + tag if timestamp else tag

    decoder = codecs.getincrementaldecoder("utf8")(errors="replace")
    pending = ""
    while True:
        chunk = os.read(source.fileno(), 65536)
        pending += decoder.decode(chunk, final=not chunk)
        # \r ends a line too: progress bars update in place.
        parts = re.split(r"(?<=[\r\n])", pending)
        pending = parts.pop() if parts and not parts[-1].endswith(("\n", "\r")) else ""
        for line in parts:
            if line:
                sink.write(prefix() + line)
        if parts:
            sink.flush()
        if not chunk:
            break
    if pending:
        sink.write(prefix() + pending)
        sink.flush()
    source.close()


def _stop_tree(pid: int, exited: threading.Event) -> None:
    """SIGTERM a worker and its descendants, SIGKILL what outlives the grace period.

    The worker itself is waited for through `exited` (set by the thread that reaps it):
    psutil would reap it here, and `Popen.wait` would then see status 0."""
    try:
        root = psutil.Process(pid)
        descendants = root.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for proc in [root, *descendants]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    deadline = time.monotonic() + GRACEFUL_STOP_SECONDS
    _, alive = psutil.wait_procs(descendants, timeout=GRACEFUL_STOP_SECONDS)
    if not exited.wait(max(0.0, deadline - time.monotonic())):
        alive.append(root)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def run_local_worker(
    argv: Sequence[str],
    env: Mapping[str, str],
    rank: int,
    events: Sequence[threading.Event],
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    timestamp: bool = False,
    zygote: Zygote | None = None,
    stdin_data: bytes | None = None,
) -> int:
    """Run one worker here until it exits or one of `events` is set (then stop it).

    Forked by `zygote` when it can (see `forkserver`), else started as a new process,
    with `stdin_data` on its stdin (the ssh client of a remote worker: its environment),
    else /dev/null.

    Returns its exit status as horovodrun reports it: 128 + N for a death by signal N.
    The worker stays in the driver's process group, so a signal to the job's group (how
    the operator stops a job) reaches it as it reaches the driver; and it gets SIGTERM
    when the driver dies alone (`dies_with_parent`), so a driver killed by the OOM killer
    or `kill -9` leaves no worker holding its GPU.
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    started = None
    if zygote is not None and stdin_data is None:
        started = _fork_worker(zygote, argv, env, rank)
    if started is None:
        process = subprocess.Popen(
            dies_with_parent(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL if stdin_data is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert process.stdout is not None and process.stderr is not None
        if process.stdin is not None and stdin_data is not None:
            # In a thread: a payload larger than the pipe's buffer would block here until
            # ssh reads it, and ssh may still be connecting.
            threading.Thread(
                target=feed, args=(process.stdin, stdin_data), name="feed-stdin", daemon=True
            ).start()
        started = _Started(process.pid, process.stdout, process.stderr, process.wait)
    forwarders = [
        threading.Thread(
            target=_forward,
            args=(started.stdout, out, f"[{rank}]<stdout>:", timestamp),
            daemon=True,
        ),
        threading.Thread(
            target=_forward,
            args=(started.stderr, err, f"[{rank}]<stderr>:", timestamp),
            daemon=True,
        ),
    ]
    for thread in forwarders:
        thread.start()
    exited = threading.Event()
    # waitpid blocks in its own thread; this one looks at the stop events meanwhile.

    codes: list[int] = []

    def wait_for_exit() -> None:
        codes.append(started.wait())
        exited.set()

    waiter = threading.Thread(target=wait_for_exit, daemon=True)
    waiter.start()
    while not exited.wait(EVENT_CHECK_SECONDS):
        if any(event.is_set() for event in events):
            _stop_tree(started.pid, exited)
            break
    waiter.join()
    for thread in forwarders:
        thread.join()
    code = codes[0]
    return 128 - code if code < 0 else code


@dataclass
class _Started:
    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    wait: Callable[[], int]
    """Blocks until it ends; its status as `subprocess` gives it (-N: killed by signal N)."""


def _fork_worker(
    zygote: Zygote, argv: Sequence[str], env: Mapping[str, str], rank: int
) -> _Started | None:
    """The worker forked by the job's zygote; None when it cannot be (not `python SCRIPT`,
    the zygote not ready yet, or gone): then it starts the usual way."""
    script = forkable(argv, env)
    if script is None:
        return None
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    stdin = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        worker = zygote.fork(script[0], env, os.getcwd(), script[1], [stdin, out_write, err_write])
    finally:
        for fd in (stdin, out_write, err_write):
            os.close(fd)
    if worker is None:
        os.close(out_read)
        os.close(err_read)
        return None
    log.info("worker rank %d forked by the zygote: pid %d", rank, worker.pid)

    def wait() -> int:
        code = worker.wait()
        if code is not None:
            return code
        # The zygote died first; its parent-death signal ends the worker: wait for that.
        with contextlib.suppress(psutil.Error):
            psutil.Process(worker.pid).wait()
        return -signal.SIGTERM

    return _Started(
        worker.pid, open(out_read, "rb", buffering=0), open(err_read, "rb", buffering=0), wait
    )


def make_worker_factory(
    settings: ElasticSettings,
    env: Mapping[str, str],
    command: Sequence[str],
    server_ip: str,
    nics: Sequence[str],
    rendezvous_port: int,
    shutdown: threading.Event,
    zygote: Zygote | None = None,
    stop_events: Callable[[str, int], Sequence[threading.Event]] | None = None,
) -> Callable[[Any, list[threading.Event] | None], tuple[int, float]]:
    """The `create_worker_fn` for Horovod's ElasticDriver: local slots run directly,
    others over ssh with their environment on its stdin (`remote_start.remote_argv`), or, under
    Kubeflow's MPI operator (which replaces ssh), through Horovod's own remote launch.
    `stop_events(host, local_rank)` gives more events that stop a slot's worker (a grow
    given up stops its new workers: `GrowHold`)."""
    run_env = horovod_gloo.create_run_env_vars(server_ip, nics, rendezvous_port, elastic=True)
    remote_command = horovod_gloo.get_run_command(
        list(command), server_ip, nics, rendezvous_port, elastic=True
    )
    horovod_remote_worker = horovod_gloo._create_elastic_worker_fn(
        horovod_gloo._exec_command_fn(settings), remote_command, dict(env), shutdown
    )
    local_addresses = network.get_local_host_addresses()

    def create_worker(slot_info: Any, events: list[threading.Event] | None) -> tuple[int, float]:
        events = [*(events or [])]
        if stop_events is not None:
            events += stop_events(slot_info.hostname, slot_info.local_rank)
        remote = network.resolve_host_address(slot_info.hostname) not in local_addresses
        if remote and env_util.is_kubeflow_mpi():
            return horovod_remote_worker(slot_info, events)  # type: ignore[no-any-return]
        log.info(
            "starting worker %s[%d] as rank %d of %d%s",
            slot_info.hostname,
            slot_info.local_rank,
            slot_info.rank,
            slot_info.size,
            " over ssh" if remote else "",
        )
        slot_env = horovod_gloo.create_slot_env_vars(slot_info)
        worker_env = worker_environment(env, slot_env, run_env)
        if settings.verbose:  # horovodrun --verbose echoes each worker's command
            print(verbose_echo(slot_info.hostname, command, slot_env, run_env, worker_env))
        with contextlib.ExitStack() as files:
            stdout: IO[str] | None = None
            stderr: IO[str] | None = None
            if settings.output_filename:  # horovodrun's --output-filename: a copy per rank
                # Padded to the widest rank the job can have, as horovodrun pads to -np.
                width = len(str(max(settings.max_num_proc or settings.num_proc, 1) - 1))
                rank_dir = Path(settings.output_filename) / f"rank.{slot_info.rank:0{width}d}"
                rank_dir.mkdir(parents=True, exist_ok=True)
                stdout = horovod_gloo.MultiFile(
                    [sys.stdout, files.enter_context(open(rank_dir / "stdout", "w"))]
                )
                stderr = horovod_gloo.MultiFile(
                    [sys.stderr, files.enter_context(open(rank_dir / "stderr", "w"))]
                )
            stops = [shutdown, *events]
            timestamp = bool(settings.prefix_output_with_timestamp)
            if remote:  # ssh with the ssh client's own environment (agent socket, HOME,
                # config); the worker's goes over its stdin
                argv = remote_argv(
                    slot_info.hostname, command, settings.ssh_port, settings.ssh_identity_file
                )
                process_env: Mapping[str, str] = os.environ
                payload: bytes | None = env_exec.encode_payload(
                    for_another_node(worker_env), os.getcwd()
                )
            else:
                argv, process_env, payload = list(command), worker_env, None
            try:
                code = run_local_worker(
                    argv,
                    process_env,
                    slot_info.rank,
                    stops,
                    stdout,
                    stderr,
                    timestamp=timestamp,
                    zygote=zygote,  # not for a remote worker: it has stdin data
                    stdin_data=payload,
                )
            except OSError as err:
                print(f"cannot start worker {slot_info.hostname}[{slot_info.local_rank}]: {err}")
                code = 1
        if code != 0:
            print(f"Process {slot_info.rank} exit with status code {code}.")
        return code, time.time()

    return create_worker
