"""Wire format of the separate transport: a bucket travels as one flat byte buffer plus metadata.

    trainer: [(name, tensor), ...] --pack--> uint8 buffer [t0 | pad | t1 | pad ...] + [TensorMeta]
             --process-group send (data) / pipe (metadata)-->
    engine:  buffer + [TensorMeta] --unpack (views, no copy)--> [(name, tensor), ...]

One send per bucket instead of one per tensor: a 135M-parameter model has ~270 tensors, and per-
message latency would dominate. Offsets are aligned so every view starts on an element boundary.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

_ALIGN = 64  # bytes; covers every dtype's alignment and keeps each tensor cache-line aligned


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor sits in a packed bucket."""

    name: str
    """HF parameter name."""
    dtype: torch.dtype
    """Element type of the tensor (the engine dtype after the trainer-side cast)."""
    shape: tuple[int, ...]
    """Full (unsharded) shape."""
    offset: int
    """Byte offset in the buffer (a multiple of the alignment)."""
    nbytes: int
    """Payload bytes (without the alignment padding that follows)."""


def pack(bucket: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[TensorMeta]]:
    """Copies a bucket into one contiguous uint8 buffer."""
    metas, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for meta, (_, tensor) in zip(metas, bucket):
        buffer[meta.offset:meta.offset + meta.nbytes].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    return buffer, metas


def unpack(buffer: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buffer`` (which must outlive them)."""
    return [(m.name, buffer[m.offset:m.offset + m.nbytes].view(m.dtype).view(m.shape)) for m in metas]


def buffer_bytes(metas: list[TensorMeta]) -> int:
    last = metas[-1]
    return -(-(last.offset + last.nbytes) // _ALIGN) * _ALIGN


def open_group(store: dist.Store, *, rank: int, world: int, timeout_s: float) -> dist.ProcessGroup:
    """A two-party gloo group on its own store, outside the default (torchrun) world: the engine
    process is not a member of the trainer's world, and the trainer's collectives stay untouched."""
    return dist.ProcessGroupGloo(dist.PrefixStore("megatron_gtpo.sync", store), rank, world,
                                 datetime.timedelta(seconds=timeout_s))


def tcp_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Rendezvous store; the master binds ``port`` (0 = any free port, read back from ``.port``)."""
    return dist.TCPStore(host, port, 2, is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))
