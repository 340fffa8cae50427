"""Counting the host syncs a piece of code would make on a GPU, on a CPU-only machine.

A host sync is a point where the CPU waits for the GPU's queue to drain: reading a device value
(``.item()``, ``bool(t)``, ``float(t)``, ``if t > 0``, Python ``min``/``max`` over tensors,
``.tolist()``, ``.numpy()``), copying device -> host (``.cpu()``, ``.to("cpu")``), a blocking
host -> device copy (``.to(device)`` of a host tensor, ``torch.tensor(data, device=...)``: pageable
memory, ``non_blocking=False``), or an op whose output shape depends on device values
(``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without
``output_size``). On CPU none of these costs anything, so the CPU suite cannot see them by timing.

:class:`SyncCounter` sees them by the operation instead, under strict mode's host/device
bookkeeping (``parallel/strict.py``: a tensor made without a device, or with ``.cpu()``, is a host
tensor; everything else stands for a device tensor): reading a host tensor is free on a GPU too
and is not counted. Scalar reads and data-dependent shapes are caught at the dispatcher
(``aten._local_scalar_dense`` is what ``item``/``bool``/``float``/``int``/``__index__`` all
reach), copies and ``tolist``/``numpy`` at the torch-function layer (on CPU they dispatch nothing).
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_gtpo.parallel import cpu_shims, strict

aten = torch.ops.aten

_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.repeat_interleave.Tensor, aten.argwhere.default}
_READS = (torch.Tensor.tolist, torch.Tensor.numpy)


def _device_tensors(values) -> list[torch.Tensor]:
    out = []
    for value in values:
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return [t for t in out if not strict.is_host(t)]


class _Dispatch(TorchDispatchMode):
    def __init__(self, events: Counter):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and _device_tensors(args):
            self.events["scalar read"] += 1
        elif func in _DATA_DEPENDENT and _device_tensors(args[:1]):
            if not (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None):
                self.events[f"data-dependent shape ({func.__name__})"] += 1
        elif func is aten.index.Tensor and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
            self.events["boolean-mask index"] += 1
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, events: Counter):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS and _device_tensors(args[:1]):
            self.events[f"read ({func.__name__})"] += 1
        elif func is torch.Tensor.cpu and _device_tensors(args[:1]):
            self.events["device -> host copy"] += 1
        elif func in (torch.Tensor.to, torch.Tensor.cuda) or "device" in kwargs:
            self._placement(func, args, kwargs)
        return func(*args, **kwargs)

    def _placement(self, func, args, kwargs) -> None:
        target = strict._target(func, args, kwargs)  # True = host, False = device, None = no placement
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is True and source is not None and not strict.is_host(source):
            self.events["device -> host copy"] += 1
        elif target is False and source is not None and strict.is_host(source) and source.numel():
            self.events["host -> device copy"] += 1
        elif target is False and func in (torch.tensor, torch.as_tensor) and not isinstance(source, torch.Tensor):
            self.events["host -> device copy (python data)"] += 1


class SyncCounter:
    """``with SyncCounter() as syncs: ...`` then ``syncs.total`` / ``syncs.events`` (what and how often).

    Tensors made before the block count as device tensors unless strict mode marked them host."""

    def __init__(self):
        self.events: Counter = Counter()
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.events.values())

    def __enter__(self) -> SyncCounter:
        self._stack.enter_context(strict.StrictDeviceMode())
        self._stack.enter_context(_Function(self.events))
        self._stack.enter_context(_Dispatch(self.events))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` placed on the stand-in device (``collectives.comm_device()`` on a CPU build)."""
    return tensor.to(cpu_shims.ACCELERATOR)
