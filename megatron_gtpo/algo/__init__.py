"""Pure-tensor policy-optimisation algorithms: GTPO, GRPO, Dr. GRPO, DAPO (spec algorithms.md).

No torch.distributed, no megatron, no config objects in this package. One training step::

    rewards += soft_overlong_punishment(...)                      # DAPO (filters.py)
    keep = dapo_group_filter(accuracy, group_ids)                 # DAPO dynamic sampling (filters.py)
    prepared = prepare_batch(name, token_ids=..., mask=..., rewards=..., group_ids=...,
                             mean_entropy=..., **cfg.prepare_kwargs())    # ONCE per global batch
    for micro-batch rows idx:                                     # any DP rank / micro-batch split
        loss, metrics = compute_loss(name, logp=..., mask=..., old_logp=..., ref_logp=...,
                                     **prepared.rows(idx).loss_inputs(), **cfg.loss_kwargs(...),
                                     num_tokens=global_tokens, num_seqs=global_seqs)

``LOSSES`` (registry.py) is the only place an algorithm name is resolved; ``LOSSES[name](...)`` is
the whole-batch single-process loss (``policy_loss``).
"""

from megatron_gtpo.algo.advantage import (completion_mean_entropy, entropy_filter, group_advantages, group_index,
                                          shape_advantages)
from megatron_gtpo.algo.aggregate import AGG_MODES, aggregate
from megatron_gtpo.algo.config import AlgoConfig
from megatron_gtpo.algo.conflict import ConflictRuns, conflict_runs, conflict_weights
from megatron_gtpo.algo.filters import dapo_group_filter, soft_overlong_punishment
from megatron_gtpo.algo.kl import entropy_from_logits, kl_k3
from megatron_gtpo.algo.losses import compute_loss, policy_loss
from megatron_gtpo.algo.prepare import PreparedBatch, gtpo_seq_scale, prepare_batch
from megatron_gtpo.algo.registry import LOSSES, Algorithm, get_algorithm

__all__ = [
    "AGG_MODES", "LOSSES", "Algorithm", "AlgoConfig", "ConflictRuns", "PreparedBatch", "aggregate",
    "completion_mean_entropy", "compute_loss", "conflict_runs", "conflict_weights", "dapo_group_filter",
    "entropy_filter", "entropy_from_logits", "get_algorithm", "group_advantages", "group_index", "gtpo_seq_scale",
    "kl_k3", "policy_loss", "prepare_batch", "shape_advantages", "soft_overlong_punishment",
]
