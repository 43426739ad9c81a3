"""The torchrun rows of `herd-operator bench`: the parts that read the example's logs and
build the baseline's command. The rows themselves start torch in every agent and worker
(seconds of CPU each), so they stay out of the CI's quick run (tests/test_bench.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from herd_operator.bench.torchrun import (
    OPTIONS,
    bare_agent_argv,
    gap_before,
    parts_figures,
    read_phases,
    stall_parts,
)
from herd_operator.bench.training import StepLog
from herd_operator.runtime.engines.torchrun import agent_args
from herd_operator.specs.loading import load_spec_document

# Rank 0's starts as `train_torchrun.py --phase-log` writes them: one at world size 2 before
# the trigger (100.0), one at 4 that ended before its snapshot (a rendezvous round broke),
# then the one that trained; the first step at 4 is at 120.0.
PHASE_LOG = """\
90.0 process 2
90.5 script 2
92.0 imports 2
92.2 rendezvous 2
92.4 snapshot 2
101.0 process 4
101.3 script 4
103.0 imports 4
110.0 process 4
110.4 script 4
113.0 imports 4
116.0 rendezvous 4
117.5 snapshot 4
118.0 snap"""


def test_phase_log_lines_are_read_and_a_half_written_one_skipped(tmp_path: Path) -> None:
    path = tmp_path / "phases.txt"
    path.write_text(PHASE_LOG)
    lines = read_phases(path)
    assert len(lines) == 13
    assert lines[0] == (90.0, "process", 2) and lines[-1] == (117.5, "snapshot", 4)
    assert read_phases(tmp_path / "absent") == []


def test_a_stall_is_split_at_the_last_complete_start_at_the_new_size(tmp_path: Path) -> None:
    path = tmp_path / "phases.txt"
    path.write_text(PHASE_LOG)
    parts = stall_parts(read_phases(path), 4, 100.0, 120.0)
    assert parts == pytest.approx(
        {
            "agents": 10.0,
            "interpreter": 0.4,
            "imports": 2.6,
            "init_process_group": 3.0,
            "data_model_snapshot": 1.5,
            "first_step": 2.5,
        }
    )
    assert parts is not None and sum(parts.values()) == pytest.approx(20.0)


def test_no_split_without_a_complete_start_between_trigger_and_first_step(tmp_path: Path) -> None:
    path = tmp_path / "phases.txt"
    path.write_text(PHASE_LOG)
    lines = read_phases(path)
    assert stall_parts(lines, 4, 111.0, 120.0) is None  # its process began before the trigger
    assert stall_parts(lines, 4, 100.0, 117.0) is None  # its snapshot came after the step
    assert stall_parts(lines, 3, 100.0, 120.0) is None
    assert stall_parts(lines[:8], 4, 100.0, 120.0) is None  # only the broken start


def test_the_gap_is_the_time_without_a_step_before_the_first_at_the_new_size(
    tmp_path: Path,
) -> None:
    path = tmp_path / "steps.txt"
    path.write_text("10.0 2\n10.5 2\n11.0 2\n25.0 4\n25.5 4\n")
    assert gap_before(StepLog(path), 25.0) == pytest.approx(14.0)
    assert gap_before(StepLog(path), 10.0) == 0.0


def test_parts_figures_are_medians_per_part() -> None:
    samples = [
        {"agents": 1.0, "imports": 4.0},
        {"agents": 3.0, "imports": 2.0},
        {"agents": 2.0, "imports": 9.0},
    ]
    assert parts_figures("ours", samples) == {"ours_agents_s": 2.0, "ours_imports_s": 4.0}
    assert parts_figures("ours", []) == {}


def test_the_bare_agents_rendezvous_as_the_engines_agents_do() -> None:
    """The baseline differs from ours only in what a bare job cannot have: our store host
    (`is_host=false`) and the shim."""
    document = {
        "apiVersion": "herd/v1alpha1",
        "kind": "HerdJob",
        "metadata": {"name": "j"},
        "spec": {"command": ["python", "train.py"], "gpus": {"min": 2, "max": 4}},
    }
    job = load_spec_document(document, "j").job
    assert job is not None
    ours = agent_args("j", job.spec, OPTIONS, "python")
    bare = bare_agent_argv("127.0.0.1:1234", 2, 4, ["python", "train.py"])

    def option(argv: list[str], name: str) -> str:
        return next(arg.partition("=")[2] for arg in argv if arg.startswith(f"--{name}="))

    for name in ("nnodes", "nproc-per-node", "rdzv-backend", "max-restarts", "monitor-interval"):
        assert option(bare, name) == option(ours, name), name
    assert option(ours, "rdzv-conf") == "is_host=false," + option(bare, "rdzv-conf")
    assert option(bare, "rdzv-endpoint") == "127.0.0.1:1234"
    assert bare[bare.index("--no-python") + 1 :] == ["python", "train.py"]
