"""Issue-15 pieces of the Megatron train step on 2 gloo ranks (run by tests/dist/test_bias_train_step.py).

Phase TP=2: GTPO's raw-logit entropy statistic (forward_stats at temperature 1 while the log-probs
stay at the sampling temperature) against a dense float64 reference; ``lm_head_fp32`` on a bf16
model (fp32 logits equal to the fp32 product of the bf16 hidden states and weights; a bf16 train
step with Adam moves the output weight). Phase DP=2: the D1/D2/D4 and mismatch metrics of
``train_step`` (D2's gap ~ 0 with a KL term and mismatch weights, summed over DP ranks).
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import model as M
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.step import StepSettings, forward_stats, logprob_settings, process_groups, \
    rank_micro_batches, train_step
from tests.dist.scripts import _trainstep_common as C

TEMPERATURE, MBS = 0.7, 2


def emit(**record) -> None:
    line = ("RESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode()
    sys.stdout.flush()
    os.write(1, line)


def full_weights() -> dict:
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(C.tiny_config(tied=False), dims=dims)[0]
    with torch.no_grad():
        model.output_layer.weight.mul_(20.0)  # sharper distributions: temperature matters
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    for value in full.values():  # the same weights on every rank
        dist.broadcast(value, src=0)
    ps.destroy_model_parallel()
    return full


def raw_entropy_phase(batch, full) -> None:
    dims = init_distributed(tp=2, pp=1, seed=7)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims)
    C.load_full(chunks, full, tied=False, tp=2, tp_rank=dims.tp_rank)
    spec = AlgoConfig(name="gtpo", entropy_logits="raw").resolve(max_completion_tokens=16)
    settings = StepSettings(spec=spec, micro_batch_size=MBS, temperature=TEMPERATURE)
    rows, mbs = rank_micro_batches(batch, settings, dims)
    lp = logprob_settings(settings, dims, process_groups(), chunks)
    raw = forward_stats(chunks, batch, mbs, lp, entropy_prob_floor=1e-6,
                        entropy_temperature=spec.entropy_temperature(TEMPERATURE))
    sampling = forward_stats(chunks, batch, mbs, lp, entropy_prob_floor=1e-6)
    ps.destroy_model_parallel()
    dims1 = init_distributed(tp=1, pp=1, seed=7)
    model = M.build_model(C.tiny_config(tied=False), dims=dims1)[0]
    C.load_full([model], full, tied=False, tp=1, tp_rank=0)
    with torch.no_grad():
        ids, pos = C.sequence_view(batch)
        logits = model(ids, pos, M.causal_mask(ids.shape[1]))
    logp_t, _, clamped_t, _, mask = C.dense_token_stats(logits, batch, TEMPERATURE)
    _, _, clamped_1, _, _ = C.dense_token_stats(logits, batch, 1.0)
    zero = torch.zeros((), dtype=torch.float64)
    err = lambda got, want: float((torch.where(mask, got.double(), zero) - want).abs().max())  # noqa: E731
    emit(check="raw_entropy", raw_err=err(raw.entropy, clamped_1), sampling_err=err(sampling.entropy, clamped_t),
         logp_err=err(raw.logp, logp_t), gap=float((clamped_1 - clamped_t).abs().max()))
    ps.destroy_model_parallel()


def lm_head_phase(batch, full) -> None:
    dims = init_distributed(tp=2, pp=1, seed=7)
    out = {}
    for fp32_head in (False, True):
        chunks = M.build_model(C.tiny_config(tied=False), dims=dims, dtype=torch.bfloat16, lm_head_fp32=fp32_head)
        C.load_full(chunks, full, tied=False, tp=2, tp_rank=dims.tp_rank)
        seen = {}
        layer = M.unwrap(chunks[0]).output_layer
        hook = layer.register_forward_pre_hook(lambda mod, args, kwargs: seen.update(x=args[0]), with_kwargs=True)
        ids, pos = C.sequence_view(batch)
        logits = chunks[0](ids, pos, M.causal_mask(ids.shape[1]))
        hook.remove()
        exact = (seen["x"].float() @ layer.weight.float().t()).transpose(0, 1)  # [s, b, V/TP] -> [b, s, V/TP]
        out[fp32_head] = float((logits.float() - exact).abs().max() / exact.abs().max())
        if fp32_head:
            ddp = wrap_ddp(chunks, OptimConfig())
            optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3}),
                                                   total_steps=2)
            before = M.unwrap(ddp[0]).output_layer.weight.detach().float().clone()
            spec = AlgoConfig(name="grpo", kl_beta=0.0).resolve(max_completion_tokens=16)
            metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch,
                                 StepSettings(spec=spec, micro_batch_size=MBS, temperature=TEMPERATURE), dims)
            moved = float((M.unwrap(ddp[0]).output_layer.weight.detach().float() - before).abs().max())
            emit(check="lm_head_step", moved=moved, loss=metrics["loss"], grad_norm=metrics["optim/grad_norm"],
                 logits_dtype=str(logits.dtype))
    emit(check="lm_head", bf16_err=out[False], fp32_err=out[True])
    ps.destroy_model_parallel()


def near_policy(batch, full, scale: float, seed: int) -> torch.Tensor:
    """Log-probs [B, T] of the policy at TEMPERATURE plus noise: a stand-in for the engine's or a
    reference model's log-probs with a realistic gap."""
    model = M.build_model(C.tiny_config(tied=False), dims=init_distributed(tp=1, pp=1, seed=7))[0]
    C.load_full([model], full, tied=False, tp=1, tp_rank=0)
    with torch.no_grad():
        ids, pos = C.sequence_view(batch)
        logp = C.dense_token_stats(model(ids, pos, M.causal_mask(ids.shape[1])), batch, TEMPERATURE)[0]
    noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return torch.where(batch.mask, logp + scale * noise, 0.0).float()


