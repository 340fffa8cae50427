"""Streaming export of a live TP/PP(/VPP)-sharded Megatron model as HF-named full tensors.

Used by HF export and by the per-step weight sync into vLLM. Data flow for one parameter::

    owner PP stage: TP shards --(TP gather)--> global Megatron tensor --(PP broadcast/send)-->
    destination ranks: strip vocabulary padding rows, split fused qkv / gate-up -->
    (hf_name, tensor) pairs --> bucket

Yielded tensors have the HF shapes of config.json (``vocab_size`` rows for the embedding and
lm_head, whatever padding the live model carries).

Order is HF order (embeddings, layers 0..L-1 by global layer number, final norm, lm_head).
Which ranks materialise full tensors:

* ``dst_ranks="all"``: every rank (each data-parallel replica gathers within its own TP x PP
  group), e.g. when every rank feeds a colocated inference worker.
* ``dst_ranks="first"``: only global rank 0 (tp 0, pp 0, dp 0); the TP rank 0 of the owning
  stage holds one full tensor transiently before sending it. Other data-parallel replicas do
  no work at all; other ranks of replica 0 take part in the collectives and yield nothing.

Every rank must exhaust the iterator (it runs collectives); peak extra memory is one bucket
plus one gathered tensor. Parameters are exported in their model dtype; unsplit tensors of a
TP=1/PP=1 model may alias the parameters, so treat the yielded tensors as read-only.
"""

from __future__ import annotations

from typing import Iterator, Literal

import torch
import torch.distributed as dist

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.models.hf_config import architecture_of, tied_embeddings
from megatron_gtpo.train.model import layer_offset, unwrap


def local_params(model_chunks: list[torch.nn.Module], *, family: str, tied: bool) -> dict:
    """``{(ParamMap.local, global layer or None): (ParamMap, parameter)}`` for this rank's chunks.
    The last stage's copy of a tied embedding is left out (the first stage's is the source)."""
    out = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for name, param in model.named_parameters():
            pm, local_layer = mp.find_param_map(name, family, tied=tied)
            if tied and pm.local == "output_layer.weight":
                continue
            layer = None if local_layer is None else offset + local_layer
            out[(pm.local, layer)] = (pm, param)
    return out


def _hf_order(key: tuple[str, int | None], family: str) -> tuple:
    """Sort key reproducing HF order: embedding, layers in order, final norm, lm_head."""
    local, layer = key
    if layer is not None:
        return (1, layer, [pm.local for pm in mp.layer_maps(family)].index(local))
    return (0, 0, 0) if local == "embedding.word_embeddings.weight" else (2, 0, int(local == "output_layer.weight"))


