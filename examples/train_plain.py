"""A plain Elastic Horovod script: no herd import. It still runs and resizes
under the operator (the shim binds its GPUs); it just reports nothing.

    horovodrun -np 2 python examples/train_plain.py --epochs 3
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--step-delay", type=float, default=0.05)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    model = torch.nn.Linear(8, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        for state.epoch in range(state.epoch, args.epochs):
            for _ in range(args.steps):
                optimizer.zero_grad()
                loss = model(torch.randn(16, 8)).pow(2).mean()
                loss.backward()
                optimizer.step()
                time.sleep(args.step_delay)
            if hvd.rank() == 0:
                print(f"epoch {state.epoch}: world size {hvd.size()}", flush=True)
            state.epoch += 1
            state.commit()

    train(state)


if __name__ == "__main__":
    main()
