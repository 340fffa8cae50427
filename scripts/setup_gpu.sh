#!/usr/bin/env bash
# GPU cluster install, one of three kinds, chosen by scripts/gpu_choice.sh and printed with the reason:
#   cu130      a Python 3.12 venv with the pinned CUDA 13 stack of requirements/gpu.lock, then Transformer
#              Engine's PyTorch extension built against that torch (needs a driver >= 580, g++ and nvcc 13)
#   cu12       the same from requirements/gpu-cu12.lock (drivers 525-579, nvcc 12.x); that lock is NOT
#              resolved yet: the script says so and stops (docs/gpu.md)
#   container  inside an NGC PyTorch container: a venv over the container's Python that sees its torch,
#              Transformer Engine and apex (--system-site-packages), with the lock's other packages;
#              vLLM 0.32.0's kernels are built for torch 2.13.0, so the container's torch must be 2.13
#   MGTPO_GPU_INSTALL=container|cu130|cu12 forces a kind.
#
#   scripts/setup_gpu.sh    # venv: $MEGATRON_GTPO_GPU_VENV (default ~/.cache/megatron-gtpo/gpu-venv), linked .venv-gpu,
#                           # which slurm/env.sh then uses for GPU jobs (MGTPO_PYTHON/MGTPO_CLI)
#
# Needs: Linux x86_64 with glibc >= 2.35; Python 3.12 (python3.12, or $PYTHON; the container's python3);
# network to PyPI.
#
# NOT TESTED on a GPU: no GPU and no CUDA toolkit were available where this was written. Verified there
# (2026-11-30, metadata only): the lock resolves for cp312 / manylinux_2_35 and every pin has a wheel;
# megatron-core 0.16.1 ships a cp312 wheel; transformer-engine-torch 2.11.0 is an sdist whose setup.py
# imports torch, setuptools, wheel and packaging (so it must build with --no-build-isolation, against the
# torch installed here) and requires transformer_engine_cu<torch's CUDA major>==2.11.0. The kind chosen is
# tested on CPU with a fake nvidia-smi (tests/unit/test_setup_gpu_choice.py).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${MEGATRON_GTPO_GPU_VENV:-$HOME/.cache/megatron-gtpo/gpu-venv}
PY=${PYTHON:-python3.12}
LOCK=requirements/gpu.lock
TE_TORCH="transformer-engine-torch==2.11.0"
STAMP="$VENV/.megatron-gtpo-gpu-lock"
# EXCLUDED, lock_without_excluded: packages of the lock deliberately not installed (requirements/excluded.txt).
source scripts/excluded.sh
want=$(cat "$LOCK" "$EXCLUDED_FILE" pyproject.toml "$0" | sha256sum | cut -c1-16)
fail() { echo "[setup_gpu] error: $*" >&2; exit 1; }
source scripts/gpu_choice.sh
choice=$(gpu_install_choice) || fail "$choice"
KIND=${choice%%$'\t'*}
echo "[setup_gpu] install: $KIND (${choice#*$'\t'})"
want=$(echo "$want $KIND" | sha256sum | cut -c1-16)
VENV_FLAGS=()
if [ "$KIND" = container ]; then
  PY=${PYTHON:-python3} VENV_FLAGS=(--system-site-packages)
  # the container's torch, Transformer Engine and apex stay; its PIP_CONSTRAINT pins them
  PROVIDED='^(torch|triton|nvidia-|transformer-engine|apex|cuda-)'
  pin=$(sed -n 's/^torch==//p' "$LOCK")
  have=$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)
  [[ "$have" == "$pin"* ]] || fail "this container's torch is $have, but vLLM 0.32.0's compiled kernels are built \
for torch $pin: use an NGC PyTorch release that ships torch $pin (docs/gpu.md), or install outside the container \
(MGTPO_GPU_INSTALL=cu130 or cu12)"
else
  # NGC containers export PIP_CONSTRAINT to pin their own torch build; this venv installs the lock's instead.
  unset PIP_CONSTRAINT
  PROVIDED='^$'
  major=13
  if [ "$KIND" = cu12 ]; then
    LOCK=requirements/gpu-cu12.lock major=12
    [ -f "$LOCK" ] || fail "$LOCK is not resolved yet (docs/gpu.md): on a CUDA 12 driver use an NGC PyTorch \
container (MGTPO_GPU_INSTALL=container), or a driver >= $CU130_MIN_DRIVER"
  fi
  NVCC=${CUDA_HOME:+$CUDA_HOME/bin/}nvcc
  cuda_major=$("$NVCC" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p' || true)
  [ "$cuda_major" = "$major" ] || fail "transformer-engine-torch is compiled here and needs a CUDA $major toolkit \
to match the lock's torch; '$NVCC --version' gave '${cuda_major:-nothing}'. Put CUDA $major's nvcc on PATH or set CUDA_HOME"
  command -v g++ >/dev/null || fail "g++ is needed to build transformer-engine-torch"
fi
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null \
  || fail "$PY is not Python 3.12 ($LOCK is resolved for 3.12); set PYTHON=/path/to/python3.12"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_gpu] creating $VENV with $("$PY" --version) ${VENV_FLAGS[*]}"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "${VENV_FLAGS[@]}" "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q "pip==26.3" "setuptools==80.10.2" "wheel==0.48.0"
  echo "[setup_gpu] installing $LOCK (--no-deps: it is the complete resolved set), less ${EXCLUDED[*]} ($EXCLUDED_FILE)"
  lock_without_excluded "$LOCK" | grep -Ev "$PROVIDED" >"$VENV/.requirements.txt"
  "$VENV/bin/python" -m pip install -q --no-deps -r "$VENV/.requirements.txt"
  "$VENV/bin/python" -m pip uninstall -q -y "${EXCLUDED[@]}" >/dev/null 2>&1 || true  # left by an older list
  if [ "$KIND" != container ]; then  # the container's TE is built for its torch already
    echo "[setup_gpu] building $TE_TORCH against $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    # --no-build-isolation: the extension must be compiled against the torch installed above, not a fresh one.
    # Without NVIDIA_PRODUCT_NAME, TE's setup.py looks for a prebuilt wheel for *this* torch (inside an NGC
    # container it would fetch one built for the container's torch) and compiles from source when none exists.
    env -u NVIDIA_PRODUCT_NAME NVTE_FRAMEWORK=pytorch MAX_JOBS="${MAX_JOBS:-8}" \
      "$VENV/bin/python" -m pip install --no-deps --no-build-isolation "$TE_TORCH"
  fi
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO"
  "$VENV/bin/python" - <<'PY'
import importlib

import torch

for name in ("megatron.core", "vllm", "transformer_engine.pytorch", "transformers", "mlflow", "megatron_gtpo"):
    importlib.import_module(name)
print(f"[setup_gpu] imports ok: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"GPUs visible: {torch.cuda.device_count()}")
PY
  echo "$want" > "$STAMP"
fi
ln -sfn "$VENV" "$REPO/.venv-gpu"
echo "[setup_gpu] ready: $REPO/.venv-gpu -> $VENV (slurm/*.sbatch GPU jobs use it); smoke: .venv-gpu/bin/python bench/gpu_smoke.py"
