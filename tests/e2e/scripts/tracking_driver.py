"""The driver's tracking calls without the training: one process of a run that may die.

Usage: python tracking_driver.py RUN_DIR URI --run N --first A --last B [--resume-step R]
       [--every K] [--die-at S --how kill|raise]

Logs ``value(step, run)`` for steps A..B, commits a checkpoint every K steps, and at step S
(after logging it, before its checkpoint commit) dies: ``kill`` = SIGKILL (after waiting until
the committed steps are in MLflow), ``raise`` = an uncaught exception (the atexit path).
Without --die-at it finishes the run FINISHED. Prints ``RESULT {"run_id": ...}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

from megatron_gtpo.tracking import Tracker, TrackingConfig

KEYS = ["loss", "reward/mean", "time/step_s"]


def value(step: int, run: int, i: int) -> float:
    return 100.0 * run + step + i / 10


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("uri")
    parser.add_argument("--run", type=int, required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--resume-step", type=int, default=None)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=None)
    parser.add_argument("--how", choices=["kill", "raise"], default="kill")
    args = parser.parse_args()
    tracker = Tracker(TrackingConfig(uri=args.uri, request_timeout_s=2), run_dir=args.run_dir,
                      resume_step=args.resume_step)
    tracker.log_params({"run": args.run})
    for step in range(args.first, args.last + 1):
        tracker.log_metrics({key: value(step, args.run, i) for i, key in enumerate(KEYS)}, step)
        if step == args.die_at:
            if args.how == "raise":
                raise RuntimeError(f"driver crash at step {step}")
            assert tracker.worker.flush(120), tracker.worker.last_error
            print("RESULT " + json.dumps({"run_id": tracker.run_id}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if step % args.every == 0:
            tracker.commit(step)
    tracker.finish("FINISHED")
    print("RESULT " + json.dumps({"run_id": tracker.run_id}), flush=True)


if __name__ == "__main__":
    main()
