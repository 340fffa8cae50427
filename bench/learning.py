"""Does the model learn, and how do GTPO, GRPO, Dr. GRPO and DAPO compare on the same work?

    configs/study/<name>.yaml: the task, steps, seeds, held-out evaluation, the shared settings and
        each algorithm's own recipe (configs/gtpo.yaml, grpo_gtpo_paper.yaml, drgrpo.yaml, dapo.yaml)
    --> training and held-out prompts written under OUT/data (held-out: never trained on)
    --> base model: `megatron-gtpo eval` greedy and pass@k on the held-out prompts ("before")
    --> per algorithm x seed: `megatron-gtpo train OUT/<algo>-s<seed>/recipe.yaml` (real Megatron,
        vLLM, MLflow; greedy held-out accuracy every eval.every steps), then `megatron-gtpo eval` of
        its last checkpoint (pass@k "after", logged into the run's MLflow run)
    --> one JSON line (per-run summaries, the spread over seeds per algorithm, compute used, load
        average) and plots: OUT/curves.png (tools/plot_run.py --panels study, one line per algorithm,
        mean over seeds with a min-max band), OUT/held_out.png (before / after bars)

    .venv/bin/python bench/learning.py --out runs/study                    # configs/study/arithmetic.yaml
    .venv/bin/python bench/learning.py --out runs/study --seeds 0 --steps 10 --algos gtpo,grpo
    .venv/bin/python bench/learning.py --quick                             # tiny model, toy task, < 1 min

--quick runs configs/study/quick.yaml (tiny random model, toy reward) with every run inside this
process (`megatron_gtpo.cli.main`, one process start for all four) and fails (exit 1) unless every
algorithm raises the reward by more than --margin from its first steps to its last: a broken update
shows a flat reward (no or zero gradient) or a falling one (a sign error). Full studies run each
`megatron-gtpo train` / `eval` as a child process, --jobs at a time (1 thread each by default: on
2 cores, --jobs 2 keeps both busy), with the child's CPU seconds sampled at every step record.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.learning_report import aggregate, pass_at_k, plot_held_out, quick_verdict, summarise_run  # noqa: E402
from bench.learning_study import (eval_argv, load_study, prepare_data, train_argv, with_sizes,  # noqa: E402
                                  write_recipe)
from bench.vs_trl import failure, journal_steps, run_child, with_cpu  # noqa: E402

DEFAULT_STUDY = REPO / "configs" / "study" / "arithmetic.yaml"
QUICK_STUDY = REPO / "configs" / "study" / "quick.yaml"
QUICK_MARGIN = 0.1
"""--quick: least rise of the mean toy reward (last steps minus first steps) per algorithm."""


def parse_args(argv=None):
    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="bench/learning.py", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--study", default=None, help=f"study file (default {DEFAULT_STUDY.relative_to(REPO)})")
    parser.add_argument("--quick", action="store_true", help="the CI-sized check: configs/study/quick.yaml in-process")
    parser.add_argument("--out", default="", help="output directory (default: a new temp dir)")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (default: the study's)")
    parser.add_argument("--seeds", default="", help="comma list of seeds (default: the study's)")
    parser.add_argument("--algos", default="", help="comma list of algorithms (default: the study's)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1; in-process runs: 1)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each child run (default 1)")
    parser.add_argument("--margin", type=float, default=QUICK_MARGIN,
                        help=f"--quick: least reward rise per algorithm (default {QUICK_MARGIN})")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600, help="limit per child process (default 4 h)")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's last checkpoint (1.6 GB)")
    parser.add_argument("--in-process", action="store_true", help="run every train in this process (--quick does)")
    parser.add_argument("--summarise-only", action="store_true",
                        help="train nothing: summarise the runs an earlier invocation left in --out (one stopped "
                             "before its last runs), listing those that never finished")
    parser.add_argument("--reuse-base", default="", metavar="DIR",
                        help="take the base model's evaluation from an earlier invocation's DIR (same held-out set, "
                             "template, cap and eval settings: its base_*.json and samples are copied, not rerun)")
    return parser.parse_args(argv)


def child_env(threads: int) -> dict[str, str]:
    """Children run offline, with OpenMP threads that wait passively (spinning threads on a shared
    CPU slow every run several times over, as `megatron-gtpo eval` knows) and ``threads`` threads."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
            "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO)}


