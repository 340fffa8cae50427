"""What ``bench/learning.py`` reports: one summary per run from its MLflow store and eval reports,
the spread over seeds per algorithm, the quick check's verdict and the held-out figure.

A run's summary reads the metrics the trainer logged to MLflow (``plotting.fetch_history``, the
same reader as ``tools/plot_run.py``) and the JSON reports ``megatron-gtpo eval`` wrote.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from megatron_gtpo.plotting import fetch_history, save_figure

CURVES = ("reward/accuracy", "reward/mean", "eval/accuracy", "entropy/mean", "gtpo/filtered_frac",
          "gtpo/conflict_tokens_per_completion", "gtpo/lambda_zero_share", "gtpo/lambda_ge2_share",
          "bias/prefix_wagg_common", "bias/prefix_wagg_len_corr", "bias/prefix_wagg_abs_mean", "bias/prefix_common_len",
          "bias/surrogate_adv_term", "bias/surrogate_cov",
          "bias/surrogate_loss_gap", "completion/length_mean", "time/step_s", "rollout/tries", "batch/active_frac",
          "gtpo/shift_share", "bias/length_drift", "batch/equal_groups_frac", "completion/truncated_frac",
          "optim/grad_norm")
"""Metric histories a run summary reads."""
MEANS = {"filtered_frac": "gtpo/filtered_frac", "conflict_tokens_per_completion": "gtpo/conflict_tokens_per_completion",
         "lambda_zero_share": "gtpo/lambda_zero_share", "lambda_ge2_share": "gtpo/lambda_ge2_share",
         "d1_wagg_common": "bias/prefix_wagg_common", "d1_wagg_len_corr": "bias/prefix_wagg_len_corr",
         "d1_wagg_abs_mean": "bias/prefix_wagg_abs_mean", "d1_common_prefix_len": "bias/prefix_common_len",
         "d2_adv_term": "bias/surrogate_adv_term", "d2_cov": "bias/surrogate_cov", "active_frac": "batch/active_frac",
         "shift_share": "gtpo/shift_share", "length_drift": "bias/length_drift",
         "equal_groups_frac": "batch/equal_groups_frac", "truncated_frac": "completion/truncated_frac"}
"""Summary key -> metric averaged over the run's steps (absent when the algorithm does not log it)."""


def window(steps: int) -> int:
    """Steps averaged at each end of a curve: a fifth of the run, 2 to 5 steps."""
    return max(2, min(5, steps // 5)) if steps >= 4 else 1


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _ends(points: list[tuple[int, float]], w: int) -> tuple[float | None, float | None]:
    values = [v for _, v in points]
    return (_mean(values[:w]), _mean(values[-w:])) if values else (None, None)


def pass_at_k(report_path: Path) -> dict[str, float] | None:
    """``{"pass@1": ..., ...}`` of the held-out benchmark in a ``megatron-gtpo eval`` report."""
    if not report_path.is_file():
        return None
    benchmarks = json.loads(report_path.read_text())["benchmarks"]
    (result,) = benchmarks.values()
    return {k: round(v, 4) for k, v in result["metrics"].items() if k.startswith("pass@")}


def summarise_run(run_dir: Path, *, steps: int) -> dict:
    """One run's numbers: training accuracy and reward at both ends, held-out greedy accuracy per
    eval step, entropy, GTPO's filter and conflict shares, D1/D2, step time and generation counts."""
    uri, run_id = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}", (run_dir / "run_id").read_text().strip()
    h = fetch_history(uri, run_id, list(CURVES))
    w = window(steps)
    out: dict = {"steps_logged": len(h.get("reward/accuracy", [])), "window": w}
    for name, key in (("acc", "reward/accuracy"), ("reward", "reward/mean"), ("entropy", "entropy/mean"),
                      ("length", "completion/length_mean")):
        out[f"{name}_first"], out[f"{name}_last"] = _ends(h.get(key, []), w)
    out["entropy_max"] = max((v for _, v in h.get("entropy/mean", [])), default=None)
    out["heldout_greedy"] = {int(s): round(v, 4) for s, v in h.get("eval/accuracy", [])}
    for name, key in MEANS.items():
        if key in h:
            out[name] = _mean(v for _, v in h[key])
    gaps = [abs(v) for _, v in h.get("bias/surrogate_loss_gap", [])]
    out["d2_loss_gap_max_abs"] = max(gaps) if gaps else None
    times = [v for _, v in h.get("time/step_s", [])]
    out["step_s_median"] = statistics.median(times) if times else None
    out["rollout_tries"] = sum(v for _, v in h.get("rollout/tries", []))
    out["truncated_first"], out["truncated_last"] = _ends(h.get("completion/truncated_frac", []), w)
    out.update(grad_norm_split(h))
    return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in out.items()}


