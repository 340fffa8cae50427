"""Strict device groups: on a CPU-only build, make gloo refuse what NCCL would refuse on a GPU.

On a GPU every process group except the gloo ones is NCCL, and NCCL takes only CUDA tensors: a
host tensor raises ``No backend type associated with device type cpu``. On the CPU CI machine
every group is gloo and every tensor is a CPU tensor, so such bugs pass the tests and crash the
first multi-GPU run. With ``MEGATRON_GTPO_STRICT_DEVICE_GROUPS=1`` (set by ``tests/helpers.py::
torchrun``) this module restores the distinction:

* **Which tensors are host tensors.** :class:`StrictDeviceMode` (the CPU shim's device redirect,
  plus bookkeeping) marks a tensor *host* when, on a GPU, it would be in host memory: made by a
  factory without a device (``torch.tensor([1.0])``, ``torch.zeros(n)``) or with an explicit CPU
  device, moved with ``.cpu()`` / ``.to("cpu")``, or computed only from host tensors. Everything
  else counts as a device tensor: ``device="cuda"`` / ``.cuda()`` / ``.to("cuda")``,
  ``torch.cuda.current_device()`` and ``collectives.comm_device()`` (the shim's
  :data:`cpu_shims.ACCELERATOR`, recognised by identity), ``device=t.device`` of a device tensor,
  results of ops on device tensors, and tensors the mode never sees (autograd's gradients,
  Parameters). Unknown means device, so Megatron's own traffic passes; the price is that a host
  tensor made where the mode cannot see it (``torch.from_numpy``; ``torch.load`` and
  ``torch.as_tensor`` are seen, as host) is missed.
* **Which groups are device groups.** The default (WORLD) group and every ``new_group`` created
  without ``backend="gloo"`` (Megatron's TP/PP/DP/... groups) would be NCCL; ``backend="gloo"``
  groups (the control plane, Megatron's ``*_GLOO`` groups) are host groups. Not checked: groups
  made before :func:`install` or outside ``new_group`` (``sync/wire.py``'s ``ProcessGroupGloo``),
  and the groups vLLM creates (vLLM's own code, not ours; its CPU platform makes even its "device"
  group gloo, so the classification would not mean what it means on a GPU).
* **What raises.** A tensor collective or p2p op on a device group handed a host tensor (as NCCL
  would); an object collective (``broadcast_object_list``, ``all_gather_object``, ...) on a device
  group called from anywhere but Megatron-Core (NCCL would accept it, staging the pickle through
  the GPU; the project rule is that CPU data goes over ``parallel.control``; Megatron's
  dist-checkpointing legitimately uses object collectives on the default group and is allowed);
  and a device tensor on a host group for an op that gloo supports on CPU only (everything but
  ``broadcast`` and ``all_reduce``, per the torch.distributed backend table).

Nothing here runs on a GPU machine (NCCL itself enforces the rule there) or without the variable.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_gtpo.parallel import cpu_shims

ENV = "MEGATRON_GTPO_STRICT_DEVICE_GROUPS"
_MARK = "_megatron_gtpo_host"  # attribute set on host tensors (absent = device tensor)
_DEVICE_DESCR, _DATA_DESCR = torch.Tensor.device, torch.Tensor.data
_DESCRIPTOR_CALL = type(torch.Tensor.device.__get__)  # what the mode sees for t.device / p.data = t
_PLACEMENT = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})
_DEVICE_GROUPS: set = set()
_HOST_GROUPS: set = set()
_ACTIVE = False
CHECKED: collections.Counter = collections.Counter()
"""Calls checked so far, per ``(op name, group kind)`` (tests and the overhead bench read it)."""

# collectives that carry tensors -> (tensor parameters, tensor-list parameters)
_TENSOR_OPS = {
    "all_reduce": (("tensor",), ()), "broadcast": (("tensor",), ()), "reduce": (("tensor",), ()),
    "all_gather": (("tensor",), ("tensor_list",)),
    "all_gather_into_tensor": (("output_tensor", "input_tensor"), ()),
    "gather": (("tensor",), ("gather_list",)), "scatter": (("tensor",), ("scatter_list",)),
    "reduce_scatter": (("output",), ("input_list",)),
    "reduce_scatter_tensor": (("output", "input"), ()),
    "all_to_all": ((), ("output_tensor_list", "input_tensor_list")),
    "all_to_all_single": (("output", "input"), ()),
    "send": (("tensor",), ()), "recv": (("tensor",), ()), "isend": (("tensor",), ()), "irecv": (("tensor",), ()),
}
_OBJECT_OPS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
               "send_object_list", "recv_object_list")
_GLOO_DEVICE_OK = ("broadcast", "all_reduce")  # gloo's CUDA support (torch.distributed backend table)


def requested() -> bool:
    """True when the environment asks for strict device groups."""
    return os.environ.get(ENV, "0") == "1"


def active() -> bool:
    """True once :func:`install` has wrapped torch.distributed in this process."""
    return _ACTIVE


def is_host(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` would live in host memory on a GPU machine (see the module doc)."""
    return getattr(tensor, _MARK, False)


