"""Benchmark-only elastic training: `examples/train_digits.py`'s model and data, timed per step.

Rank 0 appends `WALL_TIME WORLD_SIZE` to `--step-log` after every step, so the
benchmarks can see when a resize took effect and how fast training goes. It
trains until it is stopped.

    horovodrun -np 2 python -m herd_operator.bench.train_steps --step-log steps.txt
"""

from __future__ import annotations

import argparse
import time
from typing import TextIO

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from herd_operator import worker as herd

BATCH_SIZE = 32
LEARNING_RATE = 0.01


class DigitsNet(nn.Module):
    """The same network as examples/train_digits.py at its default width."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--step-log", required=True, help="file rank 0 appends step times to")
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    herd.bind_device()
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    dataset = TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))
    model = DigitsNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)
    opened: list[TextIO] = []

    def log_step() -> None:
        # Rank 0 may be another process after a reset: whoever holds it writes.
        if hvd.rank() != 0:
            return
        if not opened:
            opened.append(open(args.step_log, "a", buffering=1))  # noqa: SIM115
        opened[0].write(f"{time.time():.6f} {hvd.size()}\n")

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * hvd.size()
        herd.report_reset()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: hvd.elastic.TorchState) -> None:
        while True:
            for batch, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                F.cross_entropy(model(x), y).backward()  # type: ignore[no-untyped-call]
                optimizer.step()
                sampler.record_batch(batch, BATCH_SIZE)
                log_step()
                if batch % 4 == 0:
                    state.commit()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
