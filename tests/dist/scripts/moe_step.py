"""4-rank check: the mixture-of-experts train step at EP=2, TP=2 x EP=2 and PP=2 x EP=2 equals one process.

Usage: torchrun --nproc_per_node=4 moe_step.py HF_DIR (a tiny Qwen2-MoE: shared expert with its
gate, top-2 of 4 experts without renormalisation). Phase 0 computes the reference on every rank
alone (TP1/PP1/EP1, no DDP, no schedule: plain autograd on the whole batch, dense float64
log-softmax, tests/algo_helpers.policy_loss, manual SGD) with the router watch on, so the moe/*
metrics of the whole batch come from one process too. Then each layout loads the same HF weights
and runs the real train step: GTPO (entropy threshold between two completions' mean entropies, so
the filter and the conflict masks are live) and GRPO with a KL term, from the same start with plain
SGD, on a global batch whose groups straddle DP ranks and micro-batches, with free routing and with
the engine's routing replayed (a synthetic engine routing of random top-2 sets per token and
layer), padded and packed micro-batches. Checked: loss, grad norm, every parameter's gradient (all
HF tensors, gathered by the exporter: (before - after) / lr of one SGD step), the moe/* metrics.

The ``*_captured`` cases replay a routing that does not come from this stack: the experts HF
transformers' own Qwen2-MoE picks for every fed token (forward hooks on its routers, the stand-in
for vLLM's capture), handed per completion to ``train/routing.batch_routing`` as the rollout does.
Replaying the experts that free routing picks must reproduce free routing, so these cases are
judged against the free-routing reference: an oracle independent of the replay helpers (a replay of
another layer, of another micro-batch's rows, shifted or padded positions, or the wrong layer after
a pipeline stage boundary runs other experts and moves the loss and gradients).
Prints one ``RESULT {json}`` line per check.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.train import model as M
from megatron_gtpo.train.batching import local_rows
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.routing import attach, batch_routing, tokens_of
from megatron_gtpo.train.step import StepSettings, train_step
from tests.dist.scripts import _trainstep_common as C

LAYOUTS = ((1, 1, 2), (2, 1, 2), (1, 2, 2))  # (tp, pp, ep) of the train step; the reference is one process
# One SGD step of a large learning rate: the update lr * g dwarfs the weights, so (before - after) / lr
# is the gradient up to fp32 rounding of the update itself (~1e-7 relative), not of the weights.
LR, TEMPERATURE = 1000.0, 0.8
GTPO_METRICS = ("gtpo/filtered_frac", "gtpo/conflict_tokens_per_completion", "gtpo/lambda_zero_share",
                "gtpo/lambda_ge2_share")


def emit(**record) -> None:
    line = ("RESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode()
    sys.stdout.flush()
    os.write(1, line)


def engine_routing(batch, *, layers: int, experts: int, top_k: int) -> torch.Tensor:
    """A synthetic engine routing [B, S, L, k]: distinct random experts for every fed token (prompt
    and completion but the last token), -1 elsewhere, as ``train/routing.batch_routing`` builds it."""
    g = torch.Generator().manual_seed(3)
    fed = (batch.prompt_lengths + batch.lengths - 1).tolist()
    out = torch.full((batch.size, max(fed) + 1, layers, top_k), -1, dtype=torch.int16)
    for row, count in enumerate(fed):
        out[row, :count] = torch.rand(count, layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.int16)
    return out


def captured_routing(hf_dir, batch) -> torch.Tensor:
    """The experts HF transformers' Qwen2-MoE routes every token of ``batch`` to (its routers'
    top-k, recorded by forward hooks), given per completion to the product's ``batch_routing``."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    picked: list[torch.Tensor | None] = [None] * len(routers)
    hooks = [r.register_forward_hook(lambda mod, inp, out, i=i: picked.__setitem__(i, out[2]))
             for i, r in enumerate(routers)]
    input_ids, position_ids = C.sequence_view(batch)
    with torch.no_grad():
        model(input_ids=input_ids, position_ids=position_ids)
    for hook in hooks:
        hook.remove()
    rows, width = input_ids.shape
    per_token = torch.stack([p.reshape(rows, width, -1) for p in picked], dim=2)  # [B, S, L, k]
    fed = (batch.prompt_lengths + batch.lengths - 1).tolist()  # the engine feeds all but the last token
    completions = [SimpleNamespace(prompt_token_ids=[0] * int(batch.prompt_lengths[b]),
                                   token_ids=[0] * int(batch.lengths[b]),
                                   routed_experts=per_token[b, :fed[b]].to(torch.int16).numpy())
                   for b in range(rows)]
    return batch_routing(completions)


