"""The shard plan of a weight push: which HF tensors exist, who owns them, who receives what.

Pure arithmetic on the pipeline's parameter list (no torch.distributed): the exporter
(:mod:`megatron_gtpo.sync.export`), the up-front push check, the transfer to rollout servers and the
dry-run all read the same plan, so every rank and every server agrees on names, shapes, buckets
and byte offsets before a single byte moves.

Delivery modes (:func:`delivery_mode`) say what one rank receives:

* ``full``: every rank gets every HF tensor at full size (engines of TP=1 on every rank, or engine
  TP != trainer TP: vLLM's own loaders then cut each rank's slice). TP shards are all-gathered
  per tensor within the trainer's TP group and broadcast along the pipeline.
* ``local``: engine TP == trainer TP (> 1): engine rank r is trainer TP rank r, so each rank gets
  only its own TP shard, in HF names (vLLM loads it with ``is_sharded_weight``). Only the
  vocabulary-parallel tensors (embedding, lm_head) are gathered, because vLLM pads the vocabulary
  its own way. Shards are broadcast along the pipeline (the same TP rank of every stage). Not for
  families whose checkpoint fuses pieces into one tensor (Phi-3's qkv_proj): vLLM 0.32 cuts a fused
  tensor by its full q/k/v sizes, so it only loads it whole (``full``).
* ``senders``: the separate rollout pool. TP rank 0 of data-parallel replica 0 (and context-parallel
  rank 0: CP ranks hold the same weights) of every pipeline stage gathers its own stage's tensors
  and sends them straight to every server; nobody else receives anything.
* ``first``: global rank 0 gets everything (HF export to disk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.families import Family

Mode = Literal["full", "local", "senders", "first"]

_ALIGN = 64  # bytes between tensors of a packed bucket: every dtype's alignment, cache-line aligned


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One Megatron parameter of the whole pipeline (in HF order)."""

    local: str
    """``ParamMap.local`` name (e.g. ``self_attention.linear_qkv.weight``)."""
    layer: int | None
    """Global layer index, None outside the decoder layers."""
    owner: int
    """Pipeline rank whose chunks hold it."""
    shard_shape: tuple[int, ...]
    """Shape of one TP shard on the owner."""
    dtype: str
    """Parameter dtype name (``torch.bfloat16`` ...)."""


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """One HF tensor as a rank receives it."""

    name: str
    """HF parameter name."""
    shape: tuple[int, ...]
    """Shape as delivered (full, or this rank's TP shard in ``local`` mode)."""
    dtype: str
    """dtype name as exported (the model dtype)."""
    offset: int = 0
    """Byte offset inside its packed bucket (``senders`` mode), a multiple of 64."""

    @property
    def numel(self) -> int:
        out = 1
        for d in self.shape:
            out *= d
        return out


@dataclass(frozen=True, kw_only=True)
class BucketPlan:
    """One transfer unit of the ``senders`` mode: tensors of one pipeline stage, packed back to back."""

    index: int
    """Position in the push (buckets travel in this order)."""
    owner: int
    """Pipeline rank whose sender packs and sends it."""
    entries: tuple[int, ...]
    """Indices of its parameters in the plan's entry list (a parameter never straddles buckets)."""
    tensors: tuple[TensorMeta, ...]
    """What it holds, with offsets."""
    nbytes: int
    """Buffer size (aligned end of the last tensor)."""


def param_map(local: str, family: Family) -> mp.ParamMap:
    for pm in mp.pre_maps() + mp.layer_maps(family) + mp.post_maps(tied=False):
        if pm.local == local:
            return pm
    raise KeyError(local)


def hf_order(local: str, layer: int | None, family: Family) -> tuple:
    """Sort key reproducing HF order: embedding, layers in order, final norm, lm_head."""
    if layer is not None:
        return (1, layer, [pm.local for pm in mp.layer_maps(family)].index(local))
    return (0, 0, 0) if local == "embedding.word_embeddings.weight" else (2, 0, int(local == "output_layer.weight"))


