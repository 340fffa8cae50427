"""The trainable policy (and GRPO's frozen reference) as Megatron model chunks with their weights.

    model.path --resolve--> HF dir or Megatron checkpoint --build_model + load--> chunks
    chunks --wrap_ddp + build_optimizer--> Policy (chunks, optimizer, LR scheduler)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.models.tiny import resolve_model_path
from megatron_gtpo.parallel.dims import ParallelDims

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(kw_only=True)
class Policy:
    """Megatron chunks of one model plus what the driver needs next to them."""

    chunks: list[torch.nn.Module]
    """One module per virtual pipeline stage (DDP-wrapped when trainable)."""
    optimizer: Any
    """Megatron optimizer (None for the frozen reference model)."""
    scheduler: Any
    """Megatron OptimizerParamScheduler (None for the reference model)."""
    model_dir: Path
    """Directory with config.json and the tokenizer (the engines are built from it)."""
    hf_config: dict
    """Parsed config.json."""
    has_hf_weights: bool
    """True when model_dir holds HF safetensors (vLLM can load them directly)."""


def has_hf_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file()


def build_policy(model: ModelConfig, *, dims: ParallelDims, optim=None, total_steps: int = 1) -> Policy:
    """Builds and loads the model; with ``optim`` (an OptimConfig) also DDP, optimizer and scheduler."""
    from megatron_gtpo.train.model import build_model, hf_config_from_dir

    model_dir = resolve_model_path(model.path)
    hf_config = hf_config_from_dir(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=DTYPES[model.dtype], overrides=model.megatron,
                         vocab_divisible_by=model.make_vocab_size_divisible_by)
    hf = has_hf_weights(model_dir)
    if hf:
        from megatron_gtpo.convert.load import load_hf_weights

        load_hf_weights(chunks, hf_dir=model_dir, hf_config=hf_config, dims=dims)
    else:
        from megatron_gtpo.checkpoint import load_model_weights

        load_model_weights(chunks, model_dir)
    optimizer = scheduler = None
    if optim is not None:
        from megatron_gtpo.train.optim import build_optimizer, wrap_ddp

        chunks = wrap_ddp(chunks, optim)
        optimizer, scheduler = build_optimizer(chunks, optim, total_steps=total_steps)
    else:
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
    return Policy(chunks=chunks, optimizer=optimizer, scheduler=scheduler, model_dir=model_dir,
                  hf_config=hf_config, has_hf_weights=hf)
