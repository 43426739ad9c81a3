"""A plain torchrun script: a small CNN on scikit-learn's bundled `digits`, over Gloo on CPU
(NCCL on GPUs), that saves its own snapshot after every epoch and resumes from it, as
PyTorch's elastic tutorials teach. No import of herd is needed for it to run and resize.

    torchrun --nnodes=1:3 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=localhost:29400 --rdzv-id=demo \\
        examples/train_torchrun.py --epochs 5 --snapshot /tmp/digits.pt

Under herd-operator (`engine: {kind: torchrun}`) each GPU is one torchrun agent: a resize
is a new membership, every worker starts again at the new world size from the last
snapshot. The snapshot also keeps which epochs were trained at which world size
(`history`): after a run, its epochs are 0..N-1, each once, whatever resized in between.
When herd_operator is importable and the operator runs the job, rank 0 reports each epoch,
and its world size once its first step at each start is done: a resize's cost (its
`ResizeCompleted` event, `describe`) is then the time from the grant to training at the new
size, not to the end of the first epoch there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

SCRIPT_STARTED = time.time()
"""Before torch's import: `--phase-log` tells the interpreter's start from the imports."""

import numpy as np  # noqa: E402 - after SCRIPT_STARTED, which the imports' time is from
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

try:  # optional: epoch reports under the operator; a no-op elsewhere
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


def load_digits() -> TensorDataset:
    """scikit-learn's bundled digits, read from the CSV it ships (without importing it:
    every worker of every restart would pay SciPy's import)."""
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    table_file = Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None
    if table_file is not None and table_file.is_file():
        table = np.loadtxt(table_file, delimiter=",")  # 64 pixels, then the label
        pixels, targets = table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)
    else:
        from sklearn.datasets import load_digits as sklearn_digits

        digits = sklearn_digits()
        pixels, targets = digits.images, digits.target
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    return TensorDataset(images, torch.tensor(targets, dtype=torch.long))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--snapshot", default="snapshot.pt", help="where the snapshot lives")
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.01, help="per worker; scaled by world size")
    parser.add_argument("--width", type=int, default=16, help="conv channels")
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="seconds to sleep after each step"
    )
    parser.add_argument(
        "--step-log", help="rank 0 appends `WALL_TIME WORLD_SIZE` here after every step"
    )
    parser.add_argument(
        "--phase-log",
        help="rank 0 appends `WALL_TIME PHASE WORLD_SIZE` here for each phase of its start:"
        " process (its start), script (this file's first line), imports, rendezvous"
        " (init_process_group returned), snapshot (loaded)",
    )
    return parser.parse_args()


def process_started() -> float:
    """This process's start, wall clock, to the clock tick (under torchrun: when its agent
    started it; the shim's exec keeps the process)."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22: starttime, since boot
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


def load_snapshot(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The snapshot's progress (`epochs_run`, `history`), its weights loaded into `model`
    and `optimizer`; a fresh start when there is none."""
    if not path.exists():
        return {"epochs_run": 0, "history": []}
    snapshot = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(snapshot["model"])
    optimizer.load_state_dict(snapshot["optimizer"])
    return {"epochs_run": snapshot["epochs_run"], "history": snapshot["history"]}


def save_snapshot(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, progress: dict[str, Any]
) -> None:
    """Written whole or not at all: a worker stopped mid-write leaves the last one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    weights = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    torch.save({**weights, **progress}, partial)
    os.replace(partial, path)


def main() -> None:
    imported = time.time()
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)  # under the operator: the allocator's GPU
    dist.init_process_group("nccl" if cuda else "gloo")
    phases = [("imports", imported), ("rendezvous", time.time())]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")

    dataset = load_digits()
    model = DigitsNet(args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * world, momentum=0.9)
    snapshot = Path(args.snapshot)
    progress = load_snapshot(snapshot, model, optimizer)
    if args.phase_log and rank == 0:
        phases.append(("snapshot", time.time()))
        started = [("process", process_started()), ("script", SCRIPT_STARTED)]
        with open(args.phase_log, "a") as phase_log:
            phase_log.writelines(f"{at:.6f} {name} {world}\n" for name, at in started + phases)
    for group in optimizer.param_groups:  # the world may differ from the snapshot's
        group["lr"] = args.lr * world
    ddp = DistributedDataParallel(model)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    if rank == 0:
        print(f"start: world size {world}, from epoch {progress['epochs_run']}", flush=True)
    step_log = open(args.step_log, "a", buffering=1) if args.step_log and rank == 0 else None  # noqa: SIM115
    trained_at_this_size = False

    for epoch in range(progress["epochs_run"], args.epochs):
        started = time.monotonic()
        sampler.set_epoch(epoch)
        total = torch.zeros(2)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item(), 1.0])
            if step_log is not None:
                step_log.write(f"{time.time():.6f} {world}\n")
            if not trained_at_this_size:
                trained_at_this_size = True
                if herd is not None:  # where the operator's measure of a resize ends
                    herd.report_reset()
            if args.step_delay:
                time.sleep(args.step_delay)
        dist.all_reduce(total)
        mean_loss = (total[0] / total[1]).item()
        progress = {
            "epochs_run": epoch + 1,
            "history": [*progress["history"], (epoch, world)],
        }
        if rank == 0:
            save_snapshot(snapshot, model, optimizer, progress)
            print(
                f"epoch {epoch}: loss {mean_loss:.4f}, world size {world}, "
                f"{time.monotonic() - started:.1f}s",
                flush=True,
            )
        if herd is not None:
            herd.report_epoch(epoch, {"loss": mean_loss}, world_size=world)
    dist.destroy_process_group()
    if rank == 0:
        print(f"done: {args.epochs} epochs", flush=True)


if __name__ == "__main__":
    main()
