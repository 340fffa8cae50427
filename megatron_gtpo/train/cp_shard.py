"""A micro-batch split over the context-parallel group: this rank's model input and the maps back.

Three views of one micro-batch's tokens::

    completion view [mb, T]      the loss's (train/batching.py): completion token t of row b
    sequence view   [mb, S]      the whole model input (padded rows, or one packed row [1, S])
    shard view      [mb, S/cp]   what this CP rank runs the model on: the positions ``seq_index`` of
                                 the sequence view (parallel/cp_index.py), the same for every row

Padded rows are split as Megatron's ``get_batch_on_this_cp_rank`` splits them (2 x cp chunks, rank
r holds r and 2cp - 1 - r); their length must be a multiple of 2 x cp (``train.model.
sequence_multiple`` pads them so). A packed row is first re-laid so that every sequence is padded
to a multiple of 2 x cp (:func:`pad_packed`: ``cu_seqlens_padded`` where each starts,
``cu_seqlens`` their real lengths, as Transformer Engine's THD attention takes them), then each
sequence is split the same way (TE's ``thd_get_partitioned_indices``).

Positions stay global: ``position_ids`` of the shard are the positions of its tokens in their
sequence, so RoPE rotates every token exactly as without CP; the targets of the fused log-prob pass
are the tokens that follow each position in the *sequence* (often held by another rank), taken
from the whole micro-batch that every rank holds.

A model output at sequence position g predicts token g + 1, so completion column t of row b is
predicted at g = start_b + t - 1: :meth:`CPShard.take` reads it where this rank holds g (``held``),
0 elsewhere; every completion token is held by exactly one rank of the group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_gtpo.parallel.cp_index import (cp_attention_mask, cp_padded_length, gathered_index, inverse_index,
                                             load_balanced_index, thd_partitioned_index)
from megatron_gtpo.train import model_input
from megatron_gtpo.train.batching import MicroBatch

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class CPShard:
    """This CP rank's share of one micro-batch (built by :func:`shard_micro_batch`). The train step
    uses it where it uses a ``MicroBatch`` without CP: ``rows``, ``width``, ``lengths`` and
    ``index`` are the micro-batch's."""

    mb: MicroBatch
    """The whole micro-batch (packed: re-laid by :func:`pad_packed`), on every rank of the group."""
    cp: int
    """Context-parallel size."""
    rank: int
    """This rank's index in the CP group."""
    seq_index: Tensor  # [S/cp] long
    """Sequence-view position of each token this rank holds, in storage order."""
    input_ids: Tensor  # [mb, S/cp] long
    position_ids: Tensor  # [mb, S/cp] long: global positions (restarting per sequence when packed)
    targets: Tensor  # [mb, S/cp] long
    """The token following each held position in the sequence view: the fused pass's targets."""
    slot: Tensor  # [mb, width] long
    """The local slot whose output predicts completion column t of row b (0 where not held)."""
    held: Tensor  # [mb, width] bool
    """The completion tokens whose prediction this rank computes (each token: exactly one rank)."""
    cu_seqlens: Tensor | None = None  # [segments + 1] int32
    """Packed: cumulative REAL lengths of the sequences (TE's ``cu_seqlens_q/kv``); None: padded rows."""
    key_index: Tensor | None = None  # [S] long
    """Packed: sequence positions of the keys the stand-in attention gathers (all ranks' shares in
    all-gather order), for its block-causal mask; None: padded rows."""

    @property
    def rows(self) -> Tensor:
        return self.mb.rows

    @property
    def width(self) -> int:
        return self.mb.width

    @property
    def lengths(self) -> Tensor:
        return self.mb.lengths

    @property
    def index(self) -> int:
        """The micro-batch's place in the step's schedule (``MicroBatch.index``)."""
        return self.mb.index

    @property
    def seq_len(self) -> int:
        return int(self.mb.input_ids.shape[1])

    @property
    def packed(self) -> bool:
        return self.mb.cu_seqlens is not None

    def to(self, device) -> CPShard:
        """This shard (and its micro-batch) with every tensor on ``device`` (None: where they are)."""
        if device is None:
            return self
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), Tensor)}
        return dataclasses.replace(self, mb=self.mb.to(device), **moved)

    def take(self, local: Tensor, width: int | None = None) -> Tensor:
        """Completion view ``[mb, width]`` of a shard-view output ``local`` ``[mb, S/cp]`` (packed:
        ``[1, S/cp]``) aligned with the PREDICTING position: 0 where this rank does not hold the
        token. ``width`` >= the micro-batch's: zero columns added (the global batch's width)."""
        index = self.slot.to(local.device)
        out = local[0][index] if self.packed else local.gather(1, index)
        out = torch.where(self.held.to(local.device), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out if width is None or width == out.shape[1] else torch.nn.functional.pad(out, (0, width - out.shape[1]))

    def to_shard(self, values: Tensor) -> Tensor:
        """Shard view ``[mb, S/cp]`` (packed ``[1, S/cp]``) of a completion-view tensor ``values``
        ``[mb, >= width]``: slot j gets the value of the completion token its position predicts, 0
        where it predicts none (prompt, padding). The inverse of :meth:`take` on held tokens."""
        mb, g = self.mb, self.seq_index.to(values.device)
        start, lengths = mb.start.to(values.device), mb.lengths.to(values.device)
        if self.packed:
            bounds = mb.cu_seqlens[1:].to(device=values.device, dtype=g.dtype)
            row = torch.bucketize(g, bounds, right=True).clamp(max=len(start) - 1)[None, :]  # [1, S/cp]
        else:
            row = torch.arange(len(start), device=values.device)[:, None].expand(-1, len(g))
        col = g[None, :] + 1 - start[row]
        inside = (col >= 0) & (col < lengths[row])
        out = values[row, col.clamp(min=0, max=values.shape[1] - 1)]
        return torch.where(inside, out, torch.zeros((), dtype=values.dtype, device=values.device))

    def attention_mask(self) -> Tensor | None:
        """The stand-in attention's mask of a packed row (``[1, 1, S/cp, S]``, keys in all-gather
        order, block-diagonal per sequence, causal on global positions); None for padded rows (the
        stand-in builds their load-balanced causal mask itself)."""
        if not self.packed:
            return None
        return cp_attention_mask(self.seq_index, self.key_index, self.mb.cu_seqlens)


def _held_slots(mb: MicroBatch, seq_index: Tensor) -> tuple[Tensor, Tensor]:
    """``(slot, held)`` ``[mb, width]``: the local slot that predicts completion column t of row b
    (0 where another rank holds it) and whether this rank holds that loss token. A model output at
    sequence position g predicts token g + 1, so column t is predicted at g = start_b + t - 1."""
    seq_len = int(mb.input_ids.shape[1])
    cols = torch.arange(mb.width, device=seq_index.device)
    src = (mb.start.to(cols.device)[:, None] + cols - 1).clamp(min=0, max=seq_len - 1)
    slot = inverse_index(seq_index, seq_len)[src]
    held = (slot >= 0) & (cols < mb.lengths.to(cols.device)[:, None])
    return slot.clamp(min=0), held


def pad_packed(mb: MicroBatch, *, cp: int, pad_id: int, seq_len: int | None = None) -> tuple[MicroBatch, Tensor]:
    """A packed micro-batch re-laid for CP: every sequence (and the padding tail) padded to a
    multiple of 2 x cp with ``pad_id``; positions restart per sequence and run on through its
    padding. ``seq_len``: the total length to reach with a padding tail (pipeline parallelism's
    common length; a multiple of 2 x cp); None: the padded sequences only. Returns the micro-batch
    (``cu_seqlens`` = where each padded sequence starts, TE's ``cu_seqlens_padded``) and the
    cumulative real lengths (TE's ``cu_seqlens``)."""
    cu = mb.cu_seqlens.to(torch.long).cpu()
    n = len(mb.rows)
    real = cu[1:n + 1] - cu[:n]  # the sequences; a trailing segment beyond them is padding
    padded = torch.tensor([cp_padded_length(int(x), cp) for x in real], dtype=torch.long)
    total = int(padded.sum())
    if seq_len is not None and (seq_len < total or (seq_len - total) % (2 * cp)):
        raise ValueError(f"a packed length of {seq_len} cannot hold these sequences padded for parallel.cp={cp} "
                         f"({total} tokens) with a tail that is a multiple of 2 x cp")
    lengths = torch.cat([padded, torch.tensor([seq_len - total] if seq_len and seq_len > total else [])]).long()
    real_lengths = torch.cat([real, lengths[n:]])
    offsets = torch.cumsum(lengths, 0) - lengths
    old_ids = mb.input_ids[0].cpu()
    ids = torch.full((int(lengths.sum()),), pad_id, dtype=old_ids.dtype)
    within = torch.arange(int(real.sum())) - torch.repeat_interleave(torch.cumsum(real, 0) - real, real)
    seg = torch.repeat_interleave(torch.arange(n), real)
    ids[offsets[seg] + within] = old_ids[cu[seg] + within]
    positions = torch.arange(len(ids)) - torch.repeat_interleave(offsets, lengths)
    device = mb.input_ids.device
    out = dataclasses.replace(
        mb, input_ids=ids[None, :].to(device), position_ids=positions[None, :].to(device),
        start=(offsets[:n] + mb.start.cpu() - cu[:n]).to(device),
        cu_seqlens=torch.cat([offsets, offsets[-1:] + lengths[-1:]]).to(torch.int32).to(device),
        max_seqlen=int(lengths.max()))
    cu_real = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(real_lengths, 0)])
    return out, cu_real.to(torch.int32).to(device)


