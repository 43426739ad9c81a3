"""Tests for `herd-operator bench` and the checkout's `python -m devtools.bench`: the
harness's arithmetic and files, and a --quick run of each.

No timing assertions: the machine is shared. The quick runs check that the
cheap benchmarks run end to end and that their results files are complete.
"""

from __future__ import annotations

import json
import math
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from devtools.bench.rpcflood import ensure_descriptors, flood_rows
from devtools.bench.soak import Sample, SoakPlan, job_processes, slope_per_hour, soak
from devtools.bench.suite import DEVELOPER_BENCHMARKS, EVERY
from devtools.bench.suite import main as devtools_bench
from herd_operator.bench.arbitration import first_fit, seeded_demands
from herd_operator.bench.driver import tree_cpu_seconds
from herd_operator.bench.harness import (
    Benchmark,
    Context,
    Row,
    Skip,
    Stats,
    missing_modules,
    paired_ratio_figures,
    percentile,
    render_markdown,
    run_benchmarks,
    select,
    write_results,
)
from herd_operator.bench.scale import write_specs
from herd_operator.bench.suite import BENCHMARKS
from herd_operator.bench.training import (
    StepLog,
    first_worker_forked,
    grant_seen,
    job_cpu_seconds,
    samples_per_second,
)
from herd_operator.cli import main
from herd_operator.runtime.log_format import log_time
from herd_operator.specs import load_spec_file
from herd_operator.specs.values import Demand, Placement, Pool

# Without the real-training benchmarks (test_slurm covers the multi-node path) and `soak`
# (30 s even with --quick; its own tests below).
# The torchrun rows start torch in every agent and worker: seconds of CPU each, too much
# for the smoke (their pure parts are tested below).
EXPENSIVE = (
    "resize-stall",
    "training-overhead",
    "torchrun-resize-stall",
    "torchrun-training-overhead",
    "torchrun-idle-cost",
    "multinode-resize",
    "soak",
)
CHEAP = [b.name for b in BENCHMARKS if b.name not in EXPENSIVE]
CHEAP_DEVELOPER = [b.name for b in DEVELOPER_BENCHMARKS if b.name not in EXPENSIVE]


def row(ours: list[float], baseline: list[float], better: Any = "lower") -> Row:
    return Row(
        name="r",
        what="w",
        unit="ms",
        better=better,
        baseline_label="b",
        baseline=Stats.of(baseline),
        ours=Stats.of(ours),
    )


# ---- statistics ----


def test_percentile_interpolates_between_neighbours() -> None:
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile([10.0, 20.0], 95) == pytest.approx(19.5)


def test_percentile_rejects_no_values_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match=r"^percentile of no values$"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"^percentile 101 is outside 0\.\.100$"):
        percentile([1.0], 101)


def test_stats_summarise_unsorted_samples() -> None:
    stats = Stats.of([5.0, 1.0, 3.0])
    assert (stats.median, stats.minimum, stats.maximum, stats.n) == (3.0, 1.0, 5.0, 3)
    assert stats.p5 == pytest.approx(1.2)
    assert stats.p95 == pytest.approx(4.8)
    with pytest.raises(ValueError, match=r"^no samples to summarise$"):
        Stats.of([])


def test_paired_ratios_cancel_a_drift_that_the_ratio_of_medians_keeps() -> None:
    # The machine slows down run after run; ours is always 10% slower than its pair.
    baseline = [100.0, 80.0, 60.0, 40.0]
    ours = [110.0, 88.0, 66.0, 44.0]
    figures = paired_ratio_figures(ours, baseline)
    assert figures["paired_ratio_median"] == pytest.approx(1.1)
    assert figures["paired_ratio_p5"] == pytest.approx(1.1)
    assert figures["paired_ratio_p95"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match=r"^3 runs of ours against 4 of the baseline$"):
        paired_ratio_figures(ours[:3], baseline)


def test_ratio_is_ours_over_baseline_and_json_never_holds_infinity() -> None:
    assert row([3.0], [2.0]).ratio == 1.5
    assert row([3.0], [2.0], "higher").to_json()["ratio_better"] == "higher"
    zero = row([1.0], [0.0])
    assert math.isinf(zero.ratio)
    assert zero.to_json()["ratio"] is None
    assert row([0.0], [0.0]).ratio == 1.0


# ---- selection and running ----


