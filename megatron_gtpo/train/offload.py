"""The trainer's gradient buffers and optimizer state parked in host memory while colocated engines
generate (``rollout.offload_trainer``), and brought back for the train step or a checkpoint save.

    offload(): optimizer state (moments, fp32 master weights) copied to host, every storage freed
               with ``resize_(0)``, then the allocator's cache emptied
    reload():  storages re-allocated; the optimizer state copied back, the gradient buffers zeroed

Storage by storage: views into one buffer move once. Gradients are not copied back, because Megatron
zeroes its grad buffers at the start of every step.

Why the cache is emptied: ``resize_(0)`` hands a CUDA storage's blocks back to PyTorch's caching
allocator, not to the driver, so ``torch.cuda.mem_get_info()`` (the engine-start check, and any
other process) would still count them as used; Megatron's own ``offload_grad_buffers``
(``distributed/distributed_data_parallel.py``) empties the cache after the same resize for the
same reason. On CPU the same call hands glibc's free heap back (``utils.memory``).

Who may call ``reload`` when: only while the colocated engines sleep (their KV cache is the memory
the state returns to); the driver's :class:`~megatron_gtpo.rollout.memory.Choreography` orders it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_gtpo.train import optim_state
from megatron_gtpo.utils.memory import release_cached_memory


class TrainerOffload:
    """Gradient buffers and optimizer state of a Megatron policy, parked in host memory on demand."""

    def __init__(self, model_chunks: list, optimizer):
        self._chunks, self._optimizer = model_chunks, optimizer
        self._grads: list = []
        self._state: list = []
        self._host: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self.offloaded = False

    def _storages(self) -> tuple[list, list]:
        """Grad buffers and optimizer state as they are now (Adam creates its moments at the first step)."""
        grads = _unique_storages(b.grad_data for c in self._chunks
                                 for b in getattr(c, "buffers", []) + getattr(c, "expert_parallel_buffers", []))
        return grads, _unique_storages(_optimizer_tensors(self._optimizer))

    @property
    def nbytes(self) -> int:
        """Bytes an offload frees on the device now."""
        return 0 if self.offloaded else sum(s.nbytes() for part in self._storages() for s in part)

    def offload(self) -> None:
        if self.offloaded:
            return
        self._grads, self._state = self._storages()
        on_gpu = any(s.device.type == "cuda" for s in self._state)
        self._host = []
        for storage in self._state:  # pinned host memory only pays for device-to-host copies
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_bytes(storage), non_blocking=on_gpu)
            self._host.append(host)
        if on_gpu:
            torch.cuda.synchronize()
        self._sizes = [s.nbytes() for s in self._grads]
        for storage in self._grads + self._state:
            storage.resize_(0)
        release_cached_memory()  # the freed blocks back to the driver (see the module docstring)
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        for storage, size in zip(self._grads, self._sizes):
            storage.resize_(size)
            _bytes(storage).zero_()
        for storage, host in zip(self._state, self._host):
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=storage.device.type == "cuda")
        if any(s.device.type == "cuda" for s in self._state):
            torch.cuda.synchronize()
        self._host = []
        self.offloaded = False


def _bytes(storage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    return torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage)


def _optimizer_tensors(optimizer) -> Iterable[torch.Tensor]:
    """Moments and fp32 master weights of a Megatron optimizer (chained or not): the per-parameter
    state by the rules of the optimizer in use (``train.optim_state``), then Megatron's main copies."""
    yield from optim_state.state_tensors(optimizer)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(opt, name, None) or []:
                yield from (p.data for p in group)


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list:
    seen, out = set(), []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen.add(storage.data_ptr())
            out.append(storage)
    return out
