"""`herd-operator`: run the operator, and look at what it did.

    herd-operator run --specs-dir jobs --hosts localhost:4
    herd-operator get [NAME] [-o json|yaml|wide]
    herd-operator describe NAME
    herd-operator events [NAME]
    herd-operator check-state [--full]
    herd-operator validate FILE...
    herd-operator schema
    herd-operator demo

Every command takes the same `--state-dir` (default `$HERD_STATE_DIR`, else
`./.herd-state`); the reading commands work while the operator runs and after.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TypeVar

import yaml

from herd_operator.cli.views import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    dash,
    format_age,
    format_events,
    format_table,
    job_object,
    open_store,
)
from herd_operator.layout import default_state_dir
from herd_operator.runtime.engines import UnknownEngineError, engine_problem
from herd_operator.runtime.store import StoreError, UnreadableSpecError
from policies.base import PolicyError
from policies.registry import load_policy
from specs import SpecFile, index_specs, json_schema, load_spec_file

_Number = TypeVar("_Number", int, float)


def _state_dir_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=default_state_dir(),
        help="the operator's state directory (default: $HERD_STATE_DIR or ./.herd-state)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="herd-operator",
        description="Share the GPUs of an allocation among elastic Horovod jobs declared as YAML.",
    )
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
        help="pool as HOST:GPUS[,HOST:GPUS...] "
        "(default: the GPUs NVML sees, else localhost with --virtual-gpus)",
    )
    run.add_argument(
        "--virtual-gpus",
        type=_positive_int,
        default=4,
        help="virtual GPUs on a machine without GPUs (default: 4)",
    )
    run.add_argument(
        "--listen",
        default="127.0.0.1",
        help="address the allocator listens on (default: 127.0.0.1)",
    )
    run.add_argument(
        "--advertise",
        help="address workers use to reach the allocator (default: the --listen address)",
    )
    run.add_argument(
        "--resync-seconds",
        type=_positive_float,
        default=5.0,
        help="how often a running job is reconciled without an event (default: 5)",
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
        "--no-watch", action="store_true", help="no file events, relist only (as on NFS or Lustre)"
    )
    run.add_argument(
        "--runtime-dir",
        type=Path,
        help="where to keep grant files and discovery scripts, which Horovod reads every "
        "second on this host (default: $XDG_RUNTIME_DIR, else /dev/shm, else the state dir)",
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
    run.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    exporter = commands.add_parser(
        "exporter", help="serve this node's GPU metrics (one per node, e.g. srun --overlap)"
    )
    _state_dir_option(exporter)
    exporter.add_argument("--port", type=_port, default=9411, help="default: 9411 (0: any)")
    exporter.add_argument("--listen", default="0.0.0.0", help="default: 0.0.0.0")
    exporter.add_argument(
        "--host", help="this node's name as the pool spells it (default: the host name)"
    )
    exporter.add_argument("--virtual-gpus", type=_positive_int, default=4)
    exporter.add_argument("--virtual-gpu-memory", type=parse_bytes, default=2 << 30)
    exporter.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )

    get = commands.add_parser("get", help="list jobs (kubectl-like table)")
    _state_dir_option(get)
    get.add_argument("name", nargs="?")
    get.add_argument("-o", "--output", choices=["table", "wide", "json", "yaml"], default="table")

    describe = commands.add_parser("describe", help="conditions, placement and events of a job")
    _state_dir_option(describe)
    describe.add_argument("name")

    events = commands.add_parser("events", help="list events")
    _state_dir_option(events)
    events.add_argument("name", nargs="?", help="only this job's events")
    events.add_argument("--limit", type=_positive_int, default=100)

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
        help="file to write (default: timeline.png; stdout for --format text); "
        "a .txt or .md name means --format text",
    )
    report.add_argument(
        "--format", choices=["png", "text"], help="default: from --output's suffix, else png"
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
        default=Path(".herd-demo"),
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
        " installed policy (default: fcfs,static,memory,goodput)",
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
        "--output", type=Path, default=Path("sim-results"), help="default: ./sim-results"
    )
    return parser


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
_port = _bounded(int, lambda v: 0 <= v < 65536, "a port is 0..65535", "a port number")
_positive_float = _bounded(float, lambda v: v > 0, "must be positive", "a number")
_non_negative_float = _bounded(float, lambda v: v >= 0, "must not be negative", "a number")

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
    from herd_operator.runtime.operator import Operator, OperatorConfig, OperatorError, tune_gc
    from herd_operator.runtime.pools import discover_pool

    configure_logging(args.log_level)
    try:
        pool = discover_pool(args.hosts, args.virtual_gpus)
    except ValueError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_USAGE
    config = OperatorConfig(
        specs_dir=args.specs_dir,
        state_dir=args.state_dir,
        pool=pool,
        listen_host=args.listen,
        advertise_host=args.advertise,
        resync_seconds=args.resync_seconds,
        relist_seconds=args.relist_seconds,
        grace_seconds=args.grace_seconds,
        watch_events=not args.no_watch,
        min_resize_interval=args.min_resize_interval,
        virtual_gpu_memory_bytes=args.virtual_gpu_memory,
        metrics_host=args.metrics_listen or args.listen,
        metrics_port=args.metrics_port,
        prometheus_url=args.prometheus_url,
        runtime_dir=args.runtime_dir,
        listen_port=args.port,
        leave_jobs_running=args.leave_jobs_running,
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


def cmd_exporter(args: argparse.Namespace) -> int:
    from herd_operator.agent.exporter import run_exporter

    configure_logging(args.log_level)
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
        )
    except OSError as err:
        print(
            f"herd-operator exporter: cannot serve on {args.listen}:{args.port}: {err}",
            file=sys.stderr,
        )
        return EXIT_FAILURE


# ---- reading commands ----


def cmd_get(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        records = store.list_jobs()
    if args.name:
        records = [record for record in records if record.name == args.name]
        if not records:
            print(f"herd-operator: no job {args.name!r} in {args.state_dir}", file=sys.stderr)
            return EXIT_FAILURE
    objects = [job_object(record) for record in records]
    if args.output == "json":
        print(json.dumps(objects, indent=2))
        return EXIT_OK
    if args.output == "yaml":
        print(yaml.safe_dump(objects, sort_keys=False), end="")
        return EXIT_OK
    if not objects:
        print(f"No jobs in {args.state_dir}.")
        return EXIT_OK
    now = time.time()
    header = ["NAME", "STATUS", "MIN", "MAX", "DESIRED", "ALLOCATED", "ACTIVE", "AGE"]
    wide = args.output == "wide"
    if wide:
        header += ["EPOCH", "RESTARTS", "GEN", "POLICY", "PLACEMENT"]
    rows = [header]
    for obj in objects:
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
                f"{host}:{'+'.join(map(str, gpu_list))}"
                for host, gpu_list in obj["placement"].items()
            )
            row += [
                dash(obj["epoch"]),
                str(obj["restarts"]),
                f"{obj['observedGeneration']}/{obj['generation']}",
                dash(obj["policy"]),
                placement or "-",
            ]
        rows.append(row)
    print(format_table(rows))
    return EXIT_OK


def cmd_describe(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        record = store.get_job(args.name)
        events = store.events(args.name, limit=20)
        decisions = store.grant_history(args.name)[-10:]
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
    lines.append("Events:" + ("" if events else "       none"))
    if events:
        lines += ["  " + line for line in format_events(events, now, False).splitlines()]
    print("\n".join(lines))
    return EXIT_OK


def cmd_events(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        events = store.events(args.name, limit=args.limit)
    if not events:
        print("No events.")
        return EXIT_OK
    print(format_events(events, time.time(), True))
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
    files = [load_spec_file(path) for path in paths]
    problems = [str(error) for spec_file in files for error in spec_file.errors]
    for spec_file in files:
        if spec_file.job is not None:
            try:
                load_policy(spec_file.job.spec.policy)
            except PolicyError as err:
                problems.append(f"{spec_file.path}: {err.field}: {err.message}")
            engine = engine_problem(spec_file.job.spec)
            if engine is not None:
                problems.append(f"{spec_file.path}: {UnknownEngineError.field}: {engine}")
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
    print(json.dumps(json_schema(), indent=2))
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
        results = simulate(workload, pool, policies, args.tick)
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


COMMANDS = {
    "run": cmd_run,
    "exporter": cmd_exporter,
    "get": cmd_get,
    "describe": cmd_describe,
    "events": cmd_events,
    "check-state": cmd_check_state,
    "report": cmd_report,
    "validate": cmd_validate,
    "schema": cmd_schema,
    "demo": cmd_demo,
    "bench": cmd_bench,
    "simulate": cmd_simulate,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except StoreError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return EXIT_FAILURE
    except BrokenPipeError:  # `herd-operator schema | head`: the reader left, that is fine
        sys.stderr.close()
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
