"""Issue-15 pieces of the Megatron train step on 2 gloo ranks (run by tests/dist/test_bias_train_step.py).

Phase TP=2: GTPO's raw-logit entropy statistic (forward_stats at temperature 1 while the log-probs
stay at the sampling temperature) against a dense float64 reference; ``lm_head_fp32`` on a bf16
model (fp32 logits equal to the fp32 product of the bf16 hidden states and weights; a bf16 train
step with Adam moves the output weight). Phase DP=2: the D1/D2/D4 and mismatch metrics of
``train_step`` (D2's gap ~ 0 with a KL term and mismatch weights, summed over DP ranks).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_gtpo import algo
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


CAPS = {"grpo_kl_tis": 1.1, "gtpo_mis": 1.2, "dapo_mu3": 1.5}


def metric_cases() -> dict:
    return {
        "grpo_kl_tis": (AlgoConfig(name="grpo", kl_beta=0.04, mismatch_correction="tis",
                                   mismatch_cap=CAPS["grpo_kl_tis"]), True),
        "gtpo_mis": (AlgoConfig(name="gtpo", entropy_threshold=777.0, mismatch_correction="mis",
                                mismatch_cap=CAPS["gtpo_mis"]), False),
        "dapo_mu3": (AlgoConfig(name="dapo", mu=3, clip_eps_low=0.01, clip_eps_high=0.01, mismatch_correction="tis",
                                mismatch_cap=CAPS["dapo_mu3"]), False),
    }


def single_process_d2(spec, batch, dense, ref_logp) -> dict[str, float]:
    """D2's terms of the first update computed in one process on the whole batch, from the real loss:
    the mismatch weights' part is the loss with them minus the loss without, the KL part the loss
    without the weights minus the loss without KL; the advantage and entropy parts from the
    algorithm's own token weights (``algo.token_omega``, checked against autograd in the unit tests);
    and the mismatch weights' spread over the whole batch."""
    logp, clamped, ids, mask = dense
    mean_h = algo.completion_mean_entropy(clamped, mask) if spec.needs_mean_entropy else None
    prepared = algo.prepare_batch(spec, token_ids=ids, mask=mask, rewards=batch.rewards, group_ids=batch.group_ids,
                                  mean_entropy=mean_h)
    weights, mismatch = algo.mismatch_weights(spec, logp, batch.sampler_logprobs.double(), mask)
    ref = None if ref_logp is None else torch.where(mask, ref_logp.double(), 0.0)

    def loss(s, w) -> float:
        tokens = algo.TokenInputs(logp=logp, mask=mask, ref_logp=ref if s.kl_beta > 0 else None, is_weights=w)
        return float(algo.compute_loss(dataclasses.replace(s, mu=1), tokens, prepared)[0])

    plain, no_kl = loss(spec, None), loss(dataclasses.replace(spec, kl_beta=0.0), None)
    omega = algo.token_omega(spec, mask, prepared, num_tokens=mask.sum(), num_seqs=mask.shape[0])
    d2 = algo.surrogate_decomposition(omega, prepared, batch.group_ids)
    return {"bias/surrogate_adv_term": float(d2.adv_term), "bias/surrogate_entropy_term": float(d2.entropy_term),
            "bias/surrogate_kl_term": plain - no_kl, "bias/surrogate_is_term": loss(spec, weights) - plain,
            **{k: float(v) for k, v in mismatch.items()}}


class UpdateNorms:
    """Records ||theta_after - theta_before|| of every optimizer step (D4's measured Adam updates)."""

    def __init__(self, optimizer, params):
        self.norms, self._step, self._params = [], optimizer.step, params
        optimizer.step = self.step

    def step(self, *args, **kwargs):
        before = [p.detach().double().clone() for p in self._params]
        out = self._step(*args, **kwargs)
        self.norms.append(math.sqrt(sum(float(((p.detach().double() - b) ** 2).sum())
                                        for p, b in zip(self._params, before))))
        return out


def metrics_phase(batch, full) -> None:
    dims = init_distributed(tp=1, pp=1, seed=7)  # 2 ranks: DP = 2
    batch.sampler_logprobs = near_policy(batch, full, 0.2, seed=1)
    ref_logp = near_policy(batch, full, 0.3, seed=2)
    dense = dense_stats(batch, full)
    chunks = M.build_model(C.tiny_config(tied=False), dims=dims)
    ddp = wrap_ddp(chunks, OptimConfig())
    for name, (cfg, with_ref) in metric_cases().items():
        C.load_full(ddp, full, tied=False, tp=1, tp_rank=0)
        # no weight decay: an Adam update is then exactly lr m_hat / (sqrt(v_hat) + eps) (D4)
        optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3,
                                                                           "clip_grad": 0.0, "weight_decay": 0.0}),
                                               total_steps=4)
        updates = UpdateNorms(optimizer, [p for chunk in ddp for p in chunk.parameters()])
        spec = cfg.resolve(max_completion_tokens=16)
        settings = StepSettings(spec=spec, micro_batch_size=MBS, temperature=TEMPERATURE)
        rows, _ = rank_micro_batches(batch, settings, dims)
        metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                             dims, ref_logp=ref_logp[rows] if with_ref else None)
        emit(check="metrics", case=name, metrics={k: v for k, v in metrics.items()
                                                  if k.startswith(("bias/", "mismatch/", "loss"))},
             nonfinite=[k for k, v in metrics.items() if not math.isfinite(v)], update_norms=updates.norms,
             reference=single_process_d2(spec, batch, dense, ref_logp if with_ref else None))
    ps.destroy_model_parallel()


def dense_stats(batch, full):
    """float64 log-probs at TEMPERATURE, GTPO's clamped entropies, token ids and mask of the whole
    batch from a TP1 copy of the weights (the single-process view)."""
    model = M.build_model(C.tiny_config(tied=False), dims=init_distributed(tp=1, pp=1, seed=7))[0]
    C.load_full([model], full, tied=False, tp=1, tp_rank=0)
    with torch.no_grad():
        ids, pos = C.sequence_view(batch)
        logp, _, clamped, token_ids, mask = C.dense_token_stats(model(ids, pos, M.causal_mask(ids.shape[1])), batch,
                                                                TEMPERATURE)
    return logp, clamped, token_ids, mask


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
