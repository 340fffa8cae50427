"""The MLflow side of the journal: sends what is ready, in journal order, and nothing else.

Only the worker thread (or the replay tool, with the run's process gone) calls into this module;
every call may raise when the store does not answer, and the caller retries later: progress is
the journal's ``sent_offset``, advanced after each accepted request, so a retry resends at most
one request's records (SQL stores keep one row per identical key/step/timestamp/value).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from megatron_gtpo.models.smollm2 import default_cache_dir
from megatron_gtpo.tracking.journal import TERMINAL, Journal, JournalState, next_batch, superseded
from megatron_gtpo.tracking.sqlite_seed import seed_sqlite_store
from megatron_gtpo.tracking.uri import redact_uri
from megatron_gtpo.utils.atomic import write_text_atomic

log = logging.getLogger("megatron_gtpo")

JOURNAL_TAG = "megatron_gtpo.journal"
END_REASON_TAG = "megatron_gtpo.end_reason"
MAX_METRICS = 1000  # MLflow's log_batch limits
MAX_PARAMS = 100
READ_RECORDS = 200  # journal records read per round: bounds the worker's memory
# The store rejected the request itself (bad key or value, param changed): resending cannot help.
REJECTED = ("INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS")


def is_rejection(err: BaseException) -> bool:
    return getattr(err, "error_code", None) in REJECTED


class Publisher:
    """Sends one journal's records to its MLflow run (creating the run first when needed)."""

    def __init__(self, journal: Journal):
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
        from mlflow.tracking import MlflowClient

        self.journal = journal
        seed_sqlite_store(journal.snapshot().uri, default_cache_dir())
        self.client = MlflowClient(tracking_uri=journal.snapshot().uri)
        # SQL stores (sqlite, postgresql, mysql) can delete the metrics of re-run steps, so they
        # publish every step at once; other stores (an HTTP server) publish a step once a
        # checkpoint covers it (see the package docstring).
        self.can_delete = isinstance(self.client._tracking_client.store, SqlAlchemyStore)

    def pump(self, stop=lambda: False) -> None:
        """Creates the run, publishes every ready record and the wanted status; returns when
        nothing more is ready (everything sent, or the rest waits for a checkpoint), or when
        ``stop()`` turns true between requests."""
        run_id = self.ensure_run()
        state = self.journal.snapshot()
        if state.status == "RUNNING" and state.published_status != "RUNNING":
            self.client.update_run(run_id, status="RUNNING")
            self.journal.update(published_status="RUNNING")
        while not stop():
            if not self._send_round(run_id):
                break
        else:
            return
        state = self.journal.snapshot()
        if state.status in TERMINAL and state.published_status != state.status:
            if state.reason:
                self.client.set_tag(run_id, END_REASON_TAG, state.reason[:5000])
            self.client.set_terminated(run_id, status=state.status)
            self.journal.update(published_status=state.status)

    def ensure_run(self) -> str:
        """The journal's run id; creates the experiment and the run on first use. A run tagged
        with this journal's id is found again instead of created twice (lost create reply)."""
        state = self.journal.snapshot()
        if state.run_id:
            return state.run_id
        exp = self.client.get_experiment_by_name(state.experiment)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(state.experiment, artifact_location=state.artifact_location)
            except Exception as err:  # another process created it meanwhile
                if not is_rejection(err) or (exp := self.client.get_experiment_by_name(state.experiment)) is None:
                    raise
                exp_id = exp.experiment_id
        else:
            exp_id = exp.experiment_id
        found = self.client.search_runs([exp_id], f"tags.`{JOURNAL_TAG}` = '{state.journal_id}'", max_results=1)
        run = found[0] if found else self.client.create_run(exp_id, run_name=state.run_name,
                                                            tags={JOURNAL_TAG: state.journal_id})
        run_id = run.info.run_id
        self.journal.update(run_id=run_id, published_status=run.info.status)
        if self.journal.root.name == "tracking":  # the live journal of a run dir (not a moved-aside one)
            write_text_atomic(self.journal.root.parent / "run_id", run_id)
        log.info("tracking: MLflow run %s at %s", run_id, redact_uri(state.uri))
        return run_id

    def _send_round(self, run_id: str) -> bool:
        """Publishes up to READ_RECORDS ready records; False when nothing more is ready."""
        state = self.journal.snapshot()
        batch, end = next_batch(self.journal, state, state.sent_offset, can_delete=self.can_delete,
                                max_records=READ_RECORDS)
        if not batch:
            return False
        self._publish(run_id, [record for record, _ in batch], state)
        self.journal.update(sent_offset=end)
        return True

    def _publish(self, run_id: str, records: list[dict[str, Any]], state: JournalState) -> None:
        """Sends ``records`` in order: consecutive metrics records share log_batch calls."""
        from mlflow.entities import Metric

        metrics: list[Metric] = []
        for record in records:
            kind = record.get("t")
            if superseded(record, state.rewinds):
                continue
            if kind == "metrics":
                metrics += [Metric(k, float(v), int(record["ts"]), int(record["step"])) for k, v in record["m"].items()]
                continue
            self._send_metrics(run_id, metrics)
            metrics = []
            self._guarded(record, lambda r=record: self._send_other(run_id, r))
        self._send_metrics(run_id, metrics)

    def _send_metrics(self, run_id: str, metrics: list) -> None:
        for start in range(0, len(metrics), MAX_METRICS):
            chunk = metrics[start:start + MAX_METRICS]
            try:
                self.client.log_batch(run_id, metrics=chunk)
            except Exception as err:
                if not is_rejection(err):
                    raise
                for metric in chunk:  # find the bad one(s), keep the rest
                    self._guarded({"t": "metric", "key": metric.key, "step": metric.step},
                                  lambda m=metric: self.client.log_batch(run_id, metrics=[m]))

    def _send_other(self, run_id: str, record: dict[str, Any]) -> None:
        from mlflow.entities import Param

        kind = record.get("t")
        if kind == "params":
            items = [Param(k, v) for k, v in record["params"].items()]
            for start in range(0, len(items), MAX_PARAMS):
                self.client.log_batch(run_id, params=items[start:start + MAX_PARAMS])
        elif kind == "text":
            self.client.log_text(run_id, record["text"], record["path"])
        elif kind == "tag":
            self.client.set_tag(run_id, record["key"], record["value"])
        elif kind == "file":
            self.client.log_artifact(run_id, str(self.journal.root / record["file"]), record.get("dir"))
        elif kind == "rewind" and self.can_delete:
            removed = delete_steps_after(self.client, run_id, int(record["to"]))
            if removed:
                log.info("tracking: resumed at step %d: removed %d metric rows of re-run steps", record["to"], removed)

    def _guarded(self, record: dict[str, Any], send) -> None:
        """Runs ``send``; a rejection (bad key/value) is logged and counted, not retried."""
        try:
            send()
        except Exception as err:
            if not is_rejection(err):
                raise
            state = self.journal.snapshot()
            self.journal.update(rejected=state.rejected + 1)
            log.error("tracking: MLflow rejected a %s record (step %s): %s", record.get("t"), record.get("step"),
                      str(err)[:500])


