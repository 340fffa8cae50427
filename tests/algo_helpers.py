"""Single-process, whole-batch use of the pure algorithm functions, for tests.

The trainer never calls these: it prepares a global batch once and calls ``algo.compute_loss`` per
micro-batch with global normalisers (``megatron_gtpo/train/step.py``). Tests of the algorithms
want the same computation on one batch in one call.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoConfig, AlgoSpec, ConflictRuns, PreparedBatch, TokenInputs


def spec_of(name: str, *, max_completion_tokens: int = 16, **fields) -> AlgoSpec:
    """The resolved spec of ``AlgoConfig(name=name, **fields)``."""
    return AlgoConfig(name=name, **fields).resolve(max_completion_tokens=max_completion_tokens)


def prepared_of(advantages: torch.Tensor, *, token_weights: torch.Tensor | None = None,
                seq_scale: torch.Tensor | None = None) -> PreparedBatch:
    """A PreparedBatch holding just the per-sequence loss inputs (no conflict runs)."""
    zeros = torch.zeros(advantages.shape[0], dtype=torch.long)
    return PreparedBatch(advantages=advantages, raw_advantages=advantages, token_weights=token_weights,
                         seq_scale=seq_scale, delta=None, runs=ConflictRuns(fwd=zeros, bwd=zeros, lengths=zeros))


def policy_loss(spec: AlgoSpec, *, logp, mask, rewards, group_ids, token_ids, entropy=None, mean_entropy=None,
                old_logp=None, ref_logp=None):
    """``prepare_batch`` + ``validate_loss_inputs`` + ``compute_loss`` with this batch's own
    normalisers; returns ``(loss, metrics)`` with the metrics of both steps (names as logged)."""
    if mean_entropy is None and entropy is not None and spec.needs_mean_entropy:
        mean_entropy = algo.completion_mean_entropy(entropy, mask)
    prepared = algo.prepare_batch(spec, token_ids=token_ids, mask=mask, rewards=rewards, group_ids=group_ids,
                                  mean_entropy=mean_entropy)
    # The first of mu > 1 updates may score pi_old itself (old_logp None: the ratio is exactly 1).
    check = spec if old_logp is not None else dataclasses.replace(spec, mu=1)
    algo.validate_loss_inputs(check, prepared, mask=mask, old_logp=old_logp, ref_logp=ref_logp)
    loss, metrics = algo.compute_loss(spec, TokenInputs(logp=logp, mask=mask, old_logp=old_logp, ref_logp=ref_logp),
                                      prepared)
    metrics = {**prepared.metrics, **metrics}
    if entropy is not None and not spec.needs_mean_entropy:
        metrics["entropy/mean"] = algo.completion_mean_entropy(entropy, mask).mean()
    return loss, metrics
