"""Two small training jobs on one NVIDIA GPU: alone, together, and together under MPS (issue 30).

One command, a few minutes on a machine with one NVIDIA GPU:

    python scripts/gpu_share_bench.py [--seconds 45] [--batches 64,256] [--output FILE]

Each job trains a small ResNet-18-like network on synthetic 32x32 images (no data to fetch)
in its own process, limited to its share of the GPU's memory with
`torch.cuda.set_per_process_memory_fraction`. Phases:

1. exclusive: job A, then job B, each alone on the GPU;
2. colocated: A and B at once on the same GPU (time-sliced by the driver);
3. mps: A and B at once under an MPS daemon started for this run, in its own pipe and log
   directories under a temporary directory, stopped at the end even on failure (skipped,
   with the reason, when `nvidia-cuda-mps-control` is missing or does not start).

Per job and phase: training throughput (samples/s over the measured window), peak memory as
torch counts it (allocated, reserved) and as NVML counts the process, and the NVML readings
set against `nvidia-smi --query-compute-apps` taken at the same moments. Figures: each job's
slowdown co-located against alone, and the summed normalised throughput (above 1: sharing
the GPU did more work than running the two one after the other). Writes a JSON of all of it
(`--output`, default `$OUT/gpu-share-bench.json` when OUT is set, else
`gpu-share-bench.json`). Needs torch with CUDA; nvidia-ml-py (module pynvml) for the NVML
readings (they are left out, with the reason, without it). Exits with status 2 and a clear
message without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

EXIT_NO_GPU = 2
JOB_NAMES = ("a", "b")
MPS_CONTROL = "nvidia-cuda-mps-control"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=45.0, help="measured seconds per run")
    parser.add_argument(
        "--warmup", type=float, default=8.0, help="seconds trained before measuring"
    )
    parser.add_argument(
        "--batches", default="64,256", help="the two jobs' batch sizes, comma-separated"
    )
    parser.add_argument(
        "--memory-fraction",
        type=float,
        default=0.45,
        help="each job's limit, share of the GPU's memory (set_per_process_memory_fraction)",
    )
    parser.add_argument(
        "--mps-thread-percentage",
        type=int,
        default=0,
        help="CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for each job under MPS (0: not set)",
    )
    parser.add_argument("--no-mps", action="store_true", help="skip the MPS phase")
    parser.add_argument("--output", type=Path, default=None, help="where the JSON goes")
    # A job's own process (internal).
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        batches = [int(part) for part in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches: expected two integers like 64,256, got {args.batches!r}")
    if len(batches) != 2 or min(batches) < 1:
        parser.error(f"--batches: expected two positive integers, got {args.batches!r}")
    args.batches = batches
    if not 0.0 < args.memory_fraction <= 0.5:
        parser.error("--memory-fraction: must be within (0, 0.5] (two jobs share one GPU)")
    if args.seconds <= 0 or args.warmup < 0:
        parser.error("--seconds must be > 0 and --warmup >= 0")
    if not 0 <= args.mps_thread_percentage <= 100:
        parser.error("--mps-thread-percentage: must be within [0, 100]")
    if args.output is None:
        out = os.environ.get("OUT")
        args.output = Path(out, "gpu-share-bench.json") if out else Path("gpu-share-bench.json")
    return args


def mps_environment(base: Mapping[str, str], root: Path, thread_percentage: int) -> dict[str, str]:
    """The environment of the MPS daemon and its clients: pipe and log directories of this
    run's own (so another daemon on the machine is neither used nor stopped)."""
    env = dict(base)
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(root / "pipe")
    env["CUDA_MPS_LOG_DIRECTORY"] = str(root / "log")
    if thread_percentage:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage)
    else:
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    return env


