"""``AlgoSpec``: the one record of an algorithm, every setting resolved, handed to ``algo/``'s functions.

    AlgoConfig (recipe, fields may be None) --AlgoConfig.resolve(max_completion_tokens)--> AlgoSpec

``RunConfig`` resolves it once per run (``cfg.algorithm``) and every part receives this record; no
field has a default here, so a value can only come from the recipe or from ``config.DEFAULTS``.
Fields keep the recipe's names (``algo.clip_eps_high`` is ``spec.clip_eps_high``) and meanings (the
field docstrings of ``AlgoConfig``); only the five resolved-only fields are documented below. A
function that takes an AlgoSpec trusts it: the recipe checks ran when the config was built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megatron_gtpo.algo.choices import (AggMode, AlgoName, ConflictOverlap, EntropyLogits, GtpoNormalization,
                                        MismatchMode, PromptReduction, SamplingMetric, Surrogate)


@dataclass(frozen=True, kw_only=True)
class AlgoSpec:
    """A fully resolved algorithm (docs/algorithms.md section 9 lists the values per algorithm)."""

    name: AlgoName
    conflict_aware: bool
    """GTPO: token weights lambda, entropy filter delta, entropy shift gamma, per-completion scales."""
    surrogate: Surrogate
    """The policy term ``losses.compute_loss`` clips: clip (PPO's token ratio), gspo (the sequence
    ratio, spec 13) or cispo (the detached, clipped token IS weight, spec 14)."""
    adv_std_scale: bool
    adv_eps: float
    agg_mode: AggMode
    constant: float | None
    """Dr. GRPO's L for ``seq-mean-token-sum-norm`` (drgrpo_constant, else the rollout's max tokens);
    None for the other modes."""
    clip_eps_low: float
    clip_eps_high: float
    kl_beta: float
    mu: int
    conflict_weight: float
    conflict_overlap: ConflictOverlap
    pad_id: int | None
    entropy_threshold: float | None
    """GTPO's filter threshold; None while ``auto`` is undecided (the driver sets it at the first step:
    ``config.filter_rule``); ``inf`` = no filter."""
    entropy_gamma: float
    """gamma in reward units (``entropy_gamma_relative`` x reward range already applied)."""
    gtpo_normalization: GtpoNormalization
    gtpo_prompt_reduction: PromptReduction
    entropy_logits: EntropyLogits
    mismatch_correction: MismatchMode
    mismatch_cap: float
    mismatch_cap_low: float
    """C_low of mis (the recipe's None resolved to 1 / mismatch_cap)."""
    dynamic_sampling: bool
    dynamic_sampling_metric: SamplingMetric
    dynamic_sampling_max_tries: int
    overlong_max_tokens: int
    """DAPO soft overlong punishment L_max (the rollout's max tokens); 0 when the punishment is off."""
    overlong_buffer_len: int
    overlong_penalty_factor: float

    entropy_prob_floor: ClassVar[float] = 1e-6
    """Probability floor inside the log of GTPO's <H>_i statistic (the reference code's clamp, spec 5.5)."""

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
