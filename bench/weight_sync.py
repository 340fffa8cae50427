"""Weight-sync bandwidth and memory: a SmolLM2-135M-shaped model pushed from Megatron into vLLM, per placement.

The model is SmolLM2-135M's config (30 layers, hidden 576, head_dim 64, tied 49152-token vocabulary)
with 8 query / 2 KV heads instead of 9 / 3, so that TP=2 divides them, random weights and SmolLM2's
tokenizer (built once, cached): every mode pushes the same 128 M parameters.

    modes:  colocated      engine TP=1 in the trainer process (trainer TP=1)
            colocated_tp2  one engine of TP=2 over 2 trainer ranks (trainer TP=2, torchrun), shard-local
            pool1, pool2   a separate pool of 1 / 2 rollout servers (local processes) fed by the trainer
    each:   the trainer (SmolLM2 + a simulated update) pushes through the real WeightSync ``repeats``
            times (streamed exporter, planned check, transport, vLLM reload); baseline: a plain copy
            of the same bytes into preallocated tensors, in the same process and run

Reported per mode: the fastest push in seconds, GB/s (bytes one engine rank receives, model dtype),
the ratio to the plain copy's GB/s (also the fastest: on a shared machine the minimum is the stable
statistic), where the time goes (the push's phases; for colocated also the export alone, so the rest
is vLLM's reload), peak extra memory of the push on the trainer rank (``PeakMemory``: peak RSS above
the start on CPU, which for colocated includes vLLM's reload allocations), the trainer's model size,
and max |log-prob(engine) - log-prob(trainer)| over sampled tokens after the push (before it: shows
the push changed what the engines serve). Ends with one JSON line per mode.

    python bench/weight_sync.py [--dtype bf16|fp32] [--repeats 3] [--bucket-mb 64]
                                [--modes colocated,colocated_tp2,pool1,pool2] [--threads 1]
    python bench/weight_sync.py --quick              # the tiny model, colocated and pool1 (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

QUESTIONS = ["What is 12 + 30?", "Name three colors.", "Write one sentence about the sea.", "What is a prime number?"]
TEMPERATURE, MAX_TOKENS, PAD = 1.0, 32, 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # this checkout
from bench.quick import parse_quick  # noqa: E402

QUICK = {"model": "tiny", "dtype": "fp32", "repeats": 1, "modes": "colocated,pool1", "bucket_mb": 4}
"""The tiny model through one colocated and one pool push (colocated_tp2 runs the same ``bench_mode``
on two torchrun ranks: left out to keep the suite short)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="trainer and engine dtype")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per mode and plain copies (fastest kept)")
    parser.add_argument("--modes", default="colocated,colocated_tp2,pool1,pool2", help="comma-separated modes")
    parser.add_argument("--bucket-mb", type=int, default=64, help="sync.bucket_mb: bucket size in MiB")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads per process (1, like the tests: on a shared 2-core machine every "
                             "2-thread region waits for the busy other core)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a torchrun rank of colocated_tp2
    parser.add_argument("--model", choices=["smollm2-shape", "tiny"], default="smollm2-shape",
                        help="the pushed model: SmolLM2-135M's shape (the figures) or the tests' tiny Qwen2")
    return parse_quick(parser, argv, QUICK)


def ensure_bench_model() -> str:
    """SmolLM2-135M's shape with 8 / 2 heads (see the module docstring), saved once next to SmolLM2."""
    import shutil

    import transformers

    from megatron_gtpo.models.smollm2 import default_cache_dir, ensure_smollm2

    out = default_cache_dir() / "bench-smollm2-shape-h8kv2"
    if (out / "model.safetensors").is_file():
        return str(out)
    source = ensure_smollm2()
    config = transformers.AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads = 8, 2
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".tmp")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return str(out)


def vllm_kwargs(dtype: str, tp: int = 1) -> dict:
    return {"dtype": {"bf16": "bfloat16", "fp32": "float32"}[dtype], "max_model_len": 512,
            "kv_cache_memory_bytes": 256 << 20, "tensor_parallel_size": tp}


