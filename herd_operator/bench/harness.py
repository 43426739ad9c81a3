"""The benchmark harness: runs benchmarks, summarises samples, writes Markdown and JSON.

Every number is reported next to a baseline measured in the same run, as a
ratio: this machine is shared, and absolute times drift from run to run while
ratios taken minutes apart hold.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import json
import math
import os
import platform
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Better = Literal["lower", "higher"]


@dataclass(frozen=True)
class Stats:
    """Summary of repeated measurements of one quantity."""

    median: float
    p5: float
    p95: float
    minimum: float
    maximum: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no samples to summarise")
        ordered = sorted(values)
        return cls(
            median=percentile(ordered, 50),
            p5=percentile(ordered, 5),
            p95=percentile(ordered, 95),
            minimum=ordered[0],
            maximum=ordered[-1],
            n=len(ordered),
        )

    def to_json(self) -> dict[str, float | int]:
        return {
            "median": self.median,
            "p5": self.p5,
            "p95": self.p95,
            "min": self.minimum,
            "max": self.maximum,
            "n": self.n,
        }


def paired_ratio_figures(ours: Sequence[float], baseline: Sequence[float]) -> dict[str, float]:
    """Median and p5-p95 of ours[i] / baseline[i], for runs made in adjacent pairs.

    On a shared machine the load drifts over minutes; a pair run back to back sees the
    same load, so the per-pair ratio cancels the drift that the ratio of medians keeps.
    """
    if len(ours) != len(baseline):
        raise ValueError(f"{len(ours)} runs of ours against {len(baseline)} of the baseline")
    ratios = Stats.of([mine / theirs for mine, theirs in zip(ours, baseline, strict=True)])
    return {
        "paired_ratio_median": ratios.median,
        "paired_ratio_p5": ratios.p5,
        "paired_ratio_p95": ratios.p95,
    }


def percentile(ordered: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, interpolating between neighbours."""
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0..100")
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Row:
    """One line of the results: our median against a baseline's, in the same unit."""

    name: str
    what: str
    unit: str
    better: Better
    baseline_label: str
    baseline: Stats
    ours: Stats
    extra: Mapping[str, float] = field(default_factory=dict)
    """Secondary figures (latency percentiles, memory), printed beside the row."""

    @property
    def ratio(self) -> float:
        """ours / baseline; compare with `better` to read it."""
        if self.baseline.median == 0:
            return math.inf if self.ours.median else 1.0
        return self.ours.median / self.baseline.median

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "what": self.what,
            "unit": self.unit,
            "baseline": {"label": self.baseline_label, **self.baseline.to_json()},
            "ours": self.ours.to_json(),
            "ratio": self.ratio if math.isfinite(self.ratio) else None,
            "ratio_better": "lower" if self.better == "lower" else "higher",
            "extra": dict(self.extra),
        }


@dataclass(frozen=True)
class Context:
    """What a benchmark run is told: size, how many measured repetitions, a scratch dir."""

    quick: bool
    repeat: int
    scratch: Path
    progress: Callable[[str], None] = lambda line: None


class Skip(Exception):
    """A benchmark cannot run here (a missing module, a missing tool); the text says why."""


@dataclass(frozen=True)
class Benchmark:
    name: str
    what: str
    run: Callable[[Context], list[Row]]
    full_repeat: int
    quick_repeat: int = 1
    requires: tuple[str, ...] = ()
    """Importable modules it needs; without them it is skipped, not failed."""


@dataclass(frozen=True)
class Outcome:
    benchmark: str
    what: str
    rows: tuple[Row, ...]
    seconds: float
    skipped: str | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.benchmark,
            "what": self.what,
            "seconds": self.seconds,
            "skipped": self.skipped,
            "error": self.error,
            "rows": [row.to_json() for row in self.rows],
        }


def select(benchmarks: Sequence[Benchmark], only: str | None) -> list[Benchmark]:
    """The benchmarks named in a comma-separated `only` (all when None), in registry order."""
    if only is None:
        return list(benchmarks)
    wanted = [name.strip() for name in only.split(",") if name.strip()]
    known = {bench.name for bench in benchmarks}
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(
            f"unknown benchmark(s): {', '.join(unknown) or '(none named)'};"
            f" choose from {', '.join(bench.name for bench in benchmarks)}"
        )
    return [bench for bench in benchmarks if bench.name in wanted]


