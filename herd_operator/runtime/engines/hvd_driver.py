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
- A grow whose new workers do not start in time (`--grow-timeout-seconds`) is given up, and
  the running workers go on at their old size, instead of failing the job (`GrowHold`).

The grant file stays the only channel from the operator, so a driver keeps working when
the operator that launched it dies and another adopts the job.

Exit status and signals are horovodrun's: SIGTERM or SIGINT stop the workers and the
driver exits 1, as does a job whose worker failed for good; 0 when every worker ended 0.

This module is the entry point: it parses both sets of arguments and wires the parts into
Horovod's driver. The parts live apart: discovery and missed updates in `hvd_discovery`,
the grow hold in `hvd_grow`, starting and supervising workers in `hvd_workers`.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from horovod.runner import gloo_run as horovod_gloo
from horovod.runner import launch as horovod_launch
from horovod.runner.common.util import config_parser, secret, timeout
from horovod.runner.driver import driver_service
from horovod.runner.elastic import driver as horovod_elastic_driver
from horovod.runner.elastic.settings import ElasticSettings
from horovod.runner.http.http_server import RendezvousServer
from horovod.runner.util import network

from herd_operator.runtime.engines.forkserver import Zygote
from herd_operator.runtime.engines.hvd_discovery import (
    DEFAULT_POLL_SECONDS,
    GrantFileDiscovery,
    MissedUpdateRedelivery,
)
from herd_operator.runtime.engines.hvd_grow import (
    DEFAULT_GROW_RETRY_SECONDS,
    DEFAULT_GROW_TIMEOUT_SECONDS,
    MAX_GROW_RETRY_SECONDS,
    MAX_GROW_TIMEOUT_SECONDS,
    GrowHold,
    WithheldSlots,
    observed_rendezvous_handler,
)
from herd_operator.runtime.engines.hvd_rounds import RoundWatch
from herd_operator.runtime.engines.hvd_workers import make_worker_factory, worker_environment
from herd_operator.runtime.log_format import TextFormatter
from herd_operator.specs.values import MODULE_NAME_PATTERN

DRIVER_MODULE = "herd_operator.runtime.engines.hvd_driver"
"""This module: how the Horovod engine starts every job (running jobs, adopted by a newer
operator, were started by this name too: it stays the entry point)."""
MODULE_NAME = re.compile(MODULE_NAME_PATTERN)
DEFAULT_GLOO_TIMEOUT_SECONDS = 30
"""Horovod's, when `--gloo-timeout-seconds` is not given (the operator always gives it)."""

log = logging.getLogger("herd.hvd_driver")
DRIVER_LOG_FORMAT = "%(asctime)s herd-driver: %(message)s"
"""The driver's own lines in a job's log; the benchmarks read their times back
(herd_operator/bench/training.py)."""


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
    args: argparse.Namespace,
    grant_file: Path,
    poll_seconds: float,
    preload: Sequence[str] = (),
    grow_timeout: float = DEFAULT_GROW_TIMEOUT_SECONDS,
    grow_retry: float = DEFAULT_GROW_RETRY_SECONDS,
) -> None:
    """Horovod's elastic Gloo launch (`_run_elastic` and `launch_gloo_elastic` of
    horovodrun), with the grant file as discovery and local workers started directly
    (forked by a zygote that imported `preload`, when given), and grows whose new workers
    are not at the rendezvous within `grow_timeout` seconds given up (`GrowHold`, tried
    again after `grow_retry` seconds at first)."""
    discovery = WithheldSlots(
        GrantFileDiscovery(
            grant_file,
            args.slots or 1,
            on_change=lambda slots: log.info("grant seen: %s", slots),
        )
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
    hold = GrowHold(driver, discovery, grow_timeout, driver._timeout, grow_retry)
    gloo_timeout = args.gloo_timeout_seconds or DEFAULT_GLOO_TIMEOUT_SECONDS
    rounds = RoundWatch(driver, forming_limit=gloo_timeout, formed_limit=driver._timeout)

    def put_seen(scope: str, key: str) -> None:
        hold.put_seen(scope, key)
        rounds.put_seen(scope, key)

    port = rendezvous.start(observed_rendezvous_handler(driver, put_seen))
    min_hosts = horovod_gloo._get_min_start_hosts(settings)
    hosts = driver.wait_for_available_slots(settings.num_proc, min_hosts=min_hosts)
    nics = job_interfaces(settings, hosts.host_assignment_order)
    server_ip = network.get_driver_ip(nics)
    shutdown = horovod_gloo.register_shutdown_event()
    hold.stopping = shutdown.is_set
    zygote = Zygote(preload, worker_environment(env, {}, {})) if preload else None
    create_worker = make_worker_factory(
        settings, env, args.command, server_ip, nics, port, shutdown, zygote, hold.stop_events
    )
    rounds.start()
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
        "--grow-timeout-seconds",
        type=float,
        default=DEFAULT_GROW_TIMEOUT_SECONDS,
        help="how long the running workers of a grow wait for its new workers to reach the "
        "rendezvous before the grow is given up and they go on at their old size "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--grow-retry-seconds",
        type=float,
        default=DEFAULT_GROW_RETRY_SECONDS,
        help="how long the slots of a grow given up (its new workers did not start within "
        "--grow-timeout-seconds) are withheld before it is tried again, unless the grant changes "
        "first; doubled after each failure in a row, up to 600 s (default: %(default)s)",
    )
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
    if not 0 < ours.grow_timeout_seconds <= MAX_GROW_TIMEOUT_SECONDS:
        parser.error(
            f"--grow-timeout-seconds must be > 0 and <= {MAX_GROW_TIMEOUT_SECONDS:.0f}, "
            f"got {ours.grow_timeout_seconds}"
        )
    if not 0 < ours.grow_retry_seconds <= MAX_GROW_RETRY_SECONDS:
        parser.error(
            f"--grow-retry-seconds must be > 0 and <= {MAX_GROW_RETRY_SECONDS:.0f}, "
            f"got {ours.grow_retry_seconds}"
        )
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
    # Stamped as the operator's lines are (a job's log holds both): UTC, ISO 8601, ms.
    handler.setFormatter(TextFormatter(DRIVER_LOG_FORMAT))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    if not horovod_launch.gloo_built(verbose=False):
        print(
            "Gloo support is required for elastic training; this Horovod lacks it", file=sys.stderr
        )
        return 1
    try:
        run_elastic(
            args,
            ours.grant_file,
            ours.poll_seconds,
            ours.preload,
            ours.grow_timeout_seconds,
            ours.grow_retry_seconds,
        )
    except Exception as err:  # horovodrun's failure: the message, status 1
        print(f"herd-driver: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
