"""The job's launch process under the Horovod engine: Horovod's elastic driver, in-process.

    python -m herd_operator.runtime.engines.hvd_driver --grant-file F -- <horovodrun args>

It takes horovodrun's own arguments (parsed by Horovod's `parse_args`: min/max np,
reset limit, timeouts, cool-down, network interface, ssh options, verbosity...) and
runs Horovod's `ElasticDriver`, rendezvous server and worker registry unchanged. Three
parts differ from `horovodrun --host-discovery-script`:

- Discovery reads the grant file the operator publishes (the same file the bare launch's
  script `cat`s), on a `stat` every `--poll-seconds` and a read only when the file was
  replaced. horovodrun runs its script once a second through `safe_shell_exec`, which
  starts a Python interpreter per call (a quarter of a second of CPU, for the life of
  the job); a `stat` costs microseconds, so the poll can be 20x more frequent and a
  grant change is seen within 50 ms instead of within 1 s (31 ms median measured).
- A worker on this host is started directly, as an argument list with its environment
  passed as the environment: not as `sh -c 'env K=V ... cmd'` behind a freshly spawned
  Python middleman. That saves the middleman's start (an interpreter: ~240 ms of CPU,
  docs/benchmarks.md) and keeps the operator's environment off every worker's command
  line (readable by every user in `ps`). A worker on another host is started over ssh as
  Horovod starts it (same ssh options, the user's ssh config, the job's directory), but
  with no value on any command line: ssh runs `env_exec.py` there, which reads the
  worker's environment from ssh's stdin (`remote_worker_argv`).
- A host change that Horovod drops because no worker could hear it yet (the first workers
  are still starting) is delivered once one can (`MissedUpdateRedelivery`).

The grant file stays the only channel from the operator, so a driver keeps working when
the operator that launched it dies and another adopts the job.

Exit status and signals are horovodrun's: SIGTERM or SIGINT stop the workers and the
driver exits 1, as does a job whose worker failed for good; 0 when every worker ended 0.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import faulthandler
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
from horovod.runner import launch as horovod_launch
from horovod.runner.common.util import config_parser, secret, timeout
from horovod.runner.common.util import env as env_util
from horovod.runner.driver import driver_service
from horovod.runner.elastic import driver as horovod_elastic_driver
from horovod.runner.elastic.discovery import HostDiscovery
from horovod.runner.elastic.rendezvous import create_rendezvous_handler
from horovod.runner.elastic.settings import ElasticSettings
from horovod.runner.elastic.worker import HostUpdateResult
from horovod.runner.http.http_server import RendezvousServer
from horovod.runner.util import network

from herd_operator.runtime.engines import env_exec
from herd_operator.runtime.engines.forkserver import Zygote, forkable
from herd_operator.runtime.engines.parent_death import dies_with_parent
from herd_operator.specs.values import MODULE_NAME_PATTERN

DRIVER_MODULE = "herd_operator.runtime.engines.hvd_driver"
DEFAULT_POLL_SECONDS = 0.05
"""How often the grant file is `stat`ed. 20 stats a second cost well under 0.1% of a
core (see docs/benchmarks.md, driver-idle-cpu) and bound how late a grant is seen."""
GRACEFUL_STOP_SECONDS = 5.0
"""How long a worker told to stop has before it is killed (horovodrun's middleman: 5 s)."""
EVENT_CHECK_SECONDS = 1.0
"""How often a worker's supervisor looks at its stop events (horovodrun's: every 1 s)."""

MODULE_NAME = re.compile(MODULE_NAME_PATTERN)
ENV_EXEC_SCRIPT = str(Path(env_exec.__file__).resolve())
"""Run by its path on the other host (the same path on a shared file system, like the
driver's interpreter): it needs no import path there."""

log = logging.getLogger("herd.hvd_driver")


class GrantFileError(ValueError):
    """The grant file holds a line that is not `host` or `host:slots`."""


def parse_grant(text: str, default_slots: int, source: Path) -> dict[str, int]:
    """Host -> slots from `host:slots` lines (a bare `host` gets `default_slots`), as
    Horovod reads a discovery script's output; blank lines are skipped."""
    slots: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        host, sep, count = line.partition(":")
        if not host:
            raise GrantFileError(f"{source}:{number}: {line!r} has no host name")
        if not sep:
            slots[host] = default_slots
            continue
        if not count.isdigit():
            raise GrantFileError(
                f"{source}:{number}: slots in {line!r} must be a whole number >= 0"
            )
        slots[host] = int(count)
    return slots


class GrantFileDiscovery(HostDiscovery):  # type: ignore[misc]
    """Horovod's host discovery from the operator's grant file: no process per call.

    The file is replaced atomically (write and rename), so a new (inode, mtime, size)
    is a new grant and the same one is the same grant: a poll is one `stat` unless the
    grant changed. A file that disappears after the first read (the operator withdrew the
    grant: the job is being stopped) keeps the last grant, as horovodrun keeps the last
    hosts when its script fails; the first read must succeed, as horovodrun's first
    discovery must.
    """

    def __init__(
        self,
        path: Path,
        default_slots: int = 1,
        on_change: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.default_slots = default_slots
        self.on_change = on_change
        self._seen: tuple[int, int, int] | None = None
        self._slots: dict[str, int] = {}
        self._missing_reported = False

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            if self._seen is None:
                raise
            if not self._missing_reported:
                log.warning("grant file %s is gone; keeping the last grant", self.path)
                self._missing_reported = True
            return dict(self._slots)
        self._missing_reported = False
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            slots = parse_grant(self.path.read_text(), self.default_slots, self.path)
            self._seen = key
            if slots != self._slots:
                self._slots = slots
                if self.on_change is not None:
                    self.on_change(dict(slots))
        return dict(self._slots)


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
                target=_feed, args=(process.stdin, stdin_data), name="feed-stdin", daemon=True
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


def _feed(sink: IO[bytes], data: bytes) -> None:
    """Write `data` and close `sink` (its reader sees the end); a reader that is gone (ssh
    could not connect) is not an error here: its exit status says what happened."""
    with contextlib.suppress(OSError), sink:
        sink.write(data)


def remote_worker_argv(
    host: str,
    command: Sequence[str],
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The ssh command that starts `command` on `host` through `env_exec` (the environment
    goes on its stdin): Horovod's ssh options and host, then one remote command string of
    quoted names and paths, no value."""
    argv = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no"]
    if ssh_port is not None:
        argv += ["-p", str(ssh_port)]
    if ssh_identity_file is not None:
        argv += ["-i", ssh_identity_file]
    # ssh joins its arguments into one string for the remote shell: quote each part.
    remote = [python, "-I", ENV_EXEC_SCRIPT, "--", *command]
    return [*argv, host, "exec " + " ".join(shlex.quote(part) for part in remote)]


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
) -> Callable[[Any, list[threading.Event] | None], tuple[int, float]]:
    """The `create_worker_fn` for Horovod's ElasticDriver: local slots run directly,
    others over ssh with their environment on its stdin (`remote_worker_argv`), or, under
    Kubeflow's MPI operator (which replaces ssh), through Horovod's own remote launch."""
    run_env = horovod_gloo.create_run_env_vars(server_ip, nics, rendezvous_port, elastic=True)
    remote_command = horovod_gloo.get_run_command(
        list(command), server_ip, nics, rendezvous_port, elastic=True
    )
    horovod_remote_worker = horovod_gloo._create_elastic_worker_fn(
        horovod_gloo._exec_command_fn(settings), remote_command, dict(env), shutdown
    )
    local_addresses = network.get_local_host_addresses()

    def create_worker(slot_info: Any, events: list[threading.Event] | None) -> tuple[int, float]:
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
            stops = [shutdown, *(events or [])]
            timestamp = bool(settings.prefix_output_with_timestamp)
            if remote:  # ssh with the ssh client's own environment (agent socket, HOME,
                # config); the worker's goes over its stdin
                argv = remote_worker_argv(
                    slot_info.hostname, command, settings.ssh_port, settings.ssh_identity_file
                )
                process_env: Mapping[str, str] = os.environ
                payload: bytes | None = env_exec.encode_payload(worker_env, os.getcwd())
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


class MissedUpdateRedelivery:
    """Tells the coordinator worker of a host change that Horovod could not tell it.

    Horovod's driver notifies only when discovery sees a change, and drops the notice when
    no coordinator worker has registered yet (the workers are still starting: importing
    torch takes seconds). A grant changed then would wait for the next change, which may
    never come. This wraps the driver's notifier to remember a dropped notice, and once a
    coordinator has been registered for a whole poll (its listener is then in place),
    delivers it if the hosts still call for other assignments.
    """

    def __init__(self, driver: Any, period: float) -> None:
        self.driver = driver
        self.period = period
        self._notify = driver._notify_workers_host_changes
        self._dropped = HostUpdateResult.no_update
        self._lock = threading.Lock()
        driver._notify_workers_host_changes = self._notify_and_remember

    def _coordinator_client(self) -> Any:
        coordinator = self.driver.get_coordinator_info()
        return None if coordinator is None else self.driver.get_worker_client(coordinator)

    def _notify_and_remember(self, current_hosts: Any, update_res: Any) -> None:
        heard = self._coordinator_client() is not None
        self._notify(current_hosts, update_res)
        with self._lock:
            self._dropped = HostUpdateResult.no_update if heard else self._dropped | update_res

    def _assignments_would_change(self) -> bool:
        """Whether the current hosts give other assignments than the workers run with.

        The same test Horovod's notifier makes before it tells anyone: a notice dropped at
        start-up for the hosts the first workers were started on is stale, not missed.
        """
        hosts = self.driver._host_manager.current_hosts
        next_assignments: dict[str, Any] = {}
        if hosts.count_available_slots() >= self.driver._min_num_proc:
            next_assignments, _ = self.driver._get_host_assignments(hosts)
        return bool(next_assignments != self.driver.host_assignments)

    def poll(self, seen_client: bool) -> bool:
        """One look: deliver a dropped notice if it is still due; whether a coordinator is
        registered now (a notice is delivered only after it was seen for a whole period)."""
        client = self._coordinator_client() is not None
        with self._lock:
            dropped = self._dropped
        if dropped != HostUpdateResult.no_update and client and seen_client:
            with self.driver._wait_hosts_cond:
                if self._assignments_would_change():
                    log.info("telling the workers of a host change they missed while starting")
                    self._notify_and_remember(self.driver._host_manager.current_hosts, dropped)
                else:
                    with self._lock:
                        self._dropped = HostUpdateResult.no_update
        return client

    def run(self) -> None:
        seen_client = False
        while not self.driver._shutdown.wait(self.period):
            seen_client = self.poll(seen_client)

    def start(self) -> None:
        threading.Thread(target=self.run, name="missed-updates", daemon=True).start()


def job_interfaces(settings: ElasticSettings, first_hosts: Sequence[str]) -> Sequence[str]:
    """The interfaces the job's workers and rendezvous use, fixed for the life of the job.

    With `--network-interface` given they are used as given. Horovod's own choice differs
    when the first hosts are all this node: it then looks for 127.0.0.1 on the given
    interfaces and fails (`eth0` has none), so an operator on one of its pool's nodes could
    not start a job placed on that node alone; and 127.0.0.1 would strand the workers of
    other nodes the job grows onto later. Without interfaces, Horovod's probe decides.
    """
    if settings.nics:
        return sorted(settings.nics)
    return list(driver_service.get_common_interfaces(settings, first_hosts))


def run_elastic(
    args: argparse.Namespace, grant_file: Path, poll_seconds: float, preload: Sequence[str] = ()
) -> None:
    """Horovod's elastic Gloo launch (`_run_elastic` and `launch_gloo_elastic` of
    horovodrun), with the grant file as discovery and local workers started directly
    (forked by a zygote that imported `preload`, when given)."""
    discovery = GrantFileDiscovery(
        grant_file,
        args.slots or 1,
        on_change=lambda slots: log.info("grant seen: %s", slots),
    )
    start_timeout = args.start_timeout or int(os.getenv("HOROVOD_START_TIMEOUT", "30"))
    settings = ElasticSettings(
        discovery=discovery,
        min_num_proc=args.min_num_proc or args.num_proc,
        max_num_proc=args.max_num_proc,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        cooldown_range=args.cooldown_range,
        num_proc=args.num_proc,
        verbose=2 if args.verbose else 0,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        extra_mpi_args=args.mpi_args,
        key=secret.make_secret_key(),
        start_timeout=timeout.Timeout(
            start_timeout,
            message="Timed out waiting for {activity}. Please check connectivity between "
            "servers, or raise --start-timeout.",
        ),
        output_filename=args.output_filename,
        run_func_mode=False,
        nics=args.nics,
        prefix_output_with_timestamp=args.prefix_output_with_timestamp,
    )
    env = os.environ.copy()
    config_parser.set_env_from_args(env, args)

    # The driver's discovery thread reads this module global before each wait.
    horovod_elastic_driver.DISCOVER_HOSTS_FREQUENCY_SECS = poll_seconds
    rendezvous = RendezvousServer(settings.verbose)
    driver = horovod_elastic_driver.ElasticDriver(
        rendezvous,
        settings.discovery,
        settings.min_num_proc,
        settings.max_num_proc,
        timeout=settings.elastic_timeout,
        reset_limit=settings.reset_limit,
        cooldown_range=settings.cooldown_range,
        verbose=settings.verbose,
    )
    MissedUpdateRedelivery(driver, poll_seconds).start()
    port = rendezvous.start(create_rendezvous_handler(driver))
    min_hosts = horovod_gloo._get_min_start_hosts(settings)
    hosts = driver.wait_for_available_slots(settings.num_proc, min_hosts=min_hosts)
    nics = job_interfaces(settings, hosts.host_assignment_order)
    server_ip = network.get_driver_ip(nics)
    shutdown = horovod_gloo.register_shutdown_event()
    zygote = Zygote(preload, worker_environment(env, {}, {})) if preload else None
    create_worker = make_worker_factory(
        settings, env, args.command, server_ip, nics, port, shutdown, zygote
    )
    try:
        driver.start(settings.num_proc, create_worker)
        results = driver.get_results()
        driver.stop()
    finally:
        if zygote is not None:
            zygote.close()
    if results.error_message is not None:
        raise RuntimeError(results.error_message)
    for name, (code, _) in sorted(results.worker_results.items(), key=lambda item: item[1][1]):
        if code != 0:
            raise RuntimeError(
                "Horovod detected that one or more processes exited with non-zero status, "
                f"thus causing the job to be terminated. The first process to do so was:\n"
                f"Process name: {name}\nExit code: {code}\n"
            )


def parse_driver_args(argv: Sequence[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(our options, horovodrun's) from `[ours...] -- [horovodrun's...]`."""
    argv = list(argv)
    if "--" not in argv:
        raise SystemExit(
            f"usage: python -m {DRIVER_MODULE} --grant-file FILE [--poll-seconds S] -- "
            "<horovodrun arguments>"
        )
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog=f"python -m {DRIVER_MODULE}")
    parser.add_argument("--grant-file", type=Path, required=True)
    parser.add_argument("--poll-seconds", type=float, default=DEFAULT_POLL_SECONDS)
    parser.add_argument(
        "--preload",
        default="",
        help="modules a zygote imports once, comma-separated; local `python SCRIPT` workers "
        "are then forked from it (default: none, no zygote)",
    )
    ours = parser.parse_args(argv[:split])
    ours.preload = [name for name in ours.preload.split(",") if name]
    for name in ours.preload:
        if not MODULE_NAME.fullmatch(name):
            parser.error(
                f"--preload: {name!r} is not a module name (like 'torch' or 'horovod.torch')"
            )
    if not 0 < ours.poll_seconds <= 60:
        parser.error(f"--poll-seconds must be > 0 and <= 60, got {ours.poll_seconds}")
    saved = sys.argv
    sys.argv = ["horovodrun", *argv[split + 1 :]]
    try:
        horovod_args = horovod_launch.parse_args()
    finally:
        sys.argv = saved
    if horovod_args.host_discovery_script or horovod_args.hosts or horovod_args.hostfile:
        parser.error(
            "the grant file is the job's hosts: drop --host-discovery-script/-H/--hostfile"
        )
    if horovod_args.min_num_proc is None:
        parser.error("--min-np is required: this driver runs elastic jobs only")
    if not horovod_args.command:
        parser.error("no command to run after horovodrun's arguments")
    return ours, horovod_args


def main(argv: Sequence[str] | None = None) -> int:
    ours, args = parse_driver_args(sys.argv[1:] if argv is None else argv)
    # `kill -USR1` prints every thread's stack: where a stuck driver waits.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.log_level:  # horovodrun's --log-level: Horovod's own logs too
        logging.basicConfig(level=logging.getLevelName(args.log_level))
    # Ours always: when the driver saw a grant and started a worker (the resize timeline).
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(created).3f herd-driver: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if not horovod_launch.gloo_built(verbose=False):
        print(
            "Gloo support is required for elastic training; this Horovod lacks it", file=sys.stderr
        )
        return 1
    try:
        run_elastic(args, ours.grant_file, ours.poll_seconds, ours.preload)
    except Exception as err:  # horovodrun's failure: the message, status 1
        print(f"herd-driver: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
