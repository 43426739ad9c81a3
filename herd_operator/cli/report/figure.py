"""The report's figure: three panels on one time axis (GPUs per job, the pool stacked,
GPU memory), and a fourth when GPUs were shared (each shared GPU's jobs and their memory),
drawn with matplotlib into a PNG, SVG or PDF.

Apart from the numbers it shows (`figure_data`, pure and tested without drawing):
matplotlib is imported only here, and only when a figure is drawn.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from herd_operator.cli.report.figure_data import (
    JobStyle,
    grant_steps,
    job_styles,
    label_lifts,
    line_offsets,
    pool_stack,
    resize_label,
    threshold_lines,
    time_unit,
    world_size_steps,
)
from herd_operator.cli.report.series import JobSeries, RunData
from herd_operator.cli.report.shares import LANE_HEIGHT, share_bars
from herd_operator.cli.report.text import format_duration

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

FIGURE_INCHES = (8.0, 9.0)
"""Wide enough for a legend beside nothing, narrow enough for a page (scaled to 6.3 in, the
text is still 7 pt)."""
DEFAULT_DPI = 150


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
    """Three panels on one time axis: GPUs per job, the pool stacked, GPU memory; and the
    shared GPUs below them when there were any."""
    scale, unit = time_unit(run.end)
    styles = job_styles([job.name for job in run.jobs])
    ratios = [3, 2, 2, 2] if run.shared else [3, 2, 2]
    panels = figure.subplots(len(ratios), 1, sharex=True, height_ratios=ratios)
    jobs_axes, pool_axes, memory_axes = panels[:3]
    figure.suptitle(figure_title(run), fontsize=11)
    top = max(run.pool_max, *(job.max_gpus or 0 for job in run.jobs), 1)
    _draw_jobs(jobs_axes, run, styles, scale, top)
    _draw_pool(pool_axes, run, styles, scale, top)
    _draw_memory(memory_axes, run, styles, scale, unit)
    if run.shared:
        memory_axes.set_xlabel("")
        _draw_shared(panels[3], run, styles, scale, unit)
    figure.legend(
        handles=_legend_handles(run, styles),
        loc="outside lower center",
        ncols=4,
        fontsize=8,
        frameon=False,
    )


def _draw_jobs(
    axes: Axes, run: RunData, styles: Sequence[JobStyle], scale: float, top: int
) -> None:
    """(a) GPUs per job: granted (steps), reported world size (thin, dotted), resizes (marks)."""
    offsets = line_offsets(len(run.jobs))
    for job, style, offset in zip(run.jobs, styles, offsets, strict=True):
        _draw_job(axes, job, run.end, style, offset, scale)
    _label_resizes(axes, run, styles, offsets, scale)
    axes.set_ylabel("GPUs per job")
    # Headroom above the largest count for the resize labels.
    axes.set_ylim(-0.3, top + 0.9)
    _integer_ticks(axes)
    axes.grid(axis="y", alpha=0.3)
    axes.set_title(
        "(a) GPUs granted per job, and the world size its workers reported", loc="left", fontsize=9
    )


def _draw_job(
    axes: Axes, job: JobSeries, end: float, style: JobStyle, offset: float, scale: float
) -> None:
    """One job's lines and marks in panel (a), ``offset`` GPUs off its true values."""
    xs, ys = grant_steps(job, end)
    axes.step(
        [x / scale for x in xs],
        [y + offset for y in ys],
        where="post",
        color=style.color,
        linestyle=style.linestyle,
        linewidth=1.8,
    )
    xs, ys = world_size_steps(job, end)
    axes.step(
        [x / scale for x in xs],
        [y + offset for y in ys],
        where="post",
        color=style.color,
        linestyle=":",
        linewidth=1.0,
    )
    if job.epoch_ends:
        axes.plot(
            [t / scale for t, _ in job.epoch_ends],
            [_world_size_at(job, t) + offset for t, _ in job.epoch_ends],
            linestyle="none",
            marker="|",
            markersize=6,
            color=style.color,
        )
    for step in job.grants:
        if step.is_resize:
            axes.plot(
                step.time / scale,
                step.after + offset,
                marker="^" if step.after > step.before else "v",
                markersize=6,
                color=style.color,
                markeredgecolor="black",
                markeredgewidth=0.5,
                linestyle="none",
            )


def _label_resizes(
    axes: Axes,
    run: RunData,
    styles: Sequence[JobStyle],
    offsets: Sequence[float],
    scale: float,
) -> None:
    """Each resize's `before->after` and what it cost (`resize_label`) beside its mark,
    lifted over the labels near it."""
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
        axes.annotate(
            resize_label(run.jobs[index], step),
            (step.time / scale, step.after + offsets[index]),
            xytext=(-4 if near_right else 4, 5 + 9 * lift),
            textcoords="offset points",
            ha="right" if near_right else "left",
            fontsize=7,
            color=styles[index].color,
            annotation_clip=False,
        )