def build_trainer(model_dir: str, dtype: torch.dtype, tp: int):
    """SmolLM2 in Megatron, with a small deterministic perturbation standing in for an optimizer
    step, so the push changes what the engine (started from the checkpoint) serves."""
    from megatron_gtpo.convert.load import load_hf_weights
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train.model import build_model

    dims = init_distributed(tp=tp, seed=1234)
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=dtype)
    load_hf_weights(chunks, hf_dir=model_dir, hf_config=hf_config, dims=dims)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02 * p.float().std())
    return dims, chunks, hf_config


def plain_copy(sources: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """Fastest seconds to copy ``sources`` into preallocated, already-touched tensors."""
    targets = [torch.empty_like(t) for t in sources]
    walls = []
    for _ in range(repeats + 1):  # the first pass faults the target pages in; not timed
        wall = time.perf_counter()
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        walls.append(time.perf_counter() - wall)
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    return {"seconds": min(walls[1:]), "bytes": nbytes, "gb_per_s": nbytes / min(walls[1:]) / 1e9}


def copy_baseline(exporter, mode: str, repeats: int) -> dict[str, float]:
    """The plain copy of exactly the bytes one engine rank receives in ``mode``."""
    sources = [t.clone() for _, t in exporter.tensors("full" if mode == "senders" else mode)]
    return plain_copy(sources, repeats)


def logprob_diff(engines, chunks, dims, hf_config: dict) -> dict[str, float]:
    """Max |engine - trainer| log-prob of tokens the engines sample now (temperature 1)."""
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.train.batching import collate
    from megatron_gtpo.train.step import (StepSettings, forward_stats, logprob_settings, process_groups,
                                          rank_micro_batches)
    from megatron_gtpo.types import Prompt, ScoredGroup

    tok = engines.tokenizer
    prompts = []
    for i, q in enumerate(QUESTIONS):
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append(Prompt(uid=str(i), token_ids=list(tok(text, add_special_tokens=False)["input_ids"])))
    completions = engines.generate(prompts, Sampling(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS), seed=1)
    groups = [ScoredGroup(prompt=p, completions=[c for c in completions if c.prompt_index == i], rewards=[0.0, 0.0])
              for i, p in enumerate(prompts)]
    batch = collate(groups, pad_id=PAD)
    settings = StepSettings(spec=AlgoConfig().resolve(max_completion_tokens=MAX_TOKENS), micro_batch_size=batch.size,
                            temperature=TEMPERATURE, vocab_size=int(hf_config["vocab_size"]))
    rows, mbs = rank_micro_batches(batch, settings, dims)
    trainer = forward_stats(chunks, batch, mbs, logprob_settings(settings, dims, process_groups(), chunks)).logp
    diff = (batch.sampler_logprobs[rows].double() - trainer.double())[batch.mask[rows]].abs()
    return {"max": diff.max().item(), "mean": diff.mean().item()}


def timed_pushes(syncer, exporter, repeats: int) -> tuple[list, int]:
    """Stats of each push and the largest peak extra memory over them."""
    from megatron_gtpo.utils.memory import PeakMemory

    stats, peak = [], 0
    for version in range(1, repeats + 1):
        with PeakMemory() as memory:
            stats.append(syncer.push(exporter, version=version))
        peak = max(peak, memory.extra_bytes)
    return stats, peak


def export_only(exporter, mode: str, repeats: int) -> float:
    """Fastest seconds of the exporter's stream alone (a consumer that keeps nothing)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for item in exporter.tensors(mode):
            del item
        best = min(best, time.perf_counter() - start)
    return best


def bench_mode(mode: str, args, *, model_dir: str, trainer) -> dict:
    """One mode in this process (colocated with engine TP = trainer TP, or a pool of servers)."""
    from megatron_gtpo.rollout import RolloutConfig
    from megatron_gtpo.rollout.placement import build_engines
    from megatron_gtpo.sync import ExportPlan, SyncConfig
    from megatron_gtpo.sync.build import build_weight_sync
    from megatron_gtpo.sync.export import Exporter

    dims, chunks, hf_config = trainer
    servers = int(mode[4:]) if mode.startswith("pool") else 0
    tp = dims.tp
    sync_cfg = SyncConfig(transport="separate" if servers else "colocated", bucket_mb=args.bucket_mb,
                          local_servers=max(servers, 1), timeout_s=1200)
    start = time.perf_counter()
    engines = build_engines(RolloutConfig(seed=0, vllm=vllm_kwargs(args.dtype, tp)), sync_cfg.placement(),
                            model_dir=model_dir)
    syncer = build_weight_sync(sync_cfg, ExportPlan(hf_config=hf_config, dims=dims, bucket_bytes=sync_cfg.bucket_size),
                               engines.engine)
    startup = time.perf_counter() - start
    exporter = Exporter(chunks, hf_config=hf_config, dims=dims)
    copy = copy_baseline(exporter, syncer.mode, args.repeats)
    before = logprob_diff(engines, chunks, dims, hf_config)
    stats, peak = timed_pushes(syncer, exporter, args.repeats)
    best = min(stats, key=lambda s: s.seconds)
    export_s = export_only(exporter, syncer.mode, args.repeats) if not servers else None
    after = logprob_diff(engines, chunks, dims, hf_config)
    model = sum(p.numel() * p.element_size() for p in chunks[0].parameters())
    engines.close()
    syncer.close()
    gbps = best.num_bytes / best.seconds / 1e9
    transfer = best.phases.get("transfer")
    return {"mode": mode, "transport": sync_cfg.transport, "servers": servers, "engine_tp": tp, "trainer_tp": tp,
            "delivery": syncer.mode, "seconds": round(best.seconds, 4), "gb_per_s": round(gbps, 3),
            "ratio_vs_copy": round(gbps / copy["gb_per_s"], 3), "copy_gb_per_s": round(copy["gb_per_s"], 3),
            "phases": {k: round(v, 4) for k, v in best.phases.items()},
            "transfer_ratio_vs_copy": round(best.num_bytes / transfer / 1e9 / copy["gb_per_s"], 3) if transfer else None,
            "gb_per_s_all_servers": round(gbps * max(servers, 1), 3),
            "export_only_seconds": None if export_s is None else round(export_s, 4),
            "peak_extra_mb": round(peak / 2**20, 1), "model_mb": round(model / 2**20, 1),
            "bucket_mb": args.bucket_mb, "gigabytes": round(best.num_bytes / 1e9, 4), "tensors": best.num_tensors,
            "push_seconds_all": [round(s.seconds, 4) for s in stats],
            "max_abs_logprob_diff": after["max"], "mean_abs_logprob_diff": after["mean"],
            "max_abs_logprob_diff_before_push": before["max"],
            "engine_startup_seconds": round(startup, 1), "dtype": args.dtype}


def ensure_tiny() -> str:
    from megatron_gtpo.models.tiny import ensure_tiny as build

    return str(build())


def run_tp2(args) -> dict:
    """colocated_tp2 as a 2-rank torchrun of this script; rank 0's row."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__, "--worker", "colocated_tp2",
           "--dtype", args.dtype, "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
           "--threads", str(args.threads), "--model", args.model]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=3000)
    rows = sorted((json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")),
                  key=lambda r: r["rank"])
    if proc.returncode or len(rows) != 2:
        raise RuntimeError(f"colocated_tp2 failed rc={proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    return {**rows[0], "peak_extra_mb_per_rank": [r["peak_extra_mb"] for r in rows],
            "model_mb_per_rank": [r["model_mb"] for r in rows]}


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers and the torchrun ranks
    torch.set_num_threads(args.threads)
    model_dir = ensure_bench_model() if args.model == "smollm2-shape" else str(ensure_tiny())
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.worker == "colocated_tp2":
        row = bench_mode("colocated", args, model_dir=model_dir, trainer=build_trainer(model_dir, dtype, tp=2))
        print("ROW " + json.dumps({**row, "mode": "colocated_tp2", "rank": int(os.environ["RANK"])}), flush=True)
        return
    modes = args.modes.split(",")
    trainer = build_trainer(model_dir, dtype, tp=1) if set(modes) - {"colocated_tp2"} else None
    rows = []
    for mode in modes:
        row = run_tp2(args) if mode == "colocated_tp2" else bench_mode(mode, args, model_dir=model_dir, trainer=trainer)
        rows.append({"peak_extra_mb_per_rank": [row["peak_extra_mb"]], "model_mb_per_rank": [row["model_mb"]], **row})
        print(f"{mode}: {rows[-1]}", flush=True)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":  # the rollout servers and the torchrun ranks are separate processes
    main()
