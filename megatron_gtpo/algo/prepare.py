"""Whole-global-batch preparation: everything that needs complete groups, computed ONCE per step.

::

    spec, token_ids, mask, rewards, group_ids, <H> --prepare_batch--> PreparedBatch
        .advantages    [B]     A (GRPO/DAPO z-score, Dr. GRPO R - mean) or GTPO's A~ = delta (A - gamma <H>)
        .token_weights [B, T]  GTPO lambda (None otherwise)
        .seq_scale     [B]     GTPO per-completion normaliser (None otherwise)
    PreparedBatch.rows(idx) -> the same record for one micro-batch's rows (compute_loss's input)

GTPO per-completion scale, with ``num_seqs = B`` (the global batch) in ``seq-mean-token-mean``:

* ``normalization="paper"``: ``seq_scale_i = B / (num_groups * G_i)``, so the loss is
  ``(1/num_groups) sum_groups (1/G) sum_i (1/|o_i|) sum_t ...``: the README objective ``1/(G |o_i|)``
  averaged over prompts (with one prompt per step exactly ``1/(G |o_i|)``; groups may differ in size).
* ``normalization="code"``: ``seq_scale_i = B / (num_groups * max(1, n_i))``, so the loss is
  ``(1/num_groups) sum_i (1/|o_i|) (1/max(1, n_i)) sum_t ...``: the official code's per-completion
  ``1/max(1, n_i)`` summed over completions (no 1/G), averaged over prompts. With one prompt per step
  (the official setup) this equals the reference code exactly; the ``1/num_groups`` keeps the gradient
  scale independent of the number of prompts per step (our generalisation, not in the code).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from megatron_gtpo.algo.advantage import entropy_filter, group_advantages, group_index, shape_advantages
from megatron_gtpo.algo.checks import as_mask, check_shape
from megatron_gtpo.algo.conflict import ConflictRuns, conflict_runs, conflict_weights
from megatron_gtpo.algo.spec import AlgoSpec

Tensor = torch.Tensor

NORMALIZATIONS = ("code", "paper")
REDUCTIONS = ("mean", "sum")


@dataclass
class PreparedBatch:
    """Per-sequence inputs of the loss, computed once over the whole global batch."""

    advantages: Tensor  # [B]
    """Advantage fed to the surrogate: A, or GTPO's shaped A~ = delta (A - gamma <H>)."""
    raw_advantages: Tensor  # [B]
    """Group-relative A before GTPO shaping; its sign decides positive/negative in conflicts."""
    token_weights: Tensor | None  # [B, T]
    """GTPO lambda (0 / 1 / W / W*W); None for the other algorithms."""
    seq_scale: Tensor | None  # [B]
    """GTPO per-completion normaliser (module docstring); None for the other algorithms."""
    delta: Tensor | None  # [B]
    """GTPO entropy filter, 1 = kept, 0 = filtered; None for the other algorithms."""
    runs: ConflictRuns
    """Forward/backward conflict run lengths (``n_i``)."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Global-batch metrics under their logged names (``megatron_gtpo.metrics``): batch/active_frac,
    gtpo/filtered_frac, gtpo/conflict_tokens_per_completion, gtpo/lambda_zero_share,
    gtpo/lambda_ge2_share and, with <H>_i, entropy/mean."""

    def rows(self, index: Tensor | slice, *, width: int | None = None) -> "PreparedBatch":
        """The same record restricted to the completions ``index`` (one micro-batch); ``width`` trims
        ``token_weights`` to the micro-batch's own padded length (columns beyond are padding)."""
        def pick(t):
            return None if t is None else t[index]
        runs = ConflictRuns(fwd=self.runs.fwd[index], bwd=self.runs.bwd[index], lengths=self.runs.lengths[index])
        return replace(self, advantages=self.advantages[index], raw_advantages=self.raw_advantages[index],
                       token_weights=None if self.token_weights is None else self.token_weights[index, :width],
                       seq_scale=pick(self.seq_scale),
                       delta=pick(self.delta), runs=runs)


