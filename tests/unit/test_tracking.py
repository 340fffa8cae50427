"""Tracking journal, worker and replay against real MLflow stores in tmp (SQLite and file stores,
no server; the server tests are in tests/e2e/test_tracking_server.py): nothing lost, each
(key, step) once after crashes and resumes, a dead URI never blocks a call, preflight's URI check."""

from __future__ import annotations

import atexit
import json
import logging
import socket
import time
from pathlib import Path

import pytest

from megatron_gtpo.tracking import Tracker, TrackingConfig, check_tracking_uri
from megatron_gtpo.tracking.journal import Journal, JournalState, held, superseded
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO, free_port

KEYS = ["loss", "reward/mean", "time/step_s"]


def metrics(step: int, run: int) -> dict[str, float]:
    """Values that say which process logged them (``run``) for which step."""
    return {key: 100.0 * run + step + i / 10 for i, key in enumerate(KEYS)}


def crash(tracker: Tracker) -> None:
    """What a SIGKILL leaves behind: no finish, no flush, the journal as written; the kernel drops the lock."""
    atexit.unregister(tracker._at_exit)
    tracker.worker.stop()
    tracker.journal._append_fh.close()
    tracker.journal.release()


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def train(run_dir: Path, cfg: TrackingConfig, *, steps: range, run: int, resume_step: int | None,
          every: int = 2, crash_after: int | None = None, flush_before_crash: bool = True) -> Tracker:
    """The driver's calls for ``steps``: metrics per step, commit after each checkpoint."""
    tracker = Tracker(cfg, run_dir=run_dir, resume_step=resume_step)
    tracker.log_params({"algo": {"name": "gtpo"}, "run": run} if run == 0 else {"run": run})
    for step in steps:
        tracker.log_metrics(metrics(step, run), step)
        if step == crash_after:  # killed before this step's checkpoint (if any) was committed
            if flush_before_crash:
                assert tracker.worker.flush(120), tracker.worker.last_error
            crash(tracker)
            return tracker
        if step % every == 0:
            tracker.commit(step)
    return tracker


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """One SQLite store for the module (creating one runs MLflow's migrations: ~15 s on a busy box);
    every test has its own run in it."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture
def sqlite_cfg(sqlite_uri) -> TrackingConfig:
    return TrackingConfig(uri=sqlite_uri)


@pytest.fixture(autouse=True)
def _allow_file_store(monkeypatch):
    """The file store stands in for stores without delete (like an HTTP server); MLflow 3 wants an opt-in."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


@pytest.fixture
def warnings_log(caplog):
    """The package logger's warnings (attached directly: the driver's setup_logging stops propagation)."""
    logger = logging.getLogger("megatron_gtpo")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.WARNING, "megatron_gtpo")
    yield caplog
    logger.removeHandler(caplog.handler)


# ------------------------------------------------------------------------------ journal rules


def test_journal_drops_a_torn_tail_and_skips_partial_lines(tmp_path):
    journal = Journal(tmp_path / "tracking")
    journal.root.mkdir()
    journal.set_state(JournalState(uri="x", experiment="e", run_name="r"))
    journal.path.write_bytes(b'{"seq":0,"t":"metrics","step":1,"ts":1,"m":{"a":1}}\n{"seq":1,"t":"met')
    assert [r["seq"] for r, _ in journal.read(0)] == [0], "a line without newline is still being written"
    journal.open_for_append()
    assert journal.append({"t": "params", "params": {}}) == 1
    journal.close()
    assert [r["seq"] for r, _ in journal.read(0)] == [0, 1]


def test_rewind_supersedes_later_steps_and_hold_waits_for_commit():
    state = JournalState(uri="x", experiment="e", run_name="r", committed_step=4, rewinds=[[10, 4]])
    assert superseded({"seq": 7, "step": 5}, state.rewinds) and not superseded({"seq": 7, "step": 4}, state.rewinds)
    assert not superseded({"seq": 12, "step": 5}, state.rewinds), "logged after the resume: the re-run value"
    assert not superseded({"seq": 3, "t": "params"}, state.rewinds)
    assert held({"step": 5}, state) and not held({"step": 4}, state) and not held({"t": "params"}, state)
    state.release_all = True
    assert not held({"step": 5}, state)


