"""The step-time model by GPUs and local batch (herd_operator/simulate/steptime.py): its
arithmetic on hand-made models, and that its fit recovers a model it was given steps of."""

from __future__ import annotations

import pytest

from herd_operator.simulate.steptime import (
    POLLUX_STEP_MODELS,
    StepModel,
    fit_step_model,
    relative_errors,
    trace_rows,
)

# 0.1 s + 10 ms a sample; on one node 0.2 s + 0.05 s a GPU past 2, across nodes 0.5 + 0.1.
MODEL = StepModel(0.1, 0.01, 0.2, 0.05, 0.5, 0.1, 1.0, 32.0)


def test_steps_of_a_hand_made_model() -> None:
    assert MODEL.seconds(1, 10) == pytest.approx(0.2)  # compute alone
    assert MODEL.seconds(2, 20) == pytest.approx(0.2 + 0.2)  # no overlap: the sum
    assert MODEL.seconds(4, 40) == pytest.approx(0.2 + 0.3)
    assert MODEL.seconds(8, 80) == pytest.approx(0.2 + 1.1)  # 2 nodes of 4
    overlapped = StepModel(0.1, 0.01, 0.2, 0.05, 0.5, 0.1, 10.0, 32.0)
    assert overlapped.seconds(2, 20) == pytest.approx(0.2 * 2**0.1)  # about the max
    # Past 32 samples a GPU, micro-batches: 64 is two of 32, the second without the sync.
    assert MODEL.seconds(1, 64) == pytest.approx(0.42 + 0.42)
    assert MODEL.seconds(2, 128) == pytest.approx((0.42 + 0.2) + 0.42)
    assert MODEL.seconds(1, 40) == pytest.approx(0.3 + 0.3)  # two of 20
    with pytest.raises(ValueError, match="gpus >= 1"):
        MODEL.seconds(0, 10)
    with pytest.raises(ValueError, match="finite and >= 0"):
        StepModel(-0.1, 0.01, 0.2, 0.05, 0.5, 0.1, 1.0, 32.0)
    with pytest.raises(ValueError, match="overlap"):
        StepModel(0.1, 0.01, 0.2, 0.05, 0.5, 0.1, 0.5, 32.0)


def test_the_fit_recovers_the_model_it_was_given_steps_of() -> None:
    truth = StepModel(0.05, 0.002, 0.03, 0.004, 0.08, 0.002, 2.0, 128.0)
    layouts = [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16), (16, 64)]
    rows = [
        (nodes, gpus, float(local), truth.micro_step(nodes, gpus, local))
        for nodes, gpus in layouts
        for local in (8, 16, 32, 64, 128, 256)
    ]
    fitted = fit_step_model(rows, max_local_batch=128.0)
    used = [row for row in rows if row[2] <= 128]
    assert max(abs(e) for e in relative_errors(fitted, used)) < 0.02
    assert fitted.overlap == 2.0
    assert fitted.max_local_batch == 128.0
    with pytest.raises(ValueError, match="two local batches"):
        fit_step_model([(1, 1, 8.0, 0.1), (1, 2, 8.0, 0.2)], 128.0)


def test_trace_rows_count_nodes_and_gpus_of_each_placement() -> None:
    files = {
        "placements.csv": "placement,local_bsz,step_time,sync_time\n1,8,0.1,0\n112,16,0.4,0.2\n",
        "scalability.csv": "num_nodes,num_replicas,local_bsz,step_time,sync_time\n"
        "16,64,32,0.9,0.5\n",
    }
    assert trace_rows(files.__getitem__) == [
        (1, 1, 8.0, 0.1),
        (3, 4, 16.0, 0.4),
        (16, 64, 32.0, 0.9),
    ]


def test_every_application_of_pollux_has_a_step_model() -> None:
    assert set(POLLUX_STEP_MODELS) == {
        "bert",
        "cifar10",
        "deepspeech2",
        "imagenet",
        "ncf",
        "yolov3",
    }
    for model in POLLUX_STEP_MODELS.values():
        # More samples a GPU never make a step shorter, nor do more GPUs past one node.
        assert model.seconds(4, 64) <= model.seconds(4, 128)
        assert model.seconds(8, 8 * 16) <= model.seconds(16, 16 * 16)
