"""Streaming export of a live TP/PP(/VPP)-sharded Megatron model as HF-named tensors.

Used by the per-step weight push and by HF export. :class:`Exporter` first builds the push's
:mod:`shard plan <megatron_gtpo.sync.shards>` (every parameter of the whole pipeline, one small
metadata exchange over the gloo control group, cached: the model's structure never changes), so
every rank knows the names, shapes and buckets of the whole push before any byte moves. Then it
materialises one HF tensor at a time, on the ranks the delivery mode names::

    owner stage: each TP rank's piece of the HF tensor (its shard's q/k/v or gate/up slice)
        --(TP gather: to all / to TP rank 0 / none in local mode)--> HF tensor
        --(PP broadcast along the pipeline, full/local modes)--> consumer

A routed expert's tensor (mixture-of-experts families) is made where the expert lives: the EP rank
that holds it gathers it over its expert-TP group, then broadcasts it over the expert-parallel group
(``full``), sends it to global rank 0 (``first``) or packs it as that EP rank's own sender
(``senders``); no rank ever holds more than the one expert tensor in flight.

Yielded tensors have the HF shapes of config.json: ``vocab_size`` rows for the embedding and
lm_head, whatever padding the live model carries (padding rows never leave the trainer).

Memory: the gather writes each rank's piece straight into the output tensor (row chunks), or passes
one piece at a time through a piece-sized buffer (column chunks of row-parallel weights); a sender's
output is a view of its bucket buffer. So a rank holds at most what its consumer has not released
(a sender: one bucket) plus one HF tensor and one TP piece. Unsplit tensors of TP=1 models and
shard-local tensors alias the parameters: treat yielded tensors as read-only.
Every rank must exhaust its iterators (they run collectives) in the same order.

LoRA (``model.lora``): the adapters are not pushed; every adapted weight goes out merged,
``W + (alpha / r) B A``, computed per TP shard on the rank that holds it when its first piece is
asked for and dropped when the next parameter's is (q, k and v, gate and up are pieces of one
merged shard). So a LoRA push holds one merged shard more than a full one, never a second model;
``release`` (called by the weight sync around every push) drops it, so a push never sees the
previous push's adapters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.families import Family, family_of
from megatron_gtpo.models.hf_config import tied_embeddings
from megatron_gtpo.parallel import control
from megatron_gtpo.parallel.collectives import comm_device
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.sync.shards import (BucketPlan, Entry, Mode, TensorMeta, delivered, full_shape, hf_order, param_map,
                                       plan_buckets, receives, sender_ranks)
from megatron_gtpo.train.lora_layers import is_adapter_name, merge_sources
from megatron_gtpo.train.model import layer_offset, unwrap


def local_params(model_chunks: list[torch.nn.Module], *, family: Family, tied: bool, dims: ParallelDims,
                 experts: int = 0) -> dict:
    """``{(ParamMap.local, global layer or None, global expert or None): parameter}`` for this rank's
    chunks (``experts``: routed experts per layer). The last stage's copy of a tied embedding is
    left out (the first stage's is the source), and so are LoRA adapters (their weights go out
    merged)."""
    out = {}
    for chunk in model_chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for name, param in model.named_parameters():
            if is_adapter_name(name):
                continue
            pm, local_layer, local_expert = mp.find_param_map(name, family, tied=tied)
            if tied and pm.local == "output_layer.weight":
                continue
            expert = None if local_expert is None else mp.global_expert(local_expert, experts=experts, ep=dims.ep,
                                                                         ep_rank=dims.ep_rank)
            out[(pm.local, None if local_layer is None else offset + local_layer, expert)] = param
    return out


def _coords(dims: ParallelDims) -> dict[str, int]:
    return {"rank": dims.rank, "pp": dims.pp_rank, "tp": dims.tp_rank, "dp": dims.dp_rank, "cp": dims.cp_rank,
            "ep": dims.ep_rank, "etp": dims.etp_rank, "edp": dims.edp_rank}


class Exporter:
    """One rank's view of the policy as a stream of HF tensors (see the module docstring)."""

    def __init__(self, model_chunks: list[torch.nn.Module], *, hf_config: dict, dims: ParallelDims):
        self.dims, self.family = dims, family_of(hf_config)
        self.shapes = mp.shapes_of(hf_config)
        self.params = local_params(model_chunks, family=self.family, tied=tied_embeddings(hf_config), dims=dims,
                                   experts=self.shapes.experts)
        self.merges = merge_sources(model_chunks)
        """``{(local, layer): LoRA adapter}`` of the adapted dense weights (empty without LoRA)."""
        self._merged: tuple[tuple[str, int | None], torch.Tensor] | None = None
        self._entries: list[Entry] | None = None
        self.senders: list[int] = []
        """Global ranks of the ``senders`` mode (``shards.sender_ranks``), set with the entries."""

    def release(self) -> None:
        """Drops the cached merged shard (the adapters change between pushes)."""
        self._merged = None

    def _shard(self, entry: Entry) -> torch.Tensor:
        """This rank's shard of ``entry``'s parameter as the engines get it: the parameter, or for a
        LoRA-adapted weight its merged shard (computed once per parameter, see the module docstring)."""
        key = (entry.local, entry.layer)
        param = self.params[(entry.local, entry.layer, entry.expert)].detach()
        adapter = self.merges.get(key) if entry.expert is None else None  # experts carry no adapters
        if adapter is None:
            return param
        if self._merged is None or self._merged[0] != key:
            self._merged = None  # free the previous one before allocating the next
            self._merged = (key, adapter.merged(param))
        return self._merged[1]

    @property
    def entries(self) -> list[Entry]:
        """Every parameter of the whole pipeline in HF order (gathered once, then cached): dense ones
        from TP rank 0 of DP replica 0 (CP rank 0) of each stage, experts from the EP rank that holds them."""
        if self._entries is None:
            mine = [(local, layer, expert, tuple(p.shape), str(p.dtype))
                    for (local, layer, expert), p in self.params.items()]
            gathered = control.all_gather_data((_coords(self.dims), mine))
            self.senders = sender_ranks([c for c, _ in gathered], moe=self.shapes.experts > 0)
            entries = []
            for c, items in gathered:
                expert_holder, dense_holder = c["etp"] == 0 and c["edp"] == 0, c["tp"] == 0 and c["dp"] == 0 and c["cp"] == 0
                for local, layer, expert, shape, dtype in items:
                    if (dense_holder if expert is None else expert_holder):
                        entries.append(Entry(local=local, layer=layer, owner=c["pp"], shard_shape=shape, dtype=dtype,
                                             expert=expert, ep_owner=c["ep"],
                                             split=None if expert is None else self.dims.etp,
                                             source=self.senders.index(c["rank"])))
            self._entries = sorted(entries, key=lambda e: hf_order(e.local, e.layer, self.family, e.expert))
        return self._entries

    def receives(self, entry: Entry, mode: Mode) -> bool:
        d = self.dims
        return receives(mode, tp_rank=d.tp_rank, dp_rank=d.dp_rank, pp_rank=d.pp_rank, owner=entry.owner, rank=d.rank,
                        cp_rank=d.cp_rank)

    def metas(self, mode: Mode) -> list[TensorMeta]:
        """What :meth:`tensors` yields on this rank, in order: the push plan, before any byte moves."""
        return [m for e in self.entries if self.receives(e, mode)
                for m in delivered(e, mode, family=self.family, shapes=self.shapes, tp=self.dims.tp)]

    def buckets(self, bucket_bytes: int) -> list[BucketPlan]:
        """The ``senders`` push cut into buckets (identical on every rank)."""
        return plan_buckets(self.entries, family=self.family, shapes=self.shapes, tp=self.dims.tp,
                            bucket_bytes=bucket_bytes)

    def pack(self, bucket: BucketPlan, buffer: torch.Tensor | None) -> bool:
        """``senders`` mode: writes ``bucket`` into ``buffer`` (uint8, >= ``bucket.nbytes``) on its
        sender (``self.senders[bucket.owner]``: TP rank 0 of data-parallel replica 0 (CP rank 0) of the
        owner stage, or for experts expert-TP rank 0 of the EP rank holding them); the sender's other
        (expert-)TP ranks send their shards; everybody else does nothing. True on the sender."""
        sender = self.entries and self.senders[bucket.owner] == self.dims.rank
        metas = iter(bucket.tensors)
        for index in bucket.entries:
            entry = self.entries[index]
            pm = param_map(entry.local, self.family)
            takes_part = self._holds(entry, pm)
            for part in range(len(pm.hf)):
                meta = next(metas)
                if takes_part:
                    self._gather_hf(pm, entry, part, view_of(buffer, meta) if sender else None, to_all=False)
        return bool(sender)

    def _holds(self, entry: Entry, pm: mp.ParamMap) -> bool:
        """Whether this rank holds a piece of ``entry`` in the replica the push reads it from: the
        owner stage's data-parallel replica 0 (dense), or the EP rank holding the expert in expert
        replica 0 (experts); the (expert-)TP group of that replica gathers it."""
        d = self.dims
        if d.pp_rank != entry.owner:
            return False
        return d.ep_rank == entry.ep_owner and d.edp_rank == 0 if pm.is_expert else d.dp_rank == 0

    # ----------------------------------------------------------------------------- full / local / first

    def tensors(self, mode: Literal["full", "local", "first"]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors in HF order on the receiving ranks of ``mode``, one at a time; collectives
        only elsewhere."""
        from megatron.core import parallel_state as ps

        pp_group = ps.get_pipeline_model_parallel_group() if self.dims.pp > 1 else None
        for entry in self.entries:
            pm = param_map(entry.local, self.family)
            metas = delivered(entry, mode, family=self.family, shapes=self.shapes, tp=self.dims.tp)
            for part, meta in enumerate(metas):
                tensor = self._one(pm, entry, part, meta, mode=mode, pp_group=pp_group)
                if tensor is not None:
                    yield meta.name, tensor
                    del tensor  # the consumer owns it now; hold nothing while making the next one

    def _one(self, pm: mp.ParamMap, entry: Entry, part: int, meta: TensorMeta, *, mode: str, pp_group):
        d = self.dims
        mine = entry.owner == d.pp_rank
        if mode == "first":
            return self._to_first(pm, entry, part, meta, pp_group=pp_group)
        if pm.is_expert:  # the EP rank holding it gathers it, then its EP group gets it from there
            tensor = self._gather_hf(pm, entry, part, None, to_all=True) if mine and d.ep_rank == entry.ep_owner else None
            tensor = self._ep_broadcast(tensor, meta, entry) if mine and d.ep > 1 else tensor
        elif mode == "local" and pm.kind not in (mp.VOCAB, mp.REPLICATED):
            tensor = self._local_hf(pm, entry, part) if mine else None
        else:
            tensor = self._gather_hf(pm, entry, part, None, to_all=True) if mine else None
        if d.pp > 1:  # the owner stage's tensor goes to the same TP rank of every stage
            tensor = _pp_broadcast(tensor, meta, owner=entry.owner, pp_group=pp_group)
        return tensor

    def _ep_broadcast(self, tensor: torch.Tensor | None, meta: TensorMeta, entry: Entry) -> torch.Tensor:
        """An expert's HF tensor from the EP rank that holds it to its whole expert-parallel group."""
        from megatron.core import parallel_state as ps

        group = ps.get_expert_model_parallel_group()
        tensor = _empty(meta) if tensor is None else tensor.contiguous()
        dist.broadcast(tensor, src=dist.get_process_group_ranks(group)[entry.ep_owner], group=group)
        return tensor

    def _local_hf(self, pm: mp.ParamMap, entry: Entry, part: int) -> torch.Tensor:
        """This rank's TP shard of HF tensor ``part`` (``local`` mode): its piece, or for a fused
        HF tensor its pieces concatenated (what the HF tensor's rows of this shard are)."""
        if not pm.fused:
            return self._part(pm, entry, part)
        return torch.cat([self._part(pm, entry, piece) for piece in range(pm.pieces)], dim=0)

    def _part(self, pm: mp.ParamMap, entry: Entry, part: int) -> torch.Tensor:
        """This rank's piece ``part`` of a parameter (its TP shard's q, k or v, gate or up slice, or
        the whole shard for unsplit kinds; a copy only for q/k/v, whose rows interleave per KV group)."""
        shard = self._shard(entry)
        if pm.kind == mp.QKV:
            hd, per = self.shapes.head_dim, self.shapes.heads // self.shapes.groups
            tail = shard.shape[1:]
            pieces = shard.view(-1, (per + 2) * hd, *tail).split([per * hd, hd, hd], dim=1)
            return pieces[part].reshape(-1, *tail)
        if pm.split_kind == mp.FC1:
            return shard.chunk(2, dim=0)[part]
        return shard

    def _gather_hf(self, pm: mp.ParamMap, entry: Entry, part: int, out: torch.Tensor | None, *,
                   to_all: bool) -> torch.Tensor | None:
        """HF tensor ``part`` of a parameter, gathered from the TP ranks (:meth:`_gather`). A fused HF
        tensor (Phi-3's qkv_proj: [q; k; v]) gathers each piece straight into its own rows of ``out``,
        so it costs no more memory than a separate one."""
        if not pm.fused:
            return self._gather(pm, entry, part, out, to_all=to_all)
        here = to_all or self._split(pm)[2] == 0
        rows = mp.piece_rows(pm, full_shape(pm, entry.shard_shape, self._split(pm)[1])[0], self.shapes)
        if here and out is None:
            param = self.params[(entry.local, entry.layer, entry.expert)]
            out = torch.empty((sum(rows), *entry.shard_shape[1:]), dtype=param.dtype, device=param.device)
        start = 0
        for piece, count in enumerate(rows):
            self._gather(pm, entry, piece, out.narrow(0, start, count) if here else None, to_all=to_all)
            start += count
        return out if here else None

    def _gather(self, pm: mp.ParamMap, entry: Entry, part: int, out: torch.Tensor | None, *,
                to_all: bool) -> torch.Tensor | None:
        """:meth:`_gather_tp` with a padded vocabulary's extra rows dropped: they never leave the
        trainer (vLLM pads its own). A padded tensor is gathered whole first, then copied into ``out``."""
        if pm.kind != mp.VOCAB or full_shape(pm, entry.shard_shape, self.dims.tp)[0] == self.shapes.vocab:
            return self._gather_tp(pm, entry, part, out, to_all=to_all)
        tensor = self._gather_tp(pm, entry, part, None, to_all=to_all)
        if tensor is None:
            return None
        tensor = mp.strip_vocab(pm, tensor, self.shapes.vocab)
        return tensor if out is None else out.copy_(tensor)

    def _gather_tp(self, pm: mp.ParamMap, entry: Entry, part: int, out: torch.Tensor | None, *,
                   to_all: bool) -> torch.Tensor | None:
        """HF tensor ``part`` of a parameter of this stage, gathered from the TP ranks into ``out``
        (allocated when None) on every TP rank (``to_all``) or on TP rank 0 only. Row chunks land
        directly in place; column chunks (row-parallel weights) pass one shard at a time."""
        group, tp, tp_rank = self._split(pm)
        piece = self._part(pm, entry, part)
        here = to_all or tp_rank == 0
        if tp == 1 or pm.kind == mp.REPLICATED:
            if not here:
                return None
            return piece if out is None else out.copy_(piece)
        ranks = dist.get_process_group_ranks(group)
        dim = 1 if pm.split_kind == mp.ROW else 0
        if here and out is None:
            shape = tuple(n * tp if i == dim else n for i, n in enumerate(piece.shape))
            out = torch.empty(shape, dtype=piece.dtype, device=piece.device)
        piece = piece.contiguous()
        if dim == 0 and piece.is_cuda and to_all:  # NCCL writes every rank's rows in place
            dist.all_gather_into_tensor(out, piece, group=group)
        elif dim == 0 and piece.is_cuda:
            dist.gather(piece, list(out.chunk(tp, dim=0)) if here else None, dst=ranks[0], group=group)
        else:  # gloo's gathers stage through a full-size temporary: go rank by rank instead
            _gather_chunks(piece, out, dim=dim, tp_rank=tp_rank, ranks=ranks, group=group, to_all=to_all)
        return out if here else None

    def _split(self, pm: mp.ParamMap) -> tuple:
        """(group, size, this rank's index) a parameter is cut over: expert TP for routed experts, TP
        for the rest (the group is None when the size is 1)."""
        from megatron.core import parallel_state as ps

        d = self.dims
        if pm.is_expert:
            return (ps.get_expert_tensor_parallel_group() if d.etp > 1 else None), d.etp, d.etp_rank
        return (ps.get_tensor_model_parallel_group() if d.tp > 1 else None), d.tp, d.tp_rank

    def _to_first(self, pm, entry: Entry, part: int, meta: TensorMeta, *, pp_group) -> torch.Tensor | None:
        """Full tensors on global rank 0 only: TP gather to TP rank 0 of the owner stage, then a
        point-to-point send to stage 0 when the owner is another stage (ranks of DP replica 0 and CP
        rank 0 only: the other copies of the weights take no part)."""
        d = self.dims
        if pm.is_expert:
            return self._expert_to_first(pm, entry, part, meta)
        if not d.first_copy:
            return None
        tensor = self._gather_hf(pm, entry, part, None, to_all=False) if entry.owner == d.pp_rank else None
        if d.tp_rank != 0:
            return None
        if d.pp == 1 or entry.owner == 0:
            return tensor if d.pp_rank == 0 else None
        ranks = dist.get_process_group_ranks(pp_group)
        if d.pp_rank == entry.owner:
            dist.send(tensor.contiguous(), dst=ranks[0])
        elif d.pp_rank == 0:
            tensor = _empty(meta)
            dist.recv(tensor, src=ranks[entry.owner])
            return tensor
        return None


    def _expert_to_first(self, pm, entry: Entry, part: int, meta: TensorMeta) -> torch.Tensor | None:
        """An expert's full tensor on global rank 0: gathered over the holder's expert-TP group, then
        sent point to point from the holder (its expert-TP rank 0) when that is another rank."""
        d, source = self.dims, self.senders[entry.source]
        tensor = self._gather_hf(pm, entry, part, None, to_all=False) if self._holds(entry, pm) else None
        if source == 0:
            return tensor if d.rank == 0 else None
        if d.rank == source:
            dist.send(tensor.contiguous(), dst=0)
        elif d.rank == 0:
            tensor = _empty(meta)
            dist.recv(tensor, src=source)
            return tensor
        return None


def _gather_chunks(piece: torch.Tensor, out: torch.Tensor | None, *, dim: int, tp_rank: int, ranks: list[int],
                   group, to_all: bool) -> None:
    """Chunk r of ``out`` along ``dim`` from TP rank r's ``piece``, one rank at a time (a broadcast
    from each, or point-to-point to TP rank 0): row chunks are received in place, column chunks
    through one piece-sized buffer."""
    tp = len(ranks)
    buffer = torch.empty_like(piece) if dim and (to_all or tp_rank == 0) else None
    for r in range(tp):
        dst = None if out is None else out.chunk(tp, dim=dim)[r]
        land = buffer if dim else dst  # a row chunk is contiguous: receive straight into it
        if to_all:
            dist.broadcast(piece if tp_rank == r else land, src=ranks[r], group=group)
        elif tp_rank == 0 and r:
            dist.recv(land, src=ranks[r], group=group)
        elif tp_rank == r and r:
            dist.send(piece, dst=ranks[0], group=group)
        if dst is not None and (tp_rank == r or dim):
            dst.copy_(piece if tp_rank == r else buffer)


def view_of(buffer: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, as a view into a packed uint8 bucket buffer."""
    dtype = getattr(torch, meta.dtype.removeprefix("torch."))
    nbytes = meta.numel * torch.empty((), dtype=dtype).element_size()
    return buffer[meta.offset:meta.offset + nbytes].view(dtype).view(meta.shape)


def _empty(meta: TensorMeta) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=getattr(torch, meta.dtype.removeprefix("torch.")), device=comm_device())


def _pp_broadcast(tensor: torch.Tensor | None, meta: TensorMeta, *, owner: int, pp_group) -> torch.Tensor:
    tensor = _empty(meta) if tensor is None else tensor.contiguous()
    dist.broadcast(tensor, src=dist.get_process_group_ranks(pp_group)[owner], group=pp_group)
    return tensor