def cases(threshold: float):
    """(name, algorithm, replay, packed): GTPO and GRPO with a KL term, free routing and replayed
    routing (synthetic, and captured from HF's model: ``*_captured``), padded and packed micro-batches."""
    gtpo, grpo = AlgoConfig(name="gtpo", entropy_threshold=threshold), AlgoConfig(name="grpo", kl_beta=0.04)
    return [("gtpo", gtpo, False, False), ("gtpo_replay", gtpo, True, True),
            ("grpo_kl", grpo, False, True), ("grpo_kl_replay", grpo, True, False),
            ("gtpo_captured", gtpo, True, False), ("grpo_kl_captured", grpo, True, True)]


def reference_of(name: str) -> str:
    """The reference case: replaying captured free routing must reproduce free routing."""
    return name.removesuffix("_captured")


def ref_logprobs(batch) -> torch.Tensor:
    """A 'reference model' log-prob table [B, T] for GRPO's KL term (completion view)."""
    return torch.where(batch.mask, batch.sampler_logprobs - 0.1, 0.0)


def gtpo_metrics(metrics) -> dict[str, float]:
    """GTPO's entropy filter and conflict masks as the metrics report them (empty for GRPO)."""
    return {k: float(metrics[k]) for k in GTPO_METRICS if k in metrics}


def full_params(chunks, hf_config, dims) -> dict[str, torch.Tensor]:
    """Every HF tensor of the model on every rank (the exporter's full mode: experts from their EP rank)."""
    return {name: tensor.detach().clone() for name, tensor in Exporter(chunks, hf_config=hf_config, dims=dims)
            .tensors("full")}


def hf_tensors(hf_dir) -> dict[str, torch.Tensor]:
    """The start: the HF checkpoint's own tensors (what every layout loads)."""
    from pathlib import Path

    from safetensors.torch import load_file

    out = {}
    for path in sorted(Path(hf_dir).glob("*.safetensors")):
        out.update(load_file(path))
    return out


def update_grads(before, chunks, hf_config, dims) -> dict[str, torch.Tensor]:
    """(before - after) / lr of every HF tensor after one SGD step."""
    after = full_params(chunks, hf_config, dims)
    assert set(after) == set(before), sorted(set(after) ^ set(before))
    return {n: (before[n].double() - after[n].double()) / LR for n in before}


def load_model(hf_dir, hf_config, dims, *, replay: bool):
    chunks = M.build_model(hf_config, dims=dims)
    load_hf_weights(chunks, hf_dir=hf_dir, hf_config=hf_config, dims=dims)
    return chunks, attach(chunks, replay=replay, layers=int(hf_config["num_hidden_layers"]))


def whole_batch_tokens(batch):
    """The MoeTokens of the whole batch as one padded micro-batch of C.sequence_view's rows."""
    input_ids, _ = C.sequence_view(batch)
    view = SimpleNamespace(rows=torch.arange(batch.size), input_ids=input_ids, cu_seqlens=None)
    return tokens_of(batch.routed_experts, view, prompt_lengths=batch.prompt_lengths, lengths=batch.lengths,
                     device=torch.device("cpu"))


