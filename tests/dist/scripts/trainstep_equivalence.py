"""Multi-rank check: GTPO/GRPO/DAPO/Dr. GRPO/GSPO/CISPO losses, gradients, parameter updates, no-grad log-probs and
greedy tokens of the Megatron train step in several (TP, PP, DP[, VPP]) layouts equal a
single-process reference on the same global batch.

Usage: torchrun --nproc_per_node=N trainstep_equivalence.py LAYOUT [LAYOUT ...] [--logprob-tp K ...]
LAYOUT is ``tp,pp[,vpp]`` (DP = N / (tp*pp)). Phase 0 computes the reference on every rank with a
TP1/PP1 model (plain autograd on the whole batch); then each layout re-initialises parallel_state,
loads the same weights and runs ``train_on_batch``. Prints one ``RESULT {json}`` line per check.
"""

from __future__ import annotations

import argparse
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
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, current_lr, wrap_ddp
from megatron_gtpo.train.batching import local_rows
from megatron_gtpo.train.step import (StepSettings, check_schedule, forward_stats, logprob_settings, process_groups,
                                     rank_micro_batches, train_step)
from tests.megatron_greedy import greedy_generate
from tests.dist.scripts import _trainstep_common as C
from tests.dist.scripts._logprob_checks import check_vocab_parallel

TEMPERATURE, MBS = 0.8, 2
PROMPTS = [[5, 9, 17, 33], [7, 100]]


def emit(**record) -> None:
    """One ``RESULT`` line per record, written with a single os.write: ranks share the pipe, and
    writes below PIPE_BUF (4 KiB) are atomic, so lines of different ranks never interleave."""
    line = ("RESULT " + json.dumps({"rank": dist.get_rank(), **record}) + "\n").encode()
    assert len(line) < 4096, "keep RESULT records short (atomic pipe writes)"
    sys.stdout.flush()
    os.write(1, line)


def cases(threshold: float, clip: float) -> list[dict]:
    """(name, algo config, mu, use ref logp, optimizer) combinations checked in every layout."""
    sgd = {"optimizer": "sgd", "lr": 0.5, "sgd_momentum": 0.0, "weight_decay": 0.0, "clip_grad": 0.0}
    return [
        dict(name="gtpo", cfg=AlgoConfig(name="gtpo", entropy_threshold=threshold), mu=1, ref=False, opt=sgd),
        dict(name="grpo_kl", cfg=AlgoConfig(name="grpo", kl_beta=0.04), mu=1, ref=True, opt=sgd),
        dict(name="dapo", cfg=AlgoConfig(name="dapo"), mu=1, ref=False, opt=sgd),
        # small steps so the second update's ratio stays near 1 and the 0.02 clip range is hit
        dict(name="dapo_mu2_clip", cfg=AlgoConfig(name="dapo", mu=2, clip_eps_low=0.02, clip_eps_high=0.02), mu=2,
             ref=False, opt={**sgd, "lr": 1e-4, "clip_grad": clip}),
        # Dr. GRPO: its normaliser is the constant L (max completion tokens), the same in every
        # micro-batch and DP slice; a per-micro-batch normaliser would change the loss here
        dict(name="drgrpo", cfg=AlgoConfig(name="drgrpo"), mu=1, ref=False, opt=sgd),
        # GSPO at its own range (3e-4 / 4e-4): update 2 clips whole completions by their sequence
        # ratio, each row's mean log-ratio taken over the whole row in any micro-batch / DP split
        dict(name="gspo_mu2", cfg=AlgoConfig(name="gspo", mu=2), mu=2, ref=False,
             opt={**sgd, "lr": 1e-4, "clip_grad": clip}),
        # CISPO: truncated IS weights (0.02 above and below) that keep their tokens' gradients
        dict(name="cispo_mu2", cfg=AlgoConfig(name="cispo", mu=2, clip_eps_low=0.02, clip_eps_high=0.02), mu=2,
             ref=False, opt={**sgd, "lr": 1e-4, "clip_grad": clip}),
    ]


def synthetic_ref_logp(batch, logp: torch.Tensor) -> torch.Tensor:
    """A 'reference model' log-prob table [B, S] near the policy's (``logp`` [B, T]) so GRPO's KL
    term has a moderate, non-zero gradient."""
    g = torch.Generator().manual_seed(11)
    noisy = (logp + 0.3 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)).float()
    return torch.where(batch.mask, noisy, torch.zeros(()))


