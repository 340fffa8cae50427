"""The one unpickler of torch's object collectives in a trainer rank: data types only, no code.

Megatron-Core's distributed checkpointing and torch DCP plan every save and load with torch's
object collectives (``all_gather_object``, ``gather_object``, ``broadcast_object_list``,
``scatter_object_list``): one rank pickles its plan, metadata or loaded objects, the others unpickle
what arrives over the gloo pairs (NCCL on GPU). Those sockets are not authenticated, and a plain
unpickler calls whatever callable the bytes name, so a process that reached them in a peer's place
could run code as the job's owner (issue #34, S5; the package's own control plane carries no
pickles at all, see objects.py). torch decodes all of them through one hook,
``torch.distributed.distributed_c10d._unpickler``; ``install`` puts ``GuardedUnpickler`` there.

What it builds (``find_class``, the only way a pickle reaches a callable):

* the plain containers and scalars of ``SAFE_GLOBALS`` (OrderedDict, slice, complex, ...), torch's
  ``Size``, dtypes and the tensor rebuild, numpy's array and scalar reconstruction;
* the *record types* of the checkpointing packages (``RECORD_MODULES``): dataclasses, enums and
  named tuples defined there (plans, write items, chunk and tensor metadata, Megatron's sharded
  tensors and objects), whose construction only stores fields;
* a tensor's bytes through ``torch.load(weights_only=True)`` (torch's own restricted loader), in
  place of ``torch.storage._load_from_bytes``, which would run a full unpickler on them.

Anything else (``os.system``, ``builtins.eval``, any function or non-record class) raises
``pickle.UnpicklingError`` naming it: the collective fails on the rank that received it, and
nothing the bytes named was called. A legitimate type missing here fails the same way, loudly, at
the first checkpoint of the run; add it to ``SAFE_GLOBALS`` only if building it with arbitrary
arguments has no effect but a value.
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import enum
import io
import pickle

RECORD_MODULES = ("torch.distributed.checkpoint", "torch.distributed._shard", "torch.distributed.tensor",
                  "megatron.core.dist_checkpointing",
                  "vllm.distributed")  # a colocated engine's message-queue handles, over the trainer's world
SAFE_GLOBALS: dict[str, frozenset[str]] = {
    "builtins": frozenset({"set", "frozenset", "slice", "complex", "range", "bytearray", "object"}),
    "collections": frozenset({"OrderedDict", "defaultdict", "deque"}),
    "copyreg": frozenset({"_reconstructor"}),  # object.__new__(cls) of a class this list admitted
    "_codecs": frozenset({"encode"}),  # how protocol 2 spells bytes
    "torch": frozenset({"Size", "device", "dtype", "layout", "memory_format", "Tensor"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_parameter", "_rebuild_tensor"}),
    "torch._tensor": frozenset({"_rebuild_from_type_v2"}),  # calls only what this list admitted
    "torch.serialization": frozenset({"_get_layout"}),  # a layout from its name
    "numpy": frozenset({"ndarray", "dtype"}),
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),
    "numpy.core.numeric": frozenset({"_frombuffer"}),  # protocol 5's out-of-band arrays
    "numpy._core.numeric": frozenset({"_frombuffer"}),
}
_TORCH_VALUES = ("float", "int", "uint", "bool", "complex", "bfloat", "qint", "quint", "strided", "sparse",
                 "contiguous_format", "channels_last", "preserve_format")


def _tensor_bytes(data: bytes):
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _is_record(obj) -> bool:
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
                                      or (issubclass(obj, tuple) and hasattr(obj, "_fields")))


def _torch_value(name: str) -> bool:
    """A dtype, layout or memory format by name (``torch.float32``, ``torch.strided``): values, not
    callables, pickled as module attributes."""
    import torch

    return name.startswith(_TORCH_VALUES) and isinstance(
        getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))


class GuardedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that builds only the data types listed above (module docstring)."""

    def find_class(self, module: str, name: str):
        # protocol 2 spells Python 3's names in Python 2's (__builtin__.set); judge what they mean
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _tensor_bytes
        if name in SAFE_GLOBALS.get(module, ()) or (module == "torch" and _torch_value(name)):
            return super().find_class(module, name)
        if module.startswith(RECORD_MODULES) and "." not in name:
            found = super().find_class(module, name)
            if _is_record(found):
                return found
        raise pickle.UnpicklingError(
            f"refused to unpickle {module}.{name} from a peer rank: an object collective may build only data "
            "types (megatron_gtpo/parallel/unpickle.py; issue #34)")


def install() -> None:
    """Make ``GuardedUnpickler`` the unpickler of torch's object collectives in this process
    (idempotent; before the first collective, see parallel/dims.py)."""
    from torch.distributed import distributed_c10d

    distributed_c10d._unpickler = GuardedUnpickler


def installed() -> bool:
    from torch.distributed import distributed_c10d

    return distributed_c10d._unpickler is GuardedUnpickler
