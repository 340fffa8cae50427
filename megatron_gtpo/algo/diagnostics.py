"""Hidden-objective-bias diagnostics D2-D4 of docs/algorithms.md section 6 (S4, arXiv 2601.05002),
and the algorithm's own token weights omega that D1 (``algo/prefix.py``) and D2 share.

Everything is a pure tensor function of what one training step already holds::

    prepare_batch(spec, ...) -> prepared                (advantages A / A~, lambda, seq_scale, delta)
    omega = token_omega(spec, mask, prepared, num_tokens=..., num_seqs=...)
    c     = omega * prepared.advantages[:, None]       # c_{i,t} = -d loss / d logp_{i,t} at rho = 1
    d2    = surrogate_decomposition(omega, prepared, group_ids, kl_term=...)

* ``token_omega`` (omega): the per-token weight of the policy-gradient term in ``compute_loss``,
  i.e. the aggregation weight of the mode (``aggregate.aggregation_weights``, the same normalisers
  ``aggregate`` divides by) times GTPO's per-completion ``seq_scale`` and token weights ``lambda``
  (times optional mismatch weights). In S4's notation (spec 6, Eq. 1) ``omega_{i,t} = alpha_{i,t}
  s_{i,t}`` at rho = 1; GTPO's ``delta_i`` sits in the advantage ``A~_i = delta_i (A_i - gamma <H>_i)``
  that ``compute_loss`` receives, so ``alpha_{i,t} = delta_i omega_{i,t}`` (``surrogate_decomposition``
  applies it). ``tests/unit/test_algo_diagnostics.py`` checks ``omega * A == -grad`` of the real loss.
* D2 ``surrogate_decomposition``: the loss value at inner step 1 (rho = 1) split as spec 6 Prop. 4.
* D4 ``clip_overshoot`` and ``momentum_step_ratio``: Prop. 3 (mu > 1 only).
* D3 ``small_second_moment_counts``: the Adam-epsilon probe of Prop. 2.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_gtpo.algo.advantage import group_index
from megatron_gtpo.algo.aggregate import aggregate, aggregation_weights
from megatron_gtpo.algo.checks import as_mask, check_finite, check_shape
from megatron_gtpo.algo.losses import clip_regions
from megatron_gtpo.algo.prepare import PreparedBatch, check_shaped
from megatron_gtpo.algo.spec import AlgoSpec

Tensor = torch.Tensor
F64 = torch.float64


def token_omega(spec: AlgoSpec, mask: Tensor, prepared: PreparedBatch, *, num_tokens: float | Tensor | None = None,
                num_seqs: float | Tensor | None = None, is_weights: Tensor | None = None,
                lengths: Tensor | None = None, check: bool = True) -> Tensor:
    """``omega`` [B, T] float64: weight of token (i, t) in the policy-gradient part of ``compute_loss``
    at rho = 1, so that ``-d loss / d logp_{i,t} = omega_{i,t} * prepared.advantages_i`` (spec 1's
    coefficient ``c_{i,t}``; spec 6 Eq. 1 ``alpha s`` with GTPO's delta inside the advantage)::

        omega_{i,t} = aggregation_weight_{i,t}(spec.agg_mode, normalisers) * seq_scale_i * lambda_{i,t} * w_{i,t}

    ``mask`` [B, T] and ``prepared`` hold the same rows (``PreparedBatch.rows``; lambda is cut to the
    mask's width); ``num_tokens``/``num_seqs`` are what ``compute_loss`` gets (the GLOBAL counts in
    the trainer); ``is_weights`` [B, T] the mismatch weights and ``lengths`` [B] the completion
    lengths of ``TokenInputs`` (context parallelism: ``mask`` holds a rank's share). 0 outside ``mask``.
    ``check=False``: no value checks (the train step's per-micro-batch call, no host sync).
    """
    if check:
        mask = as_mask(mask)
    omega = aggregation_weights(mask, mode=spec.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                constant=spec.constant, dtype=F64, lengths=lengths)
    if prepared.seq_scale is not None:
        check_shape(prepared.seq_scale, tuple(mask.shape[:1]), name="seq_scale", what="[B], one per completion")
        omega = omega * prepared.seq_scale.detach().to(F64)[:, None]
    lam = None if prepared.token_weights is None else prepared.token_weights[:, :mask.shape[1]]
    for name, value in (("token_weights", lam), ("is_weights", is_weights)):
        if value is not None:
            check_shape(value, tuple(mask.shape), name=name, what="[B, T], like mask")
            omega = torch.where(mask, omega * value.detach().to(F64), 0.0)   # padding may hold anything
    if check and not bool(torch.isfinite(omega.sum())):   # one cheap pass; the full check to name the place
        check_finite(omega, name="omega (seq_scale x token_weights x is_weights)")
    return omega


def kl_penalty(spec: AlgoSpec, kl: Tensor, mask: Tensor, prepared: PreparedBatch, *,
               num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
               lengths: Tensor | None = None, check: bool = True) -> Tensor:
    """KL part of the loss, ``kl_beta * aggregate(seq_scale_i * k3_{i,t})`` (0-d float64), as
    ``compute_loss`` adds it [spec 2, S4 Eq. 1 ``beta R``]. ``kl`` [B, T] = ``kl_k3(logp, ref_logp)``
    (detached); ``prepared`` the same rows; ``lengths`` as in ``token_omega``. Summable over
    micro-batches (and context-parallel shares) with the GLOBAL normalisers.
    ``check=False``: ``mask`` is a checked bool mask (no host sync)."""
    if check:
        mask = as_mask(mask)
    check_shape(kl, tuple(mask.shape), name="kl", what="[B, T], like mask")
    x = kl.detach().to(F64)
    if prepared.seq_scale is not None:
        x = x * prepared.seq_scale.detach().to(F64)[:, None]
    return spec.kl_beta * aggregate(x, mask, mode=spec.agg_mode, num_tokens=num_tokens, num_seqs=num_seqs,
                                    constant=spec.constant, lengths=lengths)


@dataclass
class SurrogateDecomposition:
    """D2: the surrogate's value at rho = 1 split as spec 6 Prop. 4 (all 0-d float64, loss scale)."""

    adv_term: Tensor
    """``sum_i A_i Omega_i`` with the group-relative (unshaped) ``A`` and ``Omega_i = delta_i sum_t omega_{i,t}``."""
    entropy_term: Tensor
    """GTPO's ``gamma sum_i delta_i <H>_i sum_t omega_{i,t}`` (S4's ``beta R`` with beta = gamma); 0 otherwise."""
    kl_term: Tensor
    """``kl_beta * aggregate(seq_scale k3)``, the loss's KL part (``kl_penalty``); 0 without KL."""
    cov_within: Tensor
    """Pooled within-group covariance ``(1/B) sum_g sum_{i in g} (A_i - mean_g A)(Omega_i - mean_g Omega)``."""
    mean_term: Tensor
    """``sum_g G_g mean_g(A) mean_g(Omega)``: ``adv_term = B * cov_within + mean_term``; 0 for centred A."""

    @property
    def predicted_loss(self) -> Tensor:
        """``-(adv_term - entropy_term) + kl_term``: what ``compute_loss`` must return at rho = 1."""
        return -(self.adv_term - self.entropy_term) + self.kl_term

    def gap(self, loss: Tensor | float, is_term: Tensor | float = 0.0) -> Tensor:
        """``loss - predicted_loss - is_term``: ~0 (float rounding) when ``loss`` is the step-1 loss.
        ``is_term`` is the part of that loss due to the mismatch weights (0 without them)."""
        return (torch.as_tensor(loss, dtype=F64).detach().cpu() - self.predicted_loss.cpu()
                - torch.as_tensor(is_term, dtype=F64).cpu())

    def metrics(self, loss: Tensor | float | None = None, is_term: Tensor | float = 0.0) -> dict[str, Tensor]:
        """``bias/surrogate_*`` values to log; with ``loss`` also ``bias/surrogate_loss_gap``."""
        out = {"bias/surrogate_adv_term": self.adv_term, "bias/surrogate_entropy_term": self.entropy_term,
               "bias/surrogate_kl_term": self.kl_term, "bias/surrogate_cov": self.cov_within}
        if loss is not None:
            out["bias/surrogate_loss_gap"] = self.gap(loss, is_term)
        return out


def surrogate_decomposition(omega: Tensor, prepared: PreparedBatch, group_ids: Tensor, *,
                            kl_term: Tensor | float = 0.0) -> SurrogateDecomposition:
    """D2 [spec 6 Prop. 4, S4 App. A]: at rho = 1 the loss is ``-(sum_i A_i Omega_i - beta R) + KL``.

    ``omega`` [B, T] from ``token_omega`` (whole batch, global normalisers); ``prepared`` the same
    rows: ``advantages`` is what ``compute_loss`` got (GTPO: ``A~ = delta (A - gamma <H>)``),
    ``raw_advantages`` the unshaped ``A`` and ``delta`` GTPO's filter (None: no filter);
    ``kl_term`` from ``kl_penalty``. The entropy part is recovered without gamma:
    ``gamma delta_i <H>_i = delta_i A_i - A~_i``. Expected (Prop. 4): 0 for length-normalised
    weights (GRPO), ``sum_i A_i |o_i| / Z`` for constant ones (DAPO, Dr. GRPO), ``B * Cov(A, Omega)``
    in general.
    """
    check_shaped(prepared)
    check_shape(prepared.advantages, tuple(omega.shape[:1]), name="advantages", what="[B], one per row of omega")
    adv = prepared.advantages.detach().to(F64)
    raw = prepared.raw_advantages.detach().to(F64)
    dlt = torch.ones_like(adv) if prepared.delta is None else prepared.delta.detach().to(F64)
    check_shape(raw, tuple(adv.shape), name="raw_advantages", what="[B], like advantages")
    check_shape(dlt, tuple(adv.shape), name="delta", what="[B], like advantages")
    row_sum = omega.to(F64).sum(dim=1)                         # sum_t omega_{i,t}
    big_omega = dlt * row_sum                                  # spec's Omega_i (delta included)
    index, sizes = group_index(group_ids.to(adv.device))
    sizes = sizes.to(F64)

    def group_mean(x: Tensor) -> Tensor:
        return torch.zeros_like(sizes).index_add_(0, index, x) / sizes

    mean_a, mean_o = group_mean(raw), group_mean(big_omega)
    cov = ((raw - mean_a[index]) * (big_omega - mean_o[index])).sum() / max(raw.numel(), 1)
    return SurrogateDecomposition(
        adv_term=(raw * big_omega).sum(), entropy_term=((dlt * raw - adv) * row_sum).sum(),
        kl_term=torch.as_tensor(kl_term, dtype=F64, device=adv.device).detach(), cov_within=cov,
        mean_term=(sizes * mean_a * mean_o).sum())


def favoured_clip_mask(spec: AlgoSpec, log_ratio: Tensor, prepared: PreparedBatch, mask: Tensor, *,
                       is_weights: Tensor | None = None, check: bool = True) -> Tensor:
    """[B, T] bool: tokens in the advantage-favoured clipped region ``{rho > 1+eps_high, A > 0} U
    {rho < 1-eps_low, A < 0}`` where the clipped term is active and the token's gradient is 0
    [spec 6 D4]. ``log_ratio`` [B, T] = the log of the ratio the surrogate clips
    (``losses.surrogate_log_ratio``: ``logp - old_logp``, GSPO's ``log s_i``); the advantage is the
    loss's own (``prepared.advantages`` times GTPO's lambda and the mismatch weights, so a token with
    weight 0 is never clipped): the region of ``compute_loss``'s ``clip/{low,high}_frac``
    (``losses.clip_regions``). CISPO has no such region (its clipped tokens keep their gradient,
    spec 14): all False."""
    if check:
        mask = as_mask(mask)
    check_shape(log_ratio, tuple(mask.shape), name="log_ratio", what="[B, T], like mask")
    check_shape(prepared.advantages, tuple(mask.shape[:1]), name="advantages", what="[B], one per completion")
    ratio = torch.exp(log_ratio.detach())
    adv = prepared.advantages.detach().to(ratio.dtype)[:, None].expand_as(ratio)
    if prepared.token_weights is not None:
        adv = adv * prepared.token_weights[:, :mask.shape[1]].detach().to(ratio.dtype)
    if is_weights is not None:
        adv = adv * is_weights.detach().to(ratio.dtype)
    if spec.surrogate == "cispo":
        return torch.zeros_like(mask)
    low, high = clip_regions(spec, ratio, adv)
    return mask & (low | high)


@dataclass
class ClipOvershoot:
    """D4 token counts at one inner step k (0-d int64; sum them over micro-batches and DP ranks)."""

    tokens: Tensor
    """Masked tokens."""
    favoured: Tensor
    """Tokens in the advantage-favoured clipped region at step k (``favoured_clip_mask``)."""
    overshoot: Tensor
    """Of those, tokens whose ``|log rho|`` is larger at step k+1 than at step k."""

    def __add__(self, other: "ClipOvershoot") -> "ClipOvershoot":
        return ClipOvershoot(tokens=self.tokens + other.tokens, favoured=self.favoured + other.favoured,
                             overshoot=self.overshoot + other.overshoot)

    def rates(self) -> dict[str, float]:
        """``favoured_frac`` (share of tokens; the trainer logs it as ``clip/{low,high}_frac``) and
        ``overshoot_rate`` (share of the favoured ones, ``bias/clip_overshoot_rate``; 0 when none)."""
        tokens, favoured = int(self.tokens), int(self.favoured)
        return {"favoured_frac": favoured / max(tokens, 1), "overshoot_rate": int(self.overshoot) / max(favoured, 1)}


def clip_overshoot(spec: AlgoSpec, log_ratio: Tensor, next_log_ratio: Tensor, prepared: PreparedBatch, mask: Tensor,
                   *, is_weights: Tensor | None = None, check: bool = True) -> ClipOvershoot:
    """D4 counts for inner step k [spec 6 Prop. 3, D4]: ``log_ratio`` [B, T] = ``logp_k - old_logp``
    measured at step k, ``next_log_ratio`` [B, T] the same tokens at step k+1 (same pi_old). A
    favoured-clipped token has zero gradient of its own, so if its ``|log rho|`` still grows, the
    push came from Adam's momentum (or from other tokens through shared parameters). ``check=False``:
    ``mask`` is a checked bool mask (no host sync)."""
    if check:
        mask = as_mask(mask)
    check_shape(next_log_ratio, tuple(mask.shape), name="next_log_ratio", what="[B, T], like mask")
    region = favoured_clip_mask(spec, log_ratio, prepared, mask, is_weights=is_weights, check=check)
    grows = next_log_ratio.detach().abs() > log_ratio.detach().abs()
    return ClipOvershoot(tokens=mask.sum(), favoured=region.sum(), overshoot=(region & grows).sum())


def momentum_step_ratio(enter_step: int, k: int, *, beta1: float, beta2: float) -> float:
    """``C_{T,k} = ||dtheta_{T+k}|| / ||dtheta_{T-1}||`` of Adam once the gradient is 0 from step T on
    [spec 6 Prop. 3, S4 App. D Eq. 31-37], bias corrections included (``T = enter_step`` >= 2 is the
    1-based Adam step count of the first zero-gradient step, ``k >= 0``)::

        C_{T,k} = beta1^(k+1) (1 - beta1^(T-1)) / (1 - beta1^(T+k))
                  * sqrt((1 - beta2^(T+k)) / (beta2^(k+1) (1 - beta2^(T-1))))

    Exact for any gradient history when Adam's eps is negligible against sqrt(v_hat) and every
    coordinate enters the region at the same step: ``m`` and ``v`` then only decay by beta1, beta2.
    """
    if not (isinstance(enter_step, int) and enter_step >= 2 and isinstance(k, int) and k >= 0):
        raise ValueError(f"enter_step={enter_step!r} must be an int >= 2 and k={k!r} an int >= 0")
    _check_betas(beta1, beta2)
    t_prev, t_now = enter_step - 1, enter_step + k
    first = beta1 ** (k + 1) * (1 - beta1 ** t_prev) / (1 - beta1 ** t_now)
    return first * math.sqrt((1 - beta2 ** t_now) / (beta2 ** (k + 1) * (1 - beta2 ** t_prev)))


def momentum_step_ratio_limit(k: int, *, beta1: float, beta2: float) -> float:
    """Large-T limit of ``momentum_step_ratio``: ``(beta1 / sqrt(beta2))^(k+1)`` (0.923^(k+1) at (0.9, 0.95))."""
    _check_betas(beta1, beta2)
    return (beta1 / math.sqrt(beta2)) ** (k + 1)


def adam_update_sq_norm(exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], *, step: int, lr: float,
                        beta1: float, beta2: float, eps: float) -> Tensor:
    """``||dtheta||^2`` (0-d float64) of the Adam step just taken, from the optimizer state alone (no
    parameter copy): ``dtheta = lr m_hat / (sqrt(v_hat) + eps)`` with torch.optim.Adam's bias
    corrections at ``step`` (1-based). Decoupled weight decay (AdamW) is NOT included: Prop. 3 is about
    the momentum part. For sharded optimizer states, sum the result over the shards' ranks."""
    if len(exp_avgs) != len(exp_avg_sqs):
        raise ValueError(f"exp_avgs ({len(exp_avgs)}) and exp_avg_sqs ({len(exp_avg_sqs)}) must pair up")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"step={step!r} must be the optimizer's 1-based step count")
    _check_betas(beta1, beta2)
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    total = torch.zeros((), dtype=F64)
    for m, v in zip(exp_avgs, exp_avg_sqs):
        upd = (lr / bc1) * m.detach().to(F64) / (v.detach().to(F64).sqrt() / math.sqrt(bc2) + eps)
        total = total + upd.square().sum().cpu()
    return total


def small_second_moment_counts(exp_avg_sqs: Sequence[Tensor], *, step: int, beta2: float, eps: float,
                               factor: float = 10.0) -> tuple[Tensor, Tensor]:
    """D3 probe [spec 6 Prop. 2, D3]: ``(small, total)`` 0-d int64 counts of Adam second-moment entries
    with ``sqrt(v_hat) < factor * eps``, ``v_hat = exp_avg_sq / (1 - beta2^step)``. There Adam's eps
    is not negligible, so rescaling the reward changes the update (reward-scale invariance breaks).
    Compared in each tensor's own dtype (no float64 copy of the optimizer state); sum the counts
    over ranks for sharded states, fraction = small / total."""
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"step={step!r} must be the optimizer's 1-based step count")
    if not (0.0 <= beta2 < 1.0 and eps > 0 and factor > 0):
        raise ValueError(f"need 0 <= beta2 < 1 (got {beta2!r}), eps > 0 (got {eps!r}), factor > 0 (got {factor!r})")
    threshold = (factor * eps) ** 2 * (1 - beta2 ** step)      # v_hat < (f eps)^2  <=>  v < (f eps)^2 bc2
    small = torch.zeros((), dtype=torch.long)
    total = 0
    for v in exp_avg_sqs:
        small = small + (v.detach() < threshold).sum().cpu()
        total += v.numel()
    return small, torch.tensor(total, dtype=torch.long)


def _check_betas(beta1: float, beta2: float) -> None:
    if not (0.0 <= beta1 < 1.0 and 0.0 < beta2 < 1.0):
        raise ValueError(f"betas ({beta1!r}, {beta2!r}) must satisfy 0 <= beta1 < 1 and 0 < beta2 < 1")
