"""``Tracker``: what the driver calls (rank 0). Every call appends to the journal and returns;
the worker thread publishes (see the package docstring for the guarantees)."""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_gtpo.tracking.journal import TERMINAL, Journal, JournalState, backlog
from megatron_gtpo.tracking.publisher import configure_http
from megatron_gtpo.tracking.sinks import side_workers
from megatron_gtpo.tracking.uri import redact_uri, resolve_experiment, resolve_uri
from megatron_gtpo.tracking.worker import Worker
from megatron_gtpo.utils.configuration import ConfigError, flatten

log = logging.getLogger("megatron_gtpo")

LOCK_WAIT_S = 60.0
"""How long a new run waits for the previous writer of its journal to release it."""

@dataclass(frozen=True, kw_only=True)
class FlushReport:
    """Where the run's records stand once ``finish`` stopped waiting."""

    unsent: int
    """Records not in MLflow yet (0: everything was sent)."""
    held: int
    """Of those, records of steps after the last checkpoint, kept for a --resume (stores without
    delete, run not FINISHED): they are re-run, so they are never sent."""
    status_sent: bool
    """The final status reached MLflow."""
    journal: Path
    """The journal that keeps the unsent records."""
    others: dict[str, int] = field(default_factory=dict)
    """Records not in each other backend (wandb, tensorboard) yet; sent at the next --resume."""


