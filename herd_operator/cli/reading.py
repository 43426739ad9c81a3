"""`herd-operator get`, `describe`, `events` and `logs`: what the store and the job logs say,
while the operator runs and after, as tables, objects or a followed log.

Apart from the commands that change or run things: these only read (the store opened
read-only), and their watch loops are theirs alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from herd_operator.cli.arguments import (
    Subcommands,
    UsageError,
    add_command,
    non_negative_int,
    positive_float,
    positive_int,
    state_dir_option,
)
from herd_operator.cli.completion import complete_job_names
from herd_operator.cli.logs import show_log
from herd_operator.cli.selectors import Selector, SelectorError, parse_selector
from herd_operator.cli.sorting import SORT_BY_HELP, SortKey, SortKeyError, parse_sort_key, sort_by
from herd_operator.cli.views import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    dash,
    epochs_completed,
    eta_cell,
    format_age,
    format_events,
    format_table,
    herdjob_resource,
    job_has_ended,
    job_object,
    open_store,
    progress_cell,
    resource_list,
    rfc3339,
)
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Event, Store, UnreadableSpecError
from herd_operator.specs.labels import LABEL_KEY_RULE, is_label_key
from herd_operator.specs.records import JobRecord
from herd_operator.specs.values import Placement

WATCH_POLL_SECONDS = 0.5
"""How often `get -w` and `events -w` read the store (one small read each)."""
WATCH_EVENTS_WINDOW = 1000
"""Events read per look by `events -w`: more than the operator adds between two looks."""


def add_commands(commands: Subcommands) -> None:
    get = add_command(commands, "get", cmd_get, help="list jobs (kubectl-like table)")
    state_dir_option(get)
    complete_job_names(
        get.add_argument("name", nargs="?", help="only this job (-o json|yaml: the one object)")
    )
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
        "'key in (a,b)', 'key notin (a,b)', joined by commas (all must hold); '' matches every job",
    )
    get.add_argument("--no-headers", action="store_true", help="tables without their header")
    get.add_argument(
        "--sort-by",
        type=_sort_key,
        metavar="KEY",
        help=f"list the jobs ordered by KEY (default: by name): {SORT_BY_HELP}",
    )
    get.add_argument(
        "-L",
        "--label-columns",
        type=_label_keys,
        action="extend",
        metavar="KEY[,KEY]",
        help="a table column for each of these labels, headed by the key in capitals "
        "(as kubectl's -L)",
    )
    get.add_argument(
        "--show-labels",
        action="store_true",
        help="a LABELS column with each job's labels (key=value, comma-separated)",
    )
    _watch_options(get, "after the list, print each job that changes (Ctrl-C ends)")

    describe = add_command(
        commands, "describe", cmd_describe, help="conditions, placement and events of a job"
    )
    state_dir_option(describe)
    complete_job_names(describe.add_argument("name"))

    events = add_command(commands, "events", cmd_events, help="list events")
    state_dir_option(events)
    complete_job_names(events.add_argument("name", nargs="?", help="only this job's events"))
    events.add_argument("--limit", type=positive_int, default=100)
    events.add_argument("--no-headers", action="store_true", help="no header line")
    _watch_options(events, "after the list, print each new or repeated event (Ctrl-C ends)")

    logs = add_command(
        commands, "logs", cmd_logs, help="print a job's output (<state-dir>/logs/<job>.log)"
    )
    state_dir_option(logs)
    complete_job_names(logs.add_argument("name", metavar="NAME"))
    logs.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing what the job writes until it ends (Ctrl-C ends sooner)",
    )
    logs.add_argument(
        "--tail",
        type=non_negative_int,
        metavar="N",
        help="only the last N lines (default: all)",
    )
    logs.add_argument(
        "--timeout",
        type=positive_float,
        metavar="SECONDS",
        help="with -f: stop following after SECONDS (default: until the job ends)",
    )


def _watch_options(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("-w", "--watch", action="store_true", help=what)
    parser.add_argument(
        "--timeout",
        type=positive_float,
        metavar="SECONDS",
        help="with -w: stop watching after SECONDS (default: until Ctrl-C)",
    )


def _selector(text: str) -> Selector:
    try:
        return parse_selector(text)
    except SelectorError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _sort_key(text: str) -> SortKey:
    try:
        return parse_sort_key(text)
    except SortKeyError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _label_keys(text: str) -> list[str]:
    keys = [key.strip() for key in text.split(",") if key.strip()]
    bad = [key for key in keys if not is_label_key(key)]
    if bad or not keys:
        raise argparse.ArgumentTypeError(
            f"{text!r}: {bad[0]!r} is not a label key ({LABEL_KEY_RULE})"
            if bad
            else f"{text!r}: no label keys"
        )
    return keys


def _label_header(args: argparse.Namespace) -> list[str]:
    keys = args.label_columns or []
    return [key.upper() for key in keys] + (["LABELS"] if args.show_labels else [])


def _label_cells(record: JobRecord, args: argparse.Namespace) -> list[str]:
    """The -L columns (a label's value, empty when unset, as kubectl's) and --show-labels'."""
    labels = _labels(record)
    cells = [labels.get(key, "") for key in args.label_columns or []]
    if args.show_labels:
        shown = ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
        cells.append(shown or "<none>")
    return cells


