"""The torchrun engine's batch sampler (`herd.distributed_batches`) on a real 2-process Gloo
group on CPU: the noise-scale estimate it measures with torch.distributed equals the Horovod
path's arithmetic on the same gradients, the gradients are summed, rank 0's answer of
the `batch` channel reaches both ranks, and the epoch's report carries a step's compute apart
from the whole step and the hosts the workers span. Tiny tensors; the processes are forked."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from herd_operator.agent.adaptive import NoiseEstimate, gain_ratio, update_noise
from herd_operator.agent.batching import BatchSettings
from herd_operator.environment import WORKER_HOST_ENV
from herd_operator.specs.values import COMPUTE_SECONDS_METRIC, NODES_METRIC, STEP_SECONDS_METRIC

SETTINGS = BatchSettings("adaptive", 4, 0.1, reference_workers=2, max_batch=64)
"""Base batch 8; the operator's answer (2, 16): shares of 8, each the mean over 8 samples."""
GRADIENTS = {0: [1.0, 2.0, -1.0], 1: [0.5, -1.0, 3.0]}
"""Each rank's part of the step's mean gradient (its own mean gradient x share / count)."""


def _worker(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from herd_operator.agent.training import distributed_batches

    os.environ[WORKER_HOST_ENV] = f"host{rank}"  # each rank on a host of its own
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # Only rank 0 asks: rank 1's answer must never be used.
        answer = (2, 16) if rank == 0 else (2, 40)
        sampler = distributed_batches(32, SETTINGS, seed=0, ask=lambda: answer)
        steps = sampler.steps()
        step = next(steps)
        param = torch.zeros(3, requires_grad=True)
        param.grad = torch.tensor(GRADIENTS[rank])
        sampler.sum_gradients([param], step)
        sampler.record_step(step)
        noise = sampler.batch_state.noise
        result = {
            "batch": sampler.plan.global_batch,
            "count": step.count,
            "indices": list(step.indices),
            "summed": param.grad.tolist(),
            "noise": [noise.sqr_biased, noise.var_biased, noise.weight],
            "progress": sampler.batch_state.progress,
            "first": sampler.adaptive_metrics(),
        }
        # The second step is timed (the first after a start is not): its time apart from
        # the all-reduce wait lies within it.
        step = next(steps)
        param.grad = torch.tensor(GRADIENTS[rank])
        sampler.sum_gradients([param], step)
        sampler.record_step(step)
        result["second"] = sampler.adaptive_metrics()
        Path(out, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_the_torchrun_sampler_measures_what_the_horovod_path_does(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    context = multiprocessing.get_context("fork")
    store = str(tmp_path / "store")
    workers = [
        context.Process(target=_worker, args=(rank, store, str(tmp_path))) for rank in (0, 1)
    ]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(120)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join()
    assert [worker.exitcode for worker in workers] == [0, 0]
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["batch"] for r in results] == [16, 16]  # rank 0's answer, broadcast
    assert [r["count"] for r in results] == [16, 16]
    assert len(set(results[0]["indices"]) | set(results[1]["indices"])) == 16
    summed = [a + b for a, b in zip(GRADIENTS[0], GRADIENTS[1], strict=True)]
    for result in results:
        assert result["summed"] == pytest.approx(summed)
    # The Horovod path (ElasticBatchSampler.sum_gradients): each rank's own mean gradient
    # is its part x count / share; the mean of their squared norms, against the squared
    # norm of the summed gradient, local batch 8, global 16, base 8.
    local = [sum(x * x for x in GRADIENTS[rank]) * (16 / 8) ** 2 for rank in (0, 1)]
    expected = update_noise(NoiseEstimate(), sum(local) / 2, sum(x * x for x in summed), 8, 16, 8)
    for result in results:
        assert result["noise"] == pytest.approx(
            [expected.sqr_biased, expected.var_biased, expected.weight]
        )
        # The step's gain at the measured estimate counts as its progress.
        assert result["progress"] == pytest.approx(gain_ratio(expected, 16, 8))
    assert results[0]["noise"] == results[1]["noise"]
    for result in results:
        first, second = result["first"], result["second"]
        assert COMPUTE_SECONDS_METRIC not in first and STEP_SECONDS_METRIC not in first
        assert 0 <= second[COMPUTE_SECONDS_METRIC] <= second[STEP_SECONDS_METRIC]
        assert first[NODES_METRIC] == second[NODES_METRIC] == 2
