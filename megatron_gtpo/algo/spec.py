"""``AlgoSpec``: one algorithm with every setting resolved, handed to the pure functions of ``algo/``.

    AlgoConfig (recipe, fields may be None) --AlgoConfig.resolve(max_completion_tokens)--> AlgoSpec

The recipe's ``None`` fields take the algorithm's defaults from ``registry.LOSSES`` exactly once, in
``AlgoConfig.resolve``; below that nothing looks an algorithm up by name or fills in a default, so
the advantage, the conflict weights and the loss can never disagree about a setting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class AlgoSpec:
    """A fully resolved algorithm (spec algorithms.md section 9 lists the values per algorithm)."""

    name: str
    """gtpo, grpo, drgrpo or dapo (for logs and errors only: behaviour follows the fields below)."""
    conflict_aware: bool
    """GTPO: token weights lambda, entropy filter delta, entropy shift gamma, per-completion scales."""
    std_scale: bool
    """Divide ``R - mean`` by the group's unbiased std + ``adv_eps`` (GRPO, DAPO)."""
    adv_eps: float
    """Added to the group std before dividing."""
    agg_mode: str
    """Aggregation mode of ``aggregate.py`` (token-mean, seq-mean-token-mean, ...)."""
    constant: float | None
    """Dr. GRPO's L for ``seq-mean-token-sum-norm`` (max completion tokens); None for other modes."""
    clip_low: float
    """Lower clip epsilon: the ratio is clamped to >= 1 - clip_low."""
    clip_high: float
    """Upper clip epsilon: the ratio is clamped to <= 1 + clip_high."""
    kl_beta: float
    """Weight of the k3 KL penalty to the reference policy (0: no reference model)."""
    mu: int
    """Optimizer steps per rollout batch (> 1 keeps pi_old log-probs and clips the ratio)."""
    conflict_weight: float = 2.0
    """GTPO W on a positive completion's conflict tokens."""
    conflict_overlap: str = "product"
    """product (W*W where forward and backward runs overlap, the code) or union (W)."""
    pad_id: int | None = None
    """Token id never counted as a conflict (the code's PAD_ID); None: the mask alone decides."""
    entropy_threshold: float = 0.7
    """GTPO filter: delta_i = 1[<H>_i <= threshold]."""
    entropy_gamma: float = 0.1
    """GTPO shift: A~_i = delta_i (A_i - gamma <H>_i)."""
    gtpo_normalization: str = "code"
    """GTPO per-completion normaliser: code (1/max(1, n_i)) or paper (1/G)."""
    gtpo_prompt_reduction: str = "mean"
    """GTPO over several prompts: mean (average the per-prompt objectives) or sum (the code's sum_i L_i)."""
    entropy_logits: str = "sampling"
    """GTPO's <H>_i at the sampling temperature (sampling) or on the raw logits at temperature 1 (raw)."""
    mismatch_correction: str = "none"
    """Train-inference mismatch weights: none, tis (min(r, C)) or mis (r inside [C_low, C], else 0)."""
    mismatch_cap: float = 2.0
    """C of the mismatch correction."""
    mismatch_cap_low: float | None = None
    """C_low of mis (None: 1 / C)."""
    entropy_prob_floor: float = 1e-6
    """Probability floor inside the log of GTPO's <H>_i statistic (the reference code's clamp)."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose ``dynamic_sampling_metric`` is all equal and refill the batch."""
    dynamic_sampling_metric: str = "accuracy"
    """accuracy (DAPO Eq. 11) or reward (verl's seq_reward)."""
    dynamic_sampling_max_tries: int = 10
    """Most rollout batches generated to fill one training batch."""
    overlong_max_tokens: int = 0
    """DAPO soft overlong punishment L_max (the rollout's max tokens); 0 when the punishment is off."""
    overlong_buffer_len: int = 0
    """DAPO soft overlong punishment L_cache; 0 disables it."""
    overlong_penalty_factor: float = 1.0
    """The punishment's value at and beyond L_max is ``-overlong_penalty_factor``."""

    @property
    def needs_old_logp(self) -> bool:
        """mu > 1: the ratio's denominator pi_old, the detached log-probs of the first update's forward
        (pre-update weights), is kept for the later updates."""
        return self.mu > 1

    @property
    def needs_mean_entropy(self) -> bool:
        """GTPO's filter and shift need each row's <H>_i of pi_old (``prepare.shape_rows``)."""
        return self.conflict_aware

    def entropy_temperature(self, sampling_temperature: float) -> float:
        """Temperature of GTPO's <H>_i statistic: 1 (raw logits, the official code) or the sampling one."""
        return 1.0 if self.entropy_logits == "raw" else sampling_temperature

    @property
    def needs_reference(self) -> bool:
        """A frozen reference model exists only for a KL term."""
        return self.kl_beta > 0
