"""How the CLI shows what the store holds: the job object, tables, ages, events.

Shared by the commands, the report and the demo (which import it, never each other).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from controllers.ports import JobRecord
from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Event, Store, StoreError, UnreadableSpecError
from specs.models import HerdJobSpec

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def open_store(state_dir: Path) -> Store:
    path = StateLayout(state_dir).database
    if not path.exists():
        raise StoreError(
            f"no operator state in {state_dir} (run `herd-operator run --state-dir {state_dir}`"
            " first, or pass the --state-dir it used)"
        )
    return Store.open_readonly(path)


def job_object(record: JobRecord) -> dict[str, Any]:
    """The JSON shape of a job for `get -o json`: spec, status and identity.

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
        },
        "placement": {host: gpu_list for host, gpu_list in status.placement},
        "epoch": status.epoch,
        "restarts": status.restarts,
        "priority": spec.priority if spec else None,
        "policy": spec.policy.name if spec else None,
        "createdAt": record.created_at,
        "spec": spec.model_dump(mode="json", by_alias=True) if spec else None,
    }
    if spec_error is not None:
        shown["specError"] = spec_error
    return shown


def format_age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def dash(value: object) -> str:
    return "-" if value is None else str(value)


def format_events(events: Sequence[Event], now: float, with_object: bool) -> str:
    header = ["LAST SEEN", "TYPE", "REASON"] + (["OBJECT"] if with_object else []) + ["MESSAGE"]
    rows = [header]
    for event in events:
        message = event.message + (f" (x{event.count})" if event.count > 1 else "")
        row = [format_age(now - event.last_time), event.type, event.reason]
        if with_object:
            row.append(f"herdjob/{event.job}" if event.job else "-")
        rows.append([*row, message])
    return format_table(rows)