def grad_norm_split(history: dict) -> dict:
    """The pre-clip grad norm averaged over steps whose groups were all equal-reward (only GTPO's
    shift can act there) and over the others; with one prompt per step each step is one or the other."""
    equal = dict(history.get("batch/equal_groups_frac", []))
    norms = history.get("optim/grad_norm", [])
    out = {}
    for name, pick in (("grad_norm_equal_steps", lambda s: equal.get(s) == 1.0),
                       ("grad_norm_mixed_steps", lambda s: equal.get(s, 1.0) < 1.0)):
        out[name] = _mean(v for s, v in norms if pick(s))
    return out


def spread(values: list[float | None]) -> dict | None:
    """Mean, min, max (and the sample std with two seeds or more) of a number over seeds."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    row = {"mean": round(sum(values) / len(values), 5), "min": round(min(values), 5), "max": round(max(values), 5)}
    if len(values) > 1:
        row["std"] = round(statistics.stdev(values), 5)
    return row


def aggregate(runs: list[dict]) -> dict:
    """Per algorithm: the spread over seeds of every number of the run summaries."""
    out: dict = {}
    for algo in dict.fromkeys(r["algo"] for r in runs):
        mine = [r for r in runs if r["algo"] == algo and r.get("status") == "ok"]
        row: dict = {"seeds": [r["seed"] for r in mine]}
        keys = [k for k, v in (mine[0] if mine else {}).items() if isinstance(v, (int, float)) and k not in ("seed",)]
        for key in keys:
            row[key] = spread([r.get(key) for r in mine])
        for key in ("pass_before", "pass_after"):
            ks = sorted({k for r in mine for k in (r.get(key) or {})})
            if ks:
                row[key] = {k: spread([(r.get(key) or {}).get(k) for r in mine]) for k in ks}
        last = [r["heldout_greedy"][max(r["heldout_greedy"])] for r in mine if r.get("heldout_greedy")]
        row["heldout_greedy_after"] = spread(last)
        out[algo] = row
    return out


def quick_verdict(runs: list[dict], margin: float) -> dict:
    """The quick check: each algorithm's mean reward over the last steps minus the first steps must
    exceed ``margin``. A broken update shows a flat (lr 0, no gradient) or falling (sign flip) reward."""
    def gain(r):
        return None if r.get("reward_last") is None else round(r["reward_last"] - r["reward_first"], 4)

    rows = {r["algo"]: {"reward_first": r.get("reward_first"), "reward_last": r.get("reward_last"), "gain": gain(r)}
            for r in runs}
    failed = sorted(a for a, v in rows.items() if v["gain"] is None or v["gain"] <= margin)
    return {"margin": margin, "per_algorithm": rows, "passed": not failed, "failed": failed}


def plot_held_out(summary: dict, output: Path) -> Path:
    """Bars per algorithm: held-out greedy accuracy and pass@k before (base model) and after
    training, mean over seeds with min-max whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos, base = list(summary["algorithms"]), summary.get("base") or {}
    ks = sorted((base.get("pass") or {}), key=lambda k: int(k.split("@")[1]))
    metrics = [("greedy", base.get("greedy"), lambda a: a.get("heldout_greedy_after"))]
    metrics += [(k, (base.get("pass") or {}).get(k), lambda a, k=k: (a.get("pass_after") or {}).get(k)) for k in ks]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 4), squeeze=False)
    for ax, (name, before, after_of) in zip(axes[0], metrics):
        rows = [after_of(summary["algorithms"][a]) or {} for a in algos]
        means = [r.get("mean", float("nan")) for r in rows]
        errs = [[m - r.get("min", m) for m, r in zip(means, rows)], [r.get("max", m) - m for m, r in zip(means, rows)]]
        ax.bar(range(len(algos)), means, yerr=errs, capsize=4, color="tab:blue", alpha=0.8, label="after")
        if before is not None:
            ax.axhline(before, color="tab:red", linestyle="--", label=f"before (base) {before:.3f}")
        ax.set_xticks(range(len(algos)), algos)
        ax.set_title(f"held-out {name}" + (" (greedy, T=0)" if name == "greedy" else ""))
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return save_figure(fig, output)


