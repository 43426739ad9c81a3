"""What a simulation shows: a table per policy, and figures."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.simulate.results import SimResult


@dataclass(frozen=True)
class Summary:
    policy: str
    jobs: int
    unfinished: int
    mean_jct: float
    p99_jct: float
    mean_queueing: float
    makespan: float
    allocation: float
    """GPU-seconds allocated / (pool x makespan)."""
    memory: float
    """GPU memory used, integrated, / (pool x makespan)."""
    memory_of_allocated: float
    """GPU memory used / memory of the GPUs allocated."""
    resizes_per_job: float
    gpu_seconds: float
    decisions: int
    wall_seconds: float
    decide_seconds: float
    policy_seconds: float
    preemptions_per_job: float = 0.0
    """Under a queue that preempts (`policies/queueing.py`)."""


def percentile(values: Sequence[float], share: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def summarize(result: SimResult) -> Summary:
    jobs = result.jobs
    count = max(len(jobs), 1)
    start = min((job.arrival for job in jobs), default=0.0)
    end = max((job.finished for job in jobs), default=0.0)
    makespan = end - start
    capacity = result.pool_gpus * makespan
    gpu_seconds = sum(job.gpu_seconds for job in jobs)
    memory_seconds = sum(job.memory_seconds for job in jobs)
    return Summary(
        policy=result.policy,
        jobs=len(jobs),
        unfinished=len(result.unfinished),
        mean_jct=sum(job.completion for job in jobs) / count,
        p99_jct=percentile([job.completion for job in jobs], 0.99),
        mean_queueing=sum(job.queueing for job in jobs) / count,
        makespan=makespan,
        allocation=gpu_seconds / capacity if capacity else 0.0,
        memory=memory_seconds / capacity if capacity else 0.0,
        memory_of_allocated=memory_seconds / gpu_seconds if gpu_seconds else 0.0,
        resizes_per_job=sum(job.resizes for job in jobs) / count,
        gpu_seconds=gpu_seconds,
        decisions=result.decisions,
        wall_seconds=result.wall_seconds,
        decide_seconds=result.decide_seconds,
        policy_seconds=result.policy_seconds,
        preemptions_per_job=sum(job.preemptions for job in jobs) / count,
    )


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def table(summaries: Sequence[Summary]) -> str:
    """Markdown: one row per policy; JCT changes against the first row."""
    base = summaries[0].mean_jct if summaries else 0.0
    lines = [
        "| policy | jobs | mean JCT h | vs first | p99 JCT h | mean queueing h | makespan h"
        " | GPU allocation | memory used / pool | memory used / allocated | resizes per job"
        " | decisions | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        change = f"{(s.mean_jct / base - 1) * 100:+.1f}%" if base else "n/a"
        lines.append(
            f"| {s.policy} | {s.jobs} | {_hours(s.mean_jct)} | {change} | {_hours(s.p99_jct)}"
            f" | {_hours(s.mean_queueing)} | {_hours(s.makespan)} | {s.allocation:.1%}"
            f" | {s.memory:.1%} | {s.memory_of_allocated:.1%} | {s.resizes_per_job:.2f}"
            f" | {s.decisions} | {s.wall_seconds:.1f} |"
        )
    return "\n".join(lines) + "\n"


def write(results: Sequence[SimResult], output: Path, header: str) -> list[Path]:
    """Write summary.md, summary.json, jobs-POLICY.csv and the figures; return the paths."""
    output.mkdir(parents=True, exist_ok=True)
    summaries = [summarize(result) for result in results]
    written = []
    markdown = output / "summary.md"
    markdown.write_text(f"{header}\n\n{table(summaries)}")
    written.append(markdown)
    report = output / "summary.json"
    report.write_text(
        json.dumps({"header": header, "policies": [s.__dict__ for s in summaries]}, indent=2)
    )
    written.append(report)
    for result in results:
        path = output / f"jobs-{re.sub(r'[^A-Za-z0-9_.=-]', '_', result.policy)}.csv"
        rows = ["name,arrival,admitted,finished,requested,gpu_seconds,resizes,preemptions"]
        rows += [
            f"{j.name},{j.arrival:.3f},{j.admitted:.3f},{j.finished:.3f},{j.requested},"
            f"{j.gpu_seconds:.1f},{j.resizes},{j.preemptions}"
            for j in result.jobs
        ]
        path.write_text("\n".join(rows) + "\n")
        written.append(path)
    written += _figures(results, output)
    return written


def _figures(results: Sequence[SimResult], output: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    utilization = output / "utilization.png"
    figure, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for result in results:
        times = [t / 3600 for t, _, _ in result.timeline]
        axes[0].step(times, [a / result.pool_gpus for _, a, _ in result.timeline],
                     where="post", label=result.policy, linewidth=0.8)  # fmt: skip
        axes[1].step(times, [m / result.pool_gpus for _, _, m in result.timeline],
                     where="post", label=result.policy, linewidth=0.8)  # fmt: skip
    axes[0].set_ylabel("GPUs allocated / pool")
    axes[1].set_ylabel("GPU memory used / pool")
    axes[1].set_xlabel("hours")
    axes[0].legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(utilization, dpi=110)
    plt.close(figure)

    cdf = output / "jct-cdf.png"
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for result in results:
        values = sorted(job.completion / 3600 for job in result.jobs)
        if values:
            axis.step(values, [(i + 1) / len(values) for i in range(len(values))],
                      where="post", label=result.policy)  # fmt: skip
    axis.set_xscale("log")
    axis.set_xlabel("job completion time (hours, log)")
    axis.set_ylabel("share of jobs")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(cdf, dpi=110)
    plt.close(figure)
    return [utilization, cdf]