def launch(argv: list[str], *, log_path: Path, args, run_dir: Path | None = None) -> dict:
    """``megatron-gtpo ARGV`` in this process (--in-process) or as a child; exit code, wall and CPU
    seconds, and (children) the CPU seconds of each step."""
    if args.in_process:  # the subcommand's own main: `megatron-gtpo train` ends its process when done
        import importlib

        from megatron_gtpo.cli import SUBCOMMANDS, quiet_warnings

        quiet_warnings()
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        code = int(importlib.import_module(SUBCOMMANDS[argv[0]][0]).main(list(argv[1:])) or 0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {"code": code, "wall_s": time.perf_counter() - start, "cpu_per_step": {},
                "cpu_s": after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime}
    journal = run_dir / "tracking" / "journal.jsonl" if run_dir is not None else None
    steps_of = (lambda: journal_steps(journal) if journal.exists() else []) if journal else (lambda: [])
    got = run_child([sys.executable, "-m", "megatron_gtpo.cli", *argv], env=child_env(args.threads),
                    log_path=log_path, timeout_s=args.timeout_s, steps_of=steps_of)
    per_step = {s["step"]: round(s["cpu_s"], 2) for s in with_cpu(steps_of(), got.cpu_at_step) if "cpu_s" in s}
    return {"code": got.code, "wall_s": got.wall_s, "cpu_s": got.cpu_s, "cpu_per_step": per_step}


def evaluate_model(model: str, *, study, data, out: Path, args, hf_config: str = "", mlflow=None,
                   reuse: Path | None = None) -> dict:
    """``megatron-gtpo eval`` of ``model`` on the held-out prompts; its pass@k (or the failure).
    ``reuse``: an earlier invocation's directory holding the same evaluation, copied instead."""
    if reuse is not None:
        for suffix in (".json", ".samples.jsonl"):
            shutil.copyfile((reuse / out.name).with_suffix(suffix), out.with_suffix(suffix))
        return {"pass": pass_at_k(out.with_suffix(".json")), "wall_s": 0.0, "cpu_s": 0.0, "reused": str(reuse)}
    got = launch(eval_argv(model=model, hf_config=hf_config, study=study, data=data, output=out.with_suffix(".json"),
                           shared_rollout=study.shared["rollout"], mlflow=mlflow),
                 log_path=out.with_suffix(".log"), args=args)
    if got["code"] != 0:
        return {"error": failure("eval", got["code"], out.with_suffix(".log")), "wall_s": round(got["wall_s"], 1)}
    return {"pass": pass_at_k(out.with_suffix(".json")), "wall_s": round(got["wall_s"], 1),
            "cpu_s": round(got["cpu_s"], 1)}


def base_eval(study, data, out: Path, args) -> dict:
    """The base model on the held-out prompts, shared by every algorithm: greedy accuracy (as the
    trainer's periodic eval) and, with ``eval.n``, pass@k."""
    import dataclasses

    from megatron_gtpo.models.smollm2 import ensure_smollm2

    model = str(ensure_smollm2())
    reuse = Path(args.reuse_base) if args.reuse_base else None
    greedy_study = dataclasses.replace(study, eval=dataclasses.replace(study.eval, n=1, k=(1,), temperature=0.0))
    got = {"greedy": evaluate_model(model, study=greedy_study, data=data, out=out / "base_greedy", args=args,
                                    reuse=reuse)}
    if study.eval.n:
        got["pass"] = evaluate_model(model, study=study, data=data, out=out / "base_pass", args=args, reuse=reuse)
    return {"greedy": (got["greedy"].get("pass") or {}).get("pass@1"), "pass": (got.get("pass") or {}).get("pass"),
            "errors": [e["error"] for e in got.values() if "error" in e],
            "wall_s": round(sum(e["wall_s"] for e in got.values()), 1),
            "cpu_s": round(sum(e.get("cpu_s") or 0 for e in got.values()), 1)}


def train_and_eval(study, data, algo: str, seed: int, out: Path, args) -> dict:
    """One run: train, summarise from MLflow, pass@k of the last checkpoint."""
    run_dir = out / f"{algo}-s{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    recipe = write_recipe(study, algo, data, seed=seed, run_dir=run_dir)
    argv = train_argv(recipe, run_dir)
    row: dict = {"algo": algo, "seed": seed, "command": "megatron-gtpo " + " ".join(argv),
                 "load1_start": round(os.getloadavg()[0], 1)}
    got = launch(argv, log_path=out / f"{algo}-s{seed}.log", args=args, run_dir=run_dir)
    cpu_steps = sorted(got["cpu_per_step"].values())
    row.update(wall_s=round(got["wall_s"], 1), cpu_s=round(got["cpu_s"], 1),
               cpu_s_per_step_median=cpu_steps[len(cpu_steps) // 2] if cpu_steps else None)
    if got["code"] != 0:
        return {**row, "status": "failed", "error": failure("train", got["code"], out / f"{algo}-s{seed}.log")}
    row.update(status="ok", **summarise_run(run_dir, steps=study.steps))
    if study.eval.n and data.held_out_root is not None:
        from megatron_gtpo.models.smollm2 import ensure_smollm2

        ckpt = run_dir / "checkpoints" / f"step_{study.steps:08d}"
        uri = f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        after = evaluate_model(str(ckpt), study=study, data=data, out=run_dir / "held_out_pass", args=args,
                               hf_config=str(ensure_smollm2()),
                               mlflow=(uri, (run_dir / "run_id").read_text().strip(), study.steps))
        row.update(pass_after=after.get("pass"), eval_wall_s=after["wall_s"], eval_cpu_s=after.get("cpu_s"))
        if "error" in after:
            row["eval_error"] = after["error"]
    if not args.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    row["load1_end"] = round(os.getloadavg()[0], 1)
    return row


class LoadSampler:
    """The 1-minute load average every ``every_s`` seconds while the study runs."""

    def __init__(self, every_s: float = 15.0):
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(every_s,), daemon=True)
        self._thread.start()

    def _watch(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(os.getloadavg()[0])

    def stop(self) -> dict:
        self._stop.set()
        s = self.samples
        return {"min": round(min(s), 1), "mean": round(sum(s) / len(s), 1), "max": round(max(s), 1), "samples": len(s)}


def summarise_existing(study, out: Path) -> dict:
    """``--summarise-only``: the summary of the runs an earlier (stopped) invocation left in ``out``,
    read from their MLflow stores and eval reports; runs that never finished are listed, not guessed."""
    from megatron_gtpo.plotting import plot_runs

    runs, missing = [], []
    for seed in study.seeds:
        for algo in study.algorithms:
            run_dir = out / f"{algo}-s{seed}"
            evaluated = not study.eval.n or (run_dir / "held_out_pass.json").is_file()
            if not (run_dir / "run_id").is_file() or not evaluated:
                missing.append(f"{algo}-s{seed}")
                continue
            row = {"algo": algo, "seed": seed, "status": "ok", **summarise_run(run_dir, steps=study.steps),
                   "pass_after": pass_at_k(run_dir / "held_out_pass.json")}
            runs.append(row)
    greedy = pass_at_k(out / "base_greedy.json") or {}
    base = {"greedy": greedy.get("pass@1"), "pass": pass_at_k(out / "base_pass.json")}
    for run in runs:
        run["pass_before"] = base["pass"]
    dirs = {a: [str(out / f"{a}-s{r['seed']}") for r in runs if r["algo"] == a] for a in study.algorithms}
    figures = [str(plot_runs([f"{a}={','.join(d)}" for a, d in dirs.items() if d], out / "curves.png",
                             panels="study", smooth=max(1, min(5, study.steps // 8))))] if runs else []
    summary = {"algorithms": aggregate(runs), "base": base}
    if runs:
        figures.append(str(plot_held_out(summary, out / "held_out.png")))
    return {**summary, "runs": runs, "not_run": missing, "figures": figures}


def run_study(study, args, out: Path) -> dict:
    """Data, the base evaluation, every run (``--jobs`` at a time), summaries and plots."""
    from megatron_gtpo.plotting import plot_runs

    data = prepare_data(study, out)
    started, load, usage = time.perf_counter(), LoadSampler(), resource.getrusage(resource.RUSAGE_CHILDREN)
    base = base_eval(study, data, out, args) if data.held_out_root is not None else None
    tasks = [(algo, seed) for seed in study.seeds for algo in study.algorithms]
    one = lambda task: train_and_eval(study, data, task[0], task[1], out, args)  # noqa: E731
    if args.in_process or args.jobs == 1:  # the trainer installs signal handlers: main thread only
        runs = [one(task) for task in tasks]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            runs = list(pool.map(one, tasks))
    for run in runs:
        if base:
            run["pass_before"] = base["pass"]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    ok = [r for r in runs if r["status"] == "ok"]
    figures = []
    if ok:
        dirs = {a: [str(out / f"{a}-s{r['seed']}") for r in ok if r["algo"] == a] for a in study.algorithms}
        groups = [f"{a}={','.join(d)}" for a, d in dirs.items() if d]
        smooth = max(1, min(5, study.steps // 8))  # trailing mean: a step's 8-16 samples are noisy
        figures.append(str(plot_runs(groups, out / "curves.png", panels="study", smooth=smooth)))
    summary = {"algorithms": aggregate(runs), "base": base}
    if base and ok:
        figures.append(str(plot_held_out(summary, out / "held_out.png")))
    compute = {"wall_s": round(time.perf_counter() - started, 1), "load1": load.stop(), "cores": os.cpu_count(),
               "jobs": 1 if args.in_process else args.jobs, "threads_per_run": args.threads,
               "cpu_s_children": round(children.ru_utime + children.ru_stime - usage.ru_utime - usage.ru_stime, 1),
               "cpu_s_runs": round(sum(r.get("cpu_s", 0) + (r.get("eval_cpu_s") or 0) for r in runs), 1),
               "cpu_s_base_eval": base["cpu_s"] if base else 0.0}
    return {**summary, "runs": runs, "compute": compute, "figures": figures,
            "data": {"held_out_prompts": data.held_out_count, "held_out_overlap_removed": data.overlap_removed}}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.in_process = True
    if args.in_process:  # what children get, set before torch loads (OpenMP reads it once)
        os.environ.update(child_env(args.threads))
    try:
        study = load_study(args.study or (QUICK_STUDY if args.quick else DEFAULT_STUDY))
        study = with_sizes(study, steps=args.steps, seeds=tuple(int(s) for s in args.seeds.split(",") if s.strip()),
                           algorithms=tuple(a.strip() for a in args.algos.split(",") if a.strip()))
    except (ValueError, OSError) as err:
        print(f"bench/learning.py: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="learning_")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"steps": study.steps, "seeds": list(study.seeds), "algorithms": list(study.algorithms),
             "prompts_per_step": study.shared["train"]["prompts_per_step"], "G": study.shared["rollout"]["n"],
             "max_tokens": study.shared["rollout"]["max_tokens"]}
    print(json.dumps({"bench": "learning", "study": str(study.path), "sizes": sizes, "out": str(out)}), flush=True)
    result = summarise_existing(study, out) if args.summarise_only else run_study(study, args, out)
    line = {"bench": "learning", "study": study.name, "mode": "quick" if args.quick else "full",
            "command": " ".join(["bench/learning.py", *(argv if argv is not None else sys.argv[1:])]), "sizes": sizes,
            "out": str(out), **result}
    failed = [f"{r['algo']}-s{r['seed']}" for r in result["runs"] if r["status"] != "ok"]
    if args.summarise_only:
        line["mode"] = "summarise-only"
    if args.quick:
        line["quick_check"] = quick_verdict(result["runs"], args.margin)
    (out / "summary.json").write_text(json.dumps(line, indent=1) + "\n")
    print(json.dumps(line), flush=True)
    if failed:
        print(f"bench/learning.py: runs failed: {', '.join(failed)} (logs in {out})", file=sys.stderr)
        return 1
    return 0 if not args.quick or line["quick_check"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
