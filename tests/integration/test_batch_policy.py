"""preserve-batch on a real job: the operator resizes it 2 -> 1 -> 2 (schedule policy), and
the workers' own step logs show a fixed global batch and learning rate and every sample of
every epoch trained on exactly once."""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from herd_operator.agent.batching import epoch_order
from tests.integration.harness import REPO, OperatorHarness, spec_document

EPOCHS = 7
"""Two at 2, two at 1, then back at 2 from epoch 4: a grow stalls training until the new
worker joins, so it lands in epoch 4 (step 1 here at load 7-9) and epochs 5-6 are margin."""
GLOBAL_BATCH = 64  # --worker-batch 32 at --reference-workers 2
LR = 0.05
SEED = 3
DIGITS_TRAIN = 1347  # examples/experiments/data.py: 75% of sklearn's 1,797 digits


def read_steps(directory: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(directory.glob("worker-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def committed_chain(
    records: list[dict[str, Any]], epoch_size: int, epochs: int = EPOCHS, by: str = "epoch"
) -> list[list[dict[str, Any]]]:
    """Per step that counts, the records of all its ranks, in training order.

    A step rolled back by a failed allreduce (a removed worker) is done again from the
    same cursor at the new world size; the last attempt at a cursor is the one kept.
    `by="pass"`: `epochs` counts passes over the data (an adaptive epoch is progress, not
    a pass), and the last one may end early, where the progress did.
    """
    attempts: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        attempts[(record[by], record["cursor"], record["world"])].append(record)
    latest: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for (epoch, cursor, _), group in attempts.items():
        kept = latest.get((epoch, cursor))
        if kept is None or max(r["time"] for r in group) > max(r["time"] for r in kept):
            latest[(epoch, cursor)] = group
    chain = []
    for epoch in range(epochs):
        cursor = 0
        while cursor < epoch_size:
            if by == "pass" and epoch == epochs - 1 and (epoch, cursor) not in latest:
                return chain  # the run's progress ended within its last pass
            assert (epoch, cursor) in latest, f"epoch {epoch}: no step starts at {cursor}"
            group = latest[(epoch, cursor)]
            chain.append(group)
            cursor += group[0]["count"]
        assert cursor == epoch_size, f"epoch {epoch} overran: {cursor}"
    return chain


def test_preserve_batch_keeps_batch_and_lr_and_each_sample_once_across_2_1_2(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    steps_dir = tmp_path / "steps"
    command = [
        "python",
        "-m",
        "examples.experiments.train_quality",
        *("--dataset", "digits", "--epochs", str(EPOCHS), "--seed", str(SEED)),
        # The script asks for naive: the spec's preserve-batch must win.
        *("--policy", "naive", "--worker-batch", "32", "--reference-workers", "2"),
        *("--lr", str(LR), "--no-decay", "--evaluations", "2"),
        *("--step-log", str(steps_dir), "--step-delay", "0.08"),
    ]
    schedule = {
        "name": "schedule",
        "params": {"initial": 2, "steps": [{"atEpoch": 2, "gpus": 1}, {"atEpoch": 4, "gpus": 2}]},
    }
    training = {"batchPolicy": "preserve-batch", "maxWorkerBatch": 32}
    herd.write_spec(
        spec_document(
            "quality",
            1,
            2,
            command,
            policy=schedule,
            training=training,
            env={"PYTHONPATH": str(REPO)},
        )
    )

    def succeeded() -> bool:
        condition = herd.condition("quality", "Succeeded")
        return condition is not None and condition["status"] == "True"

    herd.wait_for(succeeded, "the job to finish", timeout=240, job="quality")

    records = read_steps(steps_dir)
    chain = committed_chain(records, DIGITS_TRAIN)
    # The world went 2 -> 1 -> 2, as the workers saw it.
    worlds = [group[0]["world"] for group in chain]
    changes = [worlds[0]] + [b for a, b in itertools.pairwise(worlds) if a != b]
    assert changes == [2, 1, 2], changes

    last_step = DIGITS_TRAIN % GLOBAL_BATCH
    for epoch in range(EPOCHS):
        order = epoch_order(DIGITS_TRAIN, SEED, epoch)
        seen: list[int] = []
        for group in (g for g in chain if g[0]["epoch"] == epoch):
            world, cursor, count = group[0]["world"], group[0]["cursor"], group[0]["count"]
            assert sorted(r["rank"] for r in group) == list(range(world)), group
            for record in group:
                # Fixed at every world size: the global batch and the rate.
                assert record["global_batch"] == GLOBAL_BATCH
                assert record["lr"] == LR and record["policy_lr"] == LR
                assert record["count"] == count
                if count == GLOBAL_BATCH:
                    # 64 samples: 32 per worker at 2, two micro-batches of 32 at 1.
                    assert record["micro_batches"] == ([32] if world == 2 else [32, 32])
            assert count in (GLOBAL_BATCH, last_step), count
            indices = [i for record in group for i in record["indices"]]
            assert sorted(indices) == sorted(order[cursor : cursor + count])
            seen += indices
        assert sorted(seen) == list(range(DIGITS_TRAIN)), f"epoch {epoch}: not each sample once"
        assert len(seen) == len(set(seen))


def test_simulated_workers_train_like_real_horovodrun(tmp_path: Path) -> None:
    """The study's in-process simulation of k workers is the same training as horovodrun's:
    the same steps, the same resizes at the same samples, the same test accuracy."""
    from examples.experiments.data import load
    from examples.experiments.quality import RunConfig, simulate
    from examples.experiments.study import run_horovodrun

    config = RunConfig(
        dataset="digits", policy="naive", schedule="bounce-2-1-2", epochs=1, evaluations=3
    )
    real = run_horovodrun(config, tmp_path / "run", timeout=240)
    simulated = simulate(config, load("digits"))
    # The first step at or past a third (449) and two thirds (898) of the 1,347 samples:
    # steps of 64 at 2 workers, of 32 at 1.
    assert simulated.worlds == [(0, 2), (512, 1), (928, 2)]
    assert real.worlds == simulated.worlds
    assert real.steps == simulated.steps
    assert [mark for mark, _ in real.curve] == [mark for mark, _ in simulated.curve]
    # Only the order of float additions differs: at most a test sample or two.
    test_samples = len(load("digits").y_test)
    for (_, ours), (_, theirs) in zip(real.curve, simulated.curve, strict=True):
        assert abs(ours - theirs) <= 2 / test_samples


ADAPTIVE_EPOCHS = 8
"""Base batch at 2 workers until the noise scale is measured and the operator's choice
reaches them (within epoch 0, `MEASURE_STEPS` after its measurement), then its batch at 2;
the shrink lands an epoch or two later; the rest at 1 worker is margin for a slow shrink."""
MEASURE_STEPS = 8
"""`training.measureSteps`: the report 9 steps into a configuration (the first is not
timed), the operator's batch taken 8 later; an epoch at the base batch is 43 steps."""


def test_adaptive_batch_follows_the_operators_choice_across_a_shrink(
    herd: OperatorHarness, tmp_path: Path
) -> None:
    """goodput picks a batch for the job's 2 GPUs from the noise scale the workers measure;
    the workers train at it; a shrink to 1 GPU (the spec's max lowered) gives another, within
    maxBatch, in micro-batches of at most maxWorkerBatch; every epoch's report carries the
    adaptive metrics, and so does a measurement a few steps into each configuration, which
    reaches the operator before the first epoch's end (issue 31)."""
    steps_dir = tmp_path / "steps"
    command = [
        "python",
        "-m",
        "examples.experiments.train_quality",
        *("--dataset", "digits", "--epochs", str(ADAPTIVE_EPOCHS), "--seed", str(SEED)),
        *("--policy", "naive", "--worker-batch", "16", "--reference-workers", "2"),
        *("--lr", str(LR), "--no-decay", "--evaluations", "1"),
        *("--step-log", str(steps_dir), "--step-delay", "0.15"),
    ]
    training = {
        "batchPolicy": "adaptive", "maxWorkerBatch": 64, "maxBatch": 256,
        "measureSteps": MEASURE_STEPS,
    }  # fmt: skip

    # min stays 1 (Horovod's --min-np is fixed at launch); lowering max shrinks the job live.
    # A small minGain keeps goodput asking for the max: the resize is the test's. The
    # script sleeps 0.15 s a step, a fixed cost of most of its step: priorSerial says so
    # (above the half goodput takes by itself) until two batches per GPU are measured.
    policy = {"name": "goodput", "params": {"minGain": 0.01, "priorSerial": 0.9}}

    def document(gpus: int) -> dict[str, Any]:
        return spec_document(
            "adaptive", 1, gpus, command, policy=policy, training=training,
            env={"PYTHONPATH": str(REPO)},
        )  # fmt: skip

    def choice() -> Any:
        with herd.store() as store:
            record = store.get_job("adaptive")
        return None if record is None else record.status.batch

    def trained_at(gpus: int) -> int | None:
        """The batch the operator chose for `gpus` GPUs once the workers reported training
        at it (an epoch's end, or a measurement within an epoch)."""
        chosen = choice()
        if chosen is None or chosen.gpus != gpus or chosen.size == GLOBAL_BATCH // 2:
            return None  # no choice yet, or the base batch (32) still
        for report in herd.reports("adaptive"):
            if report.world_size == gpus and report.metrics.get("batch_size") == chosen.size:
                return int(chosen.size)
        return None

    herd.write_spec(document(2))
    at_two = herd.wait_for(
        lambda: trained_at(2), "an epoch at the batch chosen for 2", 240, "adaptive"
    )
    herd.write_spec(document(1))

    def succeeded() -> bool:
        condition = herd.condition("adaptive", "Succeeded")
        return condition is not None and condition["status"] == "True"

    herd.wait_for(succeeded, "the job to finish", timeout=240, job="adaptive")

    reports = herd.reports("adaptive")
    epochs = [r for r in reports if r.epoch is not None]
    assert len({r.epoch for r in epochs}) == ADAPTIVE_EPOCHS
    # Measurements within epochs: the first before any epoch's end, one at each world size
    # (the shrink is a new configuration), each with the step time and the batch.
    measurements = [r for r in reports if r.measurement]
    assert measurements and measurements[0].time < min(r.time for r in epochs), reports
    assert {r.world_size for r in measurements} == {1, 2}, measurements
    for report in measurements:
        assert report.epoch is None
        assert report.metrics["step_seconds"] > 0 and report.metrics["batch_size"] >= 32
    for report in epochs:
        keys = {"gradient_noise_scale", "batch_size", "step_seconds"}
        assert keys <= set(report.metrics), (report, epochs)
        assert report.metrics["gradient_noise_scale"] > 0
        # A step's compute, measured apart from it, and the one host the workers span.
        assert 0 < report.metrics["compute_seconds"] <= report.metrics["step_seconds"]
        assert report.metrics["nodes"] == 1
    records = read_steps(steps_dir)
    passes = 1 + max(record["pass"] for record in records)
    chain = committed_chain(records, DIGITS_TRAIN, passes, by="pass")
    worlds = [group[0]["world"] for group in chain]
    assert [worlds[0]] + [b for a, b in itertools.pairwise(worlds) if a != b] == [2, 1]
    batches_at = {
        world: [g[0]["global_batch"] for g in chain if g[0]["world"] == world] for world in (1, 2)
    }
    assert batches_at[2][0] == GLOBAL_BATCH // 2  # the base batch before any choice
    # The operator's batch, picked from the measurement, is taken within the first epoch.
    assert any(g[0]["epoch"] == 0 and g[0]["global_batch"] > 32 for g in chain), batches_at
    assert 32 < at_two <= 256 and at_two in batches_at[2]  # at most maxBatch
    # Memory: past 64 a worker, its share is cut into micro-batches of at most 64.
    assert all(max(r["micro_batches"], default=0) <= 64 for group in chain for r in group)
    last = choice()
    assert last is not None and last.gpus == 1 and last.size <= 256
    for group in chain:
        for record in group:
            # AdaScale: the rate is the base rate times a gain between 1 and batch / base
            # (the step's batch: a pass's short last step may be under the base).
            low, high = sorted((1.0, record["count"] / 32))
            assert LR * low * (1 - 1e-9) <= record["policy_lr"] <= LR * high * (1 + 1e-9)
