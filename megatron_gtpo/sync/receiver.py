"""The rollout server's side of a push, as a backend of vLLM 0.32's stateful weight-transfer API.

vLLM lets a worker receive weights through a pluggable ``WeightTransferEngine`` driven by four
worker calls (``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``; the trainer-side static helpers were removed in vLLM 0.28). Its built-in
``nccl`` backend streams straight into the layer-wise reload and has a single sender; a pool of
servers that must all switch versions together, fed by every pipeline stage, needs more, so this
module registers its own backend, ``mgtpo_staged``:

    init_weight_transfer_engine(init_info)  every vLLM worker of the server joins the transfer group
    start_weight_update()                   a new staging area
    update_weights(update_info)             receives every bucket of the push (point-to-point from
                                            the bucket's sender) into host staging
    finish_weight_update()                  loads the staged push (vLLM's layer-wise in-place
                                            reload), or drops it after ``mgtpo_discard_staged``

Staging costs one copy of the weights (model dtype) in the server's *host* memory, never in GPU
memory (on GPU each bucket lands in one device buffer and is copied to pinned host memory); it is
what lets a push that fails anywhere leave every server on its old version. The staging buffers are
kept from push to push (the plan is the same every step), so only the first push pays their page
faults.
The backend is registered in every vLLM process by importing this module, which vLLM does for the
worker extension class :class:`StagedReceiverExtension` (``worker_extension_cls``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, \
    WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from megatron_gtpo.rollout.engine import reload_model
from megatron_gtpo.sync.export import view_of
from megatron_gtpo.sync.shards import TensorMeta
from megatron_gtpo.sync.wire import open_group, tcp_store

BACKEND = "mgtpo_staged"


@dataclass
class StagedInitInfo(WeightTransferInitInfo):
    """Where the transfer group meets (the server's TCP store) and this worker's rank offset."""

    host: str
    port: int
    prefix: str
    world: int
    rank_offset: int
    timeout_s: float = 900.0


@dataclass
class StagedUpdateInfo(WeightTransferUpdateInfo):
    """One whole push: its buckets in order and which group rank sends each stage's buckets."""

    version: int
    buckets: list = field(default_factory=list)
    """``(owner pipeline stage, nbytes, [TensorMeta fields as dicts])`` per bucket."""
    senders: dict = field(default_factory=dict)
    """Pipeline stage -> rank in the transfer group."""


class StagedWeightTransferEngine(WeightTransferEngine[StagedInitInfo, StagedUpdateInfo]):
    """Receives a push into host staging; loads it only at ``finish_weight_update``."""

    init_info_cls = StagedInitInfo
    update_info_cls = StagedUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model):
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.buffers: list[torch.Tensor] = []  # host staging, kept across pushes (no page faults after the first)
        self.discard = False
        self.received_buckets = 0

    def init_transfer_engine(self, init_info: StagedInitInfo) -> None:
        store = tcp_store(init_info.host, init_info.port, is_master=False, timeout_s=init_info.timeout_s)
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = open_group(store, prefix=init_info.prefix, rank=rank, world=init_info.world,
                                timeout_s=init_info.timeout_s, device=torch.device(self.device))

    def start_weight_update(self) -> None:
        self.staged, self.discard = [], False

    def receive_weights(self, update_info: StagedUpdateInfo) -> None:
        on_gpu = torch.device(self.device).type == "cuda"
        wire = torch.empty(max(n for _, n, _ in update_info.buckets), dtype=torch.uint8, device=self.device) \
            if on_gpu else None
        for index, (owner, nbytes, metas) in enumerate(update_info.buckets):
            host = self._staging(index, nbytes)
            target = wire[:nbytes] if on_gpu else host
            self.group.recv([target], update_info.senders[owner], 0).wait()
            if on_gpu:
                host.copy_(target)
            self.staged.extend((m["name"], view_of(host, TensorMeta(**m))) for m in metas)
            self.received_buckets += 1

    def _staging(self, index: int, nbytes: int) -> torch.Tensor:
        """Host buffer of bucket ``index``, reused across pushes (the plan is the same every step)."""
        while len(self.buffers) <= index:
            self.buffers.append(torch.empty(0, dtype=torch.uint8))
        if self.buffers[index].numel() != nbytes:
            self.buffers[index] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self.buffers[index]

    def finish_weight_update(self) -> None:
        staged, self.staged = self.staged, []
        if self.discard:
            return
        dtype = self.model_config.dtype
        weights = ((name, t.to(device=self.device, dtype=dtype)) for name, t in staged)
        reload_model(self.model, self.model_config, weights)

    def shutdown(self) -> None:
        self.group = None
        self.staged, self.buffers = [], []


class StagedReceiverExtension:
    """Worker extension (``worker_extension_cls``): importing it registers the backend in every vLLM
    worker process; its one call turns the next ``finish_weight_update`` into a discard."""

    def mgtpo_discard_staged(self) -> int:
        engine = self.weight_transfer_engine
        dropped = len(engine.staged)
        engine.discard = True
        return dropped


def register() -> None:
    """Registers the ``mgtpo_staged`` backend with vLLM's factory (idempotent)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, StagedWeightTransferEngine)
    except ValueError:  # already registered in this process
        pass


register()
