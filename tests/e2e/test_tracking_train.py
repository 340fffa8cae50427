"""Training never pays for tracking (run_learn_gtpo: GTPO, 12 steps, tracked by a live ``mlflow
server`` that is SIGKILLed once step 3 is logged). The run finishes (exit 0) with its checkpoints,
its steps after the kill take no longer than before it; once the server is back, the journal
replays and every step is in MLflow exactly once. The kill -9 of a run whose last step had reached
MLflow is test_resume.py::test_step_rerun_after_sigkill_is_stored_once."""

from __future__ import annotations

import re

from tests.e2e.mlflow_server import metric_rows
from tests.e2e.runs import LEARN_STEPS

KEYS = ["loss", "reward/mean", "time/step_s", "optim/grad_norm", "entropy/mean"]
STEP_LINE = re.compile(r"step (\d+)/\d+ \|.* = ([0-9.]+)s")


def test_training_survives_a_dead_tracking_server(run_learn_gtpo):
    from mlflow.tracking import MlflowClient

    run, server = run_learn_gtpo.run, run_learn_gtpo.server
    out, text = run.out, run.log
    for step in (8, 12):  # checkpoint_every=4, keep_last=2
        assert (out / "checkpoints" / f"step_{step:08d}").is_dir()
    step_s = {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(text)}
    print(f"step times (s): {step_s}; from the server kill to exit: {run_learn_gtpo.after_kill_s:.1f}s")
    assert sorted(step_s) == list(range(1, LEARN_STEPS + 1))
    # A client that waited on the dead server (MLflow retries a refused connection with back-off for
    # minutes) would stretch the steps after the kill; step 1 carries the warm-up, so 2-3 are the scale.
    before = max(step_s[2], step_s[3])
    assert max(step_s[s] for s in range(4, LEARN_STEPS + 1)) < 3 * before + 2, f"steps waited on MLflow: {step_s}"
    assert "tracking: MLflow at" in text and "record(s) not in MLflow" in text

    run_id = (out / "run_id").read_text().strip()
    mlflow_run = MlflowClient(server.uri).get_run(run_id)
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.params["algo.name"] == "gtpo"
    for key in KEYS:
        assert [s for s, _ in metric_rows(server, run_id, key)] == list(range(1, LEARN_STEPS + 1)), key
    for key in mlflow_run.data.metrics:  # no key of any kind has a step twice
        steps = [s for s, _ in metric_rows(server, run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