TABLE = (("acc_first", "train acc, first"), ("acc_last", "train acc, last"),
         ("heldout_greedy_after", "held-out greedy after"),
         ("entropy_first", "entropy first"), ("entropy_last", "entropy last"), ("entropy_max", "entropy max"),
         ("filtered_frac", "filtered"), ("lambda_zero_share", "lambda=0"), ("lambda_ge2_share", "lambda>=2"),
         ("d1_wagg_common", "D1 W_agg common"), ("d2_adv_term", "D2 sum A Omega"), ("d2_loss_gap_max_abs", "D2 gap"),
         ("active_frac", "A != 0"), ("step_s_median", "step s"), ("rollout_tries", "generations"))
"""(aggregate key, column) of ``table``: the study's numbers per algorithm."""


def merged(lines: list[dict]) -> dict:
    """The summaries of several ``bench/learning.py`` invocations (e.g. seeds run apart) as one:
    every run, the spread per algorithm over all of them, each invocation's base evaluation."""
    runs = [r for line in lines for r in line["runs"]]
    return {"algorithms": aggregate(runs), "runs": runs, "base": [line.get("base") for line in lines]}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        lo, hi = value["min"], value["max"]
        return f"{value['mean']:.3g}" + ("" if lo == hi else f" [{lo:.3g}, {hi:.3g}]")
    return f"{value:.3g}"


def table(summary: dict) -> str:
    """A markdown table, one row per algorithm: mean over seeds, [min, max] where the seeds differ."""
    head = "| algorithm | seeds | " + " | ".join(name for _, name in TABLE) + " |"
    rows = [head, "|" + "---|" * (len(TABLE) + 2)]
    for algo, agg in summary["algorithms"].items():
        rows.append(f"| {algo} | {','.join(map(str, agg['seeds']))} | "
                    + " | ".join(_cell(agg.get(key)) for key, _ in TABLE) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    """``bench/learning_report.py SUMMARY.json [...]``: the markdown table of one or several study
    summaries (``OUT/summary.json`` of bench/learning.py), merged, and the merged JSON line."""
    import argparse

    parser = argparse.ArgumentParser(prog="bench/learning_report.py", description=main.__doc__)
    parser.add_argument("summaries", nargs="+", help="summary.json files written by bench/learning.py")
    parser.add_argument("--held-out-png", default="", help="also draw the held-out before/after bars here")
    args = parser.parse_args(argv)
    summary = merged([json.loads(Path(p).read_text()) for p in args.summaries])
    print(table(summary))
    if args.held_out_png:  # "before" is the base model: the same greedy evaluation in every summary
        plot_held_out({**summary, "base": next((b for b in summary["base"] if b), None)}, Path(args.held_out_png))
    print(json.dumps({"bench": "learning_report", "summaries": args.summaries, **summary}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
