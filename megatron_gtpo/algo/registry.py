"""The four algorithms as data: what each one changes in the shared surrogate (spec section 9).

``LOSSES`` is the only place an algorithm name is looked up, by ``AlgoConfig.resolve`` (once per
run). All four share one per-token surrogate (``losses.compute_loss``); they differ in the
advantage, the aggregation normaliser, the clip range, the KL weight and GTPO's token weights /
sequence scales.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """Per-algorithm defaults; ``AlgoConfig`` fields left at ``None`` resolve to these."""

    name: str
    """Registry key: gtpo, grpo, drgrpo or dapo."""
    std_scale: bool
    """Divide the centred reward by the group std (GRPO, DAPO) or not (Dr. GRPO, GTPO)."""
    agg_mode: str
    """Default aggregation mode, see ``algo/aggregate.py``."""
    clip_eps_high: float | None
    """Upper clip epsilon; None means the same as the lower one (symmetric clip)."""
    kl_beta: float
    """Default weight of the k3 KL penalty against the reference policy."""
    conflict_aware: bool
    """Uses GTPO's token weights lambda, entropy filter/shift and per-sequence scales."""
    dynamic_sampling: bool
    """Default for DAPO's drop-groups-with-equal-accuracy filter."""
    overlong_buffer_len: int
    """Default soft-overlong buffer L_cache in tokens; 0 disables the punishment."""


LOSSES: dict[str, Algorithm] = {
    # GTPO official code [spec 5, 5.10]: R - mean, seq-mean with per-completion scales, no KL, mu = 1.
    "gtpo": Algorithm(name="gtpo", std_scale=False, agg_mode="seq-mean-token-mean", clip_eps_high=None,
                      kl_beta=0.0, conflict_aware=True, dynamic_sampling=False, overlong_buffer_len=0),
    # DeepSeekMath [spec 2]: z-score, seq-mean-token-mean, k3 KL with beta 0.04.
    "grpo": Algorithm(name="grpo", std_scale=True, agg_mode="seq-mean-token-mean", clip_eps_high=None,
                      kl_beta=0.04, conflict_aware=False, dynamic_sampling=False, overlong_buffer_len=0),
    # Dr. GRPO [spec 3]: R - mean, sum / (G * L), beta 0 in the public recipes.
    "drgrpo": Algorithm(name="drgrpo", std_scale=False, agg_mode="seq-mean-token-sum-norm", clip_eps_high=None,
                        kl_beta=0.0, conflict_aware=False, dynamic_sampling=False, overlong_buffer_len=0),
    # DAPO [spec 4]: z-score, token-mean, clip-higher 0.28, no KL, dynamic sampling, L_cache 4096.
    "dapo": Algorithm(name="dapo", std_scale=True, agg_mode="token-mean", clip_eps_high=0.28,
                      kl_beta=0.0, conflict_aware=False, dynamic_sampling=True, overlong_buffer_len=4096),
}
