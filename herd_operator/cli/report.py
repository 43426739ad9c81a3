"""`herd-operator report`: a timeline figure or a text summary of a run, from the state store.

The store is read once into a ``RunData`` of plain series (times in seconds since the
run's first record); the figure and the text are pure functions of it. matplotlib is
imported only to draw, so the text summary works where it is not installed.
"""

from __future__ import annotations

import argparse
import struct
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from controllers.ports import JobRecord
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, format_table, open_store
from herd_operator.runtime.store import MAX_REPORTS_PER_JOB, Store
from herd_operator.runtime.store import GrantChange as StoredGrantChange
from policies.memory import MemoryParams
from specs import PolicyRef
from specs.values import Report, UsageSample

if TYPE_CHECKING:
    from matplotlib.axes import Axes

TEXT_SUFFIXES = {".txt": "text", ".md": "markdown"}
FIGURE_INCHES = (12.0, 7.5)
FIGURE_DPI = 100


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
    min_gpus: int
    max_gpus: int
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

    def gpu_seconds(self, end: float) -> float:
        """GPUs granted, integrated over the window up to ``end``."""
        total, level, since = 0.0, self.initial_gpus, 0.0
        for step in self.grants:
            total += level * (step.time - since)
            level, since = step.after, step.time
        return total + level * max(0.0, end - since)

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


@dataclass(frozen=True)
class RunData:
    """What the report shows: every selected job's series over one window."""

    state_dir: Path
    origin: float
    """Unix time of run second 0: the first record, or the window's start if later."""
    end: float
    """Run seconds of the last record."""
    jobs: tuple[JobSeries, ...]


