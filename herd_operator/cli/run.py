"""`herd-operator run`: the operator in the foreground, its options and their defaults.

Apart because it is the one command with dozens of options; the runtime it starts is
imported only when it runs, so the other commands start without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from herd_operator.auth import TokenFileError, TokenProblem
from herd_operator.cli.arguments import (
    Subcommands,
    UsageError,
    add_command,
    gpu_metrics_options,
    non_negative_float,
    parse_bytes,
    port,
    positive_float,
    positive_int,
    state_dir_option,
)
from herd_operator.cli.foreground import configure_logging, log_options, stop_on_signals
from herd_operator.cli.spec_files import SPECS_DIR_ENV, default_specs_dir
from herd_operator.cli.views import EXIT_FAILURE, EXIT_USAGE
from herd_operator.policies.queueing import DEFAULT_MIN_RUN_SECONDS, QUEUE_MODES, QueueConfig
from herd_operator.policies.sharing import (
    DEFAULT_MAX_JOBS_PER_GPU,
    DEFAULT_MEMORY_MARGIN,
    SharingLimits,
)
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.runtime.pruner import DEFAULT_RETENTION_SECONDS
from herd_operator.runtime.store import MAX_GRANTS_PER_JOB
from herd_operator.specs.conditions import REPORT_DEADLINE_SECONDS

if TYPE_CHECKING:
    from herd_operator.agent.mps import MpsDaemon


def add_commands(commands: Subcommands) -> None:
    run = add_command(commands, "run", cmd_run, help="run the operator in the foreground")
    state_dir_option(run)
    run.add_argument(
        "--specs-dir",
        type=Path,
        default=default_specs_dir(),
        help=f"directory of HerdJob YAML files to watch (default: ${SPECS_DIR_ENV}, else ./jobs)",
    )
    _pool_options(run)
    run.add_argument(
        "--resync-seconds",
        type=positive_float,
        default=5.0,
        help="how often a running job is reconciled without an event (default: 5)",
    )
    run.add_argument(
        "--report-deadline",
        type=positive_float,
        default=REPORT_DEADLINE_SECONDS,
        metavar="SECONDS",
        help="a launch none of whose workers reported (herd_operator.worker) within SECONDS "
        "gets the condition Reporting=False and a Warning event; the job keeps running "
        f"(default: {REPORT_DEADLINE_SECONDS:.0f})",
    )
    run.add_argument(
        "--relist-seconds",
        type=positive_float,
        default=10.0,
        help="how often the spec directory is fully re-read (default: 10)",
    )
    run.add_argument(
        "--grace-seconds",
        type=positive_float,
        default=10.0,
        help="SIGTERM-to-SIGKILL grace period when stopping a job (default: 10)",
    )
    _allocator_options(run)
    _metrics_options(run)
    run.add_argument(
        "--no-watch", action="store_true", help="no file events, relist only (as on NFS or Lustre)"
    )
    _state_options(run)
    log_options(run)


def _pool_options(run: argparse.ArgumentParser) -> None:
    """Which GPUs the operator shares, and how the pool's nodes reach it."""
    run.add_argument(
        "--hosts",
        help="pool as HOSTS:GPUS[,HOSTS:GPUS...]; HOSTS may be a Slurm host list and GPUS "
        "may name a type: 'nid[001-004]:4', nodeA:a100:4 (default: the Slurm allocation "
        "this runs in, else the GPUs NVML sees, else localhost with --virtual-gpus)",
    )
    run.add_argument(
        "--virtual-gpus",
        type=positive_int,
        help="virtual GPUs (CPU workers) per host where no GPU is found (default: 4); "
        "given, virtual GPUs are used even on a host whose NVIDIA devices NVML cannot read",
    )
    run.add_argument(
        "--listen",
        help="address the allocator listens on (default: 127.0.0.1 for a pool on this host; "
        "for several nodes, this node's address on --network-interface)",
    )
    run.add_argument(
        "--advertise",
        help="address workers use to reach the allocator (default: the --listen address)",
    )
    run.add_argument(
        "--node-timeout",
        type=positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a node whose agent (herd-operator exporter) was heard and then silent this "
        "long is lost, none of its free GPUs granted, until its agent calls again, even if "
        "the node answers probes; an agent that misses two of its calls makes its node "
        "suspect at once, until a probe or the agent answers (default: 30)",
    )
    run.add_argument(
        "--network-interface",
        metavar="NAME",
        help="interface between the pool's nodes, for Horovod and the allocator's address "
        "(hsn0 on Perlmutter; default: the one holding --listen or this host's address)",
    )


