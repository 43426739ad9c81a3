"""What the report's figure shows, as numbers: step lines, the pool stacked by job, label
positions, each job's colour and line style.

Pure functions of the series (no matplotlib), apart from the drawing so that the
property tests check every number the figure shows, and the accounting (at no instant
do the jobs hold more than the pool) holds without drawing anything.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from herd_operator.cli.report.series import GrantStep, JobSeries, RunData
from herd_operator.cli.report.shares import SharedSpan
from herd_operator.cli.report.text import format_duration

if TYPE_CHECKING:
    from matplotlib.typing import LineStyleType

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


def resize_seconds(job: JobSeries, step: GrantStep) -> float | None:
    """How long the resize `step` took to reach the workers: from the grant change to the
    first reported world size at the new grant's size, before the grant next changed (the
    measure of its `ResizeCompleted` event); None when no report said it in time, as for a
    script that does not report."""
    until = min((later.time for later in job.grants if later.time > step.time), default=None)
    return next(
        (
            when - step.time
            for when, size in job.world_sizes
            if size == step.after and when >= step.time and (until is None or when < until)
        ),
        None,
    )


def resize_label(job: JobSeries, step: GrantStep) -> str:
    """A resize's mark in the figure: `3->2`, and what it cost when the reports say it
    (`3->2 28s`)."""
    seconds = resize_seconds(job, step)
    return step.label if seconds is None else f"{step.label} {format_duration(seconds)}"


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
    its grant), and idle GPUs. A GPU that several jobs share counts once: each of its jobs
    holds the part of it its memory is of theirs (alike where a memory is not known), so a
    job's level is fractional while it shares.
    """

    times: tuple[float, ...]
    granted: tuple[tuple[float, ...], ...]
    """Per job (in ``RunData.jobs`` order), per time."""
    draining: tuple[float, ...]
    idle: tuple[float, ...]
    pool: tuple[int, ...]


def shared_surplus(spans: Sequence[SharedSpan], at: float) -> dict[str, float]:
    """Per job, the GPUs its grant counts at ``at`` beyond its parts of the GPUs it shares
    then: on each shared GPU, one less its part (its memory over the jobs' there; alike
    where one is not known)."""
    surplus: dict[str, float] = {}
    for span in spans:
        if not span.start <= at < span.end:
            continue
        known = all(count > 0 for _, count in span.jobs)
        total = sum(count for _, count in span.jobs) if known else len(span.jobs)
        for job, count in span.jobs:
            part = (count if known else 1) / total
            surplus[job] = surplus.get(job, 0.0) + 1.0 - part
    return surplus


def pool_stack(run: RunData) -> PoolStack:
    times = {0.0, run.end}
    for job in run.jobs:
        times.update(step.time for step in job.grants)
        times.update(world_size_steps(job, run.end)[0])
    times.update(at for at, _ in run.pool)
    times.update(edge for span in run.shared for edge in (span.start, span.end))
    grid = tuple(sorted(t for t in times if 0.0 <= t <= run.end))
    granted: list[list[float]] = [[] for _ in run.jobs]
    draining: list[float] = []
    idle: list[float] = []
    pool: list[int] = []
    for at in grid:
        size = run.pool_at(at)
        surplus = shared_surplus(run.shared, at)
        levels = [job.granted_at(at) for job in run.jobs]
        # A job that held more than the pool (a damaged log) is shown at most the pool.
        room: float = size
        for index, (job, level) in enumerate(zip(run.jobs, levels, strict=True)):
            shown = min(level - surplus.get(job.name, 0.0), room)
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