def parse_compute_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` ->
    {pid: MiB}; lines it cannot read (`[N/A]`, `[Insufficient Permissions]`) are left out."""
    apps: dict[int, int] = {}
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            apps[int(parts[0])] = int(parts[1])
        except ValueError:
            continue
    return apps


def slowdown(alone: float, shared: float) -> float | None:
    """Throughput alone over throughput shared (None when either is missing or zero)."""
    if alone <= 0 or shared <= 0:
        return None
    return alone / shared


def figures(phases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Per sharing phase: each job's slowdown against its exclusive run, the worst, and the
    summed normalised throughput (each job's shared throughput over its own alone)."""
    exclusive = phases.get("exclusive", {})
    out: dict[str, Any] = {}
    for phase in ("colocated", "mps"):
        runs = phases.get(phase, {})
        if not runs or "skipped" in runs:
            continue
        slowdowns: dict[str, float | None] = {}
        normalised = 0.0
        for name in JOB_NAMES:
            alone = float(exclusive.get(name, {}).get("throughput", 0.0))
            shared = float(runs.get(name, {}).get("throughput", 0.0))
            slowdowns[name] = slowdown(alone, shared)
            normalised += shared / alone if alone > 0 else 0.0
        known = [value for value in slowdowns.values() if value is not None]
        out[phase] = {
            "slowdown": slowdowns,
            "worst_slowdown": max(known) if known else None,
            "normalised_throughput_sum": normalised,
        }
    return out


def nvml_against_smi(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per-process memory from NVML set against nvidia-smi's, sample by sample: the largest
    difference in MiB and the count compared."""
    differences = [
        abs(int(nvml) - int(sample["smi"][pid]))
        for sample in samples
        for pid, nvml in sample.get("nvml", {}).items()
        if pid in sample.get("smi", {})
    ]
    return {
        "compared": len(differences),
        "max_difference_mib": max(differences) if differences else None,
        "median_difference_mib": statistics.median(differences) if differences else None,
    }


def report(
    config: Mapping[str, Any],
    device: Mapping[str, Any],
    phases: Mapping[str, Mapping[str, Any]],
    samples: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The JSON written: what ran, on what, every run's figures and the comparisons."""
    return {
        "config": dict(config),
        "device": dict(device),
        "phases": {name: dict(runs) for name, runs in phases.items()},
        "figures": figures(phases),
        "nvml_vs_nvidia_smi": nvml_against_smi(samples),
        "samples": list(samples),
    }


# --- on the GPU ------------------------------------------------------------------------------


def _model(torch: Any) -> Any:
    """A ResNet-18-like network for 32x32 images: four stages of two residual blocks."""
    nn = torch.nn

    class Block(nn.Module):  # type: ignore[misc,name-defined]
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False),
                nn.BatchNorm2d(cout),
                nn.ReLU(inplace=True),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.skip = (
                nn.Identity()
                if stride == 1 and cin == cout
                else nn.Sequential(
                    nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
                )
            )

        def forward(self, x: Any) -> Any:
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[Any] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    channels = 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [Block(channels, width, stride), Block(width, width, 1)]
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def _nvml_process_mib(pid: int) -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        # Under MPS the clients are listed apart from the daemon's process.
        for getter in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetMPSComputeRunningProcesses",
        ):
            for proc in getattr(pynvml, getter, lambda _: [])(handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory) >> 20
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    return None


def run_worker(args: argparse.Namespace) -> int:
    """One job: train for warmup + seconds, write its figures to --result."""
    import torch

    torch.cuda.set_per_process_memory_fraction(args.memory_fraction, 0)
    device = torch.device("cuda:0")
    model = _model(torch).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images = torch.randn(args.batch, 3, 32, 32, device=device)
    labels = torch.randint(0, 10, (args.batch,), device=device)
    loss_fn = torch.nn.CrossEntropyLoss()
    started = time.monotonic()
    measured_from: float | None = None
    steps = 0
    nvml_peak: int | None = None
    while True:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(images), labels).backward()
        optimizer.step()
        torch.cuda.synchronize()
        now = time.monotonic()
        if measured_from is None:
            if now - started >= args.warmup:
                measured_from, steps = now, 0
                nvml_peak = _nvml_process_mib(os.getpid())
            continue
        steps += 1
        if steps % 50 == 0:
            reading = _nvml_process_mib(os.getpid())
            if reading is not None:
                nvml_peak = max(nvml_peak or 0, reading)
        if now - measured_from >= args.seconds:
            break
    elapsed = time.monotonic() - measured_from
    result = {
        "pid": os.getpid(),
        "batch": args.batch,
        "steps": steps,
        "seconds": elapsed,
        "throughput": steps * args.batch / elapsed,
        "torch_max_allocated_mib": torch.cuda.max_memory_allocated(0) >> 20,
        "torch_max_reserved_mib": torch.cuda.max_memory_reserved(0) >> 20,
        "nvml_peak_mib": nvml_peak,
    }
    args.result.write_text(json.dumps(result))
    return 0


def _smi_apps() -> dict[int, int]:
    done = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return parse_compute_apps(done.stdout)


def _run_jobs(
    args: argparse.Namespace, names: Sequence[str], env: Mapping[str, str], work: Path
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start the named jobs at once, sample NVML and nvidia-smi while they run, collect."""
    procs = {}
    for name in names:
        batch = args.batches[JOB_NAMES.index(name)]
        command = [sys.executable, __file__, "--worker", "--batch", str(batch),
                   "--seconds", str(args.seconds), "--warmup", str(args.warmup),
                   "--memory-fraction", str(args.memory_fraction),
                   "--result", str(work / f"{name}.json")]  # fmt: skip
        procs[name] = subprocess.Popen(command, env=dict(env))
    samples: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.warmup + args.seconds + 240
    try:
        while any(proc.poll() is None for proc in procs.values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs {', '.join(names)} ran past their time")
            time.sleep(3)
            pids = {proc.pid for proc in procs.values() if proc.poll() is None}
            smi = {pid: mib for pid, mib in _smi_apps().items() if pid in pids}
            nvml = {pid: mib for pid in pids if (mib := _nvml_process_mib(pid)) is not None}
            if smi or nvml:
                samples.append({"time": time.time(), "smi": smi, "nvml": nvml})
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    runs: dict[str, Any] = {}
    for name, proc in procs.items():
        path = work / f"{name}.json"
        runs[name] = (
            json.loads(path.read_text())
            if proc.returncode == 0 and path.exists()
            else {"failed": f"exit status {proc.returncode}"}
        )
    return runs, samples


@contextlib.contextmanager
def mps_daemon(env: Mapping[str, str]) -> Iterator[None]:
    """An MPS control daemon in this run's directories, asked to quit on the way out."""
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        Path(env[key]).mkdir(parents=True, exist_ok=True)
    subprocess.run([MPS_CONTROL, "-d"], env=dict(env), check=True, timeout=30)
    try:
        yield
    finally:
        subprocess.run([MPS_CONTROL], input="quit\n", text=True, env=dict(env),
                       timeout=60, check=False)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args)
    try:
        import torch
    except ImportError:
        print("gpu_share_bench: torch is not installed; it needs torch with CUDA", file=sys.stderr)
        return EXIT_NO_GPU
    if not torch.cuda.is_available():
        print(
            "gpu_share_bench: no CUDA GPU visible (torch.cuda.is_available() is False);"
            " run it on a machine with an NVIDIA GPU",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    props = torch.cuda.get_device_properties(0)
    device = {"name": props.name, "memory_mib": props.total_memory >> 20,
              "torch": torch.__version__, "cuda": torch.version.cuda}  # fmt: skip
    config = {
        key: value for key, value in vars(args).items() if key not in ("worker", "batch", "result")
    }
    config["output"] = str(args.output)
    phases: dict[str, dict[str, Any]] = {"exclusive": {}}
    samples: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gpu-share-bench-") as tmp:
        work = Path(tmp)
        env = dict(os.environ)
        for name in JOB_NAMES:
            runs, taken = _run_jobs(args, [name], env, work)
            phases["exclusive"].update(runs)
            samples += [{**sample, "phase": "exclusive"} for sample in taken]
        runs, taken = _run_jobs(args, JOB_NAMES, env, work)
        phases["colocated"] = runs
        samples += [{**sample, "phase": "colocated"} for sample in taken]
        if args.no_mps:
            phases["mps"] = {"skipped": "--no-mps"}
        elif shutil.which(MPS_CONTROL) is None:
            phases["mps"] = {"skipped": f"{MPS_CONTROL} not found"}
        else:
            mps_env = mps_environment(env, work / "mps", args.mps_thread_percentage)
            try:
                with mps_daemon(mps_env):
                    runs, taken = _run_jobs(args, JOB_NAMES, mps_env, work)
                phases["mps"] = runs
                samples += [{**sample, "phase": "mps"} for sample in taken]
            except (subprocess.SubprocessError, OSError) as err:
                phases["mps"] = {"skipped": f"MPS did not start or run: {err}"}
    result = report(config, device, phases, samples)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps({"device": device, "figures": result["figures"],
                      "nvml_vs_nvidia_smi": result["nvml_vs_nvidia_smi"]}, indent=2))  # fmt: skip
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