def test_select_keeps_registry_order_and_names_unknown_benchmarks() -> None:
    chosen = select(BENCHMARKS, "arbitration,spec-to-launch")
    assert [b.name for b in chosen] == ["spec-to-launch", "arbitration"]
    with pytest.raises(
        ValueError, match=r"^unknown benchmark\(s\): nope; choose from spec-to-launch, "
    ):
        select(BENCHMARKS, "nope,scale")
    assert [b.name for b in select(BENCHMARKS, None)] == [b.name for b in BENCHMARKS]


def fixed_rows(ctx: Context) -> list[Row]:
    assert ctx.scratch.is_dir()
    return [row([float(ctx.repeat)], [1.0])]


def needs_skip(ctx: Context) -> list[Row]:
    raise Skip("no GPU here")


def breaks(ctx: Context) -> list[Row]:
    raise RuntimeError("boom")


def test_run_benchmarks_skips_and_contains_failures() -> None:
    benchmarks = [
        Benchmark("missing", "w", fixed_rows, 3, requires=("no_such_module_for_bench",)),
        Benchmark("skips", "w", needs_skip, 3),
        Benchmark("fails", "w", breaks, 3),
        Benchmark("works", "w", fixed_rows, 3, quick_repeat=2),
    ]
    lines: list[str] = []
    outcomes = run_benchmarks(benchmarks, quick=True, repeat=None, progress=lines.append)
    by_name = {outcome.benchmark: outcome for outcome in outcomes}
    assert by_name["missing"].skipped == "skipped: no_such_module_for_bench not importable"
    assert by_name["skips"].skipped == "skipped: no GPU here"
    assert by_name["fails"].error == "RuntimeError: boom"
    assert by_name["works"].rows[0].ours.median == 2.0  # the quick repeat count reached it
    assert "fails: FAILED: RuntimeError: boom" in lines
    explicit = run_benchmarks(benchmarks[3:], quick=True, repeat=5, progress=lines.append)
    assert explicit[0].rows[0].ours.median == 5.0


def test_results_files_hold_rows_skips_and_machine(tmp_path: Path) -> None:
    benchmarks = [
        Benchmark("works", "what it does", fixed_rows, 4),
        Benchmark("skips", "w", needs_skip, 1),
    ]
    outcomes = run_benchmarks(benchmarks, quick=False, repeat=None, progress=lambda line: None)
    machine = {"cores": 2, "cpu_model": "test cpu"}
    markdown, report = write_results(tmp_path / "out", outcomes, machine, "herd-operator bench")
    document = json.loads(report.read_text())
    assert document["machine"]["cores"] == 2
    assert len(document["machine"]["load_average_after"]) == 3
    works, skips = document["benchmarks"]
    assert works["rows"][0]["ours"]["median"] == 4.0
    assert works["rows"][0]["ratio"] == 4.0
    assert skips == {
        "name": "skips",
        "what": "w",
        "seconds": skips["seconds"],
        "skipped": "skipped: no GPU here",
        "error": None,
        "rows": [],
    }
    text = markdown.read_text()
    assert "| r | b | 1 | 4 | 4-4 | 1 | ms | 4 | lower |" in text
    assert "| skips | skipped: no GPU here |" in text
    assert "- `works`: what it does" in text


def test_markdown_lists_secondary_figures() -> None:
    with_extra = Row(
        "x", "w", "req/s", "higher", "echo", Stats.of([2.0]), Stats.of([1.0]), {"p99_ms": 3.5}
    )
    outcomes = [
        run_benchmarks(
            [Benchmark("b", "w", lambda ctx: [with_extra], 1)],
            quick=False,
            repeat=None,
            progress=lambda line: None,
        )[0]
    ]
    assert "- x: p99_ms 3.5" in render_markdown(outcomes, {}, "cmd", [0.0, 0.0, 0.0])


# ---- benchmark helpers ----


def test_job_cpu_counts_only_the_processes_that_name_the_marker(tmp_path: Path) -> None:
    marker = str(tmp_path / "steps.txt")
    spin = (
        "import time\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end:\n"
        "    pass\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", spin, "--step-log", marker])
    try:
        deadline = time.monotonic() + 30
        while job_cpu_seconds(marker) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job_cpu_seconds(marker) >= 0.25
        assert job_cpu_seconds(str(tmp_path / "another-run.txt")) == 0.0
    finally:
        process.kill()
        process.wait()


