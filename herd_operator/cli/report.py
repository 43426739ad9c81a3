"""`herd-operator report`: a timeline figure or a text summary of a run, from the state store.

The store is read once into a ``RunData`` of plain series (times in seconds since the
run's first record); the figure and the text are pure functions of it. matplotlib is
imported only to draw, so the text summary works where it is not installed.

GPU-seconds integrate the grant history. The operator logs a drop to 0 GPUs for every end
(succeeded, failed, stopped, deleted); a store written before it did ends a job's grant at
its terminal status time instead (``finished_at``, the shutdown's ``Running=False``, the
``Deleted`` event), so old runs are not counted as holding GPUs they had given back. Jobs
whose spec was deleted are kept: their grant history and events outlive them (their
reports and memory samples do not).
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, format_table, open_store
from herd_operator.controllers.ports import JobRecord
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
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Report, UsageSample

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import LineStyleType

TEXT_SUFFIXES = {".txt": "text", ".md": "markdown"}
FIGURE_SUFFIXES = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
FIGURE_FORMATS = frozenset(FIGURE_SUFFIXES.values())
FIGURE_INCHES = (8.0, 9.0)
"""Wide enough for a legend beside nothing, narrow enough for a page (scaled to 6.3 in, the
text is still 7 pt)."""
DEFAULT_DPI = 150
DELETED = "Deleted"
INSTALL_REPORT_EXTRA = "pip install 'herd-operator[report]'"

# Job colours: a hash of the name picks one, so a job keeps its colour from report to
# report. Paul Tol's "muted" scheme: tells 9 colours apart, also for colour-blind readers
# and in grey print (with the line styles and hatches). Grey is kept for idle and draining.
PALETTE = (
    "#332288",
    "#DDCC77",
    "#44AA99",
    "#882255",
    "#88CCEE",
    "#117733",
    "#CC6677",
    "#999933",
    "#AA4499",
)
"""In an order where neighbours differ most: a job that finds its colour taken takes the
next one."""
LINE_STYLES: tuple[LineStyleType, ...] = ("-", "--", "-.", (0, (8, 2, 1, 2, 1, 2)))
HATCHES = ("", "//", "..", "xx")
"""One per line style: the stacked view tells jobs apart in grey print too. Dotted lines
are kept for the reported world size."""


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


class ReportError(Exception):
    """The report cannot be made; ``exit_code`` says how the command exits."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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

    The end is added only where the log lacks it (a store of an older operator): the level
    in force at the end time is above 0, so a later row cannot be the end's.
    """
    changes = [(change.time, change.gpus, change.reason) for change in source.grants]
    ended = end_time(source)
    if ended is not None:
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
    changes = grant_levels(source)
    earlier = [gpus for time_, gpus, _ in changes if time_ < origin]
    initial = level = earlier[-1] if earlier else 0
    steps: list[GrantStep] = []
    for time_, gpus, reason in changes:
        if time_ >= origin and gpus != level:
            steps.append(GrantStep(time_ - origin, level, gpus, reason))
            level = gpus
    world_sizes: list[tuple[float, int]] = []
    epoch_ends: list[tuple[float, int]] = []
    for report in reports:
        if report.time < origin:
            continue
        if not world_sizes or world_sizes[-1][1] != report.world_size:
            world_sizes.append((report.time - origin, report.world_size))
        if report.epoch is not None and (not epoch_ends or epoch_ends[-1][1] != report.epoch):
            epoch_ends.append((report.time - origin, report.epoch))
    memory = [
        (sample.time - origin, sample.used_bytes / sample.total_bytes)
        for sample in usage
        if sample.time >= origin and sample.total_bytes > 0
    ]
    record = source.record
    min_gpus = max_gpus = None
    policy, thresholds = "-", None
    if record is None:
        status = DELETED
        created = min(
            [change.time for change in source.grants] + [event.time for event in source.events]
        )
    else:
        status = record.status.summary()
        created = record.created_at
        try:
            spec = record.spec.spec
        except StoreError:  # an unreadable stored spec: show the job without it
            pass
        else:
            min_gpus, max_gpus = spec.gpus.min, spec.gpus.max
            policy, thresholds = spec.policy.name, memory_thresholds(spec.policy)
    return JobSeries(
        name=source.name,
        status=status,
        policy=policy,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        created=created - origin,
        initial_gpus=initial,
        grants=tuple(steps),
        world_sizes=tuple(world_sizes),
        epoch_ends=tuple(epoch_ends),
        memory=tuple(memory),
        thresholds=thresholds,
        trimmed_through=None if source.trimmed is None else source.trimmed.through - origin,
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


def job_sources(store: Store) -> list[JobSource]:
    """Every job the store knows, by name: those with a record, and deleted ones (whose
    grant history or events outlive them)."""
    records = {record.name: record for record in store.list_jobs()}
    grants: dict[str, list[StoredGrantChange]] = {}
    for change in store.grant_history():
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
    if pool_sizes:
        earlier = [gpus for at, gpus in pool_sizes if at <= origin]
        pool = [(0.0, earlier[-1] if earlier else pool_sizes[0][1])]
        pool += [(at - origin, gpus) for at, gpus in pool_sizes if origin < at <= last]
        return RunData(state_dir, origin, end, jobs, tuple(pool))
    return RunData(state_dir, origin, end, jobs, ((0.0, infer_pool(jobs)),), pool_inferred=True)


# ---- text ----


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
    return "\n".join(lines) + "\n"


# ---- figure data (pure: the property tests check these) ----


def grant_steps(job: JobSeries, end: float) -> tuple[list[float], list[int]]:
    """x and y of the granted-GPUs step line (``where="post"``).

    It starts when the job was created (a stretch at 0 is time pending) and stops where the
    grant last went to 0, else holds the last grant until ``end``.
    """
    xs, ys = [max(job.created, 0.0)], [job.initial_gpus]
    for step in job.grants:
        xs.append(step.time)
        ys.append(step.after)
    if ys[-1] > 0 or len(ys) == 1:
        xs.append(max(end, xs[-1]))
        ys.append(ys[-1])
    return xs, ys


def world_size_steps(job: JobSeries, end: float) -> tuple[list[float], list[int]]:
    """x and y of the reported world size, held until the grant next drops to 0, or ``end``."""
    if not job.world_sizes:
        return [], []
    last = job.world_sizes[-1][0]
    release = next((s.time for s in job.grants if s.after == 0 and s.time >= last), end)
    xs = [t for t, _ in job.world_sizes] + [max(release, last)]
    ys = [size for _, size in job.world_sizes]
    return xs, [*ys, ys[-1]]


def _world_size_in_force(job: JobSeries, end: float, when: float) -> int:
    """The reported world size the world-size line shows at ``when`` (0 outside it)."""
    xs, ys = world_size_steps(job, end)
    if not xs or when < xs[0] or when >= xs[-1]:
        return 0
    size = 0
    for x, y in zip(xs, ys, strict=True):
        if x > when:
            break
        size = y
    return size


@dataclass(frozen=True)
class PoolStack:
    """The pool over time as layers, constant from ``times[i]`` to ``times[i + 1]``.

    At each time the layers add up to the pool: GPUs granted to each job, GPUs draining
    (taken from a job whose workers still run on them: its reported world size is above
    its grant), and idle GPUs.
    """

    times: tuple[float, ...]
    granted: tuple[tuple[int, ...], ...]
    """Per job (in ``RunData.jobs`` order), per time."""
    draining: tuple[int, ...]
    idle: tuple[int, ...]
    pool: tuple[int, ...]


def pool_stack(run: RunData) -> PoolStack:
    times = {0.0, run.end}
    for job in run.jobs:
        times.update(step.time for step in job.grants)
        times.update(world_size_steps(job, run.end)[0])
    times.update(at for at, _ in run.pool)
    grid = tuple(sorted(t for t in times if 0.0 <= t <= run.end))
    granted: list[list[int]] = [[] for _ in run.jobs]
    draining: list[int] = []
    idle: list[int] = []
    pool: list[int] = []
    for at in grid:
        size = run.pool_at(at)
        levels = [job.granted_at(at) for job in run.jobs]
        # A job that held more than the pool (a damaged log) is shown at most the pool.
        room = size
        for index, level in enumerate(levels):
            shown = min(level, room)
            granted[index].append(shown)
            room -= shown
        beyond = sum(
            max(0, _world_size_in_force(job, run.end, at) - level)
            for job, level in zip(run.jobs, levels, strict=True)
        )
        draining.append(min(beyond, room))
        idle.append(room - draining[-1])
        pool.append(size)
    return PoolStack(
        grid, tuple(tuple(row) for row in granted), tuple(draining), tuple(idle), tuple(pool)
    )


def label_lifts(points: Sequence[tuple[float, int]], near: float) -> list[int]:
    """How many labels each point's label sits above, so labels at one spot do not overlap.

    A label is lifted over every earlier label at the same y less than ``near`` away in x.
    """
    lifts: list[int] = []
    for index, (x, y) in enumerate(points):
        below = [
            lift
            for (other_x, other_y), lift in zip(points[:index], lifts, strict=True)
            if other_y == y and abs(other_x - x) < near
        ]
        lifts.append(max(below) + 1 if below else 0)
    return lifts


def time_unit(span: float) -> tuple[float, str]:
    """Divisor and name of the unit that keeps the time axis' numbers readable."""
    if span > 3 * 3600:
        return 3600.0, "hours"
    if span > 600:
        return 60.0, "minutes"
    return 1.0, "seconds"


