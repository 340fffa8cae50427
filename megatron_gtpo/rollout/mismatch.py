"""Train-inference mismatch: how far the engine's sampler log-probs are from the trainer's.

Both sides score the same sampled tokens under the same (temperature-scaled) policy weights, so in
exact arithmetic the difference is zero. What remains measures kernel and precision differences
between vLLM and Megatron (and any stale weights); the loop logs it every step.
"""

from __future__ import annotations

import torch


def logprob_mismatch(engine_lp: torch.Tensor, trainer_lp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean and max of ``|engine_lp - trainer_lp|`` over the tokens where ``mask`` is set.

    Args:
        engine_lp: ``[B, S]`` sampler log-probs reported by the rollout engine.
        trainer_lp: ``[B, S]`` the trainer's log-probs of the same tokens (no grad needed).
        mask: ``[B, S]`` bool/0-1, true on sampled completion tokens.

    Returns ``train_infer/logprob_abs_diff_mean``, ``.../logprob_abs_diff_max``, the signed mean
    ``train_infer/logprob_diff_mean`` (engine minus trainer) and ``train_infer/num_tokens``; all
    zero when the mask is empty.
    """
    if engine_lp.shape != trainer_lp.shape or engine_lp.shape != mask.shape:
        raise ValueError(f"shapes differ: engine {tuple(engine_lp.shape)}, trainer {tuple(trainer_lp.shape)}, "
                         f"mask {tuple(mask.shape)}")
    keep = mask.bool()
    diff = engine_lp.detach().double()[keep] - trainer_lp.detach().double()[keep]
    if diff.numel() == 0:
        return {"train_infer/logprob_abs_diff_mean": 0.0, "train_infer/logprob_abs_diff_max": 0.0,
                "train_infer/logprob_diff_mean": 0.0, "train_infer/num_tokens": 0.0}
    if not torch.isfinite(diff).all():
        raise ValueError("non-finite log-prob on a masked token (a -inf sampler log-prob means the token "
                         "was outside the nucleus: check top_p and the temperature passed to the trainer)")
    return {"train_infer/logprob_abs_diff_mean": diff.abs().mean().item(),
            "train_infer/logprob_abs_diff_max": diff.abs().max().item(),
            "train_infer/logprob_diff_mean": diff.mean().item(),
            "train_infer/num_tokens": float(diff.numel())}
