"""Checks the NVML exporter against nvidia-smi on a real GPU (run on a GPU machine).

A torch process holds a known amount of GPU memory; the exporter's collector
reads the GPU through NVML; nvidia-smi reads it too. Prints both and the
differences as JSON (and writes it to $OUT/gpu-check.json when OUT is set).

    python scripts/gpu_exporter_check.py --hold-gib 4
Needs torch with CUDA and nvidia-ml-py (module pynvml) importable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from herd_operator.exporters.collector import GpuCollector, exposition
from herd_operator.exporters.nvml import NvmlGpuSource

HOLDER = """
import sys, time, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda:0")
x.fill_(1); torch.cuda.synchronize()
print("holding", torch.cuda.memory_reserved(0), flush=True)
time.sleep(float(sys.argv[2]))
"""


def nvidia_smi() -> dict[str, object]:
    gpus = (
        subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,uuid,memory.used,memory.total,utilization.gpu,power.draw",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    apps = (
        subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )
    return {
        "gpus": [line.split(", ") for line in gpus],
        "apps": [line.split(", ") for line in apps],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold-gib", type=float, default=4.0)
    args = parser.parse_args()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(args.hold_gib), "120"], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    reserved = int(holder.stdout.readline().split()[1])
    time.sleep(2)
    source = NvmlGpuSource(os.uname().nodename)
    readings = source.read()
    smi = nvidia_smi()
    text = exposition(GpuCollector(source, lambda: {(source.host, 0): "check"}, per_process=True))
    holder.terminate()
    result = {
        "torch_reserved_bytes": reserved,
        "nvml": [
            {
                "index": r.index,
                "uuid": r.uuid,
                "used": r.memory_used_bytes,
                "total": r.memory_total_bytes,
                "util": r.utilization_ratio,
                "power": r.power_watts,
                "processes": [(p.pid, p.used_bytes) for p in r.processes],
            }
            for r in readings
        ],
        "nvidia_smi": smi,
        "holder_pid": holder.pid,
        "errors": source.errors(),
        "exposition_lines": [line for line in text.splitlines() if line.startswith("herd_gpu_")],
    }
    gpu0 = result["nvml"][0]
    smi_used_mib = float(smi["gpus"][0][2])  # type: ignore[index]
    result["used_difference_mib"] = (gpu0["used"] or 0) / 2**20 - smi_used_mib  # type: ignore[operator]
    out = json.dumps(result, indent=2, default=str)
    print(out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu-check.json").write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
