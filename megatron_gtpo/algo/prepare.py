"""Global-batch preparation, split by what each part depends on.

::

    spec, token_ids, mask, rewards, group_ids --prepare_groups--> PreparedBatch   ONCE per global batch
        .advantages    [B]     A (GRPO/DAPO z-score, Dr. GRPO and GTPO R - mean)
        .token_weights [B, T]  GTPO lambda (None otherwise): token ids and the SIGNS of the unshaped A
        .seq_scale     [B]     GTPO per-completion normaliser (None otherwise): group sizes or n_i
        .needs_entropy         GTPO: True, the rows still lack the entropy filter and shift
    PreparedBatch.rows(idx) -> the same record for one micro-batch's rows
    shape_rows(spec, rows, <H> of those rows) -> GTPO's A~ = delta (A - gamma <H>), delta   PER ROW
    shape_batch(spec, prepared, <H> [B])      -> shape_rows of the whole batch + its <H> metrics
    prepare_batch(..., mean_entropy=<H> [B]) = prepare_groups + shape_batch

GTPO's ``<H>_i`` (entropy filter delta_i, shift gamma <H>_i) touches row i only: nothing group-level
(the conflict signs, the normalisers, num_tokens/num_seqs) depends on it, so a train step can
prepare the groups before any forward and shape each micro-batch's rows inside its own training
forward (``train/step.py``); the whole-batch values are the same element for element.

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
from megatron_gtpo.algo.choices import NORMALIZATIONS, REDUCTIONS
from megatron_gtpo.algo.conflict import ConflictRuns, conflict_runs, conflict_weights
from megatron_gtpo.algo.spec import AlgoSpec

Tensor = torch.Tensor

@dataclass
class PreparedBatch:
    """Per-sequence inputs of the loss, computed once over the whole global batch."""

    advantages: Tensor  # [B]
    """Advantage fed to the surrogate: A, or GTPO's shaped A~ = delta (A - gamma <H>) (after ``shape_rows``)."""
    raw_advantages: Tensor  # [B]
    """Group-relative A before GTPO shaping; its sign decides positive/negative in conflicts."""
    token_weights: Tensor | None  # [B, T]
    """GTPO lambda (0 / 1 / W / W*W); None for the other algorithms."""
    seq_scale: Tensor | None  # [B]
    """GTPO per-completion normaliser (module docstring); None for the other algorithms."""
    delta: Tensor | None  # [B]
    """GTPO entropy filter, 1 = kept, 0 = filtered; None for the other algorithms and before ``shape_rows``."""
    runs: ConflictRuns
    """Forward/backward conflict run lengths (``n_i``)."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Global-batch metrics under their logged names (``megatron_gtpo.metrics``): batch/active_frac,
    gtpo/conflict_tokens_per_completion, gtpo/lambda_zero_share, gtpo/lambda_ge2_share, and once
    the <H>_i of every row are known (``shape_batch``) gtpo/filtered_frac and entropy/mean."""
    mean_entropy: Tensor | None = None  # [B]
    """GTPO's <H>_i the advantages were shaped with (``shape_rows``); None before that and for the others."""
    needs_entropy: bool = False
    """GTPO rows before ``shape_rows``: ``advantages`` are still the unshaped A and must not reach a loss."""

    def rows(self, index: Tensor | slice, *, width: int | None = None) -> "PreparedBatch":
        """The same record restricted to the completions ``index`` (one micro-batch); ``width`` trims
        ``token_weights`` to the micro-batch's own padded length (columns beyond are padding)."""
        def pick(t):
            return None if t is None else t[index]
        runs = ConflictRuns(fwd=self.runs.fwd[index], bwd=self.runs.bwd[index], lengths=self.runs.lengths[index])
        return replace(self, advantages=self.advantages[index], raw_advantages=self.raw_advantages[index],
                       token_weights=None if self.token_weights is None else self.token_weights[index, :width],
                       seq_scale=pick(self.seq_scale), delta=pick(self.delta), runs=runs,
                       mean_entropy=pick(self.mean_entropy))


def prepare_groups(spec: AlgoSpec, *, token_ids: Tensor, mask: Tensor, rewards: Tensor,
                   group_ids: Tensor) -> PreparedBatch:
    """Everything of one WHOLE global batch (all completions of every prompt; groups must be
    complete) that needs only token ids, mask, rewards and groups: advantages, and for GTPO the
    token weights and per-completion scales; for the other algorithms the conflict runs too, for
    the ``gtpo/conflict_tokens_per_completion`` diagnostic.

    ``token_ids``/``mask`` [B, T]; ``rewards``/``group_ids`` [B]. GTPO rows come back with
    ``needs_entropy``: apply ``shape_rows`` with their ``<H>_i`` before the loss.
    """
    mask = as_mask(mask)
    check_shape(rewards, (mask.shape[0],), name="rewards", what="[B], one reward per completion (row of mask)")
    adv = group_advantages(rewards, group_ids, std_scale=spec.adv_std_scale, eps=spec.adv_eps)
    if not spec.conflict_aware:
        runs = conflict_runs(token_ids, mask, adv, group_ids, pad_id=spec.pad_id)
        prepared = PreparedBatch(advantages=adv, raw_advantages=adv, token_weights=None, seq_scale=None,
                                 delta=None, runs=runs)
    else:
        lam, runs = conflict_weights(token_ids, mask, adv, group_ids, weight=spec.conflict_weight,
                                     overlap=spec.conflict_overlap, pad_id=spec.pad_id, return_runs=True)
        scale = gtpo_seq_scale(group_ids, runs, normalization=spec.gtpo_normalization,
                               reduction=spec.gtpo_prompt_reduction).to(adv.dtype)
        prepared = PreparedBatch(advantages=adv, raw_advantages=adv, token_weights=lam, seq_scale=scale,
                                 delta=None, runs=runs, needs_entropy=True)
    prepared.metrics = _group_metrics(prepared, mask)
    return prepared


