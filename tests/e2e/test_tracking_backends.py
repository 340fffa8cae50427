"""A tiny training run (configs/tiny.yaml, 2 gloo ranks, real vLLM and Megatron) publishing to
MLflow, W&B (offline) and TensorBoard at once, read back from each backend's own files; and a run
whose W&B package is missing and whose TensorBoard directory cannot be written, which still trains
to the end with MLflow whole. The journal rules behind them are tests/unit/test_tracking_backends.py."""

from __future__ import annotations

import pytest

from tests.e2e.runs import history, train
from tests.tracking_readers import tensorboard_scalars, wandb_exit_codes, wandb_history

STEPS = 3
ALL = "tracking.backends=[mlflow,wandb,tensorboard]"
KEYS = ["loss", "reward/mean", "time/step_s", "throughput/tokens_per_gpu_s", "data/prompts"]
SECRET = "wandb-key-that-must-never-be-written-0123456789"


def test_a_tiny_run_publishes_the_same_steps_to_mlflow_wandb_and_tensorboard(tmp_path):
    """Every key of MLflow's run (step 0's data counts and every training metric) is in TensorBoard
    and in W&B's offline log at the same steps with the same values (float32: TensorBoard's
    precision); the W&B run ended with exit code 0; WANDB_API_KEY, exported, is in no file of the
    run directory and not in the log. Injected bug caught: TensorBoardSink.write writing
    ``step - 1`` (every step off by one against MLflow)."""
    out = tmp_path / "run"
    run = train(out, ALL, steps=STEPS, env={"WANDB_API_KEY": SECRET})
    tb, wb = tensorboard_scalars(out), wandb_history(out)
    keys = set(tb) | set(wb)
    assert set(KEYS) <= keys, sorted(keys)
    for key in sorted(keys):
        mlflow = history(out, key)
        for backend, points in (("tensorboard", sorted(tb.get(key, []))), ("wandb", sorted(wb.get(key, [])))):
            assert [s for s, _ in points] == [s for s, _ in mlflow], (backend, key, points, mlflow)
            assert [v for _, v in points] == pytest.approx([v for _, v in mlflow], rel=1e-6, abs=1e-6, nan_ok=True), \
                (backend, key)
    assert [s for s, _ in history(out, "loss")] == list(range(1, STEPS + 1))
    assert wandb_exit_codes(out) == [0]
    assert SECRET not in run.log
    leaks = [p for p in out.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaks, f"WANDB_API_KEY written to {leaks}"


def test_a_run_survives_a_missing_wandb_and_an_unwritable_tensorboard_dir(tmp_path):
    """`import wandb` fails (a package on PYTHONPATH that raises ImportError, as a missing one would)
    and <run dir>/tensorboard is a file: the run trains every step and exits 0, each backend warns
    once naming itself and the fix, MLflow holds every step once. Injected bug caught: the sinks
    built in the training thread (the ImportError ends the run before step 1)."""
    out, shadow = tmp_path / "run", tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("wandb is not installed (injected by the test)")\n')
    out.mkdir()
    (out / "tensorboard").write_text("not a directory")
    from tests.helpers import REPO

    run = train(out, ALL, steps=STEPS, env={"PYTHONPATH": f"{shadow.parent}:{REPO}"})
    assert run.log.count("W&B is off for this run") == 1 and "pip install wandb==0.31.0" in run.log
    assert run.log.count("tracking: TensorBoard at") == 1 and f"make {out / 'tensorboard'} writable" in run.log
    assert "record(s) not in TensorBoard" in run.log and "record(s) not in W&B" in run.log
    assert [s for s, _ in history(out, "loss")] == list(range(1, STEPS + 1))
    assert not (out / "wandb").exists()