def prepare_batch(spec: AlgoSpec, *, token_ids: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                  mean_entropy: Tensor | None = None) -> PreparedBatch:
    """Advantages, and for GTPO the token weights, entropy filter and per-completion scales, of one
    WHOLE global batch (all completions of every prompt; groups must be complete).

    ``token_ids``/``mask`` [B, T]; ``rewards``/``group_ids``/``mean_entropy`` [B]. GTPO needs
    ``mean_entropy`` (``<H>_i`` of pi_old, no gradient). For the other algorithms the conflict runs
    are computed too, for the ``gtpo/conflict_tokens_per_completion`` diagnostic.
    """
    mask = as_mask(mask)
    check_shape(rewards, (mask.shape[0],), name="rewards", what="[B], one reward per completion (row of mask)")
    adv = group_advantages(rewards, group_ids, std_scale=spec.std_scale, eps=spec.adv_eps)
    if not spec.conflict_aware:
        runs = conflict_runs(token_ids, mask, adv, group_ids, pad_id=spec.pad_id)
        prepared = PreparedBatch(advantages=adv, raw_advantages=adv, token_weights=None, seq_scale=None,
                                 delta=None, runs=runs)
    else:
        if mean_entropy is None:
            raise ValueError(f"algo={spec.name!r} needs mean_entropy [B] (<H>_i of pi_old, e.g. "
                             "completion_mean_entropy(entropy, mask)) of the whole global batch")
        lam, runs = conflict_weights(token_ids, mask, adv, group_ids, weight=spec.conflict_weight,
                                     overlap=spec.conflict_overlap, pad_id=spec.pad_id, return_runs=True)
        delta = entropy_filter(mean_entropy, threshold=spec.entropy_threshold).to(adv.dtype)
        shaped = shape_advantages(adv, delta=delta, mean_entropy=mean_entropy, gamma=spec.entropy_gamma)
        scale = gtpo_seq_scale(group_ids, runs, normalization=spec.gtpo_normalization,
                               reduction=spec.gtpo_prompt_reduction).to(adv.dtype)
        prepared = PreparedBatch(advantages=shaped, raw_advantages=adv, token_weights=lam, seq_scale=scale,
                                 delta=delta, runs=runs)
    prepared.metrics = _prepare_metrics(prepared, mask, mean_entropy)
    return prepared


def gtpo_seq_scale(group_ids: Tensor, runs: ConflictRuns, *, normalization: str, reduction: str = "mean") -> Tensor:
    """GTPO per-completion scale [B] float32 for ``seq-mean-token-mean`` over ``num_seqs = B``
    (module docstring): ``B / (num_groups * G_i)`` (paper) or ``B / (num_groups * max(1, n_i))`` (code);
    ``reduction="sum"`` leaves out ``num_groups`` (the sum over prompts)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} must be one of {REDUCTIONS}")
    index, sizes = group_index(group_ids)
    batch, num_groups = index.numel(), sizes.numel()
    per_seq = sizes[index] if normalization == "paper" else runs.n.clamp(min=1)
    if reduction == "sum":
        return batch / per_seq.to(torch.float32)
    return batch / (num_groups * per_seq.to(torch.float32))


@torch.no_grad()
def _prepare_metrics(prepared: PreparedBatch, mask: Tensor, mean_entropy: Tensor | None) -> dict[str, Tensor]:
    f32 = torch.float32
    batch = max(mask.shape[0], 1)
    out = {"batch/active_frac": (prepared.raw_advantages != 0).sum().to(f32) / batch}
    out["gtpo/filtered_frac"] = (torch.zeros((), dtype=f32) if prepared.delta is None
                                 else (prepared.delta == 0).sum().to(f32) / batch)
    out["gtpo/conflict_tokens_per_completion"] = prepared.runs.num_conflict_tokens.sum().to(f32) / batch
    tokens = mask.sum().clamp(min=1).to(f32)
    lam = prepared.token_weights
    out["gtpo/lambda_zero_share"] = torch.zeros((), dtype=f32) if lam is None else ((lam == 0) & mask).sum() / tokens
    out["gtpo/lambda_ge2_share"] = torch.zeros((), dtype=f32) if lam is None else ((lam >= 2) & mask).sum() / tokens
    if mean_entropy is not None:
        out["entropy/mean"] = mean_entropy.detach().to(f32).mean()
    return out
