"""Elastic Horovod training of a small CNN on scikit-learn's bundled `digits` data.

Runs under `herd-operator` (reports epochs and world size, binds the
allocator's device) and under a bare `horovodrun` alike. The learning rate is
scaled with the world size and rescaled on every reset, the way Horovod's
elastic docs recommend; the sampler hands out the rest of an epoch to the new
set of workers so no sample is lost or seen twice.

    horovodrun -np 2 python examples/train_digits.py --epochs 5
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:  # optional: the script is also a plain Elastic Horovod script
    from herd_operator import worker as herd
except ImportError:  # pragma: no cover - exercised when run outside this project
    herd = None  # type: ignore[assignment]


class DigitsNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, width, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(width * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def load_digit_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits: images (1797, 8, 8) with values 0-16, and labels.

    Read from the CSV that scikit-learn ships, without importing scikit-learn: its import
    (SciPy with it) took as long as torch's on 2 loaded cores, and every worker a resize
    starts pays it. `find_spec` finds the package without running it.
    """
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    table_file = Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None
    if table_file is not None and table_file.is_file():
        table = np.loadtxt(table_file, delimiter=",")  # 64 pixels, then the label
        return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    from sklearn.datasets import load_digits  # another layout: let scikit-learn read it

    digits = load_digits()
    return digits.images, digits.target


def load_checkpoint(path: str | None, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load the checkpoint at `path` into the model and optimizer, if there is one; returns
    the epoch to start from (0 without one)."""
    if not path or not os.path.exists(path):
        return 0
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    return int(saved["epoch"])


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, next_epoch: int
) -> None:
    """Write the checkpoint whole: a stop during the write leaves the previous one."""
    partial = f"{path}.partial"
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": next_epoch},
        partial,
    )
    os.replace(partial, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by world size")
    parser.add_argument("--width", type=int, default=16, help="conv channels")
    parser.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        help="seconds to sleep after each step, to stretch a demo run",
    )
    parser.add_argument(
        "--step-log",
        help="rank 0 appends `WALL_TIME WORLD_SIZE` here after every step (for benchmarks)",
    )
    parser.add_argument(
        "--checkpoint",
        help="rank 0 saves the model, the optimizer and the next epoch here after every "
        "epoch, and a new run starts from it: a suspended job resumes where it was",
    )
    parser.add_argument(
        "--hold-mb",
        type=int,
        default=0,
        help="MiB of memory each worker keeps allocated (a stand-in for a bigger model)",
    )
    parser.add_argument(
        "--grow-mb",
        type=int,
        default=0,
        help="MiB more each worker allocates from epoch --grow-at-epoch on (a model that grows)",
    )
    parser.add_argument("--grow-at-epoch", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if herd is not None:
        herd.bind_device()
    ballast = torch.ones(args.hold_mb * 262144) if args.hold_mb else None  # 4-byte floats

    pixels, targets = load_digit_images()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(targets, dtype=torch.long)
    dataset = TensorDataset(images, labels)

    model = DigitsNet(args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    first_epoch = load_checkpoint(args.checkpoint, model, optimizer)
    if first_epoch:
        sampler.set_epoch(first_epoch)
        if hvd.rank() == 0:
            print(f"resuming from {args.checkpoint}: epoch {first_epoch}", flush=True)
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, sampler=sampler, epoch=first_epoch, batch=0
    )

    def on_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: world size {hvd.size()}, resuming epoch {state.epoch}", flush=True)
        if herd is not None:
            herd.report_reset()

    state.register_reset_callbacks([on_reset])
    grown: list[torch.Tensor] = []  # --grow-mb: allocated once, kept to the end
    step_log = open(args.step_log, "a", buffering=1) if args.step_log else None  # noqa: SIM115

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs):
            if args.grow_mb and state.epoch >= args.grow_at_epoch and not grown:
                grown.append(torch.ones(args.grow_mb * 262144))  # 4-byte floats, touched
            model.train()
            started = time.monotonic()
            total_loss, batches = 0.0, 0
            for state.batch, (x, y) in enumerate(loader, start=state.batch):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                sampler.record_batch(state.batch, args.batch_size)
                total_loss, batches = total_loss + loss.item(), batches + 1
                if step_log is not None and hvd.rank() == 0:  # rank 0 may move on a reset
                    step_log.write(f"{time.time():.6f} {hvd.size()}\n")
                if args.step_delay:
                    time.sleep(args.step_delay)
                if state.batch % 4 == 0:
                    state.commit()
            mean_loss = hvd.allreduce(
                torch.tensor(total_loss / max(batches, 1)), name="loss"
            ).item()
            if hvd.rank() == 0:
                print(
                    f"epoch {state.epoch}: loss {mean_loss:.4f}, world size {hvd.size()}, "
                    f"{time.monotonic() - started:.1f}s",
                    flush=True,
                )
            if herd is not None:
                herd.report_epoch(state.epoch, {"loss": mean_loss})
            state.batch = 0
            sampler.set_epoch(state.epoch + 1)
            state.epoch += 1
            state.commit()
            if args.checkpoint and hvd.rank() == 0:
                save_checkpoint(args.checkpoint, model, optimizer, state.epoch)

    train(state)
    if hvd.rank() == 0:
        print(f"done: {args.epochs} epochs, pid {os.getpid()}", flush=True)
    del ballast


if __name__ == "__main__":
    main()