class Tracker:
    """One MLflow run per run directory, continued by ``--resume``. Disabled (``enabled=False``
    or not rank 0): every method is a no-op. See the package docstring for what the driver calls."""

    def __init__(self, cfg, *, run_dir: str | os.PathLike, run_id: str | None = None,
                 resume_step: int | None = None):
        """``cfg``: TrackingConfig. ``run_id``: from the checkpoint (None: the journal's).
        ``resume_step``: step of the checkpoint the run resumed from (0 when --resume found
        none), None for a fresh run: a fresh run moves an existing journal aside."""
        self.enabled = cfg.enabled
        self.run_dir = Path(run_dir)
        self.uri = resolve_uri(cfg.uri, self.run_dir)
        self._cfg = cfg
        self._finished = False
        if not self.enabled:
            return
        if "mlflow" in cfg.backends:
            configure_http(cfg.request_timeout_s)
        self.journal = Journal(self.run_dir / "tracking")
        self._locked = self._acquire()
        self._open_state(run_id, fresh=resume_step is None)
        self.journal.open_for_append()
        if resume_step is not None:
            self._rewind(resume_step)
        self.workers: dict[str, Worker] = {}
        """One publishing thread per backend of ``tracking.backends``."""
        if "mlflow" in cfg.backends:
            self.workers["mlflow"] = Worker(self.journal, uri=self.uri)
        self.workers.update(side_workers(cfg, self.journal, self.run_dir, self.journal.snapshot().experiment))
        self.worker: Worker | None = self.workers.get("mlflow")
        """MLflow's worker (None when 'mlflow' is not in tracking.backends)."""
        atexit.register(self._at_exit)
        if self.worker is not None:
            self.worker.wait_for_run(2.0 * cfg.request_timeout_s)

    @property
    def run_id(self) -> str | None:
        """The MLflow run id; None while the store has not answered yet (it is created later)."""
        return self.journal.snapshot().run_id if self.enabled else None

    # ------------------------------------------------------------------ logging (training thread)

    def log_params(self, params: dict[str, Any]) -> None:
        """Logs a nested dict as flat ``a.b.c`` params (values cut at MLflow's 6000 chars), once
        per run: a resumed run does not log them again (MLflow params are immutable)."""
        if not self.enabled or self.journal.snapshot().params_logged:
            return
        self.journal.append({"t": "params", "params": {k: str(v)[:6000] for k, v in flatten(params).items()}})
        self.journal.update(params_logged=True)
        self._notify()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Logs ``metrics`` at ``step`` (timestamped now); a step logged again after a resume
        replaces the earlier values (see the package docstring)."""
        if not self.enabled or not metrics:
            return
        self.journal.append({"t": "metrics", "step": int(step), "ts": int(time.time() * 1000),
                             "m": {k: float(v) for k, v in metrics.items()}})
        self._notify()

    def set_tag(self, key: str, value: str) -> None:
        """Sets the run's tag ``key`` (MLflow's 5000-character limit applies to ``value``)."""
        if self.enabled:
            self.journal.append({"t": "tag", "key": key, "value": str(value)[:5000]})
            self._notify()

    def log_artifact(self, path: str | os.PathLike, subdir: str | None = None) -> None:
        """Logs a file (copied into the journal now: it may change before it is sent)."""
        if self.enabled:
            self.journal.append({"t": "file", "file": self.journal.keep_file(path), "dir": subdir})
            self._notify()

    def log_json(self, data: Any, name: str, step: int | None = None) -> None:
        """Stores ``data`` as a JSON artifact called ``name``; with ``step`` it is published with
        that step's metrics."""
        if self.enabled:
            record = {"t": "text", "path": name, "text": json.dumps(data, indent=1, default=str)}
            self.journal.append(record if step is None else {**record, "step": int(step)})
            self._notify()

    # ------------------------------------------------------------------ lifecycle

    def commit(self, step: int) -> None:
        """Call after the checkpoint of ``step`` is committed: records up to ``step`` are final
        (stores that cannot delete publish them now). Syncs the journal to disk; never waits on MLflow."""
        if not self.enabled:
            return
        self.journal.fsync()
        self.journal.update(committed_step=max(self.journal.snapshot().committed_step, int(step)))
        self._notify()

    def finish(self, status: str = "FINISHED", reason: str | None = None,
               timeout_s: float | None = None) -> FlushReport | None:
        """Ends the run as FINISHED / FAILED / KILLED: waits up to ``timeout_s`` (default
        ``tracking.flush_timeout_s``) for MLflow, then logs what is still unsent and where it is
        kept. FINISHED publishes every step; FAILED/KILLED keep steps after the last checkpoint
        for the resume. Idempotent."""
        if not self.enabled or self._finished:
            return None
        if status not in TERMINAL:
            raise ValueError(f"finish(status={status!r}): expected one of {TERMINAL}")
        self._finished = True
        atexit.unregister(self._at_exit)
        self.journal.fsync()
        self.journal.update(status=status, reason=reason, release_all=status == "FINISHED")
        deadline = time.monotonic() + (self._cfg.flush_timeout_s if timeout_s is None else timeout_s)
        for worker in self.workers.values():  # they publish at once: the waits overlap
            worker.flush(max(deadline - time.monotonic(), 0.0))
        for worker in self.workers.values():
            worker.stop()
        report = self.backlog()
        self.journal.close()
        if report.unsent or not report.status_sent:
            log.warning("tracking: %d record(s) not in MLflow at %s%s%s; kept in %s: sent at the next --resume or "
                        "by `python -m megatron_gtpo.tracking replay %s`", report.unsent, self.uri,
                        f" ({report.held} wait for a --resume)" if report.held else "",
                        "" if report.status_sent else f", run status {status} not set yet",
                        report.journal, self.run_dir)
        for name, unsent in report.others.items():
            if unsent:
                log.warning("tracking: %d record(s) not in %s; kept in %s: sent at the next --resume", unsent,
                            self.workers[name].label, report.journal)
        return report

    def backlog(self) -> FlushReport:
        """What is not in MLflow (all zero without it) and in each other backend now."""
        state = self.journal.snapshot()
        unsent = waiting = 0
        if self.worker is not None:
            unsent, waiting = backlog(self.journal, state, can_delete=self.worker.can_delete)
        others = {name: backlog(self.journal, state, can_delete=w.can_delete,
                                offset=state.sinks.get(name, {}).get("offset", 0))[0]
                  for name, w in self.workers.items() if name != "mlflow"}
        return FlushReport(unsent=unsent, held=waiting, journal=self.journal.path, others=others,
                           status_sent=self.worker is None or state.published_status == state.status)

    def _notify(self) -> None:
        for worker in self.workers.values():
            worker.notify()

    def _at_exit(self) -> None:
        """The process exits without finish() (an uncaught exception): the run becomes FAILED."""
        self.finish("FAILED", reason="the training process exited without finishing the run "
                                     "(uncaught exception or exit)")

    # ------------------------------------------------------------------ opening

    def _open_state(self, run_id: str | None, *, fresh: bool) -> None:
        old = self.journal.load_state()
        if old is not None and (fresh or (run_id is not None and run_id != old.run_id)):
            self._archive(old, "a fresh run started" if fresh else f"the checkpoint belongs to MLflow run {run_id}")
            old = None
        if old is not None and old.status == "RUNNING" and self._locked:
            log.warning("tracking: MLflow run %s was left RUNNING by pid %s on %s (started %s), which is gone: "
                        "killed (SIGKILL, OOM, node loss) before it could finish the run; resuming it",
                        old.run_id, old.owner.get("pid"), old.owner.get("host"), old.owner.get("started"))
        if old is None:
            local = not self.uri.startswith(("http://", "https://", "databricks"))
            old = JournalState(uri=self.uri, experiment=resolve_experiment(self._cfg.experiment),
                               run_name=self._cfg.run_name or self.run_dir.resolve().name, run_id=run_id,
                               artifact_location=(self.run_dir / "mlartifacts").resolve().as_uri() if local else None,
                               journal_id=uuid.uuid4().hex)
        elif old.uri != self.uri:
            log.warning("tracking: the journal's records went to %s, they now go to %s", redact_uri(old.uri), redact_uri(self.uri))
            old.uri = self.uri
        old.status, old.reason, old.owner = "RUNNING", None, Journal.owner_record()
        self.journal.set_state(old)

    def _archive(self, old: JournalState, why: str) -> None:
        if old.status == "RUNNING":
            self.journal.update(status="FAILED", reason=f"left RUNNING by pid {old.owner.get('pid')}; {why}")
        moved = self.journal.archive()
        unsent, _ = backlog(Journal(moved), old, can_delete=None)
        log.warning("tracking: %s; the previous tracking journal moved to %s%s", why, moved,
                    f" ({unsent} record(s) unsent: `python -m megatron_gtpo.tracking replay {moved}`)"
                    if unsent else "")
        self.journal = Journal(self.run_dir / "tracking")
        self._locked = self._acquire()

    def _acquire(self) -> bool:
        """Waits up to LOCK_WAIT_S for a previous writer to go; then goes on without the lock
        (tracking never stops a training): two writers can interleave records, so say so loudly."""
        try:
            self.journal.acquire(wait_s=LOCK_WAIT_S)
            return True
        except ConfigError as err:
            log.error("tracking: %s. Going on WITHOUT the journal lock: if both processes train, their "
                      "records mix in one MLflow run", err)
            return False

    def _rewind(self, step: int) -> None:
        """The run resumed from the checkpoint of ``step``: later steps will be logged again."""
        state = self.journal.snapshot()
        if step < state.committed_step:
            log.warning("tracking: resuming at step %d below the committed step %d: on stores that cannot delete "
                        "(HTTP servers), steps %d-%d may appear twice", step, state.committed_step, step + 1,
                        state.committed_step)
        seq = self.journal.append({"t": "rewind", "to": int(step)})
        self.journal.update(rewinds=state.rewinds + [[seq, int(step)]], committed_step=int(step), release_all=False)