def shard_micro_batch(mb: MicroBatch, *, cp: int, rank: int, pad_id: int, seq_len: int | None = None) -> CPShard:
    """This CP rank's share of ``mb`` (padded rows: their length must be a multiple of 2 x cp;
    packed: re-laid by :func:`pad_packed` first, ``seq_len`` as there). Every row needs a prompt of
    at least one token (the first completion token is predicted from the position before it).
    Index arithmetic with host reads: build shards from CPU micro-batches, then move them
    (:meth:`CPShard.to`), as the train step's plan does."""
    if bool((mb.start < 1).any()):
        raise ValueError("context parallelism needs a prompt of >= 1 token in every row")
    cu_real = keys = None
    if mb.cu_seqlens is not None:
        mb, cu_real = pad_packed(mb, cp=cp, pad_id=pad_id, seq_len=seq_len)
        index = thd_partitioned_index(mb.cu_seqlens, cp, rank).to(mb.input_ids.device)
        keys = gathered_index([thd_partitioned_index(mb.cu_seqlens, cp, r) for r in range(cp)])
        keys = keys.to(mb.input_ids.device)
    else:
        index = load_balanced_index(mb.input_ids.shape[1], cp, rank, device=mb.input_ids.device)
    targets = torch.roll(mb.input_ids, shifts=-1, dims=1)
    slot, held = _held_slots(mb, index)
    return CPShard(mb=mb, cp=cp, rank=rank, seq_index=index, input_ids=mb.input_ids.index_select(1, index),
                   position_ids=mb.position_ids.index_select(1, index), targets=targets.index_select(1, index),
                   slot=slot, held=held, cu_seqlens=cu_real, key_index=keys)


