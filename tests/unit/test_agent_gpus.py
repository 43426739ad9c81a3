"""How many GPUs a node agent (`herd-operator exporter`) serves, and what it says about it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from herd_operator.agent import exporter
from herd_operator.agent.exporter import (
    DEFAULT_VIRTUAL_GPUS,
    FROM_POOL,
    GpuCount,
    ServedGpus,
    choose_gpu_count,
    pool_disagreement,
    pool_gpus,
    pool_indices,
    slurm_gpu_count,
)
from herd_operator.runtime.handlers import ExporterRegistry
from herd_operator.specs.values import Pool

counts = st.integers(min_value=1, max_value=64)


@given(
    nvml=st.integers(min_value=0, max_value=8),
    requested=st.none() | counts,
    pool=st.none() | st.integers(min_value=0, max_value=64),
    slurm=st.none() | st.tuples(counts, st.sampled_from(["SLURM_GPUS_ON_NODE"])),
)
def test_the_first_source_that_knows_gives_the_count(
    nvml: int, requested: int | None, pool: int | None, slurm: tuple[int, str] | None
) -> None:
    """NVML, then --virtual-gpus, then the operator's pool, then Slurm, then the default."""
    chosen = choose_gpu_count(nvml, requested, pool, slurm)
    if nvml:
        assert chosen == GpuCount(nvml, "NVML")
    elif requested is not None:
        assert chosen == GpuCount(requested, "--virtual-gpus")
    elif pool:
        assert chosen == GpuCount(pool, FROM_POOL)
    elif slurm is not None:
        assert chosen == GpuCount(slurm[0], "Slurm's SLURM_GPUS_ON_NODE")
    else:
        assert chosen.count == DEFAULT_VIRTUAL_GPUS
        assert chosen.source.startswith("the default")


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),
        ({"SLURM_GPUS_ON_NODE": "2"}, (2, "SLURM_GPUS_ON_NODE")),
        ({"SLURM_GPUS_PER_NODE": "a100:4"}, (4, "SLURM_GPUS_PER_NODE")),
        ({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}, (3, "SLURM_GPUS_PER_NODE")),
        # The node's own count wins over the job's per-node request.
        ({"SLURM_GPUS_ON_NODE": "1", "SLURM_GPUS_PER_NODE": "4"}, (1, "SLURM_GPUS_ON_NODE")),
        # A step without GPUs says 0 for the node: the next variable, or nothing.
        ({"SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_NODE": "4"}, (4, "SLURM_GPUS_PER_NODE")),
        ({"SLURM_GPUS_ON_NODE": "0"}, None),
        # Inherited from the batch node by a step without GPUs: not this node's.
        ({"SLURM_JOB_GPUS": "0,1"}, None),
        ({"SLURM_GPUS_ON_NODE": " "}, None),
    ],
)
def test_slurm_gives_this_nodes_count(
    environ: dict[str, str], expected: tuple[int, str] | None
) -> None:
    assert slurm_gpu_count(environ) == expected


@pytest.mark.parametrize("value", ["four", "a100:", "4:a100", "-1", "a100:2;v100:2"])
def test_a_slurm_count_that_does_not_parse_is_an_error_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=rf"^SLURM_GPUS_PER_NODE={value!r}: expected COUNT"):
        slurm_gpu_count({"SLURM_GPUS_PER_NODE": value})


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ({"gpus": 2, "indices": [2, 3]}, (2, 3)),
        ({"gpus": 0, "indices": []}, ()),
        ({"gpus": 2}, None),  # an operator from before the indices
        ({"indices": [True]}, None),
        ({"indices": [-1]}, None),
        ({"indices": "2,3"}, None),
        ({"indices": [2.0]}, None),
    ],
)
def test_the_pools_slots_here_are_read_only_from_a_list_of_numbers(
    reply: dict[str, Any], expected: tuple[int, ...] | None
) -> None:
    assert pool_indices(reply) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ({"gpus": 2}, 2),
        ({"gpus": 0}, 0),
        ({}, None),  # an operator from before the answer
        ({"gpus": True}, None),
        ({"gpus": -1}, None),
        ({"gpus": "2"}, None),
        ({"gpus": 2.0}, None),
        ({"gpus": 10**9}, None),
    ],
)
def test_the_pools_count_is_read_only_from_a_plain_count(
    reply: dict[str, Any], expected: int | None
) -> None:
    assert pool_gpus(reply) == expected


