"""Whole-global-batch preparation: everything that needs complete groups, computed ONCE per step.

::

    token_ids, mask, rewards, group_ids, <H> --prepare_batch--> PreparedBatch
        .advantages    [B]     A (GRPO/DAPO z-score, Dr. GRPO R - mean) or GTPO's A~ = delta (A - gamma <H>)
        .token_weights [B, T]  GTPO lambda (None otherwise)
        .seq_scale     [B]     GTPO per-completion normaliser (None otherwise)
    PreparedBatch.rows(idx).loss_inputs() -> kwargs for compute_loss on one micro-batch

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
from megatron_gtpo.algo.registry import get_algorithm

Tensor = torch.Tensor

NORMALIZATIONS = ("code", "paper")


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
    runs: ConflictRuns | None
    """Forward/backward conflict run lengths (``n_i``); None when token_ids were not given."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Global-batch metrics: entropy_mean, filtered_frac, conflict_tokens_per_seq, lambda_zero_frac,
    lambda_ge2_frac, active_frac (share of completions with A != 0)."""

    def rows(self, index: Tensor | slice, *, width: int | None = None) -> "PreparedBatch":
        """The same record restricted to the completions ``index`` (one micro-batch); ``width`` trims
        ``token_weights`` to the micro-batch's own padded length (columns beyond are padding)."""
        def pick(t):
            return None if t is None else t[index]
        runs = None if self.runs is None else ConflictRuns(
            fwd=self.runs.fwd[index], bwd=self.runs.bwd[index], lengths=self.runs.lengths[index])
        return replace(self, advantages=self.advantages[index], raw_advantages=self.raw_advantages[index],
                       token_weights=None if self.token_weights is None else self.token_weights[index, :width],
                       seq_scale=pick(self.seq_scale),
                       delta=pick(self.delta), runs=runs)

    def loss_inputs(self) -> dict[str, Tensor | None]:
        """Keyword arguments ``advantages``, ``token_weights``, ``seq_scale`` for ``compute_loss``."""
        return {"advantages": self.advantages, "token_weights": self.token_weights, "seq_scale": self.seq_scale}


def prepare_batch(algo: str, *, mask: Tensor, rewards: Tensor, group_ids: Tensor, token_ids: Tensor | None = None,
                  mean_entropy: Tensor | None = None, adv_std_scale: bool | None = None, adv_eps: float = 1e-4,
                  conflict_weight: float = 2.0, conflict_overlap: str = "product", pad_id: int | None = None,
                  entropy_threshold: float = 0.7, entropy_gamma: float = 0.1,
                  gtpo_normalization: str = "code") -> PreparedBatch:
    """Advantages, and for GTPO the token weights, entropy filter and per-completion scales, of one
    WHOLE global batch (all completions of every prompt; groups must be complete).

    ``mask``/``token_ids`` [B, T]; ``rewards``/``group_ids``/``mean_entropy`` [B]. GTPO needs
    ``token_ids`` and ``mean_entropy`` (``<H>_i`` of the current policy, no gradient). For the other
    algorithms ``token_ids`` is optional and only feeds the ``conflict_tokens_per_seq`` diagnostic.
    ``adv_std_scale=None`` uses the algorithm's default (GRPO/DAPO: True).
    """
    spec = get_algorithm(algo)
    mask = as_mask(mask)
    check_shape(rewards, (mask.shape[0],), name="rewards", what="[B], one reward per completion (row of mask)")
    if gtpo_normalization not in NORMALIZATIONS:
        raise ValueError(f"gtpo_normalization={gtpo_normalization!r} must be one of {NORMALIZATIONS}")
    std_scale = spec.std_scale if adv_std_scale is None else adv_std_scale
    adv = group_advantages(rewards, group_ids, std_scale=std_scale, eps=adv_eps)
    if not spec.conflict_aware:
        runs = None if token_ids is None else conflict_runs(token_ids, mask, adv, group_ids, pad_id=pad_id)
        prepared = PreparedBatch(advantages=adv, raw_advantages=adv, token_weights=None, seq_scale=None,
                                 delta=None, runs=runs)
    else:
        if token_ids is None or mean_entropy is None:
            raise ValueError(f"algo={spec.name!r} needs token_ids [B, T] and mean_entropy [B] (<H>_i, e.g. "
                             "completion_mean_entropy(entropy, mask)) of the whole global batch")
        lam, runs = conflict_weights(token_ids, mask, adv, group_ids, weight=conflict_weight,
                                     overlap=conflict_overlap, pad_id=pad_id, return_runs=True)
        delta = entropy_filter(mean_entropy, threshold=entropy_threshold).to(adv.dtype)
        shaped = shape_advantages(adv, delta=delta, mean_entropy=mean_entropy, gamma=entropy_gamma)
        scale = gtpo_seq_scale(group_ids, runs, normalization=gtpo_normalization).to(adv.dtype)
        prepared = PreparedBatch(advantages=shaped, raw_advantages=adv, token_weights=lam, seq_scale=scale,
                                 delta=delta, runs=runs)
    prepared.metrics = _prepare_metrics(prepared, mask, mean_entropy)
    return prepared


def gtpo_seq_scale(group_ids: Tensor, runs: ConflictRuns, *, normalization: str) -> Tensor:
    """GTPO per-completion scale [B] float32 for ``seq-mean-token-mean`` over ``num_seqs = B``
    (module docstring): ``B / (num_groups * G_i)`` (paper) or ``B / (num_groups * max(1, n_i))`` (code)."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization={normalization!r} must be one of {NORMALIZATIONS}")
    index, sizes = group_index(group_ids)
    batch, num_groups = index.numel(), sizes.numel()
    per_seq = sizes[index] if normalization == "paper" else runs.n.clamp(min=1)
    return batch / (num_groups * per_seq.to(torch.float32))


@torch.no_grad()
def _prepare_metrics(prepared: PreparedBatch, mask: Tensor, mean_entropy: Tensor | None) -> dict[str, Tensor]:
    f32 = torch.float32
    batch = max(mask.shape[0], 1)
    out = {"active_frac": (prepared.raw_advantages != 0).sum().to(f32) / batch}
    out["filtered_frac"] = (torch.zeros((), dtype=f32) if prepared.delta is None
                            else (prepared.delta == 0).sum().to(f32) / batch)
    if prepared.runs is not None:
        out["conflict_tokens_per_seq"] = prepared.runs.num_conflict_tokens.sum().to(f32) / batch
    tokens = mask.sum().clamp(min=1).to(f32)
    lam = prepared.token_weights
    out["lambda_zero_frac"] = torch.zeros((), dtype=f32) if lam is None else ((lam == 0) & mask).sum() / tokens
    out["lambda_ge2_frac"] = torch.zeros((), dtype=f32) if lam is None else ((lam >= 2) & mask).sum() / tokens
    if mean_entropy is not None:
        out["entropy_mean"] = mean_entropy.detach().to(f32).mean()
    return out