def reference_phase(hf_dir, hf_config, batch, before) -> dict:
    """One process (every rank alone): the GTPO threshold, then each case's loss, gradients and moe/* metrics."""
    dims = init_distributed(tp=1, pp=1, ep=1, seed=7)
    vocab = int(hf_config["vocab_size"])
    chunks, _ = load_model(hf_dir, hf_config, dims, replay=False)
    with torch.no_grad():
        input_ids, position_ids = C.sequence_view(batch)
        logits = chunks[0](input_ids, position_ids, M.causal_mask(input_ids.shape[1]))
        _, _, clamped, _, mask = C.dense_token_stats(logits, batch, TEMPERATURE, vocab=vocab)
    mean_h = (clamped.sum(1) / mask.sum(1)).sort().values
    threshold = float(mean_h[len(mean_h) // 2 - 1: len(mean_h) // 2 + 1].mean())  # between two completions
    out = {"threshold": threshold}
    for name, algo_cfg, replay, _ in cases(threshold):
        if name != reference_of(name):
            continue
        chunks, watch = load_model(hf_dir, hf_config, dims, replay=replay)
        model = chunks[0]
        watch.collect = True
        with watch.micro_batch(model, whole_batch_tokens(batch)):
            loss, _, _, loss_metrics = C.reference_loss(
                model, batch, spec=algo_cfg.resolve(max_completion_tokens=16), temperature=TEMPERATURE,
                ref_logp=ref_logprobs(batch) if algo_cfg.kl_beta else None, vocab=vocab)
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()))
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(LR * p.grad)
        out[name] = {"loss": float(loss), "grad_norm": norm, "moe": watch.metrics(groups=[]),
                     "grads": update_grads(before, chunks, hf_config, dims),
                     "gtpo": gtpo_metrics(loss_metrics)}
    ps.destroy_model_parallel()
    return out


def run_case(hf_dir, hf_config, batch, dims, case, before) -> dict:
    _, algo_cfg, replay, packed = case
    chunks, _ = load_model(hf_dir, hf_config, dims, replay=replay)
    ddp = wrap_ddp(chunks, OptimConfig())
    sgd = {"optimizer": "sgd", "lr": LR, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}
    optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=sgd), total_steps=2)
    settings = StepSettings(spec=algo_cfg.resolve(max_completion_tokens=16), micro_batch_size=2,
                            temperature=TEMPERATURE, micro_batch_tokens=40 if packed else 0, moe=True)
    rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=1 if packed else 2)
    ref_logp = ref_logprobs(batch)[rows] if algo_cfg.kl_beta else None
    metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings, dims,
                         ref_logp=ref_logp)
    return {"metrics": metrics, "grads": update_grads(before, ddp, hf_config, dims)}


def main() -> None:
    hf_dir = sys.argv[1]
    dist.init_process_group("gloo")
    hf_config = read_hf_config(hf_dir)
    batch = C.make_batch(5, num_groups=4, group_size=4)
    batch.routed_experts = engine_routing(batch, layers=int(hf_config["num_hidden_layers"]),
                                          experts=int(hf_config.get("num_experts") or hf_config["num_local_experts"]),
                                          top_k=int(hf_config["num_experts_per_tok"]))
    captured = copy.copy(batch)
    captured.routed_experts = captured_routing(hf_dir, batch)
    before = hf_tensors(hf_dir)
    reference = reference_phase(hf_dir, hf_config, batch, before)
    for tp, pp, ep in LAYOUTS:
        dims = init_distributed(tp=tp, pp=pp, ep=ep, seed=7)
        for case in cases(reference["threshold"]):
            rows = captured if case[0].endswith("_captured") else batch
            got, ref = run_case(hf_dir, hf_config, rows, dims, case, before), reference[reference_of(case[0])]
            errs = {n: float((got["grads"][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
                    for n, g in ref["grads"].items()}
            worst = max(errs, key=errs.get)
            emit(layout=f"tp{tp}_pp{pp}_ep{ep}_dp{dims.dp}", case=case[0], loss=got["metrics"]["loss"],
                 loss_ref=ref["loss"], grad_norm=got["metrics"]["optim/grad_norm"], grad_norm_ref=ref["grad_norm"],
                 grad_err=errs[worst], worst=worst, moe={k: v for k, v in got["metrics"].items() if k.startswith("moe/")},
                 moe_ref=ref["moe"], gtpo=gtpo_metrics(got["metrics"]), gtpo_ref=ref["gtpo"],
                 router_grad=max(float(g.abs().max()) for n, g in got["grads"].items() if n.endswith("mlp.gate.weight")),
                 nonfinite=[k for k, v in got["metrics"].items() if not math.isfinite(v)])
        ps.destroy_model_parallel()


if __name__ == "__main__":
    main()