def threshold_lines(jobs: Sequence[JobSeries]) -> dict[float, list[str]]:
    """Memory policy threshold -> the jobs using it, so shared thresholds draw one line."""
    lines: dict[float, list[str]] = {}
    for job in jobs:
        if job.thresholds is not None:
            for value in job.thresholds:
                lines.setdefault(value, []).append(job.name)
    return dict(sorted(lines.items()))


@dataclass(frozen=True)
class JobStyle:
    color: str
    linestyle: LineStyleType
    hatch: str


def job_styles(names: Sequence[str]) -> list[JobStyle]:
    """Each job's colour, line style and hatch, from its name: the same in every report.

    A hash of the name picks a colour of ``PALETTE`` and, from other bits, a line style
    (with its hatch for the stacked view). Two jobs of one report whose names pick the
    same one would look alike, so the second (by name) takes the next one no job of the
    report has; only then can a job's look differ from one report to the next (with more
    jobs than colours, colours repeat and the line styles tell them apart).
    """
    digests = {name: zlib.crc32(name.encode()) for name in names}
    colors = _spread(
        {name: digest % len(PALETTE) for name, digest in digests.items()}, len(PALETTE)
    )
    lines = _spread(
        {name: digest // len(PALETTE) % len(LINE_STYLES) for name, digest in digests.items()},
        len(LINE_STYLES),
    )
    return [
        JobStyle(PALETTE[colors[name]], LINE_STYLES[lines[name]], HATCHES[lines[name]])
        for name in names
    ]


def _spread(wanted: dict[str, int], choices: int) -> dict[str, int]:
    """Each name's wanted choice, or the next one free among the names before it (by name);
    once every choice is taken, they are all free again."""
    chosen: dict[str, int] = {}
    taken: set[int] = set()
    for name in sorted(wanted):
        choice = next(
            (wanted[name] + shift) % choices
            for shift in range(choices)
            if (wanted[name] + shift) % choices not in taken
        )
        chosen[name] = choice
        taken.add(choice)
        if len(taken) == choices:
            taken.clear()
    return chosen


def line_offsets(count: int) -> list[float]:
    """Vertical offsets (in GPUs) that keep equal step lines of ``count`` jobs apart.

    Centred on the true value and at most 0.3 GPU wide in all, so a line never reads as
    the next integer.
    """
    if count < 2:
        return [0.0] * count
    spacing = min(0.08, 0.3 / (count - 1))
    return [(index - (count - 1) / 2) * spacing for index in range(count)]


# ---- figure ----


def draw_timeline(run: RunData, path: Path, kind: str = "png", dpi: int = DEFAULT_DPI) -> None:
    """Draw the run into ``path`` as ``kind`` (png, svg or pdf), at ``dpi`` for PNG."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # A fixed salt for the SVG's element ids (random otherwise) and no dates: the same
    # run gives the same file, so a document that includes it rebuilds without changes.
    with rc_context({"svg.hashsalt": "herd-operator"}):
        figure = Figure(figsize=FIGURE_INCHES, dpi=dpi, layout="constrained")
        FigureCanvasAgg(figure)  # attaches the Agg canvas: no display needed (PDF/SVG too)
        draw_run(figure, run)
        figure.savefig(path, format=kind, dpi=dpi, metadata=_metadata(kind))


def _metadata(kind: str) -> dict[str, str | None]:
    # No creation date (PDF and SVG embed one otherwise).
    if kind == "pdf":
        return {"CreationDate": None, "Title": "herd-operator report"}
    if kind == "svg":
        return {"Date": None, "Title": "herd-operator report"}
    return {"Title": "herd-operator report"}


def figure_title(run: RunData) -> str:
    """What the run was, without paths (a figure goes into papers and slides)."""
    started = datetime.fromtimestamp(run.origin, UTC).strftime("%Y-%m-%d %H:%M UTC")
    jobs = f"{len(run.jobs)} job{'s' if len(run.jobs) != 1 else ''}"
    pool = f"{run.pool_max} GPUs" + (" (most held at once)" if run.pool_inferred else "")
    return f"herd-operator run of {started}: {jobs} on {pool}, {format_duration(run.end)}"


def draw_run(figure: Figure, run: RunData) -> None:
    """Three panels on one time axis: GPUs per job, the pool stacked, GPU memory."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    scale, unit = time_unit(run.end)
    styles = job_styles([job.name for job in run.jobs])
    jobs_axes, pool_axes, memory_axes = figure.subplots(3, 1, sharex=True, height_ratios=[3, 2, 2])
    figure.suptitle(figure_title(run), fontsize=11)
    top = max(run.pool_max, *(job.max_gpus or 0 for job in run.jobs), 1)

    # (a) GPUs per job: granted (steps), reported world size (thin, dotted), resizes (marks).
    offsets = line_offsets(len(run.jobs))
    for job, style, offset in zip(run.jobs, styles, offsets, strict=True):
        xs, ys = grant_steps(job, run.end)
        jobs_axes.step(
            [x / scale for x in xs],
            [y + offset for y in ys],
            where="post",
            color=style.color,
            linestyle=style.linestyle,
            linewidth=1.8,
        )
        xs, ys = world_size_steps(job, run.end)
        jobs_axes.step(
            [x / scale for x in xs],
            [y + offset for y in ys],
            where="post",
            color=style.color,
            linestyle=":",
            linewidth=1.0,
        )
        if job.epoch_ends:
            jobs_axes.plot(
                [t / scale for t, _ in job.epoch_ends],
                [_world_size_at(job, t) + offset for t, _ in job.epoch_ends],
                linestyle="none",
                marker="|",
                markersize=6,
                color=style.color,
            )
        for step in job.grants:
            if step.is_resize:
                jobs_axes.plot(
                    step.time / scale,
                    step.after + offset,
                    marker="^" if step.after > step.before else "v",
                    markersize=6,
                    color=style.color,
                    markeredgecolor="black",
                    markeredgewidth=0.5,
                    linestyle="none",
                )
    resizes = sorted(
        (
            (step, index)
            for index, job in enumerate(run.jobs)
            for step in job.grants
            if step.is_resize
        ),
        key=lambda change: change[0].time,
    )
    lifts = label_lifts([(step.time, step.after) for step, _ in resizes], near=run.end / 12)
    for (step, index), lift in zip(resizes, lifts, strict=True):
        near_right = step.time > 0.85 * run.end
        jobs_axes.annotate(
            step.label,
            (step.time / scale, step.after + offsets[index]),
            xytext=(-4 if near_right else 4, 5 + 9 * lift),
            textcoords="offset points",
            ha="right" if near_right else "left",
            fontsize=7,
            color=styles[index].color,
            annotation_clip=False,
        )
    jobs_axes.set_ylabel("GPUs per job")
    # Headroom above the largest count for the resize labels.
    jobs_axes.set_ylim(-0.3, top + 0.9)
    jobs_axes.yaxis.get_major_locator().set_params(integer=True)
    jobs_axes.grid(axis="y", alpha=0.3)
    jobs_axes.set_title(
        "(a) GPUs granted per job, and the world size its workers reported", loc="left", fontsize=9
    )

    # (b) the pool, stacked: what each job holds, what drains, what is idle.
    stack = pool_stack(run)
    xs = [t / scale for t in stack.times]
    lower = [0] * len(stack.times)
    for job, style, levels in zip(run.jobs, styles, stack.granted, strict=True):
        upper = [a + b for a, b in zip(lower, levels, strict=True)]
        if any(levels):
            pool_axes.fill_between(
                xs,
                lower,
                upper,
                step="post",
                facecolor=style.color,
                hatch=style.hatch,
                edgecolor="white",
                linewidth=0.0,
                label=job.name,
            )
        lower = upper
    for layer, color, hatch in (
        (stack.draining, "#BBBBBB", "\\\\\\"),
        (stack.idle, "#EEEEEE", ""),
    ):
        upper = [a + b for a, b in zip(lower, layer, strict=True)]
        pool_axes.fill_between(
            xs,
            lower,
            upper,
            step="post",
            facecolor=color,
            hatch=hatch,
            edgecolor="#777777",
            linewidth=0.0,
        )
        lower = upper
    pool_axes.step(xs, stack.pool, where="post", color="black", linewidth=1.0)
    pool_axes.set_ylabel("GPUs in the pool")
    pool_axes.set_ylim(0, top + 0.5)
    pool_axes.yaxis.get_major_locator().set_params(integer=True)
    pool_axes.set_title(
        "(b) the pool: GPUs per job stacked, draining and idle GPUs on top", loc="left", fontsize=9
    )

    # (c) GPU memory used, against each memory policy's thresholds.
    for job, style in zip(run.jobs, styles, strict=True):
        if job.memory:
            memory_axes.plot(
                [t / scale for t, _ in job.memory],
                [100 * u for _, u in job.memory],
                color=style.color,
                linestyle=style.linestyle,
                linewidth=1.2,
            )
    _draw_thresholds(
        memory_axes,
        threshold_lines(run.jobs),
        dict(zip([j.name for j in run.jobs], styles, strict=True)),
    )
    memory_axes.set_ylabel("GPU memory used (%)")
    memory_axes.set_ylim(0, 100)
    # A little room on the right: a line that ends with the run stays visible.
    memory_axes.set_xlim(0, max(run.end, 1.0) * 1.01 / scale)
    memory_axes.set_xlabel(f"{unit} since the start of the run")
    memory_axes.grid(axis="y", alpha=0.3)
    memory_axes.set_title(
        "(c) GPU memory used, and the memory policy's thresholds", loc="left", fontsize=9
    )

    handles: list[Line2D | Patch] = [
        Line2D([], [], color=style.color, linestyle=style.linestyle, linewidth=1.8, label=job.name)
        for job, style in zip(run.jobs, styles, strict=True)
    ]
    handles += [
        Line2D([], [], color="black", linewidth=1.8, label="GPUs granted"),
        Line2D([], [], color="black", linestyle=":", linewidth=1.0, label="world size reported"),
        Line2D(
            [],
            [],
            color="grey",
            marker="^",
            linestyle="none",
            markeredgecolor="black",
            label="grown",
        ),
        Line2D(
            [],
            [],
            color="grey",
            marker="v",
            linestyle="none",
            markeredgecolor="black",
            label="shrunk",
        ),
        Line2D([], [], color="black", marker="|", linestyle="none", label="epoch end"),
        Patch(facecolor="#BBBBBB", hatch="\\\\\\", edgecolor="#777777", label="draining"),
        Patch(facecolor="#EEEEEE", edgecolor="#777777", label="idle"),
        Line2D([], [], color="grey", linestyle="--", linewidth=0.9, label="policy threshold"),
    ]
    figure.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)