def _allocator_options(run: argparse.ArgumentParser) -> None:
    """How the allocator divides the pool among the jobs."""
    run.add_argument(
        "--min-resize-interval",
        type=non_negative_float,
        default=30.0,
        help="seconds a job's size is left alone after it changed (default: 30)",
    )
    by_gain = run.add_mutually_exclusive_group()
    by_gain.add_argument(
        "--spare-by-gain",
        action="store_true",
        help="lend GPUs no job wants to the jobs whose policy reports the most gain for"
        " their next GPU (goodput does), up to their max (docs/policies.md)",
    )
    by_gain.add_argument(
        "--share-by-gain",
        action="store_true",
        help="divide every GPU above the admitted jobs' mins, tier by tier, one at a time to"
        " the job whose next GPU adds most by its policy's gains (goodput reports them), up"
        " to its max; includes --spare-by-gain (docs/policies.md)",
    )
    by_gain.add_argument(
        "--share-by-speedup",
        action="store_true",
        help="divide every GPU above the admitted jobs' mins, tier by tier, to maximise the"
        " harmonic mean of the jobs' speedups over a fair share (Pollux's objective; goodput"
        " reports them), a running job grown only if the grow pays its stall; includes"
        " --spare-by-gain (docs/policies.md)",
    )
    run.add_argument(
        "--smallest-first",
        action="store_true",
        help="admit pending jobs smallest min first within a priority tier, not in arrival"
        " order; one pending --max-wait seconds goes first (docs/policies.md)",
    )
    run.add_argument(
        "--max-wait",
        type=positive_float,
        default=DEFAULT_MAX_WAIT_SECONDS,
        help="with --smallest-first: seconds after which a pending job is admitted before"
        f" any other of its priority (default: {DEFAULT_MAX_WAIT_SECONDS:g})",
    )
    run.add_argument(
        "--queue",
        choices=QUEUE_MODES,
        default="fifo",
        help="the order in which jobs claim GPUs within a priority tier: fifo (arrival, no"
        " preemption; the default), las (least GPU-time attained first) or srpt (least work"
        " left first, from the jobs' progress); las and srpt preempt a job ranked after a"
        " pending one that would not fit otherwise, if its spec says training.resumable"
        " (docs/policies.md)",
    )
    run.add_argument(
        "--queue-min-run",
        type=non_negative_float,
        default=DEFAULT_MIN_RUN_SECONDS,
        help="with --queue las|srpt: seconds a job runs before it may be preempted"
        f" (default: {DEFAULT_MIN_RUN_SECONDS:g})",
    )
    run.add_argument(
        "--share-gpus",
        action="store_true",
        help="let jobs that opt in (spec.gpus.share) share GPUs by memory: their request"
        " (spec.gpus.memory) or their measured peak, whichever is larger (docs/policies.md)",
    )
    run.add_argument(
        "--max-jobs-per-gpu",
        type=positive_int,
        default=DEFAULT_MAX_JOBS_PER_GPU,
        help=f"with --share-gpus: most jobs on one GPU (default: {DEFAULT_MAX_JOBS_PER_GPU})",
    )
    run.add_argument(
        "--memory-margin",
        type=non_negative_float,
        default=DEFAULT_MEMORY_MARGIN,
        help="with --share-gpus: a measured peak counts this much more (default:"
        f" {DEFAULT_MEMORY_MARGIN:g}, 10%%)",
    )
    run.add_argument(
        "--max-gpu-utilization",
        type=positive_float,
        default=None,
        help="with --share-gpus: the summed measured GPU utilization (NVML, per process) of the"
        " jobs sharing one GPU at most, >= 1; a job not measured yet counts 1 (default: no cap;"
        " docs/mechanisms.md)",
    )
    run.add_argument(
        "--share-whole-first",
        action="store_true",
        help="with --share-gpus: a sharing job takes a free GPU before a shared one whose"
        " summed measured utilization it would take past 1.0 (default: shared GPUs first,"
        " the fullest first; docs/mechanisms.md)",
    )
    run.add_argument(
        "--share-shrink-to-admit",
        action="store_true",
        help="with --share-gpus: the first waiting sharing job that fits nowhere, or a waiting"
        " whole-GPU job, may take GPUs from running sharing jobs of its priority or lower, down"
        " to their min, as whole-GPU jobs are shrunk to admit one (default: a sharing job is"
        " never shrunk to admit another job)",
    )
    run.add_argument(
        "--share-to-admit",
        action="store_true",
        help="with --share-gpus: a sharing job takes a GPU another job uses only to be"
        " admitted, after every free GPU, and grows onto free GPUs only (default: it grows"
        " onto shared GPUs too)",
    )
    run.add_argument(
        "--share-light-growth",
        action="store_true",
        help="with --share-gpus: a running job grows onto a shared GPU only where the summed"
        " measured utilization stays within 1.0; only admission crowds a GPU (default: growth"
        " too)",
    )
    run.add_argument(
        "--share-move-apart",
        action="store_true",
        help="with --share-gpus and --share-shrink-to-admit: a running job's worker on a GPU"
        " past a summed utilization of 1.0 moves to a free GPU when one is left after"
        " admission (a Horovod reset of that job; default: a worker stays where it was placed)",
    )
    run.add_argument(
        "--share-when-waiting",
        action="store_true",
        help="with --share-gpus: each sharing job gets the size the division of whole GPUs"
        " gives it (--share-by-speedup's, --share-by-gain's or fair share), on free GPUs first;"
        " only a job that division leaves waiting shares a GPU, at its min (default: each"
        " sharing job grows up to what it wants)",
    )
    run.add_argument(
        "--gpu-memory",
        type=parse_bytes,
        help="with --share-gpus: each GPU's memory, e.g. 80GiB (default: --virtual-gpu-memory"
        " on virtual GPUs; needed otherwise)",
    )
    run.add_argument(
        "--virtual-gpu-memory",
        type=parse_bytes,
        default=2 << 30,
        help="memory of one virtual GPU, e.g. 2GiB or 512MiB (default: 2GiB)",
    )


