"""Replay a recorded run of the operator in the simulator, and compare the two timelines.

The store of a run holds each job's spec (GPU range, priority, policy), when it was declared,
its workers' epoch-end reports (time and world size), every grant change and when it
finished. From the reports this module derives each job's model: the epoch time at each
size it ran at, Amdahl's serial share fitted on them
(`herd_operator.policies.goodput.fit_serial`; with one size only, a prior), hence its work in
single-GPU seconds. The simulator then runs those jobs,
arriving when they were declared, on a pool of the recorded size, under the recorded policy,
and the grant timelines and completion times are compared: what the simulator's job model
(Amdahl, the measured resize stalls) gets right or wrong about a real Horovod job under the
operator.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from herd_operator.policies.goodput import fit_serial, rates_by_size, speedup
from herd_operator.runtime.store import Store
from herd_operator.simulate.config import SimConfig
from herd_operator.simulate.engine import Simulation
from herd_operator.simulate.model import JobModel
from herd_operator.specs import PolicyRef
from herd_operator.specs.values import Pool, Report

PRIOR_SERIAL = 0.05
"""The serial share of a job that ran at one size only (its scaling was not measured)."""
MEMORY_FIXED, MEMORY_BATCH = 0.05, 0.05
"""A replayed job's GPU memory (not recorded per GPU in a virtual run; no policy here reads
it unless the run's policy is `memory`)."""

Timeline = tuple[tuple[float, int], ...]
"""(seconds since the run's first job was declared, GPUs granted from then on)."""


@dataclass(frozen=True)
class RecordedJob:
    name: str
    arrival: float
    """Seconds after the run's first job was declared."""
    finished: float | None
    min_gpus: int
    max_gpus: int
    priority: int
    policy: PolicyRef
    epochs: tuple[Report, ...]
    """One report per epoch end (the first worker's), times since the first arrival."""
    grants: Timeline


@dataclass(frozen=True)
class RecordedRun:
    pool_gpus: int
    jobs: tuple[RecordedJob, ...]


def read_store(path: Path) -> RecordedRun:
    """A run as its store recorded it; ValueError if it has no job or no pool size."""
    store = Store.open_readonly(path)
    try:
        records = store.list_jobs()
        if not records:
            raise ValueError(f"store {path}: no job recorded")
        sizes = store.pool_sizes()
        if not sizes:
            raise ValueError(f"store {path}: no pool size recorded")
        start = min(record.created_at for record in records)
        jobs = []
        for record in records:
            spec = record.spec.spec
            by_epoch: dict[int, Report] = {}
            for report in store.reports(record.name, limit=100_000):
                if report.epoch is not None and report.epoch not in by_epoch:
                    by_epoch[report.epoch] = Report(
                        report.epoch, report.time - start, report.world_size
                    )
            grants = tuple(
                (change.time - start, change.gpus) for change in store.grant_history(record.name)
            )
            finished = record.status.finished_at
            jobs.append(
                RecordedJob(
                    name=record.name,
                    arrival=record.created_at - start,
                    finished=None if finished is None else finished - start,
                    min_gpus=spec.gpus.min,
                    max_gpus=spec.gpus.max,
                    priority=spec.priority,
                    policy=spec.policy,
                    epochs=tuple(by_epoch[epoch] for epoch in sorted(by_epoch)),
                    grants=grants,
                )
            )
        return RecordedRun(max(gpus for _, gpus in sizes), tuple(jobs))
    finally:
        store.close()


def _scaling(job: RecordedJob) -> tuple[float, float]:
    """The job's serial share and its epoch time on one GPU, from its epoch times."""
    rates = rates_by_size(job.epochs, "throughput")
    if not rates:
        raise ValueError(
            f"job {job.name}: fewer than two epochs at one size recorded: its speed is unknown"
        )
    fitted = fit_serial(rates)
    serial = PRIOR_SERIAL if fitted is None else fitted
    # Epoch time on n GPUs = one-GPU epoch time / speedup(n): each size gives an estimate.
    one_gpu_epoch = statistics.median(
        speedup(serial, size) / statistics.median(values) for size, values in rates.items()
    )
    return serial, one_gpu_epoch


