"""scripts/gpu_share_bench.py's pure parts, on CPU: arguments, the MPS environment, the
nvidia-smi parsing, the figures and the JSON's shape, and the exit without a GPU."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_share_bench.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_share_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_arguments_defaults_and_output_under_out(bench: ModuleType, monkeypatch) -> None:
    monkeypatch.setenv("OUT", "/tmp/out-dir")
    args = bench.parse_args([])
    assert args.batches == [64, 256]
    assert args.output == Path("/tmp/out-dir/gpu-share-bench.json")
    monkeypatch.delenv("OUT")
    args = bench.parse_args(["--batches", "32,128", "--seconds", "5", "--output", "x.json"])
    assert (args.batches, args.seconds, args.output) == ([32, 128], 5.0, Path("x.json"))


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--batches", "64"], "--batches"),
        (["--batches", "a,b"], "--batches"),
        (["--batches", "0,4"], "--batches"),
        (["--memory-fraction", "0.8"], "--memory-fraction"),
        (["--seconds", "0"], "--seconds"),
        (["--mps-thread-percentage", "101"], "--mps-thread-percentage"),
    ],
)
def test_bad_arguments_name_the_field(bench: ModuleType, capsys, argv, field) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(argv)
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err


def test_mps_environment_is_the_runs_own(bench: ModuleType, tmp_path: Path) -> None:
    base = {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "10"}
    env = bench.mps_environment(base, tmp_path, 0)
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "pipe")
    assert env["CUDA_MPS_LOG_DIRECTORY"] == str(tmp_path / "log")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env  # not inherited silently
    assert env["PATH"] == "/bin" and base["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "10"
    assert bench.mps_environment(base, tmp_path, 50)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_compute_apps_parsing_skips_what_it_cannot_read(bench: ModuleType) -> None:
    text = "1234, 2048\n99, [N/A]\n\ngarbage\n555, 10\n"
    assert bench.parse_compute_apps(text) == {1234: 2048, 555: 10}


def _run(throughput: float) -> dict[str, object]:
    return {"throughput": throughput, "torch_max_allocated_mib": 100}


def test_figures_and_report_shape(bench: ModuleType) -> None:
    phases = {
        "exclusive": {"a": _run(1000.0), "b": _run(400.0)},
        "colocated": {"a": _run(800.0), "b": _run(200.0)},
        "mps": {"skipped": "nvidia-cuda-mps-control not found"},
    }
    samples = [
        {"smi": {1: 1000, 2: 500}, "nvml": {1: 1000, 2: 498}},
        {"smi": {1: 1010}, "nvml": {1: 1004, 3: 7}},
    ]
    result = bench.report({"seconds": 1.0}, {"name": "cpu"}, phases, samples)
    colocated = result["figures"]["colocated"]
    assert colocated["slowdown"] == {"a": pytest.approx(1.25), "b": pytest.approx(2.0)}
    assert colocated["worst_slowdown"] == pytest.approx(2.0)
    assert colocated["normalised_throughput_sum"] == pytest.approx(0.8 + 0.5)
    assert "mps" not in result["figures"]  # skipped: no figure made up
    assert result["nvml_vs_nvidia_smi"] == {
        "compared": 3,
        "max_difference_mib": 6,
        "median_difference_mib": 2,
    }
    assert set(result) == {"config", "device", "phases", "figures", "nvml_vs_nvidia_smi", "samples"}
    json.dumps(result)  # what is written is JSON


def test_a_failed_job_gives_no_slowdown(bench: ModuleType) -> None:
    phases = {
        "exclusive": {"a": _run(1000.0), "b": _run(400.0)},
        "colocated": {"a": {"failed": "exit status 1"}, "b": _run(300.0)},
    }
    figures = bench.figures(phases)["colocated"]
    assert figures["slowdown"]["a"] is None
    assert figures["worst_slowdown"] == pytest.approx(400 / 300)


def test_exits_with_a_clear_message_without_a_gpu(
    bench: ModuleType, tmp_path: Path, capsys
) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible here: the script would run")
    assert bench.main(["--output", str(tmp_path / "r.json")]) == bench.EXIT_NO_GPU == 2
    assert "no CUDA GPU visible" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


def test_the_script_runs_as_a_command(tmp_path: Path) -> None:
    """Its own process: the argument errors exit 2 before torch is imported (fast)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--batches", "64"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "--batches" in done.stderr
