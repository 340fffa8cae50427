"""``AlgoConfig``: the ``algo:`` block of a recipe (validated, one docstring per field), and its
resolution into the one record of the algorithm that the rest of the run receives::

    AlgoConfig (recipe; a None field = "the algorithm's default")
        --resolve(max_completion_tokens)--> AlgoSpec (spec.py: frozen, every value concrete)

``RunConfig`` (megatron_gtpo/config.py) resolves it once, as ``cfg.algorithm``; nothing below looks
an algorithm up by name or fills in a default. The per-algorithm defaults are the one table
``DEFAULTS``; the choices of every enum-like field are the ``Literal`` types of ``choices.py``.
Section numbers ("spec 5.4") cite docs/algorithms.md.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from megatron_gtpo.algo.choices import (AggMode, AlgoName, ConflictOverlap, EntropyLogits, GtpoNormalization,
                                        MismatchMode, PromptReduction, SamplingMetric)
from megatron_gtpo.algo.spec import AlgoSpec
from megatron_gtpo.utils.configuration import require

DEFAULTS: dict[str, dict[str, Any]] = {
    # GTPO official code [spec 5, 5.10]: R - mean, seq-mean with per-completion scales, no KL, mu = 1.
    "gtpo": {"conflict_aware": True, "surrogate": "clip", "adv_std_scale": False, "agg_mode": "seq-mean-token-mean",
             "clip_eps_low": 0.2, "kl_beta": 0.0, "dynamic_sampling": False, "overlong_buffer_len": 0},
    # DeepSeekMath [spec 2]: z-score, seq-mean-token-mean, k3 KL with beta 0.04.
    "grpo": {"conflict_aware": False, "surrogate": "clip", "adv_std_scale": True, "agg_mode": "seq-mean-token-mean",
             "clip_eps_low": 0.2, "kl_beta": 0.04, "dynamic_sampling": False, "overlong_buffer_len": 0},
    # Dr. GRPO [spec 3]: R - mean, sum / (G * L), beta 0 in the public recipes.
    "drgrpo": {"conflict_aware": False, "surrogate": "clip", "adv_std_scale": False,
               "agg_mode": "seq-mean-token-sum-norm", "clip_eps_low": 0.2, "kl_beta": 0.0, "dynamic_sampling": False,
               "overlong_buffer_len": 0},
    # DAPO [spec 4]: z-score, token-mean, clip-higher 0.28, no KL, dynamic sampling, L_cache 4096.
    "dapo": {"conflict_aware": False, "surrogate": "clip", "adv_std_scale": True, "agg_mode": "token-mean",
             "clip_eps_low": 0.2, "kl_beta": 0.0, "clip_eps_high": 0.28, "dynamic_sampling": True,
             "overlong_buffer_len": 4096},
    # GSPO [spec 13]: z-score, the sequence ratio clipped to [1 - 3e-4, 1 + 4e-4], one term per completion
    # (1/G sum_i: seq-mean-token-mean of the token form), no KL.
    "gspo": {"conflict_aware": False, "surrogate": "gspo", "adv_std_scale": True, "agg_mode": "seq-mean-token-mean",
             "clip_eps_low": 3e-4, "clip_eps_high": 4e-4, "kl_beta": 0.0, "dynamic_sampling": False,
             "overlong_buffer_len": 0},
    # CISPO [spec 14]: z-score, detached IS weight clipped above only (eps_low = 1: lower bound 0),
    # 1 / sum_i |o_i| (token-mean), no KL.
    "cispo": {"conflict_aware": False, "surrogate": "cispo", "adv_std_scale": True, "agg_mode": "token-mean",
              "clip_eps_low": 1.0, "clip_eps_high": 0.28, "kl_beta": 0.0, "dynamic_sampling": False,
              "overlong_buffer_len": 0},
}
"""What each algorithm changes in the shared surrogate (spec 9): the values ``AlgoConfig`` fields left
at None resolve to (``clip_eps_high`` absent: the lower clip, a symmetric range), plus whether it
uses GTPO's token weights, entropy filter/shift and per-completion scales (``conflict_aware``) and
which policy term it clips (``surrogate``, ``choices.Surrogate``)."""


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(kw_only=True)
class AlgoConfig:
    """Policy-optimisation algorithm and its hyper-parameters (docs/algorithms.md)."""

    name: AlgoName = "gtpo"
    """Algorithm: gtpo (spec 5), grpo (spec 2), drgrpo (spec 3), dapo (spec 4), gspo (spec 13) or
    cispo (spec 14)."""

    adv_std_scale: bool | None = None
    """Divide ``R - mean`` by the group's unbiased std + adv_eps. None = algorithm default: True for
    grpo and dapo (spec 2, 4), False for drgrpo and gtpo (spec 3, 5.2)."""

    adv_eps: float = 1e-4
    """Added to the group std before dividing; 1e-4 as TRL and the GTPO repo's GRPO (spec 2; verl: 1e-6)."""

    agg_mode: AggMode | None = None
    """Loss aggregation (algo/aggregate.py). None = algorithm default: seq-mean-token-mean for grpo and
    gtpo (spec 2, 5.8), seq-mean-token-sum-norm for drgrpo (spec 3), token-mean for dapo (spec 4)."""

    clip_eps_low: float | None = None
    """Lower clip: the ratio is clamped to >= 1 - clip_eps_low, in (0, 1] (1: no lower bound). None =
    0.2 as TRL/verl and DAPO (spec 2, 4); 3e-4 for gspo (its sequence ratio, spec 13); 1 for cispo (its
    IS weight has no lower bound, spec 14). Inactive when mu = 1 (the ratio is exactly 1)."""

    clip_eps_high: float | None = None
    """Upper clip: the ratio is clamped to <= 1 + clip_eps_high. None = 0.28 for dapo (clip-higher,
    spec 4) and cispo (Trinity-RFT's default; the paper does not state its value, spec 14), 4e-4 for
    gspo (spec 13), clip_eps_low otherwise."""

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

    conflict_overlap: ConflictOverlap = "product"
    """Where a positive completion's forward and backward conflict runs overlap: product = W*W as the
    official code (lambda_fwd * lambda_bwd), union = W as a plain reading of the paper (spec 5.4)."""

    entropy_threshold: float | Literal["auto"] = 0.7
    """GTPO entropy filter: completions with mean entropy <H>_i above this (nats) get delta = 0. 0.7 in
    the official code (ln 2 in the README; a huge value such as 777 disables the filter) (spec 5.5).
    ``auto`` (configs/gtpo.yaml's choice) applies the authors' README rule (spec 5.5, ``filter_rule``): ``<H>_ini``, the mean <H>_i
    of the initial policy over the first step's completions (one extra no-grad forward, once per run),
    decides: no filter when ``<H>_ini > ln 2``, else ln 2. The decision is logged, tagged in MLflow
    and saved in every checkpoint (a resume keeps it).
    <H>_i always comes from the trainer's policy before the update (its logits in the no-grad pre-pass),
    also when the completion was sampled by an older engine (``rollout.staleness: 1``): the filter
    judges the policy being updated, not the one that sampled."""

    entropy_gamma: float | None = None
    """GTPO entropy shift gamma in A~ = delta (A - gamma <H>); None = ``entropy_gamma_relative`` x the
    reward's range when that is set, else 0.1 (ENT_SCALE at the code's HEAD, 1e-3 in its first commit;
    spec 5.6). A value here wins over ``entropy_gamma_relative`` (an override of gamma means it). gamma is in
    reward units: 0.1 is the paper's value on its 0-20 reward, and on a 0/1 reward the same 0.1 makes
    the shift most of the update (docs/algorithms.md "Reward scale and the entropy shift")."""

    entropy_gamma_relative: float | None = None
    """gamma as a share of the reward's range: gamma = this x (reward.range or the built-in reward's
    spread, e.g. 20 for ``gtpo``) x reward.scale. 0.005 is the paper's 0.1 on its 0-20 reward, so a
    recipe that changes its reward keeps the shift's weight against the advantages (configs/gtpo.yaml;
    spec 5.6 for gamma, docs/algorithms.md 5.6a). Used only while ``entropy_gamma`` is null."""

    gtpo_normalization: GtpoNormalization = "code"
    """GTPO per-completion normaliser: code = (1/|o_i|) / max(1, n_i) summed over completions (official
    code, spec 5.8), paper = 1/(G |o_i|) (README objective, spec 5.1); both averaged over prompts."""

    gtpo_prompt_reduction: PromptReduction = "mean"
    """GTPO with several prompts per step: mean = average the per-prompt objectives (the project's
    choice: the gradient scale does not grow with prompts_per_step), sum = sum over all completions of
    all prompts, as the official code's step loss ``sum_i L_i`` (spec 5.8; the code trains one prompt
    per step, where both are equal). configs/gtpo.yaml sets sum."""

    entropy_logits: EntropyLogits = "sampling"
    """Distribution of GTPO's entropy statistic <H>_i (filter delta and shift gamma): sampling = the
    rollout's sampling temperature (the project's choice, the distribution the tokens came from), raw
    = the model's raw logits at temperature 1, as the official code computes it (TRL 0.15.2's
    per-token log-probs do not divide by the temperature; spec 5.5, 5.10). Equal at temperature 1;
    at 0.9 raw entropies are higher, so more completions are filtered at threshold 0.7.
    configs/gtpo.yaml sets raw."""

    mismatch_correction: MismatchMode = "none"
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

    dynamic_sampling_metric: SamplingMetric = "accuracy"
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
        self._check_choices()
        require(self.adv_std_scale is None or isinstance(self.adv_std_scale, bool), "adv_std_scale",
                self.adv_std_scale, "true, false or null")
        require(_finite(self.adv_eps) and self.adv_eps >= 0, "adv_eps", self.adv_eps, "a finite number >= 0")
        require(self.clip_eps_low is None or (_finite(self.clip_eps_low) and 0 < self.clip_eps_low <= 1),
                "clip_eps_low", self.clip_eps_low, "null or a number in (0, 1] (1: no lower bound)")
        require(self.clip_eps_high is None or (_finite(self.clip_eps_high) and self.clip_eps_high > 0),
                "clip_eps_high", self.clip_eps_high, "null or a finite number > 0")
        require(self.kl_beta is None or (_finite(self.kl_beta) and self.kl_beta >= 0), "kl_beta", self.kl_beta,
                "null or a finite number >= 0")
        require(_is_int(self.mu) and self.mu >= 1, "mu", self.mu, "an integer >= 1")
        require(_finite(self.conflict_weight) and self.conflict_weight > 0, "conflict_weight",
                self.conflict_weight, "a finite number > 0 (2.0 in the official code)")
        require(self.entropy_threshold == "auto" or (_finite(self.entropy_threshold) and self.entropy_threshold > 0),
                "entropy_threshold", self.entropy_threshold,
                "'auto' (the authors' rule) or a finite number > 0 in nats (0.7; 777 disables the filter)")
        require(self.entropy_gamma is None or (_finite(self.entropy_gamma) and self.entropy_gamma >= 0),
                "entropy_gamma", self.entropy_gamma, "null (0.1) or a finite number >= 0")
        require(self.entropy_gamma_relative is None or (_finite(self.entropy_gamma_relative)
                                                        and self.entropy_gamma_relative >= 0),
                "entropy_gamma_relative", self.entropy_gamma_relative, "null or a finite number >= 0 (0.005)")

        require(_finite(self.mismatch_cap) and self.mismatch_cap > 1, "mismatch_cap", self.mismatch_cap,
                "a finite number > 1 (2.0 is common)")
        require(self.mismatch_cap_low is None or (_finite(self.mismatch_cap_low) and 0 <= self.mismatch_cap_low < 1),
                "mismatch_cap_low", self.mismatch_cap_low, "null (= 1 / mismatch_cap) or a number in [0, 1)")
        require(self.dynamic_sampling is None or isinstance(self.dynamic_sampling, bool), "dynamic_sampling",
                self.dynamic_sampling, "true, false or null")
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

    def _check_choices(self) -> None:
        """Every ``Literal`` field (``choices.py``) holds one of its values, or None where allowed."""
        for name, hint in typing.get_type_hints(type(self)).items():
            options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
            allowed = tuple(v for o in options if typing.get_origin(o) is Literal for v in typing.get_args(o))
            others = [o for o in options if typing.get_origin(o) is not Literal and o is not type(None)]
            if allowed and not (others and not isinstance(getattr(self, name), str)):  # 0.7 for float | "auto"
                nullable, value = type(None) in options, getattr(self, name)
                require(value in allowed or (nullable and value is None), name, value,
                        f"{'null or ' if nullable else ''}one of {allowed}")

    def resolve(self, *, max_completion_tokens: int, reward_range: float | None = None) -> AlgoSpec:
        """The algorithm with every default filled in: None fields take ``DEFAULTS[name]``;
        ``max_completion_tokens`` (rollout.max_tokens) is Dr. GRPO's L unless drgrpo_constant is set,
        and DAPO's L_max of the overlong punishment; ``reward_range`` (the reward's spread times
        reward.scale; None when unknown) turns ``entropy_gamma_relative`` into gamma. ``entropy_threshold:
        auto`` resolves to None (decided at the first step: ``filter_rule``). ``RunConfig`` calls it
        once per run."""
        default = DEFAULTS[self.name]
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in default.items():
            if values.get(name) is None:
                values[name] = value
        if values["clip_eps_high"] is None:  # a symmetric clip range
            values["clip_eps_high"] = values["clip_eps_low"]
        constant = values.pop("drgrpo_constant")
        constant = max_completion_tokens if constant is None else constant
        values["constant"] = float(constant) if values["agg_mode"] == "seq-mean-token-sum-norm" else None
        values["overlong_max_tokens"] = max_completion_tokens if values["overlong_buffer_len"] else 0
        if values["mismatch_cap_low"] is None:  # two-sided, as IcePop
            values["mismatch_cap_low"] = 1.0 / self.mismatch_cap
        values["entropy_gamma"] = self._gamma(reward_range)
        del values["entropy_gamma_relative"]
        if values["entropy_threshold"] == "auto":
            values["entropy_threshold"] = None
        return AlgoSpec(**values)

    def _gamma(self, reward_range: float | None) -> float:
        if self.entropy_gamma is not None:
            return self.entropy_gamma
        if self.entropy_gamma_relative is None:
            return DEFAULT_GAMMA
        require(reward_range is not None, "entropy_gamma_relative", self.entropy_gamma_relative,
                "set with a reward of known range: give the user reward function's spread as reward.range "
                "(max - min of its values), or set algo.entropy_gamma instead")
        return self.entropy_gamma_relative * reward_range


DEFAULT_GAMMA = 0.1
"""ENT_SCALE at the official code's HEAD (spec 5.6): gamma when neither gamma field is set."""


def filter_rule(initial_mean_entropy: float) -> float:
    """The authors' README rule for GTPO's filter (spec 5.5), from ``<H>_ini``, the initial policy's
    mean completion entropy: no filter (``inf``) when ``<H>_ini > ln 2``, else the threshold ln 2."""
    return math.inf if initial_mean_entropy > math.log(2) else math.log(2)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
