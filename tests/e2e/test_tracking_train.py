"""Training never pays for tracking: configs/tiny.yaml trains 6 steps against a live ``mlflow
server`` that is SIGKILLed right after step 3. The run finishes (exit 0) with its checkpoints;
once the server is back, the journal replays and every step 1..6 is in MLflow exactly once."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from tests.e2e.mlflow_server import MlflowServer, metric_rows
from tests.helpers import REPO, child_env, kill_tree

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / "tiny.yaml")]
STEPS = 6
KEYS = ["loss", "reward/mean", "time/step_s", "optim/grad_norm", "entropy/mean"]
STEP_LINE = re.compile(r"step (\d+)/\d+ \|.* = ([0-9.]+)s")


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)  # steps of the tiny recipe take ~1 s: catch the line before the next one


def test_training_survives_a_dead_tracking_server(tmp_path):
    from mlflow.tracking import MlflowClient

    server = MlflowServer(tmp_path / "server").start()
    out, log_path = tmp_path / "run", tmp_path / "train.log"
    env = child_env(PYTHONUNBUFFERED="1")  # log lines as they happen
    proc = None
    try:
        with open(log_path, "w") as log:
            proc = subprocess.Popen([*CLI, "--output-dir", str(out), "--steps", str(STEPS),
                                     f"tracking.uri={server.uri}"], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, cwd=REPO, start_new_session=True)
        wait_for(lambda: "step 3/6 |" in log_path.read_text() or proc.poll() is not None, 900, "step 3")
        server.kill()
        killed_at = time.monotonic()
        rc = proc.wait(timeout=900)
        after_kill_s = time.monotonic() - killed_at
        text = log_path.read_text()
        assert rc == 0, f"training failed rc={rc}:\n{text[-6000:]}"
        for step in (4, 6):  # train.keep_last=2 removed step 2's
            assert (out / "checkpoints" / f"step_{step:08d}").is_dir()
        step_s = {int(m.group(1)): float(m.group(2)) for m in STEP_LINE.finditer(text)}
        print(f"step times (s): {step_s}; from the server kill to exit: {after_kill_s:.1f}s")
        assert sorted(step_s) == list(range(1, STEPS + 1))
        assert max(step_s[s] for s in (4, 5, 6)) < 60, f"steps after the kill waited on MLflow: {step_s}"
        assert "tracking: MLflow at" in text and "record(s) not in MLflow" in text

        server.start()  # same port and store: the server is back
        replay = subprocess.run([sys.executable, "-m", "megatron_gtpo.tracking", "replay", str(out)],
                                capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        run_id = (out / "run_id").read_text().strip()
        run = MlflowClient(server.uri).get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.params["algo.name"] == "gtpo"
        for key in KEYS:
            assert [s for s, _ in metric_rows(server, run_id, key)] == list(range(1, STEPS + 1)), key
        for key in run.data.metrics:  # no key of any kind has a step twice
            steps = [s for s, _ in metric_rows(server, run_id, key)]
            assert len(steps) == len(set(steps)), (key, steps)
    finally:
        if proc is not None:
            kill_tree(proc.pid)
            proc.wait()
        server.kill()


def test_step_rerun_after_sigkill_is_stored_once(tmp_path):
    """Default SQLite store: SIGKILL right after step 5 was logged (checkpoint 4; steps 5 and maybe
    6 already in MLflow), then --resume: every per-step key has steps 1..8 exactly once (data/* has
    step 0 once), one MLflow run, FINISHED, and the resume reported the run the killed process left
    RUNNING."""
    from mlflow.tracking import MlflowClient

    out, log_path = tmp_path / "run", tmp_path / "killed.log"
    env = child_env(PYTHONUNBUFFERED="1")  # log lines as they happen
    args = [*CLI, "--output-dir", str(out), "--steps", "8", "train.checkpoint_every=4"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        wait_for(lambda: "step 5/8 |" in log_path.read_text() or proc.poll() is not None, 900, "step 5")
    finally:
        kill_tree(proc.pid)
        proc.wait()
    assert proc.returncode == -9 and not (out / "checkpoints" / "step_00000008").exists(), "killed too late"
    run_id = (out / "run_id").read_text().strip()
    uri = f"sqlite:///{out / 'mlflow.db'}"
    before = [m.step for m in MlflowClient(uri).get_metric_history(run_id, "loss")]
    resumed = subprocess.run([*args, "--resume"], capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-6000:]
    assert "left RUNNING by pid" in resumed.stdout + resumed.stderr
    assert (out / "run_id").read_text().strip() == run_id
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    print(f"loss steps in MLflow at the kill: {before}")
    for key in run.data.metrics:
        steps = sorted(m.step for m in client.get_metric_history(run_id, key))
        # data/* describe the prompt set: logged once, at step 0 of the fresh run, never on resume
        assert steps == ([0] if key.startswith("data/") else list(range(1, 9))), (key, steps)
    assert "data/prompts" in run.data.metrics
