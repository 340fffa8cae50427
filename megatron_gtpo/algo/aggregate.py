"""Loss aggregation: the one place where per-token losses become a scalar (style (c) 3).

GRPO, DAPO and Dr. GRPO differ mainly in this normaliser [spec 2-4, S8/S9 ``agg_loss``]:

=========================  ==========================================================  =========
mode                       value                                                       used by
=========================  ==========================================================  =========
token-mean                 ``sum_{i,t} x / num_tokens``                                DAPO
seq-mean-token-mean        ``sum_i (sum_t x_{i,t} / |o_i|) / num_seqs``                GRPO, GTPO
seq-mean-token-sum         ``sum_{i,t} x / num_seqs``
seq-mean-token-sum-norm    ``sum_{i,t} x / (num_seqs * constant)``  (constant = L)     Dr. GRPO
=========================  ==========================================================  =========

Distributed contract: a global batch is split over data-parallel ranks and micro-batches. Pass the
GLOBAL ``num_tokens`` (masked tokens of the whole global batch) and ``num_seqs`` (completions of the
whole global batch); then the per-micro-batch results SUM to the single-process loss, because every
term is a per-token or per-sequence quantity divided by a batch-wide constant. ``|o_i|`` is the
row's own length: ``mask.sum(dim=1)``, unless ``lengths`` gives it, which context parallelism needs
(a rank's mask then holds only the tokens it computes, a part of each completion; the shares of the
ranks add up to the whole row's term only when each divides by the WHOLE length). When a
normaliser is omitted the local one is used (single-process use). Dr. GRPO's ``constant`` must be given explicitly: it is the max completion
length L (rollout ``max_tokens``), a run constant, never the padded width of a micro-batch. Note that
verl's ``seq-mean-token-sum-norm`` omits ``1/num_seqs``; we follow the Dr. GRPO objective ``1/(G L)``.
"""

from __future__ import annotations

import torch

from megatron_gtpo.algo.checks import as_mask
from megatron_gtpo.algo.choices import AGG_MODES

Tensor = torch.Tensor

def aggregate(per_token_loss: Tensor, mask: Tensor, *, mode: str, num_tokens: float | Tensor | None = None,
              num_seqs: float | Tensor | None = None, constant: float | None = None,
              lengths: Tensor | None = None) -> Tensor:
    """Reduces ``per_token_loss`` [B, T] over the masked tokens to a 0-d tensor (see module table).

    ``mask`` [B, T] bool (a 0/1 mask is checked and converted). ``num_tokens``/``num_seqs``
    override the local counts with global ones (python numbers or 0-d tensors, e.g. all-reduced);
    they are the caller's contract and not checked here (this runs once per micro-batch).
    ``lengths`` [B]: each row's completion length ``|o_i|`` when ``mask`` holds only part of it
    (context parallelism); None: ``mask.sum(dim=1)``. Normalisers are clamped to >= 1 so an empty batch gives 0, not NaN. Masked-out positions never
    contribute, even if they hold NaN or inf.
    """
    if mask.dtype != torch.bool:
        mask = as_mask(mask)
    masked = torch.where(mask, per_token_loss, torch.zeros((), dtype=per_token_loss.dtype,
                                                           device=per_token_loss.device))
    row_div, denom = _divisors(mask, mode=mode, num_tokens=num_tokens, num_seqs=num_seqs, constant=constant,
                               lengths=lengths)
    if row_div is None:
        return masked.sum() / denom
    return (masked.sum(dim=1) / row_div).sum() / denom


def aggregation_weights(mask: Tensor, *, mode: str, num_tokens: float | Tensor | None = None,
                        num_seqs: float | Tensor | None = None, constant: float | None = None,
                        dtype: torch.dtype = torch.float64, lengths: Tensor | None = None) -> Tensor:
    """Per-token weight ``w`` [B, T] of ``aggregate``: ``aggregate(x, mask, ...) == sum_{i,t} w_{i,t} x_{i,t}``
    (up to rounding), 0 outside ``mask``. Same arguments as ``aggregate``; both take the
    normalisers from ``_divisors``, so the weights cannot drift from the loss:

    * token-mean: ``1 / num_tokens``; seq-mean-token-mean: ``1 / (|o_i| num_seqs)``;
    * seq-mean-token-sum: ``1 / num_seqs``; seq-mean-token-sum-norm: ``1 / (num_seqs L)``.

    Used by the diagnostics (``algo/diagnostics.py``): the algorithm's own token weights omega;
    ``lengths`` as in ``aggregate``. A bool
    ``mask`` is the caller's contract, as in ``aggregate`` (a 0/1 mask is checked and converted).
    """
    if mask.dtype != torch.bool:
        mask = as_mask(mask)
    row_div, denom = _divisors(mask, mode=mode, num_tokens=num_tokens, num_seqs=num_seqs, constant=constant,
                               lengths=lengths)
    # a Python denominator divides as a scalar: no host data copied to the device
    row = torch.ones(mask.shape[0], dtype=dtype, device=mask.device) / denom
    if row_div is not None:
        row = row / row_div.to(dtype)
    return torch.where(mask, row[:, None], torch.zeros((), dtype=dtype, device=mask.device))


def _divisors(mask: Tensor, *, mode: str, num_tokens, num_seqs, constant,
              lengths: Tensor | None = None) -> tuple[Tensor | None, float | Tensor]:
    """The one place that maps a mode to its normalisers: ``(row_div [B] or None, denom)``; the
    aggregate is ``sum_i (sum_t x_{i,t} / row_div_i) / denom`` (``row_div`` None: ``sum x / denom``)."""
    if mode == "token-mean":
        return None, _normaliser(num_tokens, mask.sum)
    seqs = _normaliser(num_seqs, lambda: mask.shape[0])
    if mode == "seq-mean-token-mean":
        return (mask.sum(dim=1) if lengths is None else lengths.to(mask.device)).clamp(min=1), seqs
    if mode == "seq-mean-token-sum":
        return None, seqs
    if mode != "seq-mean-token-sum-norm":
        raise ValueError(f"mode={mode!r} must be one of {AGG_MODES}")
    if constant is None or not (0 < float(constant) < float("inf")):
        raise ValueError(f"constant={constant!r}: mode 'seq-mean-token-sum-norm' (Dr. GRPO) needs the "
                         "constant L > 0, the max completion length (rollout max_tokens)")
    return None, seqs * float(constant)


def _normaliser(value, local):
    """``value`` clamped to >= 1; ``local()`` (this call's own count) when ``value`` is None."""
    if value is None:
        return max(int(local()), 1)
    if isinstance(value, Tensor):
        return value.clamp(min=1)
    return max(float(value), 1.0)


def masked_extremum(values: Tensor, mask: Tensor, *, largest: bool) -> Tensor:
    """0-d max (``largest``) or min of ``values`` over ``mask``, 1 when the mask is empty, computed
    without reading a device value back (no host sync: the emptiness test stays on the device)."""
    one = torch.ones((), dtype=values.dtype, device=values.device)
    if not mask.numel():
        return one
    masked = torch.where(mask, values, float("-inf") if largest else float("inf"))
    return torch.where(mask.any(), masked.max() if largest else masked.min(), one)
