"""The accuracy study: every schedule in every batch policy, several seeds, one sample budget.

    python -m examples.experiments.study --out results/accuracy            # the full study
    python -m examples.experiments.study --out /tmp/tiny --tiny            # CI's version

Runs are simulated in this process by default (`quality.simulate`: k workers' gradients
summed as an allreduce would) or run under real Elastic Horovod with `--engine horovodrun`
(`train_quality.py --drive-hosts`: rank 0 writes the discovery file at the step where the
simulation changes the world size, and the workers wait there until Horovod has resized).
Each finished run is appended to `<out>/runs.jsonl`, and a rerun skips what is there, so
a study can be stopped and continued. At the end it writes `<out>/table.md` (final test
accuracy, mean and std over seeds, per configuration, and the gaps per policy) and
`<out>/accuracy.png` (test accuracy against samples seen, one line per schedule), and,
where `<out>` holds the same configuration run on both engines, `<out>/comparison.md`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from examples.experiments.data import DATASETS, load
from examples.experiments.memory_schedule import MEMORY_SCHEDULE
from examples.experiments.quality import (
    SCHEDULE_NAMES,
    RunConfig,
    RunResult,
    schedule_for,
    simulate,
)
from herd_operator.agent.batching import BATCH_POLICIES, plan_batches

REPO = Path(__file__).resolve().parents[2]
STUDY_SCHEDULES = ("static-1", "static-2", "static-4", "up-1-2-4", "down-4-2-1", MEMORY_SCHEDULE)
ELASTIC = ("up-1-2-4", "down-4-2-1", "bounce-2-1-2", MEMORY_SCHEDULE)
"""The schedules that resize; the memory policy's runs do (1 -> 2 -> 3 at least)."""


ADAPTIVE_MAX_BATCH = 256
"""The adaptive runs' largest global batch: 8 times the base batch of 32."""


