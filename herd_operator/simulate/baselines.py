"""Two schedulers of Pollux's artifact, rebuilt from their descriptions: the check that this
simulator's jobs can be compared with the artifact's numbers (issue 31).

Pollux (OSDI'21) compares itself with Tiresias and Optimus+Oracle on eight Philly-derived
workloads. Neither is a policy of the operator, so they do not run through the allocator:
they are small round-based schedulers over the same `JobModel`s (work, Amdahl scaling,
arrival, asked size), run as the artifact runs its baselines:

- every `ROUND_SECONDS` (the artifact's scheduling interval) the scheduler gives each job
  that has arrived and not finished a number of GPUs; a job whose count changed (started,
  resized or preempted back in) makes no progress for `RESTART_SECONDS` (the artifact's
  restart penalty); a preempted job keeps its progress (it checkpoints);
- **Tiresias** (NSDI'19, two-dimensional least-attained-service with discretized priority
  queues): jobs run at their asked size; a job enters the first queue, and moves to the
  second once its attained service (time run x asked GPUs) reaches
  `TIRESIAS_THRESHOLD_GPU_SECONDS`; each round walks the first queue, then the second, each
  in order of entry, and runs every job that still fits (a job that does not is preempted
  or left waiting; smaller ones after it may run);
- **Optimus** with an oracle of the work left (EuroSys'18): every job gets one GPU, then
  each further GPU goes to the job whose remaining time it shortens most (marginal gain),
  up to the job's scaling limit.

Placement is not modelled (the job model's speed depends on the GPU count only), and the
decisions are pure functions of the jobs' state (`tiresias_sizes`, `optimus_sizes`).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass

from herd_operator.simulate.model import JobModel
from herd_operator.simulate.results import JobOutcome, SimResult

ROUND_SECONDS = 60.0
"""The artifact's scheduling interval."""
RESTART_SECONDS = 30.0
"""The artifact's stall after each change of a job's allocation (first start included)."""
TIRESIAS_THRESHOLD_GPU_SECONDS = 16 * 3600.0
"""The attained service (GPU-seconds) that moves a job to Tiresias's second queue: the
artifact's setting."""
BASELINES = ("tiresias", "optimus")


@dataclass
class BaselineJob:
    """One job's state under a baseline scheduler."""

    model: JobModel
    done: float = 0.0
    """Work done, in single-GPU seconds."""
    size: int = 0
    stall: float = 0.0
    """Seconds of restart left before it progresses again."""
    attained: float = 0.0
    """GPU-seconds held so far (Tiresias's attained service)."""
    queue: int = 0
    entered: float = 0.0
    """When it entered its current queue (Tiresias's order within a queue)."""
    started: float | None = None
    finished: float | None = None
    changes: int = 0
    gpu_seconds: float = 0.0
    memory_seconds: float = 0.0

    @property
    def left(self) -> float:
        return max(0.0, self.model.work - self.done)


def tiresias_sizes(jobs: Sequence[BaselineJob], pool_gpus: int) -> dict[str, int]:
    """Each job's GPUs this round: its asked size if it fits, walking the first queue and
    then the second, each in order of entry; else 0."""
    free = pool_gpus
    sizes: dict[str, int] = {}
    for job in sorted(jobs, key=lambda j: (j.queue, j.entered, j.model.arrival, j.model.name)):
        asked = min(job.model.requested, pool_gpus)
        if asked <= free:
            sizes[job.model.name] = asked
            free -= asked
        else:
            sizes[job.model.name] = 0
    return sizes


def optimus_sizes(
    jobs: Sequence[BaselineJob], pool_gpus: int, limits: dict[str, int]
) -> dict[str, int]:
    """One GPU each in order of arrival while GPUs last, then each further GPU to the job
    whose remaining time it cuts most, up to `limits[job]` GPUs."""
    ordered = sorted(jobs, key=lambda j: (j.model.arrival, j.model.name))
    sizes = {job.model.name: 0 for job in ordered}
    free = pool_gpus
    gains: list[tuple[float, int, str]] = []
    by_name = {job.model.name: job for job in ordered}

    def gain(job: BaselineJob, n: int) -> float:
        model = job.model
        return job.left / model.speedup(n) - job.left / model.speedup(n + 1)

    for order, job in enumerate(ordered):
        if not free:
            break
        name = job.model.name
        sizes[name] = 1
        free -= 1
        if limits.get(name, 1) > 1:
            heapq.heappush(gains, (-gain(job, 1), order, name))
    while free and gains:
        best, order, name = heapq.heappop(gains)
        if best >= 0:
            break  # no GPU shortens anyone's remaining time
        sizes[name] += 1
        free -= 1
        if sizes[name] < limits.get(name, 1):
            heapq.heappush(gains, (-gain(by_name[name], sizes[name]), order, name))
    return sizes


