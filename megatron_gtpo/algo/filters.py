"""DAPO's dynamic-sampling group filter (docs/algorithms.md section 4.2). Its soft overlong
punishment is a reward term: ``megatron_gtpo.reward.functions.overlong_penalty``."""

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
