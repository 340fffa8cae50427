"""HF <-> Megatron-Core parameter mapping: names, fused layouts and tensor-parallel slicing.

Pure tensor code (no torch.distributed): every converter, the live-model loader and the
streaming exporter use these tables, so one mapping serves conversion and weight sync.
The name table is documented in ``megatron_gtpo/train/model.py``.

Three layouts appear:

* **HF**: separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` by default; a
  family record (``models/families.py``) may name other HF tensors for a parameter, and one name
  for a fused parameter means its *pieces* (q, k, v / gate, up) are concatenated along dim 0 in one
  HF tensor (Phi-3's ``qkv_proj`` = [q; k; v], ``gate_up_proj`` = [gate; up]).
* **global Megatron** (what the dist-checkpoint stores, = TP=1): ``linear_qkv`` rows grouped per
  KV group ``[q heads of group g | k_g | v_g]``; ``linear_fc1`` = ``[gate ; up]``.
* **TP shard r**: ``linear_qkv`` rows of groups ``r*G/tp .. (r+1)*G/tp``; ``linear_fc1`` =
  ``[gate rows of r ; up rows of r]``; column-parallel = dim-0 chunk, row-parallel = dim-1 chunk.

Vocabulary (``vocab`` kind) tensors have ``vocab_size`` rows in HF and the padded row count
(``train.model.padded_vocab_size``) in Megatron: ``pad_vocab`` appends zero rows, ``strip_vocab``
drops the padding again; both leave other kinds untouched.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_gtpo.models.families import FAMILIES, Family
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
    """HF tensor names (per-layer ones relative to ``model.layers.{i}.``), in fusion order: one per
    piece, or a single name holding every piece (``fused``)."""
    shape: tuple[str, ...]
    """Global (TP=1) shape in named sizes (:func:`global_shape`); the HF shapes follow from it."""

    @property
    def pieces(self) -> int:
        """How many HF-side pieces make the parameter: q, k, v (qkv); gate, up (fc1); else one."""
        return {QKV: 3, FC1: 2}.get(self.kind, 1)

    @property
    def fused(self) -> bool:
        """True when one HF tensor holds every piece (concatenated along dim 0)."""
        return self.pieces > 1 and len(self.hf) == 1


_LAYER_MAPS = (
    ParamMap("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight",
             "decoder.layers.self_attention.linear_qkv.layer_norm_weight", REPLICATED, ("input_layernorm.weight",),
             ("hidden",)),
    ParamMap("self_attention.linear_qkv.weight", None, "decoder.layers.self_attention.linear_qkv.weight", QKV,
             ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), ("qkv", "hidden")),
    ParamMap("self_attention.linear_qkv.bias", None, "decoder.layers.self_attention.linear_qkv.bias", QKV,
             ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), ("qkv",)),
    ParamMap("self_attention.q_layernorm.weight", None, "decoder.layers.self_attention.q_layernorm.weight",
             REPLICATED, ("self_attn.q_norm.weight",), ("head_dim",)),
    ParamMap("self_attention.k_layernorm.weight", None, "decoder.layers.self_attention.k_layernorm.weight",
             REPLICATED, ("self_attn.k_norm.weight",), ("head_dim",)),
    ParamMap("self_attention.linear_proj.weight", None, "decoder.layers.self_attention.linear_proj.weight", ROW,
             ("self_attn.o_proj.weight",), ("hidden", "q")),
    ParamMap("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight",
             "decoder.layers.mlp.linear_fc1.layer_norm_weight", REPLICATED, ("post_attention_layernorm.weight",),
             ("hidden",)),
    ParamMap("mlp.linear_fc1.weight", None, "decoder.layers.mlp.linear_fc1.weight", FC1,
             ("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("fc1", "hidden")),
    ParamMap("mlp.linear_fc2.weight", None, "decoder.layers.mlp.linear_fc2.weight", ROW, ("mlp.down_proj.weight",),
             ("hidden", "ffn")),
)

_EMBED = ParamMap("embedding.word_embeddings.weight", None, "embedding.word_embeddings.weight", VOCAB,
                  ("model.embed_tokens.weight",), ("vocab", "hidden"))
_FINAL_NORM = ParamMap("decoder.final_layernorm.weight", None, "decoder.final_layernorm.weight", REPLICATED,
                       ("model.norm.weight",), ("hidden",))
_LM_HEAD = ParamMap("output_layer.weight", None, "output_layer.weight", VOCAB, ("lm_head.weight",),
                    ("vocab", "hidden"))

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
    hidden: int = 0
    """Residual width (``hidden_size``; 0: unknown, only :func:`global_shape` needs it)."""
    ffn: int = 0
    """SwiGLU inner width (``intermediate_size``; 0: unknown, only :func:`global_shape` needs it)."""


def shapes_of(hf_config: dict) -> Shapes:
    """Head counts and widths from an HF config.json."""
    return Shapes(heads=int(hf_config["num_attention_heads"]), groups=num_kv_heads_of(hf_config),
                  head_dim=head_dim_of(hf_config), vocab=int(hf_config["vocab_size"]),
                  hidden=int(hf_config["hidden_size"]), ffn=int(hf_config["intermediate_size"]))


def global_shape(pm: ParamMap, s: Shapes) -> tuple[int, ...]:
    """The global (TP=1) Megatron shape of ``pm`` for a model of sizes ``s`` (vocabulary unpadded)."""
    sizes = {"hidden": s.hidden, "ffn": s.ffn, "fc1": 2 * s.ffn, "head_dim": s.head_dim, "q": s.heads * s.head_dim,
             "qkv": (s.heads + 2 * s.groups) * s.head_dim, "vocab": s.vocab}
    return tuple(sizes[name] for name in pm.shape)


def layer_maps(family: Family) -> tuple[ParamMap, ...]:
    """Per-layer parameters of ``family``: the default rows, the q/k/v bias and q/k norms where the
    record has them, and the record's own HF names (``Family.hf_names``)."""
    out = []
    for pm in _LAYER_MAPS:
        if pm.local.endswith("linear_qkv.bias") and not family.qkv_bias:
            continue
        if pm.local.endswith(("q_layernorm.weight", "k_layernorm.weight")) and not family.qk_norm:
            continue
        names = family.hf_names.get(pm.local)
        if names is not None and len(names) not in (1, pm.pieces):
            raise ValueError(f"family {family.name}: {pm.local} has {pm.pieces} pieces; give one HF name per piece "
                             f"or a single fused one, not {names}")
        out.append(dataclasses.replace(pm, hf=names) if names else pm)
    return tuple(out)