def _set_host(tensor, host: bool) -> None:
    if host:
        setattr(tensor, _MARK, True)
    elif getattr(tensor, _MARK, False):
        delattr(tensor, _MARK)


def _target(func, args, kwargs):
    """Where an explicit placement sends the result: True = host, False = device, None = no placement."""
    device = kwargs.get("device")
    if device is None and func is torch.Tensor.to:
        for arg in args[1:2]:
            if isinstance(arg, torch.Tensor):
                return is_host(arg)
            if isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool):
                device = arg
    if func is torch.Tensor.cuda:
        return False
    if func is torch.Tensor.cpu:
        return True
    if device is None:
        return None
    return not (device is cpu_shims.ACCELERATOR or cpu_shims.is_cuda_device(device))


def _all_host(args, kwargs) -> bool:
    """True when every tensor argument (one level into lists and tuples) is a host tensor, or
    there is none (a factory); stops at the first device tensor, the common case."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            if not getattr(value, _MARK, False):
                return False
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor) and not getattr(item, _MARK, False):
                    return False
    return True


def _outputs(result):
    if isinstance(result, torch.Tensor):
        return (result,)
    if isinstance(result, (list, tuple)):
        return [r for r in result if isinstance(r, torch.Tensor)]
    return ()


def _is_argument(tensor, args, kwargs) -> bool:
    """True for in-place and ``out=`` results (the argument itself comes back)."""
    return any(tensor is value for value in (*args, *kwargs.values()))


class StrictDeviceMode(cpu_shims.CudaToCpuMode):
    """The CPU shim's device redirect plus host/device bookkeeping (see the module doc).

    Placement calls that are no-ops on CPU (``.cuda()`` on a host tensor, ``.cpu()`` on a device
    tensor) return an alias instead of the tensor itself, so that the original keeps its class,
    as the original keeps its device on a GPU. Every torch call passes through here, so the
    common case (a device tensor among the inputs, no placement) returns after a few checks.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PLACEMENT or "device" in kwargs:
            return self._placed(func, types, args, kwargs)
        if type(func) is _DESCRIPTOR_CALL:  # attribute getters and setters
            owner = func.__self__
            if owner is _DEVICE_DESCR:  # t.device: CPU device tensors answer with the accelerator stand-in
                device = func(*args)
                return cpu_shims.ACCELERATOR if device.type == "cpu" and not is_host(args[0]) else device
            if owner is _DATA_DESCR and func.__name__ == "__set__":  # p.data = t: p takes t's class
                func(*args)
                _set_host(args[0], is_host(args[1]))
                return None
        if func is torch.Tensor.type:
            return super().__torch_function__(func, types, args, kwargs)
        result = func(*args, **kwargs)
        if _all_host(args, kwargs):
            for out in _outputs(result):
                if not _is_argument(out, args, kwargs):  # in-place results keep their class
                    _set_host(out, True)
        return result

    def _placed(self, func, types, args, kwargs):
        """``device=``, ``.to``, ``.cuda``, ``.cpu``: the result's class is the target's."""
        target = _target(func, args, kwargs)
        result = super().__torch_function__(func, types, args, kwargs)
        if target is None:  # .to(dtype) and the like: as any other op
            if _all_host(args, kwargs):
                for out in _outputs(result):
                    if not _is_argument(out, args, kwargs):
                        _set_host(out, True)
            return result
        if args and result is args[0] and is_host(result) != target:  # no copy on CPU: alias it
            result = result.view_as(result)
        for out in _outputs(result):
            _set_host(out, target)
        return result


