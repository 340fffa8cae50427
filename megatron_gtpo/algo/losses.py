"""The shared policy-gradient surrogate of GRPO, Dr. GRPO, DAPO, GTPO, GSPO and CISPO (spec 2-6, 13, 14).

Per token, with ``rho = exp(logp - old_logp)`` (``exp(logp - logp.detach())`` when ``old_logp`` is
None, i.e. mu = 1: value 1, gradient of log pi, clipping inactive)::

    x_{i,t} = seq_scale_i * ( lambda_{i,t} w_{i,t} * P_{i,t} + kl_beta * k3(ref_logp, logp) )
    loss    = aggregate(x, mask, mode=agg_mode, num_tokens, num_seqs, constant)       # = -J

with the policy term ``P`` of ``spec.surrogate`` (``a = A_i``, clip = ``clip(., 1-eps_low, 1+eps_high)``)::

    clip  (PPO; GRPO, Dr. GRPO, DAPO, GTPO):  max(-rho a, -clip(rho) a)
    gspo  (spec 13):  s_{i,t} = exp(logp - sg(logp) + sg(log s_i)),  max(-s_{i,t} a, -clip(s_{i,t}) a)
    cispo (spec 14):  -sg(clip(rho)) a exp(log rho - sg(log rho))

GSPO's ``log s_i = (1/|o_i|) sum_t log rho_{i,t}`` is the whole completion's mean log-ratio
(``sequence_log_ratio``; under context parallelism summed over the CP group by the train step,
``TokenInputs.seq_log_ratio``): this token form (the paper's "GSPO-token" with ``A_{i,t} = A_i``, as
verl writes it) has GSPO's value and gradient under seq-mean-token-mean, since
``s_{i,t}`` has the value ``s_i`` on every token and ``(1/|o_i|) sum_t s_i grad logp_t = grad s_i``.
CISPO's value is ``-clip(rho) a`` and its gradient ``-sg(clip(rho)) a grad log pi``: the gradient of the
paper's ``sg(clip(rho)) A log pi`` (Eq. 4-5), with a value that at ``rho = 1`` is the other surrogates'
(so D2's decomposition holds for it too).

``w`` (``TokenInputs.is_weights``, absent = 1) are the optional train-inference mismatch weights
(``importance.py``, ``algo.mismatch_correction``); like lambda they multiply the advantage, not the KL.

``lambda`` (GTPO token weights, >= 0) multiplies the advantage, so ``lambda * min(rho A, clip A) =
min(rho lambda A, clip lambda A)``: S4's casting of GTPO with ``alpha = delta lambda / (G |o_i|)``.
``seq_scale`` (GTPO's per-completion normaliser, see ``prepare.py``) and ``A`` are computed ONCE per
global batch by ``prepare_groups`` and passed in per micro-batch; GTPO's shaped ``A~`` needs each
row's own ``<H>_i`` only (``shape_rows``, per micro-batch in the train step, or ``prepare_batch``
for a whole batch).

Where the normalisers come from: ``num_tokens`` = masked tokens of the global batch (token-mean),
``num_seqs`` = completions of the global batch (seq-mean-*), ``spec.constant`` = max completion
length L (Dr. GRPO). With global values, summing ``compute_loss`` over micro-batches and ranks
equals the single-process loss; the trainer's Megatron rescaling lives in ``train/step.py``.

This is the hot path (one call per micro-batch): it checks nothing but that GTPO rows were shaped
(a Python flag) and reads no device value back (no host sync). ``validate_loss_inputs`` checks a
whole global batch once per step, at the batch boundary (``train/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.algo.aggregate import aggregate, masked_extremum
from megatron_gtpo.algo.checks import as_mask, check_finite, check_float, check_shape
from megatron_gtpo.algo.kl import LOG_RATIO_CLAMP, kl_k3
from megatron_gtpo.algo.prepare import PreparedBatch, check_shaped
from megatron_gtpo.algo.spec import AlgoSpec

Tensor = torch.Tensor
Metrics = dict[str, Tensor]


@dataclass(kw_only=True)
class TokenInputs:
    """Per-token tensors of the completions being scored, in the completion view (under context
    parallelism: the tokens one rank computes, ``mask`` holding those and ``lengths`` the whole ones)."""

    logp: Tensor  # [B, T] float, carries the gradient
    """log pi_theta of each sampled completion token (at the sampling temperature)."""
    mask: Tensor  # [B, T] bool
    """Prefix mask: True on the first |o_i| columns of row i."""
    old_logp: Tensor | None = None  # [B, T]
    """pi_old log-probs when mu > 1; None: the ratio is exp(logp - logp.detach())."""
    ref_logp: Tensor | None = None  # [B, T]
    """Reference-model log-probs for the KL term (kl_beta > 0)."""
    is_weights: Tensor | None = None  # [B, T] float >= 0, detached
    """Train-inference mismatch weights (``importance.mismatch_weights``) multiplying each token's
    advantage next to lambda; None: no correction (the loss is then bit-identical to the plain one)."""
    lengths: Tensor | None = None  # [B] long
    """Completion lengths ``|o_i|`` when ``mask`` holds only part of each completion (context
    parallelism: the tokens this rank computes); None: ``mask.sum(dim=1)``."""
    seq_log_ratio: Tensor | None = None  # [B] float, detached
    """GSPO: ``log s_i``, each WHOLE completion's mean of ``logp - old_logp`` (``sequence_log_ratio``);
    None: computed from this call's tokens, which must then hold whole completions (not CP shares)."""


