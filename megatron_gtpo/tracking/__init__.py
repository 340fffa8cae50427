"""MLflow tracking that never costs training: one run per run directory, params = the resolved
config, metrics per step, artifacts; only rank 0 tracks (elsewhere :class:`Tracker` is a no-op).
W&B (offline by default) and TensorBoard can publish the same journal beside it
(``tracking.backends``; see ``sinks.py`` for what they get and their exactly-once rule).

Where records go: ``tracking.uri``, else ``$MLFLOW_TRACKING_URI``, else a SQLite file
``<run dir>/mlflow.db`` (artifacts of local stores in ``<run dir>/mlartifacts``).

Design
    * Journal first. Every call (``log_metrics``, ``log_params``, ``log_json``, ``log_artifact``)
      appends one JSON line to ``<run dir>/tracking/journal.jsonl`` (flushed to the OS, so a
      killed process loses nothing; fsync'ed at each ``commit`` and at ``finish``) and returns:
      about 0.1 ms, whatever MLflow does. The journal is the queue: memory stays bounded (the
      worker reads 200 records at a time) and nothing is dropped; disk grows by the records
      themselves (about 2-3 KB a step for ~60 metrics, plus sample tables).
    * One worker thread (daemon) publishes the journal in order and records its progress (a byte
      offset) in ``tracking/state.json``. HTTP requests use ``MLFLOW_HTTP_REQUEST_TIMEOUT`` =
      ``tracking.request_timeout_s`` and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` = 0 (values you
      export win); after a failure the worker retries with backoff 0.5 s doubling to 15 s, and
      logs one warning per outage and one line when the store answers again. A dead or hung
      server therefore only delays publication; steps and checkpoints never wait on it.
    * Unsent records are replayed by the worker when the server answers again, by the next start
      with ``--resume``, or by ``python -m megatron_gtpo.tracking replay RUN_DIR`` (``status
      RUN_DIR`` prints the backlog and a run left RUNNING by a dead process).
    * The run is created by the worker (tagged with the journal's id, so a lost reply never makes
      a second run); ``Tracker.run_id`` is None until the store answered. The run id is kept in
      ``tracking/state.json`` and ``<run dir>/run_id``.

Exactly once per (key, step)
    A step re-run after a resume (the steps after the last checkpoint) must replace, not repeat,
    its metrics. MLflow has no delete-metric API over REST, so:

    * SQL stores (sqlite - the default -, postgresql, mysql, mssql URIs): every step is published
      at once; on ``--resume`` from step R the journal gets a ``rewind`` record, and the worker
      deletes the run's metric rows with step > R through the store's SQLAlchemy session before it
      publishes anything logged after the resume. Records of the killed process for steps > R that
      were never sent are skipped. Cost: one DELETE per resume; until the resume, the killed run's
      values of those steps are visible.
    * Other stores (an HTTP ``mlflow server``, databricks, file): records of step s (metrics, and
      artifacts logged with a step) are published once a checkpoint covering s is committed
      (``commit``), or at ``finish("FINISHED")``. Steps that will be re-run are never sent. Cost:
      the MLflow view lags by up to ``train.checkpoint_every`` steps. Resuming below a step
      already committed (an older checkpoint chosen by hand) can duplicate those steps: a warning
      says so.
    * A request whose reply was lost is sent again; the SQL backend (also behind an HTTP server)
      keeps one row per identical (key, step, timestamp, value), and the journal keeps each
      record's original timestamp, so a resend adds nothing. A file-backed server could show a
      duplicate row in that case.

    Guarantee: once the journal is drained, each (key, step) up to the last completed step is in
    the run once, with the value of the run that was continued. Params are logged once per run.

Run status
    ``finish("FINISHED" | "FAILED" | "KILLED", reason)`` sets it (after the records); an
    ``atexit`` hook marks a run that exits without ``finish`` (an uncaught exception) FAILED. A
    SIGKILL can do neither: the next ``--resume`` finds the journal's run RUNNING with no live
    process (``tracking/lock`` is flock'ed by the live writer), logs it, and continues the run
    (back to RUNNING); a fresh start in that directory marks it FAILED and moves the journal aside.
    A start that finds the lock held waits up to 60 s for that writer to exit, then logs an error
    and goes on unlocked (tracking never stops a training; the replay tool refuses instead).

What the driver calls (rank 0)
    ``Tracker(cfg.tracking, run_dir=..., run_id=<checkpoint's or None>, resume_step=<restored
    step, 0 when --resume found no checkpoint, None for a fresh run>)`` after the checkpoint
    restore; ``log_params`` / ``log_artifact`` / ``log_metrics(m, step)`` / ``log_json(d, name,
    step)`` per step; ``commit(step)`` after every committed checkpoint save; ``finish("FINISHED")``
    at the end, ``finish("KILLED")`` after a preemption exit, ``finish("FAILED", reason=repr(err))``
    in an ``except BaseException`` around the loop (the atexit hook is the fallback). Preflight
    calls ``check_tracking_uri(uri, timeout_s)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_gtpo.tracking.reporter import Reporter, sample_table, step_metrics
from megatron_gtpo.tracking.tracker import FlushReport, Tracker
from megatron_gtpo.tracking.uri import check_tracking_uri, redact_uri, resolve_uri, uri_password
from megatron_gtpo.utils.configuration import ConfigError, require

Backend = Literal["mlflow", "wandb", "tensorboard"]

__all__ = ["FlushReport", "Reporter", "Tracker", "TrackingConfig", "check_tracking_uri", "resolve_uri", "sample_table", "step_metrics"]


@dataclass(kw_only=True)
class TrackingConfig:
    """Where and how the run is tracked."""

    enabled: bool = True
    """Track at all (rank 0 only); false turns every backend off."""
    backends: list[Backend] = field(default_factory=lambda: ["mlflow"])
    """Where the journal is published, each by its own thread (one backend's outage never stops
    training or the others): 'mlflow' (the URI below), 'wandb' (a W&B run; offline files in
    <output_dir>/wandb, see wandb_mode), 'tensorboard' (event files in <output_dir>/tensorboard)."""
    wandb_project: str | None = None
    """W&B project; None = $WANDB_PROJECT if set, else the MLflow experiment's name."""
    wandb_mode: Literal["offline", "online"] | None = None
    """W&B mode; None = $WANDB_MODE when it is 'online' or 'offline', else 'offline' (upload later
    with `wandb sync <output_dir>/wandb/offline-run-*`). Online needs WANDB_API_KEY in the
    environment (never in a config file: wandb reads it there itself)."""
    uri: str | None = None
    """Tracking URI; None = $MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db. No
    password in it (it is written to config.yaml and the MLflow params): MLflow takes credentials
    from MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD / MLFLOW_TRACKING_TOKEN, or put the
    whole URI in $MLFLOW_TRACKING_URI (docs/security.md)."""
    experiment: str | None = None
    """MLflow experiment name (created when missing); None = $MLFLOW_EXPERIMENT_NAME if set, else
    'megatron-gtpo' (MLflow's own variable, as for the URI)."""
    run_name: str | None = None
    """MLflow run name; None = the output directory's name."""
    samples_every: int = 10
    """Log a table of sample completions with rewards every N steps (0 = never)."""
    num_samples: int = 8
    """Completions per sample table."""
    request_timeout_s: int = 5
    """Timeout of one MLflow HTTP request of the background worker, and of the preflight check
    that the tracking URI answers."""
    flush_timeout_s: float = 120.0
    """At the end of the run, the longest wait for unsent records to reach MLflow; a store that
    fails twice in a row ends the wait at once. The rest stays in <output_dir>/tracking/."""

    def __post_init__(self):
        if self.uri and uri_password(self.uri):
            raise ConfigError(f"uri={redact_uri(self.uri)!r} holds a password, which would be written to config.yaml "
                              "and MLflow: remove it and export MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or "
                              "MLFLOW_TRACKING_TOKEN), or leave tracking.uri unset and export the full "
                              "MLFLOW_TRACKING_URI")
        require(bool(self.backends) and len(set(self.backends)) == len(self.backends), "backends", self.backends,
                "a list of distinct backends among 'mlflow', 'wandb', 'tensorboard' (enabled=false tracks nothing)")
        require(self.samples_every >= 0, "samples_every", self.samples_every, ">= 0")
        require(self.num_samples >= 1, "num_samples", self.num_samples, ">= 1")
        require(self.request_timeout_s >= 1, "request_timeout_s", self.request_timeout_s, "an integer >= 1")
        require(self.flush_timeout_s >= 0, "flush_timeout_s", self.flush_timeout_s, ">= 0")
