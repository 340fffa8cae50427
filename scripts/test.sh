#!/usr/bin/env bash
# Runs the whole test suite the way CI does: installs SLURM's Debian packages when missing (the
# SLURM e2e tests start real daemons), then one pytest process over tests/ (dist, e2e, unit).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .ci/install_slurm.sh ]; then .ci/install_slurm.sh; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true VLLM_NO_USAGE_STATS=1
exec .venv/bin/python -m pytest tests -q --durations=30 "$@"
