"""MLflow tracking: one run per training, params = the resolved config, metrics per step, artifacts.

Only rank 0 talks to MLflow; on every other rank :class:`Tracker` is a no-op. The default store is
a SQLite file inside the run directory (works with no server); a server or any other tracking URI
comes from ``tracking.uri`` or ``MLFLOW_TRACKING_URI``. Artifacts of the SQLite store go to
``<run dir>/mlartifacts`` (never to ``./mlruns`` under the current directory).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gtpo.parallel.objects import broadcast_object
from megatron_gtpo.utils.atomic import write_text_atomic
from megatron_gtpo.utils.configuration import flatten, require, write_yaml_atomic

log = logging.getLogger("megatron_gtpo")


@dataclass(kw_only=True)
class TrackingConfig:
    """Where and how the run is tracked."""

    enabled: bool = True
    """Log to MLflow at all (rank 0 only)."""
    uri: str | None = None
    """Tracking URI; None = $MLFLOW_TRACKING_URI if set, else sqlite:///<output_dir>/mlflow.db."""
    experiment: str = "megatron-gtpo"
    """MLflow experiment name (created when missing)."""
    run_name: str | None = None
    """MLflow run name; None = the output directory's name."""
    samples_every: int = 10
    """Log a table of sample completions with rewards every N steps (0 = never)."""
    num_samples: int = 8
    """Completions per sample table."""

    def __post_init__(self):
        require(self.samples_every >= 0, "samples_every", self.samples_every, ">= 0")
        require(self.num_samples >= 1, "num_samples", self.num_samples, ">= 1")


def resolve_uri(uri: str | None, output_dir: str | os.PathLike) -> str:
    """Config URI, else $MLFLOW_TRACKING_URI, else a SQLite file in the run directory."""
    if uri:
        return uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    return f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"