def _sorted(records: Sequence[JobRecord], args: argparse.Namespace) -> list[JobRecord]:
    if args.sort_by is None:
        return list(records)
    layout = StateLayout(args.state_dir)
    try:
        return sort_by(
            records, args.sort_by, lambda r: herdjob_resource(r, layout.log_file(r.name))
        )
    except SortKeyError as err:
        raise UsageError(str(err)) from None


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
    header = ["NAME", "STATUS", "MIN", "MAX", "DESIRED", "ALLOCATED", "ACTIVE", "PROGRESS", "AGE"]
    return header + (["EPOCH", "ETA", "RESTARTS", "GEN", "POLICY", "PLACEMENT"] if wide else [])


_AGE = _table_header(False).index("AGE")


def _table_row(
    obj: dict[str, Any], now: float, wide: bool, beside: Sequence[str] = ()
) -> list[str]:
    """One job's cells; `beside`: the jobs sharing a GPU with it now (wide only)."""
    gpus = obj["gpus"]
    row = [
        obj["name"],
        obj["status"],
        dash(gpus["min"]),
        dash(gpus["max"]),
        dash(gpus["desired"]),
        str(gpus["allocated"]),
        dash(gpus["active"]),
        progress_cell(obj),
        format_age(now - obj["createdAt"]),
    ]
    if wide:
        placement = ",".join(
            f"{host}:{'+'.join(map(str, gpu_list))}" for host, gpu_list in obj["placement"].items()
        )
        if placement and gpus["share"]:  # GPUs shared by memory: what one worker asked for
            with_ = f",with:{'+'.join(beside)}" if beside else ""
            placement += f"(shared:{gpus['memory'] or '?'}{with_})"
        row += [
            dash(epochs_completed(obj["epoch"])),
            eta_cell(obj, now),
            str(obj["restarts"]),
            f"{obj['observedGeneration']}/{obj['generation']}",
            dash(obj["policy"]),
            placement or "-",
        ]
    return row


