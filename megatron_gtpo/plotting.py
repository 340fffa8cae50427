"""Render MLflow runs to PNG: reward, accuracy, entropy, conflict share, step time, the hidden-
objective-bias diagnostics D1/D2/D4 and the train-inference mismatch (README "Reading the bias
diagnostics"); ``plot_probe`` draws the reward-scale probe's report (D3).

Several runs (e.g. GRPO vs GTPO) share one figure, one line per run. A run is given as a run
directory (its ``mlflow.db`` and ``run_id`` file are read) or as ``RUN_ID`` with ``--tracking-uri``;
``LABEL=RUN,RUN,...`` draws several runs (the seeds of one algorithm) as one line: their mean per
step with a min-max band. ``--panels study`` selects the learning study's panels (bench/learning.py).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PANELS = [
    (("reward/mean",), "mean reward"),
    (("reward/accuracy",), "accuracy"),
    (("entropy/mean",), "mean token entropy (nats)"),
    (("gtpo/conflict_tokens_per_completion",), "conflict tokens / completion"),
    (("gtpo/lambda_zero_share",), "share of tokens with lambda = 0"),
    (("time/step_s",), "step time (s)"),
    (("bias/prefix_wagg_common", "bias/prefix_wagg_abs_mean"), "D1: W_agg on shared prefixes"),
    (("loss", "bias/surrogate_adv_term", "bias/surrogate_loss_gap"), "D2: loss = -sum A Omega + ... (gap ~ 0)"),
    (("mismatch/logprob_abs_mean", "mismatch/kl_k3", "mismatch/is_cut_frac"), "train-inference mismatch"),
    (("clip/high_frac", "clip/low_frac", "bias/clip_overshoot_rate"), "D4: clipped share, overshoot (mu > 1)"),
    (("bias/adam_step_ratio", "bias/adam_step_ratio_momentum"), "D4: Adam step ratio vs momentum-only"),
]
"""(metric names, title) per panel; a run lacking every name of a panel leaves it empty."""


STUDY_PANELS = [
    (("reward/accuracy",), "training accuracy (share of samples correct)"),
    (("eval/accuracy",), "held-out greedy accuracy"),
    (("reward/mean",), "mean reward (DAPO: its +1/-1 rule)"),
    (("entropy/mean",), "mean token entropy (nats)"),
    (("gtpo/filtered_frac",), "GTPO: share filtered (entropy above threshold)"),
    (("gtpo/lambda_zero_share", "gtpo/lambda_ge2_share"), "conflict-token shares: lambda = 0 / lambda >= 2"),
    (("bias/prefix_wagg_common", "bias/prefix_wagg_abs_mean"), "D1: W_agg, common prefix / mean |W_agg| mixed nodes"),
    (("bias/surrogate_adv_term", "bias/surrogate_loss_gap"), "D2: sum A Omega; loss gap (~0)"),
    (("completion/length_mean",), "completion tokens (mean)"),
    (("batch/active_frac",), "share of completions with A != 0"),
    (("optim/grad_norm",), "grad norm (before clipping)"),
    (("time/step_s",), "step time (s)"),
]
"""The panels of a study (``bench/learning.py``, ``--panels study``): one line per algorithm."""

PANEL_SETS = {"run": PANELS, "study": STUDY_PANELS}


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


def _groups(runs: list[str], tracking_uri: str | None, names: list[str]) -> list[tuple[str, list[dict]]]:
    """``(label, [history of each run])`` per argument: a run, or ``LABEL=RUN,RUN,...`` (one line
    for several runs, e.g. the seeds of one algorithm: their mean, with a min-max band)."""
    out = []
    for spec in runs:
        label, _, members = spec.partition("=") if "=" in spec else ("", "", spec)
        histories = []
        for member in members.split(","):
            uri, run_id, name = _resolve(member, tracking_uri)
            histories.append(fetch_history(uri, run_id, names))
            label = label or name
        out.append((label, histories))
    return out


def _smoothed(steps: list[int], values: list[float], window: int) -> list[float]:
    """Trailing moving average over the last ``window`` steps (1: unchanged). Over steps, not
    points: a metric logged every 20 steps (the held-out accuracy) is not averaged with the
    evaluation 20 steps before it by a 5-step window."""
    return [sum(v for s, v in zip(steps, values) if step - window < s <= step)
            / sum(1 for s in steps if step - window < s <= step) for step in steps]


def _draw(ax, histories: list[dict], key: str, name: str, smooth: int) -> bool:
    """One line (mean over the runs that logged ``key`` at a step) and its min-max band; False when
    no run has ``key``."""
    by_step: dict[int, list[float]] = {}
    for history in histories:
        for step, value in history.get(key, []):
            by_step.setdefault(step, []).append(value)
    if not by_step:
        return False
    steps = sorted(by_step)
    means = _smoothed(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], smooth)
    (line,) = ax.plot(steps, means, marker="o", markersize=3, label=name)
    if len(histories) > 1:
        low = _smoothed(steps, [min(by_step[s]) for s in steps], smooth)
        high = _smoothed(steps, [max(by_step[s]) for s in steps], smooth)
        ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.15)
    return True


def plot_runs(runs: list[str], output: str | os.PathLike, tracking_uri: str | None = None, *,
              panels: str = "run", smooth: int = 1) -> Path:
    """Draws every panel of ``PANEL_SETS[panels]`` for every run (or ``LABEL=RUN,RUN`` group) into
    one PNG and returns its path; ``smooth`` > 1 draws trailing moving averages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chosen = PANEL_SETS[panels]
    fig, axes = plt.subplots(3, 4, figsize=(20, 12))
    names = [key for keys, _ in chosen for key in keys]
    drawn = 0
    for label, histories in _groups(runs, tracking_uri, names):
        for ax, (keys, title) in zip(axes.flat, chosen):
            for key in keys:
                drawn += _draw(ax, histories, key, label if len(keys) == 1 else f"{label} {key}", smooth)
            ax.set_title(title + (f" ({smooth}-step mean)" if smooth > 1 else ""))
            ax.set_xlabel("step")
    for ax in axes.flat[len(chosen):]:
        ax.axis("off")
    if drawn == 0:
        raise SystemExit(f"none of the metrics {names} were found in {runs}")
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, output)