def _draw_pool(
    axes: Axes, run: RunData, styles: Sequence[JobStyle], scale: float, top: int
) -> None:
    """(b) the pool, stacked: what each job holds, what drains, what is idle."""
    stack = pool_stack(run)
    xs = [t / scale for t in stack.times]
    lower: list[float] = [0.0] * len(stack.times)
    for job, style, levels in zip(run.jobs, styles, stack.granted, strict=True):
        upper = [a + b for a, b in zip(lower, levels, strict=True)]
        if any(levels):
            axes.fill_between(
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
        axes.fill_between(
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
    axes.step(xs, stack.pool, where="post", color="black", linewidth=1.0)
    axes.set_ylabel("GPUs in the pool")
    axes.set_ylim(0, top + 0.5)
    _integer_ticks(axes)
    shared = ", a shared GPU split by memory" if run.shared else ""
    axes.set_title(
        f"(b) the pool: GPUs per job stacked{shared}, draining and idle GPUs on top",
        loc="left",
        fontsize=9,
    )


def _integer_ticks(axes: Axes) -> None:
    """Ticks of the y axis at whole GPUs only, the default locator's other choices kept."""
    from matplotlib.ticker import MaxNLocator

    locator = axes.yaxis.get_major_locator()
    if isinstance(locator, MaxNLocator):  # the default, AutoLocator, is one
        locator.set_params(integer=True)


def _draw_memory(
    axes: Axes, run: RunData, styles: Sequence[JobStyle], scale: float, unit: str
) -> None:
    """(c) GPU memory used, against each memory policy's thresholds."""
    for job, style in zip(run.jobs, styles, strict=True):
        if job.memory:
            axes.plot(
                [t / scale for t, _ in job.memory],
                [100 * u for _, u in job.memory],
                color=style.color,
                linestyle=style.linestyle,
                linewidth=1.2,
            )
    _draw_thresholds(
        axes,
        threshold_lines(run.jobs),
        dict(zip([j.name for j in run.jobs], styles, strict=True)),
    )
    axes.set_ylabel("GPU memory used (%)")
    axes.set_ylim(0, 100)
    # A little room on the right: a line that ends with the run stays visible.
    axes.set_xlim(0, max(run.end, 1.0) * 1.01 / scale)
    axes.set_xlabel(f"{unit} since the start of the run")
    axes.grid(axis="y", alpha=0.3)
    axes.set_title(
        "(c) GPU memory used, and the memory policy's thresholds", loc="left", fontsize=9
    )


def _draw_shared(
    axes: Axes, run: RunData, styles: Sequence[JobStyle], scale: float, unit: str
) -> None:
    """(d) each shared GPU a lane: its jobs stacked by the memory each worker is counted for,
    labelled where the bar is wide enough."""
    style_of = dict(zip([job.name for job in run.jobs], styles, strict=True))
    lanes, bars = share_bars(run.shared)
    for bar in bars:
        style = style_of.get(bar.job)  # a neighbour left out by --jobs: grey
        axes.bar(
            bar.start / scale,
            bar.height,
            width=max(bar.width, 0.0) / scale,
            bottom=bar.bottom,
            align="edge",
            color=style.color if style else "#999999",
            hatch=style.hatch if style else "",
            edgecolor="white",
            linewidth=0.5,
        )
        if bar.width >= run.end / 8:
            axes.text(
                (bar.start + bar.width / 2) / scale,
                bar.bottom + bar.height / 2,
                bar.text,
                ha="center",
                va="center",
                fontsize=7,
                # Black on a pale box: readable on every job's colour and hatch.
                bbox={"boxstyle": "round,pad=0.2", "facecolor": "white", "alpha": 0.8, "lw": 0},
            )
    axes.set_yticks([lane + LANE_HEIGHT / 2 for lane in range(len(lanes))], lanes, fontsize=7)
    axes.set_ylim(-0.1, len(lanes))
    axes.set_xlim(0, max(run.end, 1.0) * 1.01 / scale)
    axes.set_xlabel(f"{unit} since the start of the run")
    axes.set_title(
        "(d) shared GPUs: each job's memory counted per worker (bar height)",
        loc="left",
        fontsize=9,
    )


def _legend_handles(run: RunData, styles: Sequence[JobStyle]) -> list[Line2D | Patch]:
    """One line per job, then what each kind of line, mark and layer means."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

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
    return handles


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
