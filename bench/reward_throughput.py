"""Scoring throughput (completions/s) of the reward scorer, with and without math-verify.

Two workloads built from the real benchmark files shipped in megatron_gtpo/data/benchmarks:

- ``cheap``: GSM8K completions (answer boxed, half right, half gold + 1). Every verdict comes from
  the string/number fast path; math-verify is never called.
- ``math-verify``: MATH-500 completions whose answer is an expression written differently from the
  gold (half the gold plus a ``+0`` term, half with a digit changed), so no fast path applies and
  every verdict needs math-verify (sympy).

Each workload is scored in-process (the ``num_workers=0`` path) and by the worker pool (spawned
processes, per-sample timeout), each run with empty caches. Pool start-up is timed separately.
Prints a table and ends with one JSON line (with the 1-minute load average: on a shared machine
the pool cannot beat the in-process path, the numbers are only comparable at equal load).

    python bench/reward_throughput.py --samples 2000 --workers 2
    python bench/reward_throughput.py --quick        # toy sizes (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quick import parse_quick  # noqa: E402
from megatron_gtpo.data import load_benchmark  # noqa: E402
from megatron_gtpo.reward import ScoringPool  # noqa: E402
from megatron_gtpo.reward.extract import gold_answer  # noqa: E402
from megatron_gtpo.reward.functions import reward_path  # noqa: E402
from megatron_gtpo.reward.verify import _judge_cached, _mv_parse  # noqa: E402

QUICK = {"samples": 8, "math_samples": 4, "workers": 1}


def cheap_items(count: int) -> list[tuple[str, str, str]]:
    rows = load_benchmark("gsm8k_train")
    items = []
    for i in range(count):
        example = rows[i % len(rows)]
        answer = int(gold_answer(example.gold, "gsm8k").replace(",", "")) + (i % 2)
        items.append((f"Step {i}: adding it all up, the answer is \\boxed{{{answer}}}.", example.gold, "gsm8k"))
    return items


def _changed_digit(answer: str) -> str:
    digit = re.search(r"\d", answer)
    if not digit:
        return answer + "+1"
    d = int(digit.group())
    return answer[:digit.start()] + str(d + 1 if d < 9 else d - 1) + answer[digit.end():]


def math_verify_items(count: int) -> list[tuple[str, str, str]]:
    # Only answers that are expressions (not plain numbers): the fast paths cannot decide them.
    rows = [e for e in load_benchmark("math500") if not re.fullmatch(r"-?\d+", e.gold)]
    items = []
    for i in range(count):
        example = rows[i % len(rows)]
        pred = f"{example.gold}+0" if i % 2 == 0 else _changed_digit(example.gold)
        # the step number makes every completion text distinct, so no verdict is served from a cache
        items.append((f"Step {i}: so the answer is \\boxed{{{pred}}}.", example.gold, "math"))
    return items


def measure(items, *, workers: int, timeout_s: float, start_method: str) -> dict:
    # Same footing for every run: empty verdict/parse caches, math-verify already imported (workers
    # import and warm it during start-up, which is timed separately).
    _judge_cached.cache_clear()
    _mv_parse.cache_clear()
    _mv_parse("1")
    pool = ScoringPool(fn_path=reward_path("correctness"), num_workers=workers, timeout_s=timeout_s,
                       start_method=start_method)
    try:
        start = time.perf_counter()
        if workers:
            pool.score(items[:workers])  # start-up: spawn + imports + math-verify warm-up
        startup = time.perf_counter() - start
        start = time.perf_counter()
        scores = pool.score(items, with_answers=True, progress=True, desc=f"workers={workers}")
        seconds = time.perf_counter() - start
    finally:
        pool.close()
    failed = sum(s.status != "ok" for s in scores)
    return {"completions_per_s": round(len(items) / seconds, 1), "seconds": round(seconds, 3),
            "startup_s": round(startup, 3), "failed": failed, "correct": sum(s.correct for s in scores)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=2000, help="completions per workload (default 2000)")
    parser.add_argument("--math-samples", type=int, default=300,
                        help="completions of the math-verify workload (default 300; ~10 ms each)")
    parser.add_argument("--workers", type=int, default=2, help="pool size for the parallel runs (default 2)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="per-sample limit (default 10)")
    parser.add_argument("--start-method", default="spawn", choices=("spawn", "forkserver", "fork"),
                        help="worker start method (default spawn, as in training)")
    args = parse_quick(parser, argv, QUICK)
    if args.samples < 1 or args.math_samples < 1 or args.workers < 1:
        parser.error("--samples, --math-samples and --workers must be >= 1")
    workloads = {"cheap": cheap_items(args.samples), "math_verify": math_verify_items(args.math_samples)}
    results = {}
    for name, items in workloads.items():
        for workers in (0, args.workers):
            results[f"{name}_workers{workers}"] = measure(items, workers=workers, timeout_s=args.timeout_s,
                                                          start_method=args.start_method)
    print(f"{'run':<24}{'completions/s':>15}{'seconds':>10}{'startup s':>11}{'failed':>8}")
    for key, r in results.items():
        print(f"{key:<24}{r['completions_per_s']:>15}{r['seconds']:>10}{r['startup_s']:>11}{r['failed']:>8}")
    summary = {"bench": "reward_throughput", "cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
               "workers": args.workers, "start_method": args.start_method,
               **{f"{k}_cps": r["completions_per_s"] for k, r in results.items()},
               "results": results}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
