"""Peak memory of a real (short) training run against the memory plan's accounted parts, per rank.

Runs the driver (``megatron_gtpo.trainer.run``) on a recipe, phase by phase metered on every rank:
peak resident set (``VmHWM``) on CPU, peak allocated tensors (``torch.cuda.max_memory_allocated``)
on GPU; then asks the memory plan the dry-run uses (``megatron_gtpo/plan/memory.py``) what the same
run should hold (weights, gradients, optimizer, reference model, KV cache, engine weights, logits,
activations, push buffers, the process baseline) and prints one JSON line per rank::

    {"rank": 0, "peak_over_accounted": 1.21, "peak": ..., "accounted": ..., "terms": {...},
     "phases": {"rollout": {"peak": ..., "accounted": ...}, "train": ..., "push": ..., ...}, ...}

Phases: ``startup`` (imports up to the first part of the run: the measured ``baseline``), ``build``
(policy, reference, engines, data, reward pool, the first push), ``rollout`` (generate + score),
``train`` (the learner's step), ``push`` (the weight sync), ``checkpoint`` and ``other`` (collate,
tracking, between the phases). The plan is asked with the sizes the run actually had (the longest
sequence of a micro-batch, the layout) rather than the recipe's worst case. The reward pool's and
other child processes' peaks are reported separately (``children_peak``): they are processes of
their own, not part of a rank's memory.

    python bench/memory.py --quick                       # tiny model, 1 rank (about a minute on CPU)
    python bench/memory.py                               # SmolLM2-135M GRPO 8 x 8 x 128 fp32, 1 GiB KV
    python bench/memory.py -- train.micro_batch_tokens=0 # the same, padded micro-batches of 8 rows
    python bench/memory.py --ranks 2 --prompts 2         # 2 ranks (DP=2) via torchrun
    python bench/memory.py --prompts 2 -- train.micro_batch_size=4   # any recipe override after --
    python bench/memory.py --cp                          # CP rows: one long sequence at CP=2 vs CP=1
    python bench/memory.py --cp --quick                  # the same at 256 tokens (the suite's smoke run)

``--cp`` measures instead what one rank holds of a long sequence's step (activations, logits, the
fused pass) and its time per token at CP=2 against CP=1 in the same run, next to the plan's
per-CP-rank figures (bench/memory_cp.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "MLFLOW_DISABLE_TELEMETRY": "true",
       "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false"}
BASELINE_IMPORTS = ("megatron.core", "vllm.entrypoints.llm", "mlflow", "transformers")
"""What a rank imports before it builds anything, measured as the ``baseline`` term (``import vllm``
alone is lazy: its engine modules, +300 MB on CPU, load with ``vllm.LLM``)."""


def build_parser() -> argparse.ArgumentParser:
    intro, rest = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="bench/memory.py", description=intro, epilog=rest,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="tiny-char model (configs/tiny.yaml at TP=1): seconds per step instead of minutes; "
                             "with --cp: a 256-token sequence, one round")
    parser.add_argument("--recipe", default=None, help="recipe YAML (default: configs/grpo.yaml, --quick: tiny.yaml)")
    parser.add_argument("--model", default=None, help="model.path (default: the recipe's; smollm2 for grpo.yaml)")
    parser.add_argument("--prompts", type=int, default=None, help="train.prompts_per_step (default 8, --quick 2)")
    parser.add_argument("--n", type=int, default=None, help="rollout.n: completions per prompt (default 8, --quick 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="rollout.max_tokens (default 128, --quick 24)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="train.micro_batch_size (default 8): rows of a padded micro-batch "
                        "(train.micro_batch_tokens=0); packing, the default, ignores it")
    parser.add_argument("--max-prompt-tokens", type=int, default=None, help="data.max_prompt_tokens (default 256)")
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="rollout.vllm.kv_cache_memory_bytes in GiB (default 1, --quick 1/16)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="model.dtype and rollout.vllm.dtype")
    parser.add_argument("--steps", type=int, default=2, help="training steps (2: the second shows what a step keeps)")
    parser.add_argument("--ranks", type=int, default=1, help="trainer ranks (DP); > 1 starts torchrun")
    parser.add_argument("--threads", type=int, default=1, help="OMP/torch threads per rank")
    parser.add_argument("--out", default=None, help="run directory (default: a temporary one, deleted)")
    parser.add_argument("--cp", action="store_true", help="CP rows (bench/memory_cp.py) instead of a training run")
    parser.add_argument("--cp-tokens", type=int, default=None, help="--cp: tokens of the sequence (default 4096, --quick 256)")
    parser.add_argument("--cp-reps", type=int, default=None, help="--cp: timed rounds, the minimum counts (default 3, --quick 1)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a rank: the directory for its JSON
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="more recipe overrides (after --)")
    return parser


def recipe_and_overrides(args: argparse.Namespace, out: str) -> tuple[str, list[str]]:
    """The recipe and the overrides of the benchmarked run (the arguments, then the defaults)."""
    def pick(value, default, quick):
        return value if value is not None else (quick if args.quick else default)

    recipe = args.recipe or str(REPO / "configs" / ("tiny.yaml" if args.quick else "grpo.yaml"))
    kv = int(pick(args.kv_gib, 1.0, 1 / 16) * (1 << 30))
    max_tokens, prompt_tokens = pick(args.max_tokens, 128, 24), pick(args.max_prompt_tokens, 256, 256)
    overrides = [
        f"output_dir={out}", f"train.steps={args.steps}", f"train.prompts_per_step={pick(args.prompts, 8, 2)}",
        f"rollout.n={pick(args.n, 8, 4)}", f"rollout.max_tokens={max_tokens}",
        f"train.micro_batch_size={pick(args.micro_batch_size, 8, 4)}", f"data.max_prompt_tokens={prompt_tokens}",
        f"model.dtype={args.dtype}", f"rollout.vllm.dtype={args.dtype}", f"rollout.vllm.kv_cache_memory_bytes={kv}",
        f"rollout.vllm.max_model_len={prompt_tokens + max_tokens}", "parallel.tp=1", "parallel.pp=1",
        f"parallel.dp={args.ranks}", f"train.checkpoint_every={args.steps}", "train.keep_last=1",
    ]
    if args.model:
        overrides.append(f"model.path={args.model}")
    return recipe, overrides + list(args.overrides)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.cp_tokens = args.cp_tokens or (256 if args.quick else 4096)
    args.cp_reps = args.cp_reps or (1 if args.quick else 3)
    if args.cp:
        return cp_rows(args, argv if argv is not None else sys.argv[1:])
    if args.worker:
        return worker(args)
    os.environ.update(ENV)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp:
        out = args.out or os.path.join(tmp, "run")
        rows_dir = os.path.join(tmp, "rows")
        os.makedirs(rows_dir)
        argv = argv if argv is not None else sys.argv[1:]
        script = [str(Path(__file__).resolve()), *worker_args(argv, rows_dir, out)]
        if args.ranks == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.ranks}",
                   "--master_port", str(_free_port()), *script]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run(cmd, env=env, cwd=REPO)
        rows = [json.loads(p.read_text()) for p in sorted(Path(rows_dir).glob("rank*.json"))]
    for row in rows:
        print(json.dumps(row), flush=True)
    if proc.returncode != 0 or len(rows) != args.ranks:
        print(f"bench/memory.py: the run failed (rc={proc.returncode}, {len(rows)} of {args.ranks} rank rows)",
              file=sys.stderr)
        return 1
    return 0


def worker_args(argv: list[str], rows_dir: str, out: str) -> list[str]:
    """A rank's arguments: ``--worker`` and ``--out`` first, so that overrides after ``--`` (which
    take every later word as an override) cannot swallow them (a rank without ``--worker`` would
    start ranks of its own)."""
    return ["--worker", rows_dir, "--out", out, *argv]


def worker(args: argparse.Namespace) -> int:
    """One rank: meter the run, then write its row (``rank<r>.json`` in ``args.worker``)."""
    import torch

    torch.set_num_threads(args.threads)
    from bench.memory_meter import Meter, instrument, instrument_build, rank_row

    meter = Meter()
    from megatron_gtpo import trainer
    from megatron_gtpo.config import load_config

    for module in BASELINE_IMPORTS + (("vllm.v1.worker.gpu_worker",) if torch.cuda.is_available() else
                                      ("vllm.v1.worker.cpu_worker",)):
        importlib.import_module(module)
    recipe, overrides = recipe_and_overrides(args, args.out)
    cfg = load_config(recipe, overrides)
    meter.mark_baseline()
    build = trainer.build

    def metered_build(cfg, **kwargs):
        meter.switch("build")
        with instrument_build(meter, trainer):
            parts = instrument(meter, build(cfg, **kwargs))
        meter.switch("other")
        return parts

    trainer.build = metered_build  # run() builds through the module attribute: every part gets metered
    try:
        trainer.run(cfg)
    finally:
        trainer.build = build
    row = rank_row(meter, cfg)
    Path(args.worker, f"rank{row['rank']}.json").write_text(json.dumps(row))
    return 0


def cp_rows(args: argparse.Namespace, argv: list[str]) -> int:
    """``--cp``: on 2 gloo ranks (relaunched with torchrun), bench/memory_cp.py's rows."""
    if "RANK" in os.environ:
        import torch

        torch.set_num_threads(args.threads)
        from bench import memory_cp

        memory_cp.main_rank(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(_free_port()),
           str(Path(__file__).resolve()), *argv]
    env = {**os.environ, **ENV, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, env=env, cwd=REPO).returncode


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