def _metrics_options(run: argparse.ArgumentParser) -> None:
    """The metrics the operator serves, and where its policies read GPU memory."""
    run.add_argument(
        "--metrics-port",
        type=port,
        default=9410,
        help="serve Prometheus metrics on this port (default: 9410; 0: any free port)",
    )
    run.add_argument(
        "--metrics-listen", help="address of the metrics endpoint (default: the --listen address)"
    )
    run.add_argument(
        "--prometheus-url",
        help="read the GPU memory signal from this Prometheus server (PromQL), e.g. "
        "http://localhost:9090 (default: this host's GPUs, or the registered node exporters)",
    )
    run.add_argument(
        "--gpu-metrics",
        choices=["herd", "dcgm"],
        default="herd",
        help="whose GPU memory metrics the memory policy reads: herd's exporters' (default) or "
        "NVIDIA dcgm-exporter's DCGM_FI_DEV_FB_USED/FREE (from --prometheus-url if given, "
        "else scraped from --dcgm-exporter-url)",
    )
    run.add_argument(
        "--dcgm-exporter-url",
        action="append",
        metavar="URL",
        help="a dcgm-exporter /metrics page to scrape with --gpu-metrics dcgm (repeat for each "
        "node; default: http://HOST:9400/metrics for every host of the pool)",
    )
    gpu_metrics_options(run)


