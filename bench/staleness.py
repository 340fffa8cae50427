"""Step time of one-step-off rollouts: configs/tiny.yaml with ``rollout.staleness`` 0 and 1, same transport,
one run after the other in the same invocation (same machine load window).

    python bench/staleness.py [--transport separate|colocated] [--steps 10] [--out /tmp/bench_staleness]
    python bench/staleness.py --quick [--out DIR]    # colocated, 2 steps each (the suite's smoke run)

Prints, per staleness, the median over steps 2..N (step 1 includes the engines' warm-up) of
``time/step_s`` and of its stages (``time/rollout_s``: what the step waited for generation,
``time/train_s``, ``time/sync_s``: the push, which with staleness 1 on a pool includes waiting for
the generate call in flight), then one JSON line per run. With staleness 1 the runs use
``algo.mismatch_correction=tis`` (required); the staleness-0 run uses it too, so that the two differ
only in the schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout
from bench.quick import parse_quick  # noqa: E402

QUICK = {"transport": "colocated", "steps": 2}
KEYS = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s")


def run(out: str, *, staleness: int, transport: str, steps: int) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "megatron_gtpo.cli", "train", os.path.join(REPO, "configs", "tiny.yaml"),
           "--output-dir", out, "--steps", str(steps), f"rollout.staleness={staleness}",
           "algo.mismatch_correction=tis", f"sync.transport={transport}", f"train.checkpoint_every={steps}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{os.path.join(out, 'mlflow.db')}")
    run_id = open(os.path.join(out, "run_id")).read().strip()
    medians = {}
    for key in KEYS:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        medians[key] = statistics.median(v for step, v in points if step >= 2)
    return medians


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="separate", choices=("separate", "colocated"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default="/tmp/bench_staleness")
    args = parse_quick(parser, argv, QUICK)
    rows = {s: run(os.path.join(args.out, f"s{s}"), staleness=s, transport=args.transport, steps=args.steps)
            for s in (0, 1)}
    print(f"tiny.yaml, {args.transport}, median of steps 2..{args.steps} (s)")
    print("staleness | " + " | ".join(KEYS))
    for s, row in rows.items():
        print(f"{s} | " + " | ".join(f"{row[k]:.3f}" for k in KEYS))
    print(f"step time ratio staleness 1 / 0: {rows[1]['time/step_s'] / rows[0]['time/step_s']:.2f}")
    for s, row in rows.items():
        print(json.dumps({"staleness": s, "transport": args.transport, "steps": args.steps, **row}))


if __name__ == "__main__":
    main()
