"""Small collectives used by the train step: gathering per-sequence values over data parallelism and
reducing step metrics so every rank reports the same numbers. Tensors here are device data (device
groups); the few Python values (metric names, min/max floats, the metrics dict) go over ``control``.

Metrics travel as ``name -> (sum, count)`` pairs. Summing both parts over micro-batches and
data-parallel ranks and dividing at the end gives the mean over the whole global batch, whatever
the split (a mean of per-micro-batch means would weight a short micro-batch like a long one).
Only the last pipeline stage computes losses; :func:`broadcast_from_last_stage` hands its result
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


def sum_metric_pairs(pairs: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Adds up ``name -> tensor([sum, count])`` dicts (one per micro-batch); missing names count 0."""
    total: dict[str, Tensor] = {}
    for item in pairs:
        for name, value in item.items():
            value = value.detach().to(torch.float64).reshape(2)
            total[name] = total[name] + value if name in total else value.clone()
    return total


def reduce_metric_pairs(pairs: dict[str, Tensor], group) -> dict[str, float]:
    """All-reduces ``name -> tensor([sum, count])`` over ``group`` (SUM of both parts) and returns
    ``name -> sum / count`` (NaN when count is 0). Every rank of ``group`` must pass the same names."""
    names = sorted(pairs)
    if not names:
        return {}
    stacked = torch.stack([pairs[name].to(comm_device(), torch.float64).reshape(2) for name in names])  # [M, 2]
    if _size(group) > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
    out = {}
    for name, (total, count) in zip(names, stacked.tolist()):
        out[name] = total / count if count != 0 else float("nan")
    return out


def reduce_min_max(lows: dict[str, float], highs: dict[str, float], group) -> dict[str, float]:
    """Minimum of ``lows`` and maximum of ``highs`` over the ranks of ``group`` (Python floats: over
    its gloo twin, see ``control``). A rank may lack a name (e.g. no loss tokens in its
    micro-batches, so no ratio minimum): names are unioned first and gaps take the neutral value,
    so the reduction sees equally long lists everywhere."""
    names = control.all_gather_object((sorted(lows), sorted(highs)), over=group)
    low_names = sorted(set().union(*(n[0] for n in names)))
    high_names = sorted(set().union(*(n[1] for n in names)))
    values = [-lows.get(n, float("inf")) for n in low_names] + [highs.get(n, float("-inf")) for n in high_names]
    reduced = control.reduce_floats(values, "max", over=group)
    out = {name: -v for name, v in zip(low_names, reduced[:len(low_names)])}
    out.update(zip(high_names, reduced[len(low_names):]))
    return out


def broadcast_from_last_stage(obj, *, pp_group, last_stage_rank: int):
    """Returns the last pipeline stage's ``obj`` (any picklable value, e.g. a metrics dict) on every
    stage of ``pp_group`` (over its gloo twin); ``last_stage_rank`` is that stage's global rank."""
    return control.broadcast_object(obj, src=last_stage_rank, over=pp_group)
