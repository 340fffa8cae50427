"""Train-inference mismatch correction: per-token importance weights ``pi_train / pi_sampler``.

The rollout engine (vLLM) samples from ``pi_sampler``; the trainer's policy at the start of the
rollout step, ``pi_old`` (same weights, different kernels and precision), is what the surrogate
assumes. The token-level correction multiplies each token's policy-gradient term by a detached,
bounded weight of ``r = pi_old(o_t) / pi_sampler(o_t)``:

* ``"tis"``, truncated importance sampling: ``w = min(r, C)`` (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"; TRL's vLLM importance-sampling cap).
* ``"mis"``, masked importance sampling: ``w = r`` if ``C_low <= r <= C`` else 0 (IcePop, Ling team
  2025; verl ``rollout_is`` "mask" mode). Masking only the top would keep tokens the sampler found
  far MORE likely than the trainer (``r << 1``), which are as much a sign of a kernel or weight-sync
  fault as ``r >> 1``; so ``C_low`` defaults to ``1/C`` (two-sided, as IcePop), and ``mismatch_cap_low=0``
  gives the one-sided version. A masked token keeps its place in the loss normaliser (its weight is
  0, it is not removed from ``mask``): the normalisers are global counts fixed before the loss, and at
  mu = 1 the ratio is only known inside each micro-batch's loss (cf. slime PR #657 / verl #3915, which
  remove rejected tokens from the denominator when the ratios are known in advance).
* ``"none"``: no weights (``None``); the loss is bit-identical to the uncorrected one.

Composition (``TokenInputs(is_weights=w)``): ``w`` multiplies the advantage of each token next
to GTPO's ``lambda`` (``A lambda w``), i.e. the whole clipped term ``w * min(rho A lambda, clip(rho)
A lambda)`` since ``w >= 0``; the KL term is not weighted; lambda, delta and the conflict masks are
unchanged. With mu > 1, ``rho = pi_theta / pi_old`` is clipped as usual and ``w`` is computed ONCE
per rollout batch from ``old_logp`` (pi_old) and kept for all inner steps: the full ratio
``pi_theta / pi_sampler = rho * r`` is the decoupled-PPO product (clip the first factor, truncate or
mask the second). With mu = 1, ``old_logp`` is ``logp.detach()`` of the same forward pass.
"""

from __future__ import annotations

import torch

from megatron_gtpo.algo.aggregate import masked_extremum
from megatron_gtpo.algo.checks import as_mask, check_float, check_shape
from megatron_gtpo.algo.kl import LOG_RATIO_CLAMP
from megatron_gtpo.algo.spec import AlgoSpec

Tensor = torch.Tensor


def mismatch_weights(spec: AlgoSpec, train_logp: Tensor, sampler_logp: Tensor, mask: Tensor, *,
                     check: bool = True) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Per-token correction weights ``w`` [B, T] (detached, train_logp's dtype, 1 outside ``mask``) and
    their metrics, for ``spec.mismatch_correction`` with ``C = spec.mismatch_cap`` and ``C_low =
    spec.mismatch_cap_low`` (module docstring gives the formulas and the composition with the loss).
    ``"none"`` returns ``(None, {})``. ``check=False``: ``mask`` is a checked bool prefix mask (no
    host sync; see ``checks.py``).

    ``train_logp`` [B, T]: pi_old log-probs of the sampled tokens (``old_logp``, or ``logp.detach()`` at
    mu = 1); ``sampler_logp`` [B, T]: the engine's log-probs of the same tokens, same temperature.
    Metrics (0-d, over this call's masked tokens; ``*_max``/``*_min`` are extrema, the rest token
    means, reduced by the trainer like ``compute_loss``'s): ``mismatch/is_weight_mean``,
    ``mismatch/is_weight_max``, ``mismatch/is_ratio_min``, ``mismatch/is_ratio_max`` and
    ``mismatch/is_cut_frac`` (tis: share with r > C, whose weight is truncated; mis: share outside
    [C_low, C], whose weight is 0).
    """
    mode, cap = spec.mismatch_correction, spec.mismatch_cap
    if mode == "none":
        return None, {}
    if check:
        mask = as_mask(mask)
    for name, value in (("train_logp", train_logp), ("sampler_logp", sampler_logp)):
        check_float(value, name=name)
        check_shape(value, tuple(mask.shape), name=name, what="[B, T], like mask")
    zero = torch.zeros((), dtype=train_logp.dtype, device=train_logp.device)
    log_r = torch.where(mask, train_logp.detach() - sampler_logp.detach().to(train_logp.dtype), zero)
    ratio = torch.exp(log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if mode == "tis":
        cut = ratio > cap
        weights = ratio.clamp(max=cap)
    else:
        cut = (ratio > cap) | (ratio < spec.mismatch_cap_low)
        weights = torch.where(cut, zero, ratio)
    weights = torch.where(mask, weights, torch.ones_like(weights))
    return weights, _metrics(mask, ratio, weights, cut)


@torch.no_grad()
def _metrics(mask: Tensor, ratio: Tensor, weights: Tensor, cut: Tensor) -> dict[str, Tensor]:
    count = mask.sum().clamp(min=1).to(ratio.dtype)
    return {
        "mismatch/is_weight_mean": torch.where(mask, weights, 0.0).sum() / count,
        "mismatch/is_weight_max": masked_extremum(weights, mask, largest=True),
        "mismatch/is_ratio_min": masked_extremum(ratio, mask, largest=False),
        "mismatch/is_ratio_max": masked_extremum(ratio, mask, largest=True),
        "mismatch/is_cut_frac": (cut & mask).sum().to(ratio.dtype) / count,
    }