def reference_phase(batch, *, tied: bool):
    """Single-process reference for every case (TP1/PP1 model, dense autograd, manual SGD)."""
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    model = M.build_model(C.tiny_config(tied=tied), dims=dims)[0]
    assert model.vocab_size == 256 and M.true_vocab_size([model]) == C.VOCAB  # padded, random padding rows
    with torch.no_grad():  # sharper next-token distributions: entropies spread around the threshold
        model.output_layer.weight.mul_(40.0) if not tied else model.embedding.word_embeddings.weight.mul_(8.0)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        input_ids, position_ids = C.sequence_view(batch)
        logits = model(input_ids, position_ids, M.causal_mask(input_ids.shape[1]))
        logp, entropy, clamped, _, mask = C.dense_token_stats(logits, batch, TEMPERATURE)
        greedy = _dense_greedy(model, 6)
    mean_h = (clamped.sum(1) / mask.sum(1)).sort().values
    threshold = float(mean_h[len(mean_h) // 2 - 1: len(mean_h) // 2 + 1].mean())  # between two rows
    out = {"full": full, "logp": logp, "entropy": entropy, "mask": mask, "greedy": greedy, "cases": {},
           "ref_logp": synthetic_ref_logp(batch, logp)}
    # clip for the mu=2 case: half of the first step's gradient norm, so clipping is active
    first = _reference_updates(model, full, batch, cases(threshold, 1e9)[3], clip=0.0, ref_logp=None)
    clip = 0.5 * first["grad_norms"][0]
    for case in cases(threshold, clip):
        out["cases"][case["name"]] = _reference_updates(model, full, batch, case, clip=case["opt"]["clip_grad"],
                                                        ref_logp=out["ref_logp"] if case["ref"] else None)
    out["threshold"], out["clip"] = threshold, clip
    sampler = batch.sampler_logprobs.double()
    tokens = mask.sum()
    out["mismatch_ref"] = float(torch.where(mask, (logp - sampler).abs(), 0.0).sum() / tokens)
    out["mismatch_max_ref"] = float(torch.where(mask, (logp - sampler).abs(), 0.0).max())
    out["entropy_ref"] = float((entropy.sum(1) / mask.sum(1)).mean())
    out["clamped_entropy_ref"] = float((clamped.sum(1) / mask.sum(1)).mean())  # GTPO's <H>_i statistic
    ps.destroy_model_parallel()
    return out


def _reference_updates(model, full, batch, case, *, clip: float, ref_logp) -> dict:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(full[n])
    cfg = case["cfg"]
    kwargs = dict(spec=cfg.resolve(max_completion_tokens=16), temperature=TEMPERATURE, ref_logp=ref_logp)
    losses, norms, grads, old_logp, mean_h = [], [], None, None, None
    for update in range(case["mu"]):
        model.zero_grad(set_to_none=True)
        loss, logp, h, _ = C.reference_loss(model, batch, old_logp=old_logp if update else None,
                                            mean_entropy=mean_h, **kwargs)
        if update == 0:
            old_logp, mean_h = (logp if case["mu"] > 1 else None), h
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        coeff = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.sub_(case["opt"]["lr"] * coeff * grads[n])
        losses.append(float(loss))
        norms.append(norm)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "grads": grads, "params": params}


def _dense_greedy(model, steps: int) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(steps):
            ids = torch.tensor([tokens])
            logits = model(ids, torch.arange(len(tokens))[None], M.causal_mask(len(tokens)))
            tokens.append(int(logits[0, -1, :C.VOCAB].argmax()))  # padding columns are not tokens
        out.append(tokens[len(prompt):])
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / max |ref| (a tensor-wise relative error)."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def layout_phase(batch, ref, layout: tuple[int, int, int | None], *, tied: bool) -> None:
    tp, pp, vpp = layout
    dims = init_distributed(tp=tp, pp=pp, vpp=vpp, seed=7)
    overrides = {"batch_p2p_comm": False} if (vpp and pp == 2) else None  # see step._check_schedule
    if overrides:
        _check_vpp_guard(dims, tied)
    chunks = M.build_model(C.tiny_config(tied=tied), dims=dims, overrides=overrides)
    C.load_full(chunks, ref["full"], tied=tied, tp=tp, tp_rank=dims.tp_rank)
    name = f"tp{tp}_pp{pp}_dp{dims.dp}" + (f"_vpp{vpp}" if vpp else "")
    _check_logprobs_and_greedy(chunks, batch, ref, dims, name)
    ddp = wrap_ddp(chunks, OptimConfig())
    for case in cases(ref["threshold"], ref["clip"]):
        C.load_full(ddp, ref["full"], tied=tied, tp=tp, tp_rank=dims.tp_rank)
        optimizer, scheduler = build_optimizer(ddp, OptimConfig(optimizer=case["opt"]), total_steps=4)
        cfg, want = case["cfg"], ref["cases"][case["name"]]
        settings = StepSettings(spec=cfg.resolve(max_completion_tokens=16), micro_batch_size=MBS,
                                temperature=TEMPERATURE, chunk_tokens=5)
        rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=MBS)
        metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                             dims, ref_logp=ref["ref_logp"][rows] if case["ref"] else None)
        grad_err, update_excess = 0.0, 0.0
        for gname, lname, param in C.named_local_params(ddp, tied=tied):
            piece = dict(tp=tp, tp_rank=dims.tp_rank)
            if case["mu"] == 1:
                want_grad = C.local_piece(want["grads"][gname], lname, param, **piece)
                grad_err = max(grad_err, rel_err(param.main_grad, want_grad))
            start = C.local_piece(ref["full"][gname], lname, param, **piece).double()
            delta_ref = start - C.local_piece(want["params"][gname], lname, param, **piece).double()
            delta = start - param.detach().double()
            # allowed: 1e-5 of the update plus the fp32 rounding of p - lr*g (one ulp of the weights)
            allowed = 1e-5 * delta_ref.abs().max() + 2 * torch.finfo(torch.float32).eps * start.abs().max()
            update_excess = max(update_excess, float((delta - delta_ref).abs().max() / allowed))
        emit(check="train_step", layout=name, case=case["name"], loss=metrics["loss"],
             loss_ref=sum(want["losses"]) / len(want["losses"]), grad_norm=metrics["optim/grad_norm"],
             grad_norm_ref=sum(want["grad_norms"]) / len(want["grad_norms"]), grad_err=grad_err,
             update_excess=update_excess, ratio_max=metrics.get("train/ratio_max"),
             clip_frac=metrics.get("clip/low_frac", 0.0) + metrics.get("clip/high_frac", 0.0),
             nonfinite=[k for k, v in metrics.items() if not math.isfinite(v)])
        if case["name"] == "gtpo":
            emit(check="metrics", layout=name, metrics=metrics, mismatch_ref=ref["mismatch_ref"],
                 mismatch_max_ref=ref["mismatch_max_ref"], entropy_ref=ref["clamped_entropy_ref"])
    if dims.world == 1:
        _check_lr_schedule(ddp)
    if dims.dp > 1:
        _check_distributed_adam(batch, ref, dims, name, tied=tied, overrides=overrides)
    ps.destroy_model_parallel()


