"""`herd-operator`: run the operator, and look at what it did.

    herd-operator run --specs-dir jobs --hosts localhost:4
    herd-operator get [NAME] [-o wide|json|yaml|name] [-l SELECTOR] [--no-headers] [-w]
    herd-operator describe NAME
    herd-operator logs NAME [-f] [--tail N]
    herd-operator events [NAME] [-w]
    herd-operator check-state [--full]
    herd-operator validate FILE...
    herd-operator schema
    herd-operator demo

Every command takes the same `--state-dir` (default `$HERD_STATE_DIR`, else
`./.herd-state`), before the command or after it; the reading commands work while the
operator runs and after.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from herd_operator.cli.logs import show_log
from herd_operator.cli.selectors import Selector, SelectorError, parse_selector
from herd_operator.cli.views import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    dash,
    format_age,
    format_events,
    format_table,
    herdjob_resource,
    job_has_ended,
    job_object,
    open_store,
    resource_list,
)
from herd_operator.controllers.ports import REPORT_DEADLINE_SECONDS, JobRecord
from herd_operator.layout import StateLayout, default_state_dir
from herd_operator.runtime.allocator import DEFAULT_MAX_WAIT_SECONDS
from herd_operator.runtime.pruner import DEFAULT_RETENTION_SECONDS
from herd_operator.runtime.store import (
    MAX_GRANTS_PER_JOB,
    Event,
    Store,
    StoreError,
    UnreadableSpecError,
)

if TYPE_CHECKING:
    from herd_operator.specs import SpecFile

_Number = TypeVar("_Number", int, float)


STATE_DIR_HELP = "the operator's state directory (default: $HERD_STATE_DIR or ./.herd-state)"
WATCH_POLL_SECONDS = 0.5
"""How often `get -w` and `events -w` read the store (one small read each)."""


def _state_dir_option(parser: argparse.ArgumentParser) -> None:
    # No default here: given before the command (`herd-operator --state-dir X get`) or after
    # it, one value lands in the namespace, and `main` fills in the default when neither did.
    parser.add_argument("--state-dir", type=Path, default=argparse.SUPPRESS, help=STATE_DIR_HELP)


class HerdArgumentParser(argparse.ArgumentParser):
    """An unknown flag is refused with the usage of the command it was given to."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = self.command_parsers.get(getattr(parsed, "command", None) or "")
            (command or self).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    @property
    def command_parsers(self) -> dict[str, argparse.ArgumentParser]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}