def _state_options(run: argparse.ArgumentParser) -> None:
    """Where the operator keeps its files, what it keeps, and what a restart finds."""
    run.add_argument(
        "--runtime-dir",
        type=Path,
        help="where to keep grant files and discovery scripts, which Horovod reads every "
        "second on this host (default: $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)",
    )
    run.add_argument(
        "--grant-history-per-job",
        type=positive_int,
        default=MAX_GRANTS_PER_JOB,
        metavar="N",
        help="grant changes kept per job in the state store, the newest; `describe`, "
        "`report` and the event GrantHistoryTrimmed say when older ones were dropped "
        f"(default: {MAX_GRANTS_PER_JOB})",
    )
    run.add_argument(
        "--deleted-job-retention",
        type=non_negative_float,
        default=DEFAULT_RETENTION_SECONDS,
        metavar="SECONDS",
        help="a deleted job's grant history, log and leftover key files are removed this "
        "long after its last grant change or write, checked every minute in small steps "
        f"(default: {DEFAULT_RETENTION_SECONDS:.0f}, a day)",
    )
    run.add_argument(
        "--mps",
        action="store_true",
        help="start an NVIDIA MPS control daemon for this node's GPUs (pipes and log in "
        "<state-dir>/mps), so that jobs sharing a GPU run at once and each worker's memory "
        "limit is enforced by MPS; stopped with the operator",
    )
    run.add_argument(
        "--leave-jobs-running",
        action="store_true",
        help="on SIGTERM/SIGINT stop only the operator: the jobs train on, and the next "
        "operator started on this state dir adopts them (for an upgrade or a restart)",
    )
    run.add_argument(
        "--port",
        type=port,
        help="the allocator's port (default: the previous operator's, whose jobs' workers "
        "know it; else any free port)",
    )
    run.add_argument(
        "--no-agent-key-files",
        dest="agent_key_files",
        action="store_false",
        help="do not write each pool host's agent key to the state dir: the agents get theirs "
        "on stdin (herd-operator agent-key --host NODE | ... exporter --key-stdin)",
    )


