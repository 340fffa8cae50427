#!/usr/bin/env bash
# The GPU smoke on the device machine (no network; .whl/ from scripts/gpu_wheels.sh carried along):
#   bash scripts/gpu_smoke_device.sh [gpu_smoke.py arguments]
# Installs the wheels into /tmp/site, runs bench/gpu_smoke.py on the image's python3 (torch there),
# and writes the JSON line, the log and nvidia-smi's view into $OUT (default /tmp/gpu-smoke-out). The
# optim_state part runs the optimizer-state contract with the Adam Megatron builds there (TE's FusedAdam
# where TE imports, else torch's AdamW) and names it in the JSON (parts.optim_state.optimizer).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-smoke-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed: run scripts/gpu_wheels.sh first and carry .whl" >&2; exit 3; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore \
  HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/nvidia-smi.txt" 2>&1
timeout 480 python3 bench/gpu_smoke.py --json-out "$OUT/gpu_smoke.json" "$@" 2>&1 | tee "$OUT/gpu_smoke.log"
exit "${PIPESTATUS[0]}"
