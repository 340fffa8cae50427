"""The shared clipped policy-gradient surrogate of GRPO, Dr. GRPO, DAPO and GTPO (spec 2-6).

Per token, with ``rho = exp(logp - old_logp)`` (``exp(logp - logp.detach())`` when ``old_logp`` is
None, i.e. mu = 1: value 1, gradient of log pi, clipping inactive)::

    x_{i,t} = seq_scale_i * ( lambda_{i,t} * max(-rho A_i, -clip(rho, 1-eps_low, 1+eps_high) A_i)
                              + kl_beta * k3(ref_logp, logp) )
    loss    = aggregate(x, mask, mode=agg_mode, num_tokens, num_seqs, constant)       # = -J

``lambda`` (GTPO token weights, >= 0) multiplies the advantage, so ``lambda * min(rho A, clip A) =
min(rho lambda A, clip lambda A)``: S4's casting of GTPO with ``alpha = delta lambda / (G |o_i|)``.
``seq_scale`` (GTPO's per-completion normaliser, see ``prepare.py``) and ``A`` (GTPO: the shaped
``A~``) are computed ONCE per global batch by ``prepare_batch`` and passed in per micro-batch.

Where the normalisers come from: ``num_tokens`` = masked tokens of the global batch (token-mean),
``num_seqs`` = completions of the global batch (seq-mean-*), ``constant`` = max completion length L
(Dr. GRPO). With global values, summing ``compute_loss`` over micro-batches and ranks equals the
single-process loss; the trainer's Megatron rescaling lives in ``train/step.py``, not here.
"""

from __future__ import annotations

import torch

from megatron_gtpo.algo.advantage import completion_mean_entropy
from megatron_gtpo.algo.aggregate import AGG_MODES, aggregate
from megatron_gtpo.algo.checks import as_mask, check_finite, check_float, check_shape
from megatron_gtpo.algo.kl import LOG_RATIO_CLAMP, kl_k3
from megatron_gtpo.algo.registry import get_algorithm

Tensor = torch.Tensor
Metrics = dict[str, Tensor]


def compute_loss(algo: str, *, logp: Tensor, mask: Tensor, advantages: Tensor, old_logp: Tensor | None = None,
                 ref_logp: Tensor | None = None, token_weights: Tensor | None = None,
                 seq_scale: Tensor | None = None, entropy: Tensor | None = None, clip_low: float = 0.2,
                 clip_high: float | None = None, kl_beta: float = 0.0, agg_mode: str | None = None,
                 num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
                 constant: float | None = None) -> tuple[Tensor, Metrics]:
    """Per-micro-batch loss ``-J`` and metrics (module docstring gives the formula).

    Shapes: ``logp``, ``mask``, ``old_logp``, ``ref_logp``, ``token_weights``, ``entropy`` [B, T];
    ``advantages``, ``seq_scale`` [B]. ``clip_high=None`` and ``agg_mode=None`` take the algorithm's
    default (DAPO 0.28, otherwise ``clip_low``; see ``registry.LOSSES``). GTPO requires
    ``token_weights`` and ``seq_scale``; the other algorithms reject ``token_weights``.
    Metrics (detached 0-d tensors, means over this micro-batch's masked tokens): ratio mean/min/max,
    clip fractions low/high, share of tokens with lambda = 0 and lambda >= 2, and, when given, the
    mean completion entropy and the mean k3 KL.
    """
    spec = get_algorithm(algo)
    clip_high = (spec.clip_eps_high or clip_low) if clip_high is None else clip_high
    agg_mode = spec.agg_mode if agg_mode is None else agg_mode
    mask = _validate(spec, logp=logp, mask=mask, advantages=advantages, old_logp=old_logp, ref_logp=ref_logp,
                     token_weights=token_weights, seq_scale=seq_scale, entropy=entropy, clip_low=clip_low,
                     clip_high=clip_high, kl_beta=kl_beta, agg_mode=agg_mode)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(mask, logp, zero)  # padding may hold -inf/NaN log-probs: keep them out of the graph
    if old_logp is None:
        log_ratio = lp - lp.detach()
    else:
        log_ratio = (lp - torch.where(mask, old_logp, zero)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logp.dtype)[:, None].expand_as(lp)
    if token_weights is not None:
        adv = adv * token_weights.to(logp.dtype)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.maximum(-ratio * adv, -clipped * adv)
    kl = None
    if ref_logp is not None:
        kl = kl_k3(lp, torch.where(mask, ref_logp, zero))
        if kl_beta > 0:
            per_token = per_token + kl_beta * kl
    if seq_scale is not None:
        per_token = per_token * seq_scale.to(logp.dtype)[:, None]
    loss = aggregate(per_token, mask, mode=agg_mode, num_tokens=num_tokens, num_seqs=num_seqs, constant=constant)
    metrics = _metrics(mask, ratio=ratio, adv=adv, clip_low=clip_low, clip_high=clip_high, kl=kl,
                       token_weights=token_weights, entropy=entropy)
    return loss, metrics