class Tracker:
    """Thin MLflow wrapper. ``run_id`` is stored in checkpoints so a resumed run continues it."""

    def __init__(self, *, enabled: bool, uri: str, experiment: str, run_name: str,
                 artifact_dir: str | os.PathLike, run_id: str | None = None):
        self.enabled = enabled
        self.run_id = run_id
        self._client = None
        if not enabled:
            return
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        exp = self._client.get_experiment_by_name(experiment)
        if exp is None:
            location = None if uri.startswith(("http://", "https://", "databricks")) else \
                Path(artifact_dir).resolve().as_uri()
            exp_id = self._client.create_experiment(experiment, artifact_location=location)
        else:
            exp_id = exp.experiment_id
        if run_id is None:
            self.run_id = self._client.create_run(exp_id, run_name=run_name).info.run_id
        else:
            self._client.update_run(run_id, status="RUNNING")

    def log_params(self, params: dict[str, Any]) -> None:
        """Logs a nested dict as flat ``a.b.c`` params (MLflow caps values at 6000 chars)."""
        if not self.enabled:
            return
        from mlflow.entities import Param

        flat = [Param(k, str(v)[:6000]) for k, v in flatten(params).items()]
        for start in range(0, len(flat), 100):
            self._client.log_batch(self.run_id, params=flat[start:start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.enabled or not metrics:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(items), 500):
            self._client.log_batch(self.run_id, metrics=items[start:start + 500])

    def log_artifact(self, path: str | os.PathLike, subdir: str | None = None) -> None:
        if self.enabled:
            self._client.log_artifact(self.run_id, str(path), subdir)

    def log_json(self, data: Any, name: str) -> None:
        """Stores ``data`` as a JSON artifact called ``name``."""
        if self.enabled:
            self._client.log_text(self.run_id, json.dumps(data, indent=1, default=str), name)

    def finish(self, status: str = "FINISHED") -> None:
        """Marks the run FINISHED (or KILLED/FAILED); a resumed run flips it back to RUNNING."""
        if self.enabled:
            self._client.set_terminated(self.run_id, status=status)


class Reporter:
    """Rank 0's view of a run: MLflow metrics and artifacts, one log line per step, sample tables.

    Every rank builds one (the MLflow run id is shared with all ranks, for checkpoints); only rank 0
    writes anything. Metric names are those of ``megatron_gtpo.metrics``.
    """

    def __init__(self, config: TrackingConfig, *, run_dir: Path, rank: int, total_steps: int,
                 run_id: str | None = None):
        self.config, self.run_dir, self.rank, self.total_steps = config, Path(run_dir), rank, total_steps
        self.tracker: Tracker | None = None
        if rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.tracker = Tracker(enabled=config.enabled, uri=resolve_uri(config.uri, self.run_dir),
                                   experiment=config.experiment,
                                   run_name=config.run_name or self.run_dir.resolve().name,
                                   artifact_dir=self.run_dir / "mlartifacts", run_id=run_id)
            if self.tracker.run_id:
                write_text_atomic(self.run_dir / "run_id", self.tracker.run_id)
        self.new_run = run_id is None
        self.run_id: str | None = broadcast_object(self.tracker.run_id if self.tracker else None)
        """The MLflow run id on every rank (None when tracking is off)."""

    def start(self, config: dict) -> None:
        """Writes the resolved config to ``<run dir>/config.yaml`` and, once per MLflow run (not on
        resume), logs it as params and as an artifact."""
        if self.tracker is None:
            return
        path = write_yaml_atomic(config, self.run_dir / "config.yaml")
        if self.new_run and self.config.enabled:
            self.tracker.log_params(config)
            self.tracker.log_artifact(path)

    def step(self, step: int, metrics: dict[str, float], rollout) -> None:
        """Logs one step: MLflow metrics, a one-line summary, every N steps sample completions, and
        the step's new reward-function failures (``rollout``: the step's RolloutBatch)."""
        if self.tracker is None:
            return
        self.reward_errors(step, rollout.reward_errors)
        self.tracker.log_metrics(metrics, step)
        get = lambda k: metrics.get(k, float("nan"))  # noqa: E731
        log.info("step %d/%d | reward %.3f acc %.2f | len %.1f | H %.3f | conflicts %.2f | gnorm %.3f | "
                 "rollout %.1fs reward %.1fs train %.1fs sync %.1fs = %.1fs", step, self.total_steps,
                 get("reward/mean"), get("reward/accuracy"), get("completion/length_mean"), get("entropy/mean"),
                 get("gtpo/conflict_tokens_per_completion"), get("optim/grad_norm"), get("time/rollout_s"),
                 get("time/reward_s"), get("time/train_s"), get("time/sync_s"), get("time/step_s"))
        every = self.config.samples_every
        if every and (step % every == 0 or step == 1):
            self.tracker.log_json(sample_table(rollout.groups, limit=self.config.num_samples),
                                  f"samples/step_{step:06d}.json")

    def skipped(self, step: int, metrics: dict[str, float], rollout) -> None:
        """A step whose dynamic sampling kept no group: no update, the counters are still logged."""
        if self.tracker is None:
            return
        self.reward_errors(step, rollout.reward_errors)
        self.tracker.log_metrics({**metrics, "rollout/skipped_step": 1.0}, step)
        log.warning("step %d: dynamic sampling kept no group in %d tries (all-equal groups); no update this step",
                    step, int(metrics["rollout/tries"]))

    def dataset(self, stats, *, step: int) -> None:
        """The prompt set once per run: a log line and ``data/*`` metrics (prompts kept and dropped)."""
        if self.tracker is None:
            return
        log.info(stats.summary())
        self.tracker.log_metrics(stats.metrics(), step)

    def reward_errors(self, step: int, errors: list) -> None:
        """Appends new distinct reward-function failures (with tracebacks) to
        ``<run dir>/reward_errors.json`` and stores it as an MLflow artifact."""
        if self.tracker is None or not errors:
            return
        path = self.run_dir / "reward_errors.json"
        known = json.loads(path.read_text()) if path.is_file() else []
        known += [{"step": step, **dataclasses.asdict(e)} for e in errors]
        write_text_atomic(path, json.dumps(known, indent=1, default=str))
        self.tracker.log_artifact(path)

    def evaluation(self, step: int, metrics: dict[str, float], *, num_prompts: int) -> None:
        """Logs a periodic held-out evaluation (metrics and a JSON artifact)."""
        if self.tracker is None:
            return
        self.tracker.log_metrics(metrics, step)
        self.tracker.log_json({"step": step, **metrics, "prompts": num_prompts}, f"eval/step_{step:06d}.json")
        log.info("eval at step %d: accuracy %.3f on %d held-out prompts", step, metrics["eval/accuracy"], num_prompts)

    def finish(self, status: str) -> None:
        """Marks the MLflow run FINISHED / KILLED / FAILED."""
        if self.tracker is not None:
            self.tracker.finish(status)


def step_metrics(*parts: dict[str, float], times: dict[str, float], completion_tokens: float) -> dict[str, float]:
    """One flat dict of a step: the stages' metrics, ``time/<stage>_s`` and throughput."""
    out: dict[str, float] = {}
    for part in parts:
        out.update(part)
    out.update({f"time/{k}_s": v for k, v in times.items()})
    out["throughput/completion_tokens"] = completion_tokens
    out["throughput/tokens_per_s"] = completion_tokens / max(times["step"], 1e-9)
    return out


def sample_table(groups, *, limit: int) -> list[dict]:
    """Rows of prompt / completion / reward / correct for the sample-completions artifact."""
    rows = []
    for g in groups:
        for c, r, ok in zip(g.completions, g.rewards, g.correct or [None] * len(g.rewards)):
            rows.append({"prompt": g.prompt.text[-500:], "completion": c.text, "reward": r, "correct": ok,
                         "tokens": len(c.token_ids), "finish_reason": c.finish_reason})
            if len(rows) >= limit:
                return rows
    return rows
