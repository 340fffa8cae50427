"""Control plane: every collective that carries CPU data (Python objects, flags, a few floats) goes
over gloo, never over the device groups (NCCL on GPU takes only device tensors, and object
collectives there stage every pickle through GPU memory). Values travel as data, never pickles
(:mod:`parallel.objects`): a peer's bytes can build only the classes the receiver names.

One gloo group spans all ranks (created by ``dims.init_distributed`` right after the default
group). Collectives among the ranks of one of Megatron's device groups (e.g. the last pipeline
stage's data-parallel peers) use that group's gloo *twin*, same ranks, made once by
:func:`add_twins`: pass the device group as ``over=``. Every function is the identity in a world
of one rank (or a group of one), so single-process code needs no special case.

Device data (loss sums, logits statistics, weights) stays on the device groups with tensors on
``collectives.comm_device()``.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_gtpo.parallel import objects

_WORLD = None  # the gloo group over all ranks
_TIMEOUT: datetime.timedelta | None = None
_TWINS: dict = {}  # device group -> its gloo twin (None for a group of one rank)
_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}


def _multi() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world() -> tuple[int, int]:
    """(global rank, world size); (0, 1) outside a multi-rank job."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def init(*, timeout: datetime.timedelta) -> None:
    """Creates the control group over all ranks (collective; idempotent until :func:`reset`)."""
    global _WORLD, _TIMEOUT
    if _WORLD is None and dist.is_initialized():
        _TIMEOUT = timeout
        _WORLD = dist.new_group(backend="gloo", timeout=timeout)


def reset() -> None:
    """Forgets the control group and the twins (after ``destroy_process_group``)."""
    global _WORLD
    _WORLD = None
    _TWINS.clear()


def add_twins(groups: Sequence) -> None:
    """Creates a gloo twin (same ranks) of each of this rank's device ``groups``. Collective: every
    rank calls it with its own group of each kind in the same order (e.g. ``[dp, pp]``)."""
    if not _multi():
        return
    mine = [tuple(dist.get_process_group_ranks(g)) for g in groups]
    everyone = all_gather_data(mine)
    for kind, group in enumerate(groups):
        for ranks in sorted({entry[kind] for entry in everyone}):
            twin = dist.new_group(list(ranks), backend="gloo", timeout=_TIMEOUT) if len(ranks) > 1 else None
            if ranks == mine[kind]:
                _TWINS[group] = twin


def _group(over):
    """The gloo group for ``over`` (None = all ranks), or None when it has a single rank."""
    if not _multi():
        return None
    if _WORLD is None:
        raise RuntimeError("the control plane is not initialised: call parallel.dims.init_distributed "
                           "(or parallel.control.init) on every rank first")
    if over is None:
        return _WORLD
    if over not in _TWINS:
        raise RuntimeError(f"no gloo twin of process group {over!r}: create it with control.add_twins "
                           "on every rank (init_distributed makes those of the DP and PP groups)")
    return _TWINS[over]


def broadcast_data(value, *, src: int = 0, over=None, records: Sequence[type] = ()):
    """``value`` of global rank ``src`` on every rank of ``over`` (None = all ranks), as data: see
    :mod:`parallel.objects` for what it may hold (``records``: the dataclasses and exception
    classes it may contain). ``src`` gets its own ``value`` back; the others a decoded copy."""
    group = _group(over)
    if group is None:
        return value
    mine = dist.get_rank() == src
    data = objects.encode(value, records=records) if mine else b""
    size = torch.tensor([len(data)], dtype=torch.int64)  # host memory on purpose (gloo)
    dist.broadcast(size, src=src, group=group)
    buffer = _as_tensor(data) if mine else torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return value if mine else objects.decode(buffer.numpy().data, records=records)


def all_gather_data(value, *, over=None, records: Sequence[type] = ()) -> list:
    """Every rank's ``value``, in group-rank order (global rank order for ``over=None``), as data
    (see :func:`broadcast_data`); this rank's own entry is ``value`` itself."""
    group = _group(over)
    if group is None:
        return [value]
    data = objects.encode(value, records=records)
    count = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(count)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)  # gloo's all_gather takes equal sizes
    padded[:len(data)] = _as_tensor(data)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(count)]
    dist.all_gather(parts, padded, group=group)
    me = dist.get_group_rank(group, dist.get_rank())
    return [value if i == me else objects.decode(part.numpy().data[:int(size.item())], records=records)
            for i, (part, size) in enumerate(zip(parts, sizes))]


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def reduce_floats(values: Sequence[float], op: str, *, over=None) -> list[float]:
    """Element-wise ``op`` (``"min"``, ``"max"`` or ``"sum"``) of equally long float lists."""
    if op not in _OPS:
        raise ValueError(f"op={op!r} must be one of {sorted(_OPS)}")
    group = _group(over)
    if group is None or not values:
        return [float(v) for v in values]
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64)  # host memory on purpose
    dist.all_reduce(tensor, op=_OPS[op], group=group)
    return tensor.tolist()


def any_rank(flag: bool, *, over=None) -> bool:
    """True on every rank when ``flag`` is True on at least one (e.g. a preemption signal that
    reached only some ranks: all of them must checkpoint together)."""
    return reduce_floats([1.0 if flag else 0.0], "max", over=over)[0] > 0


def barrier(*, over=None) -> None:
    """Waits for every rank of ``over`` (None = all ranks)."""
    group = _group(over)
    if group is not None:
        dist.barrier(group=group)
