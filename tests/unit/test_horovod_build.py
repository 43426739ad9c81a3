"""Which Horovod the build script makes, decided from the machine it runs on: NCCL where a
CUDA toolkit (nvcc) is found and torch is a CUDA build, Gloo on CPU otherwise, and a clear
error where NCCL is asked for and cannot be built. Run with HERD_HOROVOD_DRY_RUN=1 (the
script stops before downloading anything) against a fake CUDA toolkit and a fake torch:
no GPU machine here. The package carries the script and its patch, and the patch applies
to Horovod 0.28.1's sources (tests/test_packaging.py installs them from a wheel)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from herd_operator.horovod_build import BUILD_SCRIPT, PATCH, build_command

GUARD_S = 60.0
"""Hang guard for the script; never a performance expectation."""
PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
# A changed patch builds a new wheel: the cache folder ends with the patch's hash.
PATCHED = "patch" + hashlib.sha256(PATCH.read_bytes()).hexdigest()[:8]


def fake_torch(root: Path, cuda: str | None) -> Path:
    package = root / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f'__version__ = "2.5.1{"+cu124" if cuda else "+cpu"}"\n'
        f"class version:\n    cuda = {cuda!r}\n"
    )
    return root


def fake_toolkit(root: Path, release: str = "12.4") -> Path:
    """A CUDA toolkit's shape: bin/nvcc answering --version, include/cuda_runtime.h."""
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\necho 'nvcc: NVIDIA (R) Cuda compiler driver'\n"
        f"echo 'Cuda compilation tools, release {release}, V{release}.131'\n"
    )
    nvcc.chmod(0o755)
    return root


def dry_run(
    tmp_path: Path, *, torch_cuda: str | None, path: list[Path], **env: str
) -> subprocess.CompletedProcess[str]:
    """The script on an empty PATH but for `path` and the basics (no /usr/local/bin: this
    machine has an nvcc there), with a fake torch importable and HOME in tmp_path."""
    site = fake_torch(tmp_path / f"site-{torch_cuda}", torch_cuda)
    basics = tmp_path / "basics"
    if not basics.exists():  # the system's commands, but never a CUDA one
        basics.mkdir()
        for folder in (Path("/bin"), Path("/usr/bin")):
            for tool in folder.iterdir():
                if tool.name not in {"nvcc", "nvidia-smi"} and not (basics / tool.name).exists():
                    (basics / tool.name).symlink_to(tool)
    environ = {
        "PATH": os.pathsep.join(str(p) for p in [*path, basics]),
        "HOME": str(tmp_path / "home"),
        "PYTHONPATH": str(site),
        "HERD_HOROVOD_DRY_RUN": "1",
        **env,
    }
    return subprocess.run(
        ["bash", str(BUILD_SCRIPT), sys.executable],
        env=environ,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )


def chosen(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines())


