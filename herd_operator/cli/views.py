"""How the CLI shows what the store holds: the job object, tables, ages, events.

Shared by the commands, the report and the demo (which import it, never each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Event, Store, StoreError, UnreadableSpecError
from herd_operator.specs.conditions import ConditionType, get_condition, is_true
from herd_operator.specs.models import API_VERSION, HOROVOD_ENGINE, KIND, HerdJobSpec
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def open_store(state_dir: Path) -> Store:
    path = StateLayout(state_dir).database
    if state_dir.exists() and not state_dir.is_dir():
        raise StoreError(f"the state dir {state_dir} is not a directory")
    if path.is_dir():  # SQLite would say only "disk I/O error"
        raise StoreError(f"state store {path} is a directory, not a file")
    if not path.exists():
        raise StoreError(
            f"no operator state in {state_dir} (run `herd-operator run --state-dir {state_dir}`"
            " first, or pass the --state-dir it used)"
        )
    return Store.open_readonly(path)


def job_object(record: JobRecord) -> dict[str, Any]:
    """A flat view of a job (identity, spec, status) for the tables, the demo and tests;
    `get -o json|yaml` shows `herdjob_resource` instead.

    A job whose stored spec is unreadable shows with its status, the spec's fields None
    and `specError` saying why (the operator records the spec file again).
    """
    status = record.status
    spec: HerdJobSpec | None
    try:
        spec, spec_error = record.spec.spec, None
    except UnreadableSpecError as err:
        spec, spec_error = None, str(err)
    gpus = status.gpus
    shown = {
        "name": record.name,
        "uid": record.uid,
        "specPath": record.spec_path,
        "generation": record.generation,
        "observedGeneration": status.observed_generation,
        "status": status.summary(),
        "conditions": [c.model_dump(by_alias=True, mode="json") for c in status.conditions],
        "gpus": {
            "min": spec.gpus.min if spec else None,
            "max": spec.gpus.max if spec else None,
            "desired": gpus.desired if gpus else None,
            "allocated": gpus.allocated if gpus else 0,
            "active": gpus.active if gpus else None,
            "share": spec.gpus.share if spec else False,
            "memory": spec.gpus.memory if spec else None,
        },
        "placement": {host: gpu_list for host, gpu_list in status.placement},
        "epoch": status.epoch,
        "restarts": status.restarts,
        "preemptions": status.preemptions,
        "priority": spec.priority if spec else None,
        "policy": spec.policy.name if spec else None,
        "createdAt": record.created_at,
        "spec": spec.model_dump(mode="json", by_alias=True) if spec else None,
        "progress": _progress_view(spec, status),
        "metrics": dict(status.metrics),
        "runStartedAt": status.run_started_at,
        "lastResize": _resize_view(status),
    }
    if spec_error is not None:
        shown["specError"] = spec_error
    return shown


def _resize_view(status: HerdJobStatus) -> dict[str, Any] | None:
    """What the job's last finished resize cost, with what its event said (None: none
    finished yet)."""
    cost = status.last_resize
    if cost is None:
        return None
    return {**cost.model_dump(by_alias=True, mode="json"), "message": cost.message()}


def epochs_completed(last_epoch: int | None) -> int | None:
    """How many epochs a job has completed, from the last epoch its workers reported (they
    count from 0, as Horovod's `state.epoch`): what `get`'s EPOCH, `describe` and the demo's
    summary show, so they agree. None: none reported (since the last launch)."""
    return None if last_epoch is None else last_epoch + 1


def _progress_view(spec: HerdJobSpec | None, status: HerdJobStatus) -> dict[str, Any] | None:
    """Epochs done against the spec's expected epochs, and the estimated end while the job
    runs (None: the spec expects no number of epochs)."""
    expected = spec.training.epochs if spec is not None and spec.training is not None else None
    if expected is None:
        return None
    progress = status.progress
    running = is_true(status.conditions, ConditionType.Running)
    return {
        "epochs": expected,
        "completed": epochs_completed(status.epoch) or 0,
        "epochSeconds": progress.epoch_seconds if progress is not None else None,
        "estimatedCompletion": progress.estimated_completion
        if progress is not None and running
        else None,
    }


def progress_cell(obj: dict[str, Any]) -> str:
    """`get`'s PROGRESS: epochs done of those expected ("3/10"), or "-"."""
    progress = obj["progress"]
    return "-" if progress is None else f"{progress['completed']}/{progress['epochs']}"


def eta_cell(obj: dict[str, Any], now: float) -> str:
    """`get -o wide`'s ETA: time left until the expected epochs are done ("-": unknown)."""
    progress = obj["progress"]
    if progress is None or progress["estimatedCompletion"] is None:
        return "-"
    return format_age(progress["estimatedCompletion"] - now)


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


MAX_CELL_CHARS = 80
"""The widest a table's cell is, but in its last column (which pads nothing): a job's name
is at most 63 characters, `herdjob/` and one 71; a longer value (a name some file
declared, a reason) is cut with an ellipsis rather than widen every row."""


def shorten(text: str, limit: int = MAX_CELL_CHARS) -> str:
    """``text``, or its first ``limit - 1`` characters and an ellipsis when it is longer."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    last = len(rows[0]) - 1
    rows = [[cell if i == last else shorten(cell) for i, cell in enumerate(row)] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def dash(value: object) -> str:
    return "-" if value is None else str(value)


def format_events(
    events: Sequence[Event], now: float, with_object: bool, *, header: bool = True
) -> str:
    titles = ["LAST SEEN", "TYPE", "REASON"] + (["OBJECT"] if with_object else []) + ["MESSAGE"]
    rows = [titles]
    for event in events:
        message = event.message + (f" (x{event.count})" if event.count > 1 else "")
        row = [format_age(now - event.last_time), event.type, event.reason]
        if with_object:
            row.append(f"herdjob/{event.job}" if event.job else "-")
        rows.append([*row, message])
    table = format_table(rows)
    # Aligned with the header either way, so that watched lines line up with the first ones.
    return table if header else table.split("\n", 1)[1] if len(rows) > 1 else ""


def job_has_ended(status: HerdJobStatus) -> bool:
    """The job will not run again by itself: it succeeded, failed, or its operator stopped
    it (a spec edit or a new operator starts it again)."""
    running = get_condition(status.conditions, ConditionType.Running)
    stopped = running is not None and running.reason == "OperatorStopped"
    return (
        stopped
        or is_true(status.conditions, ConditionType.Succeeded)
        or is_true(status.conditions, ConditionType.Failed)
    )


def rfc3339(seconds: float | None) -> str | None:
    """A Unix time as Kubernetes writes times: RFC 3339 in UTC, whole seconds ("...Z")."""
    if seconds is None:
        return None
    moment = datetime.fromtimestamp(seconds, UTC).replace(microsecond=0)
    return moment.isoformat().replace("+00:00", "Z")


def herdjob_resource(record: JobRecord, log_file: Path | None = None) -> dict[str, Any]:
    """One job as `get NAME -o yaml|json` shows it: a HerdJob object like kubectl's.

    `apiVersion`, `kind`, `metadata`, `spec` are what the user declared (plus the identity
    the operator gave it: uid, generation, creation time), so the object saved to a file
    is a spec again (the loader ignores `status` and those read-only fields); `status` is
    what the operator observed, times in RFC 3339.
    """
    status = record.status
    try:
        job, spec_error = record.spec, None
    except UnreadableSpecError as err:
        job, spec_error = None, str(err)
    metadata: dict[str, Any] = {
        "name": record.name,
        "uid": record.uid,
        "generation": record.generation,
        "creationTimestamp": rfc3339(record.created_at),
    }
    if job is not None and job.metadata.labels:
        metadata["labels"] = dict(job.metadata.labels)
    gpus = status.gpus
    shown_status: dict[str, Any] = {
        "observedGeneration": status.observed_generation,
        "conditions": [
            {
                **condition.model_dump(by_alias=True, mode="json"),
                "lastTransitionTime": rfc3339(condition.last_transition_time),
            }
            for condition in status.conditions
        ],
        "summary": status.summary(),
        "gpus": {
            "desired": gpus.desired if gpus else None,
            "allocated": gpus.allocated if gpus else 0,
            "active": gpus.active if gpus else None,
        },
        "placement": [
            {"host": host, "gpus": list(gpu_list)} for host, gpu_list in status.placement
        ],
        "epoch": status.epoch,
        "restarts": status.restarts,
        "preemptions": status.preemptions,
        "startedAt": rfc3339(status.started_at),
        "finishedAt": rfc3339(status.finished_at),
        "lastResizeAt": rfc3339(status.last_resize_at),
        "runStartedAt": rfc3339(status.run_started_at),
        "specFile": record.spec_path,
    }
    last_resize = _resize_view(status)
    if last_resize is not None:
        shown_status["lastResize"] = {
            **last_resize,
            "completedAt": rfc3339(last_resize["completedAt"]),
        }
    progress = _progress_view(job.spec if job is not None else None, status)
    if progress is not None:
        shown_status["progress"] = {
            **progress,
            "estimatedCompletion": rfc3339(progress["estimatedCompletion"]),
        }
    if status.metrics:
        shown_status["metrics"] = dict(status.metrics)
    if log_file is not None:
        shown_status["logFile"] = str(log_file)
    if spec_error is not None:
        shown_status["specError"] = spec_error
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": _spec_document(job.spec) if job is not None else None,
        "status": shown_status,
    }


def _spec_document(spec: HerdJobSpec) -> dict[str, Any]:
    """The spec as a file would say it: unset fields left out, and a horovod job's engine
    options are its `horovod` field already, so `engine` (which would say them twice) too."""
    document = spec.model_dump(mode="json", by_alias=True, exclude_none=True)
    # A policy's params are the policy's to read: a null there is a value, kept as given.
    document["policy"]["params"] = spec.model_dump(mode="json", by_alias=True)["policy"]["params"]
    if spec.engine.kind == HOROVOD_ENGINE:
        document.pop("engine", None)
    if not spec.gpus.share:  # the default, as a file leaves it out
        document["gpus"].pop("share", None)
    return document


def resource_list(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several objects as kubectl prints them: a `List`."""
    return {"apiVersion": "v1", "kind": "List", "items": list(items)}
