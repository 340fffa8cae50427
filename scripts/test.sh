#!/usr/bin/env bash
# Runs the whole test suite the way CI does: installs SLURM's Debian packages when missing (the
# SLURM e2e tests start real daemons), then pytest over tests/unit and tests/e2e, then the
# multi-rank tests/dist layer in a second pytest process (see README "Tests": in one process, a
# dist run before tests/e2e/test_convert_smollm2.py made that test fail once; not yet diagnosed).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .ci/install_slurm.sh ]; then .ci/install_slurm.sh; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true VLLM_NO_USAGE_STATS=1
.venv/bin/python -m pytest tests --ignore=tests/dist -q --durations=25 "$@"
exec .venv/bin/python -m pytest tests/dist -q --durations=10 "$@"