def test_a_pool_that_disagrees_is_said_naming_both_counts() -> None:
    slurm = GpuCount(4, "Slurm's SLURM_GPUS_ON_NODE")
    assert pool_disagreement("h2", slurm, None) is None
    assert pool_disagreement("h2", slurm, 4) is None
    assert pool_disagreement("h2", GpuCount(2, FROM_POOL), 2) is None
    said = pool_disagreement("h2", slurm, 2)
    assert said == (
        "serving 4 GPUs (Slurm's SLURM_GPUS_ON_NODE) but the operator's pool has 2 on h2: "
        "jobs get only the pool's"
    )
    outside = pool_disagreement("h9", GpuCount(4, "--virtual-gpus"), 0)
    assert outside is not None and "h9 is not in the operator's pool" in outside
    assert "--host" in outside


def test_the_served_count_follows_the_pool_and_warns_once_per_disagreement() -> None:
    served = ServedGpus("h2", 0, None, (2, "SLURM_GPUS_ON_NODE"))
    assert served.current == GpuCount(2, "Slurm's SLURM_GPUS_ON_NODE")
    # The pool agrees: the source is now the pool, and nothing to say.
    assert served.heard(2) == (None, None)
    assert served.current == GpuCount(2, FROM_POOL)
    # The pool grows on this host (the allocation changed): served at once.
    assert served.heard(3) == (GpuCount(3, FROM_POOL), None)
    # An operator that does not say leaves the last word as it was.
    assert served.heard(None) == (None, None)
    assert served.current == GpuCount(3, FROM_POOL)
    # Out of the pool: back to Slurm's count, with a warning, said once.
    changed, warning = served.heard(0)
    assert changed == GpuCount(2, "Slurm's SLURM_GPUS_ON_NODE")
    assert warning is not None and "not in the operator's pool" in warning
    assert served.heard(0) == (None, None)


def test_a_requested_count_stays_and_a_pool_that_disagrees_is_said_once_per_change() -> None:
    served = ServedGpus("h1", 0, 4, None)
    assert served.current == GpuCount(4, "--virtual-gpus")
    first = served.heard(2)
    assert first[0] is None and first[1] is not None and "has 2 on h1" in first[1]
    assert served.heard(2) == (None, None)
    again = served.heard(3)
    assert again[0] is None and again[1] is not None and "has 3 on h1" in again[1]
    assert served.heard(4) == (None, None)  # agrees now: nothing to say
    assert served.current == GpuCount(4, "--virtual-gpus")


def test_nvml_gpus_are_served_as_nvml_sees_them_whatever_the_pool() -> None:
    served = ServedGpus("g1", 4, None, None)
    changed, warning = served.heard(2)
    assert changed is None and served.current == GpuCount(4, "NVML")
    assert warning is not None and "serving 4 GPUs (NVML)" in warning


def test_a_registration_is_answered_with_the_pools_gpus_on_that_host(tmp_path: Path) -> None:
    pool = [Pool.from_counts({"h1": 2, "h2": 1})]
    registry = ExporterRegistry(tmp_path / "targets.json", None, pool=lambda: pool[0])
    assert registry({"host": "h1", "port": 9411}) == {"gpus": 2, "indices": [0, 1]}
    assert registry({"host": "h2", "port": 9411}) == {"gpus": 1, "indices": [0]}
    assert registry({"host": "h3", "port": 9411}) == {"gpus": 0, "indices": []}
    pool[0] = Pool.from_counts({"h1": 4})  # the pool changed: the next answer says so
    assert registry({"host": "h1", "port": 9411}) == {"gpus": 4, "indices": [0, 1, 2, 3]}
    assert registry({"host": "h2", "port": 9411}) == {"gpus": 0, "indices": []}
    # Slurm's own numbers where the pool asked Slurm (GPUs 2 and 3 of a shared node).
    pool[0] = Pool((("h1", (2, 3)),))
    assert registry({"host": "h1", "port": 9411}) == {"gpus": 2, "indices": [2, 3]}
    assert ExporterRegistry(tmp_path / "other.json", None)({"host": "h1", "port": 1}) == {}