# ------------------------------------------------------------------------------ real stores


def test_records_reach_the_sqlite_store(tmp_path, sqlite_cfg):
    from mlflow.tracking import MlflowClient

    config = tmp_path / "config.yaml"
    config.write_text("algo: gtpo\n")
    tracker = train(tmp_path / "run", sqlite_cfg, steps=range(1, 4), run=0, resume_step=None)
    tracker.log_artifact(config)
    config.write_text("changed after logging\n")
    tracker.log_json({"rows": [1, 2]}, "samples/step_000003.json", step=3)
    report = tracker.finish()
    assert report.unsent == 0 and report.status_sent, report
    run_id = (tmp_path / "run" / "run_id").read_text().strip()
    assert run_id == tracker.run_id
    client = MlflowClient(sqlite_cfg.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"algo.name": "gtpo", "run": "0"}
    assert history(sqlite_cfg.uri, run_id, "loss") == [(s, metrics(s, 0)["loss"]) for s in (1, 2, 3)]
    local = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path)))
    assert local.read_text() == "algo: gtpo\n", "the file as it was when logged"
    assert json.loads(Path(client.download_artifacts(run_id, "samples/step_000003.json", str(tmp_path)))
                      .read_text()) == {"rows": [1, 2]}


@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_three_crashes_and_resumes_log_each_step_once(tmp_path, store, warnings_log, sqlite_uri):
    """SQLite deletes re-run steps on resume; the file store (like an HTTP server) only publishes
    steps a checkpoint covers. Kills: after step 3 (sent), during the save of step 6 (not flushed),
    after step 5 (sent); each resume re-runs the steps after the last committed checkpoint."""
    uri = sqlite_uri if store == "sqlite" else (tmp_path / "mlruns").as_uri()
    cfg, run_dir = TrackingConfig(uri=uri), tmp_path / "run"
    train(run_dir, cfg, steps=range(1, 4), run=0, resume_step=None, crash_after=3)
    train(run_dir, cfg, steps=range(3, 7), run=1, resume_step=2, crash_after=6, flush_before_crash=False)
    tracker = train(run_dir, cfg, steps=range(5, 6), run=2, resume_step=4, crash_after=5)
    assert "left RUNNING by pid" in warnings_log.text, "a run killed without finish() is reported at the resume"
    so_far = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2} if store == "sqlite" else {1: 0, 2: 0, 3: 1, 4: 1}
    assert history(uri, tracker.run_id, "loss") == [(s, metrics(s, run)["loss"]) for s, run in so_far.items()]
    tracker = train(run_dir, cfg, steps=range(5, 9), run=3, resume_step=4)
    report = tracker.finish()
    assert report.unsent == 0 and report.status_sent, report
    expected = {1: 0, 2: 0, 3: 1, 4: 1, 5: 3, 6: 3, 7: 3, 8: 3}  # step -> the process whose value counts
    for key in KEYS:
        got = history(uri, tracker.run_id, key)
        assert [s for s, _ in got] == list(range(1, 9)), (key, got)
        assert got == [(s, metrics(s, expected[s])[key]) for s in range(1, 9)], (key, got)


def test_delete_steps_after_keeps_the_latest_value_consistent(tmp_path, sqlite_cfg):
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    from megatron_gtpo.tracking.publisher import delete_steps_after

    client = MlflowClient(sqlite_cfg.uri)
    run_id = client.create_run(client.create_experiment(f"delete-{tmp_path.name}")).info.run_id
    client.log_batch(run_id, metrics=[Metric(k, 10.0 * s + i, 1000 + s, s) for s in range(1, 6)
                                      for i, k in enumerate(["a", "b"])] + [Metric("only_late", 1.0, 1, 5)])
    assert delete_steps_after(client, run_id, 3) == 5
    assert history(sqlite_cfg.uri, run_id, "a") == [(1, 10.0), (2, 20.0), (3, 30.0)]
    assert client.get_run(run_id).data.metrics == {"a": 30.0, "b": 31.0}, "latest values recomputed, empty keys gone"


