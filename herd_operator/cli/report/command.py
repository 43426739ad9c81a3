"""`herd-operator report`: its options, the output format, the jobs chosen, and the run read
from the store, then written as a figure (`figure`) or a text summary (`text`).

The series, the figure and the text are imported only when the command runs, so that
this, registered with every command, starts nothing the other commands do not need.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from herd_operator.cli.arguments import (
    Subcommands,
    UsageError,
    add_command,
    bounded,
    positive_float,
    state_dir_option,
)
from herd_operator.cli.views import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, open_store

if TYPE_CHECKING:
    from herd_operator.cli.report.series import JobSource

TEXT_SUFFIXES = {".txt": "text", ".md": "markdown", ".json": "json", ".csv": "csv"}
DATA_FORMATS = frozenset({"json", "csv"})
FIGURE_SUFFIXES = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
FIGURE_FORMATS = frozenset(FIGURE_SUFFIXES.values())
INSTALL_REPORT_EXTRA = "pip install 'herd-operator[report]'"

# Below 30 the text is unreadable; above 1200 an 8x9 in PNG passes 100 megapixels.
_dpi = bounded(int, lambda v: 30 <= v <= 1200, "a resolution is 30..1200 dpi", "an integer")


def add_commands(commands: Subcommands) -> None:
    report = add_command(
        commands,
        "report",
        cmd_report,
        help="draw the run's timeline, or summarize it as text",
    )
    state_dir_option(report)
    report.add_argument(
        "--output",
        type=Path,
        help="file to write (default: timeline.png, or timeline.svg/.pdf with --format;"
        " stdout for --format text|json|csv); its suffix picks the format: .png, .svg, .pdf,"
        " .txt/.md for the text summary, .json or .csv",
    )
    report.add_argument(
        "--format",
        choices=["png", "svg", "pdf", "text", "json", "csv"],
        help="default: from --output's suffix, else png. json: the text summary's numbers as "
        "one object, units in the field names (docs/observability.md); csv: its job table "
        "with a header row",
    )
    report.add_argument(
        "--dpi",
        type=_dpi,
        default=150,
        help="resolution of a PNG, in dots per inch (default: 150; the figure is 8x9 in)",
    )
    report.add_argument(
        "--since",
        type=positive_float,
        metavar="SECONDS_AGO",
        help="only the last SECONDS_AGO seconds (default: the whole run)",
    )
    report.add_argument("--jobs", metavar="NAME,NAME", help="only these jobs (default: all)")


class ReportError(Exception):
    """The report cannot be made; ``exit_code`` says how the command exits."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


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
        if figure_format is not None or text_format in DATA_FORMATS:
            raise ReportError(f"--format text, but --output {output} says otherwise", EXIT_USAGE)
        return text_format or "text"
    if requested in DATA_FORMATS:
        if figure_format is not None or text_format not in (None, requested):
            raise ReportError(
                f"--format {requested}, but --output {output} says otherwise", EXIT_USAGE
            )
        return requested
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
            f"cannot tell the format of --output {output}: name it .png, .svg, .pdf, .txt,"
            " .md, .json or .csv, or pass --format",
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


def cmd_report(args: argparse.Namespace) -> int:
    """`herd-operator report`: see the module docstring; returns the exit code."""
    from herd_operator.cli.report.figure import FIGURE_INCHES, draw_timeline, png_size
    from herd_operator.cli.report.series import job_sources, load_run
    from herd_operator.cli.report.tabular import format_csv, format_json
    from herd_operator.cli.report.text import format_summary

    try:
        kind = output_format(args.format, args.output)
        since = None if args.since is None else time.time() - args.since
        with open_store(args.state_dir) as store, store.snapshot():
            history = store.read_grant_history()
            if history.skipped:  # said once, here: the series below use what was read
                _progress(f"skipped {history.skipped_summary(store.path)}")
            sources = select_jobs(job_sources(store, history.changes), args.jobs, args.state_dir)
            _progress(f"reading {len(sources)} job{'s' if len(sources) != 1 else ''}...")
            run = load_run(store, args.state_dir, sources, since)
        if kind not in FIGURE_FORMATS:
            if kind in DATA_FORMATS:
                text = format_json(run) if kind == "json" else format_csv(run)
            else:
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
        if err.exit_code == EXIT_USAGE:
            raise UsageError(str(err)) from None
        print(f"herd-operator: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:
        print(f"herd-operator: cannot write the report: {err}", file=sys.stderr)
        return EXIT_FAILURE
