"""The series `herd-operator report` shows, read from the state store: what each job was
granted, reported and used, in seconds since the run's first record.

The store is read once into a ``RunData`` of plain series; the figure and the text are
pure functions of it (`figure_data`, `figure`, `text`), so this is the one module of the
report that reads the store.

GPU-seconds integrate the grant history. The operator logs a drop to 0 GPUs for every end
(succeeded, failed, stopped, deleted); a store written before it did ends a job's grant at
its terminal status time instead (``finished_at``, the shutdown's ``Running=False``, the
``Deleted`` event), so old runs are not counted as holding GPUs they had given back. Jobs
whose spec was deleted are kept: their grant history and events outlive them (their
reports and memory samples do not).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from herd_operator.cli.report.shares import SharedSpan, shared_spans
from herd_operator.policies.memory import MemoryParams
from herd_operator.runtime.store import (
    MAX_EVENTS,
    MAX_REPORTS_PER_JOB,
    Store,
    StoreError,
    TrimmedHistory,
)
from herd_operator.runtime.store import Event as StoredEvent
from herd_operator.runtime.store import GrantChange as StoredGrantChange
from herd_operator.specs import ConditionType, PolicyRef, get_condition
from herd_operator.specs.records import JobRecord
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Report, UsageSample

DELETED = "Deleted"


@dataclass(frozen=True)
class GrantStep:
    """A change of a job's granted GPU count, ``time`` in run seconds."""

    time: float
    before: int
    after: int
    reason: str

    @property
    def label(self) -> str:
        return f"{self.before}->{self.after}"

    @property
    def is_resize(self) -> bool:
        """A running job changed size (not an admission or a release)."""
        return self.before > 0 and self.after > 0


@dataclass(frozen=True)
class JobSeries:
    """One job's series over the report window, times in run seconds."""

    name: str
    status: str
    policy: str
    min_gpus: int | None
    """None when the spec is gone (a deleted job) or unreadable."""
    max_gpus: int | None
    created: float
    initial_gpus: int
    """Granted GPUs at the window's start (0 unless the job started before it)."""
    grants: tuple[GrantStep, ...]
    world_sizes: tuple[tuple[float, int], ...]
    """(time, world size) where the reported world size changed."""
    epoch_ends: tuple[tuple[float, int], ...]
    """(time, epoch) of each epoch end; repeats of one epoch by several ranks count once."""
    memory: tuple[tuple[float, float], ...]
    """(time, used/total) of the job's GPUs."""
    thresholds: tuple[float, float] | None
    """(low, high) of the memory policy, None for other policies."""
    trimmed_through: float | None = None
    """Run seconds of the newest grant change the store's bound dropped (None: the job's
    log is whole): before it, the grants shown are not what the job held."""

    def gpu_seconds(self, end: float) -> float:
        """GPUs granted, integrated over the window up to ``end``."""
        total, level, since = 0.0, self.initial_gpus, 0.0
        for step in self.grants:
            if step.time >= end:
                break
            total += level * (step.time - since)
            level, since = step.after, step.time
        return total + level * max(0.0, end - since)

    def granted_at(self, when: float) -> int:
        """GPUs granted at ``when`` (after the changes made at that very time)."""
        level = self.initial_gpus
        for step in self.grants:
            if step.time > when:
                break
            level = step.after
        return level

    def pending_seconds(self, end: float) -> float:
        """From the job's creation (or the window's start) to its first grant, or to ``end``."""
        if self.initial_gpus > 0:
            return 0.0
        granted = next((step.time for step in self.grants if step.after > 0), end)
        return max(0.0, granted - max(self.created, 0.0))

    def epochs(self) -> int:
        return len({epoch for _, epoch in self.epoch_ends})

    def resizes(self) -> int:
        return sum(step.is_resize for step in self.grants)

    @property
    def gpus_range(self) -> str:
        if self.min_gpus is None or self.max_gpus is None:
            return "-"
        return f"{self.min_gpus}-{self.max_gpus}"


@dataclass(frozen=True)
class RunData:
    """What the report shows: every selected job's series over one window."""

    state_dir: Path
    origin: float
    """Unix time of run second 0: the first record, or the window's start if later."""
    end: float
    """Run seconds of the last record."""
    jobs: tuple[JobSeries, ...]
    pool: tuple[tuple[float, int], ...]
    """(run seconds, GPUs in the pool) from each change on; the first at time 0."""
    pool_inferred: bool = False
    """The store did not log the pool's size (written by an older operator): ``pool`` is
    the most GPUs the jobs held at once."""
    shared: tuple[SharedSpan, ...] = ()
    """When a GPU held several of the jobs' workers, and each one's memory (none for a
    store from before the log of shared GPUs, schema 6)."""

    def pool_at(self, when: float) -> int:
        size = self.pool[0][1] if self.pool else 0
        for at, gpus in self.pool:
            if at > when:
                break
            size = gpus
        return size

    @property
    def pool_max(self) -> int:
        return max((gpus for _, gpus in self.pool), default=0)