class FakeView:
    """The operator as an agent sees it: each registration answered with `answers`' next."""

    def __init__(self, answers: list[dict[str, Any] | None], stop: threading.Event) -> None:
        self.answers = answers
        self.stop = stop

    def register(self, port: int) -> dict[str, Any] | None:
        answer = self.answers.pop(0)
        if not self.answers:
            self.stop.set()
        return answer

    def unregister(self, port: int) -> bool:
        return True

    def owners(self) -> dict[tuple[str, int], str]:
        return {}

    def bound_pids(self) -> dict[int, list[int]]:
        return {}

    def gpu_owners(self) -> dict[int, str] | None:
        return None


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(exporter, "nvml_gpu_count", lambda: 0)
    monkeypatch.setattr(exporter, "check_no_unseen_gpus", lambda: None)
    monkeypatch.setattr(exporter, "REGISTER_EVERY_SECONDS", 0.0)
    monkeypatch.setattr(exporter, "RETRY_REGISTER_SECONDS", 0.0)
    yield


def run_agent(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    answers: list[dict[str, Any] | None],
    environ: dict[str, str],
    requested: int | None = None,
) -> list[int]:
    """Run the agent through `answers`; the GPU counts its source served, one per read."""
    stop = threading.Event()
    view = FakeView(answers, stop)
    monkeypatch.setattr(exporter, "AllocatorView", lambda *args: view)
    served: list[int] = []
    real = exporter.VirtualGpuSource

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            served.append(self.count)

        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, value)
            if name == "count" and served:
                served.append(value)

    monkeypatch.setattr(exporter, "VirtualGpuSource", Recording)
    code = exporter.run_exporter(
        tmp_path, "h2", "127.0.0.1", 0, requested, 1 << 30, stop, environ=environ
    )
    assert code == 0
    return served


def test_the_agent_starts_with_slurms_count_then_serves_the_pools(
    no_nvml: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="herd_operator.agent.exporter"):
        served = run_agent(
            monkeypatch, tmp_path, [None, {"gpus": 1}, {"gpus": 1}], {"SLURM_GPUS_ON_NODE": "2"}
        )
    assert served == [2, 1]
    text = caplog.text
    assert "exporter for h2 (2 virtual GPUs, from Slurm's SLURM_GPUS_ON_NODE)" in text
    assert "registered with the operator as agent:h2 (its pool has 1 GPUs here)" in text
    assert (
        "h2 now serves 1 virtual GPUs, from the operator's pool "
        "(was 2 virtual GPUs, from Slurm's SLURM_GPUS_ON_NODE)"
    ) in text


def test_the_agent_with_nothing_to_go_by_says_it_serves_the_default(
    no_nvml: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="herd_operator.agent.exporter"):
        served = run_agent(monkeypatch, tmp_path, [None, {}], {})
    assert served == [DEFAULT_VIRTUAL_GPUS]
    assert f"({DEFAULT_VIRTUAL_GPUS} virtual GPUs, from the default: no NVML GPU" in caplog.text


def test_the_agent_with_a_bad_slurm_count_stops_naming_it(
    no_nvml: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    stop = threading.Event()
    stop.set()
    code = exporter.run_exporter(
        tmp_path, "h2", "127.0.0.1", 0, None, 1 << 30, stop,
        environ={"SLURM_GPUS_ON_NODE": "two"},
    )  # fmt: skip
    assert code == 2
    assert "SLURM_GPUS_ON_NODE='two'" in caplog.text
    # --virtual-gpus needs no Slurm count: the variable is not read.
    assert run_agent(monkeypatch, tmp_path, [{}], {"SLURM_GPUS_ON_NODE": "two"}, 3) == [3]


def test_the_agent_names_dcgm_files_by_the_steps_gpus_and_stops_on_a_bad_list(
    no_nvml: None,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "3", "SLURM_GPUS_ON_NODE": "2"}
    stop = threading.Event()
    stop.set()
    code = exporter.run_exporter(
        tmp_path, "h2", "127.0.0.1", 0, None, 1 << 30, stop,
        dcgm_job_mapping_dir=tmp_path / "map", environ={**step, "SLURM_STEP_GPUS": "gpu:2"},
    )  # fmt: skip
    assert code == 2
    assert "SLURM_STEP_GPUS='gpu:2': expected GPU ids" in caplog.text
    with caplog.at_level(logging.INFO, logger="herd_operator.agent.exporter"):
        code = exporter.run_exporter(
            tmp_path, "h2", "127.0.0.1", 0, None, 1 << 30, stop,
            dcgm_job_mapping_dir=tmp_path / "map", environ={**step, "SLURM_STEP_GPUS": "2,3"},
        )  # fmt: skip
    assert code == 0
    assert f"job mapping files in {tmp_path / 'map'} (SLURM_STEP_GPUS=2,3)" in caplog.text
