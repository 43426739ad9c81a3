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


def committed_chain(records: list[dict[str, Any]], epoch_size: int) -> list[list[dict[str, Any]]]:
    """Per step that counts, the records of all its ranks, in training order.

    A step rolled back by a failed allreduce (a removed worker) is done again from the
    same cursor at the new world size; the last attempt at a cursor is the one kept.
    """
    attempts: dict[tuple[int, int, int], list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        attempts[(record["epoch"], record["cursor"], record["world"])].append(record)
    latest: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for (epoch, cursor, _), group in attempts.items():
        kept = latest.get((epoch, cursor))
        if kept is None or max(r["time"] for r in group) > max(r["time"] for r in kept):
            latest[(epoch, cursor)] = group
    chain = []
    for epoch in range(EPOCHS):
        cursor = 0
        while cursor < epoch_size:
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
