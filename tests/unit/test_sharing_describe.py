"""What `describe` says of a job sharing GPUs by memory: the GPUs it shares, with which jobs,
and the memory each of those asked for (issue 30's user-facing list)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from herd_operator.layout import StateLayout
from herd_operator.runtime.store import Store
from herd_operator.specs.models import HerdJob
from herd_operator.specs.status import HerdJobStatus
from herd_operator.specs.values import Placement
from tests.unit.test_cli import record, run_cli


def _sharing_job(name: str, memory: str | None) -> HerdJob:
    gpus: dict[str, object] = {"min": 1, "max": 2, "share": True}
    if memory is not None:
        gpus["memory"] = memory
    return HerdJob.model_validate(
        {
            "apiVersion": "herd/v1alpha1",
            "kind": "HerdJob",
            "metadata": {"name": name},
            "spec": {"command": ["python", "train.py"], "gpus": gpus},
        }
    )


def test_describe_names_each_neighbour_on_a_shared_gpu_with_the_memory_it_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    now = time.time()
    with Store(StateLayout(state).database) as store:
        for name, memory in (("a", "8Gi"), ("b", "4Gi"), ("c", None)):
            record(store, _sharing_job(name, memory), now)
        placements = {
            "a": Placement((("h0", (0, 1)),)),
            "b": Placement((("h0", (0,)),)),
            "c": Placement((("h0", (1,)),)),
        }
        store.replace_allocations(placements, now, shared={"a", "b", "c"})
    code, out, err = run_cli(capsys, "describe", "a", "--state-dir", str(state))
    assert (code, err) == (0, "")
    assert (
        "Sharing:      GPUs shared by memory, 8Gi per worker asked; h0:0 with b (4Gi asked);"
        " h0:1 with c (no memory asked: its measured peak)"
    ) in out.splitlines()


def test_get_wide_names_the_jobs_sharing_each_job_s_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    now = time.time()
    with Store(StateLayout(state).database) as store:
        for name, memory in (("a", "8Gi"), ("b", "4Gi"), ("c", None), ("d", "2Gi")):
            record(store, _sharing_job(name, memory), now)
        placements = {
            "a": Placement((("h0", (0, 1)),)),
            "b": Placement((("h0", (0,)),)),
            "c": Placement((("h0", (1,)),)),
            "d": Placement((("h0", (2,)),)),
        }
        store.replace_allocations(placements, now, shared={"a", "b", "c", "d"})
        for name, placement in placements.items():
            status = HerdJobStatus(placement=[(h, list(g)) for h, g in placement.hosts])
            store.put_status(name, status, now)
    code, out, err = run_cli(capsys, "get", "-o", "wide", "--state-dir", str(state))
    assert (code, err) == (0, "")
    cells = {line.split()[0]: line.split()[-1] for line in out.splitlines()[1:]}
    assert cells == {
        "a": "h0:0+1(shared:8Gi,with:b+c)",
        "b": "h0:0(shared:4Gi,with:a)",
        "c": "h0:1(shared:?,with:a)",
        "d": "h0:2(shared:2Gi)",  # alone on its GPU now
    }
