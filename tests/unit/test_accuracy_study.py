"""The accuracy study's runner, in its tiny CI form: the table and the figure come out."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from herd_operator.agent.batching import BATCH_POLICIES, BatchPolicyName

# The study imports torch, scikit-learn and matplotlib: each test imports it when it runs,
# not this module when it is collected, which every xdist worker does (torch alone is about
# 2 CPU-s of each worker's collection). Installed is checked without importing them.
for _needed in ("torch", "sklearn", "matplotlib"):
    if importlib.util.find_spec(_needed) is None:
        pytest.skip(f"{_needed} is not installed", allow_module_level=True)

if TYPE_CHECKING:
    from examples.experiments.quality import RunResult


def test_tiny_study_writes_the_table_and_the_figure(tmp_path: Path) -> None:
    from examples.experiments import study

    assert study.main(["--out", str(tmp_path), "--tiny"]) == 0
    runs = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert len(runs) == len(BATCH_POLICIES) * 2  # two schedules, one seed
    table = (tmp_path / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| simulated | digits |")]
    configurations = {tuple(cell.strip() for cell in row.split("|")[3:5]) for row in rows}
    for policy in BATCH_POLICIES:
        assert (policy, "static-1") in configurations
        assert (policy, "up-1-2-4") in configurations
    accuracies = [float(m) for m in re.findall(r"\| (\d+\.\d\d) ± \d+\.\d\d \|", table)]
    assert len(accuracies) == len(BATCH_POLICIES) * 2
    assert all(10.0 < value <= 100.0 for value in accuracies), accuracies
    assert "gap, all schedules" in table
    figure = (tmp_path / "accuracy.png").read_bytes()
    assert figure[:8] == b"\x89PNG\r\n\x1a\n" and len(figure) > 10_000
    # A second run finds every configuration done and trains nothing again.
    assert study.main(["--out", str(tmp_path), "--tiny"]) == 0
    assert (tmp_path / "runs.jsonl").read_text().splitlines() == runs
    # The upscaling run really changed world size, at the schedule's thirds of the budget.
    for line in runs:
        run = json.loads(line)
        if run["config"]["schedule"] == "up-1-2-4":
            assert [world for _, world in run["worlds"]] == [1, 2, 4]


def test_simulated_preserve_batch_is_the_same_training_at_any_world_size() -> None:
    """Summed shard gradients are the global batch's mean gradient: the world size changes
    only the order of float additions, so the runs end within a few test samples."""
    from examples.experiments.data import load
    from examples.experiments.quality import RunConfig, simulate

    data = load("digits")
    base = RunConfig(dataset="digits", policy="preserve-batch", epochs=1, evaluations=2)
    one = simulate(base, data)
    for schedule in ["static-4", "down-4-2-1"]:
        other = simulate(replace(base, schedule=schedule), data)
        assert other.steps == one.steps
        assert abs(other.final_accuracy - one.final_accuracy) <= 3 / len(data.y_test)
    naive = replace(base, policy="naive", schedule="static-4")
    naive_run = simulate(naive, data)
    assert naive_run.steps < one.steps / 3, "naive at 4 workers takes 4x the batch"


def test_the_memory_schedule_resizes_where_the_memory_policy_decides() -> None:
    """Under naive the memory per GPU never falls, so the policy grows the job to its max;
    under preserve-batch it falls with each worker and the job settles at 3 (the memory
    model's numbers: examples/experiments/memory_schedule.py)."""
    from examples.experiments import study
    from examples.experiments.data import load
    from examples.experiments.quality import RunConfig, simulate

    data = load("digits")
    epoch = len(data.y_train)
    for policy, worlds in [("naive", [1, 2, 3, 4]), ("preserve-batch", [1, 2, 3])]:
        config = RunConfig(
            dataset="digits", policy=policy, schedule="memory", epochs=4, evaluations=2
        )
        run = simulate(config, data)
        assert run.worlds == [(index * epoch, world) for index, world in enumerate(worlds)]
        assert study.global_batches(config) == ("32/64/96/128" if policy == "naive" else "32")


def test_the_table_counts_a_memory_run_as_elastic() -> None:
    """preserve-batch's memory runs train at the static runs' global batch, so they enter the
    elastic-vs-static gap; naive's (32/64/96/128) match no static run and do not."""
    from examples.experiments import study
    from examples.experiments.quality import RunConfig, RunResult

    def run(policy: BatchPolicyName, schedule: str, accuracy: float) -> RunResult:
        config = RunConfig(dataset="digits", policy=policy, schedule=schedule)
        return RunResult(config, "simulated", accuracy, steps=1)

    runs = [
        run("preserve-batch", "static-1", 0.90),
        run("preserve-batch", "static-4", 0.91),
        run("preserve-batch", "memory", 0.88),
        run("naive", "static-1", 0.90),
        run("naive", "memory", 0.80),
    ]
    table = study.table(runs)
    assert "| simulated | digits | preserve-batch | memory | 32 | 0 | 88.00 ± 0.00 | 1 |" in table
    assert "| simulated | digits | naive | memory | 32/64/96/128 | 0 | 80.00 ± 0.00 | 1 |" in table
    assert "| simulated | digits | preserve-batch | 3.00 | 3.00 | - |" in table
    assert "| simulated | digits | naive | 10.00 | - | - |" in table


def test_comparison_puts_each_real_run_beside_its_simulation() -> None:
    from examples.experiments import study
    from examples.experiments.quality import RunConfig, RunResult

    config = RunConfig(dataset="digits", policy="naive", schedule="up-1-2-4")
    simulated = RunResult(
        config,
        "simulated",
        0.95,
        curve=[(10, 0.5), (20, 0.95)],
        steps=152,
        worlds=[(0, 1), (2694, 2), (5388, 4)],
    )
    real = RunResult(
        config,
        "horovodrun",
        0.94,
        curve=[(10, 0.52), (20, 0.94)],
        steps=152,
        worlds=[(0, 1), (2694, 2), (5500, 4)],
    )
    alone = RunResult(replace(config, seed=1), "horovodrun", 0.9)  # no simulation: no row
    rows = study.comparison([simulated, real, alone]).splitlines()[2:]
    assert rows == [
        "| digits | naive | up-1-2-4 | 0 | 94.00 | 95.00 | -1.00 | 152 / 152 "
        "| 0: 1; 2694: 2; 5500: 4 (simulated: 0: 1; 2694: 2; 5388: 4) | 2.00 |"
    ]
    assert study.comparison([simulated]) == ""


def test_an_adaptive_run_trains_until_the_fixed_runs_progress() -> None:
    """adaptive epochs are AdaScale progress: at 2 workers, larger batches at a gain below
    batch / base take more samples than the fixed run's pass, in fewer optimizer steps,
    and every evaluation mark (of progress) is reached."""
    from examples.experiments.data import load
    from examples.experiments.quality import RunConfig, simulate

    data = load("digits")
    config = RunConfig(
        dataset="digits", policy="adaptive", schedule="static-2", epochs=2, evaluations=2,
        max_batch=256,
    )  # fmt: skip
    run = simulate(config, data)
    fixed_steps = 2 * -(-len(data.y_train) // 32)
    assert max(batch for _, batch in run.batches) > 32  # the operator's batch was taken
    assert run.samples > 2 * len(data.y_train)
    assert run.steps < fixed_steps
    assert len(run.curve) == 2 and run.curve[-1][0] == run.samples
