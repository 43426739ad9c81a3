"""`herd-operator-build-horovod`: builds the patched Horovod 0.28.1 wheel that
`herd-operator[train]` needs, for the Python it runs in, and prints the wheel's path.

Horovod's last release does not build against current PyTorch (it asks for C++14, and
C++11 for CUDA), so `pip install 'herd-operator[train]'` alone tries to build the sdist and
fails. The build script and its patch ship in the package (this folder), so that a pip
install of herd-operator can build the wheel with no checkout:

    pip install herd-operator
    pip install "$(herd-operator-build-horovod)"
    pip install 'herd-operator[train]'

A folder apart: it holds no code of the operator, only this door to a shell script that
also runs from a checkout before herd-operator is installed (scripts/bootstrap.sh).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BUILD_SCRIPT = Path(__file__).with_name("build-horovod.sh")
PATCH = Path(__file__).with_name("horovod-0.28.1.patch")


def build_command(argv: list[str], python: str = sys.executable) -> list[str]:
    """The script's argument list: the Python to build for (this one, or `--python PATH`)."""
    if argv[:1] == ["--python"] and len(argv) == 2:
        python = argv[1]
    elif argv:
        raise SystemExit(
            "usage: herd-operator-build-horovod [--python PATH]\n"
            "(HERD_HOROVOD_GPU=auto|nccl|cpu chooses the build; see docs/perlmutter.md)"
        )
    return ["bash", str(BUILD_SCRIPT), python]


def main(argv: list[str] | None = None) -> int:
    return subprocess.call(build_command(sys.argv[1:] if argv is None else argv))