def _world_size_at(job: JobSeries, when: float) -> int:
    """The reported world size in force at ``when`` (an epoch end is one of its reports)."""
    size = job.world_sizes[0][1]
    for time_, reported in job.world_sizes:
        if time_ > when:
            break
        size = reported
    return size


def _draw_thresholds(
    axes: Axes, lines: dict[float, list[str]], styles: dict[str, JobStyle]
) -> None:
    """One dashed line per threshold value, labelled in percent like the axis, on the right.

    A threshold of one job takes its colour; one that jobs share is grey.
    """
    for value, names in lines.items():
        color = styles[names[0]].color if len(names) == 1 else "grey"
        axes.axhline(100 * value, color=color, linestyle="--", linewidth=0.9)
        axes.annotate(
            f"{100 * value:.0f}% ({', '.join(names)})",
            (1.0, 100 * value),
            xycoords=("axes fraction", "data"),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
            color=color,
            annotation_clip=False,
        )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height in pixels from a PNG's header."""
    with path.open("rb") as file:
        header = file.read(24)
    width, height = struct.unpack(">II", header[16:24])  # IHDR, right after the signature
    return int(width), int(height)


# ---- command ----


def output_format(requested: str | None, output: Path | None) -> str:
    """`png`, `svg`, `pdf`, `text` or `markdown`: what was asked for, else what the output's
    suffix says (a name without a suffix is a PNG).

    ReportError (usage) when they disagree, or the suffix is none of these: writing PNG
    bytes into `x.pdf` helps no one.
    """
    suffix = output.suffix.lower() if output is not None else ""
    text_format = TEXT_SUFFIXES.get(suffix)
    figure_format = FIGURE_SUFFIXES.get(suffix)
    if requested == "text":
        if figure_format is not None:
            raise ReportError(f"--format text, but --output {output} names a figure", EXIT_USAGE)
        return text_format or "text"
    if requested is not None:
        if suffix and figure_format != requested:
            raise ReportError(
                f"--format {requested}, but --output {output} says otherwise", EXIT_USAGE
            )
        return requested
    if text_format is not None:
        return text_format
    if figure_format is not None:
        return figure_format
    if suffix:
        raise ReportError(
            f"cannot tell the format of --output {output}: name it .png, .svg, .pdf, .txt"
            " or .md, or pass --format",
            EXIT_USAGE,
        )
    return "png"


