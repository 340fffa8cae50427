"""CP rows of ``bench/memory.py --cp``: what one rank holds of a long sequence's step, CP=2 against CP=1.

    python bench/memory.py --cp [--cp-tokens 4096] [--cp-reps 3]

Re-launches itself on 2 gloo ranks (torchrun). One sequence of ``--cp-tokens`` tokens (a 64-token
prompt, the rest completion) through a Megatron GPTModel (local spec, fp32, 2 layers, hidden 256,
4 heads / 2 KV heads, vocabulary 16384) and the step's loss path: the fused log-prob + entropy
pass on the rank's logits, GTPO's <H>_i over the CP group, backward through both. CP=1 runs on
rank 0 alone (rank 1 waits), CP=2 on both ranks, each holding half of the sequence (Megatron's
load-balanced split, the CPU stand-in CP attention), in the same run, from the same weights:

* memory: the peak of tensor bytes allocated during forward + loss + backward (PyTorch profiler
  allocation events; the weights exist beforehand): the rank's activations, logits and the fused
  pass's scratch, against the memory plan's ``activations + logits`` for the same sizes
  (``plan/memory.py``, what the dry-run prints per CP rank);
* time per token: forward + loss + backward over the rank's own tokens, the minimum over
  ``--cp-reps`` rounds (CP=2 includes the stand-in's K/V all-gathers and their reduce-scatters).

Prints one JSON line per CP size and a summary line (``peak_vs_cp1``, ``time_per_token_vs_cp1``).
"""

from __future__ import annotations

import json
import time

import torch

MODEL = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16384, "max_position_embeddings": 8192,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
PROMPT = 64


def _micro_batch(tokens: int):
    from megatron_gtpo.train.batching import MicroBatch

    gen = torch.Generator().manual_seed(2)
    return MicroBatch(rows=torch.zeros(1, dtype=torch.long), position_ids=torch.arange(tokens)[None, :],
                      input_ids=torch.randint(3, MODEL["vocab_size"], (1, tokens), generator=gen),
                      start=torch.tensor([PROMPT]), lengths=torch.tensor([tokens - PROMPT]), width=tokens - PROMPT)


def _step(model, shard, settings, group):
    """Forward, the fused pass on this rank's logits, <H>_i over the CP group, backward."""
    from megatron_gtpo.train.cp_loss import mean_entropy, shard_token_stats
    from megatron_gtpo.train.cp_shard import forward

    logits = forward(model, shard)
    logp, entropy = shard_token_stats(settings, logits, shard, inplace_backward=True)
    mask = torch.ones(1, shard.width, dtype=torch.bool, device=shard.held.device)
    mean_entropy(entropy, shard.held, mask, group)
    (-(logp * shard.held).sum() + 0.01 * entropy.sum()).backward()


def _plan_bytes(cp: int, tokens: int) -> int:
    """The memory plan's activations + logits of this sequence on one CP rank."""
    from megatron_gtpo.models.shape import shape_from_hf_config
    from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
    from megatron_gtpo.plan.memory import MemorySizes, activation_bytes, estimate_memory

    shape = shape_from_hf_config(MODEL, name="bench")
    layout = plan_layout(LayoutRequest(shape=shape, nodes=1, gpus_per_node=2 if cp == 2 else 1, tp=1, pp=1, cp=cp,
                                       prompts_per_step=2 // cp, group_size=2, max_prompt_tokens=PROMPT,
                                       max_completion_tokens=tokens - PROMPT))
    sizes = MemorySizes(param_bytes=4, logits_bytes=4, layer_spec="local", micro_batch_tokens=tokens)
    return activation_bytes(shape, layout, sizes) + estimate_memory(shape, layout, sizes).logits


def run_cp(cp: int, args) -> dict | None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from bench.logprob_entropy import peak_extra_bytes
    from megatron_gtpo.parallel.collectives import comm_device
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.cp_shard import shard_micro_batch
    from megatron_gtpo.train.logprobs import LogprobSettings

    dims = init_distributed(tp=1, cp=cp, pp=1, seed=0)
    result = None
    if dims.dp_rank == 0:  # CP=1: rank 0 alone; CP=2: the one CP group
        torch.manual_seed(0)
        model = M.build_model(MODEL, dims=dims)[0]
        # built on the host, then moved, as the train step's plan does (train/plan.py)
        shard = shard_micro_batch(_micro_batch(args.cp_tokens), cp=cp, rank=dims.cp_rank, pad_id=0).to(comm_device())
        settings = LogprobSettings(tp_group=None, tp_rank=0, vocab_size=MODEL["vocab_size"], temperature=1.0,
                                   chunk_tokens=None)
        group = ps.get_context_parallel_group() if cp > 1 else None
        _step(model, shard, settings, group)  # warm-up (lazy buffers, the stand-in's cached masks)
        model.zero_grad(set_to_none=False)
        peak, _ = peak_extra_bytes(lambda: _step(model, shard, settings, group))
        seconds = []
        for _ in range(args.cp_reps):
            model.zero_grad(set_to_none=False)
            if group is not None:
                dist.barrier(group=group)
            start = time.perf_counter()
            _step(model, shard, settings, group)
            seconds.append(time.perf_counter() - start)
        local = int(shard.input_ids.shape[1])
        result = {"cp": cp, "rank": dims.rank, "local_tokens": local, "peak_mb": round(peak / 2**20, 1),
                  "plan_mb": round(_plan_bytes(cp, args.cp_tokens) / 2**20, 1),
                  "us_per_token": round(1e6 * min(seconds) / local, 2)}
    dist.barrier()
    ps.destroy_model_parallel()
    return result


def main_rank(args) -> None:
    import torch.distributed as dist

    from megatron_gtpo.parallel import control

    dist.init_process_group("gloo")
    one, two = run_cp(1, args), run_cp(2, args)
    # the rows are plain data: the gloo control group carries them as JSON (an object collective on
    # the default group is what strict device groups refuse, and NCCL would stage it through a GPU)
    rows = control.all_gather_data(two)
    if dist.get_rank() != 0:
        return
    worst = max(rows, key=lambda r: r["peak_mb"])
    for row in (one, *rows):
        print(json.dumps(row), flush=True)
    print(json.dumps({"cp_rows": True, "tokens": args.cp_tokens,
                      "peak_vs_cp1": round(worst["peak_mb"] / one["peak_mb"], 3),
                      "plan_vs_cp1": round(worst["plan_mb"] / one["plan_mb"], 3),
                      "measured_over_plan_cp1": round(one["peak_mb"] / one["plan_mb"], 3),
                      "measured_over_plan_cp2": round(worst["peak_mb"] / worst["plan_mb"], 3),
                      "time_per_token_vs_cp1": round(max(r["us_per_token"] for r in rows) / one["us_per_token"], 3)}),
          flush=True)
