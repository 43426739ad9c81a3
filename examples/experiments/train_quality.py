"""The accuracy study's training under real Elastic Horovod, with the worker API's batch policy.

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \\
        --network-interface lo python -m examples.experiments.train_quality --policy preserve-batch

The policy comes from the job's spec (`spec.training.batchPolicy`, passed to the workers
as HERD_BATCH_POLICY) when there is one, else from `--policy`. The model, the loss and the
cut of every step are those of `quality.simulate`; each step's gradient is summed over the
workers (`sampler.sum_gradients`, which also measures the gradient noise scale under the
adaptive policy) and is the mean over the step's global batch. Each epoch's report carries
the adaptive metrics (`sampler.adaptive_metrics()`: noise scale, batch, step time).

Each worker appends one JSON line per optimizer step to `--step-log DIR/worker-<pid>.jsonl`
(its rank, world size, the step's epoch, pass over the data and place in it, global
batch, lr and sample indices): the evidence the integration test and the study read. A
line is written after the step's allreduce and before `state.commit()`, which saves the
step before it looks for a resize, so a logged step is a committed one unless its
allreduce failed elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch

from examples.experiments.data import DATASETS, load
from examples.experiments.quality import (
    SCHEDULE_NAMES,
    RunConfig,
    RunResult,
    accumulate,
    accuracy,
    budget_units,
    checkpoints,
    decay_factor,
    make_model,
    position,
    schedule_for,
)
from herd_operator import worker as herd
from herd_operator.agent.batching import BATCH_POLICIES, policy_name


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    defaults = RunConfig()
    parser.add_argument("--dataset", choices=DATASETS, default=defaults.dataset)
    parser.add_argument(
        "--policy", choices=BATCH_POLICIES, help="unless the spec chose one (default: naive)"
    )
    parser.add_argument(
        "--schedule",
        default="horovodrun",
        help="the study's schedule name; with --drive-hosts it also sets the world size",
    )
    parser.add_argument(
        "--drive-hosts",
        type=Path,
        help="the discovery file: rank 0 writes the schedule's world size there at the exact "
        "step the simulation changes it, and all workers wait until Horovod has resized",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--worker-batch", type=int, default=defaults.worker_batch)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--reference-workers", type=int, default=defaults.reference_workers)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--max-worker-batch", type=int, default=defaults.max_worker_batch)
    parser.add_argument("--max-batch", type=int, default=defaults.max_batch)
    parser.add_argument("--no-decay", action="store_true", help="no cosine decay of the rate")
    parser.add_argument("--evaluations", type=int, default=defaults.evaluations)
    parser.add_argument("--step-log", type=Path, help="directory for per-worker step logs")
    parser.add_argument("--progress", type=Path, help="rank 0 writes the samples seen here")
    parser.add_argument("--result", type=Path, help="rank 0 writes the run's result here")
    parser.add_argument("--step-delay", type=float, default=0.0, help="seconds after each step")
    return parser.parse_args()


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    temporary.replace(path)


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(1)
    herd.bind_device()
    settings = herd.batch_settings(
        args.worker_batch,
        args.lr,
        policy=args.policy,
        reference_workers=args.reference_workers,
        warmup_steps=args.warmup_steps,
        max_worker_batch=args.max_worker_batch,
        max_batch=args.max_batch,
    )
    config = RunConfig(
        dataset=args.dataset,
        policy=policy_name(settings.policy),
        schedule=args.schedule,
        seed=args.seed,
        epochs=args.epochs,
        worker_batch=settings.worker_batch,
        lr=settings.lr,
        reference_workers=settings.reference_workers,
        warmup_steps=settings.warmup_steps,
        max_worker_batch=settings.max_worker_batch,
        max_batch=settings.max_batch,
        decay=not args.no_decay,
        evaluations=args.evaluations,
    )
    data = load(config.dataset)
    epoch_size = len(data.y_train)
    budget = budget_units(config, epoch_size)
    model = make_model(data.features, data.classes, config.hidden, config.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum)
    sampler = herd.elastic_batches(epoch_size, settings, seed=config.seed)
    # The curve travels with the committed state, so a new rank 0 goes on with it.
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, sampler=sampler, curve=[], worlds=[], steps=0
    )
    state.register_reset_callbacks([sampler.on_reset, herd.report_reset])
    log = None
    if args.step_log is not None:
        args.step_log.mkdir(parents=True, exist_ok=True)
        log = (args.step_log / f"worker-{os.getpid()}.jsonl").open("a", buffering=1)
    started = time.monotonic()
    written = {"world": 0}
    # The memory schedule is the memory policy's decisions for this batch mode, all known
    # before the run (they depend on the batch plan, not on the training).
    driven = args.drive_hosts is not None and config.schedule in SCHEDULE_NAMES
    schedule = schedule_for(config) if driven else None

    def follow_schedule(at: float) -> None:
        """With --drive-hosts: resize at the step the simulation does, and wait for it.

        Every worker computes the same wanted size from the same committed position
        (samples, or under adaptive the progress: `quality.position`), so all of them wait
        (and commit, which is where Horovod raises the resize) in lockstep."""
        if schedule is None:
            return
        wanted = schedule.world_at(at / budget)
        if hvd.rank() == 0 and written["world"] != wanted:
            write_atomically(args.drive_hosts, f"localhost:{wanted}\n")
            written["world"] = wanted
        while wanted != hvd.size():
            time.sleep(0.25)
            state.commit()

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while sampler.epoch < config.epochs:
            epoch = sampler.epoch
            for step in sampler.steps():
                batches = sampler.batch_state
                seen = batches.data_pass * epoch_size + step.cursor
                at = position(config, batches, epoch_size)
                follow_schedule(at)  # a resize restarts train() before this step
                if not state.worlds or state.worlds[-1][1] != hvd.size():
                    state.worlds.append((seen, hvd.size()))
                optimizer.zero_grad()
                loss = accumulate(model, data, step)
                sampler.sum_gradients(model.parameters(), step)  # measures noise (adaptive)
                lr = step.lr * decay_factor(config, at / budget)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                optimizer.step()
                if log is not None:
                    plan = sampler.plan
                    record = {
                        "pid": os.getpid(),
                        "rank": hvd.rank(),
                        "world": hvd.size(),
                        "epoch": step.epoch,
                        "pass": batches.data_pass,
                        "cursor": step.cursor,
                        "count": step.count,
                        "global_batch": plan.global_batch,
                        "accumulation": plan.accumulation_steps,
                        "micro_batches": [len(micro) for micro in step.micro_batches],
                        "policy_lr": step.lr,
                        "lr": lr,
                        "loss": loss,
                        "indices": list(step.indices),
                        "time": time.time(),
                    }
                    log.write(json.dumps(record) + "\n")
                sampler.record_step(step)
                state.steps += 1
                now_seen = seen + step.count
                now_at = position(config, sampler.batch_state, epoch_size)
                marks = checkpoints(budget, config.evaluations)
                crossed = [mark for mark in marks if at + 1e-9 < mark <= now_at + 1e-9]
                if crossed and hvd.rank() == 0:  # labelled as simulate() labels it
                    label = now_seen if config.policy == "adaptive" else crossed[-1]
                    state.curve.append((label, accuracy(model, data)))
                if args.step_delay:
                    time.sleep(args.step_delay)
                state.commit()
                if args.progress is not None and hvd.rank() == 0:
                    write_atomically(args.progress, f"{now_seen} {hvd.size()}\n")
            metrics = {"accuracy": accuracy(model, data), **sampler.adaptive_metrics()}
            herd.report_epoch(epoch, metrics)
            sampler.set_epoch(epoch + 1)
            state.commit()

    train(state)
    if hvd.rank() == 0:
        final = accuracy(model, data)
        samples = sampler.batch_state.data_pass * epoch_size + sampler.batch_state.cursor
        end = samples if config.policy == "adaptive" else budget
        if not state.curve or state.curve[-1][0] != end:
            state.curve.append((end, final))
        result = RunResult(
            config,
            "horovodrun",
            final,
            curve=[tuple(point) for point in state.curve],
            steps=state.steps,
            worlds=[tuple(point) for point in state.worlds],
            seconds=time.monotonic() - started,
            samples=samples,
        )
        print(f"done: test accuracy {final:.4f} after {state.steps} steps", flush=True)
        if args.result is not None:
            write_atomically(args.result, json.dumps(result.to_dict()))


if __name__ == "__main__":
    main()
