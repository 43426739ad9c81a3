"""`herd-operator report --format json|csv`: the text summary's numbers for programs, as
`sacct --json` and `sacct --parsable2` give Slurm's.

The JSON is one object of a stable shape (docs/observability.md documents it; a field is
added, never renamed or removed, within one `version`); each number's unit is in its name
(`gpuSeconds`, `pendingSeconds`). The CSV is the per-job table with a header row. Both come
from the same `RunData` as the text, through the same `JobSeries` methods, unrounded: the
text's cells are these numbers formatted.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from herd_operator.cli.report.series import JobSeries, RunData
from herd_operator.cli.report.shares import SharedSpan
from herd_operator.cli.views import rfc3339

REPORT_KIND = "HerdReport"
REPORT_VERSION = 1
"""Bumped only when a field changes meaning or goes away (adding one does not)."""

CSV_COLUMNS = (
    "job",
    "status",
    "policy",
    "min_gpus",
    "max_gpus",
    "gpu_seconds",
    "epochs",
    "resizes",
    "pending_seconds",
    "shared_with",
    "shared_memory_bytes",
)
"""``shared_with``: the jobs that shared a GPU with it (``;`` between them, empty if none);
``shared_memory_bytes``: the most one of its workers was counted for on a shared GPU."""


def _job(job: JobSeries, end: float) -> dict[str, Any]:
    return {
        "name": job.name,
        "status": job.status,
        "policy": job.policy,
        "minGpus": job.min_gpus,
        "maxGpus": job.max_gpus,
        "gpuSeconds": job.gpu_seconds(end),
        "epochs": job.epochs(),
        "resizes": job.resizes(),
        "pendingSeconds": job.pending_seconds(end),
        # None: the whole grant history is kept; else run seconds up to which it was trimmed.
        "historyTrimmedThroughSeconds": job.trimmed_through,
    }


def _shared_gpu(span: SharedSpan) -> dict[str, Any]:
    return {
        "gpu": span.gpu,
        "fromOffsetSeconds": span.start,
        "toOffsetSeconds": span.end,
        # 0: the job's memory was not known (adopted by a restarted operator, not asked yet).
        "jobs": [{"job": job, "memoryBytes": count} for job, count in span.jobs],
    }


def _sharing(run: RunData, name: str) -> tuple[str, int | None]:
    """The CSV's ``shared_with`` and ``shared_memory_bytes`` of job ``name``."""
    spans = [span for span in run.shared if name in dict(span.jobs)]
    others = sorted({job for span in spans for job, _ in span.jobs} - {name})
    counted = max((dict(span.jobs)[name] for span in spans), default=None)
    return ";".join(others), counted


def report_object(run: RunData) -> dict[str, Any]:
    """The run as the JSON report's object: what the text summary says, unrounded."""
    changes = sorted(
        ((step, job.name) for job in run.jobs for step in job.grants), key=lambda c: c[0].time
    )
    return {
        "kind": REPORT_KIND,
        "version": REPORT_VERSION,
        "stateDir": str(run.state_dir),
        "start": rfc3339(run.origin),
        "startUnixSeconds": run.origin,
        "durationSeconds": run.end,
        "poolGpus": run.pool_max,
        "poolInferred": run.pool_inferred,
        "jobs": [_job(job, run.end) for job in run.jobs],
        "grantChanges": [
            {
                "offsetSeconds": step.time,
                "job": name,
                "gpusBefore": step.before,
                "gpusAfter": step.after,
                "reason": step.reason,
            }
            for step, name in changes
        ],
        "sharedGpus": [_shared_gpu(span) for span in run.shared],
    }


def format_json(run: RunData) -> str:
    return json.dumps(report_object(run), indent=2) + "\n"


def format_csv(run: RunData) -> str:
    """One row per job under a header row, quoted where needed (RFC 4180, with Unix line ends,
    as `cut`, `awk` and `sacct -P` users expect); an unknown value (a deleted job's GPU
    range) is an empty cell."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for job in report_object(run)["jobs"]:
        row = [
            job["name"],
            job["status"],
            job["policy"],
            job["minGpus"],
            job["maxGpus"],
            job["gpuSeconds"],
            job["epochs"],
            job["resizes"],
            job["pendingSeconds"],
            *_sharing(run, job["name"]),
        ]
        writer.writerow(["" if value is None else value for value in row])
    return out.getvalue()