def all_layer_maps() -> list[ParamMap]:
    """The per-layer parameters of every family (the weight-push check's table of split dims)."""
    return [pm for family in FAMILIES.values() for pm in layer_maps(family)]


def pre_maps() -> tuple[ParamMap, ...]:
    """Parameters of the first pipeline stage outside the layers."""
    return (_EMBED,)


def post_maps(*, tied: bool) -> tuple[ParamMap, ...]:
    """Parameters of the last pipeline stage outside the layers (no lm_head when tied)."""
    return (_FINAL_NORM,) if tied else (_FINAL_NORM, _LM_HEAD)


def hf_names(pm: ParamMap, layer: int | None) -> tuple[str, ...]:
    """Full HF names of ``pm`` for global ``layer`` (None for non-layer params)."""
    return pm.hf if layer is None else tuple(f"model.layers.{layer}.{n}" for n in pm.hf)


# ----------------------------------------------------------------------------- fusion

def piece_rows(pm: ParamMap, rows: int, shapes: Shapes) -> list[int]:
    """Rows of each piece (q, k, v / gate, up) of a Megatron tensor of ``rows`` rows: the global
    tensor with the model's ``shapes``, or one TP shard with the shard's head counts."""
    if pm.kind == QKV:
        per_group = (shapes.heads // shapes.groups + 2) * shapes.head_dim
        groups = rows // per_group
        q = groups * (shapes.heads // shapes.groups) * shapes.head_dim
        return [q, groups * shapes.head_dim, groups * shapes.head_dim]
    if pm.kind == FC1:
        return [rows // 2, rows // 2]
    return [rows]


def hf_shapes(pm: ParamMap, megatron_shape: tuple[int, ...], shapes: Shapes) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors :func:`split` makes of a Megatron tensor of ``megatron_shape`` (a
    global tensor with ``shapes``, or one TP shard with the per-shard head counts): one per piece,
    or one fused tensor; a padded vocabulary gets HF's row count."""
    tail = tuple(megatron_shape[1:])
    if pm.kind == VOCAB and shapes.vocab:
        return [(shapes.vocab, *tail)]
    rows = piece_rows(pm, megatron_shape[0], shapes)
    return [(sum(rows), *tail)] if pm.fused else [(r, *tail) for r in rows]


def fuse(pm: ParamMap, hf_tensors: list[torch.Tensor], shapes: Shapes) -> torch.Tensor:
    """HF tensors -> the global (TP=1) Megatron tensor of ``pm``."""
    if pm.fused:  # one HF tensor of concatenated pieces: [q; k; v] or [gate; up]
        (tensor,) = hf_tensors
        if pm.kind == FC1:
            return tensor
        hf_tensors = list(tensor.split(piece_rows(pm, tensor.shape[0], shapes), dim=0))
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
    if pm.kind == FC1 and pm.fused:  # [gate; up] is already the HF layout
        return [tensor]
    if pm.kind == QKV:
        per = shapes.heads // shapes.groups
        tail = tensor.shape[1:]
        grouped = tensor.reshape(shapes.groups, (per + 2) * shapes.head_dim, *tail)
        q, k, v = torch.split(grouped, [per * shapes.head_dim, shapes.head_dim, shapes.head_dim], dim=1)
        pieces = [t.reshape(-1, *tail) for t in (q, k, v)]
        return [torch.cat(pieces, dim=0)] if pm.fused else [t.contiguous() for t in pieces]
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
    """Shards of all TP ranks (in rank order) -> the global tensor; the inverse of tp_shard
    (LoRA's adapter gather uses it; the converter tests check the pair)."""
    if len(shards) == 1 or pm.kind == REPLICATED:
        return shards[0]
    if pm.kind == FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=1 if pm.kind == ROW else 0)


def find_param_map(local_name: str, family: Family, *, tied: bool) -> tuple[ParamMap, int | None]:
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
