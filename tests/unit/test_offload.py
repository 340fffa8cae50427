"""The trainer offload (``rollout.offload_trainer``, train/offload.py) on a real Megatron model, DDP
grad buffer and Adam after one step (single process, CPU), and what it and the engine-start check
do to a GPU's free memory, counted as CUDA counts it (tests/cuda_standin.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.plan.memory import EngineBudget
from megatron_gtpo.rollout.placement import check_free_memory
from megatron_gtpo.train.offload import TrainerOffload
from megatron_gtpo.utils.configuration import ConfigError
from tests.cuda_standin import CachingAllocator

GIB = 1 << 30


@pytest.fixture(scope="module")
def policy():
    """(chunks, optimizer) of the tiny policy after one Adam step: moments exist."""
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.models.tiny import ensure_tiny_char
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train.model import build_model
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp

    dims = init_distributed(tp=1, seed=0)
    chunks = wrap_ddp(build_model(read_hf_config(ensure_tiny_char()), dims=dims), OptimConfig())
    optimizer, _ = build_optimizer(chunks, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3}), total_steps=1)
    for p in chunks[0].parameters():
        p.main_grad.normal_()
    optimizer.step()
    return chunks, optimizer


def test_trainer_offload_frees_and_restores_optimizer_state_and_grad_buffers(policy):
    chunks, optimizer = policy
    state = [t.clone() for s in optimizer.optimizer.state.values() for t in s.values() if t.numel() > 1]
    offload = TrainerOffload(chunks, optimizer)
    grad_bytes = sum(b.grad_data.nbytes for b in chunks[0].buffers)
    assert offload.nbytes >= sum(t.nbytes for t in state) + grad_bytes  # moments (+ master copies) + grad buffer
    offload.offload()
    assert all(s.nbytes() == 0 for s in offload._grads + offload._state) and offload.nbytes == 0
    offload.reload()
    after = [t for s in optimizer.optimizer.state.values() for t in s.values() if t.numel() > 1]
    assert all(torch.equal(a, b) for a, b in zip(state, after))
    assert all(float(p.main_grad.abs().sum()) == 0.0 for p in chunks[0].parameters())  # zeroed, as at step start


def test_offload_hands_its_memory_to_the_driver(policy, monkeypatch):
    """N1a (GPU review round 3): ``resize_(0)`` alone left the offloaded grads and master weights in
    PyTorch's cache, so the device's free memory (what the engine-start check and vLLM read) did
    not grow and both MoE recipes were refused at start. Injected: no ``release_cached_memory()``
    after the resize in ``TrainerOffload.offload`` -> free grows by 0 bytes, this fails."""
    chunks, optimizer = policy
    offload = TrainerOffload(chunks, optimizer)
    held, storages = offload.nbytes, [s for part in offload._storages() for s in part]
    params = [p.untyped_storage() for p in chunks[0].parameters()]
    cuda = CachingAllocator(lambda: storages + params, total=8 * GIB, context=GIB // 2).install(monkeypatch)
    before = cuda.mem_get_info()[0]
    offload.offload()
    try:
        assert cuda.mem_get_info()[0] - before == held > 0
    finally:
        offload.reload()


def test_engine_start_check_counts_cached_blocks_as_free(monkeypatch):
    """N8: blocks the trainer freed but PyTorch still caches (DDP's parameter re-map leaves about
    one copy of the parameters) were counted as used, a ConfigError at the margin although vLLM,
    which empties the cache first, would start. Injected: no ``release_cached_memory()`` in
    ``placement.check_free_memory`` -> ConfigError, this fails. A share that does not fit even
    then is still refused."""
    live, freed = torch.empty(GIB // 4, dtype=torch.uint8), torch.empty(GIB // 2, dtype=torch.uint8)
    storages = [live.untyped_storage(), freed.untyped_storage()]
    cuda = CachingAllocator(lambda: storages, total=4 * GIB).install(monkeypatch)
    freed.untyped_storage().resize_(0)  # as DDP does to the parameters it copied into its buffer
    assert cuda.mem_get_info()[0] == 4 * GIB - 3 * GIB // 4  # cached: still counted as used
    check_free_memory(EngineBudget(gpu_memory_utilization=0.9, planned=True, trainer_resident=GIB // 4))
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.95"):
        check_free_memory(EngineBudget(gpu_memory_utilization=0.95, planned=True, trainer_resident=GIB // 4))