def _version() -> str:
    # Imported here: reading the distribution's metadata costs tens of milliseconds, which
    # every command (the operator's restart among them) paid for a flag it rarely gets.
    import importlib.metadata

    try:
        return importlib.metadata.version("herd-operator")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """`--version`, whose text is read only when the flag is given."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit")

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(f"herd-operator {_version()}")
        parser.exit()


def _gpu_metrics_options(parser: argparse.ArgumentParser) -> None:
    """Options of the GPU metrics that the operator (one host) and node exporters serve."""
    parser.add_argument(
        "--process-metrics",
        action="store_true",
        help="also export each GPU process's memory, labelled with its pid (new series on "
        "every restart of a job's workers: off by default)",
    )
    parser.add_argument(
        "--dcgm-job-mapping-dir",
        type=Path,
        metavar="DIR",
        help="keep NVIDIA dcgm-exporter's HPC job mapping files for this host's GPUs in DIR "
        "(the DIR given to dcgm-exporter --hpc-job-mapping-dir), so its series carry "
        "hpc_job=<herd job>",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = HerdArgumentParser(
        prog="herd-operator",
        description="Share the GPUs of an allocation among elastic Horovod jobs declared as YAML.",
    )
    parser.add_argument("--version", action=_VersionAction)
    _state_dir_option(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="run the operator in the foreground")
    _state_dir_option(run)
    run.add_argument(
        "--specs-dir",
        type=Path,
        default=Path("jobs"),
        help="directory of HerdJob YAML files to watch (default: ./jobs)",
    )
    run.add_argument(
        "--hosts",
        help="pool as HOSTS:GPUS[,HOSTS:GPUS...]; HOSTS may be a Slurm host list and GPUS "
        "may name a type: 'nid[001-004]:4', nodeA:a100:4 (default: the Slurm allocation "
        "this runs in, else the GPUs NVML sees, else localhost with --virtual-gpus)",
    )
    run.add_argument(
        "--virtual-gpus",
        type=_positive_int,
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
        type=_positive_float,
        default=30.0,
        metavar="SECONDS",
        help="a node whose agent (herd-operator exporter) was heard and then silent this "
        "long is cordoned, none of its free GPUs granted, until it is heard again "
        "(default: 30)",
    )
    run.add_argument(
        "--network-interface",
        metavar="NAME",
        help="interface between the pool's nodes, for Horovod and the allocator's address "
        "(hsn0 on Perlmutter; default: the one holding --listen or this host's address)",
    )
    run.add_argument(
        "--resync-seconds",
        type=_positive_float,
        default=5.0,
        help="how often a running job is reconciled without an event (default: 5)",
    )
    run.add_argument(
        "--report-deadline",
        type=_positive_float,
        default=REPORT_DEADLINE_SECONDS,
        metavar="SECONDS",
        help="a launch none of whose workers reported (herd_operator.worker) within SECONDS "
        "gets the condition Reporting=False and a Warning event; the job keeps running "
        f"(default: {REPORT_DEADLINE_SECONDS:.0f})",
    )
    run.add_argument(
        "--relist-seconds",
        type=_positive_float,
        default=10.0,
        help="how often the spec directory is fully re-read (default: 10)",
    )
    run.add_argument(
        "--grace-seconds",
        type=_positive_float,
        default=10.0,
        help="SIGTERM-to-SIGKILL grace period when stopping a job (default: 10)",
    )
    run.add_argument(
        "--min-resize-interval",
        type=_non_negative_float,
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
    run.add_argument(
        "--smallest-first",
        action="store_true",
        help="admit pending jobs smallest min first within a priority tier, not in arrival"
        " order; one pending --max-wait seconds goes first (docs/policies.md)",
    )
    run.add_argument(
        "--max-wait",
        type=_positive_float,
        default=DEFAULT_MAX_WAIT_SECONDS,
        help="with --smallest-first: seconds after which a pending job is admitted before"
        f" any other of its priority (default: {DEFAULT_MAX_WAIT_SECONDS:g})",
    )
    run.add_argument(
        "--virtual-gpu-memory",
        type=parse_bytes,
        default=2 << 30,
        help="memory of one virtual GPU, e.g. 2GiB or 512MiB (default: 2GiB)",
    )
    run.add_argument(
        "--metrics-port",
        type=_port,
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
    _gpu_metrics_options(run)
    run.add_argument(
        "--no-watch", action="store_true", help="no file events, relist only (as on NFS or Lustre)"
    )
    run.add_argument(
        "--runtime-dir",
        type=Path,
        help="where to keep grant files and discovery scripts, which Horovod reads every "
        "second on this host (default: $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)",
    )
    run.add_argument(
        "--grant-history-per-job",
        type=_positive_int,
        default=MAX_GRANTS_PER_JOB,
        metavar="N",
        help="grant changes kept per job in the state store, the newest; `describe`, "
        "`report` and the event GrantHistoryTrimmed say when older ones were dropped "
        f"(default: {MAX_GRANTS_PER_JOB})",
    )
    run.add_argument(
        "--deleted-job-retention",
        type=_non_negative_float,
        default=DEFAULT_RETENTION_SECONDS,
        metavar="SECONDS",
        help="a deleted job's grant history, log and leftover key files are removed this "
        "long after its last grant change or write, checked every minute in small steps "
        f"(default: {DEFAULT_RETENTION_SECONDS:.0f}, a day)",
    )
    run.add_argument(
        "--leave-jobs-running",
        action="store_true",
        help="on SIGTERM/SIGINT stop only the operator: the jobs train on, and the next "
        "operator started on this state dir adopts them (for an upgrade or a restart)",
    )
    run.add_argument(
        "--port",
        type=_port,
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
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    agent_key = commands.add_parser(
        "agent-key",
        help="print one host's agent key, to pipe into `exporter --key-stdin` on that host",
    )
    _state_dir_option(agent_key)
    agent_key.add_argument("--host", required=True, help="the node's name as the pool spells it")

    exporter = commands.add_parser(
        "exporter", help="serve this node's GPU metrics (one per node, e.g. srun --overlap)"
    )
    _state_dir_option(exporter)
    exporter.add_argument("--port", type=_port, default=9411, help="default: 9411 (0: any)")
    exporter.add_argument(
        "--listen",
        help="address to serve on (default: the one --host resolves to here, where the operator "
        "and Prometheus scrape it: loopback for a pool on this node alone, else this node's "
        "address, not every interface; docs/observability.md; 0.0.0.0: every interface)",
    )
    exporter.add_argument(
        "--host", help="this node's name as the pool spells it (default: the host name)"
    )
    exporter.add_argument(
        "--virtual-gpus",
        type=_positive_int,
        help="virtual GPUs where NVML finds none (default: as many as the operator's pool "
        "has on this host, else Slurm's SLURM_GPUS_ON_NODE or SLURM_GPUS_PER_NODE, else 4); "
        "given, also on a host whose NVIDIA devices NVML cannot read",
    )
    exporter.add_argument("--virtual-gpu-memory", type=parse_bytes, default=2 << 30)
    exporter.add_argument(
        "--key-stdin",
        action="store_true",
        help="read this host's agent key from the first line of stdin (from "
        "`herd-operator agent-key`) instead of the state dir's secrets/agent-HOST.token",
    )
    _gpu_metrics_options(exporter)
    exporter.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )

    get = commands.add_parser("get", help="list jobs (kubectl-like table)")
    _state_dir_option(get)
    get.add_argument("name", nargs="?", help="only this job (-o json|yaml: the one object)")
    get.add_argument(
        "-o",
        "--output",
        choices=["table", "wide", "json", "yaml", "name"],
        default="table",
        help="table (default), wide, json or yaml (a HerdJob object, or a List of them), "
        "name (herdjob/NAME)",
    )
    get.add_argument(
        "-l",
        "--selector",
        type=_selector,
        help="only jobs whose labels match: key=value, key!=value, key, !key, "
        "'key in (a,b)', 'key notin (a,b)', joined by commas (all must hold)",
    )
    get.add_argument("--no-headers", action="store_true", help="tables without their header")
    _watch_options(get, "after the list, print each job that changes (Ctrl-C ends)")

    describe = commands.add_parser("describe", help="conditions, placement and events of a job")
    _state_dir_option(describe)
    describe.add_argument("name")

    events = commands.add_parser("events", help="list events")
    _state_dir_option(events)
    events.add_argument("name", nargs="?", help="only this job's events")
    events.add_argument("--limit", type=_positive_int, default=100)
    events.add_argument("--no-headers", action="store_true", help="no header line")
    _watch_options(events, "after the list, print each new or repeated event (Ctrl-C ends)")

    logs = commands.add_parser("logs", help="print a job's output (<state-dir>/logs/<job>.log)")
    _state_dir_option(logs)
    logs.add_argument("name", metavar="NAME")
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing what the job writes until it ends (Ctrl-C ends sooner)",
    )
    logs.add_argument(
        "--tail",
        type=_non_negative_int,
        metavar="N",
        help="only the last N lines (default: all)",
    )
    logs.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="with -f: stop following after SECONDS (default: until the job ends)",
    )

    check = commands.add_parser(
        "check-state", help="check the state store for damage (exit 1 if damaged)"
    )
    _state_dir_option(check)
    check.add_argument(
        "--full",
        action="store_true",
        help="SQLite's integrity_check (indexes too; ~3x slower) instead of quick_check",
    )

    report = commands.add_parser("report", help="draw the run's timeline, or summarize it as text")
    _state_dir_option(report)
    report.add_argument(
        "--output",
        type=Path,
        help="file to write (default: timeline.png, or timeline.svg/.pdf with --format;"
        " stdout for --format text); its suffix picks the format: .png, .svg, .pdf, or"
        " .txt/.md for the text summary",
    )
    report.add_argument(
        "--format",
        choices=["png", "svg", "pdf", "text"],
        help="default: from --output's suffix, else png",
    )
    report.add_argument(
        "--dpi",
        type=_dpi,
        default=150,
        help="resolution of a PNG, in dots per inch (default: 150; the figure is 8x9 in)",
    )
    report.add_argument(
        "--since",
        type=_positive_float,
        metavar="SECONDS_AGO",
        help="only the last SECONDS_AGO seconds (default: the whole run)",
    )
    report.add_argument("--jobs", metavar="NAME,NAME", help="only these jobs (default: all)")

    validate = commands.add_parser("validate", help="check job spec files; exit 1 on problems")
    validate.add_argument("files", nargs="+", type=Path, metavar="FILE")

    commands.add_parser("schema", help="print the JSON Schema of the HerdJob spec")

    demo = commands.add_parser("demo", help="run the example jobs on this machine, end to end")
    demo.add_argument(
        "--state-dir",
        type=Path,
        default=argparse.SUPPRESS,
        help="where the demo keeps its jobs, state and logs (default: ./.herd-demo; wiped first)",
    )
    demo.add_argument("--virtual-gpus", type=_positive_int, default=4)
    demo.add_argument(
        "--timeout",
        type=_positive_float,
        default=600.0,
        help="give up after this many seconds (default: 600)",
    )

    bench = commands.add_parser("bench", help="measure the operator against baselines")
    bench.add_argument("--quick", action="store_true", help="tiny sizes, 1-2 repetitions")
    bench.add_argument("--only", metavar="NAME[,NAME]", help="run only these benchmarks")
    bench.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="where benchmarks.md and benchmarks.json go (default: ./bench-results)",
    )
    bench.add_argument(
        "--repeat", type=_positive_int, help="measured repetitions (default: per benchmark)"
    )
    simulate = commands.add_parser(
        "simulate",
        help="run a workload on a simulated cluster under the real policies and allocator",
    )
    simulate.add_argument(
        "workload", help="'perlmutter' (the generated Perlmutter-like mix) or a CSV trace"
    )
    simulate.add_argument("--pool", default="1792x4", help="NODESxGPUS (default: 1792x4)")
    simulate.add_argument(
        "--policy",
        default="fcfs,static,memory,goodput",
        help="comma-separated: fcfs (rigid, first come), static, memory, goodput, or any"
        " installed policy (default: fcfs,static,memory,goodput); NAME+spare: under an"
        " allocator that lends spare GPUs by the gain the policy reports; NAME+share: one"
        " that divides every GPU above the mins by that gain; NAME+small: one that admits"
        " the pending job with the smallest min first (combined: NAME+small+share)",
    )
    simulate.add_argument("--jobs", type=_positive_int, default=1000, help="generated jobs")
    simulate.add_argument("--seed", type=int, default=1, help="seed of the generated mix")
    simulate.add_argument(
        "--load", type=_positive_float, default=0.9, help="offered load of the mix (default 0.9)"
    )
    simulate.add_argument(
        "--tick",
        type=_non_negative_float,
        default=0.0,
        help="decide at multiples of this many seconds (default 0: at each event)",
    )
    simulate.add_argument(
        "--resync",
        type=_non_negative_float,
        default=0.0,
        help="reconcile every job again every this many seconds, as the operator's periodic"
        " resync (5 s there) does (default 0: only at each job's events)",
    )
    simulate.add_argument(
        "--max-wait",
        type=_positive_float,
        default=DEFAULT_MAX_WAIT_SECONDS,
        help="under +small: a job pending this many seconds is admitted first"
        f" (default {DEFAULT_MAX_WAIT_SECONDS:g}, as run --max-wait)",
    )
    simulate.add_argument(
        "--output", type=Path, default=Path("sim-results"), help="default: ./sim-results"
    )
    replay = commands.add_parser(
        "replay",
        help="simulate a recorded run of the operator again and compare the two timelines",
    )
    replay.add_argument(
        "state",
        type=Path,
        help="the run's store: its state.db, the directory holding it, or a demo's --state-dir",
    )
    replay.add_argument(
        "--min-resize-interval",
        type=_non_negative_float,
        default=30.0,
        help="the recorded operator's --min-resize-interval (default 30; the demo runs with 5)",
    )
    replay.add_argument(
        "--model-start",
        action="store_true",
        help="launch jobs in the simulator's constant start time, not in what each recorded"
        " job took from its first grant to its first epoch",
    )
    return parser


def _watch_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-w", "--watch", action="store_true", help=what)
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="with -w: stop watching after SECONDS (default: until Ctrl-C)",
    )


def _selector(text: str) -> Selector:
    try:
        return parse_selector(text)
    except SelectorError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _bounded(
    convert: Callable[[str], _Number], ok: Callable[[_Number], bool], rule: str, noun: str
) -> Callable[[str], _Number]:
    """An argparse type: convert, then check a bound; errors say what is allowed."""

    def parse(text: str) -> _Number:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{rule}, got {text}")
        return value

    return parse


_positive_int = _bounded(int, lambda v: v >= 1, "must be at least 1", "an integer")
_non_negative_int = _bounded(int, lambda v: v >= 0, "must not be negative", "an integer")
_port = _bounded(int, lambda v: 0 <= v < 65536, "a port is 0..65535", "a port number")
_positive_float = _bounded(float, lambda v: v > 0, "must be positive", "a number")
_non_negative_float = _bounded(float, lambda v: v >= 0, "must not be negative", "a number")
# Below 30 the text is unreadable; above 1200 an 8x9 in PNG passes 100 megapixels.
_dpi = _bounded(int, lambda v: 30 <= v <= 1200, "a resolution is 30..1200 dpi", "an integer")

_BYTE_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
}


def parse_bytes(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5GB` or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if not match or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 2GiB, 512MiB, 1.5GB, 1048576)"
        )
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


# ---- run ----


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def cmd_run(args: argparse.Namespace) -> int:
    from herd_operator.runtime.engines.horovod import local_names
    from herd_operator.runtime.operator import Operator, OperatorConfig, OperatorError, tune_gc
    from herd_operator.runtime.pools import DEFAULT_VIRTUAL_GPUS, PoolOptions, discover_pool
    from herd_operator.runtime.reach import local_interfaces, own_address, plan_reach

    configure_logging(args.log_level)
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
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_USAGE
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
        smallest_first=args.smallest_first,
        max_wait_seconds=args.max_wait,
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
    stop = _stop_on_signals()
    tune_gc()
    try:
        return Operator(config).run(stop)
    except OperatorError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as err:  # a port in use, most often
        print(f"herd-operator: cannot start: {err}", file=sys.stderr)
        return EXIT_FAILURE


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        logging.getLogger("herd_operator").info("%s received", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


KEY_LINE_MAX_CHARS = 256
"""What `exporter --key-stdin` reads at most: a key is 64 hex characters and a newline."""


def cmd_agent_key(args: argparse.Namespace) -> int:
    from herd_operator.auth import TokenFileError, agent_key, read_token_file

    try:
        host = _checked_host(args.host)
        master = read_token_file(StateLayout(args.state_dir).token_file)
    except (ValueError, TokenFileError) as err:
        print(f"herd-operator agent-key: {err}", file=sys.stderr)
        return EXIT_FAILURE
    if sys.stdout.isatty():
        # A key on a screen ends up in scrollback and terminal logs.
        print(
            "herd-operator agent-key: stdout is a terminal; pipe the key into "
            "`herd-operator exporter --key-stdin` (e.g. through srun) instead",
            file=sys.stderr,
        )
        return EXIT_USAGE
    sys.stdout.write(agent_key(master, host).hex() + "\n")
    return EXIT_OK


def _checked_host(text: str) -> str:
    """``text`` if it is a host name an agent may speak for; ValueError naming --host if not."""
    from herd_operator.auth import is_host

    if not is_host(text):
        raise ValueError(
            f"--host {text!r}: not a host name (letters, digits, '-', '_', '.', ':', '%'; "
            "at most 253 characters)"
        )
    return text


def cmd_exporter(args: argparse.Namespace) -> int:
    from herd_operator.agent.exporter import run_exporter
    from herd_operator.auth import TokenFileError, parse_key

    configure_logging(args.log_level)
    key = None
    if args.key_stdin:
        try:
            key = parse_key(sys.stdin.readline(KEY_LINE_MAX_CHARS), "--key-stdin: stdin")
        except TokenFileError as err:
            print(f"herd-operator exporter: {err}", file=sys.stderr)
            return EXIT_USAGE
    stop = _stop_on_signals()
    try:
        return run_exporter(
            args.state_dir,
            args.host,
            args.listen,
            args.port,
            args.virtual_gpus,
            args.virtual_gpu_memory,
            stop,
            per_process=args.process_metrics,
            dcgm_job_mapping_dir=args.dcgm_job_mapping_dir,
            key=key,
        )
    except OSError as err:
        print(
            f"herd-operator exporter: cannot serve on {args.listen or 'its address'}:{args.port}: "
            f"{err}",
            file=sys.stderr,
        )
        return EXIT_FAILURE


# ---- reading commands ----


def _selected(records: Sequence[JobRecord], selector: Selector | None) -> list[JobRecord]:
    if selector is None:
        return list(records)
    return [record for record in records if selector.matches(_labels(record))]


def _labels(record: JobRecord) -> dict[str, str]:
    try:
        return dict(record.spec.metadata.labels)
    except UnreadableSpecError:  # its labels are unknown: no selector matches them
        return {}


def _table_header(wide: bool) -> list[str]:
    header = ["NAME", "STATUS", "MIN", "MAX", "DESIRED", "ALLOCATED", "ACTIVE", "AGE"]
    return header + (["EPOCH", "RESTARTS", "GEN", "POLICY", "PLACEMENT"] if wide else [])


def _table_row(obj: dict[str, Any], now: float, wide: bool) -> list[str]:
    gpus = obj["gpus"]
    row = [
        obj["name"],
        obj["status"],
        dash(gpus["min"]),
        dash(gpus["max"]),
        dash(gpus["desired"]),
        str(gpus["allocated"]),
        dash(gpus["active"]),
        format_age(now - obj["createdAt"]),
    ]
    if wide:
        placement = ",".join(
            f"{host}:{'+'.join(map(str, gpu_list))}" for host, gpu_list in obj["placement"].items()
        )
        row += [
            dash(obj["epoch"]),
            str(obj["restarts"]),
            f"{obj['observedGeneration']}/{obj['generation']}",
            dash(obj["policy"]),
            placement or "-",
        ]
    return row


def _print_objects(
    records: Sequence[JobRecord], args: argparse.Namespace, *, header: bool, single: bool
) -> None:
    """`records` in the `-o` format; `single`: one object, not a List (get NAME)."""
    layout = StateLayout(args.state_dir)
    if args.output in ("json", "yaml"):
        objects = [herdjob_resource(r, layout.log_file(r.name)) for r in records]
        shown = objects[0] if single and len(objects) == 1 else resource_list(objects)
        if args.output == "json":
            print(json.dumps(shown, indent=2), flush=True)
        else:
            import yaml  # here: `run` never needs it, and starts sooner without it

            print(yaml.safe_dump(shown, sort_keys=False), end="", flush=True)
        return
    if args.output == "name":
        for record in records:
            print(f"herdjob/{record.name}", flush=True)
        return
    wide = args.output == "wide"
    now = time.time()
    rows = [_table_row(job_object(record), now, wide) for record in records]
    if header and not args.no_headers:
        rows.insert(0, _table_header(wide))
    if rows:
        print(format_table(rows), flush=True)


def cmd_get(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        records = _selected(store.list_jobs(), args.selector)
        if args.name:
            records = [record for record in records if record.name == args.name]
            if not records:
                print(f"herd-operator: no job {args.name!r} in {args.state_dir}", file=sys.stderr)
                return EXIT_FAILURE
        if records or args.output in ("json", "yaml"):
            _print_objects(records, args, header=True, single=bool(args.name))
        elif args.output != "name":
            print(f"No jobs in {args.state_dir}.", file=sys.stderr)
        if args.watch:
            _watch_jobs(store, args, records)
    return EXIT_OK


def _watch_jobs(store: Store, args: argparse.Namespace, shown: Sequence[JobRecord]) -> None:
    """Print each job again when it changes (a table row: when a cell other than AGE does);
    a deleted job's row says `Deleted`. Ends at --timeout, or by Ctrl-C (in `main`)."""
    wide = args.output == "wide"
    printed_header = bool(shown)

    def fingerprint(record: JobRecord) -> object:
        if args.output in ("table", "wide"):
            row = _table_row(job_object(record), 0.0, wide)
            del row[7]  # AGE grows on its own: not a change of the job
            return row
        return (record.generation, record.status, record.spec_path)

    last = {record.name: fingerprint(record) for record in shown}
    for _ in _ticks(args.timeout):
        records = _selected(store.list_jobs(), args.selector)
        if args.name:
            records = [record for record in records if record.name == args.name]
        changed = [record for record in records if last.get(record.name) != fingerprint(record)]
        gone = sorted(set(last) - {record.name for record in records})
        if changed and args.output in ("json", "yaml"):
            for record in changed:  # one object per change, as kubectl -w prints them
                if args.output == "yaml":
                    print("---", flush=True)
                _print_objects([record], args, header=False, single=True)
        elif changed:
            _print_objects(changed, args, header=not printed_header, single=False)
            printed_header = printed_header or args.output in ("table", "wide")
        if gone and args.output in ("table", "wide", "name"):
            for name in gone:
                print(
                    f"herdjob/{name}" if args.output == "name" else f"{name}   Deleted",
                    flush=True,
                )
        last = {record.name: fingerprint(record) for record in records}