def shape_rows(spec: AlgoSpec, prepared: PreparedBatch, mean_entropy: Tensor, *, check: bool = True) -> PreparedBatch:
    """GTPO's entropy filter and shift on any set of rows (a micro-batch, or the whole batch):
    ``delta_i = 1[<H>_i <= threshold]``, ``A~_i = delta_i (A_i - gamma <H>_i)`` from the unshaped
    ``raw_advantages``; row i needs only its own ``<H>_i`` (``mean_entropy`` [rows], pi_old's, no
    gradient). The other algorithms' rows come back unchanged. Checks finiteness (a NaN <H>_i
    fails here, naming ``mean_entropy``) unless ``check=False`` (the train step's per-micro-batch
    call: no host sync; its finiteness flag covers <H>_i)."""
    if not spec.conflict_aware:
        return prepared
    delta = entropy_filter(mean_entropy, threshold=spec.entropy_threshold, check=check)
    delta = delta.to(prepared.raw_advantages.dtype)
    shaped = shape_advantages(prepared.raw_advantages, delta=delta, mean_entropy=mean_entropy,
                              gamma=spec.entropy_gamma, check=check)
    return replace(prepared, advantages=shaped, delta=delta, mean_entropy=mean_entropy.detach(), needs_entropy=False)


def check_shaped(prepared: PreparedBatch) -> None:
    """Raises when GTPO rows would reach a loss or a diagnostic with their unshaped advantages."""
    if prepared.needs_entropy:
        raise ValueError("GTPO rows need shape_rows(spec, rows, mean_entropy) (entropy filter and gamma shift) "
                         "before the loss: prepare_groups leaves the advantages unshaped")


def prepare_batch(spec: AlgoSpec, *, token_ids: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor,
                  mean_entropy: Tensor | None = None) -> PreparedBatch:
    """``prepare_groups`` and, for GTPO, ``shape_batch`` (the whole batch's ``shape_rows`` and the
    metrics that need every <H>_i) in one call. GTPO needs ``mean_entropy`` [B] (``<H>_i`` of pi_old, no
    gradient); for the others it only adds ``entropy/mean``."""
    if spec.conflict_aware and mean_entropy is None:
        raise ValueError(f"algo={spec.name!r} needs mean_entropy [B] (<H>_i of pi_old, e.g. "
                         "completion_mean_entropy(entropy, mask)) of the whole global batch")
    prepared = prepare_groups(spec, token_ids=token_ids, mask=mask, rewards=rewards, group_ids=group_ids)
    return prepared if mean_entropy is None else shape_batch(spec, prepared, mean_entropy)


def shape_batch(spec: AlgoSpec, prepared: PreparedBatch, mean_entropy: Tensor) -> PreparedBatch:
    """``shape_rows`` of a WHOLE batch (``mean_entropy`` [B], every row's <H>_i), plus the metrics
    that need all of them: ``gtpo/filtered_frac`` (GTPO) and ``entropy/mean``."""
    shaped = shape_rows(spec, prepared, mean_entropy)
    f32 = torch.float32
    metrics = dict(prepared.metrics)
    with torch.no_grad():
        if shaped.delta is not None:
            metrics["gtpo/filtered_frac"] = (shaped.delta == 0).sum().to(f32) / max(shaped.delta.shape[0], 1)
        metrics["entropy/mean"] = mean_entropy.detach().to(f32).mean()
    return replace(shaped, metrics=metrics)


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
def _group_metrics(prepared: PreparedBatch, mask: Tensor) -> dict[str, Tensor]:
    f32 = torch.float32
    batch = max(mask.shape[0], 1)
    out = {"batch/active_frac": (prepared.raw_advantages != 0).sum().to(f32) / batch}
    if prepared.token_weights is None:  # no entropy filter: nothing is filtered (GTPO: shape_batch)
        out["gtpo/filtered_frac"] = torch.zeros((), dtype=f32)
    out["gtpo/conflict_tokens_per_completion"] = prepared.runs.num_conflict_tokens.sum().to(f32) / batch
    tokens = mask.sum().clamp(min=1).to(f32)
    lam = prepared.token_weights
    out["gtpo/lambda_zero_share"] = torch.zeros((), dtype=f32) if lam is None else ((lam == 0) & mask).sum() / tokens
    out["gtpo/lambda_ge2_share"] = torch.zeros((), dtype=f32) if lam is None else ((lam >= 2) & mask).sum() / tokens
    return out
