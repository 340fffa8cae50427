"""Small collectives used by the train step: gathering per-sequence values over data parallelism and
reducing step metrics so every rank reports the same numbers. Tensors here are device data (device
groups); the few Python values (metric names, min/max floats, the metrics dict) go over ``control``.

Metrics travel as ``(sum, count)`` pairs (``train/metric_sums.py``). Summing both parts over
micro-batches and data-parallel ranks and dividing at the end gives the mean over the whole global
batch, whatever the split (a mean of per-micro-batch means would weight a short micro-batch like a
long one). Only the last pipeline stage computes losses; :func:`broadcast_from_last_stage` hands its result
to the other stages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import control, cpu_shims

Tensor = torch.Tensor


def _size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def comm_device() -> torch.device:
    """Where device data and collective buffers live: the current GPU, or on a CPU build the CPU
    (``cpu_shims.ACCELERATOR``, which strict mode counts as the device)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else cpu_shims.ACCELERATOR


def all_gather_rows(local: Tensor, group) -> Tensor:
    """Concatenates equally shaped ``[n, ...]`` tensors of every rank of ``group`` along dim 0, in
    group-rank order (DP rank r holds rows ``r*n .. (r+1)*n - 1`` of the global batch)."""
    if _size(group) == 1:
        return local
    local = local.contiguous()
    out = local.new_empty((_size(group) * local.shape[0], *local.shape[1:]))
    dist.all_gather_into_tensor(out, local, group=group)
    return out


def reduce_sums_and_maxima(sums: Tensor, maxima: Tensor, group) -> tuple[Tensor, Tensor]:
    """All-reduces two device tensors over ``group``: ``sums`` element-wise by SUM, ``maxima`` by MAX
    (a minimum travels negated). The step's metrics of every update go through this once per step."""
    if _size(group) > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    return sums, maxima


def broadcast_from_last_stage(obj, *, pp_group, last_stage_rank: int):
    """Returns the last pipeline stage's ``obj`` (any picklable value, e.g. a metrics dict) on every
    stage of ``pp_group`` (over its gloo twin); ``last_stage_rank`` is that stage's global rank."""
    return control.broadcast_data(obj, src=last_stage_rank, over=pp_group)