def missing_modules(names: Sequence[str]) -> list[str]:
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def run_benchmarks(
    benchmarks: Sequence[Benchmark],
    *,
    quick: bool,
    repeat: int | None,
    progress: Callable[[str], None],
) -> list[Outcome]:
    """Run each benchmark in its own scratch directory; a failure costs only that benchmark."""
    outcomes = []
    for bench in benchmarks:
        started = time.perf_counter()
        missing = missing_modules(bench.requires)
        if missing:
            note = f"skipped: {', '.join(missing)} not importable"
            progress(f"{bench.name}: {note}")
            outcomes.append(Outcome(bench.name, bench.what, (), 0.0, skipped=note))
            continue
        count = (
            repeat if repeat is not None else (bench.quick_repeat if quick else bench.full_repeat)
        )
        progress(f"{bench.name}: running ({count} repetitions{', quick' if quick else ''})")
        with tempfile.TemporaryDirectory(prefix=f"herd-bench-{bench.name}-") as scratch:
            context = Context(quick, count, Path(scratch), progress)
            try:
                rows = tuple(bench.run(context))
            except Skip as skip:
                note = f"skipped: {skip}"
                outcomes.append(
                    Outcome(bench.name, bench.what, (), time.perf_counter() - started, note)
                )
                progress(f"{bench.name}: {note}")
                continue
            except Exception as err:
                detail = "".join(traceback.format_exception_only(err)).strip()
                outcomes.append(
                    Outcome(bench.name, bench.what, (), time.perf_counter() - started, error=detail)
                )
                progress(f"{bench.name}: FAILED: {detail}")
                continue
        seconds = time.perf_counter() - started
        outcomes.append(Outcome(bench.name, bench.what, rows, seconds))
        for row in rows:
            progress(
                f"{bench.name}: {row.name}: ours {format_value(row.ours.median)} {row.unit}, "
                f"baseline {format_value(row.baseline.median)}, ratio {row.ratio:.3g}"
                f" ({row.better} is better)"
            )
        progress(f"{bench.name}: done in {seconds:.1f} s")
    return outcomes


def timed_repeats(action: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Wall seconds of `repeat` calls of `action`, after `warmup` unmeasured ones."""
    for _ in range(warmup):
        action()
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return samples


# ---- machine block ----


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    return platform.processor() or "unknown"


def module_version(name: str) -> str | None:
    """A module's __version__, or None when it is not importable."""
    try:
        module = importlib.import_module(name)
    except Exception:  # a broken install (e.g. Horovod built against another torch) counts too
        return None
    version = getattr(module, "__version__", None)
    return str(version) if version is not None else "unknown"


def git_commit(repo: Path) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = subprocess.run(
        ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    return done.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine_info(repo: Path) -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cores": os.cpu_count(),
        "cpu_model": cpu_model(),
        "python": platform.python_version(),
        "torch": module_version("torch"),
        "horovod": module_version("horovod"),
        "git_commit": git_commit(repo),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "load_average_before": [round(value, 2) for value in load],
    }


# ---- output ----


def format_value(value: float) -> str:
    if math.isinf(value) or math.isnan(value):
        return str(value)
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 1:
        return f"{value:.3g}" if magnitude < 100 else f"{value:.0f}"
    return f"{value:.3g}"


def _spread(stats: Stats) -> str:
    return f"{format_value(stats.p5)}-{format_value(stats.p95)}"


def render_markdown(
    outcomes: Sequence[Outcome],
    machine: Mapping[str, Any],
    command: str,
    load_after: Sequence[float],
) -> str:
    lines = [
        "# herd-operator benchmarks",
        "",
        f"Command: `{command}`",
        "",
        "Ratio is ours / baseline; the `better` column says which direction is good.",
        "Spread is p5-p95 over n repetitions.",
        "",
        "| benchmark | baseline | baseline median | ours median | ours p5-p95 | n | unit"
        " | ratio | better |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for outcome in outcomes:
        if outcome.skipped or outcome.error:
            lines.append(
                f"| {outcome.benchmark} | {outcome.skipped or 'FAILED: ' + str(outcome.error)}"
                " | | | | | | | |"
            )
            continue
        for row in outcome.rows:
            lines.append(
                f"| {row.name} | {row.baseline_label} | {format_value(row.baseline.median)}"
                f" | {format_value(row.ours.median)} | {_spread(row.ours)} | {row.ours.n}"
                f" | {row.unit} | {row.ratio:.3g} | {row.better} |"
            )
            if row.extra:
                figures = ", ".join(f"{key} {format_value(v)}" for key, v in row.extra.items())
                notes.append(f"- {row.name}: {figures}")
    if notes:
        lines += ["", "Details:", "", *notes]
    lines += ["", "What each benchmark measures:", ""]
    lines += [f"- `{outcome.benchmark}`: {outcome.what}" for outcome in outcomes]
    lines += ["", "Machine:", ""]
    lines += [f"- {key}: {value}" for key, value in machine.items()]
    lines.append(f"- load_average_after: {[round(value, 2) for value in load_after]}")
    return "\n".join(lines) + "\n"


def write_results(
    output: Path, outcomes: Sequence[Outcome], machine: Mapping[str, Any], command: str
) -> tuple[Path, Path]:
    """Write `benchmarks.md` and `benchmarks.json` into `output`; returns their paths."""
    output.mkdir(parents=True, exist_ok=True)
    load_after = list(os.getloadavg())
    markdown = output / "benchmarks.md"
    markdown.write_text(render_markdown(outcomes, machine, command, load_after))
    document = {
        "command": command,
        "machine": {**machine, "load_average_after": load_after},
        "benchmarks": [outcome.to_json() for outcome in outcomes],
    }
    report = output / "benchmarks.json"
    report.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    return markdown, report


def stop_session(process: subprocess.Popen[bytes], grace: float = 15.0) -> None:
    """SIGTERM the session `process` leads (it was started with `start_new_session`), and
    SIGKILL it when it has not ended after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
