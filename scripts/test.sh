#!/usr/bin/env bash
# Runs the whole test suite the way CI does (`make test`, `.ci/run`): installs SLURM's Debian packages
# when missing (the SLURM layer starts real daemons), then one pytest process over tests/ (dist, e2e,
# unit) with the full-run guards on (tests/guards.py: per-layer floors, documented skips only).
# Extra arguments go to pytest; a selection (-k, a path) needs MGTPO_TEST_GUARDS=0.
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install_slurm.sh  # unconditional: without it the SLURM layer would skip, and the guards fail the run
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true VLLM_NO_USAGE_STATS=1
export MGTPO_TEST_GUARDS="${MGTPO_TEST_GUARDS:-1}"
limit="${MGTPO_TEST_TIMEOUT:-80m}"  # below CI's 90 minutes, setup included
mkdir -p test-results
status=0
# SIGINT at the limit: pytest stops the running test, prints its summary and the slowest tests, and
# writes the JUnit report; SIGKILL 2 minutes later if it does not.
timeout --signal=INT --kill-after=120 "$limit" .venv/bin/python -m pytest tests -q --durations=25 \
  --junitxml=test-results/junit.xml "$@" || status=$?
if [ "$status" = 124 ]; then echo "scripts/test.sh: the suite ran past $limit and was stopped" >&2; fi
echo "scripts/test.sh: exit $status after $((SECONDS / 60)) min $((SECONDS % 60)) s (JUnit: test-results/junit.xml)"
exit "$status"