def metrics_phase(batch, full) -> None:
    dims = init_distributed(tp=1, pp=1, seed=7)  # 2 ranks: DP = 2
    batch.sampler_logprobs = near_policy(batch, full, 0.2, seed=1)
    ref_logp = near_policy(batch, full, 0.3, seed=2)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims)
    ddp = wrap_ddp(chunks, OptimConfig())
    cases = {
        "grpo_kl_tis": (AlgoConfig(name="grpo", kl_beta=0.04, mismatch_correction="tis", mismatch_cap=1.1), True),
        "gtpo_mis": (AlgoConfig(name="gtpo", entropy_threshold=777.0, mismatch_correction="mis", mismatch_cap=1.2),
                     False),
        "dapo_mu3": (AlgoConfig(name="dapo", mu=3, clip_eps_low=0.01, clip_eps_high=0.01,
                                mismatch_correction="tis", mismatch_cap=1.5), False),
    }
    for name, (cfg, with_ref) in cases.items():
        C.load_full(ddp, full, tied=False, tp=1, tp_rank=0)
        optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3,
                                                                           "clip_grad": 0.0}), total_steps=4)
        settings = StepSettings(spec=cfg.resolve(max_completion_tokens=16), micro_batch_size=MBS,
                                temperature=TEMPERATURE)
        rows, _ = rank_micro_batches(batch, settings, dims)
        metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                             dims, ref_logp=ref_logp[rows] if with_ref else None)
        emit(check="metrics", case=name, metrics={k: v for k, v in metrics.items()
                                                  if k.startswith(("bias/", "mismatch/", "loss"))},
             nonfinite=[k for k, v in metrics.items() if not math.isfinite(v)])
    ps.destroy_model_parallel()


def main() -> None:
    dist.init_process_group("gloo")
    batch = C.make_batch(0)
    full = full_weights()
    raw_entropy_phase(batch, full)
    lm_head_phase(batch, full)
    metrics_phase(batch, full)
    dist.barrier()


if __name__ == "__main__":
    main()