def test_a_rejected_metric_is_counted_and_the_rest_is_sent(tmp_path, sqlite_cfg, warnings_log):
    tracker = Tracker(sqlite_cfg, run_dir=tmp_path / "run")
    tracker.log_metrics({"loss": 1.0, "bad//key": 2.0}, 1)
    tracker.log_metrics({"loss": 2.0}, 2)
    report = tracker.finish()
    assert report.unsent == 0 and report.status_sent and tracker.journal.snapshot().rejected == 1
    assert history(sqlite_cfg.uri, tracker.run_id, "loss") == [(1, 1.0), (2, 2.0)]
    assert "MLflow rejected a metric record" in warnings_log.text


def test_file_store_publishes_a_step_once_a_checkpoint_covers_it(tmp_path):
    uri = (tmp_path / "mlruns").as_uri()
    tracker = train(tmp_path / "run", TrackingConfig(uri=uri), steps=range(1, 4), run=0, resume_step=None)
    assert tracker.worker.flush(120)
    assert [s for s, _ in history(uri, tracker.run_id, "loss")] == [1, 2]
    assert tracker.backlog().held == 1
    tracker.finish("KILLED", reason="preempted")
    assert [s for s, _ in history(uri, tracker.run_id, "loss")] == [1, 2], "KILLED keeps step 3 for the resume"


def test_dead_server_never_blocks_and_replay_sends_the_journal(tmp_path, sqlite_uri):
    import mlflow.tracking  # noqa: F401 - imported up front: the timings below are the tracker's, not the import's

    from megatron_gtpo.tracking.__main__ import replay, status

    cfg = TrackingConfig(uri=f"http://127.0.0.1:{free_port()}", flush_timeout_s=60)
    start = time.perf_counter()
    tracker = train(tmp_path / "run", cfg, steps=range(1, 21), run=0, resume_step=None)
    tracker.log_json({"a": 1}, "samples/step_000020.json")
    assert time.perf_counter() - start < 3 * cfg.request_timeout_s, "init waits at most for one failed try"
    start = time.perf_counter()
    for step in range(21, 221):
        tracker.log_metrics(metrics(step, 0), step)
    per_call = (time.perf_counter() - start) / 200
    assert per_call < 0.01, f"log_metrics took {per_call * 1e3:.2f} ms with a dead server"
    start = time.perf_counter()
    report = tracker.finish()
    assert time.perf_counter() - start < 3 * cfg.request_timeout_s, "a dead server ends the flush at once"
    assert report.unsent == 222 and not report.status_sent and tracker.run_id is None
    assert "222 record(s) not in MLflow" in status(tmp_path / "run")
    sqlite = sqlite_uri  # the server stays dead: send the journal to another store
    report = replay(tmp_path / "run", uri=sqlite, timeout_s=120)
    assert report.unsent == 0 and report.status_sent
    run_id = (tmp_path / "run" / "run_id").read_text().strip()
    assert [s for s, _ in history(sqlite, run_id, "loss")] == list(range(1, 221))


def test_a_second_writer_waits_then_goes_on_loudly_and_replay_is_refused(tmp_path, sqlite_cfg, warnings_log,
                                                                          monkeypatch):
    from megatron_gtpo.tracking import tracker as tracker_module
    from megatron_gtpo.tracking.__main__ import replay

    monkeypatch.setattr(tracker_module, "LOCK_WAIT_S", 1.0)
    first = Tracker(sqlite_cfg, run_dir=tmp_path / "run")
    with pytest.raises(ConfigError, match="another live process"):
        replay(tmp_path / "run", timeout_s=1)
    start = time.perf_counter()
    second = Tracker(sqlite_cfg, run_dir=tmp_path / "run", resume_step=0)
    assert time.perf_counter() - start >= 1.0
    assert "another live process" in warnings_log.text and "WITHOUT the journal lock" in warnings_log.text
    second.finish()
    first.finish()


