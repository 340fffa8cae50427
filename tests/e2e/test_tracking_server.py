"""The tracking worker against a real ``mlflow server`` (SQLite backend, loopback): the server
dies mid-stream and comes back, hangs (SIGSTOP), and the run is SIGKILLed / crashes and resumes
three times; nothing is lost, no (key, step) is stored twice, a dead server never blocks a call."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from megatron_gtpo.tracking import Tracker, TrackingConfig
from tests.e2e.mlflow_server import metric_rows
from tests.helpers import REPO, run_group

KEYS = ["loss", "reward/mean", "time/step_s"]
DRIVER = REPO / "tests" / "e2e" / "scripts" / "tracking_driver.py"


def value(step: int, run: int, i: int) -> float:
    return 100.0 * run + step + i / 10


@pytest.fixture
def live_server(mlflow_server):
    """The session's server (tests/e2e/conftest.py), started again if a test left it down or paused."""
    if mlflow_server.proc is None:
        mlflow_server.start()
    yield mlflow_server
    if mlflow_server.proc is not None:
        mlflow_server.resume()


def log_steps(tracker: Tracker, steps: range, run: int = 0, every: int = 2) -> list[float]:
    """The driver's calls; returns the seconds each log_metrics call took."""
    took = []
    for step in steps:
        start = time.perf_counter()
        tracker.log_metrics({key: value(step, run, i) for i, key in enumerate(KEYS)}, step)
        took.append(time.perf_counter() - start)
        if step % every == 0:
            tracker.commit(step)
    return took


def test_server_killed_mid_stream_then_restarted(live_server, tmp_path):
    import mlflow.tracking  # noqa: F401 - imported up front: the timings are the tracker's

    tracker = Tracker(TrackingConfig(uri=live_server.uri, request_timeout_s=2), run_dir=tmp_path / "run")
    log_steps(tracker, range(1, 5))
    assert tracker.worker.flush(120), tracker.worker.last_error
    assert [s for s, _ in metric_rows(live_server, tracker.run_id, "loss")] == [1, 2, 3, 4]
    live_server.kill()
    took = log_steps(tracker, range(5, 12))  # 5..10 committed, 11 waits for a checkpoint
    assert max(took) < 0.05, f"log_metrics with the server dead: {took}"
    assert tracker.backlog().unsent == 7
    live_server.start()  # same port, same store
    assert tracker.worker.flush(180), tracker.worker.last_error
    assert [s for s, _ in metric_rows(live_server, tracker.run_id, "loss")] == list(range(1, 11))
    report = tracker.finish()
    assert report.unsent == 0 and report.status_sent
    from mlflow.tracking import MlflowClient

    assert MlflowClient(live_server.uri).get_run(tracker.run_id).info.status == "FINISHED"
    for i, key in enumerate(KEYS):
        assert metric_rows(live_server, tracker.run_id, key) == [(s, value(s, 0, i)) for s in range(1, 12)], key


def test_hung_server_costs_neither_steps_nor_exit(live_server, tmp_path):
    from megatron_gtpo.tracking.__main__ import replay

    tracker = Tracker(TrackingConfig(uri=live_server.uri, request_timeout_s=2), run_dir=tmp_path / "run")
    log_steps(tracker, range(1, 3))
    assert tracker.worker.flush(120), tracker.worker.last_error
    live_server.pause()
    try:
        took = log_steps(tracker, range(3, 9))
        start = time.perf_counter()
        report = tracker.finish()
        finish_s = time.perf_counter() - start
    finally:
        live_server.resume()
    assert max(took) < 0.05, took
    assert finish_s < 15, f"finish waited {finish_s:.1f}s on a hung server (2 tries of 2 s expected)"
    assert report.unsent == 6 and not report.status_sent
    tracker.worker._thread.join(60)  # its last request returns once the server runs again
    report = replay(tmp_path / "run", timeout_s=120)
    assert report.unsent == 0 and report.status_sent
    assert [s for s, _ in metric_rows(live_server, tracker.run_id, "loss")] == list(range(1, 9))


def drive(run_dir, uri, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return run_group([sys.executable, str(DRIVER), str(run_dir), uri, *args], timeout=300, env=env, cwd=REPO)


def test_killed_and_crashed_three_times_each_step_once(live_server, tmp_path):
    """SIGKILL after step 3 (checkpoint 2), SIGKILL during the save of step 6 (checkpoint 4), an
    uncaught exception at step 5 (FAILED), then a resume that finishes: steps 1..8 once each,
    with the values of the process whose work was kept."""
    from mlflow.tracking import MlflowClient

    run_dir, uri = tmp_path / "run", live_server.uri
    first = drive(run_dir, uri, "--run", "0", "--first", "1", "--last", "3", "--die-at", "3")
    assert first.returncode == -9, first.stderr[-3000:]
    assert drive(run_dir, uri, "--run", "1", "--first", "3", "--last", "6", "--resume-step", "2",
                 "--die-at", "6").returncode == -9
    crashed = drive(run_dir, uri, "--run", "2", "--first", "5", "--last", "5", "--resume-step", "4",
                    "--die-at", "5", "--how", "raise")
    assert crashed.returncode == 1 and "driver crash at step 5" in crashed.stderr
    assert "left RUNNING by pid" in crashed.stdout + crashed.stderr, "the SIGKILLed run is reported"
    run_id = (run_dir / "run_id").read_text().strip()  # written once the first process created the run
    run = MlflowClient(uri).get_run(run_id)
    assert run.info.status == "FAILED" and "exited without finishing" in run.data.tags["megatron_gtpo.end_reason"]
    last = drive(run_dir, uri, "--run", "3", "--first", "5", "--last", "8", "--resume-step", "4")
    assert last.returncode == 0, last.stderr[-3000:]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"
    kept = {1: 0, 2: 0, 3: 1, 4: 1, 5: 3, 6: 3, 7: 3, 8: 3}
    for i, key in enumerate(KEYS):
        assert metric_rows(live_server, run_id, key) == [(s, value(s, kept[s], i)) for s in range(1, 9)], key