@dataclass(frozen=True)
class MeasuredStall:
    """How long a recorded job made no progress after a grant change."""

    job: str
    kind: str
    """`start` (its first launch), `grow` or `shrink`."""
    old: int
    new: int
    seconds: float


def measured_stalls(job: RecordedJob) -> list[MeasuredStall]:
    """The stall of the job's first launch and of each resize, from its epoch ends.

    First launch: first grant to the first epoch end, less one epoch at that size. A resize
    at t: q is the first epoch end at the new size, p the epoch end before it; from
    max(t, p), the share of that epoch done at the old size by t is kept (the workers commit
    every few batches), so the stall is q - max(t, p) less the rest of the epoch at the new
    size. A resize with another one before q, or no epoch end before q, is left out: its
    stall cannot be told apart."""
    serial, one_gpu_epoch = _scaling(job)

    def epoch_at(size: int) -> float:
        return one_gpu_epoch / speedup(serial, size)

    stalls: list[MeasuredStall] = []
    first_grant = next(((when, gpus) for when, gpus in job.grants if gpus > 0), None)
    if first_grant is not None and job.epochs:
        first = job.epochs[0]
        seconds = first.time - first_grant[0] - epoch_at(first.world_size)
        stalls.append(MeasuredStall(job.name, "start", 0, first_grant[1], max(0.0, seconds)))
    changes = [(when, gpus) for when, gpus in job.grants]
    for index, ((_, old), (when, new)) in enumerate(itertools.pairwise(changes), start=1):
        if not 0 < old != new > 0:
            continue
        later = changes[index + 1][0] if index + 1 < len(changes) else float("inf")
        # The workers may end an epoch at the old size after the grant changed (they see
        # the change at their next commit): the first epoch at the new size is the one.
        after = next((r for r in job.epochs if r.time > when and r.world_size == new), None)
        before = [r for r in job.epochs if after is not None and r.time < after.time]
        if not before or after is None or after.time >= later:
            continue
        begun = max(when, before[-1].time)
        done = min(1.0, max(0.0, (begun - before[-1].time) / epoch_at(old)))
        seconds = after.time - begun - (1.0 - done) * epoch_at(new)
        kind = "grow" if new > old else "shrink"
        stalls.append(MeasuredStall(job.name, kind, old, new, max(0.0, seconds)))
    return stalls


def job_model(job: RecordedJob, *, measured_start: bool = True) -> JobModel:
    """The simulator's model of a recorded job, from its epoch times at each size.

    `measured_start`: the job's launch takes what it took in the record (its first grant to
    its first epoch end, less one epoch at that size) instead of the simulator's constant."""
    serial, one_gpu_epoch = _scaling(job)
    epochs = len(job.epochs)
    start_seconds = None
    if measured_start:
        start = next((s for s in measured_stalls(job) if s.kind == "start"), None)
        start_seconds = None if start is None else start.seconds
    return JobModel(
        name=job.name,
        arrival=job.arrival,
        requested=job.max_gpus,
        min_gpus=job.min_gpus,
        max_gpus=job.max_gpus,
        work=one_gpu_epoch * epochs,
        epochs=epochs,
        serial_fraction=serial,
        mem_fixed=MEMORY_FIXED,
        mem_batch=MEMORY_BATCH,
        priority=job.priority,
        start_seconds=start_seconds,
    )


@dataclass(frozen=True)
class JobComparison:
    name: str
    real_end: float
    """From arrival to the last epoch's end (the work done)."""
    teardown: float
    """From the last epoch's end to the job's recorded finish (not simulated)."""
    simulated_end: float
    real_grants: Timeline
    simulated_grants: Timeline
    size_agreement: float
    """Share of the time from arrival to the later end during which both grant the same."""

    @property
    def end_error(self) -> float:
        """(simulated - real) completion, relative to the real time from arrival to end."""
        return (self.simulated_end - self.real_end) / self.real_end


def size_at(timeline: Timeline, at: float) -> int:
    size = 0
    for when, gpus in timeline:
        if when > at:
            break
        size = gpus
    return size