def select_jobs(
    sources: Sequence[JobSource], names: str | None, state_dir: Path
) -> list[JobSource]:
    """The jobs named in ``names`` (comma-separated), in that order; all if None."""
    if not sources:
        raise ReportError(f"nothing to report in {state_dir}", EXIT_FAILURE)
    if names is None:
        return list(sources)
    by_name = {source.name: source for source in sources}
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    if not wanted:
        raise ReportError(f"--jobs: no job names in {names!r}", EXIT_USAGE)
    unknown = ", ".join(repr(name) for name in wanted if name not in by_name)
    if unknown:
        raise ReportError(
            f"--jobs: no such job in {state_dir}: {unknown} (jobs there: {', '.join(by_name)})",
            EXIT_USAGE,
        )
    return [by_name[name] for name in dict.fromkeys(wanted)]


def _progress(message: str) -> None:
    print(f"report: {message}", file=sys.stderr, flush=True)


def run_report(args: argparse.Namespace) -> int:
    """`herd-operator report`: see the module docstring; returns the exit code."""
    try:
        kind = output_format(args.format, args.output)
        since = None if args.since is None else time.time() - args.since
        with open_store(args.state_dir) as store, store.snapshot():
            sources = select_jobs(job_sources(store), args.jobs, args.state_dir)
            _progress(f"reading {len(sources)} job{'s' if len(sources) != 1 else ''}...")
            run = load_run(store, args.state_dir, sources, since)
        if kind not in FIGURE_FORMATS:
            text = format_summary(run, markdown=kind == "markdown")
            if args.output is None:
                sys.stdout.write(text)
                return EXIT_OK
            args.output.write_text(text)
            _progress(f"wrote {args.output}")
            return EXIT_OK
        output = args.output or Path(f"timeline.{kind}")
        _progress("drawing...")
        try:
            draw_timeline(run, output, kind, args.dpi)
        except ImportError as err:
            raise ReportError(
                f"drawing needs matplotlib ({err}): {INSTALL_REPORT_EXTRA}, or use --format text",
                EXIT_FAILURE,
            ) from err
        if kind == "png":
            width, height = png_size(output)
            _progress(f"wrote {output} ({width}x{height} px)")
        else:
            inches = "x".join(f"{size:g}" for size in FIGURE_INCHES)
            _progress(f"wrote {output} ({kind.upper()}, {inches} in)")
        return EXIT_OK
    except ReportError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"herd-operator: cannot write the report: {err}", file=sys.stderr)
        return EXIT_FAILURE
