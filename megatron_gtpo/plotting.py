"""Render MLflow runs to PNG: reward, accuracy, entropy, conflict share and step-time curves.

Several runs (e.g. GRPO vs GTPO) share one figure, one line per run. A run is given as a run
directory (its ``mlflow.db`` and ``run_id`` file are read) or as ``RUN_ID`` with ``--tracking-uri``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PANELS = [
    ("reward/mean", "mean reward"),
    ("reward/accuracy", "accuracy"),
    ("entropy/mean", "mean token entropy (nats)"),
    ("gtpo/conflict_tokens_per_completion", "conflict tokens / completion"),
    ("gtpo/lambda_zero_share", "share of tokens with lambda = 0"),
    ("time/step_s", "step time (s)"),
]


def _resolve(run: str, tracking_uri: str | None) -> tuple[str, str, str]:
    """Returns (tracking uri, run id, label) for a run directory or a run id."""
    path = Path(run)
    if path.is_dir():
        run_id_file = path / "run_id"
        if not run_id_file.is_file():
            raise SystemExit(f"{path} has no run_id file: is it a megatron-gtpo output directory?")
        uri = tracking_uri or f"sqlite:///{(path / 'mlflow.db').resolve()}"
        return uri, run_id_file.read_text().strip(), path.name
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise SystemExit(f"{run} is not a directory; pass --tracking-uri to look up a run id")
    return uri, run, run[:8]


def fetch_history(uri: str, run_id: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """Metric histories ``{key: [(step, value), ...]}`` sorted by step (missing keys are omitted)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for key in keys:
        hist = client.get_metric_history(run_id, key)
        if hist:
            out[key] = sorted((m.step, m.value) for m in hist)
    return out


def plot_runs(runs: list[str], output: str | os.PathLike, tracking_uri: str | None = None) -> Path:
    """Draws every panel for every run into one PNG and returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    drawn = 0
    for run in runs:
        uri, run_id, label = _resolve(run, tracking_uri)
        history = fetch_history(uri, run_id, [k for k, _ in PANELS])
        for ax, (key, title) in zip(axes.flat, PANELS):
            if key in history:
                steps, values = zip(*history[key])
                ax.plot(steps, values, marker="o", markersize=3, label=label)
                drawn += 1
            ax.set_title(title)
            ax.set_xlabel("step")
    if drawn == 0:
        raise SystemExit(f"none of the metrics {[k for k, _ in PANELS]} were found in {runs}")
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=90)
    os.replace(tmp, output)
    plt.close(fig)
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plot_run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories (with mlflow.db and run_id) or MLflow run ids")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG file to write (default: curves.png)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI for run ids (default: $MLFLOW_TRACKING_URI)")
    args = parser.parse_args(argv)
    print(plot_runs(args.runs, args.output, args.tracking_uri))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
