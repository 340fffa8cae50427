#!/usr/bin/env bash
# Wheels that bench/gpu_smoke.py needs on the GPU test machine beyond its image, downloaded into .whl/
# (gitignored) on a machine with network; scripts/gpu_smoke_device.sh installs them there offline.
#
# The image (library/device KINDS.md) has Python 3.12.3, torch 2.11.0+cu130, numpy, packaging, pyyaml,
# psutil, einops, setuptools, safetensors and transformers: everything megatron_gtpo's train/, sync/,
# convert/ and checkpoint/ import except megatron-core. So one wheel travels. Transformer Engine (its CUDA 13
# core library alone is a 179 MB wheel) and vLLM (326 MB) cannot fit the 64 MiB a device call carries:
# the smoke prints SKIP for te_bf16, te_fp8 and vllm there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=("megatron-core==0.16.1")   # cp312 manylinux_2_24/2_28 wheel, 2.6 MB
LIMIT=$((32 << 20))                # well under the 64 MiB that travels per call (the repo is ~1 MB)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
ls -l .whl
echo "[gpu_wheels] ${#WHEELS[@]} wheel(s), $total bytes in .whl/"
[ "$total" -le "$LIMIT" ] || { echo "[gpu_wheels] over $LIMIT bytes: too much to carry" >&2; exit 1; }
