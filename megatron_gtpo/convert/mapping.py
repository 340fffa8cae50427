"""HF <-> Megatron-Core parameter mapping: names, fused layouts and tensor-parallel slicing.

Pure tensor code (no torch.distributed): every converter, the live-model loader and the
streaming exporter use these tables, so one mapping serves conversion and weight sync.
The name table is documented in ``megatron_gtpo/train/model.py``.

Three layouts appear:

* **HF**: separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``.
* **global Megatron** (what the dist-checkpoint stores, = TP=1): ``linear_qkv`` rows grouped per
  KV group ``[q heads of group g | k_g | v_g]``; ``linear_fc1`` = ``[gate ; up]``.
* **TP shard r**: ``linear_qkv`` rows of groups ``r*G/tp .. (r+1)*G/tp``; ``linear_fc1`` =
  ``[gate rows of r ; up rows of r]``; column-parallel = dim-0 chunk, row-parallel = dim-1 chunk.

Vocabulary (``vocab`` kind) tensors have ``vocab_size`` rows in HF and the padded row count
(``train.model.padded_vocab_size``) in Megatron: ``pad_vocab`` appends zero rows, ``strip_vocab``
drops the padding again; both leave other kinds untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.models.hf_config import head_dim_of, num_kv_heads_of

# Kinds of Megatron parameters, i.e. how they are fused and split across TP ranks.
QKV, FC1, COLUMN, ROW, VOCAB, REPLICATED = "qkv", "fc1", "column", "row", "vocab", "replicated"


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of."""

    local: str
    """Parameter name inside a transformer layer (or the model) with the local spec."""
    te_name: str | None
    """Name of the same parameter with the Transformer Engine spec (fused norms), if different."""
    ckpt_key: str
    """Dist-checkpoint key (per-layer params are stacked over layers under this key)."""
    kind: str
    """How it is fused/split: one of qkv, fc1, column, row, vocab, replicated."""
    hf: tuple[str, ...]
    """HF tensor names (per-layer ones relative to ``model.layers.{i}.``), in fusion order."""


