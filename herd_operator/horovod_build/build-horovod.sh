#!/usr/bin/env bash
# Builds (once) a Horovod 0.28.1 wheel that compiles against current PyTorch, and caches
# it by Horovod, torch, Python, flavour (cpu, or nccl-cuda<version>) and the patch's hash.
# Prints the wheel's path on stdout; everything else goes to stderr.
#
# Horovod's last release hard-codes C++14 (PyTorch >= 2.1 needs C++17) and, for CUDA,
# C++11 (CUDA 13 needs C++17); horovod-0.28.1.patch beside this script changes those and
# adds two includes GCC 13 wants. It also makes the training thread's wait for a collective
# (WaitAndClear) sleep after 50 us instead of yielding in a loop, which kept a core busy per
# waiting worker (docs/benchmarks.md). docs/perlmutter.md says how it builds on a GPU node.
#
# Usage: build-horovod.sh PYTHON   (a python whose environment already has torch)
#        herd-operator-build-horovod   (the same, for the python it is installed in)
#
# Environment:
#   HERD_HOROVOD_GPU   auto (default): NCCL where nvcc is found and torch is a CUDA
#                      build, else CPU (Gloo); nccl: NCCL or an error saying what is
#                      missing; cpu: Gloo only
#   CUDA_HOME          the CUDA toolkit, and no other where it is set (else the nvcc
#                      on PATH, else /usr/local/cuda); Perlmutter's `cudatoolkit`
#                      module sets it
#   NCCL_HOME          NCCL's prefix (include/, lib/); else the pip package
#                      nvidia-nccl-cu* beside torch; else Horovod looks in CUDA_HOME
#   HOROVOD_BUILD_CUDA_CC_LIST  compute capabilities to build for (80 for A100); else
#                      those nvidia-smi reports here, else every one nvcc knows (slower)
#   HERD_WHEEL_CACHE   where wheels are cached (default ~/.cache/herd-operator/wheels)
#   HERD_HOROVOD_DRY_RUN=1  print the chosen flavour, cache and build variables and stop
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=$(command -v "${1:?usage: build-horovod.sh PYTHON}")
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
horovod_version=0.28.1
patch_file=$here/horovod-$horovod_version.patch
say() { echo "build-horovod: $*" >&2; }

read -r torch_version torch_cuda py_tag < <("$python" -c '
import sys, torch
print(torch.__version__.split("+")[0], torch.version.cuda or "none",
      f"cp{sys.version_info[0]}{sys.version_info[1]}")') || {
  say "$python cannot import torch: install torch first (the site's CUDA build on a GPU node)"
  exit 2
}

# Where CUDA is: CUDA_HOME where it is set (and only there), else the nvcc on PATH, else
# /usr/local/cuda.
nvcc=
if [[ -n ${CUDA_HOME:-} ]]; then
  [[ ! -x $CUDA_HOME/bin/nvcc ]] || nvcc=$CUDA_HOME/bin/nvcc
elif command -v nvcc >/dev/null; then
  nvcc=$(command -v nvcc)
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc=/usr/local/cuda/bin/nvcc
fi

want=${HERD_HOROVOD_GPU:-auto}
case $want in
  auto)
    if [[ -n $nvcc && $torch_cuda != none ]]; then
      flavour=nccl
    else
      flavour=cpu
      if [[ -n $nvcc ]]; then
        say "nvcc at $nvcc, but torch $torch_version is a CPU build: building for CPU (Gloo)"
      fi
    fi
    ;;
  nccl)
    if [[ -z $nvcc ]]; then
      say "HERD_HOROVOD_GPU=nccl, but no nvcc: not in \$CUDA_HOME/bin (CUDA_HOME=${CUDA_HOME:-unset})," \
        "on PATH or in /usr/local/cuda/bin; load the CUDA toolkit (module load cudatoolkit)"
      exit 2
    fi
    if [[ $torch_cuda == none ]]; then
      say "HERD_HOROVOD_GPU=nccl, but torch $torch_version in $python is a CPU build:" \
        "install a CUDA build of torch first"
      exit 2
    fi
    flavour=nccl
    ;;
  cpu) flavour=cpu ;;
  *)
    say "HERD_HOROVOD_GPU=$want: expected auto, nccl or cpu"
    exit 2
    ;;
esac

