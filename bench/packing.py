"""Train-phase time of packed micro-batches (``train.micro_batch_tokens``) against padded ones.

A global batch with a long-tail completion-length mix (log-normal, median ~100 tokens, clipped to
16..1024; prompts 32..128 tokens) trains on a small Qwen2-style model (single rank, gloo world of
1, the local Megatron spec: on CPU the packed micro-batch is one row with a block-diagonal causal
mask) once padded (``--micro-batch-size`` rows per micro-batch, each padded to its longest row) and
once packed (``--budget`` tokens per micro-batch), alternating in one process. Every step starts
from the same weights (a parameter snapshot is restored), so the two paths' losses are comparable;
the train phase is ``train_step`` (one-pass GTPO: forward/backward, optimizer step).
Prints one JSON line: medians of the wall time per path, ``packed_vs_padded`` (packed / padded;
goal <= 0.6 on CPU), the same ratio of this process's CPU time (steadier on a shared machine), the tokens each path computes (real + padding) and how far the packed
step's loss and grad norm are from the padded step's.

    .venv/bin/python bench/packing.py [--rows 64] [--budget 1152] [--steps 3]
    .venv/bin/python bench/packing.py --quick        # toy sizes (the suite's smoke run)

Measured on the 2-core CI machine while other jobs loaded it (load average 15-60), defaults (64 rows,
16704 real tokens; padded: 8 micro-batches, 43224 positions; packed: 15, 16704): CPU-time ratio
0.33, wall-time ratio 0.16-0.39 over three runs. With ``--budget 2304`` (two longest rows) the wall
ratio was 1.03: the local spec's dense block-diagonal mask costs O(budget^2) per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quick import parse_quick  # noqa: E402

VOCAB, LONGEST_ROW = 2048, 128 + 1024
QUICK = {"rows": 8, "group_size": 4, "micro_batch_size": 4, "hidden": 64, "layers": 1, "steps": 1,
         "warmup": 0}


def model_config(hidden: int, layers: int) -> dict:
    return {"architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden, "intermediate_size": 3 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": max(hidden // 32, 1),
            "num_key_value_heads": max(hidden // 64, 1), "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}


def completion_lengths(rows: int, seed: int) -> list[int]:
    """Long tail: log-normal around a median of 100 tokens (sigma 0.9), clipped to 16..1024."""
    import random

    rng = random.Random(seed)
    return [min(max(round(math.exp(rng.gauss(math.log(100), 0.9))), 16), 1024) for _ in range(rows)]


def make_batch(rows: int, group_size: int, seed: int):
    """Random tokens in the Batch layout (train/batching.py): groups of ``group_size`` completions,
    varied rewards, sampler log-probs near the uniform distribution's."""
    import torch

    from megatron_gtpo.types import Batch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(completion_lengths(rows, seed))
    prompt_lengths = torch.randint(32, 129, (rows // group_size,), generator=g).repeat_interleave(group_size)
    width, prompt_width = int(lengths.max()), int(prompt_lengths.max())
    mask = torch.arange(width)[None, :] < lengths[:, None]
    token_ids = torch.where(mask, torch.randint(3, VOCAB, (rows, width), generator=g), 0)
    prompt_ids = torch.where(torch.arange(prompt_width)[None, :] < prompt_lengths[:, None],
                             torch.randint(3, VOCAB, (rows, prompt_width), generator=g), 0)
    sampler = torch.where(mask, -math.log(VOCAB) + 0.1 * torch.randn(mask.shape, generator=g), torch.zeros(()))
    return Batch(prompt_ids=prompt_ids, prompt_lengths=prompt_lengths, token_ids=token_ids, mask=mask,
                 sampler_logprobs=sampler, rewards=torch.rand(rows, generator=g),
                 group_ids=torch.arange(rows) // group_size, pad_id=0)


def layout(batch, settings, dims) -> dict:
    """Micro-batches of one path and the model positions one pass computes (real tokens + padding)."""
    from megatron_gtpo.train.step import rank_micro_batches

    mbs = rank_micro_batches(batch, settings, dims)[1]
    return {"micro_batches": len(mbs), "tokens": sum(mb.input_ids.numel() for mb in mbs)}


def run(args) -> dict:
    import torch

    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
    from megatron_gtpo.train.snapshot import ParamSnapshot
    from megatron_gtpo.train.step import StepSettings, train_step

    torch.set_num_threads(args.threads)
    dims = init_distributed(tp=1, pp=1, seed=7)
    chunks = wrap_ddp(M.build_model(model_config(args.hidden, args.layers), dims=dims), OptimConfig())
    snapshot, batch = ParamSnapshot(chunks), make_batch(args.rows, args.group_size, args.seed)
    spec = AlgoConfig(name="gtpo", entropy_threshold=777.0, entropy_gamma=0.0).resolve(max_completion_tokens=1024)
    paths = {"padded": StepSettings(spec=spec, micro_batch_size=args.micro_batch_size, temperature=1.0),
             "packed": StepSettings(spec=spec, micro_batch_size=args.micro_batch_size, temperature=1.0,
                                    micro_batch_tokens=args.budget)}
    times, cpu, losses = ({name: [] for name in paths} for _ in range(3))
    for i in range(args.warmup + args.steps):
        for name in (paths if i % 2 else reversed(paths)):  # alternate the order: drift hits both
            snapshot.restore()
            optimizer, scheduler = build_optimizer(chunks, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-4}),
                                                   total_steps=10)
            start, start_cpu = time.perf_counter(), time.process_time()
            metrics = train_step(SimpleNamespace(chunks=chunks, optimizer=optimizer, scheduler=scheduler), batch,
                                 paths[name], dims)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
                losses[name].append((metrics["loss"], metrics["optim/grad_norm"]))
    padded, packed = statistics.median(times["padded"]), statistics.median(times["packed"])
    real = int((batch.prompt_lengths + batch.lengths).sum())
    cpu_ratio = statistics.median(cpu["packed"]) / statistics.median(cpu["padded"])
    return {"packed_vs_padded": round(packed / padded, 3), "padded_s": round(padded, 3), "packed_s": round(packed, 3),
            "packed_vs_padded_cpu_time": round(cpu_ratio, 3),
            "real_tokens": real, "padded": layout(batch, paths["padded"], dims),
            "packed": layout(batch, paths["packed"], dims),
            "loss_abs_diff": abs(losses["packed"][0][0] - losses["padded"][0][0]),  # the loss nearly cancels
            "grad_norm_rel_diff": abs(losses["packed"][0][1] / losses["padded"][0][1] - 1),
            "rows": args.rows, "budget": args.budget, "micro_batch_size": args.micro_batch_size,
            "completion_median": statistics.median(batch.lengths.tolist()), "completion_max": int(batch.lengths.max()),
            "model": f"qwen2 h{args.hidden} x{args.layers} layers, vocab {VOCAB}", "threads": args.threads,
            "steps": args.steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64, help="completions in the global batch (default 64)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="rows per padded micro-batch (default 8)")
    parser.add_argument("--budget", type=int, default=LONGEST_ROW,
                        help=f"tokens per packed micro-batch (default {LONGEST_ROW}, the longest possible row "
                             "128 + 1024: train.micro_batch_tokens' default rule)")
    parser.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--steps", type=int, default=3, help="timed train steps per path (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per path first (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_quick(parser, argv, QUICK)
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