def cmd_run(args: argparse.Namespace) -> int:
    from herd_operator.runtime.config import OperatorConfig, OperatorError
    from herd_operator.runtime.engines.horovod import local_names
    from herd_operator.runtime.operator import Operator, tune_gc
    from herd_operator.runtime.pools import DEFAULT_VIRTUAL_GPUS, PoolOptions, discover_pool
    from herd_operator.runtime.reach import local_interfaces, own_address, plan_reach

    configure_logging(args.log_level, args.log_format)
    virtual_gpus = args.virtual_gpus or DEFAULT_VIRTUAL_GPUS
    try:
        pool = discover_pool(
            args.hosts,
            virtual_gpus,
            PoolOptions(virtual_gpus, virtual_requested=args.virtual_gpus is not None),
        )
        reach = plan_reach(
            [host for host, _ in pool.pool.hosts],
            local_names(),
            local_interfaces(),
            listen=args.listen,
            advertise=args.advertise,
            network_interface=args.network_interface,
            own_address=own_address(),
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    for warning in reach.warnings:
        logging.getLogger("herd_operator").warning("%s", warning)
    config = OperatorConfig(
        specs_dir=args.specs_dir,
        state_dir=args.state_dir,
        pool=pool,
        listen_host=reach.listen,
        advertise_host=reach.advertise,
        network_interface=reach.network_interface,
        node_timeout_seconds=args.node_timeout,
        resync_seconds=args.resync_seconds,
        relist_seconds=args.relist_seconds,
        report_deadline_seconds=args.report_deadline,
        grace_seconds=args.grace_seconds,
        watch_events=not args.no_watch,
        min_resize_interval=args.min_resize_interval,
        spare_by_gain=args.spare_by_gain,
        share_by_gain=args.share_by_gain,
        share_by_speedup=args.share_by_speedup,
        smallest_first=args.smallest_first,
        max_wait_seconds=args.max_wait,
        queue=None
        if args.queue == "fifo"
        else QueueConfig(args.queue, min_run_seconds=args.queue_min_run),
        sharing=sharing_limits(args, pool.virtual),
        virtual_gpu_memory_bytes=args.virtual_gpu_memory,
        metrics_host=args.metrics_listen or reach.listen,
        metrics_port=args.metrics_port,
        prometheus_url=args.prometheus_url,
        gpu_metrics=args.gpu_metrics,
        dcgm_exporter_urls=tuple(args.dcgm_exporter_url or ()),
        process_metrics=args.process_metrics,
        dcgm_job_mapping_dir=args.dcgm_job_mapping_dir,
        runtime_dir=args.runtime_dir,
        listen_port=args.port,
        leave_jobs_running=args.leave_jobs_running,
        grant_history_per_job=args.grant_history_per_job,
        deleted_job_retention_seconds=args.deleted_job_retention,
        agent_key_files=args.agent_key_files,
    )
    mps = _start_mps(args)
    if isinstance(mps, int):
        return mps
    if mps is not None:
        config = dataclasses.replace(config, extra_env={**config.extra_env, **mps.environment()})
    stop = stop_on_signals()
    tune_gc()
    try:
        return Operator(config).run(stop)
    except OperatorError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except TokenFileError as err:  # the state dir's token: the user's to mend, as a bad flag
        print(f"herd-operator: {err}{_TOKEN_REMEDIES[err.problem]}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as err:  # a port in use, most often
        where = f"{err.filename}: {err.strerror}" if err.filename else str(err)
        print(f"herd-operator: cannot start: {where}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        # With --leave-jobs-running the jobs' workers are still the daemon's clients.
        if mps is not None and not args.leave_jobs_running:
            mps.stop(timeout=10.0)


def _start_mps(args: argparse.Namespace) -> MpsDaemon | int | None:
    """This node's MPS control daemon, started, when `--mps` asks for it (None when not);
    an exit status when it cannot start (the message printed)."""
    if not args.mps:
        return None
    from herd_operator.agent.mps import MpsDaemon, MpsError

    daemon = MpsDaemon(Path(args.state_dir) / "mps")
    try:
        daemon.start()
    except MpsError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    return daemon


def sharing_limits(args: argparse.Namespace, virtual: bool) -> SharingLimits | None:
    """`--share-gpus` and its settings; the GPUs' memory must be known to share them."""
    cap = args.max_gpu_utilization
    if not args.share_gpus:
        given = {
            "--max-gpu-utilization": cap is not None,
            "--share-whole-first": args.share_whole_first,
            "--share-shrink-to-admit": args.share_shrink_to_admit,
            "--share-to-admit": args.share_to_admit,
            "--share-light-growth": args.share_light_growth,
            "--share-move-apart": args.share_move_apart,
            "--share-when-waiting": args.share_when_waiting,
        }
        for flag in (flag for flag, on in given.items() if on):
            raise UsageError(f"{flag}: only with --share-gpus")
        return None
    if cap is not None and not (math.isfinite(cap) and cap >= 1.0):
        raise UsageError(
            f"--max-gpu-utilization: must be a finite number >= 1 (one busy job's), got {cap:g}"
        )
    if args.share_move_apart and not args.share_shrink_to_admit:
        raise UsageError("--share-move-apart: only with --share-shrink-to-admit")
    memory = args.gpu_memory or (args.virtual_gpu_memory if virtual else None)
    if memory is None:
        raise UsageError("--share-gpus: give --gpu-memory (each GPU's memory, e.g. 80GiB)")
    return SharingLimits(
        args.max_jobs_per_gpu, args.memory_margin, memory, max_utilization=cap,
        whole_first=args.share_whole_first, shrink_to_admit=args.share_shrink_to_admit,
        share_to_admit=args.share_to_admit, light_growth=args.share_light_growth,
        move_apart=args.share_move_apart, share_when_waiting=args.share_when_waiting,
    )  # fmt: skip


_NEW_TOKEN = (
    "remove it and the next start makes a new one (the keys derived from the old one, which"
    " running jobs and node exporters hold, stop working)"
)
_TOKEN_REMEDIES: dict[TokenProblem, str] = {
    "open": " (it must be a file of this user's, mode 0600; or remove it and the next start"
    " makes a new one)",
    "kind": f": {_NEW_TOKEN}",
    "owner": f": another user may have read or replaced it; {_NEW_TOKEN}",
    "mode": "",  # the message says the chmod
    "content": f": {_NEW_TOKEN}",
}
"""What to do, after the reader's message, about each problem of the operator's token."""