build_env=(
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1
  HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO
  # CMake 4 refuses the old minimum versions of the bundled gloo and flatbuffers.
  CMAKE_POLICY_VERSION_MINIMUM=3.5
)
pip_nccl=
if [[ $flavour == nccl ]]; then
  # The toolkit holds nvcc's bin/ and include/cuda_runtime.h (an nvcc on PATH may be a
  # wrapper elsewhere).
  cuda_home=
  real_nvcc=$(readlink -f "$nvcc")
  for candidate in ${CUDA_HOME:-} "$(dirname "$(dirname "$real_nvcc")")" /usr/local/cuda; do
    if [[ -e $candidate/include/cuda_runtime.h ]]; then
      cuda_home=$candidate
      break
    fi
  done
  if [[ -z $cuda_home ]]; then
    say "nvcc at $nvcc, but no include/cuda_runtime.h beside it nor in /usr/local/cuda: set CUDA_HOME"
    exit 2
  fi
  cuda_release=$("$nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\),.*/\1/p' | head -n 1)
  flavour=nccl-cuda${cuda_release:-unknown}
  build_env+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME="$cuda_home" HOROVOD_NCCL_LINK=SHARED)
  if [[ -n ${NCCL_HOME:-} ]]; then
    build_env+=(HOROVOD_NCCL_HOME="$NCCL_HOME")
  else
    # The NCCL that torch's CUDA wheels bring (nvidia-nccl-cu*): its lib/ holds only
    # libnccl.so.2, so the link name goes in a folder of our own.
    pip_nccl=$("$python" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
    if [[ -n $pip_nccl && -e $pip_nccl/lib/libnccl.so.2 ]]; then
      build_env+=(HOROVOD_NCCL_INCLUDE="$pip_nccl/include" HOROVOD_NCCL_LIB="<cache>/nccl-lib")
    else
      pip_nccl=
    fi
  fi
  if [[ -n ${HOROVOD_BUILD_CUDA_CC_LIST:-} ]]; then
    build_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$HOROVOD_BUILD_CUDA_CC_LIST")
  elif command -v nvidia-smi >/dev/null; then
    ccs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
      tr -d '. ' | grep -E '^[0-9]+$' | sort -u | paste -sd, || true)
    [[ -z $ccs ]] || build_env+=(HOROVOD_BUILD_CUDA_CC_LIST="$ccs")
  fi
fi

# The CPU wheel's folder has no flavour in its name: caches made before the NCCL build
# existed stay valid. A changed patch is a new wheel: its hash is in the folder's name.
patch_hash=$(sha256sum "$patch_file" | cut -c1-8)
cache=${HERD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/herd-operator/wheels}/horovod-$horovod_version-torch$torch_version-$py_tag
[[ $flavour == cpu ]] || cache+=-$flavour
cache+=-patch$patch_hash
build_env=("${build_env[@]/#HOROVOD_NCCL_LIB=<cache>/HOROVOD_NCCL_LIB=$cache}")
if [[ ${HERD_HOROVOD_DRY_RUN:-} == 1 ]]; then
  echo "flavour=$flavour"
  echo "cache=$cache"
  printf '%s\n' "${build_env[@]}"
  exit 0
fi
mkdir -p "$cache"
existing=$(ls "$cache"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [[ -n $existing ]]; then
  echo "$existing"
  exit 0
fi

command -v patch >/dev/null || { say "the patch program is needed (apt-get install patch)"; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
say "building Horovod $horovod_version ($flavour) for torch $torch_version ($py_tag);" \
  "about 5 minutes on 2 cores for CPU, 2 minutes on 16 cores with NCCL (measured)"
# Horovod's build requirements, in the environment it builds in (--no-build-isolation:
# it must see this torch).
"$python" -m pip install -q numpy cloudpickle psutil pyyaml packaging cffi wheel setuptools >&2
if ! command -v cmake >/dev/null; then
  "$python" -m pip install -q cmake >&2
  PATH="$(dirname "$python"):$PATH"
fi
"$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$horovod_version" -d "$work" >&2
tar -xzf "$work/horovod-$horovod_version.tar.gz" -C "$work"
src=$work/horovod-$horovod_version
patch -d "$src" -p1 --forward --quiet <"$patch_file" >&2 || { say "$patch_file did not apply"; exit 1; }
if [[ -n $pip_nccl ]]; then
  mkdir -p "$cache/nccl-lib"
  ln -sfn "$pip_nccl/lib/libnccl.so.2" "$cache/nccl-lib/libnccl.so"
fi

(
  cd "$src"
  export "${build_env[@]}" MAKEFLAGS=-j"$(nproc)"
  "$python" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$work/out" . >&2
)
mv "$work"/out/horovod-*.whl "$cache"/
ls "$cache"/horovod-*.whl | head -n 1
