"""Control plane of the weight path and the rollout fan-out: CPU objects over a gloo group.

On GPU the default group is NCCL, which only carries device tensors; the weight path's objects
(push outcomes, export metadata, completions broadcast by rank 0) therefore travel over one gloo
group spanning the whole world, created once by every rank at the same point
(:func:`control_group`, called from ``build_rollout``). Device tensors never go through here.

(The project's general control plane, ``parallel/control.py``, plays the same role for the rest
of the driver; when both exist this module should delegate to it.)
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

_GROUP: list = []  # the one world-wide gloo group, created on first use by every rank


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a multi-rank job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def control_group(timeout_s: float = 1800.0):
    """The world-wide gloo group (None in a one-rank world). Every rank must make the first call
    at the same point of the program, because creating a group is collective."""
    if world()[1] == 1:
        return None
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
    return _GROUP[0]


def all_gather_object(obj) -> list:
    """``obj`` of every rank, in rank order (a one-element list in a one-rank world)."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list = [None] * size
    dist.all_gather_object(out, obj, group=control_group())
    return out


def broadcast_object(obj, *, src: int = 0):
    """``obj`` of global rank ``src`` on every rank."""
    rank, size = world()
    if size == 1:
        return obj
    box = [obj if rank == src else None]
    dist.broadcast_object_list(box, src=src, group=control_group())
    return box[0]