def _check_lr_schedule(ddp) -> None:
    """Warm-up + cosine schedule as configured through OptimConfig, read back step by step."""
    cfg = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3, "min_lr": 1e-4},
                      scheduler={"lr_warmup_steps": 2, "lr_decay_style": "cosine"})
    optimizer, scheduler = build_optimizer(ddp, cfg, total_steps=6)
    lrs = [current_lr(optimizer)]
    for _ in range(6):
        scheduler.step(increment=1)
        lrs.append(current_lr(optimizer))
    emit(check="lr_schedule", lrs=lrs)


def _check_vpp_guard(dims, tied) -> None:
    """PP=2 x VPP with batched p2p silently swaps activations and gradients: the model builder
    turns it off by default, and the step must refuse a user override that turns it back on."""
    assert M.build_model(C.tiny_config(tied=tied), dims=dims)[0].config.batch_p2p_comm is False
    chunks = M.build_model(C.tiny_config(tied=tied), dims=dims, overrides={"batch_p2p_comm": True})
    try:
        check_schedule(chunks, 2, dims)
        emit(check="vpp_guard", raised=False)
    except ValueError as err:
        emit(check="vpp_guard", raised="batch_p2p_comm=False" in str(err))


def _check_distributed_adam(batch, ref, dims, name, *, tied, overrides):
    """Distributed optimizer + Adam + clipping: loss and (pre-clip) grad norm match, and every local
    parameter equals one-process Adam's first step from the reference gradients (``adam_excess``)."""
    chunks = M.build_model(C.tiny_config(tied=tied), dims=dims, overrides=overrides)
    # no weight decay: the one-process reference below is Adam's update alone
    cfg = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3, "clip_grad": 1e-3, "weight_decay": 0.0,
                                 "use_distributed_optimizer": True})
    ddp = wrap_ddp(chunks, cfg)
    C.load_full(ddp, ref["full"], tied=tied, tp=dims.tp, tp_rank=dims.tp_rank)
    optimizer, scheduler = build_optimizer(ddp, cfg, total_steps=4)
    algo_cfg, want = AlgoConfig(name="gtpo", entropy_threshold=ref["threshold"]), ref["cases"]["gtpo"]
    settings = StepSettings(spec=algo_cfg.resolve(max_completion_tokens=16), micro_batch_size=MBS,
                            temperature=TEMPERATURE)
    metrics = train_step(SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler), batch, settings,
                         dims)
    moved, adam_excess = 0.0, 0.0
    for g, n, p in C.named_local_params(ddp, tied=tied):
        start = C.local_piece(ref["full"][g], n, p, tp=dims.tp, tp_rank=dims.tp_rank).double()
        grad = C.local_piece(want["grads"][g], n, p, tp=dims.tp, tp_rank=dims.tp_rank).double()
        delta = start - p.detach().double()
        moved = max(moved, float(delta.abs().max()))
        adam_excess = max(adam_excess, float((delta - _first_adam_step(grad, want["grad_norms"][0], cfg)).abs().max()
                                             / cfg.optimizer["lr"]))
    emit(check="distopt_adam", layout=name, loss=metrics["loss"], loss_ref=want["losses"][0],
         grad_norm=metrics["optim/grad_norm"], grad_norm_ref=want["grad_norms"][0], max_param_change=moved,
         adam_excess=adam_excess)