def test_grant_seen_is_the_drivers_first_new_grant_after_the_trigger(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        f"{log_time(1000.500)} herd-driver: grant seen: {{'localhost': 2}}\n"
        "[0]<stdout>:epoch 1: world size 2\n"
        f"{log_time(1010.250)} herd-driver: grant seen: {{'localhost': 4}}\n"
        f"{log_time(1010.300)} herd-driver: starting worker localhost[2] as rank 2 of 4\n"
        f"{log_time(1020.000)} herd-driver: grant seen: {{'localhost': 2}}\n"
    )
    assert grant_seen(log, 1010.0) == 1010.25
    assert grant_seen(log, 1030.0) is None
    assert grant_seen(None, 0.0) is None  # a bare horovodrun run says nothing


def test_a_forked_worker_starts_when_the_driver_logs_its_fork(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_text(
        f"{log_time(1000.100)} herd-driver: worker rank 0 forked by the zygote: pid 41\n"
        f"{log_time(1010.300)} herd-driver: starting worker localhost[2] as rank 2 of 4\n"
        f"{log_time(1010.350)} herd-driver: worker rank 3 forked by the zygote: pid 44\n"
        f"{log_time(1010.420)} herd-driver: worker rank 2 forked by the zygote: pid 43\n"
    )
    assert first_worker_forked(log, 1010.0) == 1010.35
    assert first_worker_forked(log, 1011.0) is None
    assert first_worker_forked(None, 0.0) is None


def test_tree_cpu_leaves_out_the_idle_worker() -> None:
    spin = (
        "import subprocess, time\n"
        "worker = subprocess.Popen(['sleep', '60'])\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end:\n"
        "    pass\n"
        "time.sleep(60)\n"
    )
    process = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 30
        while tree_cpu_seconds(process.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(process.pid) >= 0.25
    finally:
        for child in psutil.Process(process.pid).children(recursive=True):
            child.kill()
        process.kill()
        process.wait()
    assert tree_cpu_seconds(process.pid) == 0.0  # gone: nothing to count


def test_the_scale_child_starts_without_the_spec_models() -> None:
    """The `scale` baseline (libyaml loads in a child) is measured against its own peak memory:
    a child that imported pydantic and the models would lift the baseline by ~15 MB."""
    probe = (
        "import sys, herd_operator.bench.scale; "
        "heavy = ('pydantic', 'specs', 'herd_operator.runtime'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "[]"


def test_generated_spec_files_are_valid_and_distinct(tmp_path: Path) -> None:
    write_specs(tmp_path, 25)
    loaded = [load_spec_file(path) for path in sorted(tmp_path.iterdir())]
    assert [spec.errors for spec in loaded] == [()] * 25
    assert len({spec.name for spec in loaded}) == 25


def test_first_fit_keeps_placements_and_fills_in_pool_order() -> None:
    pool = Pool.from_counts({"a": 2, "b": 2})
    demands = [Demand("x", 1, 3, 3), Demand("y", 1, 4, 4)]
    current = {"x": Placement((("b", (0,)),))}
    # x holds 1 and takes 2 more; y gets the single GPU left.
    assert first_fit(pool, demands, current) == 4


def test_seeded_demands_repeat_exactly() -> None:
    assert seeded_demands(50) == seeded_demands(50)
    assert all(d.min <= d.desired <= d.max for d in seeded_demands(50))


def test_step_log_skips_a_half_written_line(tmp_path: Path) -> None:
    path = tmp_path / "steps.txt"
    path.write_text("10.0 2\n10.5 2\n11.0 4\n11.5")
    assert StepLog(path).steps() == [(10.0, 2), (10.5, 2), (11.0, 4)]
    assert StepLog(tmp_path / "absent").steps() == []
    assert StepLog(path).wait_steps(2, 2, 0.0) == [10.0, 10.5]


def test_step_log_reads_on_from_where_it_stopped(tmp_path: Path) -> None:
    path = tmp_path / "steps.txt"
    path.write_text("10.0 2\n10.5")
    log = StepLog(path)
    assert log.steps() == [(10.0, 2)]
    with path.open("a") as more:
        more.write(" 2\n11.0 4\n")  # the half-written line is finished, and one more
    assert log.steps() == [(10.0, 2), (10.5, 2), (11.0, 4)]
    assert log.steps() == [(10.0, 2), (10.5, 2), (11.0, 4)]  # nothing read twice


def test_samples_per_second_counts_steps_between_first_and_last() -> None:
    # 4 steps end 0.5 s apart: 3 intervals of 32 samples on each of 2 workers.
    assert samples_per_second([0.0, 0.5, 1.0, 1.5], 2) == pytest.approx(3 * 32 * 2 / 1.5)


# ---- the command ----


def test_cli_rejects_unknown_benchmark(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "--only", "nope", "--output", str(tmp_path)]) == 2
    assert "herd-operator bench: unknown benchmark(s): nope;" in capsys.readouterr().err
    assert not (tmp_path / "benchmarks.json").exists()


def test_the_installed_command_offers_no_developer_benchmark(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["bench", "--only", "rpc-flood", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "herd-operator bench: unknown benchmark(s): rpc-flood;" in err
    offered = err.partition("choose from ")[2].strip().split(", ")
    assert offered == [bench.name for bench in BENCHMARKS]


def test_the_checkout_command_runs_every_benchmark_soak_last(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    names = [bench.name for bench in EVERY]
    assert names[: len(BENCHMARKS)] == [bench.name for bench in BENCHMARKS]
    assert len(set(names)) == len(names) and names[-1] == "soak"
    assert devtools_bench(["--only", "nope", "--output", str(tmp_path)]) == 2
    assert "python -m devtools.bench: unknown benchmark(s): nope;" in capsys.readouterr().err
    assert not (tmp_path / "benchmarks.json").exists()


QuickRun = tuple[int, Path, list[str], str]


@pytest.fixture(scope="module", params=["herd-operator bench", "python -m devtools.bench"])
def quick_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> QuickRun:
    """A --quick run of the cheap benchmarks of the installed command, and of the checkout's
    developer benchmarks; the latter from another working directory, since `rpcdrive`'s
    child processes must find the uninstalled `devtools` wherever a run was started."""
    output = tmp_path_factory.mktemp("bench") / "results"
    if request.param == "herd-operator bench":
        names = CHEAP
        code = main(["bench", "--quick", "--only", ",".join(names), "--output", str(output)])
    else:
        names = CHEAP_DEVELOPER
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(output.parent)
            args = ["--quick", "--only", ",".join(names), "--output", str(output)]
            code = devtools_bench(args)
    return code, output, names, request.param


def test_quick_run_succeeds_and_names_every_benchmark_it_ran(quick_run: QuickRun) -> None:
    code, output, names, program = quick_run
    assert code == 0
    document = json.loads((output / "benchmarks.json").read_text())
    ran = document["benchmarks"]
    assert [entry["name"] for entry in ran] == names
    assert [entry["error"] for entry in ran] == [None] * len(names)
    assert document["command"] == f"{program} --quick --only {','.join(names)} --output {output}"
    markdown = (output / "benchmarks.md").read_text()
    for name in names:
        assert f"- `{name}`:" in markdown


def test_quick_run_rows_are_complete(quick_run: QuickRun) -> None:
    _, output, _, _ = quick_run
    document = json.loads((output / "benchmarks.json").read_text())
    for entry in document["benchmarks"]:
        assert entry["rows"], f"{entry['name']} produced no rows"
        for result in entry["rows"]:
            assert result["ratio_better"] in ("lower", "higher")
            assert result["baseline"]["label"]
            assert result["ours"]["n"] >= 1
            assert result["ours"]["p5"] <= result["ours"]["median"] <= result["ours"]["p95"]
            assert result["ratio"] == pytest.approx(
                result["ours"]["median"] / result["baseline"]["median"]
            )
    machine = document["machine"]
    assert machine["cores"] >= 1
    assert set(machine) >= {"cpu_model", "python", "torch", "horovod", "git_commit", "date"}


# ---- rpc-flood ----


def test_rpc_flood_reports_calls_failures_and_the_flood_it_ran_under(tmp_path: Path) -> None:
    """Tiny numbers: 3 clients for two seconds, 40 idlers (over a server with 16 slots for
    unauthenticated connections that evicts silent ones after 0.1 s, so some are dropped
    and reconnect). With one second and 70 idlers a flood phase sometimes had no successful
    call at all (2 runs in 6, before and after this session's changes)."""
    lines: list[str] = []
    rows = flood_rows(
        Context(quick=True, repeat=1, scratch=tmp_path, progress=lines.append),
        clients=3,
        idlers=40,
        seconds=2.0,
        server_options={"max_unauthenticated": 16, "eviction_age": 0.1},
    )
    throughput, latency = rows
    assert throughput.name == "rpc-flood throughput, 3 clients, 40 idle connections"
    assert (throughput.unit, throughput.better) == ("req/s", "higher")
    assert (latency.unit, latency.better) == ("ms", "lower")
    extra = throughput.extra
    assert (extra["clients"], extra["idle_connections"], extra["seconds_per_phase"]) == (3, 40, 2.0)
    assert extra["calls_ok"] > 0 and extra["baseline_calls_ok"] > 0
    assert extra["calls_failed"] >= extra["calls_refused"] + extra["calls_timed_out"]
    # Every idler connected at least once, and the server dropped some to make room.
    assert extra["idler_connections"] >= 40
    assert extra["idler_drops"] > 0
    assert extra["open_file_limit"] >= 2 * (40 + 3)
    # Server log lines are counted, not printed; without idlers nothing is rejected.
    assert extra["server_warning_lines"] >= 0 and extra["server_stop_tracebacks"] >= 0
    assert extra["baseline_server_warning_lines"] == 0
    assert 0 < extra["baseline_p50_ms"] <= extra["baseline_p99_ms"]
    assert 0 < extra["ours_p50_ms"] <= extra["ours_p99_ms"]
    assert latency.ours.median == pytest.approx(extra["ours_p99_ms"])
    assert throughput.ratio == pytest.approx(throughput.ours.median / throughput.baseline.median)
    assert any("round 1 flooded:" in line for line in lines), lines
    json.dumps([row.to_json() for row in rows], allow_nan=False)  # results files refuse NaN


def test_descriptor_limit_is_left_alone_when_it_suffices() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit, note = ensure_descriptors(16)
    assert limit == soft or soft == resource.RLIM_INFINITY
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == soft
    assert "already covers the 16 needed" in note


# ---- soak ----

needs_training = pytest.mark.skipif(
    bool(missing_modules(("torch", "horovod.torch"))), reason="soak jobs need torch and horovod"
)


def tiny_soak_plan(seconds: float) -> SoakPlan:
    return SoakPlan(
        duration_s=seconds,
        warmup_s=6.0,
        sample_every_s=1.0,
        arrival_every_s=2.0,
        concurrency=2,
        resize_after_s=3.0,
        cancel_every=2,
        epochs=1,
        steps=10,
        step_delay_s=0.05,
        report_every_s=2.0,
    )


def processes_under(root: Path) -> list[int]:
    """The operator (its argv names the scratch dir) and the jobs (the launch-id marker)."""
    found = [pid for pid, _ in psutil_cmdline_hits(str(root))]
    found += [proc.pid for proc in job_processes(root / "soak" / "state")]
    return found


def psutil_cmdline_hits(marker: str) -> list[tuple[int, str]]:
    hits = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if marker in cmdline and proc.info["status"] != psutil.STATUS_ZOMBIE:
            hits.append((proc.pid, cmdline))
    return hits


def test_slope_is_least_squares_in_mb_per_hour() -> None:
    samples = [
        Sample(at=h * 3600.0, rss=int((100 + 2 * h) * 1e6), uss=0, threads=1, fds=1)
        for h in range(4)
    ]
    assert slope_per_hour(samples) == pytest.approx(2.0)
    assert slope_per_hour(samples[:1]) == 0.0


@needs_training
def test_soak_reports_its_figures_and_leaves_nothing_running(tmp_path: Path) -> None:
    ctx = Context(quick=True, repeat=1, scratch=tmp_path)
    rss, state = soak(ctx, tiny_soak_plan(25.0))
    assert rss.name == "soak: operator RSS"
    assert rss.baseline.median > 0 and rss.ours.median > 0
    assert rss.extra["jobs_written"] >= 2
    assert rss.extra["jobs_started"] >= 1
    for key in ("rss_slope_mb_per_hour", "threads_max", "fds_max", "uss_end_mb"):
        assert key in rss.extra
    assert rss.extra["threads_max"] >= 1 and rss.extra["fds_max"] >= 3
    assert state.extra["store_mb_end"] > 0
    assert state.extra["events_per_job"] > 0 and state.extra["logs_kb_per_job"] > 0
    assert state.ours.median >= state.extra["store_mb_end"]
    assert processes_under(tmp_path) == []


@needs_training
def test_an_interrupted_soak_stops_the_operator_and_its_jobs(tmp_path: Path) -> None:
    def interrupt_once_jobs_run(line: str) -> None:
        if "started 0," not in line:
            raise KeyboardInterrupt

    ctx = Context(quick=True, repeat=1, scratch=tmp_path, progress=interrupt_once_jobs_run)
    with pytest.raises(KeyboardInterrupt):
        soak(ctx, tiny_soak_plan(120.0))
    assert processes_under(tmp_path) == []