def compute_loss(spec: AlgoSpec, tokens: TokenInputs, prepared: PreparedBatch, *,
                 num_tokens: float | Tensor | None = None,
                 num_seqs: float | Tensor | None = None) -> tuple[Tensor, Metrics]:
    """Loss ``-J`` of the rows in ``tokens`` (module docstring gives the formula) and its metrics.

    ``prepared`` holds the same rows (``PreparedBatch.rows``); its ``token_weights`` may be wider
    than ``tokens`` (the global batch's width) and are cut to it. ``num_tokens``/``num_seqs``: the
    global normalisers (None: this call's own counts, single-process use). Metrics are detached 0-d
    tensors, means over this call's masked tokens: ``train/ratio_{mean,min,max}``,
    ``clip/{low,high}_frac`` and, with a reference model, ``train/kl_mean``.
    """
    check_shaped(prepared)
    logp, mask = tokens.logp, tokens.mask
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    lp = torch.where(mask, logp, zero)  # padding may hold -inf/NaN log-probs: keep them out of the graph
    if tokens.old_logp is None:
        log_ratio = lp - lp.detach()
    else:
        log_ratio = (lp - torch.where(mask, tokens.old_logp, zero)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    adv = prepared.advantages.to(logp.dtype)[:, None].expand_as(lp)
    if prepared.token_weights is not None:
        adv = adv * prepared.token_weights[:, :lp.shape[1]].to(logp.dtype)
    if tokens.is_weights is not None:
        adv = adv * tokens.is_weights.detach().to(logp.dtype)
    per_token, ratio = _policy_term(spec, lp, log_ratio, adv, tokens)
    kl = None
    if tokens.ref_logp is not None:
        kl = kl_k3(lp, torch.where(mask, tokens.ref_logp, zero))
        if spec.kl_beta > 0:
            per_token = per_token + spec.kl_beta * kl
    if prepared.seq_scale is not None:
        per_token = per_token * prepared.seq_scale.to(logp.dtype)[:, None]
    loss = aggregate(per_token, mask, mode=spec.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                     constant=spec.constant, lengths=tokens.lengths)
    return loss, _metrics(mask, ratio=ratio, adv=adv, spec=spec, kl=kl)


def _policy_term(spec: AlgoSpec, lp: Tensor, log_ratio: Tensor, adv: Tensor,
                 tokens: TokenInputs) -> tuple[Tensor, Tensor]:
    """``(P, ratio)`` [B, T]: the policy term of ``spec.surrogate`` (module docstring) and the ratio it
    clips (GSPO: ``s_i`` on every token of completion i), from the masked log-probs ``lp`` and the
    token log-ratios ``log_ratio`` (both carrying the gradient)."""
    if spec.surrogate == "gspo":
        seq = tokens.seq_log_ratio
        if seq is None:
            seq = sequence_log_ratio(log_ratio, tokens.mask, lengths=tokens.lengths)
        seq = seq.detach().to(lp.dtype).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_ratio = (lp - lp.detach()) + seq[:, None]    # value log s_i, gradient of log pi (verl's order)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - spec.clip_eps_low, 1.0 + spec.clip_eps_high)
    if spec.surrogate == "cispo":   # the weight detached, the gradient through log pi only
        return -clipped.detach() * adv * torch.exp(log_ratio - log_ratio.detach()), ratio
    return torch.maximum(-ratio * adv, -clipped * adv), ratio


def validate_loss_inputs(spec: AlgoSpec, prepared: PreparedBatch, *, mask: Tensor, old_logp: Tensor | None = None,
                         ref_logp: Tensor | None = None, sampler_logp: Tensor | None = None,
                         old_logp_later: bool = False) -> None:
    """Checks the loss inputs of a set of rows once per step (shapes, masks, finiteness, what the
    algorithm needs), so bad input fails with a message naming the argument instead of a NaN loss.

    ``mask``/``old_logp``/``ref_logp``/``sampler_logp`` [B, T] and ``prepared`` hold the same B rows;
    the engine's ``sampler_logp`` is checked only when a mismatch correction uses it. ``prepared``
    may still need GTPO's ``shape_rows`` (its unshaped advantages are checked; the shaping checks
    ``<H>_i`` itself). ``old_logp_later``: pi_old is no input here but the detached log-probs of the
    first update's own forward (the train step's one pass), so mu > 1 needs no ``old_logp``.
    """
    mask = as_mask(mask)
    shape = tuple(mask.shape)
    if spec.mismatch_correction == "none":
        sampler_logp = None
    elif sampler_logp is None:
        raise ValueError(f"mismatch_correction={spec.mismatch_correction!r} needs sampler_logp (the engine's "
                         "log-probs of the sampled tokens)")
    for name, value in (("old_logp", old_logp), ("ref_logp", ref_logp), ("sampler_logp", sampler_logp)):
        if value is not None:
            check_float(value, name=name)
            check_shape(value, shape, name=name, what="[B, T], like mask")
            check_finite(value, name=name, mask=mask)
    for name, value in (("advantages", prepared.advantages), ("seq_scale", prepared.seq_scale)):
        if value is not None:
            check_shape(value, shape[:1], name=name, what="[B], one per completion")
            check_finite(value, name=name)
    if spec.kl_beta > 0 and ref_logp is None:
        raise ValueError(f"kl_beta={spec.kl_beta} needs ref_logp (reference-model log-probs)")
    if spec.needs_old_logp and old_logp is None and not old_logp_later:
        raise ValueError(f"mu={spec.mu} needs old_logp (pi_old log-probs from a forward before the first update)")
    if spec.conflict_aware and (prepared.token_weights is None or prepared.seq_scale is None):
        raise ValueError(f"algo={spec.name!r} needs token_weights (lambda) and seq_scale from prepare_batch")
    if not spec.conflict_aware and prepared.token_weights is not None:
        raise ValueError(f"token_weights are GTPO's lambda; algo={spec.name!r} does not use them")
    if prepared.token_weights is not None and bool((prepared.token_weights[:, :shape[1]][mask] < 0).any()):
        raise ValueError("token_weights must be >= 0 (lambda is 0, 1, W or W*W)")


@torch.no_grad()
def _metrics(mask, *, ratio, adv, spec: AlgoSpec, kl) -> Metrics:
    count = mask.sum().clamp(min=1).to(ratio.dtype)
    r = ratio.detach()
    low, high = clip_regions(spec, r, adv.detach())

    def share(flags: Tensor) -> Tensor:
        return (flags & mask).sum().to(r.dtype) / count

    out = {
        "train/ratio_mean": torch.where(mask, r, 0.0).sum() / count,
        "train/ratio_min": masked_extremum(r, mask, largest=False),
        "train/ratio_max": masked_extremum(r, mask, largest=True),
        "clip/low_frac": share(low),
        "clip/high_frac": share(high),
    }
    if kl is not None:
        out["train/kl_mean"] = torch.where(mask, kl.detach(), 0.0).sum() / count
    return out


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor, *, lengths: Tensor | None = None) -> Tensor:
    """GSPO's ``log s_i`` [B] (detached): ``(1/|o_i|) sum_t log rho_{i,t}`` over the masked tokens of
    ``log_ratio`` [B, T] (``logp - old_logp``), ``|o_i|`` = ``lengths`` or ``mask.sum(dim=1)``; 0 for an
    empty row. ``mask`` must hold whole completions (under CP the train step sums the shares first)."""
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    total = torch.where(mask, log_ratio.detach(), zero).sum(dim=1)
    count = mask.sum(dim=1) if lengths is None else lengths.to(mask.device)
    return total / count.clamp(min=1).to(total.dtype)


