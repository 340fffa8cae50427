"""Is a recipe in the regime its algorithm was designed for? Per-step guards' inputs (pure tensors).

GTPO's shaped advantage ``A~_i = delta_i (A_i - gamma <H>_i)`` has no std normalisation, so how much
of the update the entropy shift ``gamma <H>_i`` carries depends on the reward's scale: under 1% of
the coefficient mass on the paper's 0-20 reward, 65-71% on a 0/1 reward in this project's first
learning study (docs/results.md). The shift is not centred and is divided by ``|o_i|``, so in an
equal-reward group it is a policy gradient on ``-gamma <H>(y) / |y|``, a reward that grows with
length (docs/algorithms.md "Reward scale and the entropy shift"). These functions measure it::

    c_i   = A~_i * omega_i / |o_i|            per-token coefficient of completion i (rho = 1)
    shift_share  = sum_i |s_i| / (sum_i |a_i| + sum_i |s_i|),  a_i = delta_i A_i w_i,  s_i = delta_i gamma <H>_i w_i
    length_drift = sum_i c_i (|o_i| - mean_{g(i)} |o|) / sum_i |c_i|        (D5)
    equal_groups = share of groups whose rewards are all equal (their A_i are all 0)

with ``w_i = sum_t omega_{i,t} / |o_i|`` (``token_omega``: aggregation, GTPO's per-completion scale
and lambda, averaged over the completion's tokens). D5 is the first-order direction in which a step
moves the expected completion length when each completion's log-probability moves by ``c_i``
(review ``gtpo_learning.md`` section 3.1): < 0 shorter, > 0 longer; normalised per step, because
with a binding grad clip every step has the same norm.
"""

from __future__ import annotations

import torch

from megatron_gtpo.algo.advantage import group_index
from megatron_gtpo.algo.checks import check_shape
from megatron_gtpo.algo.prepare import PreparedBatch, check_shaped

Tensor = torch.Tensor
F64 = torch.float64


def completion_coefficients(omega: Tensor, prepared: PreparedBatch, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """``(a, s)`` [B] float64: the advantage part ``delta_i A_i w_i`` and the entropy-shift part
    ``delta_i gamma <H>_i w_i`` of each completion's per-token coefficient ``c_i = a_i - s_i``
    (module docstring); ``s`` is 0 for algorithms without the shift."""
    check_shaped(prepared)
    check_shape(lengths, tuple(omega.shape[:1]), name="lengths", what="[B], completion tokens per row of omega")
    per_token = omega.to(F64).sum(dim=1) / lengths.to(F64).clamp(min=1)
    shaped = prepared.advantages.detach().to(F64)
    delta = torch.ones_like(shaped) if prepared.delta is None else prepared.delta.detach().to(F64)
    adv = delta * prepared.raw_advantages.detach().to(F64)
    return adv * per_token, (adv - shaped) * per_token


def regime_metrics(omega: Tensor, prepared: PreparedBatch, group_ids: Tensor, lengths: Tensor) -> dict[str, Tensor]:
    """``gtpo/shift_share``, ``bias/length_drift`` (D5) and ``batch/equal_groups_frac`` of one whole
    batch (module docstring). ``omega`` [B, T] from ``token_omega`` with the loss's normalisers,
    ``prepared`` the same rows after GTPO's shaping, ``group_ids``/``lengths`` [B]. A step with no
    weight at all (every coefficient 0) reports 0 for the share and the drift."""
    a, s = completion_coefficients(omega, prepared, lengths)
    coef = a - s
    index, sizes = group_index(group_ids.to(coef.device))
    length = lengths.to(F64).to(coef.device)
    mean_len = torch.zeros(sizes.shape, dtype=F64, device=coef.device).index_add_(0, index, length) / sizes.to(F64)
    mass = coef.abs().sum()
    raw = prepared.raw_advantages.detach()
    nonzero = torch.zeros(sizes.shape, dtype=torch.long, device=raw.device).index_add_(0, index, (raw != 0).long())
    both = a.abs().sum() + s.abs().sum()
    zero = torch.zeros((), dtype=F64)
    return {"gtpo/shift_share": s.abs().sum() / both if both > 0 else zero,
            "bias/length_drift": (coef * (length - mean_len[index])).sum() / mass if mass > 0 else zero,
            "batch/equal_groups_frac": (nonzero == 0).to(F64).mean()}
