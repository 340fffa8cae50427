"""Host staging of a push on a rollout server: one copy per server, shared by all its vLLM workers.

A push is staged whole before anything is loaded, so that a push that fails anywhere leaves every
server on its old version. The staging lives in host memory, never on a GPU, and exists **once per
server** (one server per rollout node):

    staging bytes per server = sum over the push's buckets of bucket.nbytes
                             = sum over tensors of ceil(numel * itemsize / 64) * 64   (export dtype)
                            <= push payload + 64 bytes per tensor

(the 64-byte packing of ``sync/shards.py``; :func:`staging_bytes`). The server process makes one
anonymous shared-memory file (``memfd``: no name in any file system, freed with the server; only
this user's processes can open it, through ``/proc/<server pid>/fd/<fd>``) of that size. Worker 0
receives every bucket straight into it (on GPU through one device bucket buffer); at the commit
every worker maps the same pages and loads its own part through vLLM's loaders (each cuts its TP
slice). Before, each of the k workers of a TP=k server received and staged the whole push: k copies
per node and k copies over the senders' links.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from megatron_gtpo.sync.shards import TensorMeta, aligned, dtype_size


@dataclass(frozen=True, kw_only=True)
class StagedBucket:
    """One bucket of a push as the server stages it."""

    owner: int
    """Pipeline stage whose sender sends it (its rank in the transfer group)."""
    start: int
    """Byte offset of the bucket in the staging area."""
    nbytes: int
    """Its packed size."""
    tensors: tuple[TensorMeta, ...]
    """What it holds (offsets inside the bucket)."""


def staging_bytes(bucket_sizes) -> int:
    """Host staging of one server for a push of buckets of these packed sizes (module docstring)."""
    return sum(int(n) for n in bucket_sizes)


def layout(plan: list[TensorMeta], buckets: list[dict]) -> list[StagedBucket]:
    """The staged buckets of a checked ``plan`` cut as ``buckets`` (``{owner, nbytes, tensors}``,
    ``tensors`` = how many plan tensors in order). Raises ValueError when the cut does not cover the
    plan exactly or a tensor does not fit its bucket, or a bucket is larger than its packed tensors:
    the server stages exactly what it checked, never more."""
    out, start, taken = [], 0, 0
    for i, bucket in enumerate(buckets):
        count, nbytes = bucket["tensors"], bucket["nbytes"]
        metas = tuple(plan[taken:taken + count])
        if count < 1 or len(metas) != count or bucket["owner"] < 0:
            raise ValueError(f"receive: bucket {i} names {count} tensors from stage {bucket['owner']}, "
                             f"{len(plan) - taken} of the checked plan are left")
        end = 0
        for meta in metas:
            if meta.offset != end:  # packed back to back, 64-byte aligned: a gap would size a huge sparse area
                raise ValueError(f"receive: {meta.name} at offset {meta.offset}, its bucket packs it at {end}")
            end = aligned(meta.offset + meta.numel * dtype_size(meta.dtype))
        if nbytes != end:
            raise ValueError(f"receive: bucket {i} is {nbytes} bytes, its tensors pack into {end}")
        out.append(StagedBucket(owner=bucket["owner"], start=start, nbytes=nbytes, tensors=metas))
        start, taken = start + nbytes, taken + count
    if taken != len(plan):
        raise ValueError(f"receive: the buckets hold {taken} of the {len(plan)} checked tensors")
    return out


class SharedArea:
    """The server's staging file (server process): an anonymous shared-memory file of ``nbytes``."""

    def __init__(self, nbytes: int, generation: int):
        self.nbytes, self.generation = nbytes, generation
        self._fd = os.memfd_create("mgtpo-staging", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, max(nbytes, 1))
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        """Where this user's processes on this node open it."""

    @property
    def fileno(self) -> int:
        """The file's descriptor in the server process (to read what was staged)."""
        return self._fd

    def close(self) -> None:
        os.close(self._fd)


def map_area(path: str, nbytes: int) -> torch.Tensor:
    """The staging area as one shared uint8 tensor (any worker process of the server)."""
    return torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