def clip_regions(spec: AlgoSpec, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor]:
    """``(low, high)`` [B, T] bool: where the clip acts on each token, from the clipped ratio's value
    ``ratio`` (GSPO: ``s_i`` on every token of completion i) and the token's advantage ``adv`` (times
    lambda and the mismatch weights), the one rule of ``clip/{low,high}_frac`` and of D4.

    clip, gspo: the clipped term is the active one and the token's gradient is 0 (TRL's definition):
    ``{rho < 1-eps_low, A < 0}``, ``{rho > 1+eps_high, A > 0}``. cispo: the IS weight is truncated
    (``rho`` outside the range, any advantage); its gradient is kept, only its weight is capped."""
    below, above = ratio < 1.0 - spec.clip_eps_low, ratio > 1.0 + spec.clip_eps_high
    if spec.surrogate == "cispo":
        return below, above
    return below & (adv < 0), above & (adv > 0)


def surrogate_log_ratio(spec: AlgoSpec, tokens: TokenInputs) -> Tensor:
    """[B, T] detached log of the ratio the surrogate clips, 0 outside the mask: ``token_log_ratio``,
    or GSPO's ``log s_i`` on every token of completion i (``tokens.seq_log_ratio`` or
    ``sequence_log_ratio``); 0 everywhere at mu = 1 (no ``old_logp``). D4 (``train/observer.py``) reads it."""
    mask = tokens.mask
    if tokens.old_logp is None:
        return torch.zeros_like(tokens.logp).detach()
    log_ratio = token_log_ratio(tokens.logp, tokens.old_logp, mask)
    if spec.surrogate != "gspo":
        return log_ratio
    seq = tokens.seq_log_ratio
    if seq is None:
        seq = sequence_log_ratio(log_ratio, mask, lengths=tokens.lengths)
    zero = torch.zeros((), dtype=log_ratio.dtype, device=mask.device)
    return torch.where(mask, seq.detach().to(log_ratio.dtype).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None], zero)


def token_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """[B, T] detached ``logp - old_logp`` clamped to +-LOG_RATIO_CLAMP, 0 outside ``mask``: the value
    of ``compute_loss``'s per-token log-ratio (GSPO's ``log s_i`` averages it)."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    diff = torch.where(mask, logp.detach(), zero) - torch.where(mask, old_logp.detach().to(logp.dtype), zero)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