def forward(model, shard: CPShard, **extra):
    """Output of one model chunk on this rank's share (``[mb, S/cp, V/TP]`` logits on the last
    stage). Padded rows: Megatron's own CP path (its RoPE slices the same load-balanced chunks;
    the attention, TE's or the stand-in, builds the causal mask). Packed rows: TE takes THD
    ``PackedSeqParams`` with ``cu_seqlens_padded``; the CPU stand-in an explicit block-causal
    mask, with the rotary table taken at the shard's own positions."""
    if not shard.packed:
        return model(shard.input_ids, shard.position_ids, None, **extra)
    if model_input.uses_te_attention(model):
        return model(shard.input_ids, shard.position_ids, None, packed_seq_params=thd_params(shard), **extra)
    with model_input.rope_at_positions(model, shard.position_ids[0], shard.mb.max_seqlen):
        return model(shard.input_ids, shard.position_ids, shard.attention_mask(), **extra)


def thd_params(shard: CPShard):
    """Megatron's ``PackedSeqParams`` of a packed share for TE's CP attention (GPU; untested here):
    the GLOBAL real and padded cumulative lengths (TE divides them by cp itself, as Megatron's
    ``get_thd_batch_on_this_cp_rank`` passes them) and the longest padded sequence."""
    from megatron.core.packed_seq_params import PackedSeqParams

    padded = shard.mb.cu_seqlens.to(torch.int32)
    real = shard.cu_seqlens.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=shard.mb.max_seqlen,
                           max_seqlen_kv=shard.mb.max_seqlen)