def _first_adam_step(grad: torch.Tensor, norm: float, cfg: OptimConfig) -> torch.Tensor:
    """One-process Adam's first update ``p0 - p1`` (float64) from the unclipped gradient ``grad`` and
    the global grad norm: Megatron's clip (coefficient ``clip / (norm + 1e-6)`` when below 1), then
    Adam at step 1, where the bias corrections cancel (m_hat = g, v_hat = g^2): ``lr g / (|g| + eps)``
    (constant LR, no warm-up: OptimConfig's default schedule)."""
    from megatron.core.optimizer import OptimizerConfig

    opt = OptimizerConfig(**cfg.optimizer)  # Megatron's defaults for what the case leaves unset (eps)
    assert opt.weight_decay == 0.0, "the reference has no weight decay term"
    g = grad * min(1.0, opt.clip_grad / (norm + 1e-6))
    return opt.lr * g / (g.abs() + opt.adam_eps)


def _check_logprobs_and_greedy(chunks, batch, ref, dims, name) -> None:
    """No-grad log-probs and exact entropies of this rank's rows (last stage) against the dense
    reference; greedy tokens on every rank."""
    settings = StepSettings(spec=AlgoConfig().resolve(max_completion_tokens=16), micro_batch_size=MBS,
                            temperature=TEMPERATURE, chunk_tokens=7)
    rows, mbs = rank_micro_batches(batch, settings, dims)
    stats = forward_stats(chunks, batch, mbs, logprob_settings(settings, dims, process_groups(), chunks))
    greedy = greedy_generate(chunks, PROMPTS, 6, dims)
    if stats is None:
        return
    mask = ref["mask"][rows]
    zero = torch.zeros((), dtype=torch.float64)
    logp = torch.where(mask, stats.logp.double(), zero)
    ent = torch.where(mask, stats.entropy.double(), zero)
    emit(check="logprobs", layout=name, logp_err=rel_err(logp, ref["logp"][rows]),
         entropy_err=rel_err(ent, ref["entropy"][rows]), greedy=greedy, greedy_ref=ref["greedy"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layouts", nargs="*")
    parser.add_argument("--logprob-tp", type=int, nargs="*", default=[])
    parser.add_argument("--tied", action="store_true", help="tied-embedding Llama instead of untied Qwen2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    for tp in args.logprob_tp:
        for record in check_vocab_parallel(tp):
            emit(check="vocab_parallel", **record)
    if not args.layouts:
        return
    batch = C.make_batch(0)
    ref = reference_phase(batch, tied=args.tied)
    for item in args.layouts:
        parts = [int(x) for x in item.split(",")]
        layout_phase(batch, ref, (parts[0], parts[1], parts[2] if len(parts) > 2 else None), tied=args.tied)


if __name__ == "__main__":
    main()
