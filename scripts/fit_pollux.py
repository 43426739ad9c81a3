"""Fit Pollux's applications from its traces and print `POLLUX_CALIBRATIONS`.

Usage: python scripts/fit_pollux.py GIT_DIR [REF]
It prints `POLLUX_CALIBRATIONS`, then `POLLUX_BATCHING` (herd_operator/simulate/batching.py).
GIT_DIR: a clone of petuum/adaptdl (bare or not); REF: default `osdi21-artifact`. The files
are read with `git show`, never copied (herd_operator/simulate/calibration.py says how the
fit is made and under which licence the traces are).
"""

from __future__ import annotations

import subprocess
import sys

from herd_operator.simulate.batching import derive_batching
from herd_operator.simulate.calibration import derive

BATCHES = {
    "bert": (384,),
    "cifar10": (2048, 4096),
    "deepspeech2": (320, 640),
    "imagenet": (3200, 6400),
    "ncf": (32768,),
    "yolov3": (64,),
}
"""The global batch sizes the jobs of Pollux's workloads use (`simulator/workloads*/`)."""


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    git_dir, ref = argv[1], argv[2] if len(argv) == 3 else "osdi21-artifact"
    for application, batches in BATCHES.items():
        for batch in batches:

            def read(name: str, app: str = application) -> str:
                path = f"{ref}:simulator/traces/{app}/{name}"
                command = ["git", "-C", git_dir, "show", path]
                return subprocess.run(command, check=True, capture_output=True, text=True).stdout

            fit = derive(application, batch, read)
            points = ", ".join(f"({n}, {t:.5g})" for n, t in fit.measured)
            print(
                f'    ("{application}", {batch}): Calibration("{application}", {batch},'
                f" {fit.serial_fraction:.4f}, {fit.iteration_seconds:.5g}, {fit.iterations},"
                f" {fit.epochs}, ({points})),  # worst error {fit.worst_error():.1%}"
            )
    for application, batches in BATCHES.items():
        listing = subprocess.run(
            [
                "git",
                "-C",
                git_dir,
                "ls-tree",
                "--name-only",
                f"{ref}:simulator/traces/{application}",
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        validated = [
            int(name.removeprefix("validation-").removesuffix(".csv"))
            for name in listing
            if name.startswith("validation-")
        ]
        for batch in batches:

            def read_trace(name: str, app: str = application) -> str:
                path = f"{ref}:simulator/traces/{app}/{name}"
                command = ["git", "-C", git_dir, "show", path]
                return subprocess.run(command, check=True, capture_output=True, text=True).stdout

            fit = derive(application, batch, read_trace)
            row = derive_batching(application, batch, fit.epochs, validated, read_trace)
            noise = ", ".join(f"{n:.4g}" for n in row.noise)
            print(
                f'    ("{application}", {batch}): BatchCalibration({row.max_batch},'
                f" {row.min_local_batch}, {row.per_sample_seconds:.4g}, ({noise})),"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