def test_fresh_start_moves_the_old_journal_aside_and_fails_its_run(tmp_path, sqlite_cfg):
    from mlflow.tracking import MlflowClient

    first = train(tmp_path / "run", sqlite_cfg, steps=range(1, 3), run=0, resume_step=None, crash_after=2)
    second = Tracker(sqlite_cfg, run_dir=tmp_path / "run")
    second.finish()
    assert second.run_id not in (None, first.run_id)
    assert len(list(tmp_path.glob("run/tracking.*"))) == 1
    from megatron_gtpo.tracking.__main__ import replay

    replay(next(tmp_path.glob("run/tracking.*")), timeout_s=60)
    assert MlflowClient(sqlite_cfg.uri).get_run(first.run_id).info.status == "FAILED"
    assert (tmp_path / "run" / "run_id").read_text().strip() == second.run_id


# ------------------------------------------------------------------------------ preflight check


def test_uri_check_fails_fast_when_nothing_listens():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"tracking\.uri=.*nothing answers.*mlflow server"):
        check_tracking_uri(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    assert time.perf_counter() - start < 5


def test_uri_check_gives_up_on_a_server_that_never_answers():
    with socket.socket() as sock:  # accepts connections in the backlog, never replies
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        start = time.perf_counter()
        with pytest.raises(ConfigError, match=r"tracking\.uri="):
            check_tracking_uri(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=2)
        assert time.perf_counter() - start < 4


def test_uri_check_of_local_stores(tmp_path, monkeypatch):
    assert "writable" in check_tracking_uri(f"sqlite:///{tmp_path / 'new' / 'dir' / 'mlflow.db'}")
    assert not (tmp_path / "new").exists(), "the check creates nothing"
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="not writable"):
        check_tracking_uri(f"sqlite:///{blocker / 'sub' / 'mlflow.db'}")
    with pytest.raises(ConfigError, match="tracking.uri"):
        check_tracking_uri(f"postgresql://u:p@127.0.0.1:{free_port()}/db", timeout_s=2)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE"):
        check_tracking_uri(tmp_path.as_uri())


def test_train_dry_run_rejects_a_dead_tracking_uri_within_10s(tmp_path, capsys, monkeypatch):
    from megatron_gtpo.config import load_config
    from megatron_gtpo.cli import train as train_cli

    monkeypatch.chdir(REPO)
    load_config("configs/tiny.yaml", [])  # warm-up: its lazy torch/Megatron imports (20-30 s on a busy 2-core box) are not the check
    port = free_port()
    start = time.perf_counter()
    code = train_cli.main(["configs/tiny.yaml", "--dry-run", "--output-dir", str(tmp_path / "run"),
                           f"tracking.uri=http://127.0.0.1:{port}"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 2 and f"tracking.uri='http://127.0.0.1:{port}'" in err and "mlflow server" in err, err
    assert elapsed < 10, f"dry run took {elapsed:.1f}s to reject the URI"


def test_mlflow_experiment_name_from_the_environment(tmp_path, sqlite_cfg, monkeypatch):
    """MLFLOW_EXPERIMENT_NAME was silently ignored (the run went to 'megatron-gtpo'). Injected bug:
    the tracker using `self._cfg.experiment` again -> the experiment is None/'megatron-gtpo', fails.
    A recipe's tracking.experiment still wins over the variable."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", f"from-env-{tmp_path.name}")
    tracker = train(tmp_path / "run", sqlite_cfg, steps=range(1, 3), run=0, resume_step=None)
    tracker.finish()
    run = MlflowClient(sqlite_cfg.uri).get_run(tracker.run_id)
    assert MlflowClient(sqlite_cfg.uri).get_experiment(run.info.experiment_id).name == f"from-env-{tmp_path.name}"
    from megatron_gtpo.tracking.uri import resolve_experiment

    assert resolve_experiment("mine") == "mine"
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME")
    assert resolve_experiment(None) == "megatron-gtpo"


def test_eta_is_the_remaining_steps_at_the_recent_mean_step_time():
    """The step line had no ETA. Injected bug: the mean over all steps instead of the last 10 -> the
    slow first step still weighs in, 0:05:27 instead of 0:01:00, fails."""
    from megatron_gtpo.tracking.reporter import eta

    assert eta([100.0] + [2.0] * 10, 30) == "0:01:00"
    assert eta([3.0, float("nan")], 1200) == "1:00:00" and eta([], 5) == "?" and eta([2.0], 0) == "0:00:00"