def run_key(config: RunConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


def read_runs(path: Path) -> list[RunResult]:
    if not path.exists():
        return []
    return [RunResult.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line]


def run_horovodrun(config: RunConfig, workdir: Path, timeout: float = 1800) -> RunResult:
    """`config` under real Elastic Horovod, resized by its schedule through the discovery file
    (which the job's rank 0 rewrites itself, see `train_quality.follow_schedule`)."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    schedule = schedule_for(config)
    hosts, result = workdir / "hosts", workdir / "result.json"
    discovery = workdir / "discover.sh"
    discovery.write_text(f"#!/bin/sh\nexec cat {hosts}\n")
    discovery.chmod(0o755)
    world = schedule.world_at(0.0)
    hosts.write_text(f"localhost:{world}\n")
    python = sys.executable
    command = [
        str(Path(python).with_name("horovodrun")),
        *("-np", str(world), "--min-np", "1", "--max-np", str(schedule.max_workers)),
        *("--host-discovery-script", str(discovery), "--network-interface", "lo"),
        *(python, "-m", "examples.experiments.train_quality"),
        *("--dataset", config.dataset, "--policy", config.policy, "--schedule", config.schedule),
        *("--seed", str(config.seed), "--epochs", str(config.epochs)),
        *("--worker-batch", str(config.worker_batch), "--lr", str(config.lr)),
        *("--reference-workers", str(config.reference_workers)),
        *("--warmup-steps", str(config.warmup_steps), "--evaluations", str(config.evaluations)),
        *("--drive-hosts", str(hosts), "--result", str(result)),
        *("--step-log", str(workdir / "steps")),
    ]
    if config.max_worker_batch is not None:
        command += ["--max-worker-batch", str(config.max_worker_batch)]
    if config.max_batch is not None:
        command += ["--max-batch", str(config.max_batch)]
    if not config.decay:
        command.append("--no-decay")
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    # Gloo's rendezvous waits 30 s by default for a new worker, which a worker that imports
    # torch on a loaded machine can miss (then the grow fails and the job stops).
    env = {"HOROVOD_GLOO_TIMEOUT_SECONDS": "300", **os.environ, "PYTHONPATH": path}
    with (workdir / "horovodrun.log").open("w") as output:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=output)
        try:
            process.wait(timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if process.returncode != 0 or not result.exists():
        raise RuntimeError(f"horovodrun failed ({process.returncode}): see {workdir}")
    return RunResult.from_dict(json.loads(result.read_text()))


def global_batches(config: RunConfig) -> str:
    """The global batch sizes a configuration trains at, as text."""
    settings = config.settings()
    if settings.policy == "adaptive":  # chosen during the run: the bounds
        return f"{settings.reference_batch}..{settings.max_batch or settings.reference_batch}"
    worlds = sorted({workers for _, workers in schedule_for(config).phases})
    sizes = []
    for world in worlds:
        size = plan_batches(settings, world).global_batch
        if size not in sizes:
            sizes.append(size)
    return "/".join(str(size) for size in sizes)


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) if len(values) > 1 else 0.0


def table(runs: Iterable[RunResult]) -> str:
    """The study's table: one row per configuration (over seeds), then the gaps per policy."""
    groups: dict[tuple[str, str, str, str], list[RunResult]] = defaultdict(list)
    for run in runs:
        config = run.config
        groups[(run.engine, config.dataset, config.policy, config.schedule)].append(run)
    lines = [
        "| engine | data | policy | schedule | global batch | seeds | test accuracy % "
        "(mean ± std) | optimizer steps |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {name: index for index, name in enumerate(SCHEDULE_NAMES)}
    policies = {name: index for index, name in enumerate(BATCH_POLICIES)}
    keys = sorted(groups, key=lambda k: (k[0], k[1], policies[k[2]], order.get(k[3], 99)))
    summary: dict[tuple[str, str, str], dict[str, float]] = defaultdict(dict)
    for key in keys:
        group = groups[key]
        mean, std = mean_std([run.final_accuracy * 100 for run in group])
        summary[key[:3]][key[3]] = mean
        seeds = ",".join(str(run.config.seed) for run in sorted(group, key=lambda r: r.config.seed))
        steps = statistics.fmean(run.steps for run in group)
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {global_batches(group[0].config)} "
            f"| {seeds} | {mean:.2f} ± {std:.2f} | {steps:.0f} |"
        )
    lines += [
        "",
        "Gaps in points of mean test accuracy: all = best minus worst schedule; "
        "elastic vs static = the largest distance of an elastic schedule's mean from a static "
        "one's at the same global batch; down - up = downscaling minus upscaling.",
        "",
        "| engine | data | policy | gap, all schedules | elastic vs static, same batch "
        "| down - up |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (engine, dataset, policy), means in sorted(
        summary.items(), key=lambda item: (item[0][0], item[0][1], policies[item[0][2]])
    ):
        spread = max(means.values()) - min(means.values())
        same = elastic_vs_static(engine, dataset, policy, means, groups)
        down_up = (
            f"{means['down-4-2-1'] - means['up-1-2-4']:+.2f}"
            if "down-4-2-1" in means and "up-1-2-4" in means
            else "-"
        )
        lines.append(
            f"| {engine} | {dataset} | {policy} | {spread:.2f} | "
            f"{'-' if same is None else f'{same:.2f}'} | {down_up} |"
        )
    return "\n".join(lines) + "\n"


def elastic_vs_static(
    engine: str,
    dataset: str,
    policy: str,
    means: dict[str, float],
    groups: dict[tuple[str, str, str, str], list[RunResult]],
) -> float | None:
    """The largest |elastic mean - static mean| over pairs that train at one global batch."""
    gaps = []
    for elastic, static in itertools.product(means, means):
        if elastic not in ELASTIC or not static.startswith("static-"):
            continue
        one = global_batches(groups[(engine, dataset, policy, elastic)][0].config)
        other = global_batches(groups[(engine, dataset, policy, static)][0].config)
        if one == other:
            gaps.append(abs(means[elastic] - means[static]))
    return max(gaps) if gaps else None


def comparison(runs: Iterable[RunResult]) -> str:
    """Each configuration run under horovodrun beside its simulation (same config, seed):
    final test accuracy, optimizer steps, where the world size changed, and the largest
    distance between the two accuracy curves at their evaluation points. Empty when no
    configuration ran on both."""
    by_engine: dict[str, dict[str, RunResult]] = defaultdict(dict)
    for run in runs:
        by_engine[run.engine][run_key(run.config)] = run
    pairs = [
        (real, by_engine["simulated"][key])
        for key, real in by_engine["horovodrun"].items()
        if key in by_engine["simulated"]
    ]
    if not pairs:
        return ""
    order = {name: index for index, name in enumerate(SCHEDULE_NAMES)}
    policies = {name: index for index, name in enumerate(BATCH_POLICIES)}
    pairs.sort(
        key=lambda pair: (
            pair[0].config.dataset,
            policies[pair[0].config.policy],
            order.get(pair[0].config.schedule, 99),
            pair[0].config.seed,
        )
    )
    lines = [
        "| data | policy | schedule | seed | accuracy % horovodrun | simulated | difference "
        "| steps horovodrun / simulated | world changes (samples: workers) | largest curve "
        "distance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for real, simulated in pairs:
        config = real.config
        worlds = "; ".join(f"{seen}: {world}" for seen, world in real.worlds)
        if real.worlds != simulated.worlds:
            worlds += (
                " (simulated: "
                + "; ".join(f"{seen}: {world}" for seen, world in simulated.worlds)
                + ")"
            )
        else:
            worlds += " (same)"
        # Point by point: the same evaluation steps (an older train_quality labelled a
        # point by the samples after the step that crossed the mark, not by the mark).
        curve = "-"
        if len(real.curve) == len(simulated.curve) and real.curve:
            distances = [
                abs(one[1] - other[1]) * 100
                for one, other in zip(real.curve, simulated.curve, strict=True)
            ]
            curve = f"{max(distances):.2f}"
        difference = (real.final_accuracy - simulated.final_accuracy) * 100
        lines.append(
            f"| {config.dataset} | {config.policy} | {config.schedule} | {config.seed} "
            f"| {100 * real.final_accuracy:.2f} | {100 * simulated.final_accuracy:.2f} "
            f"| {difference:+.2f} | {real.steps} / {simulated.steps} | {worlds} | {curve} |"
        )
    return "\n".join(lines) + "\n"


def figure(runs: Sequence[RunResult], path: Path) -> None:
    """Test accuracy against samples seen: a panel per (engine, data set, policy), a line per
    schedule (the mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted({(run.engine, run.config.dataset) for run in runs})
    columns = [p for p in BATCH_POLICIES if any(run.config.policy == p for run in runs)]
    fig, axes = plt.subplots(
        len(rows), len(columns), figsize=(4.2 * len(columns), 3.2 * len(rows)), squeeze=False
    )
    for (row, (engine, dataset)), (column, policy) in itertools.product(
        enumerate(rows), enumerate(columns)
    ):
        axis = axes[row][column]
        curves: dict[str, list[list[tuple[int, float]]]] = defaultdict(list)
        for run in runs:
            if (run.engine, run.config.dataset, run.config.policy) == (engine, dataset, policy):
                curves[run.config.schedule].append(run.curve)
        for schedule in sorted(curves, key=lambda name: SCHEDULE_NAMES.index(name)):
            points = min(len(curve) for curve in curves[schedule])
            xs = [curves[schedule][0][index][0] for index in range(points)]
            ys = [
                100 * statistics.fmean(curve[index][1] for curve in curves[schedule])
                for index in range(points)
            ]
            axis.plot(xs, ys, label=schedule, linestyle="-" if "static" in schedule else "--")
        axis.set_title(f"{dataset}, {policy} ({engine})", fontsize=9)
        axis.set_xlabel("samples seen")
        axis.set_ylabel("test accuracy %")
        axis.grid(alpha=0.3)
        if curves:  # a panel can be empty when only part of a study ran
            axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = RunConfig()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--engine", choices=["simulated", "horovodrun"], default="simulated")
    parser.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS))
    parser.add_argument("--policies", nargs="+", choices=BATCH_POLICIES, default=BATCH_POLICIES)
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULE_NAMES, default=list(STUDY_SCHEDULES)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=defaults.epochs, help="the sample budget")
    parser.add_argument("--worker-batch", type=int, default=defaults.worker_batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument(
        "--no-decay", action="store_true", help="a constant rate (no cosine decay over the budget)"
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=ADAPTIVE_MAX_BATCH,
        help="adaptive: the largest global batch the goodput policy may pick",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="CI: one seed, digits, one epoch, two schedules"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        args.datasets, args.seeds, args.epochs = ["digits"], [0], 1
        args.schedules = ["static-1", "up-1-2-4"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs_file = args.out / "runs.jsonl"
    runs = read_runs(runs_file)
    done = {(run.engine, run_key(run.config)) for run in runs}
    base = RunConfig(
        epochs=args.epochs,
        worker_batch=args.worker_batch,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        decay=not args.no_decay,
        evaluations=4 if args.tiny else RunConfig().evaluations,
    )
    data_cache = {}
    for dataset, policy, schedule, seed in itertools.product(
        args.datasets, args.policies, args.schedules, args.seeds
    ):
        config = replace(base, dataset=dataset, policy=policy, schedule=schedule, seed=seed)
        if policy == "adaptive":
            config = replace(config, max_batch=args.max_batch)
        if (args.engine, run_key(config)) in done:
            continue
        if args.engine == "simulated":
            if dataset not in data_cache:
                data_cache[dataset] = load(dataset)
            result = simulate(config, data_cache[dataset])
        else:
            workdir = args.out / "horovodrun" / f"{dataset}-{policy}-{schedule}-{seed}"
            result = run_horovodrun(config, workdir)
        print(
            f"{result.engine} {dataset} {policy} {schedule} seed {seed}: "
            f"{100 * result.final_accuracy:.2f}% in {result.seconds:.1f}s",
            flush=True,
        )
        with runs_file.open("a") as handle:
            handle.write(json.dumps(result.to_dict()) + "\n")
        runs.append(result)
    (args.out / "table.md").write_text(table(runs))
    compared = comparison(runs)
    if compared:
        (args.out / "comparison.md").write_text(compared)
    figure(runs, args.out / "accuracy.png")
    print(f"wrote {args.out / 'table.md'} and {args.out / 'accuracy.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
