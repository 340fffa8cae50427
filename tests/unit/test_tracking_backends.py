"""W&B (offline) and TensorBoard beside MLflow (tracking.backends), against the real packages in
tmp, read back from their own files (tests/tracking_readers.py): the same (step, value) as MLflow,
each step once after a crash and resume, and each backend's outage (package missing, directory
unwritable, wandb init failing, a writer raising mid-run) leaves training and the others whole."""

from __future__ import annotations

import atexit
import logging
import sys
import time
from pathlib import Path

import pytest

from megatron_gtpo.tracking import Tracker, TrackingConfig
from megatron_gtpo.utils.configuration import ConfigError, build
from tests.tracking_readers import tensorboard_scalars, wandb_config, wandb_exit_codes, wandb_history

ALL = ["mlflow", "wandb", "tensorboard"]
KEYS = ["loss", "reward/mean"]


def metrics(step: int, run: int) -> dict[str, float]:
    """Values that say which process logged them (``run``) for which step."""
    return {key: 100.0 * run + step + i / 10 for i, key in enumerate(KEYS)}


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """One SQLite store for the module (MLflow's migrations run once); each test has its own run."""
    return f"sqlite:///{tmp_path_factory.mktemp('store') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """No test reaches the network: W&B offline unless a test says otherwise, at a dead URL."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")


