"""W&B and TensorBoard beside MLflow: each reads the same journal from its own offset
(``state.json`` ``sinks``) in its own worker thread, so the exactly-once rule is the journal's
(``next_batch``), written once for every backend, and one backend's outage delays only itself.

What each backend gets
    metrics (every key at its step, timestamped as logged), params (W&B config; TensorBoard text
    ``config``), tags (W&B summary ``tags/<key>``; TensorBoard text ``tags/<key>``) and the run's end
    (W&B exit code). Files and JSON tables (config.yaml, sample completions, eval reports) stay
    MLflow's and the run directory's.

Exactly once per (key, step)
    * TensorBoard can drop re-run steps itself: after a resume from step R the writer reopens with
      ``purge_step=R+1``, and TensorBoard's readers discard the earlier events of steps > R. So it
      gets every step at once, as MLflow's SQL stores do.
    * W&B cannot (its history only grows): a step reaches it once a checkpoint covers it, or at
      ``finish("FINISHED")``, as with an MLflow HTTP server. The offline run directory
      (``<run dir>/wandb/offline-run-*``, one per process start, all of one W&B run id) is uploaded
      later by ``wandb sync <run dir>/wandb/offline-run-*``.
    * A batch whose offset was not saved before a kill is written again (at most one batch of
      READ_RECORDS): the same caveat as a lost MLflow reply.

Secrets: WANDB_API_KEY is read by wandb itself (online mode) from the environment; it is never a
config field, and nothing here logs or writes it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from megatron_gtpo.tracking.journal import TERMINAL, Journal, JournalState, next_batch, superseded
from megatron_gtpo.tracking.worker import BackendUnavailable, Worker

log = logging.getLogger("megatron_gtpo")

READ_RECORDS = 200  # journal records read per round, as MLflow's publisher
PINS = {"wandb": "wandb==0.31.0", "tensorboard": "tensorboard==2.21.0"}
"""What to install when a backend's package is missing (the versions of requirements/cpu.lock)."""


class SinkPublisher:
    """Publishes one journal to one non-MLflow backend (``sink``) in order, from its own offset.

    State per backend (``state.sinks[name]``): ``offset``; ``status``; ``step_start`` = [step,
    offset] where the records of the highest step written so far begin (a backend that can delete
    uses it to redo a whole step after a failed batch, see ``_recover``)."""

    def __init__(self, journal: Journal, sink):
        self.journal, self.sink = journal, sink
        self.can_delete = sink.can_delete
        self._failed: list[dict[str, Any]] | None = None  # the batch whose write raised, if any

    def pump(self, stop=lambda: False) -> None:
        """As ``Publisher.pump``: every ready record, then the run's end once it is wanted. The sink
        opens at its first record (a W&B run ended by ``finish`` is not started again for nothing)."""
        if self._failed is not None:
            self._recover(self._failed)
        while not stop():
            state = self.journal.snapshot()
            mine = state.sinks.get(self.sink.name, {})
            offset, start = mine.get("offset", 0), mine.get("step_start")
            batch, end = next_batch(self.journal, state, offset, can_delete=self.can_delete, max_records=READ_RECORDS)
            if not batch:
                break
            self.sink.open(state)
            self._failed = [record for record, _ in batch]
            for record, after in batch:
                if superseded(record, state.rewinds):
                    pass
                elif record.get("t") == "rewind":
                    start = None
                elif record.get("step") is not None and (start is None or record["step"] > start[0]):
                    start = [record["step"], offset]
                offset = after
                if not superseded(record, state.rewinds):
                    self.sink.write(record)
            self.sink.flush()  # on disk before the offset moves past these records
            self._failed = None
            self.journal.update_sink(self.sink.name, offset=end, step_start=start)
        else:
            return
        state = self.journal.snapshot()
        if state.status in TERMINAL and state.sinks.get(self.sink.name, {}).get("status") != state.status:
            self.sink.open(state)
            self.sink.finish(state.status)
            self.journal.update_sink(self.sink.name, status=state.status)

    def _recover(self, failed: list[dict[str, Any]]) -> None:
        """A batch raised part-way: some of its records may be written. A backend that can delete
        reopens with its events of the batch's first step and later dropped, and redoes that whole
        step (from ``step_start`` when earlier batches wrote part of it): nothing twice, nothing
        lost. W&B needs none of it: it ignores rows of steps below its current one, and a row of the
        current step written again gets the same values."""
        if not self.can_delete:
            self._failed = None
            return
        state = self.journal.snapshot()
        steps = [r["step"] for r in failed if r.get("step") is not None and not superseded(r, state.rewinds)]
        mine = state.sinks.get(self.sink.name, {})
        start = mine.get("step_start")
        if not steps:
            self.sink.reopen(None)
        elif start is not None and start[0] >= steps[0]:
            self.sink.reopen(start[0])
            self.journal.update_sink(self.sink.name, offset=start[1], step_start=None)
        else:
            self.sink.reopen(steps[0])
        self._failed = None  # only now: a reopen that raised is tried again at the next pump


