"""MLflow tracking: one run per training, params = the resolved config, metrics per step, artifacts.

Only rank 0 talks to MLflow; on every other rank :class:`Tracker` is a no-op. The default store is
a SQLite file inside the run directory (works with no server); a server or any other tracking URI
comes from ``tracking.uri`` or ``MLFLOW_TRACKING_URI``. Artifacts of the SQLite store go to
``<run dir>/mlartifacts`` (never to ``./mlruns`` under the current directory).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_gtpo.utils.configuration import flatten, require


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
