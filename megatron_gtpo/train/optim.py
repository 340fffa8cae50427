"""Megatron DDP, optimizer and learning-rate schedule for the policy.

Megatron's own configuration objects are passed through natively: ``OptimConfig.optimizer`` is a
dict of ``megatron.core.optimizer.OptimizerConfig`` fields, ``ddp`` one of
``DistributedDataParallelConfig`` fields and ``scheduler`` one of ``OptimizerParamScheduler``
arguments. This module only fills in what follows from elsewhere (dtypes from the model, the
schedule's peak/min learning rate and weight decay from the optimizer settings) and wires the
hooks Megatron's schedule expects on the model config (grad scaling, grad finalisation, no_sync).

Steps are optimizer steps: with ``mu`` updates per rollout batch the schedule advances ``mu`` times
per rollout step, so warm-up and decay lengths are given in optimizer steps.

On CPU (gloo) everything here is Megatron's real code path; megatron_cpu.md section 7 found the
DDP buckets, the distributed optimizer and clipping follow the same fp32 trajectory as plain AdamW
once ``parallel/cpu_shims`` is installed.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_gtpo.utils.configuration import ConfigError, require, unknown_keys_message

# Arguments of OptimizerParamScheduler that are derived here rather than set by the user.
_DERIVED_SCHEDULER_KEYS = ("optimizer", "init_lr", "max_lr", "min_lr", "start_wd", "end_wd")


_NO_DEFERRED_GATHER = (
    "false (unset): with the distributed optimizer it leaves the all-gather of the updated parameter "
    "shards to the next forward's hooks, but the weight push follows the optimizer step, so the engines "
    "would receive the pre-update weights of every shard this rank does not own; the push needs every "
    "gathered weight right after the step, so there is nothing for the overlap to hide")


def _default_optimizer() -> dict[str, Any]:
    return {"optimizer": "adam", "lr": 1e-6, "min_lr": 0.0, "weight_decay": 0.0, "adam_beta1": 0.9,
            "adam_beta2": 0.999, "adam_eps": 1e-8, "clip_grad": 1.0}


def _default_ddp() -> dict[str, Any]:
    return {"grad_reduce_in_fp32": True, "overlap_grad_reduce": False}


def _default_scheduler() -> dict[str, Any]:
    return {"lr_warmup_steps": 0, "lr_decay_style": "constant"}


@dataclass(kw_only=True)
class OptimConfig:
    """Optimizer, DDP and LR-schedule settings of the policy (Megatron's own field names)."""

    optimizer: dict[str, Any] = field(default_factory=_default_optimizer)
    """Fields of ``megatron.core.optimizer.OptimizerConfig`` passed through unchanged: ``optimizer``
    (adam|sgd), ``lr``, ``min_lr``, ``weight_decay``, ``adam_beta1/2``, ``adam_eps``, ``clip_grad``
    (global grad-norm clip; 0 disables), ``use_distributed_optimizer`` ...
    ``bf16``/``fp16``/``params_dtype`` are taken from the model and must not be set here;
    ``overlap_param_gather`` (here or in ``ddp``) is refused: the weight push right after the step
    needs the gathered parameters it would defer."""

    ddp: dict[str, Any] = field(default_factory=_default_ddp)
    """Fields of ``megatron.core.distributed.DistributedDataParallelConfig`` (``grad_reduce_in_fp32``,
    ``overlap_grad_reduce``, ``bucket_size`` ...). ``use_distributed_optimizer`` is copied from
    ``optimizer`` so the two cannot disagree."""

    scheduler: dict[str, Any] = field(default_factory=_default_scheduler)
    """Arguments of ``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`` in optimizer
    steps: ``lr_warmup_steps`` (linear warm-up from 0), ``lr_decay_style`` (constant|linear|cosine|
    inverse-square-root|WSD), ``lr_decay_steps`` (default: the run's total optimizer steps),
    ``wd_incr_steps``/``wd_incr_style``. Peak/min lr and weight decay come from ``optimizer``."""

    def __post_init__(self) -> None:
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        _check_keys("optimizer", self.optimizer, {f.name for f in dataclasses.fields(OptimizerConfig)},
                    "megatron.core.optimizer.OptimizerConfig")
        for key in ("bf16", "fp16", "params_dtype"):
            require(key not in self.optimizer, f"optimizer.{key}", self.optimizer.get(key),
                    "unset (taken from the model's dtype)")
        _check_keys("ddp", self.ddp, {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
                    "megatron.core.distributed.DistributedDataParallelConfig")
        require("use_distributed_optimizer" not in self.ddp, "ddp.use_distributed_optimizer",
                self.ddp.get("use_distributed_optimizer"), "unset (set optimizer.use_distributed_optimizer)")
        allowed = set(inspect.signature(OptimizerParamScheduler.__init__).parameters) - {"self"}
        _check_keys("scheduler", self.scheduler, allowed - set(_DERIVED_SCHEDULER_KEYS),
                    "OptimizerParamScheduler (lr/wd values come from `optimizer`)")
        for section, values in (("optimizer", self.optimizer), ("ddp", self.ddp)):
            for key in ("overlap_param_gather", "overlap_param_gather_with_optimizer_step"):
                require(not values.get(key), f"{section}.{key}", values.get(key), _NO_DEFERRED_GATHER)
        lr = self.optimizer.get("lr")
        require(isinstance(lr, (int, float)) and lr >= 0, "optimizer.lr", lr, "a learning rate >= 0")
        warmup = self.scheduler.get("lr_warmup_steps", 0)
        require(isinstance(warmup, int) and warmup >= 0, "scheduler.lr_warmup_steps", warmup, "an int >= 0")


def _check_keys(section: str, given: dict, allowed: set[str], owner: str) -> None:
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ConfigError(unknown_keys_message(unknown, allowed, f"optim.{section}", f"the fields of {owner}"),
                          located=True)


def _model_dtype_flags(model_config) -> dict[str, Any]:
    return {"bf16": bool(model_config.bf16), "fp16": bool(model_config.fp16),
            "params_dtype": model_config.params_dtype}


def wrap_ddp(model_chunks: list[torch.nn.Module], cfg: OptimConfig) -> list[torch.nn.Module]:
    """Wraps each model chunk in Megatron's ``DistributedDataParallel`` (gradient buffers, bucketed
    DP reduction; only the first chunk is bucketed, as Megatron's training loop does for VPP)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.utils import get_model_config

    ddp_config = DistributedDataParallelConfig(
        **cfg.ddp, use_distributed_optimizer=bool(cfg.optimizer.get("use_distributed_optimizer", False)))
    config = get_model_config(model_chunks[0])
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=(index > 0))
            for index, chunk in enumerate(model_chunks)]


def build_optimizer(model_chunks: list[torch.nn.Module], cfg: OptimConfig, *, total_steps: int):
    """``(optimizer, scheduler)`` for DDP-wrapped chunks; also installs the grad hooks Megatron's
    ``forward_backward_func`` reads from the model config.

    ``total_steps``: optimizer steps of the whole run (rollout steps x mu), the default decay length.
    """
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import get_model_config

    require(total_steps >= 1, "total_steps", total_steps, "the run's number of optimizer steps (>= 1)")
    config = get_model_config(model_chunks[0])
    opt_config = OptimizerConfig(**cfg.optimizer, **_model_dtype_flags(config))
    optimizer = get_megatron_optimizer(opt_config, model_chunks)
    sched_args = {"lr_decay_steps": total_steps, "wd_incr_steps": total_steps, "wd_incr_style": "constant",
                  **cfg.scheduler}
    warmup = sched_args.get("lr_warmup_steps", 0)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else opt_config.lr, max_lr=opt_config.lr,
        min_lr=opt_config.min_lr or 0.0, start_wd=opt_config.weight_decay, end_wd=opt_config.weight_decay,
        **sched_args)
    _install_grad_hooks(model_chunks, config, optimizer, overlap=bool(cfg.ddp.get("overlap_grad_reduce")))
    return optimizer, scheduler


def _install_grad_hooks(model_chunks, config, optimizer, *, overlap: bool) -> None:
    """The hooks Megatron's training loop sets on the (shared) TransformerConfig: loss scaling
    for mixed precision, DP reduction after the last micro-batch, and no_sync while accumulating."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    if overlap:
        no_sync = [chunk.no_sync for chunk in model_chunks]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        sync = [chunk.start_grad_sync for chunk in model_chunks]
        config.grad_sync_func = sync[0] if len(sync) == 1 else sync


def zero_grads(model_chunks: list[torch.nn.Module], optimizer) -> None:
    """Clears DDP grad buffers and the optimizer's grads before a new accumulation."""
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()


def current_lr(optimizer) -> float:
    """Learning rate of the first parameter group (all groups share the schedule)."""
    return float(optimizer.param_groups[0]["lr"])