def run_baseline(
    name: str, models: Sequence[JobModel], pool_gpus: int, limits: dict[str, int] | None = None
) -> SimResult:
    """Run `models` under the baseline `name` (one of `BASELINES`) on `pool_gpus` GPUs.
    `limits`: Optimus's largest size per job (default: its `scale_limit`, else its asked
    size)."""
    if name not in BASELINES:
        raise ValueError(f"baseline {name!r}: expected one of {', '.join(BASELINES)}")
    began = time.perf_counter()
    limits = limits or {m.name: min(m.scale_limit or m.requested, pool_gpus) for m in models}
    waiting = sorted(models, key=lambda m: (m.arrival, m.name))
    jobs: list[BaselineJob] = []
    ended: list[BaselineJob] = []
    timeline: list[tuple[float, int, float]] = []
    now, rounds, next_arrival = 0.0, 0, 0
    while next_arrival < len(waiting) or jobs:
        while next_arrival < len(waiting) and waiting[next_arrival].arrival <= now:
            jobs.append(BaselineJob(waiting[next_arrival], entered=now))
            next_arrival += 1
        if jobs:
            _apply(jobs, _sizes(name, jobs, pool_gpus, limits), now)
            rounds += 1
            timeline.append(_usage(jobs, now))
        elif next_arrival < len(waiting):  # idle until the next arrival's round
            skip = (waiting[next_arrival].arrival - now) // ROUND_SECONDS
            now += max(0.0, skip) * ROUND_SECONDS
            if waiting[next_arrival].arrival <= now:
                continue
        for job in jobs:
            _advance(job, now, ROUND_SECONDS)
        now += ROUND_SECONDS
        ended += [j for j in jobs if j.finished is not None]
        jobs = [j for j in jobs if j.finished is None]
        if name == "tiresias":
            _demote(jobs, now)
    wall = time.perf_counter() - began
    ended.sort(key=lambda j: (j.model.arrival, j.model.name))
    outcomes = [_outcome(j, now) for j in ended]
    return SimResult(
        name, pool_gpus, outcomes, timeline, rounds, rounds, rounds, rounds, wall, wall, 0.0, []
    )


def _sizes(
    name: str, jobs: Sequence[BaselineJob], pool_gpus: int, limits: dict[str, int]
) -> dict[str, int]:
    if name == "tiresias":
        return tiresias_sizes(jobs, pool_gpus)
    return optimus_sizes(jobs, pool_gpus, limits)


def _outcome(job: BaselineJob, now: float) -> JobOutcome:
    model = job.model
    return JobOutcome(
        model.name,
        model.arrival,
        job.started if job.started is not None else model.arrival,
        job.finished if job.finished is not None else now,
        model.requested,
        job.gpu_seconds,
        job.memory_seconds,
        max(0, job.changes - 1),
    )


def _usage(jobs: Sequence[BaselineJob], now: float) -> tuple[float, int, float]:
    """A timeline point: GPUs allocated, and GPUs' worth of memory used."""
    memory = sum(j.size * j.model.memory_fraction(j.size) for j in jobs)
    return now, sum(j.size for j in jobs), memory


def _apply(jobs: Sequence[BaselineJob], sizes: dict[str, int], now: float) -> None:
    for job in jobs:
        size = sizes.get(job.model.name, 0)
        if size != job.size:
            job.size = size
            job.stall = RESTART_SECONDS if size else 0.0
            job.changes += 1 if size else 0
            if size and job.started is None:
                job.started = now


def _demote(jobs: Sequence[BaselineJob], now: float) -> None:
    """Tiresias: a job of the first queue whose attained service reached the threshold
    moves to the end of the second."""
    for job in jobs:
        if job.queue == 0 and job.attained >= TIRESIAS_THRESHOLD_GPU_SECONDS:
            job.queue, job.entered = 1, now


def _advance(job: BaselineJob, now: float, seconds: float) -> None:
    """`seconds` of the round starting at `now` pass for `job` at its size."""
    if not job.size:
        return
    stalled = min(job.stall, seconds)
    job.stall -= stalled
    rate = job.model.speedup(job.size)
    running = seconds - stalled
    used = min(running, job.left / rate) if rate else 0.0
    job.done += used * rate
    held = stalled + used
    job.attained += held * job.size
    job.gpu_seconds += held * job.size
    job.memory_seconds += held * job.size * job.model.memory_fraction(job.size)
    if job.left <= 1e-9:
        job.finished = now + held
        job.size = 0
