"""What co-location did, per policy: the figures the issue asks for (mean and p99 JCT, GPU-hours
of GPUs holding a job, memory used over memory of those GPUs, and how much neighbours slowed
each job).

Apart from `report.py`, whose table counts each job's GPUs as its own (right for exclusive
GPUs, twice for a GPU two jobs share): here the GPUs are counted from the timeline, which
under `pack` holds the GPUs occupied by at least one job.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from herd_operator.simulate.colocation import SLOWDOWN_LIMIT
from herd_operator.simulate.report import percentile
from herd_operator.simulate.results import SimResult


@dataclass(frozen=True)
class ShareSummary:
    policy: str
    jobs: int
    mean_jct: float
    p99_jct: float
    gpu_hours: float
    """GPU-hours of GPUs holding at least one job (the timeline's integral)."""
    memory_of_allocated: float
    """GPU memory used over the memory of those GPUs."""
    slowed_jobs: int
    """Jobs whose run took more than `SLOWDOWN_LIMIT` times what it would have alone."""
    worst_interference: float
    """The largest ratio, over jobs, of working time to working time alone."""
    worst_slowdown: float
    """The largest slowdown any job ran at, at any instant."""


def timeline_integrals(result: SimResult) -> tuple[float, float]:
    """(GPU-seconds allocated, GPU-seconds' worth of memory used) over the run: each timeline
    point holds until the next."""
    gpus = memory = 0.0
    points = result.timeline
    for (start, allocated, used), (end, _, _) in itertools.pairwise(points):
        gpus += allocated * (end - start)
        memory += used * (end - start)
    return gpus, memory


def summarize_sharing(result: SimResult) -> ShareSummary:
    jobs = result.jobs
    completions = [job.completion for job in jobs]
    gpu_seconds, memory_seconds = timeline_integrals(result)
    return ShareSummary(
        policy=result.policy,
        jobs=len(jobs),
        mean_jct=sum(completions) / max(len(jobs), 1),
        p99_jct=percentile(completions, 0.99),
        gpu_hours=gpu_seconds / 3600,
        memory_of_allocated=memory_seconds / gpu_seconds if gpu_seconds else 0.0,
        slowed_jobs=sum(1 for job in jobs if job.interference > SLOWDOWN_LIMIT),
        worst_interference=max((job.interference for job in jobs), default=1.0),
        worst_slowdown=max((job.max_slowdown for job in jobs), default=1.0),
    )


def sharing_table(results: Sequence[SimResult]) -> str:
    """Markdown: one row per policy; mean JCT against the first row."""
    summaries = [summarize_sharing(result) for result in results]
    base = summaries[0].mean_jct if summaries else 0.0
    lines = [
        "| policy | jobs | mean JCT h | vs first | p99 JCT h | GPU-hours | memory used /"
        f" allocated | jobs slowed > {SLOWDOWN_LIMIT - 1:.0%} | worst job's slowdown"
        " | worst instant |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        change = f"{(s.mean_jct / base - 1) * 100:+.1f}%" if base else "n/a"
        lines.append(
            f"| {s.policy} | {s.jobs} | {s.mean_jct / 3600:.2f} | {change}"
            f" | {s.p99_jct / 3600:.2f} | {s.gpu_hours:,.0f} | {s.memory_of_allocated:.1%}"
            f" | {s.slowed_jobs} | {s.worst_interference:.2f} | {s.worst_slowdown:.2f} |"
        )
    return "\n".join(lines) + "\n"
