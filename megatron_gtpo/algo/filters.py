"""DAPO's batch-level filters and reward shaping (spec algorithms.md section 4)."""

from __future__ import annotations

import torch

from megatron_gtpo.algo.advantage import group_index
from megatron_gtpo.algo.checks import check_finite, check_integer, check_shape

Tensor = torch.Tensor


def dapo_group_filter(values: Tensor, group_ids: Tensor) -> Tensor:
    """Dynamic-sampling keep mask [B] bool: keeps the completions of groups whose ``values`` are not
    all equal [spec 4.2, DAPO Eq. 11: ``0 < #correct < G``].

    ``values`` [B] is the per-completion filter metric: accuracy (DAPO) or the total reward
    (verl's ``seq_reward``). Groups with one completion are dropped (they carry no signal). The
    caller over-samples and refills the batch until it holds enough kept groups.
    """
    if not isinstance(values, Tensor) or values.dim() != 1:
        raise ValueError("values must be a 1-D tensor [B] (accuracy or reward per completion)")
    check_shape(group_ids, tuple(values.shape), name="group_ids", what="[B], like values")
    check_finite(values.double(), name="values")
    index, sizes = group_index(group_ids)
    v = values.double()
    lo = torch.full((sizes.numel(),), float("inf"), dtype=v.dtype).scatter_reduce_(0, index, v, "amin")
    hi = torch.full((sizes.numel(),), float("-inf"), dtype=v.dtype).scatter_reduce_(0, index, v, "amax")
    return (hi > lo)[index]


def soft_overlong_punishment(lengths: Tensor, *, max_len: int, buffer_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment ``R_len`` [B] float32, added to the rule reward [spec 4.4, Eq. 13]:

    * ``0`` if ``|y| <= max_len - buffer_len``;
    * ``factor * ((max_len - buffer_len) - |y|) / buffer_len`` inside the buffer;
    * ``-factor`` if ``|y| > max_len``.

    ``max_len`` is L_max (the rollout's max completion tokens, 20480 in the paper), ``buffer_len`` is
    L_cache (4096). ``buffer_len = 0`` leaves only the ``-factor`` for ``|y| > max_len``.
    """
    if not isinstance(lengths, Tensor) or lengths.dim() != 1:
        raise ValueError("lengths must be a 1-D integer tensor [B] (completion token counts)")
    check_integer(lengths, name="lengths")
    if not (isinstance(max_len, int) and max_len > 0):
        raise ValueError(f"max_len={max_len!r} must be an int > 0 (max completion tokens)")
    if not (isinstance(buffer_len, int) and 0 <= buffer_len <= max_len):
        raise ValueError(f"buffer_len={buffer_len!r} must be an int in [0, max_len={max_len}] (DAPO: 4096)")
    if not (factor >= 0.0 and factor < float("inf")):
        raise ValueError(f"factor={factor!r} must be a finite number >= 0 (DAPO: 1.0)")
    safe = max_len - buffer_len
    excess = (lengths - safe).clamp(min=0).to(torch.float32)
    inside = -factor * excess / max(buffer_len, 1)
    return torch.where(lengths > max_len, torch.tensor(-factor), inside).to(torch.float32)