def _print_objects(
    records: Sequence[JobRecord],
    args: argparse.Namespace,
    *,
    header: bool,
    single: bool,
    beside: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """`records` in the `-o` format; `single`: one object, not a List (get NAME); `beside`:
    `_beside`, for `wide`."""
    layout = StateLayout(args.state_dir)
    if args.output in ("json", "yaml"):
        objects = [herdjob_resource(r, _log_file(layout, r.name)) for r in records]
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
    shared = beside or {}
    rows = [
        _table_row(job_object(record), now, wide, shared.get(record.name, ()))
        + _label_cells(record, args)
        for record in records
    ]
    if header and not args.no_headers:
        rows.insert(0, _table_header(wide) + _label_header(args))
    if rows:
        print(format_table(rows), flush=True)


def cmd_get(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        records = _sorted(_selected(store.list_jobs(), args.selector), args)
        if args.name:
            records = [record for record in records if record.name == args.name]
            if not records:
                print(f"herd-operator: no job {args.name!r} in {args.state_dir}", file=sys.stderr)
                return EXIT_FAILURE
        if records or args.output in ("json", "yaml"):
            beside = _beside(store, args)
            _print_objects(records, args, header=True, single=bool(args.name), beside=beside)
        elif args.output != "name":
            print(f"No jobs in {args.state_dir}.", file=sys.stderr)
        if args.watch:
            _watch_jobs(store, args, records)
    return EXIT_OK


def _beside(store: Store, args: argparse.Namespace) -> dict[str, list[str]] | None:
    """For `-o wide`: each job holding a GPU with other jobs now (GPUs shared by memory) ->
    their names; None for the other formats (they do not show it)."""
    if args.output != "wide":
        return None
    beside: dict[str, set[str]] = {}
    for jobs in _jobs_on_gpus(store.allocations()).values():
        for job in jobs:
            beside.setdefault(job, set()).update(other for other in jobs if other != job)
    return {job: sorted(others) for job, others in beside.items() if others}


def _jobs_on_gpus(placements: Mapping[str, Placement]) -> dict[tuple[str, int], list[str]]:
    """Each granted GPU (host, index) -> the jobs placed on it, by name."""
    on: dict[tuple[str, int], list[str]] = {}
    for job, placement in sorted(placements.items()):
        for slot in placement.slots():
            on.setdefault(slot, []).append(job)
    return on


def _watch_jobs(store: Store, args: argparse.Namespace, shown: Sequence[JobRecord]) -> None:
    """Print each job again when it changes (a table row: when a cell other than AGE does);
    a deleted job's row says `Deleted`. Ends at --timeout, or by Ctrl-C (in `main`)."""
    wide = args.output == "wide"
    printed_header = bool(shown)

    def fingerprint(record: JobRecord) -> object:
        if args.output in ("table", "wide"):
            row = _table_row(job_object(record), 0.0, wide) + _label_cells(record, args)
            del row[_AGE]  # AGE grows on its own: not a change of the job
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
            beside = _beside(store, args)
            _print_objects(changed, args, header=not printed_header, single=False, beside=beside)
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


def _log_file(layout: StateLayout, name: str) -> Path | None:
    """The job's log file; None for a stored name that is not a job's (a damaged store):
    no path is made of it."""
    try:
        return layout.log_file(name)
    except ValueError:
        return None


def _sharing_neighbours(store: Store, name: str) -> dict[str, list[str]]:
    """Each GPU `name` holds with other jobs (`host:gpu` -> each of them with the memory its
    worker asked for, `b (8Gi asked)`): GPUs shared by memory (`spec.gpus.share`)."""
    on = _jobs_on_gpus(store.allocations())
    shared: dict[str, list[str]] = {}
    asked: dict[str, str] = {}
    for (host, gpu), jobs in sorted(on.items()):
        if name not in jobs:
            continue
        for job in jobs:
            if job != name:
                if job not in asked:
                    asked[job] = _asked_memory(store.get_job(job))
                shared.setdefault(f"{host}:{gpu}", []).append(f"{job} ({asked[job]})")
    return shared


def _asked_memory(record: JobRecord | None) -> str:
    """What one worker of a sharing job asked for, as `describe` says it of a neighbour."""
    try:
        memory = record.spec.spec.gpus.memory if record is not None else None
    except UnreadableSpecError:
        memory = None  # its stored spec no longer parses: `describe` of it says why
    return f"{memory} asked" if memory else "no memory asked: its measured peak"


def _sharing_line(memory: str | None, neighbours: Mapping[str, list[str]]) -> str:
    asked = f"{memory} per worker asked" if memory else "no memory asked (measured peak)"
    beside = "; ".join(f"{gpu} with {', '.join(jobs)}" for gpu, jobs in sorted(neighbours.items()))
    return f"Sharing:      GPUs shared by memory, {asked}; {beside or 'no GPU shared now'}"


def cmd_describe(args: argparse.Namespace) -> int:
    with open_store(args.state_dir) as store:
        record = store.get_job(args.name)
        events = store.events(args.name, limit=20)
        decisions = store.grant_history(args.name, limit=10)
        trimmed = store.trimmed_history(args.name).get(args.name)
        neighbours = _sharing_neighbours(store, args.name)
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
        f"Log:          {dash(_log_file(StateLayout(args.state_dir), args.name))}"
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
        f"Epochs done:  {dash(epochs_completed(obj['epoch']))}",
        *_describe_progress(obj, now),
        f"Restarts:     {obj['restarts']}",
        *([f"Preemptions:  {obj['preemptions']}"] if obj.get("preemptions") else []),
        *_describe_resize(obj, now),
        f"Age:          {format_age(now - obj['createdAt'])}",
        "Placement:" + ("" if obj["placement"] else "    none"),
    ]
    for host, gpu_list in obj["placement"].items():
        lines.append(
            f"  {host} -> GPUs {', '.join(map(str, gpu_list))} (local ranks 0..{len(gpu_list) - 1})"
        )
    if gpus["share"]:
        lines.append(_sharing_line(gpus["memory"], neighbours))
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


def _describe_progress(obj: dict[str, Any], now: float) -> list[str]:
    """describe's lines on progress, reported metrics, time limit and dependencies (only
    those the job has)."""
    lines = []
    progress = obj["progress"]
    if progress is not None:
        done, expected = progress["completed"], progress["epochs"]
        line = f"Progress:     {done}/{expected} epochs ({100 * done // expected}%)"
        if progress["epochSeconds"] is not None:
            line += f", {progress['epochSeconds']:.1f}s per epoch at this size"
        if progress["estimatedCompletion"] is not None:
            line += f", ETA {eta_cell(obj, now)} ({rfc3339(progress['estimatedCompletion'])})"
        lines.append(line)
    if obj["metrics"]:
        shown = ", ".join(f"{name}={value:.6g}" for name, value in obj["metrics"].items())
        lines.append(f"Metrics:      {shown} (the last reported)")
    spec = obj["spec"] or {}
    limit = spec.get("activeDeadlineSeconds")
    if limit is not None:
        started = obj["runStartedAt"]
        when = (
            f", {format_age(now - started)} used since the first start"
            f" (reached at {rfc3339(started + limit)})"
            if started is not None
            else ", counted from the first start"
        )
        lines.append(f"Time limit:   {limit}s{when}")
    if spec.get("dependsOn"):
        lines.append(f"Depends on:   {', '.join(spec['dependsOn'])} (must succeed first)")
    return lines


def _describe_resize(obj: dict[str, Any], now: float) -> list[str]:
    """What the job's last finished resize cost, on the engine it ran on (none: no line)."""
    cost = obj["lastResize"]
    if cost is None:
        return []
    ago = format_age(now - cost["completedAt"])
    return [f"Last resize:  {cost['message']}, on {cost['engine']}, {ago} ago"]


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
    try:
        # A name is a DNS-1123 label: `../x` would read <state>/x.log, outside the logs.
        log_file = StateLayout(args.state_dir).log_file(args.name)
    except ValueError as err:
        print(f"herd-operator logs: error: NAME {err}", file=sys.stderr)
        return EXIT_USAGE
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