_LAYER_MAPS = (
    ParamMap("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
             "decoder.layers.self_attention.linear_qkv.layer_norm_weight", REPLICATED, ("input_layernorm.weight",)),
    ParamMap("self_attention.linear_qkv.weight", None, "decoder.layers.self_attention.linear_qkv.weight", QKV,
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ParamMap("self_attention.linear_qkv.bias", None, "decoder.layers.self_attention.linear_qkv.bias", QKV,
             ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    ParamMap("self_attention.q_layernorm.weight", None, "decoder.layers.self_attention.q_layernorm.weight",
             REPLICATED, ("self_attn.q_norm.weight",)),
    ParamMap("self_attention.k_layernorm.weight", None, "decoder.layers.self_attention.k_layernorm.weight",
             REPLICATED, ("self_attn.k_norm.weight",)),
    ParamMap("self_attention.linear_proj.weight", None, "decoder.layers.self_attention.linear_proj.weight", ROW,
             ("self_attn.o_proj.weight",)),
    ParamMap("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
             "decoder.layers.mlp.linear_fc1.layer_norm_weight", REPLICATED, ("post_attention_layernorm.weight",)),
    ParamMap("mlp.linear_fc1.weight", None, "decoder.layers.mlp.linear_fc1.weight", FC1,
             ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ParamMap("mlp.linear_fc2.weight", None, "decoder.layers.mlp.linear_fc2.weight", ROW, ("mlp.down_proj.weight",)),
)

_EMBED = ParamMap("embedding.word_embeddings.weight", None, "embedding.word_embeddings.weight", VOCAB,
                  ("model.embed_tokens.weight",))
_FINAL_NORM = ParamMap("decoder.final_layernorm.weight", None, "decoder.final_layernorm.weight", REPLICATED,
                       ("model.norm.weight",))
_LM_HEAD = ParamMap("output_layer.weight", None, "output_layer.weight", VOCAB, ("lm_head.weight",))

# Linear modules whose (empty, local-spec) ``_extra_state`` Megatron stores per layer.
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")


@dataclass(frozen=True)
class Shapes:
    """The model sizes the fused layouts depend on (read from the HF config)."""

    heads: int
    """Query heads."""
    groups: int
    """Key/value heads (query groups)."""
    head_dim: int
    """Width of one head."""
    vocab: int = 0
    """config.json's ``vocab_size`` (0: unknown); a padded Megatron vocabulary is cut back to it."""


def shapes_of(hf_config: dict) -> Shapes:
    """Head counts and width from an HF config.json."""
    return Shapes(heads=int(hf_config["num_attention_heads"]), groups=num_kv_heads_of(hf_config),
                  head_dim=head_dim_of(hf_config), vocab=int(hf_config["vocab_size"]))


def layer_maps(family: str) -> tuple[ParamMap, ...]:
    """Per-layer parameters of ``family`` (qkv bias only for Qwen2, q/k norms only for Qwen3)."""
    out = []
    for pm in _LAYER_MAPS:
        if pm.local.endswith("linear_qkv.bias") and family != "qwen2":
            continue
        if "_layernorm.weight" in pm.local and pm.local.startswith("self_attention.") and family != "qwen3":
            continue
        out.append(pm)
    return tuple(out)


def pre_maps() -> tuple[ParamMap, ...]:
    """Parameters of the first pipeline stage outside the layers."""
    return (_EMBED,)


def post_maps(*, tied: bool) -> tuple[ParamMap, ...]:
    """Parameters of the last pipeline stage outside the layers (no lm_head when tied)."""
    return (_FINAL_NORM,) if tied else (_FINAL_NORM, _LM_HEAD)


def hf_names(pm: ParamMap, layer: int | None) -> tuple[str, ...]:
    """Full HF names of ``pm`` for global ``layer`` (None for non-layer params)."""
    return pm.hf if layer is None else tuple(f"model.layers.{layer}.{n}" for n in pm.hf)


def all_hf_names(family: str, *, num_layers: int, tied: bool) -> list[str]:
    """Every HF tensor name a checkpoint of this family must contain, in export order."""
    names = [n for pm in pre_maps() for n in hf_names(pm, None)]
    for layer in range(num_layers):
        names += [n for pm in layer_maps(family) for n in hf_names(pm, layer)]
    names += [n for pm in post_maps(tied=tied) for n in hf_names(pm, None)]
    return names


# ----------------------------------------------------------------------------- fusion

def fuse(pm: ParamMap, hf_tensors: list[torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """HF tensors -> the global (TP=1) Megatron tensor of ``pm``."""
    if pm.kind == QKV:
        q, k, v = hf_tensors
        per = shapes.heads // shapes.groups
        tail = q.shape[1:]
        q = q.reshape(shapes.groups, per * shapes.head_dim, *tail)
        k = k.reshape(shapes.groups, shapes.head_dim, *tail)
        v = v.reshape(shapes.groups, shapes.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(-1, *tail)
    if pm.kind == FC1:
        return torch.cat(hf_tensors, dim=0)
    (tensor,) = hf_tensors
    return tensor


def split(pm: ParamMap, tensor: torch.Tensor, shapes: Shapes) -> list[torch.Tensor]:
    """Global Megatron tensor -> HF tensors (contiguous, in ``pm.hf`` order); inverse of fuse."""
    if pm.kind == QKV:
        per = shapes.heads // shapes.groups
        tail = tensor.shape[1:]
        grouped = tensor.reshape(shapes.groups, (per + 2) * shapes.head_dim, *tail)
        q, k, v = torch.split(grouped, [per * shapes.head_dim, shapes.head_dim, shapes.head_dim], dim=1)
        return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]
    if pm.kind == FC1:
        return [t.contiguous() for t in tensor.chunk(2, dim=0)]
    return [tensor]


# ----------------------------------------------------------------------------- vocabulary padding

def pad_vocab(pm: ParamMap, tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """HF vocabulary tensor ``[vocab, h]`` -> ``[rows, h]`` with zero padding rows (other kinds as is)."""
    if pm.kind != VOCAB or tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        raise ValueError(f"{pm.local}: {tensor.shape[0]} vocabulary rows do not fit in {rows} padded rows")
    return torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])], dim=0)


def strip_vocab(pm: ParamMap, tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Padded Megatron vocabulary tensor -> its first ``vocab_size`` rows, the HF shape (a view;
    other kinds as is)."""
    if pm.kind != VOCAB or tensor.shape[0] == vocab_size:
        return tensor
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"{pm.local}: {tensor.shape[0]} rows, fewer than vocab_size={vocab_size}")
    return tensor[:vocab_size]


# ----------------------------------------------------------------------------- tensor parallel

def tp_shard(pm: ParamMap, tensor: torch.Tensor, *, tp: int, rank: int) -> torch.Tensor:
    """Global tensor -> the slice TP rank ``rank`` of ``tp`` holds (contiguous)."""
    if tp == 1 or pm.kind == REPLICATED:
        return tensor
    if pm.kind == FC1:
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    dim = 1 if pm.kind == ROW else 0  # qkv splits whole groups because rows are grouped
    return tensor.chunk(tp, dim=dim)[rank].contiguous()


def tp_unshard(pm: ParamMap, shards: list[torch.Tensor]) -> torch.Tensor:
    """Shards of all TP ranks (in rank order) -> the global tensor; inverse of tp_shard."""
    if len(shards) == 1 or pm.kind == REPLICATED:
        return shards[0]
    if pm.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if pm.kind == ROW else 0)


def find_param_map(local_name: str, family: str, *, tied: bool) -> tuple[ParamMap, int | None]:
    """Maps a live parameter name (DDP/Float16Module prefixes removed) to its ParamMap and local
    layer index (None outside the layers). KeyError for names this module does not know."""
    if local_name.startswith("decoder.layers."):
        rest = local_name[len("decoder.layers."):]
        index, suffix = rest.split(".", 1)
        for pm in layer_maps(family):
            if suffix in (pm.local, pm.te_name):
                return pm, int(index)
        raise KeyError(local_name)
    for pm in pre_maps() + post_maps(tied=False):
        if local_name == pm.local:
            return pm, None
    raise KeyError(local_name)
