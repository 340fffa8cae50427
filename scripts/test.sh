#!/usr/bin/env bash
# Runs the whole test suite the way CI does (`make test`, `.ci/run`): installs SLURM's Debian packages
# when missing (the SLURM layer starts real daemons), then the suite (dist, e2e, unit) as
# $MGTPO_TEST_SHARDS (default 2) pytest processes at once, one per core (tests/shards.py: files
# that share a run stay together), with the full-run guards on (tests/guards.py: per-layer floors,
# documented skips only). Each shard's output goes to test-results/shard-K.log and is printed when
# the shard ends, then the 25 slowest tests of the whole run and the time per layer, then a check that
# the shards together ran each collected test exactly once (test-results/shard-K.json).
# Extra arguments: one pytest process with them (a selection: -k, a path; it needs MGTPO_TEST_GUARDS=0).
set -euo pipefail
cd "$(dirname "$0")/.."
bash .ci/install_slurm.sh  # unconditional: without it the SLURM layer would skip, and the guards fail the run
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MLFLOW_DISABLE_TELEMETRY=true VLLM_NO_USAGE_STATS=1
export MGTPO_TEST_GUARDS="${MGTPO_TEST_GUARDS:-1}"
limit="${MGTPO_TEST_TIMEOUT:-80m}"  # below CI's 90 minutes, setup included
shards="${MGTPO_TEST_SHARDS:-2}"
mkdir -p test-results
rm -f test-results/junit*.xml test-results/shard-*.log test-results/shard-*.json
# SIGINT at the limit: pytest stops the running test, prints its summary and the slowest tests, and
# writes the JUnit report; SIGKILL 2 minutes later if it does not.
pytest_run() { timeout --signal=INT --kill-after=120 "$limit" .venv/bin/python -m pytest "$@"; }
status=0
if [ "$#" -gt 0 ] || [ "$shards" -le 1 ]; then
  pytest_run tests -q --durations=25 --junitxml=test-results/junit.xml "$@" || status=$?
else
  pids=()
  for k in $(seq 1 "$shards"); do
    pytest_run tests -q --shard="$k/$shards" --shard-record="test-results/shard-$k.json" --durations=10 \
      --junitxml="test-results/junit-$k.xml" \
      -o console_output_style=count >"test-results/shard-$k.log" 2>&1 &
    pids+=("$!")
  done
  echo "scripts/test.sh: $shards shards running (test-results/shard-K.log); each is printed when it ends"
  running=("${pids[@]}")
  for _ in "${pids[@]}"; do
    rc=0; wait -n -p ended "${running[@]}" || rc=$?
    # Only the shards still running: bash's wait -n names an already reaped one "no such job".
    mapfile -t running < <(for p in "${running[@]}"; do [ "$p" = "$ended" ] || echo "$p"; done)
    for k in $(seq 1 "$shards"); do [ "${pids[$((k - 1))]}" != "$ended" ] || break; done
    echo "================ shard $k/$shards: exit $rc after $((SECONDS / 60)) min $((SECONDS % 60)) s ================"
    cat "test-results/shard-$k.log"
    if [ "$status" = 0 ]; then status=$rc; fi
  done
  # The 25 slowest tests of the whole run and the time per layer; it fails when a report is missing.
  .venv/bin/python -m tests.shards report $(for k in $(seq 1 "$shards"); do echo "test-results/junit-$k.xml"; done) || { [ "$status" != 0 ] || status=1; }
  # The shards together ran exactly the collected tests: none lost, none twice (tests/shards.py check).
  .venv/bin/python -m tests.shards check $(for k in $(seq 1 "$shards"); do echo "test-results/shard-$k.json"; done) || { [ "$status" != 0 ] || status=1; }
fi
if [ "$status" = 124 ]; then echo "scripts/test.sh: the suite ran past $limit and was stopped" >&2; fi
echo "scripts/test.sh: exit $status after $((SECONDS / 60)) min $((SECONDS % 60)) s (JUnit: test-results/junit*.xml)"
exit "$status"