def _ticks(timeout: float | None) -> Iterator[None]:
    """Yield every WATCH_POLL_SECONDS, until `timeout` seconds have passed (None: forever)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        time.sleep(WATCH_POLL_SECONDS)
        if deadline is not None and time.monotonic() >= deadline:
            return
        yield


def cmd_describe(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        record = store.get_job(args.name)
        events = store.events(args.name, limit=20)
        decisions = store.grant_history(args.name, limit=10)
        trimmed = store.trimmed_history(args.name).get(args.name)
    if record is None:
        print(f"herd-operator: no job {args.name!r} in {args.state_dir}", file=sys.stderr)
        return EXIT_FAILURE
    obj = job_object(record)
    status = record.status
    now = time.time()
    gpus = obj["gpus"]
    lines = [
        f"Name:         {obj['name']}",
        f"Spec file:    {obj['specPath']}",
        f"Log:          {StateLayout(args.state_dir).log_file(args.name)}"
        f" (herd-operator logs {args.name})",
        f"Generation:   {obj['generation']} (observed {obj['observedGeneration']})",
        f"Status:       {obj['status']}",
        *([f"Spec:         {obj['specError']}"] if "specError" in obj else []),
        f"Priority:     {dash(obj['priority'])}",
        f"Policy:       {dash(obj['policy'])}"
        + (f" ({status.policy_reason})" if status.policy_reason else ""),
        f"GPUs:         min {dash(gpus['min'])}, max {dash(gpus['max'])},"
        f" desired {dash(gpus['desired'])}, "
        f"allocated {gpus['allocated']}, active {dash(gpus['active'])}",
        f"Epoch:        {dash(obj['epoch'])}",
        f"Restarts:     {obj['restarts']}",
        f"Age:          {format_age(now - obj['createdAt'])}",
        "Placement:" + ("" if obj["placement"] else "    none"),
    ]
    for host, gpu_list in obj["placement"].items():
        lines.append(
            f"  {host} -> GPUs {', '.join(map(str, gpu_list))} (local ranks 0..{len(gpu_list) - 1})"
        )
    if status.grant_reason:
        lines.append(f"Last decision: {status.grant_reason}")
    lines.append("Conditions:")
    if status.conditions:
        rows = [["TYPE", "STATUS", "REASON", "AGE", "MESSAGE"]] + [
            [c.type, str(c.status), c.reason, format_age(now - c.last_transition_time), c.message]
            for c in status.conditions
        ]
        lines += ["  " + line for line in format_table(rows).splitlines()]
    lines.append("Decisions:" + ("" if decisions else "    none"))
    if decisions:
        rows = [["AGE", "GPUS", "REASON"]] + [
            [format_age(now - change.time), str(change.gpus), change.reason] for change in decisions
        ]
        lines += ["  " + line for line in format_table(rows).splitlines()]
    if trimmed is not None:
        lines.append(
            f"  ({trimmed.dropped} older change(s) were dropped by the history bound, the"
            f" newest of them {format_age(now - trimmed.through)} ago)"
        )
    lines.append("Events:" + ("" if events else "       none"))
    if events:
        lines += ["  " + line for line in format_events(events, now, False).splitlines()]
    print("\n".join(lines))
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        events = store.events(args.name, limit=args.limit)
        header = not args.no_headers
        if events:
            print(format_events(events, time.time(), True, header=header), flush=True)
        elif not args.watch:
            print("No events.")
        if args.watch:
            _watch_events(store, args, events, header=header and not events)
    return EXIT_OK


def _watch_events(
    store: Store, args: argparse.Namespace, shown: Sequence[Event], header: bool
) -> None:
    """Print each event that is new or happened again (its count grew) since the last look."""
    seen = {event.id: event.count for event in shown}
    for _ in _ticks(args.timeout):
        # The newest events by last occurrence: any that is new or repeated is among them.
        fresh = [
            event
            for event in store.events(args.name, limit=WATCH_EVENTS_WINDOW)
            if seen.get(event.id) != event.count
        ]
        if fresh:
            print(format_events(fresh, time.time(), True, header=header), flush=True)
            header = False
            seen.update((event.id, event.count) for event in fresh)


def cmd_logs(args: argparse.Namespace) -> int:
    log_file = StateLayout(args.state_dir).log_file(args.name)
    with open_store(args.state_dir) as store:
        if store.get_job(args.name) is None and not log_file.exists():
            print(f"herd-operator: no job {args.name!r} in {args.state_dir}", file=sys.stderr)
            return EXIT_FAILURE

        def still_running() -> bool:
            record = store.get_job(args.name)
            return record is not None and not job_has_ended(record.status)

        deadline = None if args.timeout is None else time.monotonic() + args.timeout
        found = show_log(log_file, args.tail, args.follow, still_running, deadline)
    if not found:
        print(
            f"herd-operator: job {args.name!r} has no log yet ({log_file}): it has not started",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    return EXIT_OK


def cmd_check_state(args: argparse.Namespace) -> int:
    """The check the operator makes at start (read-only: it may run meanwhile), and the
    jobs whose stored spec is unreadable (each says so on stderr)."""
    with open_store(args.state_dir) as store:
        store.check(full=args.full)
        records = store.list_jobs()
        unreadable = 0
        for record in records:
            try:
                record.spec  # noqa: B018
            except UnreadableSpecError as err:
                unreadable += 1
                print(f"herd-operator: {err}", file=sys.stderr)
    print(
        f"state store {store.path}: no damage found ({len(records)} jobs"
        + (f", {unreadable} with an unreadable spec" if unreadable else "")
        + ")"
    )
    return EXIT_OK


def validate_files(paths: Sequence[Path]) -> tuple[list[SpecFile], list[str]]:
    """Load each file, check its policy and engine, and check names across the files."""
    from herd_operator.runtime.specdir import with_known_references
    from herd_operator.specs import index_specs, load_spec_file

    files = [with_known_references(load_spec_file(path)) for path in paths]
    problems = [str(error) for spec_file in files for error in spec_file.errors]
    index = index_specs([f for f in files if f.valid])
    for errors in index.invalid.values():
        problems += [str(error) for error in errors]
    return files, problems


def cmd_validate(args: argparse.Namespace) -> int:
    files, problems = validate_files(args.files)
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        return EXIT_FAILURE
    for spec_file in files:
        print(f"{spec_file.path}: ok ({spec_file.name})")
    return EXIT_OK


def cmd_report(args: argparse.Namespace) -> int:
    from herd_operator.cli.report import run_report

    return run_report(args)


def cmd_schema(args: argparse.Namespace) -> int:
    from herd_operator.policies.registry import builtin_params_models
    from herd_operator.specs import json_schema

    print(json.dumps(json_schema(builtin_params_models()), indent=2))
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from herd_operator.cli.demo import run_demo

    configure_logging("INFO")
    code: int = run_demo(args.state_dir, args.virtual_gpus, args.timeout)
    return code


def cmd_bench(args: argparse.Namespace) -> int:
    from herd_operator.bench.suite import run_bench

    argv = ["--quick"] if args.quick else []
    argv += ["--only", args.only] if args.only else []
    argv += ["--repeat", str(args.repeat)] if args.repeat else []
    argv += ["--output", str(args.output)]
    try:
        outcomes, markdown, report = run_bench(
            quick=args.quick, only=args.only, output=args.output, repeat=args.repeat, argv=argv
        )
    except ValueError as err:
        print(f"herd-operator bench: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {markdown} and {report}")
    return EXIT_FAILURE if any(outcome.error for outcome in outcomes) else EXIT_OK


WATCH_EVENTS_WINDOW = 1000
"""Events read per look by `events -w`: more than the operator adds between two looks."""


def cmd_simulate(args: argparse.Namespace) -> int:
    from herd_operator.simulate.report import write
    from herd_operator.simulate.runner import (
        describe_timing,
        load_workload,
        parse_pool,
        simulate,
    )

    # The allocator's warnings (drains past 30 s when a tick delays the workers' reports)
    # are about simulated jobs: thousands of lines nobody needs.
    logging.getLogger("herd_operator.runtime.allocator").setLevel(logging.ERROR)
    arbitration_ms = 25.8  # docs/benchmarks.md: arbitrate() on 1,792 x 4 GPUs, 2,000 jobs
    try:
        pool = parse_pool(args.pool)
        workload = load_workload(args.workload, pool, args.jobs, args.seed, args.load)
        policies = [name.strip() for name in args.policy.split(",") if name.strip()]
        results = simulate(
            workload, pool, policies, args.tick, args.resync, max_wait_seconds=args.max_wait
        )
    except ValueError as err:
        print(f"herd-operator simulate: {err}", file=sys.stderr)
        return EXIT_USAGE
    header = (
        f"{workload.description} on {args.pool} ({pool.size} GPUs), tick {args.tick:g} s\n\n"
        + describe_timing(results, arbitration_ms)
    )
    paths = write(results, args.output, header)
    print((args.output / "summary.md").read_text())
    print(f"wrote {', '.join(str(path) for path in paths)}")
    return EXIT_OK


def cmd_replay(args: argparse.Namespace) -> int:
    from herd_operator.simulate.model import (
        GROW_STALL_SECONDS,
        SHRINK_STALL_SECONDS,
        START_SECONDS,
    )
    from herd_operator.simulate.replay import (
        describe,
        describe_stalls,
        measured_stalls,
        read_store,
        replay,
    )

    logging.getLogger("herd_operator.runtime.allocator").setLevel(logging.ERROR)
    path: Path = args.state
    for candidate in (path, path / "state.db", path / "state" / "state.db"):
        if candidate.is_file():
            path = candidate
            break
    else:
        print(f"herd-operator replay: no state.db at {args.state}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run = read_store(path)
        comparisons = replay(
            run,
            min_resize_interval=args.min_resize_interval,
            measured_start=not args.model_start,
        )
        stalls = [stall for job in run.jobs for stall in measured_stalls(job)]
    except ValueError as err:
        print(f"herd-operator replay: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: {len(run.jobs)} jobs on {run.pool_gpus} GPUs, replayed in the simulator\n")
    print(describe(comparisons, {job.name: job.arrival for job in run.jobs}))
    worst = max(abs(c.end_error) for c in comparisons)
    least = min(c.size_agreement for c in comparisons)
    print(f"\nworst completion error {worst:.1%}; least time with the same grant {least:.0%}")
    print(
        "\nLaunches and resizes as recorded (the simulator's model: first start"
        f" {START_SECONDS:g} s, grow {GROW_STALL_SECONDS:g} s, shrink {SHRINK_STALL_SECONDS:g} s)\n"
    )
    print(describe_stalls(stalls))
    return EXIT_OK


COMMANDS = {
    "run": cmd_run,
    "exporter": cmd_exporter,
    "agent-key": cmd_agent_key,
    "get": cmd_get,
    "describe": cmd_describe,
    "events": cmd_events,
    "logs": cmd_logs,
    "check-state": cmd_check_state,
    "report": cmd_report,
    "validate": cmd_validate,
    "schema": cmd_schema,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "simulate": cmd_simulate,
    "replay": cmd_replay,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "state_dir", None) is None:
        args.state_dir = Path(".herd-demo") if args.command == "demo" else default_state_dir()
    try:
        return COMMANDS[args.command](args)
    except StoreError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:  # Ctrl-C ends a watch or a follow: that is how one stops them
        if getattr(args, "watch", False) or getattr(args, "follow", False):
            return EXIT_OK
        raise
    except BrokenPipeError:  # `herd-operator schema | head`: the reader left, that is fine
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
