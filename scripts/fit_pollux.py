"""Fit Pollux's applications from its traces and print `POLLUX_CALIBRATIONS`.

Usage: python scripts/fit_pollux.py GIT_DIR [REF]
It prints `POLLUX_CALIBRATIONS`, then `POLLUX_BATCHING` (herd_operator/simulate/pollux_profiles.py),
then `POLLUX_STEP_MODELS` (herd_operator/simulate/steptime.py) with each model's error on the
measured steps.
GIT_DIR: a clone of petuum/adaptdl (bare or not); REF: default `osdi21-artifact`. The files
are read with `git show`, never copied (herd_operator/simulate/calibration.py says how the
fit is made and under which licence the traces are).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import textwrap
from collections.abc import Callable

from herd_operator.simulate.batching import derive_batching
from herd_operator.simulate.calibration import POLLUX_EPOCHS, POLLUX_MAX_LOCAL_BATCH, derive
from herd_operator.simulate.steptime import fit_step_model, relative_errors, trace_rows

BATCHES = {
    "bert": (384,),
    "cifar10": (2048, 4096),
    "deepspeech2": (320, 640),
    "imagenet": (3200, 6400),
    "ncf": (32768,),
    "yolov3": (64,),
}
"""The global batch sizes the jobs of Pollux's workloads use (`simulator/workloads*/`)."""


def reader(git_dir: str, ref: str, application: str) -> Callable[[str], str]:
    """`read(name)`: the text of one of `application`'s trace files at `ref`."""

    def read(name: str) -> str:
        path = f"{ref}:simulator/traces/{application}/{name}"
        command = ["git", "-C", git_dir, "show", path]
        return subprocess.run(command, check=True, capture_output=True, text=True).stdout

    return read


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    git_dir, ref = argv[1], argv[2] if len(argv) == 3 else "osdi21-artifact"
    for application, batches in BATCHES.items():
        read = reader(git_dir, ref, application)
        for batch in batches:
            fit = derive(application, batch, read)
            points = ", ".join(f"({n}, {t:.5g})" for n, t in fit.measured)
            print(
                f'    ("{application}", {batch}): Calibration("{application}", {batch},'
                f" {fit.serial_fraction:.4f}, {fit.iteration_seconds:.5g}, {fit.iterations},"
                f" {fit.epochs}, ({points})),  # worst error {fit.worst_error():.1%}"
            )
    for application in BATCHES:
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
        row = derive_batching(
            application, POLLUX_EPOCHS[application], validated, reader(git_dir, ref, application)
        )
        print(
            f'    "{application}": BatchCalibration({row.base_batch}, {row.min_batch},'
            f" {row.max_batch}, {row.min_local_batch}, {row.progress:.6g}, ("
        )
        for batch, scales in row.noise:
            lines = textwrap.wrap(" ".join(f"{n:.4g}" for n in scales), 72)
            print(f"        ({batch}, series(")
            for line in lines:
                print(f'            "{line} "')
            print("        )),")
        print("    )),")
    for application in BATCHES:
        rows = trace_rows(reader(git_dir, ref, application))
        cap = POLLUX_MAX_LOCAL_BATCH.get(application, max(local for _, _, local, _ in rows))
        model = fit_step_model(rows, cap)
        fitted = [row for row in rows if row[2] <= cap]
        errors = [abs(e) for e in relative_errors(model, fitted)]
        bands = {"1-4": (1, 4), "8-16": (8, 16), "24-64": (24, 64)}
        packed = {
            band: [
                abs(e)
                for row, e in zip(fitted, relative_errors(model, fitted), strict=True)
                if low <= row[1] <= high and row[0] == -(-row[1] // 4)
            ]
            for band, (low, high) in bands.items()
        }
        values = ", ".join(f"{getattr(model, name):.4g}" for name in model.__dataclass_fields__)
        by_band = "; ".join(
            f"{band} GPUs ({len(e)}) median {statistics.median(e):.1%} worst {max(e):.1%}"
            for band, e in packed.items()
            if e
        )
        print(
            f'    "{application}": StepModel({values}),'
            f"  # {len(errors)} steps: median error {statistics.median(errors):.1%},"
            f" 90th {sorted(errors)[int(0.9 * len(errors))]:.1%}, worst {max(errors):.1%};"
            f" packed on nodes of 4: {by_band}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