def plot_probe(report: dict, output: str | os.PathLike) -> Path:
    """The reward-scale probe's report (``megatron-gtpo probe reward-scale``) as one PNG: reward
    curves (divided by phi) and, per run, the cosine and norm ratio of its parameter change to the
    reference phi's, and the share of Adam second moments near eps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    labels = [f"{r['variant']} phi={r['phi']:g}" for r in runs]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for run, label in zip(runs, labels):
        axes[0].plot(range(1, len(run["reward_mean"]) + 1), run["reward_mean"], marker="o", markersize=3, label=label)
    axes[0].xaxis.get_major_locator().set_params(integer=True)
    axes[0].set_title("reward / phi")
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=7)
    for ax, key, title in ((axes[1], "cosine_vs_reference", f"cosine of dtheta to phi={report['reference_phi']:g}"),
                           (axes[2], "delta_norm_ratio", "||dtheta|| / reference ||dtheta||"),
                           (axes[3], "small_v_frac", "share with sqrt(v_hat) < 10 adam_eps")):
        ax.bar(range(len(runs)), [r[key] if r[key] is not None else float("nan") for r in runs])
        ax.set_xticks(range(len(runs)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, output)


def save_figure(fig, output) -> Path:
    """Writes ``fig`` to the PNG ``output`` atomically (temp file, rename) and closes it."""
    import matplotlib.pyplot as plt

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
    parser.add_argument("runs", nargs="+", help="run directories (with mlflow.db and run_id) or MLflow run ids; "
                        "LABEL=RUN,RUN,... draws several runs (e.g. seeds) as one line, their mean with a min-max band")
    parser.add_argument("-o", "--output", default="curves.png", help="PNG file to write (default: curves.png)")
    parser.add_argument("--tracking-uri", default=None,
                        help="MLflow tracking URI for run ids (default: $MLFLOW_TRACKING_URI)")
    parser.add_argument("--panels", choices=sorted(PANEL_SETS), default="run",
                        help="run: the training and diagnostics panels (default); study: the learning-study panels")
    parser.add_argument("--smooth", type=int, default=1, help="trailing moving average over N steps (default 1: none)")
    args = parser.parse_args(argv)
    print(plot_runs(args.runs, args.output, args.tracking_uri, panels=args.panels, smooth=max(1, args.smooth)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
