"""A CPU stand-in for what CUDA reports about a GPU's memory, for the checks that read it.

PyTorch's caching allocator (``c10/cuda/CUDACachingAllocator.cpp``) keeps the blocks a freed tensor
(or a storage ``resize_(0)``) gave back in its own pools: they stay *reserved* by the process, and
the driver still counts them as used. ``torch.cuda.empty_cache()`` (``emptyCache`` ->
``release_cached_blocks``: ``cudaFree`` of every unused segment) hands them to the driver, and only
then does ``torch.cuda.mem_get_info()`` (``cudaMemGetInfo``, ``torch/cuda/memory.py``: the
device-wide free and total bytes) see them as free. vLLM empties the cache before its own start
check for this reason (``v1/worker/gpu_worker.py``), as Megatron does after
``offload_grad_buffers`` (``distributed/distributed_data_parallel.py``).

:class:`CachingAllocator` keeps that arithmetic for a given set of CPU storages standing for device
memory: *allocated* = their live bytes; *reserved* = the most allocated since the last
``empty_cache`` (a freed block is cached, a new one reuses the cache first; fragmentation is left
out); ``mem_get_info`` = (total - context - reserved, total). ``install`` puts it behind
``torch.cuda.is_available``/``empty_cache``/``mem_get_info``/``synchronize``, so the project's own
calls (``utils.memory.release_cached_memory``, the engine-start check) run unchanged against it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class CachingAllocator:
    """CUDA's memory numbers for the storages ``storages()`` returns (see the module docstring)."""

    def __init__(self, storages: Callable[[], Iterable], *, total: int, context: int = 0):
        self._storages, self.total, self.context = storages, total, context
        self._reserved = 0
        self.observe()

    def allocated(self) -> int:
        return sum(s.nbytes() for s in self._storages())

    def observe(self) -> int:
        """Reserved bytes now (call after allocations the storages made: the high-water mark)."""
        self._reserved = max(self._reserved, self.allocated())
        return self._reserved

    def empty_cache(self) -> None:
        self._reserved = self.allocated()

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.context - self.observe(), self.total

    def install(self, monkeypatch) -> CachingAllocator:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        return self
