"""GPU smoke test: one GTPO train step of a ~1B Llama-shaped policy in three builds, same process.

    python bench/gpu_smoke.py [--layers 16] [--hidden 2048] [--seq 1024] [--rows 16] [--steps 3]
    python bench/gpu_smoke.py --dry-run-cpu     # tiny local-spec fp32 model on CPU (checks the script)

Builds (all through ``train/model.py`` + ``train/step.py``, Megatron DDP + Adam, the fused
vocab-parallel GTPO loss, a synthetic global batch of ``rows`` sequences in groups of 4):

1. ``local-bf16``: Megatron's pure-PyTorch local layer spec, bf16;
2. ``te-bf16``:    the Transformer Engine layer spec, bf16;
3. ``te-fp8``:     the TE spec with FP8 (``fp8="hybrid"``, recipe ``--fp8-recipe``), needs Hopper (sm90+).

Prints, per build, tokens/s (sequence tokens of the batch, including GTPO's no-grad entropy
pass, over the median step time after one warm-up step), peak GPU memory and the loss, then one
JSON line with all of them; speed and memory are also given relative to ``local-bf16``.
Exits 0 with a ``SKIP:`` line when CUDA or Transformer Engine is
missing (FP8 alone is skipped below sm90). Not part of the CPU test suite.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def hf_config(args) -> dict:
    """A Llama-shaped config (GQA 4:1, SwiGLU, untied) sized by the command line."""
    heads = max(args.hidden // 128, 1)
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": args.hidden, "intermediate_size": 4 * args.hidden,
            "num_hidden_layers": args.layers, "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1),
            "vocab_size": args.vocab, "max_position_embeddings": args.seq, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": False}


def synthetic_batch(args, device):
    """``rows`` sequences (prompt + completion, right-padded), groups of 4, rewards 0/1."""
    from megatron_gtpo.types import TrainBatch

    g = torch.Generator().manual_seed(0)
    seq, prompt = args.seq, args.seq // 8
    ids = torch.randint(3, args.vocab, (args.rows, seq), generator=g)
    lengths = torch.randint(seq // 4, seq - prompt + 1, (args.rows,), generator=g)
    cols = torch.arange(seq)
    mask = ((cols >= prompt) & (cols < (prompt + lengths)[:, None])).float()
    ids = torch.where(cols < (prompt + lengths)[:, None], ids, torch.zeros_like(ids))
    group_ids = torch.arange(args.rows) // 4
    rewards = torch.randint(0, 2, (args.rows,), generator=g).float()
    return TrainBatch(input_ids=ids, loss_mask=mask, position_ids=cols.expand(args.rows, seq).clone(),
                      group_ids=group_ids, rewards=rewards, advantages=torch.zeros(args.rows),
                      sampler_logprobs=torch.where(mask > 0, -1.0, 0.0), pad_id=0,
                      completion_start=torch.full((args.rows,), prompt))


def run_build(name: str, args, dims, *, use_te: bool, dtype, overrides: dict | None) -> dict:
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
    from megatron_gtpo.train.step import train_on_batch

    on_gpu = torch.cuda.is_available()
    gc.collect()  # the previous build's DDP hooks form reference cycles
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated() if on_gpu else 0
    chunks = wrap_ddp(M.build_model(hf_config(args), dims=dims, dtype=dtype, overrides=overrides, use_te=use_te),
                      OptimConfig())
    optimizer, scheduler = build_optimizer(chunks, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-6}),
                                           total_steps=args.steps + 1)
    algo_cfg = AlgoConfig(name="gtpo", entropy_threshold=777.0)  # keep every completion in the loss
    batch = synthetic_batch(args, None)
    times, metrics = [], {}
    for step in range(args.steps + 1):  # step 0 warms up (kernels, FP8 scales, allocator)
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = train_on_batch(chunks, optimizer, scheduler, batch, algo_name="gtpo",
                                 prepare_kwargs=algo_cfg.prepare_kwargs(),
                                 loss_kwargs=algo_cfg.loss_kwargs(max_completion_tokens=args.seq),
                                 micro_batch_size=args.micro_batch, mu=1, temperature=1.0, dims=dims,
                                 pad_to_multiple=64 if on_gpu else 1)
        if on_gpu:
            torch.cuda.synchronize()
        if step > 0:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    out = {"build": name, "tokens_per_s": round(batch.input_ids.numel() / seconds, 1),
           "step_s": round(seconds, 4), "loss": metrics["loss"], "grad_norm": metrics["optim/grad_norm"],
           "peak_mem_gib": round((torch.cuda.max_memory_allocated() - start_bytes) / 2**30, 2) if on_gpu else None}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fp8-recipe", default="delayed", choices=["delayed", "tensorwise", "mxfp8", "blockwise"])
    parser.add_argument("--dry-run-cpu", action="store_true", help="tiny local-spec fp32 run on CPU")
    args = parser.parse_args()

    from megatron_gtpo.parallel.dims import init_distributed

    if args.dry_run_cpu:
        args.layers, args.hidden, args.vocab, args.seq, args.rows, args.micro_batch = 2, 128, 256, 64, 8, 4
        dims = init_distributed(tp=1, pp=1, seed=0)
        result = run_build("local-fp32-cpu", args, dims, use_te=False, dtype=torch.float32, overrides=None)
        print(json.dumps({"dry_run_cpu": True, "builds": [result]}), flush=True)
        return 0
    if not torch.cuda.is_available():
        print("SKIP: CUDA is not available; bench/gpu_smoke.py needs an NVIDIA GPU (try --dry-run-cpu)")
        return 0
    try:
        import transformer_engine  # noqa: F401
    except ImportError as err:
        print(f"SKIP: Transformer Engine is not installed ({err}); pip install transformer-engine[pytorch]")
        return 0
    dims = init_distributed(tp=1, pp=1, seed=0)
    builds = [("local-bf16", False, None), ("te-bf16", True, None)]
    major, minor = torch.cuda.get_device_capability()
    if major >= 9:
        builds.append(("te-fp8", True, {"fp8": "hybrid", "fp8_recipe": args.fp8_recipe,
                                        "fp8_amax_history_len": 16, "fp8_amax_compute_algo": "max"}))
    else:
        print(f"SKIP te-fp8: compute capability {major}.{minor} < 9.0 (FP8 needs Hopper or newer)")
    results = []
    for name, use_te, overrides in builds:
        r = run_build(name, args, dims, use_te=use_te, dtype=torch.bfloat16, overrides=overrides)
        base = results[0] if results else r  # ratios against the local bf16 build
        r["speedup_vs_local_bf16"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
        r["mem_vs_local_bf16"] = round(r["peak_mem_gib"] / max(base["peak_mem_gib"], 1e-9), 3)
        print(f"{r['build']:>10}: {r['tokens_per_s']:>10.0f} tok/s (x{r['speedup_vs_local_bf16']})  "
              f"step {r['step_s']:.3f}s  peak {r['peak_mem_gib']} GiB (x{r['mem_vs_local_bf16']})  "
              f"loss {r['loss']:.6f}", flush=True)
        results.append(r)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "hf_config": hf_config(args), "builds": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