# ---- reading ----


@dataclass(frozen=True)
class JobSource:
    """What the store holds of one job: its record, or for a deleted job only the logs."""

    name: str
    record: JobRecord | None
    grants: tuple[StoredGrantChange, ...]
    events: tuple[StoredEvent, ...]
    trimmed: TrimmedHistory | None = None
    """What the store's bound dropped of the job's grant history (None: nothing)."""


def end_time(source: JobSource) -> tuple[float, str] | None:
    """When the job last ended (unix time) and how, from its status or its events.

    None while it runs or waits. For a finished job, ``finished_at``; for one the operator
    stopped on its way out, the ``Running=False OperatorStopped`` transition; for a deleted
    job, its ``Deleted`` event.
    """
    if source.record is None:
        deleted = [event.time for event in source.events if event.reason == "Deleted"]
        return (deleted[-1], "spec deleted") if deleted else None
    status: HerdJobStatus = source.record.status
    for condition_type, how in (
        (ConditionType.Succeeded, "job succeeded"),
        (ConditionType.Failed, "job failed"),
    ):
        condition = get_condition(status.conditions, condition_type)
        if condition is not None and condition.status == "True":
            finished = status.finished_at
            return (finished if finished is not None else condition.last_transition_time), how
    running = get_condition(status.conditions, ConditionType.Running)
    if running is not None and running.status == "False" and running.reason == "OperatorStopped":
        return running.last_transition_time, "operator shut down"
    return None


def grant_levels(source: JobSource) -> list[tuple[float, int, str]]:
    """(unix time, GPUs, reason) of the job's grant changes, ended where the job ended.

    The end is added only where the log lacks it (a store of an older operator, whose log
    does not end at 0). Where it has it, the log's own drop stands even when it came after
    the end time: `finished_at` is when the process ended, and the GPUs were held until
    the reconcile that saw it gave them back.
    """
    changes = [(change.time, change.gpus, change.reason) for change in source.grants]
    ended = end_time(source)
    if ended is not None and (not changes or changes[-1][1] > 0):
        at, how = ended
        level = 0
        for time_, gpus, _ in changes:
            if time_ > at:
                break
            level = gpus
        if level > 0:
            changes.append((at, 0, f"{how} (from the job's status)"))
            changes.sort(key=lambda change: change[0])  # stable: rows at one time keep order
    return changes


def job_series(
    source: JobSource,
    reports: Sequence[Report],
    usage: Sequence[UsageSample],
    origin: float,
) -> JobSeries:
    """One job's series relative to ``origin``; records before it only set the starting grant."""
    initial, steps = _grant_steps(grant_levels(source), origin)
    world_sizes, epoch_ends = _reported(reports, origin)
    memory = [
        (sample.time - origin, sample.used_bytes / sample.total_bytes)
        for sample in usage
        if sample.time >= origin and sample.total_bytes > 0
    ]
    spec = _spec_view(source)
    return JobSeries(
        name=source.name,
        status=spec.status,
        policy=spec.policy,
        min_gpus=spec.min_gpus,
        max_gpus=spec.max_gpus,
        created=spec.created - origin,
        initial_gpus=initial,
        grants=tuple(steps),
        world_sizes=tuple(world_sizes),
        epoch_ends=tuple(epoch_ends),
        memory=tuple(memory),
        thresholds=spec.thresholds,
        trimmed_through=None if source.trimmed is None else source.trimmed.through - origin,
    )


def _grant_steps(
    changes: Sequence[tuple[float, int, str]], origin: float
) -> tuple[int, list[GrantStep]]:
    """The grant at ``origin`` and each change of it from then on, in run seconds."""
    earlier = [gpus for time_, gpus, _ in changes if time_ < origin]
    initial = level = earlier[-1] if earlier else 0
    steps: list[GrantStep] = []
    for time_, gpus, reason in changes:
        if time_ >= origin and gpus != level:
            steps.append(GrantStep(time_ - origin, level, gpus, reason))
            level = gpus
    return initial, steps


def _reported(
    reports: Sequence[Report], origin: float
) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """(time, world size) where the reported size changed, and (time, epoch) of each epoch
    end, from ``origin`` on."""
    world_sizes: list[tuple[float, int]] = []
    epoch_ends: list[tuple[float, int]] = []
    for report in reports:
        if report.time < origin:
            continue
        if not world_sizes or world_sizes[-1][1] != report.world_size:
            world_sizes.append((report.time - origin, report.world_size))
        if report.epoch is not None and (not epoch_ends or epoch_ends[-1][1] != report.epoch):
            epoch_ends.append((report.time - origin, report.epoch))
    return world_sizes, epoch_ends


