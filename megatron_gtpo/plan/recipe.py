"""A recipe read as plan inputs: the one place that knows which recipe keys the plan depends on.

    recipe_request(cfg, shape=..., nodes=..., gpus_per_node=...) -> (LayoutRequest, MemorySizes, notes)
    plan_engine_memory(cfg, model_dir=..., world=...) -> (rollout config for the engines, EngineBudget | None)

``megatron-gtpo dry-run`` prints what the first returns; the driver calls the second before it
starts colocated engines on GPUs, so vLLM's ``gpu_memory_utilization`` is the one the dry-run
printed (unless the recipe sets it) and the engine start is checked against the same plan.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from megatron_gtpo.models.shape import ModelShape, load_model_shape
from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import EngineBudget, MemorySizes, estimate_memory
from megatron_gtpo.train.lora import check_rank_fits
from megatron_gtpo.train.model import low_precision_recipe, padding_multiple
from megatron_gtpo.utils.configuration import ConfigError

DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "auto": 2}


def recipe_request(cfg: Any, *, shape: ModelShape, nodes: int, gpus_per_node: int, rollout_nodes: int | None = None,
                   gpu_memory_gib: float = 80.0, layer_spec: str = "te") -> tuple[LayoutRequest, MemorySizes, list[str]]:
    """The layout and memory inputs of a RunConfig (``rollout_nodes``: rollout servers of the
    separate transport, one per node; None = one; ``layer_spec``: ``MemorySizes.layer_spec``, te on
    GPUs, local for Megatron's local spec on CPU)."""
    vllm, optimizer, ddp, megatron = cfg.rollout.vllm, cfg.optim.optimizer, cfg.optim.ddp, cfg.model.megatron
    notes = []
    engine_dtype = str(vllm.get("dtype", "auto"))
    if engine_dtype not in DTYPE_BYTES:
        raise ConfigError(f"rollout.vllm.dtype={engine_dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
    if engine_dtype == "auto":
        notes.append("rollout.vllm.dtype is auto: engine weights and KV cache counted as bf16")
    param_bytes = DTYPE_BYTES[cfg.model.dtype]
    request = LayoutRequest(
        shape=shape, nodes=nodes, gpus_per_node=gpus_per_node, tp=cfg.parallel.tp, pp=cfg.parallel.pp,
        vpp=cfg.parallel.vpp, dp=cfg.parallel.dp, placement=cfg.sync.transport,
        rollout_tp=int(vllm.get("tensor_parallel_size", 1)),
        engines=rollout_nodes if cfg.sync.transport == "separate" else None,
        prompts_per_step=cfg.train.prompts_per_step, group_size=cfg.rollout.n, staleness=cfg.rollout.staleness,
        rows_per_micro_batch=cfg.train.rows_per_micro_batch, max_prompt_tokens=cfg.data.max_prompt_tokens,
        max_completion_tokens=cfg.rollout.max_tokens, cp=cfg.parallel.cp,
        cp_comm_type=cfg.model.megatron.get("cp_comm_type"), ep=cfg.parallel.ep, etp=cfg.parallel.etp)
    util, kv = vllm.get("gpu_memory_utilization"), vllm.get("kv_cache_memory_bytes")
    spec, lora = cfg.algorithm, cfg.model.lora
    check_rank_fits(lora, shape)  # the dry-run refuses what the trainer would
    sizes = MemorySizes(
        param_bytes=param_bytes, grad_bytes=4 if ddp.get("grad_reduce_in_fp32", False) else param_bytes,
        optimizer=str(optimizer.get("optimizer", "adam")),
        distributed_optimizer=bool(optimizer.get("use_distributed_optimizer", False)),
        rollout_bytes=DTYPE_BYTES[engine_dtype], gpu_memory_gib=gpu_memory_gib,
        gpu_memory_utilization=None if util is None else float(util), bucket_bytes=cfg.sync.bucket_size,
        offload_trainer=bool(cfg.rollout.offload_trainer), reference=spec.needs_reference,
        kv_cache_bytes=None if kv is None else int(kv), layer_spec=layer_spec,
        recompute=megatron.get("recompute_granularity"),
        # A half-precision output layer returns logits in the model dtype (train/step.py forward_kwargs)
        logits_bytes=4 if cfg.model.lm_head_fp32 else param_bytes, micro_batch_tokens=cfg.token_budget,
        sequence_multiple=padding_multiple(recipe=low_precision_recipe(megatron), tp=cfg.parallel.tp,
                                           sequence_parallel=bool(megatron.get("sequence_parallel"))),
        lora=lora if lora.enabled else None,
        engine_expert_parallel=bool(vllm.get("enable_expert_parallel", False)))
    return request, sizes, notes


def plan_engine_memory(cfg: Any, *, model_dir: str, world: int) -> tuple[Any, EngineBudget | None]:
    """The rollout config the colocated engines start with on GPUs: ``gpu_memory_utilization``
    from the memory plan unless the recipe sets it, and vLLM's sleep mode on (the driver sleeps
    and wakes the engines around each step). Unchanged, with no budget, on CPU or for the
    separate transport (the servers own their GPUs)."""
    rollout = cfg.rollout
    if not torch.cuda.is_available() or cfg.sync.transport != "colocated":
        return rollout, None
    gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count()))
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    request, sizes, _ = recipe_request(cfg, shape=load_model_shape(model_dir), nodes=max(world // gpus_per_node, 1),
                                       gpus_per_node=min(gpus_per_node, world), gpu_memory_gib=total / (1 << 30))
    mem = estimate_memory(request.shape, plan_layout(request), sizes)
    vllm = {"enable_sleep_mode": True, **rollout.vllm, "gpu_memory_utilization": mem.gpu_memory_utilization}
    budget = EngineBudget(gpu_memory_utilization=mem.gpu_memory_utilization, planned=mem.planned,
                          trainer_resident=mem.trainer_resident)
    return dataclasses.replace(rollout, vllm=vllm), budget
