"""GTPO out of its regime, from the CLI: the regime guard warns once, naming the key to change, and
tags the MLflow run; ``entropy_threshold: auto`` decides the filter once (the authors' rule), tags
it, keeps it in the checkpoint and does not decide again on resume.

The tiny random policy samples at <H>_i ~ 4.8 nats, so gamma = 0.1 makes the shift ~0.48 per
completion against toy-reward advantages of a few hundredths: the shift dominates every step (the
regime of the first learning study, docs/results.md). Its <H>_ini is far above ln 2: no filter.

Injected bugs, each seen failing once: the guard's warning sent to the log only (no tag); the auto
decision not stored in the checkpoint's run state (the resume decides again).
"""

from __future__ import annotations

import math

import torch
from mlflow.tracking import MlflowClient

from tests.e2e import runs

STEPS = 5
SHIFT = ["algo.entropy_threshold=auto", "algo.entropy_gamma=0.1", "train.checkpoint_every=5"]


def test_shift_dominated_run_warns_once_and_auto_filter_is_decided_once(tmp_path):
    out = tmp_path / "shift"
    first = runs.train(out, *SHIFT, steps=STEPS)
    warnings = [line for line in first.log.splitlines() if "regime guard gtpo_shift_dominates" in line]
    assert len(warnings) == 1, first.log[-4000:]
    assert "step 5:" in warnings[0] and "algo.entropy_gamma_relative" in warnings[0], warnings[0]
    decided = [line for line in first.log.splitlines() if "entropy_threshold auto:" in line]
    assert len(decided) == 1 and "no filter" in decided[0], decided
    shares = runs.per_step(out, "gtpo/shift_share", STEPS)
    assert min(shares) > 0.5, shares
    assert runs.per_step(out, "gtpo/filtered_frac", STEPS) == [0.0] * STEPS
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    tags = client.get_run((out / "run_id").read_text().strip()).data.tags
    assert "algo.entropy_gamma_relative" in tags["guard/gtpo_shift_dominates"]
    assert "no filter" in tags["gtpo.entropy_threshold"]
    common = torch.load(out / "checkpoints" / f"step_{STEPS:08d}" / "common.pt", weights_only=False)
    assert common["extra_state"]["run_state"]["entropy_threshold"] == math.inf, common["extra_state"]

    resumed = runs.train(out, *SHIFT, "--resume", steps=STEPS + 1)
    assert "entropy_threshold auto:" not in resumed.log, resumed.log[-3000:]
    assert f"step {STEPS + 1}/{STEPS + 1} |" in resumed.log
