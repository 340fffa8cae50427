"""``AlgoConfig``: the ``algo:`` block of a recipe (validated, one docstring per field).

Fields left at ``None`` take the chosen algorithm's default from ``registry.LOSSES`` in
``resolve()``, once per run. Functions in ``algo/`` never take this object: they take the frozen
:class:`~megatron_gtpo.algo.spec.AlgoSpec` that ``resolve()`` returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from megatron_gtpo.algo.aggregate import AGG_MODES
from megatron_gtpo.algo.importance import MISMATCH_MODES
from megatron_gtpo.algo.registry import LOSSES
from megatron_gtpo.algo.spec import AlgoSpec
from megatron_gtpo.utils.configuration import require

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(kw_only=True)
class AlgoConfig:
    """Policy-optimisation algorithm and its hyper-parameters (spec algorithms.md)."""

    name: Literal["gtpo", "grpo", "drgrpo", "dapo"] = "gtpo"
    """Algorithm: gtpo (spec 5), grpo (spec 2), drgrpo (spec 3) or dapo (spec 4)."""

    adv_std_scale: bool | None = None
    """Divide ``R - mean`` by the group's unbiased std + adv_eps. None = algorithm default: True for
    grpo and dapo (spec 2, 4), False for drgrpo and gtpo (spec 3, 5.2)."""

    adv_eps: float = 1e-4
    """Added to the group std before dividing; 1e-4 as TRL and the GTPO repo's GRPO (spec 2; verl: 1e-6)."""

    agg_mode: AggMode | None = None
    """Loss aggregation (algo/aggregate.py). None = algorithm default: seq-mean-token-mean for grpo and
    gtpo (spec 2, 5.8), seq-mean-token-sum-norm for drgrpo (spec 3), token-mean for dapo (spec 4)."""

    clip_eps_low: float = 0.2
    """Lower clip: the ratio is clamped to >= 1 - clip_eps_low; 0.2 as TRL/verl and DAPO (spec 2, 4).
    Inactive when mu = 1 (the ratio is exactly 1)."""

    clip_eps_high: float | None = None
    """Upper clip: the ratio is clamped to <= 1 + clip_eps_high. None = 0.28 for dapo (clip-higher,
    spec 4) and clip_eps_low otherwise."""

    kl_beta: float | None = None
    """Weight of the k3 KL penalty to the reference model. None = 0.04 for grpo (DeepSeekMath, spec 2)
    and 0 otherwise (Dr. GRPO recipes, DAPO and GTPO use no KL; spec 3, 4, 5.1). > 0 needs a reference model."""

    mu: int = 1
    """Optimizer steps per rollout batch. 1 in GRPO's paper and the GTPO code (spec 2, 5.7; the ratio is
    then exp(logp - logp.detach()) and clipping is inactive); DAPO's paper used 16 (spec 4). mu > 1
    makes the trainer keep old log-probs, so the clipped ratio is active (S4's casting for GTPO)."""

    conflict_weight: float = 2.0
    """GTPO W: weight of a positive completion's conflict tokens (0 for negatives); W_RAW = 2.0 in the
    official code (spec 5.4, 5.10)."""

    conflict_overlap: Literal["product", "union"] = "product"
    """Where a positive completion's forward and backward conflict runs overlap: product = W*W as the
    official code (lambda_fwd * lambda_bwd), union = W as a plain reading of the paper (spec 5.4)."""

    entropy_threshold: float = 0.7
    """GTPO entropy filter: completions with mean entropy <H>_i above this (nats) get delta = 0. 0.7 in
    the official code (ln 2 in the README; a huge value such as 777 disables the filter) (spec 5.5).
    <H>_i always comes from the trainer's policy before the update (its logits in the no-grad pre-pass),
    also when the completion was sampled by an older engine (``rollout.staleness: 1``): the filter
    judges the policy being updated, not the one that sampled."""

    entropy_gamma: float = 0.1
    """GTPO entropy shift gamma in A~ = delta (A - gamma <H>); ENT_SCALE = 0.1 at the code's HEAD,
    1e-3 in its first commit (spec 5.6)."""

    gtpo_normalization: Literal["code", "paper"] = "code"
    """GTPO per-completion normaliser: code = (1/|o_i|) / max(1, n_i) summed over completions (official
    code, spec 5.8), paper = 1/(G |o_i|) (README objective, spec 5.1); both averaged over prompts."""

    gtpo_prompt_reduction: Literal["mean", "sum"] = "mean"
    """GTPO with several prompts per step: mean = average the per-prompt objectives (the project's
    choice: the gradient scale does not grow with prompts_per_step), sum = sum over all completions of
    all prompts, as the official code's step loss ``sum_i L_i`` (spec 5.8; the code trains one prompt
    per step, where both are equal). configs/gtpo.yaml sets sum."""

    entropy_logits: Literal["sampling", "raw"] = "sampling"
    """Distribution of GTPO's entropy statistic <H>_i (filter delta and shift gamma): sampling = the
    rollout's sampling temperature (the project's choice, the distribution the tokens came from), raw
    = the model's raw logits at temperature 1, as the official code computes it (TRL 0.15.2's
    per-token log-probs do not divide by the temperature; spec 5.5, 5.10). Equal at temperature 1;
    at 0.9 raw entropies are higher, so more completions are filtered at threshold 0.7.
    configs/gtpo.yaml sets raw."""

    mismatch_correction: Literal["none", "tis", "mis"] = "none"
    """Train-inference mismatch correction per token with r = pi_old / pi_sampler (the engine's
    log-probs of the sampled tokens): none (paper-exact: spec 5.7 and the GTPO code have none), tis =
    truncated importance sampling min(r, C) (Yao et al. 2025; TRL's vllm_importance_sampling_cap), mis =
    masked importance sampling, r inside [C_low, C] and 0 outside (IcePop; verl rollout_is mask). The
    weight multiplies each token's advantage next to lambda (algo/importance.py). Required (tis or mis)
    with ``rollout.staleness: 1``: r then also covers the one-version lag of the sampler (decoupled PPO:
    the behaviour policy is the sampler, pi_old the trainer's policy before the update); none is
    rejected there, naming both fields."""

    mismatch_cap: float = 2.0
    """C of the mismatch correction (> 1): the truncation cap (tis) or the upper mask bound (mis). Not
    from the spec (the papers of spec 0 have no correction); 2.0 as TRL's vllm_importance_sampling_cap."""

    mismatch_cap_low: float | None = None
    """Lower mask bound C_low of mis (in [0, 1)); None = 1 / mismatch_cap (two-sided as IcePop),
    0 = one-sided. Unused by tis. Not from the spec (see mismatch_correction)."""

    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop groups whose filter metric is all equal and refill the batch by
    over-sampling (spec 4.2). None = True for dapo, False otherwise."""

    dynamic_sampling_metric: Literal["accuracy", "reward"] = "accuracy"
    """Per-completion value compared by the dynamic-sampling filter: accuracy (DAPO Eq. 11) or the total
    reward (verl's seq_reward) (spec 4.2)."""

    dynamic_sampling_max_tries: int = 10
    """Most rollout batches generated to fill one training batch under dynamic sampling (verl's
    max_num_gen_batches; its DAPO recipe uses 10 [UNVERIFIED in the spec]). After that, train on what was kept."""

    overlong_buffer_len: int | None = None
    """DAPO soft overlong punishment buffer L_cache in tokens (0 disables). None = 4096 for dapo
    (spec 4.4, with L_max = rollout max tokens), 0 otherwise."""

    overlong_penalty_factor: float = 1.0
    """Scale of the soft overlong punishment: the reward drops linearly to -factor at L_max (spec 4.4)."""

    drgrpo_constant: int | None = None
    """Dr. GRPO constant L of seq-mean-token-sum-norm. None = the rollout's max completion tokens
    (spec 3, TRL's max_completion_length)."""

    pad_id: int | None = None
    """Token id that never counts as a GTPO conflict (the code's PAD_ID, 128004 for Llama-3.1, spec 5.3).
    None = the loss mask alone decides (padding is already outside the mask)."""

    def __post_init__(self) -> None:
        require(self.name in LOSSES, "name", self.name, f"one of {sorted(LOSSES)}")
        require(self.adv_std_scale is None or isinstance(self.adv_std_scale, bool), "adv_std_scale",
                self.adv_std_scale, "true, false or null")
        require(_finite(self.adv_eps) and self.adv_eps >= 0, "adv_eps", self.adv_eps, "a finite number >= 0")
        require(self.agg_mode is None or self.agg_mode in AGG_MODES, "agg_mode", self.agg_mode,
                f"null or one of {AGG_MODES}")
        require(_finite(self.clip_eps_low) and 0 < self.clip_eps_low < 1, "clip_eps_low", self.clip_eps_low,
                "a number in (0, 1)")
        require(self.clip_eps_high is None or (_finite(self.clip_eps_high) and self.clip_eps_high > 0),
                "clip_eps_high", self.clip_eps_high, "null or a finite number > 0")
        require(self.kl_beta is None or (_finite(self.kl_beta) and self.kl_beta >= 0), "kl_beta", self.kl_beta,
                "null or a finite number >= 0")
        require(_is_int(self.mu) and self.mu >= 1, "mu", self.mu, "an integer >= 1")
        require(_finite(self.conflict_weight) and self.conflict_weight > 0, "conflict_weight",
                self.conflict_weight, "a finite number > 0 (2.0 in the official code)")
        require(self.conflict_overlap in ("product", "union"), "conflict_overlap", self.conflict_overlap,
                "'product' or 'union'")
        require(_finite(self.entropy_threshold) and self.entropy_threshold > 0, "entropy_threshold",
                self.entropy_threshold, "a finite number > 0 in nats (0.7; 777 disables the filter)")
        require(_finite(self.entropy_gamma) and self.entropy_gamma >= 0, "entropy_gamma", self.entropy_gamma,
                "a finite number >= 0")
        require(self.gtpo_normalization in ("code", "paper"), "gtpo_normalization", self.gtpo_normalization,
                "'code' or 'paper'")
        require(self.gtpo_prompt_reduction in ("mean", "sum"), "gtpo_prompt_reduction", self.gtpo_prompt_reduction,
                "'mean' or 'sum'")
        require(self.entropy_logits in ("sampling", "raw"), "entropy_logits", self.entropy_logits,
                "'sampling' or 'raw'")
        require(self.mismatch_correction in MISMATCH_MODES, "mismatch_correction", self.mismatch_correction,
                f"one of {MISMATCH_MODES}")
        require(_finite(self.mismatch_cap) and self.mismatch_cap > 1, "mismatch_cap", self.mismatch_cap,
                "a finite number > 1 (2.0 is common)")
        require(self.mismatch_cap_low is None or (_finite(self.mismatch_cap_low) and 0 <= self.mismatch_cap_low < 1),
                "mismatch_cap_low", self.mismatch_cap_low, "null (= 1 / mismatch_cap) or a number in [0, 1)")
        require(self.dynamic_sampling is None or isinstance(self.dynamic_sampling, bool), "dynamic_sampling",
                self.dynamic_sampling, "true, false or null")
        require(self.dynamic_sampling_metric in ("accuracy", "reward"), "dynamic_sampling_metric",
                self.dynamic_sampling_metric, "'accuracy' or 'reward'")
        require(_is_int(self.dynamic_sampling_max_tries) and self.dynamic_sampling_max_tries >= 1,
                "dynamic_sampling_max_tries", self.dynamic_sampling_max_tries, "an integer >= 1")
        require(self.overlong_buffer_len is None or (_is_int(self.overlong_buffer_len)
                                                     and self.overlong_buffer_len >= 0),
                "overlong_buffer_len", self.overlong_buffer_len, "null or an integer >= 0")
        require(_finite(self.overlong_penalty_factor) and self.overlong_penalty_factor >= 0,
                "overlong_penalty_factor", self.overlong_penalty_factor, "a finite number >= 0")
        require(self.drgrpo_constant is None or (_is_int(self.drgrpo_constant) and self.drgrpo_constant > 0),
                "drgrpo_constant", self.drgrpo_constant, "null or an integer > 0 (max completion tokens)")
        require(self.pad_id is None or (_is_int(self.pad_id) and self.pad_id >= 0), "pad_id", self.pad_id,
                "null or a token id >= 0")

    def resolve(self, *, max_completion_tokens: int) -> AlgoSpec:
        """The one place where ``None`` fields take the algorithm's defaults (``registry.LOSSES``).
        ``max_completion_tokens`` (rollout max_tokens) is Dr. GRPO's L unless drgrpo_constant is
        set, and DAPO's L_max of the overlong punishment."""
        default = LOSSES[self.name]
        pick = lambda value, fallback: fallback if value is None else value  # noqa: E731
        agg_mode = pick(self.agg_mode, default.agg_mode)
        constant = pick(self.drgrpo_constant, max_completion_tokens)
        buffer_len = pick(self.overlong_buffer_len, default.overlong_buffer_len)
        return AlgoSpec(
            name=self.name, conflict_aware=default.conflict_aware,
            std_scale=pick(self.adv_std_scale, default.std_scale), adv_eps=self.adv_eps, agg_mode=agg_mode,
            constant=float(constant) if agg_mode == "seq-mean-token-sum-norm" else None,
            clip_low=self.clip_eps_low, clip_high=pick(self.clip_eps_high, default.clip_eps_high or self.clip_eps_low),
            kl_beta=pick(self.kl_beta, default.kl_beta), mu=self.mu, conflict_weight=self.conflict_weight,
            conflict_overlap=self.conflict_overlap, pad_id=self.pad_id, entropy_threshold=self.entropy_threshold,
            entropy_gamma=self.entropy_gamma, gtpo_normalization=self.gtpo_normalization,
            gtpo_prompt_reduction=self.gtpo_prompt_reduction, entropy_logits=self.entropy_logits,
            mismatch_correction=self.mismatch_correction, mismatch_cap=self.mismatch_cap,
            mismatch_cap_low=self.mismatch_cap_low,
            dynamic_sampling=pick(self.dynamic_sampling, default.dynamic_sampling),
            dynamic_sampling_metric=self.dynamic_sampling_metric,
            dynamic_sampling_max_tries=self.dynamic_sampling_max_tries,
            overlong_max_tokens=max_completion_tokens if buffer_len else 0, overlong_buffer_len=buffer_len,
            overlong_penalty_factor=self.overlong_penalty_factor)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
