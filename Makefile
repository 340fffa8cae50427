# The two commands of the README. Both install what they need (scripts/setup.sh is quick when done).
.PHONY: setup demo test test-fast

setup:
	@scripts/setup.sh

# Main job: a short GTPO run on CPU with the embedded defaults (SmolLM2-135M-Instruct, local MLflow store).
demo: setup
	.venv/bin/megatron-gtpo demo

# Full test suite (unit, dist, e2e incl. slow vLLM / SLURM / MLflow tests), as CI runs it.
test: setup
	@scripts/test.sh

# The unit layer only (a few minutes on 2 cores), for the edit-test loop; no floors or skip guards.
test-fast: setup
	.venv/bin/python -m pytest tests/unit -q -p no:cacheprovider
