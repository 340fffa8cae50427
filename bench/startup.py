"""Start-up of the tiny recipe: ``megatron-gtpo train configs/tiny.yaml`` to its ``ready:`` line, with
the ranks forked from the warm driver (the default on a CPU host, megatron_gtpo/parallel/launch.py)
against torchrun's fresh interpreters (``MGTPO_LAUNCHER=torchrun``, the baseline), alternated in
this invocation so that both see the same machine load. A third row forks too but first removes
the cached empty MLflow store (megatron_gtpo/tracking/sqlite_seed.py), so that run migrates a new
store as every run did before the cache (and as an installation's first run does).

    python bench/startup.py [--repeats 3] [--out /tmp/bench_startup] [--against CHECKOUT] [--only fork,against]
    python bench/startup.py --quick [--out DIR]      # one forked run (the suite's smoke run)

``--against CHECKOUT`` adds the variant ``against``: another checkout of the project (its own ``.venv`` set up,
e.g. ``git worktree add /tmp/before HEAD~1 && make -C /tmp/before setup``) started the same way as ``fork``,
in the same rounds, so a change is measured against the code before it (``fork_over_against``).

Each run is 1 step. Prints per launcher the median over repeats of the rank's own ``start-up``
figure (wall time from the ``megatron-gtpo train`` command to the ``ready:`` line), of the time
until the first step's log line (``step 1/1 | ...``, start-up plus one tiny step, whose rollout
includes vLLM's first generation) and of the peak host RSS it reports, the wall time of the whole
command, then one JSON line with ``fork_over_torchrun`` (start-up ratio; below 1 is faster).
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
from bench.quick import parse_quick  # noqa: E402
READY = re.compile(r"ready: .*\(start-up ([0-9.]+) s, peak host RSS ([0-9.]+) GiB\)")
FIRST_STEP = re.compile(r"\bstep 1/\d+ \|")  # the first step's log line


LAUNCHERS = {"fork_store_migrated": "fork", "torchrun": "torchrun", "fork": "fork"}
"""Variant -> MGTPO_LAUNCHER. The migrating variant runs first in each round: the store it builds
is the cache the other two copy from."""
RATIOS = {"fork_over_torchrun": "torchrun", "fork_over_against": "against",
          "copied_over_migrated_store": "fork_store_migrated"}
"""Printed ratio -> the variant whose start-up divides ``fork``'s."""
QUICK = {"repeats": 1, "only": "fork"}
"""One forked run: the migrating variant would delete the store cache that concurrent runs copy."""


def run(out: str, variant: str, *, repo: str = REPO) -> dict[str, float]:
    """One 1-step run of ``repo``'s tiny recipe; ``variant`` chooses the launcher (``against``: fork)."""
    shutil.rmtree(out, ignore_errors=True)
    launcher = LAUNCHERS.get(variant, "fork")
    if variant == "fork_store_migrated":
        from megatron_gtpo.models.smollm2 import default_cache_dir
        from megatron_gtpo.tracking.sqlite_seed import template_path

        template_path(default_cache_dir()).unlink(missing_ok=True)
    cmd = [os.path.join(repo, ".venv", "bin", "megatron-gtpo"), "train", os.path.join(repo, "configs", "tiny.yaml"),
           "--output-dir", out, "--steps", "1", "train.checkpoint_every=1"]
    start, first_step, lines = time.perf_counter(), None, []
    # One stream, read as it comes: the first step's line is timed here (the ranks print unbuffered).
    proc = subprocess.Popen(cmd, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MGTPO_LAUNCHER": launcher, "PYTHONUNBUFFERED": "1",
                                 # ``repo``'s own code even where its .venv is a link to this one's
                                 "PYTHONPATH": repo})
    for line in proc.stdout:
        lines.append(line)
        if first_step is None and FIRST_STEP.search(line):
            first_step = time.perf_counter() - start
    proc.wait()
    wall = time.perf_counter() - start
    text = "".join(lines)
    match = READY.search(text)
    if proc.returncode or match is None or first_step is None:
        sys.exit(f"run failed ({launcher}: {' '.join(cmd)}):\n{text[-4000:]}")
    return {"startup_s": float(match.group(1)), "first_step_s": first_step, "peak_rss_gib": float(match.group(2)),
            "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="/tmp/bench_startup")
    parser.add_argument("--against", metavar="CHECKOUT", help="another checkout, run as the variant `against`")
    parser.add_argument("--only", help="comma-separated variants to run (default: all)")
    args = parse_quick(parser, argv, QUICK)
    variants = list(LAUNCHERS) + (["against"] if args.against else [])
    if args.only:
        only = set(args.only.split(","))
        if only - set(variants):
            parser.error(f"--only: unknown variant(s) {','.join(sorted(only - set(variants)))}; choose from "
                         f"{','.join(variants)}" + ("" if args.against else " (`against` needs --against CHECKOUT)"))
        variants = [v for v in variants if v in only]
    repos = {"against": os.path.abspath(args.against)} if args.against else {}
    rows, med = alternate(variants, args.repeats, lambda variant, i: run(
        os.path.join(args.out, f"{variant}-{i}"), variant, repo=repos.get(variant, REPO)))
    print(f"configs/tiny.yaml, TP=2, medians of {args.repeats} runs each (load1 {os.getloadavg()[0]:.1f})")
    print("launcher | start-up s | first step line s | peak host RSS GiB | command wall s (1 step)")
    for launcher, m in med.items():
        print(f"{launcher} | {m['startup_s']:.1f} | {m['first_step_s']:.1f} | {m['peak_rss_gib']:.2f} | "
              f"{m['wall_s']:.1f}")
    ratios = {name: round(med["fork"]["startup_s"] / med[base]["startup_s"], 3) for name, base in RATIOS.items()
              if "fork" in med and base in med}  # only the ratios whose two variants ran
    print(json.dumps({"bench": "startup", "repeats": args.repeats, "against": args.against, "medians": med,
                      **ratios, "all": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