def agreement(real: Timeline, simulated: Timeline, start: float, end: float) -> float:
    """Share of [start, end] during which both timelines grant the same number of GPUs."""
    if end <= start:
        return 1.0
    cuts = sorted({start, end, *(t for t, _ in real), *(t for t, _ in simulated)})
    cuts = [t for t in cuts if start <= t <= end]
    same = sum(
        right - left
        for left, right in itertools.pairwise(cuts)
        if size_at(real, left) == size_at(simulated, left)
    )
    return same / (end - start)


def replay(
    run: RecordedRun, *, min_resize_interval: float, measured_start: bool = True, tick: float = 0.0
) -> list[JobComparison]:
    """Simulate the recorded jobs and compare each one's grants and completion."""
    policy = run.jobs[0].policy
    if any(job.policy != policy for job in run.jobs):
        names = ", ".join(f"{job.name}: {job.policy.name}" for job in run.jobs)
        raise ValueError(f"the simulator runs one policy for all jobs; this run has {names}")
    unfinished = [job.name for job in run.jobs if job.finished is None]
    if unfinished:
        raise ValueError(f"jobs not finished in the recorded run: {', '.join(unfinished)}")
    models = [job_model(job, measured_start=measured_start) for job in run.jobs]
    config = SimConfig(
        Pool.from_counts({"localhost": run.pool_gpus}),
        policy,
        tick=tick,
        min_resize_interval=min_resize_interval,
        record=True,
    )
    result = Simulation(models, config).run()
    simulated: dict[str, list[tuple[float, int]]] = {job.name: [] for job in run.jobs}
    for at, _, placements in result.steps:
        for name, timeline in simulated.items():
            size = placements[name].size if name in placements else 0
            if (timeline[-1][1] if timeline else 0) != size:
                timeline.append((at, size))
    ends = {outcome.name: outcome.finished for outcome in result.jobs}
    comparisons = []
    for job in run.jobs:
        assert job.finished is not None
        real_end = job.epochs[-1].time - job.arrival
        simulated_end = ends[job.name] - job.arrival
        # The real grant lasts until the processes are gone; the simulated one until the
        # last epoch: compare the grants up to the end of the work.
        real_grants = tuple((when, gpus) for when, gpus in job.grants if when < job.epochs[-1].time)
        comparisons.append(
            JobComparison(
                name=job.name,
                real_end=real_end,
                teardown=job.finished - job.epochs[-1].time,
                simulated_end=simulated_end,
                real_grants=real_grants,
                simulated_grants=tuple(simulated[job.name][:-1]),
                size_agreement=agreement(
                    real_grants,
                    tuple(simulated[job.name][:-1]),
                    job.arrival,
                    job.arrival + min(real_end, simulated_end),
                ),
            )
        )
    return comparisons


def describe_stalls(stalls: Sequence[MeasuredStall]) -> str:
    """A markdown table of the measured launches and resizes."""
    lines = ["| job | what | GPUs | stall s |", "|---|---|---|---|"]
    lines += [f"| {s.job} | {s.kind} | {s.old} -> {s.new} | {s.seconds:.1f} |" for s in stalls]
    return "\n".join(lines)


def describe(comparisons: Sequence[JobComparison], arrivals: dict[str, float]) -> str:
    """A markdown table of the comparison, times in seconds since each job's arrival."""

    def steps(timeline: Timeline, arrival: float) -> str:
        return ", ".join(f"{gpus}@{when - arrival:.0f}" for when, gpus in timeline) or "-"

    lines = [
        "| job | real last epoch s | simulated s | error | then exit s |"
        " same grant, share of time | real grants (GPUs@s) | simulated grants (GPUs@s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        arrival = arrivals[c.name]
        lines.append(
            f"| {c.name} | {c.real_end:.1f} | {c.simulated_end:.1f} | {c.end_error:+.1%} |"
            f" {c.teardown:.1f} |"
            f" {c.size_agreement:.0%} | {steps(c.real_grants, arrival)} |"
            f" {steps(c.simulated_grants, arrival)} |"
        )
    return "\n".join(lines)
