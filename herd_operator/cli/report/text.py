"""`herd-operator report --format text` (or an --output named .txt or .md): the run as a
table per job (GPU-seconds held, epochs, resizes, time pending) and the log of grant
changes, plain or in Markdown.

Apart from the figure: it needs no matplotlib, so it works where that is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from herd_operator.cli.report.series import RunData
from herd_operator.cli.views import format_table


def _table(rows: Sequence[Sequence[str]], markdown: bool) -> list[str]:
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in rows]
        return [lines[0], "|" + "---|" * len(rows[0]), *lines[1:]]
    return format_table(rows).splitlines()


def format_duration(seconds: float) -> str:
    """`45s`, `2m05s`, `3h02m`: exact enough to compare jobs, short enough for a table."""
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def format_summary(run: RunData, markdown: bool = False) -> str:
    """Per job: status, GPU-seconds held, epochs, resizes, time pending; then the grant log."""
    started = datetime.fromtimestamp(run.origin, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    headline = (
        f"Run in {run.state_dir}: {len(run.jobs)} job{'s' if len(run.jobs) != 1 else ''},"
        f" {format_duration(run.end)} from {started}"
    )
    rows = [["JOB", "STATUS", "POLICY", "GPUS", "GPU-SECONDS", "EPOCHS", "RESIZES", "PENDING"]]
    rows += [
        [
            job.name,
            job.status,
            job.policy,
            job.gpus_range,
            f"{job.gpu_seconds(run.end):.0f}",
            str(job.epochs()),
            str(job.resizes()),
            format_duration(job.pending_seconds(run.end)),
        ]
        for job in run.jobs
    ]
    changes = sorted(
        ((step, job.name) for job in run.jobs for step in job.grants), key=lambda c: c[0].time
    )
    log_rows = [["TIME", "JOB", "GPUS", "REASON"]] + [
        [format_duration(step.time), name, step.label, step.reason] for step, name in changes
    ]
    trimmed = [job for job in run.jobs if job.trimmed_through is not None]
    if trimmed:
        # Said, not hidden: the GPU-seconds above count only the kept changes.
        headline += (
            "\nGrant history trimmed by the store's bound (run --grant-history-per-job) for "
            + ", ".join(
                f"{job.name} (up to {format_duration(max(0.0, job.trimmed_through or 0.0))})"
                for job in trimmed
            )
            + ": their GPU-seconds count only the changes kept."
        )
    if markdown:
        lines = ["# herd-operator report", "", headline, "", *_table(rows, True), ""]
        lines += ["## Grant changes", ""]
        lines += _table(log_rows, True) if changes else ["none"]
    else:
        lines = [headline, "", *_table(rows, False), ""]
        lines += ["Grant changes:" + ("" if changes else " none")]
        lines += ["  " + line for line in _table(log_rows, False)] if changes else []
    return "\n".join(lines + _shared_lines(run, markdown)) + "\n"


def _shared_lines(run: RunData, markdown: bool) -> list[str]:
    """The GPUs that held several jobs, when, and the memory each job's worker there was
    counted for (nothing when none did, or the store predates the log: schema 6)."""
    if not run.shared:
        return []
    rows = [["GPU", "FROM", "TO", "JOBS (MEMORY COUNTED PER WORKER)"]] + [
        [span.gpu, format_duration(span.start), format_duration(span.end), span.label()]
        for span in run.shared
    ]
    if markdown:
        return ["", "## Shared GPUs", "", *_table(rows, True)]
    return ["", "Shared GPUs:", *("  " + line for line in _table(rows, False))]