def full_shape(pm: mp.ParamMap, shard_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """Global Megatron shape from one TP shard's shape."""
    if pm.kind == mp.REPLICATED or tp == 1:
        return shard_shape
    dim = 1 if pm.kind == mp.ROW else 0
    return tuple(n * tp if i == dim else n for i, n in enumerate(shard_shape))


def delivery_mode(*, transport: str, trainer_tp: int, engine_tp: int, family: Family) -> Mode:
    """What each rank receives for a transport, layout and family (see the module docstring)."""
    if transport == "separate":
        return "senders"
    return "local" if engine_tp == trainer_tp and trainer_tp > 1 and not family.fused else "full"


def receives(mode: Mode, *, tp_rank: int, dp_rank: int, pp_rank: int, owner: int, rank: int, cp_rank: int = 0) -> bool:
    """Whether a rank with these coordinates ends up holding the tensors of an entry of ``owner``."""
    if mode in ("full", "local"):
        return True
    if mode == "first":
        return rank == 0
    return tp_rank == 0 and dp_rank == 0 and cp_rank == 0 and pp_rank == owner


def delivered(entry: Entry, mode: Mode, *, family: Family, shapes: mp.Shapes, tp: int) -> list[TensorMeta]:
    """The HF tensors of ``entry`` as a receiving rank gets them in ``mode``."""
    pm = param_map(entry.local, family)
    if mode == "local" and pm.kind not in (mp.VOCAB, mp.REPLICATED):
        local = mp.Shapes(heads=shapes.heads // tp, groups=shapes.groups // tp, head_dim=shapes.head_dim)
        out_shapes = mp.hf_shapes(pm, entry.shard_shape, local)
    else:
        out_shapes = mp.hf_shapes(pm, full_shape(pm, entry.shard_shape, tp), shapes)
    return [TensorMeta(name=name, shape=tuple(shape), dtype=entry.dtype)
            for name, shape in zip(mp.hf_names(pm, entry.layer), out_shapes)]


def plan_buckets(entries: list[Entry], *, family: Family, shapes: mp.Shapes, tp: int,
                 bucket_bytes: int) -> list[BucketPlan]:
    """Cuts a ``senders`` push into buckets of whole parameters of one stage, up to ``bucket_bytes``
    (a larger parameter travels alone). Deterministic: every rank and server computes the same."""
    buckets: list[BucketPlan] = []
    current: list[TensorMeta] = []
    members: list[int] = []
    owner, size = None, 0
    for index, entry in enumerate(entries):
        metas = delivered(entry, "full", family=family, shapes=shapes, tp=tp)
        nbytes = sum(aligned(m.numel * dtype_size(m.dtype)) for m in metas)
        if current and (entry.owner != owner or size + nbytes > bucket_bytes):
            buckets.append(BucketPlan(index=len(buckets), owner=owner, entries=tuple(members),
                                      tensors=tuple(current), nbytes=size))
            current, members, size = [], [], 0
        owner = entry.owner
        members.append(index)
        for meta in metas:
            current.append(TensorMeta(name=meta.name, shape=meta.shape, dtype=meta.dtype, offset=size))
            size += aligned(meta.numel * dtype_size(meta.dtype))
    if current:
        buckets.append(BucketPlan(index=len(buckets), owner=owner, entries=tuple(members), tensors=tuple(current),
                                  nbytes=size))
    return buckets


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the packing alignment (every tensor of a bucket starts aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


def dtype_size(dtype: str) -> int:
    """Bytes per element of a dtype name (``torch.bfloat16`` or ``bfloat16``)."""
    import torch

    return torch.empty((), dtype=getattr(torch, dtype.removeprefix("torch."))).element_size()


def push_bytes(metas: list[TensorMeta]) -> int:
    """Payload bytes of a list of delivered tensors."""
    return sum(m.numel * dtype_size(m.dtype) for m in metas)