def group_kind(group) -> str | None:
    """``"device"`` (NCCL on GPU), ``"host"`` (gloo) or None (not classified, not checked)."""
    if group is None or group is dist.group.WORLD:
        return "device"
    if group in _DEVICE_GROUPS:
        return "device"
    return "host" if group in _HOST_GROUPS else None


def _is_gloo(backend) -> bool:
    return backend is not None and str(backend).lower() in ("gloo", "cpu:gloo")


def _wrap_new_group(original):
    @functools.wraps(original)
    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        backend = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if isinstance(group, dist.ProcessGroup) and not _caller(("vllm",)):
            (_HOST_GROUPS if _is_gloo(backend) else _DEVICE_GROUPS).add(group)
        return group
    return new_group


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def predicted_error(name: str, *, group_kind: str | None, host: bool) -> bool:
    """The rule this module enforces: True when NCCL (a ``"device"`` group) or gloo (a ``"host"``
    group) would refuse tensor op ``name`` with a host (``host``) or device tensor.
    bench/gpu_nccl_rules.py checks it against the real backends on a GPU."""
    if group_kind == "device":
        return host
    return group_kind == "host" and not host and name not in _GLOO_DEVICE_OK


def _check_tensors(name: str, group, tensors) -> None:
    kind = group_kind(group)
    CHECKED[name, kind] += 1
    for tensor in tensors:
        if not predicted_error(name, group_kind=kind, host=is_host(tensor)):
            continue
        if kind == "device":
            raise RuntimeError(
                f"strict device groups: dist.{name} on a device group (NCCL on GPU) got a host tensor "
                f"{_describe(tensor)}; NCCL would raise 'No backend type associated with device type cpu'. "
                "Device data: create it on collectives.comm_device(); CPU data: use parallel.control.")
        raise RuntimeError(
            f"strict device groups: dist.{name} on a gloo group got a device tensor {_describe(tensor)}; "
            "gloo supports GPU tensors only for broadcast and all_reduce. Move it to the CPU first.")


def _wrap_tensor_op(name: str, original):
    singles, lists = _TENSOR_OPS[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def op(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        tensors = [bound[p] for p in singles if bound.get(p) is not None]
        for p in lists:
            tensors.extend(bound.get(p) or ())
        _check_tensors(name, bound.get("group"), tensors)
        return original(*args, **kwargs)
    return op


def _caller(prefixes: tuple[str, ...]) -> bool:
    """True when the innermost caller outside torch and this module comes from a module named by
    ``prefixes``; helper libraries between them (typing_extensions' decorators, contextlib,
    functools) are looked through."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(("torch.", "typing_extensions", "contextlib", "functools", __name__)):
            return module.startswith(prefixes)
        frame = frame.f_back
    return False


def _wrap_object_op(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def op(*args, **kwargs):
        group = signature.bind(*args, **kwargs).arguments.get("group")
        CHECKED[name, group_kind(group)] += 1
        if group_kind(group) == "device" and not _caller(("megatron.core",)):
            raise RuntimeError(
                f"strict device groups: dist.{name} (a Python-object collective) on a device group "
                "(NCCL on GPU); control-plane data goes over the gloo control group: use "
                "megatron_gtpo.parallel.control (broadcast_data, all_gather_data, any_rank, reduce_floats)")
        return original(*args, **kwargs)
    return op


def install() -> bool:
    """Turns strict mode on for this process (idempotent; CPU-only builds). Returns True when on.

    Must run before the groups to be checked are created (``init_distributed`` calls it through
    ``cpu_shims.install`` before Megatron builds its groups). Enters :class:`StrictDeviceMode`,
    which also does the CPU shim's device redirect, so the shim must not enter its own mode.
    """
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    StrictDeviceMode().__enter__()  # stays active for the life of the process
    new_group = _wrap_new_group(c10d.new_group)
    dist.new_group = c10d.new_group = new_group
    for name in _TENSOR_OPS:
        wrapped = _wrap_tensor_op(name, getattr(dist, name))
        setattr(dist, name, wrapped)
        if name in ("isend", "irecv"):  # P2POp and batch_isend_irecv compare against c10d's own
            setattr(c10d, name, wrapped)
    for name in _OBJECT_OPS:
        setattr(dist, name, _wrap_object_op(name, getattr(dist, name)))
    _ACTIVE = True
    return True