def test_nccl_is_chosen_where_nvcc_and_a_cuda_torch_are(tmp_path: Path) -> None:
    cuda = fake_toolkit(tmp_path / "cuda-12.4")
    smi = tmp_path / "smi"
    smi.mkdir()
    (smi / "nvidia-smi").write_text("#!/bin/sh\necho 8.0\necho 8.0\n")  # two A100s
    (smi / "nvidia-smi").chmod(0o755)
    build = chosen(dry_run(tmp_path, torch_cuda="12.4", path=[cuda / "bin", smi]))
    assert build["flavour"] == "nccl-cuda12.4"
    assert build["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert build["HOROVOD_CUDA_HOME"] == str(cuda)
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "80"
    assert build["HOROVOD_CPU_OPERATIONS"] == "GLOO"
    # Its own cache: a CPU wheel is never taken for it.
    assert build["cache"].endswith(f"/horovod-0.28.1-torch2.5.1-{PY_TAG}-nccl-cuda12.4-{PATCHED}")


def test_cuda_home_is_the_toolkit_and_ncclhome_and_cc_list_are_passed_on(tmp_path: Path) -> None:
    cuda = fake_toolkit(tmp_path / "cudatoolkit")
    build = chosen(
        dry_run(
            tmp_path,
            torch_cuda="12.4",
            path=[],
            CUDA_HOME=str(cuda),
            NCCL_HOME="/opt/nccl",
            HOROVOD_BUILD_CUDA_CC_LIST="80",
        )
    )
    assert build["HOROVOD_CUDA_HOME"] == str(cuda)
    assert build["HOROVOD_NCCL_HOME"] == "/opt/nccl"
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "80"


def test_the_nccl_of_torchs_pip_packages_is_linked_from_the_cache(tmp_path: Path) -> None:
    cuda = fake_toolkit(tmp_path / "cuda")
    nccl = tmp_path / f"site-{'12.4'}" / "nvidia" / "nccl"
    (nccl / "lib").mkdir(parents=True)
    (nccl / "include").mkdir()
    (nccl / "lib" / "libnccl.so.2").write_text("")
    build = chosen(dry_run(tmp_path, torch_cuda="12.4", path=[cuda / "bin"]))
    assert build["HOROVOD_NCCL_INCLUDE"] == str(nccl / "include")
    assert build["HOROVOD_NCCL_LIB"] == build["cache"] + "/nccl-lib"
    assert build["HOROVOD_NCCL_LINK"] == "SHARED"


@pytest.mark.parametrize("torch_cuda", [None, "12.4"])
def test_without_nvcc_it_builds_for_cpu(tmp_path: Path, torch_cuda: str | None) -> None:
    build = chosen(dry_run(tmp_path, torch_cuda=torch_cuda, path=[], CUDA_HOME=str(tmp_path)))
    assert build["flavour"] == "cpu"
    assert "HOROVOD_GPU_OPERATIONS" not in build
    assert build["cache"].endswith(f"-{PY_TAG}-{PATCHED}")


def test_nvcc_with_a_cpu_torch_builds_for_cpu_and_says_why(tmp_path: Path) -> None:
    cuda = fake_toolkit(tmp_path / "cuda")
    done = dry_run(tmp_path, torch_cuda=None, path=[cuda / "bin"])
    assert chosen(done)["flavour"] == "cpu"
    assert "is a CPU build: building for CPU (Gloo)" in done.stderr


@pytest.mark.parametrize(
    ("torch_cuda", "toolkit", "message"),
    [
        ("12.4", False, "HERD_HOROVOD_GPU=nccl, but no nvcc"),
        (None, True, "HERD_HOROVOD_GPU=nccl, but torch 2.5.1 in"),
    ],
)
def test_nccl_asked_for_where_it_cannot_be_built_is_an_error_saying_what_lacks(
    tmp_path: Path, torch_cuda: str | None, toolkit: bool, message: str
) -> None:
    path = [fake_toolkit(tmp_path / "cuda") / "bin"] if toolkit else []
    env = {"HERD_HOROVOD_GPU": "nccl"} | ({} if toolkit else {"CUDA_HOME": str(tmp_path)})
    done = dry_run(tmp_path, torch_cuda=torch_cuda, path=path, **env)
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""


def test_an_unknown_choice_is_refused(tmp_path: Path) -> None:
    done = dry_run(tmp_path, torch_cuda=None, path=[], HERD_HOROVOD_GPU="rocm")
    assert done.returncode == 2
    assert "HERD_HOROVOD_GPU=rocm: expected auto, nccl or cpu" in done.stderr


def test_this_machine_builds_the_wheel_bootstrap_cached() -> None:
    """Here, unfaked: bootstrap's torch is the CPU build, so even with a CUDA toolkit (the
    CPU machines have an nvcc in /usr/local/bin) the choice is Gloo, cached where bootstrap
    has always cached it; with a CUDA torch and nvcc it would be NCCL."""
    import torch

    nccl = bool(torch.version.cuda) and (
        shutil.which("nvcc") is not None or Path("/usr/local/cuda/bin/nvcc").exists()
    )
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT), sys.executable],
        env={**os.environ, "HERD_HOROVOD_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    build = chosen(done)
    assert build["flavour"].startswith("nccl") if nccl else build["flavour"] == "cpu"
    assert Path(build["cache"]).name.startswith("horovod-0.28.1-torch")
    if not nccl:
        assert Path(build["cache"]).name.endswith(f"-{PY_TAG}-{PATCHED}")


def test_the_console_script_builds_for_its_own_python() -> None:
    assert build_command([]) == ["bash", str(BUILD_SCRIPT), sys.executable]
    assert build_command(["--python", "/opt/py/bin/python3"])[2] == "/opt/py/bin/python3"
    with pytest.raises(SystemExit, match="usage: herd-operator-build-horovod"):
        build_command(["--bogus"])


def test_the_patch_changes_what_the_script_used_to_edit() -> None:
    """The C++ standard in both CMake files (C++17 for torch >= 2.1), CUDA's (CUDA 13),
    and the includes GCC 13 wants: the lines as Horovod 0.28.1 has them, and as patched."""
    text = PATCH.read_text()
    for removed, added in [
        ("-set(CMAKE_CXX_STANDARD 14)", "+set(CMAKE_CXX_STANDARD 17)"),
        ("-    set(CMAKE_CXX_STANDARD 14)", "+    set(CMAKE_CXX_STANDARD 17)"),
        ("-set(CMAKE_CUDA_STANDARD 11)", "+set(CMAKE_CUDA_STANDARD 17)"),
    ]:
        assert removed in text.splitlines() and added in text.splitlines()
    assert "+#include <cstdint>" in text.splitlines() and "+#include <string>" in text.splitlines()
    assert os.access(BUILD_SCRIPT, os.X_OK)
