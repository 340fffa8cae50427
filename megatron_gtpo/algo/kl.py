"""Per-token KL estimator and entropy (docs/algorithms.md sections 1-2)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# exp() of a log-ratio beyond +-20 (a factor of 5e8) only happens for broken inputs; clamping keeps
# the loss finite instead of inf * 0 = NaN.
LOG_RATIO_CLAMP = 20.0


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator of KL(pi_theta || pi_ref) per token [spec 2, DeepSeekMath Eq. 4]:
    ``r - ln r - 1`` with ``r = pi_ref / pi_theta``. Non-negative; gradient flows through ``logp``."""
    log_r = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(log_r) - log_r - 1.0


def entropy_from_logits(logits: Tensor, *, prob_floor: float = 1e-6) -> Tensor:
    """Token entropy ``H = -sum_v p_v ln max(p_v, prob_floor)`` in nats over the last (vocab) dim,
    without gradient, as the official GTPO code computes it (floor 1e-6 inside the log) [spec 5.5].

    ``logits`` [..., V] -> [...]. For tensor-parallel vocabularies the trainer computes the same
    quantity with vocab-parallel reductions; this dense version is the reference for tests."""
    with torch.no_grad():
        probs = torch.softmax(logits.float(), dim=-1)
        return -(probs * probs.clamp(min=prob_floor).log()).sum(dim=-1)