class Lines(logging.Handler):
    """The package logger's lines, each once (caplog would see them twice: propagated and attached)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_log():
    logger, handler = logging.getLogger("megatron_gtpo"), Lines()
    level, logger.level = logger.level, logging.INFO
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def train(run_dir: Path, cfg: TrackingConfig, *, steps: range, run: int, resume_step: int | None,
          every: int = 2) -> Tracker:
    """The driver's calls: params once, metrics per step (plus step 0's data counts on a fresh
    run, and a second record at each even step, as an eval), a commit after each checkpoint."""
    tracker = Tracker(cfg, run_dir=run_dir, resume_step=resume_step)
    tracker.log_params({"algo": {"name": "gtpo"}})
    if resume_step is None:
        tracker.log_metrics({"data/prompts": 7.0}, 0)
    for step in steps:
        tracker.log_metrics(metrics(step, run), step)
        if step % every == 0:
            tracker.log_metrics({"eval/accuracy": step / 100 + run}, step)
            tracker.commit(step)
    return tracker


def crash(tracker: Tracker) -> None:
    """What a SIGKILL leaves: no finish; every record sent so far is out, the journal as written.
    (W&B's own service process ends the run of a killed process: its run is closed here, exit 137.)"""
    for worker in tracker.workers.values():
        worker.flush(60)
    atexit.unregister(tracker._at_exit)
    for worker in tracker.workers.values():
        worker.stop()
    wandb_worker = tracker.workers.get("wandb")
    if wandb_worker is not None and wandb_worker.publisher.sink._run is not None:
        wandb_worker.publisher.sink._run.finish(exit_code=137)
    tracker.journal._append_fh.close()
    tracker.journal.release()
    time.sleep(1.1)  # W&B names an offline run directory by the second it started


def everything(run_dir: Path, uri: str, run_id: str) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{backend: {key: [(step, value), ...]}} read back from each backend's own store."""
    keys = [*KEYS, "data/prompts", "eval/accuracy"]
    tb, wb = tensorboard_scalars(run_dir), wandb_history(run_dir)
    return {"mlflow": {k: mlflow_history(uri, run_id, k) for k in keys},
            "tensorboard": {k: sorted(tb.get(k, [])) for k in keys},
            "wandb": {k: sorted(wb.get(k, [])) for k in keys}}


def test_backends_config_is_checked_with_a_suggestion():
    """A misspelt backend names the field and suggests the right one; an empty or repeated list
    says how to track nothing."""
    with pytest.raises(ConfigError, match=r"backends\[1\]='tensorbord'.*did you mean 'tensorboard'"):
        build(TrackingConfig, {"backends": ["mlflow", "tensorbord"]})
    for bad in ([], ["wandb", "wandb"]):
        with pytest.raises(ConfigError, match="enabled=false tracks nothing"):
            TrackingConfig(backends=bad)


def test_every_backend_holds_mlflows_steps_and_values(tmp_path, sqlite_uri):
    """One run to all three: each key's (step, value) list read back from TensorBoard's event files
    and W&B's offline log equals MLflow's, step 0 and the second record of a step included; the W&B
    run ends with exit code 0; the params reach W&B's config. Injected bug caught: WandbSink.write
    logging without ``step=`` (W&B counts rows itself: step 0 and the eval rows shift every step)."""
    run_dir = tmp_path / "run"
    tracker = train(run_dir, TrackingConfig(uri=sqlite_uri, backends=ALL), steps=range(1, 7), run=0, resume_step=None)
    report = tracker.finish()
    assert report.unsent == 0 and report.others == {"tensorboard": 0, "wandb": 0}, report
    got = everything(run_dir, sqlite_uri, tracker.run_id)
    assert got["mlflow"]["loss"] == [(s, metrics(s, 0)["loss"]) for s in range(1, 7)]
    assert got["mlflow"]["data/prompts"] == [(0, 7.0)]
    for backend in ("tensorboard", "wandb"):
        for key, points in got["mlflow"].items():
            # TensorBoard stores float32: compare at its precision
            assert [(s, round(v, 4)) for s, v in got[backend][key]] == [(s, round(v, 4)) for s, v in points], \
                (backend, key)
    assert wandb_exit_codes(run_dir) == [0]
    assert wandb_config(run_dir).get("algo.name") == "gtpo", wandb_config(run_dir)


def test_a_crash_and_resume_leave_each_step_once_in_every_backend(tmp_path, sqlite_uri):
    """Killed after step 5 (checkpoint at 4), resumed at 4 with other values: each backend holds
    steps 1-8 once, 5-8 with the resumed run's values. TensorBoard had step 5 (it gets every step at
    once) and drops it by its purge rule; W&B never got it (it waits for a checkpoint). Injected
    bugs caught: TensorBoardSink ignoring the rewind record (step 5 twice in TensorBoard), and
    WandbSink.can_delete = True (step 5 of the killed run in W&B, then again)."""
    run_dir, cfg = tmp_path / "run", TrackingConfig(uri=sqlite_uri, backends=ALL)
    crash(train(run_dir, cfg, steps=range(1, 6), run=0, resume_step=None))
    tracker = train(run_dir, cfg, steps=range(5, 9), run=1, resume_step=4)
    tracker.finish()
    got = everything(run_dir, sqlite_uri, tracker.run_id)
    expected = [(s, round(metrics(s, 0 if s <= 4 else 1)["loss"], 4)) for s in range(1, 9)]
    for backend in ALL:
        assert [(s, round(v, 4)) for s, v in got[backend]["loss"]] == expected, (backend, got[backend]["loss"])
    assert wandb_exit_codes(run_dir) == [137, 0]


def test_a_missing_package_turns_only_that_backend_off(tmp_path, sqlite_uri, monkeypatch, warnings_log):
    """wandb not importable: one warning naming W&B and the install command, the Tracker builds and
    every call returns, MLflow and TensorBoard get every step, and W&B's records stay in the journal
    (FlushReport.others). Injected bug caught: the sink built in the training thread (Tracker's
    constructor raising ImportError into the training)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets when it is not installed
    run_dir = tmp_path / "run"
    tracker = train(run_dir, TrackingConfig(uri=sqlite_uri, backends=ALL), steps=range(1, 5), run=0, resume_step=None)
    report = tracker.finish(timeout_s=30)
    assert report.unsent == 0 and report.others["tensorboard"] == 0 and report.others["wandb"] > 0, report
    assert warnings_log.text.count("W&B is off for this run") == 1
    assert "pip install wandb==0.31.0" in warnings_log.text
    assert [s for s, _ in mlflow_history(sqlite_uri, tracker.run_id, "loss")] == [1, 2, 3, 4]
    assert [s for s, _ in tensorboard_scalars(run_dir)["loss"]] == [1, 2, 3, 4]
    assert not (run_dir / "wandb").exists()


def test_an_unwritable_tensorboard_dir_and_a_failing_wandb_init_leave_mlflow_whole(tmp_path, sqlite_uri,
                                                                                   monkeypatch, warnings_log):
    """<run dir>/tensorboard is a file (a directory that cannot be written: root ignores chmod) and
    W&B online has no API key (its init raises): each warns once, naming itself and the fix;
    every call returns at once; MLflow gets every step. Injected bug caught: Worker._finish_try
    warning at every failed try instead of once per outage (the retries flood the log)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tensorboard").write_text("not a directory")
    cfg = TrackingConfig(uri=sqlite_uri, backends=ALL, wandb_mode="online")
    start = time.monotonic()
    tracker = train(run_dir, cfg, steps=range(1, 5), run=0, resume_step=None)
    assert time.monotonic() - start < 30, "a failing backend made the training thread wait"
    report = tracker.finish(timeout_s=10)
    text = warnings_log.text
    assert text.count("tracking: TensorBoard at") == 1 and f"make {run_dir / 'tensorboard'} writable" in text, text
    assert text.count("tracking: W&B (online") == 1 and "WANDB_API_KEY exported" in text, text
    assert report.unsent == 0 and report.others["tensorboard"] > 0 and report.others["wandb"] > 0, report
    assert [s for s, _ in mlflow_history(sqlite_uri, tracker.run_id, "loss")] == [1, 2, 3, 4]


def test_a_tensorboard_writer_raising_mid_run_loses_and_doubles_nothing(tmp_path, sqlite_uri, monkeypatch,
                                                                        warnings_log):
    """The event writer raises (a disk error) twice, then works again: once half-way through step
    3's record ('loss' written, 'reward/mean' not), once on step 4's eval record (step 4's metrics
    record went out in an earlier batch). Each outage warns once and says when it answers again;
    TensorBoard ends with steps 1-6 once each and MLflow's values. Injected bugs caught:
    SinkPublisher retrying without _recover (step 3's 'loss' twice), and _recover purging step 4
    without going back to where step 4 began (step 4's 'loss' lost)."""
    from torch.utils.tensorboard import SummaryWriter

    real, fail_once = SummaryWriter.add_scalar, {(3, "reward/mean"), (4, "eval/accuracy")}

    def add_scalar(self, tag, value, step, walltime=None):
        if (step, tag) in fail_once:
            fail_once.discard((step, tag))
            raise OSError(28, "No space left on device (injected)")
        return real(self, tag, value, step, walltime=walltime)

    monkeypatch.setattr(SummaryWriter, "add_scalar", add_scalar)
    run_dir = tmp_path / "run"
    tracker = Tracker(TrackingConfig(uri=sqlite_uri, backends=["mlflow", "tensorboard"]), run_dir=run_dir)
    tb = tracker.workers["tensorboard"]
    for step in range(1, 7):  # each record its own batch: the failures land where the docstring says
        tracker.log_metrics(metrics(step, 0), step)
        assert tb.flush(60) or step in (3, 4)
        if step % 2 == 0:
            tracker.log_metrics({"eval/accuracy": step / 100}, step)
            assert tb.flush(60) or step == 4
    report = tracker.finish(timeout_s=60)
    assert report.others == {"tensorboard": 0} and not fail_once, report
    text = warnings_log.text
    assert text.count("tracking: TensorBoard at") == 4, text  # 2 outages: 'failed' and 'answers again' each
    assert text.count("answers again") == 2, text
    scalars = tensorboard_scalars(run_dir)
    for key in KEYS:
        assert [(s, round(v, 4)) for s, v in scalars[key]] == [(s, round(metrics(s, 0)[key], 4)) for s in range(1, 7)], \
            (key, scalars[key])
    assert [s for s, _ in scalars["eval/accuracy"]] == [2, 4, 6]
