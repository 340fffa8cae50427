"""Pure-tensor policy-optimisation algorithms: GTPO, GRPO, Dr. GRPO, DAPO, GSPO, CISPO (docs/algorithms.md; a
"spec N.M" citation in this package is section N.M of that document).

No torch.distributed, no megatron, no config objects of other packages: the functions take the
frozen ``AlgoSpec`` (resolved once per run: ``RunConfig.algorithm``) and tensors. One training step::

    keep = dapo_group_filter(accuracy, group_ids)                 # DAPO dynamic sampling (filters.py)
    prepared = prepare_groups(spec, token_ids=..., mask=..., rewards=...,
                              group_ids=...)                      # ONCE per global batch
    validate_loss_inputs(spec, prepared, mask=..., ...)           # once per step, at the boundary
    for micro-batch rows idx:                                     # any DP rank / micro-batch split
        rows = shape_rows(spec, prepared.rows(idx), <H>_idx)      # GTPO: filter + shift, per row
        loss, metrics = compute_loss(spec, TokenInputs(logp=..., mask=..., old_logp=..., ref_logp=...),
                                     rows, num_tokens=global_tokens, num_seqs=global_seqs)

``prepare_batch(..., mean_entropy=<H> [B])`` does both preparation steps on a whole batch at once.

Diagnostics of the hidden objective biases (spec 6, D1-D4) live in ``diagnostics.py`` (omega, D2-D4)
and ``prefix.py`` (D1); the regime guards' inputs (GTPO's shift share, the length drift D5) in
``regime.py``; train-inference mismatch weights in ``importance.py``.
"""

from megatron_gtpo.algo.advantage import (completion_mean_entropy, entropy_filter, group_advantages, group_index,
                                          shape_advantages)
from megatron_gtpo.algo.aggregate import aggregate, aggregation_weights, masked_extremum
from megatron_gtpo.algo.choices import AGG_MODES, ALGO_NAMES, MISMATCH_MODES
from megatron_gtpo.algo.config import DEFAULTS, AlgoConfig
from megatron_gtpo.algo.conflict import ConflictRuns, conflict_runs, conflict_weights
from megatron_gtpo.algo.diagnostics import (ClipOvershoot, SurrogateDecomposition, adam_update_sq_norm, clip_overshoot,
                                            favoured_clip_mask, kl_penalty, momentum_step_ratio,
                                            momentum_step_ratio_limit, small_second_moment_counts,
                                            surrogate_decomposition, token_omega)
from megatron_gtpo.algo.filters import dapo_group_filter
from megatron_gtpo.algo.importance import mismatch_weights
from megatron_gtpo.algo.kl import entropy_from_logits, kl_k3
from megatron_gtpo.algo.losses import (TokenInputs, clip_regions, compute_loss, sequence_log_ratio, surrogate_log_ratio,
                                       token_log_ratio, validate_loss_inputs)
from megatron_gtpo.algo.prefix import SharedPrefixes, prefix_bias, prefix_bias_metrics, shared_prefixes
from megatron_gtpo.algo.prepare import (PreparedBatch, check_shaped, gtpo_seq_scale, prepare_batch,
                                        prepare_groups, shape_batch, shape_rows)
from megatron_gtpo.algo.regime import completion_coefficients, regime_metrics
from megatron_gtpo.algo.spec import AlgoSpec

__all__ = [
    "AGG_MODES", "ALGO_NAMES", "AlgoConfig", "AlgoSpec", "ClipOvershoot", "ConflictRuns", "DEFAULTS", "MISMATCH_MODES",
    "PreparedBatch", "SharedPrefixes", "SurrogateDecomposition", "TokenInputs", "adam_update_sq_norm", "aggregate",
    "aggregation_weights", "check_shaped", "clip_overshoot", "clip_regions", "completion_mean_entropy", "compute_loss",
    "conflict_runs", "conflict_weights", "dapo_group_filter", "entropy_filter", "entropy_from_logits",
    "favoured_clip_mask", "group_advantages", "group_index", "gtpo_seq_scale", "kl_k3", "kl_penalty",
    "masked_extremum", "mismatch_weights", "momentum_step_ratio", "momentum_step_ratio_limit", "prefix_bias",
    "prefix_bias_metrics", "prepare_batch", "prepare_groups", "regime_metrics", "completion_coefficients",
    "sequence_log_ratio", "shape_advantages", "shape_batch", "shape_rows", "shared_prefixes",
    "small_second_moment_counts", "surrogate_decomposition", "surrogate_log_ratio", "token_log_ratio", "token_omega",
    "validate_loss_inputs",
]