def delete_steps_after(client, run_id: str, step: int) -> int:
    """Deletes the run's metric rows with a step above ``step`` from a SQL store, and recomputes
    the latest value of the keys involved; returns the number of rows removed.

    MLflow has no delete-metric API (REST or client); this uses the store's own SQLAlchemy
    session and tables (``metrics``, ``latest_metrics``) of mlflow 3.17."""
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric

    store = client._tracking_client.store
    with store.ManagedSessionMaker(read_only=False) as session:
        removed = session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.step > step) \
            .delete(synchronize_session=False)
        stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id,
                                                      SqlLatestMetric.step > step).all()
        for latest in stale:
            best = session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.key == latest.key) \
                .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc()).first()
            if best is None:
                session.delete(latest)
            else:
                latest.step, latest.timestamp, latest.value, latest.is_nan = \
                    best.step, best.timestamp, best.value, best.is_nan
    return int(removed)


_SET_HERE: dict[str, str] = {}


def configure_http(timeout_s: int) -> None:
    """Short HTTP timeouts and no urllib3 retries for MLflow requests in this process (the worker
    retries with its own backoff; MLflow's defaults retry 7 times over ~4 minutes). MLflow reads
    these variables at each request. A value the user exported wins."""
    wanted = {"MLFLOW_HTTP_REQUEST_TIMEOUT": str(int(timeout_s)), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
              "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    for key, value in wanted.items():
        if key not in os.environ or os.environ[key] == _SET_HERE.get(key):
            os.environ[key] = _SET_HERE[key] = value