class ReportError(Exception):
    """The report cannot be made; ``exit_code`` says how the command exits."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---- reading ----


def job_series(
    record: JobRecord,
    grants: Sequence[StoredGrantChange],
    reports: Sequence[Report],
    usage: Sequence[UsageSample],
    origin: float,
) -> JobSeries:
    """One job's series relative to ``origin``; records before it only set the starting grant."""
    spec = record.spec.spec
    earlier = [change for change in grants if change.time < origin]
    initial = level = earlier[-1].gpus if earlier else 0
    steps: list[GrantStep] = []
    for change in grants:
        if change.time >= origin and change.gpus != level:
            steps.append(GrantStep(change.time - origin, level, change.gpus, change.reason))
            level = change.gpus
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
    return JobSeries(
        name=record.name,
        status=record.status.summary(),
        policy=spec.policy.name,
        min_gpus=spec.gpus.min,
        max_gpus=spec.gpus.max,
        created=record.created_at - origin,
        initial_gpus=initial,
        grants=tuple(steps),
        world_sizes=tuple(world_sizes),
        epoch_ends=tuple(epoch_ends),
        memory=tuple(memory),
        thresholds=memory_thresholds(spec.policy),
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


def load_run(
    store: Store, state_dir: Path, records: Sequence[JobRecord], since: float | None
) -> RunData:
    """Read the series of ``records`` from ``store``, from unix time ``since`` on if given."""
    with store.snapshot():
        grants = {record.name: store.grant_history(record.name) for record in records}
        reports = {
            record.name: store.reports(record.name, since, limit=MAX_REPORTS_PER_JOB)
            for record in records
        }
        usage = {record.name: store.usage(record.name, since) for record in records}
    times = [record.created_at for record in records] + [record.updated_at for record in records]
    for name in grants:
        times += [change.time for change in grants[name]]
        times += [report.time for report in reports[name]]
        times += [sample.time for sample in usage[name]]
    first, last = min(times), max(times)
    origin = first if since is None else max(since, first)
    jobs = tuple(
        job_series(record, grants[record.name], reports[record.name], usage[record.name], origin)
        for record in records
    )
    return RunData(state_dir=state_dir, origin=origin, end=max(0.0, last - origin), jobs=jobs)


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
            f"{job.min_gpus}-{job.max_gpus}",
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
    if markdown:
        lines = ["# herd-operator report", "", headline, "", *_table(rows, True), ""]
        lines += ["## Grant changes", ""]
        lines += _table(log_rows, True) if changes else ["none"]
    else:
        lines = [headline, "", *_table(rows, False), ""]
        lines += ["Grant changes:" + ("" if changes else " none")]
        lines += ["  " + line for line in _table(log_rows, False)] if changes else []
    return "\n".join(lines) + "\n"


# ---- figure ----


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


def world_size_steps(job: JobSeries, end: float) -> tuple[list[float], list[int]]:
    """x and y of the reported world size, held until the grant next drops to 0, or ``end``."""
    if not job.world_sizes:
        return [], []
    last = job.world_sizes[-1][0]
    release = next((s.time for s in job.grants if s.after == 0 and s.time >= last), end)
    xs = [t for t, _ in job.world_sizes] + [max(release, last)]
    ys = [size for _, size in job.world_sizes]
    return xs, [*ys, ys[-1]]


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


def draw_timeline(run: RunData, path: Path) -> None:
    """Draw GPUs and GPU memory per job over time into a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    scale, unit = time_unit(run.end)
    figure = Figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI, layout="constrained")
    FigureCanvasAgg(figure)  # attaches the Agg canvas: no display needed
    gpus_axes, memory_axes = figure.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    # Earlier jobs draw wider, so a later job on the same count leaves their edges visible.
    widths = [4.0 - 2.0 * i / max(len(run.jobs) - 1, 1) for i in range(len(run.jobs))]
    for index, job in enumerate(run.jobs):
        color = f"C{index % 10}"
        xs, ys = grant_steps(job, run.end)
        gpus_axes.step(
            [x / scale for x in xs], ys, where="post", color=color, linewidth=widths[index]
        )
        xs, ys = world_size_steps(job, run.end)
        gpus_axes.step(
            [x / scale for x in xs], ys, where="post", color="black", linestyle=":", linewidth=1
        )
        if job.epoch_ends:
            gpus_axes.plot(
                [t / scale for t, _ in job.epoch_ends],
                [_world_size_at(job, t) for t, _ in job.epoch_ends],
                linestyle="none",
                marker="|",
                markersize=7,
                color="black",
            )
        for step in job.grants:
            for axes in (gpus_axes, memory_axes):
                axes.axvline(step.time / scale, color=color, alpha=0.35, linewidth=0.8)
        if job.memory:
            memory_axes.plot(
                [t / scale for t, _ in job.memory],
                [100 * u for _, u in job.memory],
                color=color,
                linewidth=1.2,
            )
    changes = sorted(
        ((step, index) for index, job in enumerate(run.jobs) for step in job.grants),
        key=lambda change: change[0].time,
    )
    lifts = label_lifts([(step.time, step.after) for step, _ in changes], near=run.end / 25)
    for (step, index), lift in zip(changes, lifts, strict=True):
        gpus_axes.annotate(
            step.label,
            (step.time / scale, step.after),
            xytext=(3, 4 + 10 * lift),
            textcoords="offset points",
            fontsize=8,
            color=f"C{index % 10}",
        )
    _draw_thresholds(memory_axes, threshold_lines(run.jobs))

    gpus_axes.set_ylabel("GPUs")
    gpus_axes.set_ylim(bottom=0)
    gpus_axes.yaxis.get_major_locator().set_params(integer=True)
    gpus_axes.grid(axis="y", alpha=0.3)
    started = datetime.fromtimestamp(run.origin, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    gpus_axes.set_title(f"herd-operator run in {run.state_dir}, started {started}")
    handles: list[Line2D] = [
        Line2D([], [], color=f"C{i % 10}", linewidth=2, label=job.name)
        for i, job in enumerate(run.jobs)
    ]
    handles += [
        Line2D([], [], color="grey", linewidth=2, label="granted GPUs"),
        Line2D([], [], color="black", linestyle=":", label="reported world size"),
        Line2D([], [], color="black", linestyle="none", marker="|", label="epoch end"),
    ]
    gpus_axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9)

    memory_axes.set_ylabel("GPU memory used (%)")
    memory_axes.set_ylim(0, 100)
    memory_axes.set_xlim(0, max(run.end, 1.0) / scale)
    memory_axes.set_xlabel(f"{unit} since the start of the run")
    memory_axes.grid(axis="y", alpha=0.3)
    figure.savefig(path, format="png")


def _world_size_at(job: JobSeries, when: float) -> int:
    """The reported world size in force at ``when`` (an epoch end is one of its reports)."""
    size = job.world_sizes[0][1]
    for time_, reported in job.world_sizes:
        if time_ > when:
            break
        size = reported
    return size


def _draw_thresholds(axes: Axes, lines: dict[float, list[str]]) -> None:
    for value, names in lines.items():
        axes.axhline(100 * value, color="grey", linestyle="--", linewidth=0.9)
        axes.annotate(
            f"memory policy {value:g} ({', '.join(names)})",
            (1.0, 100 * value),
            xycoords=("axes fraction", "data"),
            xytext=(4, 0),
            textcoords="offset points",
            va="center",
            fontsize=8,
            color="grey",
        )


def png_size(path: Path) -> tuple[int, int]:
    """Width and height in pixels from a PNG's header."""
    with path.open("rb") as file:
        header = file.read(24)
    width, height = struct.unpack(">II", header[16:24])  # IHDR, right after the signature
    return int(width), int(height)


# ---- command ----


def output_format(requested: str | None, output: Path | None) -> str:
    """`png`, `text` or `markdown`: what was asked for, else what the output's suffix says."""
    suffix_format = TEXT_SUFFIXES.get(output.suffix.lower()) if output is not None else None
    if requested == "text":
        return suffix_format or "text"
    if requested == "png":
        return "png"
    return suffix_format or "png"


def select_jobs(
    records: Sequence[JobRecord], names: str | None, state_dir: Path
) -> list[JobRecord]:
    """The records named in ``names`` (comma-separated), in that order; all if None."""
    if not records:
        raise ReportError(f"nothing to report in {state_dir}", EXIT_FAILURE)
    if names is None:
        return list(records)
    by_name = {record.name: record for record in records}
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
    kind = output_format(args.format, args.output)
    since = None if args.since is None else time.time() - args.since
    try:
        with open_store(args.state_dir) as store:
            records = select_jobs(store.list_jobs(), args.jobs, args.state_dir)
            _progress(f"reading {len(records)} job{'s' if len(records) != 1 else ''}...")
            run = load_run(store, args.state_dir, records, since)
        if kind != "png":
            text = format_summary(run, markdown=kind == "markdown")
            if args.output is None:
                sys.stdout.write(text)
                return EXIT_OK
            args.output.write_text(text)
            _progress(f"wrote {args.output}")
            return EXIT_OK
        output = args.output or Path("timeline.png")
        _progress("drawing...")
        try:
            draw_timeline(run, output)
        except ImportError as err:
            raise ReportError(
                f"drawing needs matplotlib ({err}); install it, or use --format text",
                EXIT_FAILURE,
            ) from err
        width, height = png_size(output)
        _progress(f"wrote {output} ({width}x{height} px)")
        return EXIT_OK
    except ReportError as err:
        print(f"herd-operator: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"herd-operator: cannot write the report: {err}", file=sys.stderr)
        return EXIT_FAILURE