@dataclass(frozen=True)
class _SpecView:
    """What a job's series shows of its record and spec (unix times)."""

    status: str
    created: float
    policy: str = "-"
    min_gpus: int | None = None
    max_gpus: int | None = None
    thresholds: tuple[float, float] | None = None


def _spec_view(source: JobSource) -> _SpecView:
    """A deleted job shows as such, created at its first record; a job whose stored spec is
    unreadable shows without its spec."""
    record = source.record
    if record is None:
        created = min(
            [change.time for change in source.grants] + [event.time for event in source.events]
        )
        return _SpecView(DELETED, created)
    status, created = record.status.summary(), record.created_at
    try:
        spec = record.spec.spec
    except StoreError:  # an unreadable stored spec: show the job without it
        return _SpecView(status, created)
    return _SpecView(
        status,
        created,
        spec.policy.name,
        spec.gpus.min,
        spec.gpus.max,
        memory_thresholds(spec.policy),
    )


def memory_thresholds(policy: PolicyRef) -> tuple[float, float] | None:
    """(low, high) for a job under the memory policy, with the policy's own defaults."""
    if policy.name != "memory":
        return None
    try:
        params = MemoryParams.model_validate(policy.params)
    except ValidationError:
        return None  # the reconciler already reports bad parameters; draw no lines for them
    return params.low, params.high


def job_sources(
    store: Store, history: Sequence[StoredGrantChange] | None = None
) -> list[JobSource]:
    """Every job the store knows, by name: those with a record, and deleted ones (whose
    grant history or events outlive them). ``history``: the grant history read already
    (``store.read_grant_history()``, which says what it skipped), else read here."""
    records = {record.name: record for record in store.list_jobs()}
    grants: dict[str, list[StoredGrantChange]] = {}
    for change in store.grant_history() if history is None else history:
        grants.setdefault(change.job, []).append(change)
    events: dict[str, list[StoredEvent]] = {}
    for event in store.events(limit=MAX_EVENTS):
        if event.job is not None:
            events.setdefault(event.job, []).append(event)
    # A deleted job is one that once held GPUs (a job deleted while pending never ran).
    names = sorted(set(records) | set(grants))
    trimmed = store.trimmed_history()
    return [
        JobSource(
            name,
            records.get(name),
            tuple(grants.get(name, ())),
            tuple(events.get(name, ())),
            trimmed.get(name),
        )
        for name in names
    ]


def infer_pool(jobs: Sequence[JobSeries]) -> int:
    """The most GPUs the jobs held at once: the pool of a store that did not log it."""
    times = sorted({step.time for job in jobs for step in job.grants} | {0.0})
    return max((sum(job.granted_at(at) for job in jobs) for at in times), default=0)


def load_run(
    store: Store, state_dir: Path, sources: Sequence[JobSource], since: float | None
) -> RunData:
    """Read the series of ``sources`` from ``store``, from unix time ``since`` on if given.

    Call it inside the ``store.snapshot()`` that read ``sources``, so all is of one state.
    """
    reports = {
        source.name: store.reports(source.name, since, limit=MAX_REPORTS_PER_JOB)
        for source in sources
    }
    usage = {source.name: store.usage(source.name, since) for source in sources}
    pool_sizes = store.pool_sizes()
    times: list[float] = []
    for source in sources:
        if source.record is not None:
            times += [source.record.created_at, source.record.updated_at]
        times += [change.time for change in source.grants]
        times += [event.time for event in source.events if event.reason == "Deleted"]
        times += [report.time for report in reports[source.name]]
        times += [sample.time for sample in usage[source.name]]
    times = times or [time.time()]
    first, last = min(times), max(times)
    origin = first if since is None else max(since, first)
    jobs = tuple(
        job_series(source, reports[source.name], usage[source.name], origin) for source in sources
    )
    end = max(0.0, last - origin)
    shared = shared_spans(store.share_history(), origin, end, {s.name for s in sources})
    if pool_sizes:
        earlier = [gpus for at, gpus in pool_sizes if at <= origin]
        pool = [(0.0, earlier[-1] if earlier else pool_sizes[0][1])]
        pool += [(at - origin, gpus) for at, gpus in pool_sizes if origin < at <= last]
        return RunData(state_dir, origin, end, jobs, tuple(pool), shared=shared)
    pool_size = ((0.0, infer_pool(jobs)),)
    return RunData(state_dir, origin, end, jobs, pool_size, pool_inferred=True, shared=shared)
