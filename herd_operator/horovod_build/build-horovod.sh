#!/usr/bin/env bash
# Builds (once) a Horovod 0.28.1 wheel that compiles against current PyTorch, and
# caches it by Horovod, torch and Python version. Prints the wheel's path.
#
# Horovod's last release hard-codes C++14; torch >= 2.1 needs C++17. See
# ../shared/HOROVOD-AND-GPU.md for the measurements behind each step.
#
# Usage: scripts/build-horovod.sh PYTHON   (a python whose environment already has torch)
set -euo pipefail

python=$(command -v "${1:?usage: build-horovod.sh PYTHON}")
python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python")
horovod_version=0.28.1
torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')
py_tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache=${HERD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/herd-operator/wheels}/horovod-$horovod_version-torch$torch_version-$py_tag
mkdir -p "$cache"

existing=$(ls "$cache"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [[ -n $existing ]]; then
  echo "$existing"
  exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "building Horovod $horovod_version for torch $torch_version ($py_tag); about 5 minutes on 2 cores" >&2
"$python" -m pip download --quiet --no-deps --no-binary :all: "horovod==$horovod_version" -d "$work" >&2
tar -xzf "$work"/horovod-$horovod_version.tar.gz -C "$work"
src=$work/horovod-$horovod_version
sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || { echo "patch did not apply" >&2; exit 1; }
# GCC 13 needs these includes; harmless on GCC 12.
sed -i '0,/#include/s//#include <cstdint>\n#include <string>\n#include/' "$src/horovod/common/group_table.h"

(
  cd "$src"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
    MAKEFLAGS=-j"$(nproc)"
  "$python" -m pip wheel --no-build-isolation --no-deps --wheel-dir "$work/out" . >&2
)
mv "$work"/out/horovod-*.whl "$cache"/
ls "$cache"/horovod-*.whl | head -n 1
