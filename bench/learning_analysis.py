"""What a finished learning study supports: per-prompt paired comparisons and a power statement.

    .venv/bin/python bench/learning_analysis.py OUT [OUT ...] [--against gtpo] [--json FILE]
    .venv/bin/python bench/learning_analysis.py --quick      # a synthetic study, in a second

Reads each study directory that ``bench/learning.py`` wrote (``summary.json``, the base model's and
every run's ``held_out_pass.samples.jsonl``: n sampled answers per held-out prompt) and prints one
JSON line:

* ``paired``: for ``--against`` (default gtpo) against every other algorithm, over the held-out
  prompts, the per-prompt pass@1 (mean correctness of the n samples) averaged over seeds: mean
  difference, a 95% paired-bootstrap interval, and how many prompts each side wins (a sign test's
  counts and its two-sided p-value);
* ``vs_base``: each algorithm's per-prompt pass@1 against the base model's, the same way;
* ``sizing``: the base model's samples at the study's cap (stage 0): share cut off, share fully
  formatted (the paper's tags; a final ``\\boxed{}``), accuracy, mean length;
* ``power``: the pooled seed-to-seed std of the held-out greedy accuracy after training and the
  seeds per arm a difference of 0.1 (and 0.05) needs at 80% power, two-sided alpha 0.05
  (``n = 2 (z_0.975 + z_0.8)^2 s^2 / d^2``).

Pure Python on the files (no torch): it runs in seconds and in the suite's ``--quick`` check.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from collections import defaultdict
from pathlib import Path

Z = 1.959964 + 0.841621
"""z_0.975 + z_0.8: two-sided alpha 0.05 at 80% power."""


def per_prompt(samples: Path) -> dict[str, float]:
    """uid -> mean correctness of its samples in an eval samples file."""
    hits: dict[str, list[int]] = defaultdict(list)
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        hits[row["uid"]].append(int(bool(row["correct"])))
    return {uid: sum(v) / len(v) for uid, v in hits.items()}


def paired(a: dict[str, float], b: dict[str, float], *, resamples: int = 2000, seed: int = 0) -> dict:
    """``a - b`` over the prompts both hold: mean, 95% bootstrap interval, wins, sign-test p."""
    uids = sorted(set(a) & set(b))
    diffs = [a[u] - b[u] for u in uids]
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(diffs, k=len(diffs))) for _ in range(resamples))
    wins, losses = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return {"prompts": len(uids), "mean_diff": round(statistics.fmean(diffs), 4),
            "ci95": [round(means[int(0.025 * resamples)], 4), round(means[int(0.975 * resamples) - 1], 4)],
            "wins": wins, "losses": losses, "ties": len(diffs) - wins - losses,
            "sign_test_p": round(sign_test(wins, losses), 4)}


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact binomial p-value of ``wins`` against ``losses`` (ties dropped)."""
    n = wins + losses
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(wins, losses) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def seeds_needed(std: float, diff: float) -> int:
    """Seeds per arm to detect ``diff`` at 80% power (two-sided 0.05) at seed std ``std``."""
    return max(2, math.ceil(2 * (Z * std / diff) ** 2))


def load(outs: list[Path]) -> tuple[dict, dict, dict]:
    """(per algorithm: seed -> per-prompt pass@1, the base's per-prompt pass@1, per algorithm: the
    greedy held-out accuracy after training per seed) over every study directory given."""
    runs: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    greedy: dict[str, list[float]] = defaultdict(list)
    base: dict[str, float] = {}
    for out in outs:
        summary = json.loads((out / "summary.json").read_text())
        if (out / "base_pass.samples.jsonl").is_file():
            base = per_prompt(out / "base_pass.samples.jsonl")
        for run in summary["runs"]:
            samples = out / f"{run['algo']}-s{run['seed']}" / "held_out_pass.samples.jsonl"
            if run.get("status") == "ok" and samples.is_file():
                runs[run["algo"]][run["seed"]] = per_prompt(samples)
            if run.get("heldout_greedy"):
                greedy[run["algo"]].append(run["heldout_greedy"][max(run["heldout_greedy"], key=int)])
    return runs, base, greedy


