#!/usr/bin/env bash
# Sets up ./.venv with everything herd-operator and its tests need, once.
#
#   - torch 2.13.0 CPU build (pinned first: an unpinned torch pulls a CUDA build of several GB)
#   - Horovod 0.28.1, patched for C++17 and a sleeping collective wait, built once into a wheel cache
#     (herd_operator/horovod_build/build-horovod.sh; about 5 minutes on 2 cores, then
#     instant): with NCCL where nvcc is found and torch is a CUDA build, else CPU (Gloo)
#   - this project, editable, with its train and dev extras
#
# Idempotent: a second run only checks a stamp. Environment:
#   PYTHON            interpreter to build the venv from (default: python3; needs >= 3.11)
#   HERD_VENV         venv location (default: ./.venv)
#   HERD_WHEEL_CACHE  where the Horovod wheel is cached (default: ~/.cache/herd-operator/wheels)
#   HERD_HOROVOD_GPU  auto (default), nccl or cpu: the Horovod build (build-horovod.sh says how)
#   HERD_ENGINES      `torchrun` for no Horovod at all (no build: the torchrun engine only;
#                     the Horovod tests then fail to import); default: both engines
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${HERD_VENV:-$root/.venv}
python=${PYTHON:-python3}
torch_version=2.13.0

say() { echo "bootstrap: $*" >&2; }

# Debian packages the tests start for real: Prometheus (observability), poppler's pdftoppm
# (the report tests render the PDF they write), for the multi-node tests a real Slurm
# (slurmctld, slurmd, munge), sshd per namespace host and iproute2, and Redis with
# redis-benchmark (the baseline of `python -m devtools.bench --only allocator-rpc`). Checked on
# every run (cheap), since a new machine can come with an old venv.
# Each pair is a command that shows the package is there, and the package.
debian_needs=(
  prometheus:prometheus pdftoppm:poppler-utils
  scontrol:slurm-client slurmctld:slurmctld slurmd:slurmd munged:munge
  /usr/sbin/sshd:openssh-server ssh:openssh-client ip:iproute2
  redis-server:redis-server redis-benchmark:redis-tools
)
missing=()
for need in "${debian_needs[@]}"; do
  command -v "${need%%:*}" >/dev/null || missing+=("${need#*:}")
done
if ((${#missing[@]})); then
  sudo=()
  [[ $(id -u) == 0 ]] || sudo=(sudo -n)
  if [[ $(id -u) == 0 ]] || sudo -n true 2>/dev/null; then
    say "installing Debian's ${missing[*]}"
    "${sudo[@]}" apt-get update -q >/dev/null
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  else
    say "missing and this user cannot install them: apt-get install ${missing[*]}"
    say "(the observability, report and multi-node tests need them; everything else works without)"
  fi
fi

build_horovod=$root/herd_operator/horovod_build/build-horovod.sh
stamp_inputs=("$root/pyproject.toml" "$root/scripts/bootstrap.sh" "$build_horovod"
  "$root/herd_operator/horovod_build/horovod-0.28.1.patch")
engines=${HERD_ENGINES:-horovod,torchrun}
stamp=$( (cat "${stamp_inputs[@]}"; echo "$engines") | sha256sum | cut -c1-16)
if [[ -f $venv/.herd-bootstrap && $(cat "$venv/.herd-bootstrap") == "$stamp" ]]; then
  exit 0
fi

"$python" - <<'PY' || { say "herd-operator needs Python >= 3.11 (set PYTHON=...)"; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [[ ! -x $venv/bin/python ]]; then
  say "creating $venv"
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if [[ $engines == torchrun ]]; then
  say "installing torch $torch_version (CPU), then herd-operator (editable) without Horovod"
  "${pip[@]}" install -q "torch==$torch_version" numpy
  "${pip[@]}" install -q -e "$root[torchrun,report,dev]"
  echo "$stamp" > "$venv/.herd-bootstrap"
  say "ready: $venv (torchrun engine only)"
  exit 0
fi

say "installing torch $torch_version (CPU) and Horovod's build requirements"
"${pip[@]}" install -q "torch==$torch_version" numpy cloudpickle psutil pyyaml packaging cffi wheel setuptools
if ! command -v cmake >/dev/null; then
  "${pip[@]}" install -q cmake
  export PATH="$venv/bin:$PATH"
fi
if ! command -v g++ >/dev/null; then
  say "a C++ compiler is needed to build Horovod; installing Debian's build-essential"
  apt-get install -y -q build-essential >/dev/null
fi

wheel=$("$build_horovod" "$venv/bin/python")
say "installing $(basename "$wheel")"
"${pip[@]}" install -q --no-deps --force-reinstall "$wheel"

say "installing herd-operator (editable) with its train, report and dev extras"
"${pip[@]}" install -q -e "$root[train,report,dev]"

# Importing horovod.torch loads its PyTorch extension: what `horovodrun --check-build` checks,
# at a fifth of its CPU (it also probes TensorFlow, MXNet and the controllers: 13 CPU-s).
"$venv/bin/python" -c 'import horovod.torch' || { say "Horovod has no PyTorch support"; exit 1; }
echo "$stamp" > "$venv/.herd-bootstrap"
say "ready: $venv"
