"""Asynchronous rollouts on a pool of rollout servers: trainer idle share and end-to-end tokens/s at
``rollout.staleness`` k = 0, 1, 2 and with partial rollouts, as ratios to k = 0 in one invocation.

    python bench/staleness.py [--steps 8] [--max-tokens 240] [--rows 0:off,1:off,2:off,2:continue,2:abort]
    python bench/staleness.py --quick [--out DIR]    # 2 rows x 3 steps at 48 tokens (the suite's smoke run)

The workload is ``configs/tiny.yaml`` with one rollout server (``sync.transport=separate``) and
completions of up to ``--max-tokens``: the tiny random policy stops with probability ~1/128 per token,
so its lengths are geometric, a long tail of a few completions running to the cap while most ended
long before (the tail that partial rollouts cut). The trainer runs at TP=1 on core 0 and the
bench starts the server itself on core 1 (``taskset``, one thread each; the trainer reaches it through
``sync.servers`` with a job secret the bench makes): a stand-in for rollout servers on their own
devices, which 2 cores shared by both would not be (the 2026-12-01 run of this bench measured that:
no gain). Every run uses ``algo.mismatch_correction=tis`` (required off-policy),
so the rows differ only in the schedule.

Per row, over steps 2..N (step 1 includes the engines' warm-up): the trainer's idle share
``1 - sum(time/train_s) / sum(time/step_s)`` (the share of wall time it waits for generation or a
push), tokens/s = completion tokens trained / wall time, the staleness actually seen
(``rollout/staleness_mean``, ``rollout/partial_frac``), then one JSON line per row.
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
sys.path.insert(0, REPO)  # this checkout
from bench.quick import parse_quick  # noqa: E402

QUICK = {"steps": 3, "max_tokens": 48, "rows": "0:off,2:continue"}
MAX_PROMPT_TOKENS = 256
"""configs/tiny.yaml's data.max_prompt_tokens; the tiny model has 512 positions."""
SUMMED = ("time/step_s", "time/train_s", "time/rollout_s", "time/sync_s")
MEANS = ("rollout/staleness_mean", "rollout/staleness_max", "rollout/partial_frac", "completion/length_mean",
         "completion/truncated_frac")


def parse_rows(text: str) -> list[tuple[int, str]]:
    rows = []
    for item in text.split(","):
        k, _, partial = item.partition(":")
        rows.append((int(k), partial or "off"))
    if not rows or rows[0] != (0, "off"):
        raise SystemExit("--rows must start with the baseline 0:off (the ratios are against it)")
    return rows


def run(out: str, *, staleness: int, partial: str, steps: int, max_tokens: int) -> dict[str, float]:
    """One row: its own rollout server on core 1, the trainer on core 0."""
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    overrides = {"rollout": {"staleness": staleness, "partial": partial, "n": 4, "max_tokens": max_tokens,
                             "vllm": {"max_model_len": MAX_PROMPT_TOKENS + max_tokens}},
                 "algo": {"mismatch_correction": "tis"}, "sync": {"transport": "separate"}, "parallel": {"tp": 1},
                 "train": {"prompts_per_step": 4, "checkpoint_every": steps}, "tracking": {"samples_every": 0}}
    recipe = os.path.join(out, "recipe.yaml")
    with open(recipe, "w") as f:
        json.dump({"base": os.path.join(REPO, "configs", "tiny.yaml"), **overrides}, f)  # JSON is YAML
    from megatron_gtpo.utils.secret import make_secret_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "1",
           "MGTPO_SECRET_FILE": str(make_secret_file(os.path.join(out, "secret")))}
    with open(os.path.join(out, "server.log"), "w") as log:
        server = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-m", "megatron_gtpo.cli", "rollout-server",
                                   recipe, "--host", "127.0.0.1", "--port", "0"], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    try:
        address = _listening(os.path.join(out, "server.log"), server)
        cmd = ["taskset", "-c", "0", sys.executable, "-m", "megatron_gtpo.cli", "train", recipe, "--output-dir",
               os.path.join(out, "run"), "--steps", str(steps), f"sync.servers=[{address}]"]
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    finally:
        server.kill()
        server.wait()
    if proc.returncode:
        sys.exit(f"run failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return _row(os.path.join(out, "run"))


def _listening(path: str, server: subprocess.Popen) -> str:
    """``host:port`` the server printed once it held its port."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        found = re.search(r"rollout-server listening on (\S+:\d+)", open(path).read())
        if found:
            return found.group(1)
        time.sleep(0.2)
    sys.exit(f"the rollout server did not start:\n{open(path).read()[-3000:]}")


def _row(out: str) -> dict[str, float]:
    """Sums and means over steps 2..N of one run's MLflow metrics."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{os.path.join(out, 'mlflow.db')}")
    run_id = open(os.path.join(out, "run_id")).read().strip()
    series = {key: dict(sorted((m.step, m.value) for m in client.get_metric_history(run_id, key)))
              for key in (*SUMMED, *MEANS, "rollout/groups")}
    later = [s for s in series["time/step_s"] if s >= 2]
    row = {key: sum(series[key][s] for s in later) for key in SUMMED}
    row.update({key: sum(series[key].get(s, 0.0) for s in later) / len(later) for key in MEANS})
    tokens = sum(series["completion/length_mean"][s] * series["rollout/groups"][s] * 4 for s in later)  # n = 4
    row["idle_share"] = 1 - row["time/train_s"] / row["time/step_s"]
    row["tokens_per_s"] = tokens / row["time/step_s"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=240, help="at most 512 - 256 (the tiny model's positions)")
    parser.add_argument("--rows", default="0:off,1:off,2:off,2:continue,2:abort",
                        help="comma-separated k:partial runs, the first 0:off (the baseline)")
    parser.add_argument("--out", default="/tmp/bench_staleness")
    args = parse_quick(parser, argv, QUICK)
    if shutil.which("taskset") is None:
        sys.exit("taskset (util-linux) is needed to give the trainer and the server a core each")
    rows = {(k, p): run(os.path.join(args.out, f"k{k}-{p}"), staleness=k, partial=p, steps=args.steps,
                        max_tokens=args.max_tokens) for k, p in parse_rows(args.rows)}
    base = rows[(0, "off")]
    print(f"tiny.yaml on a pool of 1 server, max_tokens {args.max_tokens}, steps 2..{args.steps}")
    print("k | partial | idle share | tokens/s | x k=0 | step s | rollout s | sync s | staleness mean | partial frac")
    for (k, p), r in rows.items():
        print(f"{k} | {p} | {r['idle_share']:.2f} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}"
              f" | {r['time/step_s'] / (args.steps - 1):.2f} | {r['time/rollout_s'] / (args.steps - 1):.2f}"
              f" | {r['time/sync_s'] / (args.steps - 1):.2f} | {r['rollout/staleness_mean']:.2f}"
              f" | {r['rollout/partial_frac']:.2f}")
    for (k, p), r in rows.items():
        print(json.dumps({"staleness": k, "partial": p, "steps": args.steps, "max_tokens": args.max_tokens,
                          "tokens_per_s_vs_k0": r["tokens_per_s"] / base["tokens_per_s"], **r}))


if __name__ == "__main__":
    main()