def _global_shape(pm: mp.ParamMap, local_shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    if pm.kind == mp.REPLICATED or tp == 1:
        return local_shape
    dim = 1 if pm.kind == mp.ROW else 0
    return tuple(n * tp if i == dim else n for i, n in enumerate(local_shape))


def _plan(params: dict, *, family: str, dims: ParallelDims, pp_group) -> list[tuple]:
    """Every parameter of the whole pipeline as ``(key, owner pp rank, local shape, dtype)`` in HF
    order; one small all_gather_object among the pipeline stages (control plane)."""
    mine = [(key, tuple(param.shape), str(param.dtype)) for key, (_, param) in params.items()]
    gathered = control.all_gather_object(mine, over=pp_group) if dims.pp > 1 else [mine]
    plan = [(key, owner, shape, dtype) for owner, entries in enumerate(gathered) for key, shape, dtype in entries]
    return sorted(plan, key=lambda entry: _hf_order(entry[0], family))


def _tp_gather(pm: mp.ParamMap, shard: torch.Tensor, *, dims: ParallelDims, to_all: bool) -> torch.Tensor | None:
    """Global tensor from this stage's TP shards: on every TP rank (to_all) or on TP rank 0 only."""
    from megatron.core import parallel_state as ps

    if pm.kind == mp.REPLICATED or dims.tp == 1:
        return shard.detach()
    group = ps.get_tensor_model_parallel_group()
    shard = shard.detach().contiguous()
    parts = [torch.empty_like(shard) for _ in range(dims.tp)] if (to_all or dims.tp_rank == 0) else None
    if to_all:
        dist.all_gather(parts, shard, group=group)
    else:
        dist.gather(shard, parts, dst=dist.get_process_group_ranks(group)[0], group=group)
    return mp.tp_unshard(pm, parts) if parts is not None else None


def _materialise(pm: mp.ParamMap, entry: tuple, params: dict, *, dims: ParallelDims, to_all: bool,
                 pp_group) -> torch.Tensor | None:
    """The full global tensor of one plan entry on the ranks that need it, None elsewhere."""
    key, owner, local_shape, dtype_name = entry
    tensor = _tp_gather(pm, params[key][1], dims=dims, to_all=to_all) if owner == dims.pp_rank else None

    def empty() -> torch.Tensor:
        dtype = getattr(torch, dtype_name.removeprefix("torch."))
        return torch.empty(_global_shape(pm, local_shape, dims.tp), dtype=dtype, device=comm_device())

    if to_all:
        if dims.pp > 1:
            tensor = tensor if tensor is not None else empty()
            dist.broadcast(tensor, src=dist.get_process_group_ranks(pp_group)[owner], group=pp_group)
        return tensor
    if dims.tp_rank != 0:  # "first": only TP rank 0 of each stage moves data along the pipeline
        return None
    if dims.pp > 1 and owner != 0:
        ranks = dist.get_process_group_ranks(pp_group)
        if dims.pp_rank == owner:
            dist.send(tensor, dst=ranks[0])
        elif dims.pp_rank == 0:
            tensor = empty()
            dist.recv(tensor, src=ranks[owner])
    return tensor if dims.pp_rank == 0 else None


def export_hf_weights(model_chunks: list[torch.nn.Module], *, hf_config: dict, dims: ParallelDims,
                      bucket_bytes: int = 256 << 20,
                      dst_ranks: Literal["all", "first"] = "all") -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields buckets (lists of ``(hf_name, full_tensor)``, about ``bucket_bytes`` each, a larger
    tensor alone) covering the whole model in HF order; see the module docstring for which ranks
    receive buckets. No ``lm_head.weight`` when embeddings are tied."""
    from megatron.core import parallel_state as ps

    if dst_ranks not in ("all", "first"):
        raise ValueError(f"dst_ranks={dst_ranks!r}: expected 'all' or 'first'")
    to_all = dst_ranks == "all"
    if not to_all and dims.dp_rank != 0:
        return
    family, tied = architecture_of(hf_config), tied_embeddings(hf_config)
    shapes, vocab = mp.shapes_of(hf_config), int(hf_config["vocab_size"])
    pp_group = ps.get_pipeline_model_parallel_group() if dims.pp > 1 else None
    params = local_params(model_chunks, family=family, tied=tied)
    bucket, size = [], 0
    for entry in _plan(params, family=family, dims=dims, pp_group=pp_group):
        (local, layer) = entry[0]
        pm = _map_for(local, family)
        tensor = _materialise(pm, entry, params, dims=dims, to_all=to_all, pp_group=pp_group)
        if tensor is None:
            continue
        tensor = mp.strip_vocab(pm, tensor, vocab)  # padding rows never leave the trainer
        for name, part in zip(mp.hf_names(pm, layer), mp.split(pm, tensor, shapes)):
            bucket.append((name, part))
            size += part.nbytes
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _map_for(local: str, family: str) -> mp.ParamMap:
    for pm in mp.pre_maps() + mp.layer_maps(family) + mp.post_maps(tied=False):
        if pm.local == local:
            return pm
    raise KeyError(local)
