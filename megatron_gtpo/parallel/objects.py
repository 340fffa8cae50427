"""Python-object collectives over the default group (small records: scored groups, flags)."""

from __future__ import annotations

import torch.distributed as dist


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def broadcast_object(obj, *, src: int = 0):
    """``obj`` from global rank ``src`` on every rank (identity in a one-rank world)."""
    if not _multi():
        return obj
    box = [obj if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` in a one-rank world)."""
    if not _multi():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one (e.g. a preemption signal that
    reached only some ranks: all of them must checkpoint together)."""
    if not _multi():
        return flag
    import torch

    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def barrier() -> None:
    if _multi():
        dist.barrier()