class TensorBoardSink:
    """Event files in ``<root>/<journal id[:8]>``, ``root`` = ``<run dir>/tensorboard``
    (``tensorboard --logdir <run dir>/tensorboard``): a fresh run in the same directory starts a new
    journal, hence a new TensorBoard run beside the old one instead of mixing with it."""

    name = "tensorboard"
    can_delete = True  # purge_step: TensorBoard's own way of dropping re-run steps

    def __init__(self, root: Path):
        try:
            import tensorboard  # noqa: F401 - torch's writer needs it
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BackendUnavailable(f"TensorBoard is off for this run: the tensorboard package is not installed "
                                     f"(`pip install {PINS['tensorboard']}`, or `make setup`); the other "
                                     "backends go on") from None
        self._cls, self.root, self.log_dir, self._writer = SummaryWriter, root, None, None

    def open(self, state: JournalState) -> None:
        if self._writer is None:
            self.log_dir = self.root / state.journal_id[:8]
            self._writer = self._cls(str(self.log_dir))

    def write(self, record: dict[str, Any]) -> None:
        kind, step = record.get("t"), record.get("step", 0)
        if kind == "metrics":
            for key, value in record["m"].items():
                self._writer.add_scalar(key, value, step, walltime=record["ts"] / 1000)
        elif kind == "params":
            self._writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(record["params"].items())))
        elif kind == "tag":
            self._writer.add_text(f"tags/{record['key']}", record["value"])
        elif kind == "rewind":  # steps after record["to"] are re-run: TensorBoard drops their old events
            self.reopen(int(record["to"]) + 1)

    def reopen(self, purge_step: int | None) -> None:
        """A new event file; with ``purge_step``, TensorBoard's readers drop the earlier events of
        that step and later ones (its own restart rule)."""
        try:
            self._writer.close()
        except Exception as err:  # noqa: BLE001 - a writer that failed may fail to close too
            log.debug("tracking: closing the failed TensorBoard writer: %s", err)
        self._writer = self._cls(str(self.log_dir), purge_step=purge_step)

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, status: str) -> None:
        self._writer.flush()


class WandbSink:
    """A W&B run (offline by default: files under ``<run dir>/wandb``), id = the journal's id."""

    name = "wandb"
    can_delete = False  # W&B history only grows: steps wait for a checkpoint

    def __init__(self, run_dir: Path, *, project: str, mode: str):
        try:
            import wandb
        except ImportError:
            raise BackendUnavailable(f"W&B is off for this run: the wandb package is not installed "
                                     f"(`pip install {PINS['wandb']}`, or `make setup`); the other backends "
                                     "go on") from None
        self._wandb, self.run_dir, self.project, self.mode, self._run = wandb, run_dir, project, mode, None

    def open(self, state: JournalState) -> None:
        if self._run is not None:
            return
        wandb = self._wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                  silent=True, init_timeout=30)
        self._run = wandb.init(project=self.project, name=state.run_name, id=state.journal_id, resume="allow",
                               dir=str(self.run_dir), mode=self.mode, settings=settings, reinit="create_new")
        log.info("tracking: W&B run %s (%s) in %s", state.journal_id, self.mode, self.run_dir / "wandb")

    def write(self, record: dict[str, Any]) -> None:
        kind = record.get("t")
        if kind == "metrics":
            self._run.log(record["m"], step=int(record["step"]))
        elif kind == "params":
            self._run.config.update(record["params"], allow_val_change=True)
        elif kind == "tag":
            self._run.summary[f"tags/{record['key']}"] = record["value"]

    def flush(self) -> None:
        """Nothing to do: ``log`` hands each row to wandb's own service process, which writes it."""

    def finish(self, status: str) -> None:
        self._run.finish(exit_code=0 if status == "FINISHED" else 1)
        self._run = None  # a later status (a resumed run's end) opens it again


def side_workers(cfg, journal: Journal, run_dir: Path, experiment: str) -> dict[str, Worker]:
    """One worker per backend of ``cfg.backends`` other than MLflow (``cfg``: TrackingConfig)."""
    workers = {}
    if "tensorboard" in cfg.backends:
        tb_dir = run_dir / "tensorboard"
        workers["tensorboard"] = Worker(
            journal, name="tensorboard", label=f"TensorBoard at {tb_dir}",
            fix=f"make {tb_dir} writable (free disk space), or drop tensorboard from tracking.backends",
            make=lambda: SinkPublisher(journal, TensorBoardSink(tb_dir)))
    if "wandb" in cfg.backends:
        mode = cfg.wandb_mode or (os.environ.get("WANDB_MODE") if os.environ.get("WANDB_MODE") in ("online", "offline")
                                  else "offline")
        project = cfg.wandb_project or os.environ.get("WANDB_PROJECT") or experiment
        workers["wandb"] = Worker(
            journal, name="wandb", label=f"W&B ({mode}, project {project})",
            fix=f"make {run_dir / 'wandb'} writable; online mode needs network and WANDB_API_KEY exported "
                "(tracking.wandb_mode=offline writes locally: `wandb sync` it later)",
            make=lambda: SinkPublisher(journal, WandbSink(run_dir, project=project, mode=mode)))
    return workers
