"""What preserve-batch costs in compute: CPU time per sample of one worker's forward and
backward pass at the per-worker batch each policy gives it (1 thread, `time.process_time`,
so that other processes on a shared machine count less than in wall time).

    python -m examples.experiments.cost

At a fixed global batch of 32, preserve-batch gives each of k workers 32/k samples per
step, and makes k workers do as many optimizer steps (allreduces) as one; naive gives
each 32 and does 1/k of the steps. The allreduce's own cost is not measured here.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from examples.experiments.data import load
from examples.experiments.quality import RunConfig, make_model


def seconds_per_sample(batch: int, repeats: int = 3, samples: int = 16_384) -> float:
    data = load("blobs")
    config = RunConfig()
    model = make_model(data.features, data.classes, config.hidden, 0)
    best = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for start in range(0, samples, batch):
            index = torch.arange(start, start + batch) % len(data.y_train)
            loss = F.cross_entropy(model(data.x_train[index]), data.y_train[index], reduction="sum")
            loss.backward()
        best = min(best, (time.process_time() - started) / samples)
    return best


def main() -> None:
    torch.set_num_threads(1)
    base = seconds_per_sample(32)
    print("| per-worker batch | CPU µs per sample | relative to 32 |")
    print("| --- | --- | --- |")
    for batch in (32, 16, 8):
        cost = base if batch == 32 else seconds_per_sample(batch)
        print(f"| {batch} | {cost * 1e6:.1f} | {cost / base:.2f} |")


if __name__ == "__main__":
    main()
