"""Start-up of the tiny recipe: ``megatron-gtpo train configs/tiny.yaml`` to its ``ready:`` line, with
the ranks forked from the warm driver (the default on a CPU host, megatron_gtpo/parallel/launch.py)
against torchrun's fresh interpreters (``MGTPO_LAUNCHER=torchrun``, the baseline), alternated in
this invocation so that both see the same machine load. A third row forks too but first removes
the cached empty MLflow store (megatron_gtpo/tracking/sqlite_seed.py), so that run migrates a new
store as every run did before the cache (and as an installation's first run does).

    python bench/startup.py [--repeats 3] [--out /tmp/bench_startup]

Each run is 1 step (the step itself is not timed). Prints per launcher the median over repeats of
the rank's own ``start-up`` figure (wall time from the ``megatron-gtpo train`` command to the
``ready:`` line) and of the peak host RSS it reports, the wall time of the whole command, then one
JSON line with ``fork_over_torchrun`` (start-up ratio; below 1 is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout's megatron_gtpo
from bench.alternating import alternate  # noqa: E402
READY = re.compile(r"ready: .*\(start-up ([0-9.]+) s, peak host RSS ([0-9.]+) GiB\)")


LAUNCHERS = {"fork_store_migrated": "fork", "torchrun": "torchrun", "fork": "fork"}
"""Variant -> MGTPO_LAUNCHER. The migrating variant runs first in each round: the store it builds
is the cache the other two copy from."""


def run(out: str, variant: str) -> dict[str, float]:
    shutil.rmtree(out, ignore_errors=True)
    launcher = LAUNCHERS[variant]
    if variant == "fork_store_migrated":
        from megatron_gtpo.models.smollm2 import default_cache_dir
        from megatron_gtpo.tracking.sqlite_seed import template_path

        template_path(default_cache_dir()).unlink(missing_ok=True)
    cmd = [os.path.join(REPO, ".venv", "bin", "megatron-gtpo"), "train", os.path.join(REPO, "configs", "tiny.yaml"),
           "--output-dir", out, "--steps", "1", "train.checkpoint_every=1"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "MGTPO_LAUNCHER": launcher})
    wall = time.perf_counter() - start
    text = proc.stdout + proc.stderr
    match = READY.search(text)
    if proc.returncode or match is None:
        sys.exit(f"run failed ({launcher}: {' '.join(cmd)}):\n{text[-4000:]}")
    return {"startup_s": float(match.group(1)), "peak_rss_gib": float(match.group(2)), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="/tmp/bench_startup")
    args = parser.parse_args(argv)
    rows, med = alternate(LAUNCHERS, args.repeats,
                          lambda variant, i: run(os.path.join(args.out, f"{variant}-{i}"), variant))
    print(f"configs/tiny.yaml, TP=2, medians of {args.repeats} runs each (load1 {os.getloadavg()[0]:.1f})")
    print("launcher | start-up s | peak host RSS GiB | command wall s (1 step)")
    for launcher, m in med.items():
        print(f"{launcher} | {m['startup_s']:.1f} | {m['peak_rss_gib']:.2f} | {m['wall_s']:.1f}")
    print(json.dumps({"bench": "startup", "repeats": args.repeats, "medians": med,
                      "fork_over_torchrun": round(med["fork"]["startup_s"] / med["torchrun"]["startup_s"], 3),
                      "copied_over_migrated_store": round(med["fork"]["startup_s"]
                                                          / med["fork_store_migrated"]["startup_s"], 3),
                      "all": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