def policy_loss(algo: str, *, logp: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                token_ids: Tensor | None = None, entropy: Tensor | None = None, mean_entropy: Tensor | None = None,
                old_logp: Tensor | None = None, ref_logp: Tensor | None = None, clip_low: float = 0.2,
                clip_high: float | None = None, kl_beta: float = 0.0, agg_mode: str | None = None,
                constant: float | None = None, **prepare_options) -> tuple[Tensor, Metrics]:
    """Whole-batch, single-process loss: ``prepare_batch`` then ``compute_loss`` with local normalisers.

    ``mean_entropy`` [B] defaults to ``completion_mean_entropy(entropy, mask)``; ``prepare_options``
    go to ``prepare_batch`` (adv_std_scale, adv_eps, conflict_weight, conflict_overlap, pad_id,
    entropy_threshold, entropy_gamma, gtpo_normalization). Returns every metric of both steps.
    """
    from megatron_gtpo.algo.prepare import prepare_batch  # prepare imports this module's siblings only

    if mean_entropy is None and entropy is not None:
        mean_entropy = completion_mean_entropy(entropy, mask)
    prepared = prepare_batch(algo, token_ids=token_ids, mask=mask, rewards=rewards, group_ids=group_ids,
                             mean_entropy=mean_entropy, **prepare_options)
    loss, metrics = compute_loss(algo, logp=logp, mask=mask, old_logp=old_logp, ref_logp=ref_logp,
                                 entropy=entropy, clip_low=clip_low, clip_high=clip_high, kl_beta=kl_beta,
                                 agg_mode=agg_mode, constant=constant, **prepared.loss_inputs())
    return loss, {**prepared.metrics, **metrics}


def _validate(spec, *, logp, mask, advantages, old_logp, ref_logp, token_weights, seq_scale, entropy,
              clip_low, clip_high, kl_beta, agg_mode) -> Tensor:
    mask = as_mask(mask)
    shape = tuple(mask.shape)
    check_float(logp, name="logp")
    for name, value in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp),
                        ("token_weights", token_weights), ("entropy", entropy)):
        if value is not None:
            check_shape(value, shape, name=name, what="[B, T], like mask")
            check_finite(value, name=name, mask=mask)
    for name, value in (("advantages", advantages), ("seq_scale", seq_scale)):
        if value is not None:
            check_shape(value, shape[:1], name=name, what="[B], one per completion")
            check_finite(value, name=name)
    if not (0.0 < clip_low < 1.0 and 0.0 < clip_high < float("inf")):
        raise ValueError(f"clip_low={clip_low!r} must be in (0, 1) and clip_high={clip_high!r} > 0")
    if not (0.0 <= kl_beta < float("inf")):
        raise ValueError(f"kl_beta={kl_beta!r} must be a finite number >= 0")
    if kl_beta > 0 and ref_logp is None:
        raise ValueError(f"kl_beta={kl_beta} needs ref_logp (reference-model log-probs); pass it or set kl_beta=0")
    if agg_mode not in AGG_MODES:
        raise ValueError(f"agg_mode={agg_mode!r} must be one of {AGG_MODES}")
    if spec.conflict_aware and (token_weights is None or seq_scale is None):
        raise ValueError(f"algo={spec.name!r} needs token_weights (lambda) and seq_scale; compute them once "
                         "per global batch with prepare_batch(...) and pass the micro-batch rows")
    if not spec.conflict_aware and token_weights is not None:
        raise ValueError(f"token_weights are GTPO's lambda; algo={spec.name!r} does not use them (pass None)")
    if token_weights is not None and bool((token_weights.detach()[mask] < 0).any()):
        raise ValueError("token_weights must be >= 0 (lambda is 0, 1, W or W*W)")
    return mask


@torch.no_grad()
def _metrics(mask, *, ratio, adv, clip_low, clip_high, kl, token_weights, entropy) -> Metrics:
    count = mask.sum().clamp(min=1).to(ratio.dtype)
    has = bool(mask.any())
    r = ratio.detach()
    one = torch.ones((), dtype=r.dtype, device=r.device)

    def share(flags: Tensor) -> Tensor:
        return (flags & mask).sum().to(r.dtype) / count

    out = {
        "ratio_mean": torch.where(mask, r, 0.0).sum() / count,
        "ratio_min": torch.where(mask, r, float("inf")).min() if has else one,
        "ratio_max": torch.where(mask, r, float("-inf")).max() if has else one,
        # Tokens where the clipped term is the active one and its gradient is zero (TRL's definition).
        "clip_frac_low": share((r < 1.0 - clip_low) & (adv < 0)),
        "clip_frac_high": share((r > 1.0 + clip_high) & (adv > 0)),
    }
    if token_weights is not None:
        out["lambda_zero_frac"] = share(token_weights == 0)
        out["lambda_ge2_frac"] = share(token_weights >= 2)
    if kl is not None:
        out["kl_mean"] = torch.where(mask, kl.detach(), 0.0).sum() / count
    if entropy is not None:
        out["entropy_mean"] = completion_mean_entropy(entropy, mask).mean().to(r.dtype)
    return out
