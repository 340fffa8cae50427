"""Loads HF safetensors weights straight into a live TP/PP(/VPP)-sharded Megatron model.

Each rank reads only the HF tensors its own parameters are made of, fuses them (qkv, gate/up)
into the global Megatron layout (the vocabulary padded with zero rows to the model's padded
size), slices its TP shard and copies it in; no communication and about one fused tensor of
extra memory. A tied lm_head on the last stage (PP > 1) receives the
embedding, as Megatron's own initialisation would have copied it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.convert.hf_io import HFReader
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.models.families import family_of
from megatron_gtpo.models.hf_config import tied_embeddings
from megatron_gtpo.train.model import layer_offset, unwrap


def load_hf_weights(model_chunks: list[torch.nn.Module], *, hf_dir: str | Path, hf_config: dict,
                    dims: ParallelDims) -> int:
    """Copies the HF checkpoint in ``hf_dir`` into this rank's parameters (cast to their dtype).
    Returns the number of parameters filled; raises KeyError for a parameter with no HF source."""
    family, tied = family_of(hf_config), tied_embeddings(hf_config)
    shapes = mp.shapes_of(hf_config)
    reader = HFReader(hf_dir)
    filled = 0
    for chunk in model_chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for name, param in model.named_parameters():
            pm, local_layer = mp.find_param_map(name, family, tied=tied)
            layer = None if local_layer is None else offset + local_layer
            sources = mp.hf_names(pm, layer)
            if tied and pm.local == "output_layer.weight":
                sources = ("model.embed_tokens.weight",)
            full = mp.fuse(pm, [reader.get(n) for n in sources], shapes)
            full = mp.pad_vocab(pm, full, param.shape[0] * dims.tp)  # no-op unless a vocabulary tensor
            shard = mp.tp_shard(pm, full, tp=dims.tp, rank=dims.tp_rank)
            if shard.shape != param.shape:
                raise ValueError(f"{name}: HF gives shard {tuple(shard.shape)}, parameter is {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(shard.to(param.dtype))
            filled += 1
    return filled