def sizing(samples: Path) -> dict | None:
    """Stage 0 of a study: the base model's sampled answers at the study's cap: the share cut off
    (finish reason ``length``), the share whose format term is full in either form (the paper's tags,
    ``paper_format_score``; a final box, ``boxed_format_score``) and the accuracy."""
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    if not rows or "text" not in rows[0]:
        return None
    from megatron_gtpo.reward.functions import FORMAT_FULL, boxed_format_score, paper_format_score

    def share(pick) -> float:
        return round(sum(1 for r in rows if pick(r)) / len(rows), 4)

    return {"samples": len(rows), "truncated": share(lambda r: r.get("finish_reason") == "length"),
            "tags_formatted": share(lambda r: paper_format_score(r["text"]) == FORMAT_FULL),
            "boxed_formatted": share(lambda r: boxed_format_score(r["text"]) == FORMAT_FULL),
            "accuracy": share(lambda r: r["correct"]),
            "mean_tokens": round(statistics.fmean(r.get("num_tokens", 0) for r in rows), 1)}


def seed_mean(by_seed: dict[int, dict[str, float]]) -> dict[str, float]:
    uids = set.intersection(*(set(v) for v in by_seed.values()))
    return {u: statistics.fmean(v[u] for v in by_seed.values()) for u in uids}


def analyse(outs: list[Path], against: str = "gtpo") -> dict:
    runs, base, greedy = load(outs)
    means = {algo: seed_mean(v) for algo, v in runs.items() if v}
    out: dict = {"paired": {}, "vs_base": {}}
    base_samples = [o / "base_pass.samples.jsonl" for o in outs if (o / "base_pass.samples.jsonl").is_file()]
    if base_samples:
        out["sizing"] = sizing(base_samples[-1])
    if against in means:
        out["paired"] = {f"{against}-{o}": paired(means[against], m) for o, m in means.items() if o != against}
    if base:
        out["vs_base"] = {algo: paired(m, base) for algo, m in means.items()}
    spreads = [statistics.stdev(v) for v in greedy.values() if len(v) > 1]
    if spreads:
        pooled = math.sqrt(statistics.fmean(s * s for s in spreads))
        out["power"] = {"pooled_seed_std": round(pooled, 4), "per_algorithm_std": {
            a: round(statistics.stdev(v), 4) for a, v in greedy.items() if len(v) > 1},
            "seeds_per_arm_for_0.1": seeds_needed(pooled, 0.1) if pooled else 2,
            "seeds_per_arm_for_0.05": seeds_needed(pooled, 0.05) if pooled else 2}
    return out


def synthetic_study(root: Path) -> Path:
    """A tiny study directory in ``bench/learning.py``'s layout (4 prompts, n = 2, two algorithms,
    two seeds): what ``--quick`` analyses, and the unit tests' fixture."""
    def samples(path: Path, hits: list[tuple[int, int]]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps({"uid": f"p{i}", "correct": bool(c)}) + "\n"
                                for i, pair in enumerate(hits) for c in pair))

    samples(root / "base_pass.samples.jsonl", [(0, 0), (0, 1), (0, 0), (1, 1)])
    runs = []
    for algo, seed, hits, greedy in (("gtpo", 0, [(1, 1), (0, 1), (0, 0), (1, 1)], 0.5),
                                     ("gtpo", 1, [(1, 0), (1, 1), (0, 0), (1, 1)], 0.7),
                                     ("grpo", 0, [(0, 0), (0, 1), (0, 0), (1, 1)], 0.4),
                                     ("grpo", 1, [(0, 1), (0, 0), (0, 0), (1, 1)], 0.4)):
        samples(root / f"{algo}-s{seed}" / "held_out_pass.samples.jsonl", hits)
        runs.append({"algo": algo, "seed": seed, "status": "ok", "heldout_greedy": {"15": greedy}})
    (root / "summary.json").write_text(json.dumps({"runs": runs}))
    return root


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/learning_analysis.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outs", nargs="*", type=Path, help="study output directories of bench/learning.py")
    parser.add_argument("--quick", action="store_true", help="analyse a synthetic study (the suite's check)")
    parser.add_argument("--against", default="gtpo", help="algorithm compared with every other (default gtpo)")
    parser.add_argument("--json", type=Path, default=None, help="also write the result to this file")
    args = parser.parse_args(argv)
    if args.quick:
        import tempfile

        args.outs = [synthetic_study(Path(tempfile.mkdtemp(prefix="learning_analysis_")))]
    if not args.outs:
        parser.error("give at least one study directory, or --quick")
    missing = [str(o) for o in args.outs if not (o / "summary.json").is_file()]
    if missing:
        print(f"bench/learning_analysis.py: no summary.json in {', '.join(missing)} (a finished bench/learning.py "
              f"output directory is needed)", file=sys.stderr)
        return 2
    result = {"bench": "learning_analysis", "outs": [str(o) for o in args.outs], **analyse(args.outs, args.against)}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
