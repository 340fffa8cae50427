"""A ``MicroBatch`` -> the Megatron ``GPTModel`` call (padded or packed).

Padded micro-batch ``[mb, S]``: ``model(input_ids, position_ids, None)``; None is the causal mask
(``parallel/cpu_shims.py`` supplies it on CPU).

Packed micro-batch (one row ``[1, S]`` of whole sequences, ``MicroBatch.cu_seqlens``), two ways:

* Transformer Engine attention (GPU): Megatron's THD format, ``PackedSeqParams(qkv_format="thd",
  cu_seqlens_q/kv, max_seqlen_q/kv)``. TE's attention keeps every sequence to itself (Megatron turns
  the causal mask type into ``padding_causal`` for THD) and RoPE restarts at every ``cu_seqlens``
  boundary. **Untested here: no GPU on the development machine.** Written to Megatron-Core 0.16.1's
  API (``GPTModel.forward(packed_seq_params=...)``, ``TEDotProductAttention``); context parallelism
  is not supported (no ``cu_seqlens_*_padded``).
* Megatron's local spec (CPU): its ``DotProductAttention`` refuses ``packed_seq_params``, so the row
  stays in the ``[s, b=1, h]`` layout with an explicit block-diagonal causal mask
  ``[1, 1, S, S]`` (True = masked out, Megatron's convention), and the rotary table is gathered at
  the per-sequence positions (``position_ids``, restarting at 0). Megatron's RoPE would otherwise
  rotate by the row positions 0..S-1 and ignore ``position_ids``; RoPE scores depend only on
  relative positions, so that would be equal in exact arithmetic, but fp32 angles ``pos * freq``
  lose ~``pos * 6e-8`` rad, at a budget of tens of thousands of tokens 1e-3 rad that neither the
  padded row nor the rollout engine has. Learned absolute position embeddings read
  ``position_ids`` themselves. Each sequence then sees exactly the inputs, positions and attended
  keys of its padded row. The SDPA attention of the local spec (train/sdpa_attention.py) reads the
  boundaries from ``packed_segments`` and attends sequence by sequence, so its cost is the sum of
  per-sequence squares, as THD's; the mask is what any other attention class sees.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.model import te_available, unwrap
from megatron_gtpo.train.routing import forward_context
from megatron_gtpo.train.sdpa_attention import packed_segments

Tensor = torch.Tensor


def forward(model, mb: MicroBatch, **extra):
    """Output of one model chunk on ``mb`` (``extra``: more keyword arguments of its forward); a
    mixture-of-experts chunk runs it under its router watch (routing replay, router metrics)."""
    with forward_context(model, mb):
        return _forward(model, mb, **extra)


def _forward(model, mb: MicroBatch, **extra):
    if mb.cu_seqlens is None:
        return model(mb.input_ids, mb.position_ids, None, **extra)  # None: causal mask (CPU shim on gloo)
    if uses_te_attention(model):
        return model(mb.input_ids, mb.position_ids, None, packed_seq_params=thd_params(mb), **extra)
    with rope_at_positions(model, mb.position_ids[0], mb.max_seqlen), packed_segments(mb.cu_seqlens):
        return model(mb.input_ids, mb.position_ids, block_causal_mask(mb.cu_seqlens, mb.input_ids.shape[1]), **extra)


def uses_te_attention(model) -> bool:
    """True when the chunk's attention is Transformer Engine's (the THD path); always False on CPU.
    Without TE, Megatron's ``extensions.transformer_engine`` still imports but its classes are
    MagicMock stand-ins (``isinstance`` would raise), hence ``te_available`` first."""
    if not te_available():
        return False
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    layers = unwrap(model).decoder.layers
    return len(layers) > 0 and isinstance(layers[0].self_attention.core_attention, TEDotProductAttention)


def thd_params(mb: MicroBatch):
    """Megatron's ``PackedSeqParams`` of a packed micro-batch (THD: the batch dimension is 1)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = mb.cu_seqlens.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=mb.max_seqlen,
                           max_seqlen_kv=mb.max_seqlen)


def block_causal_mask(cu_seqlens: Tensor, seq_len: int) -> Tensor:
    """``[1, 1, S, S]`` bool, True = masked: position i attends to j only when j <= i and both lie in
    the same segment of ``cu_seqlens``."""
    pos = torch.arange(seq_len, device=cu_seqlens.device)
    segment = torch.bucketize(pos, cu_seqlens[1:].to(pos.dtype), right=True)  # [S] segment index
    masked = (segment[:, None] != segment[None, :]) | (pos[None, :] > pos[:, None])
    return masked.view(1, 1, seq_len, seq_len)


@contextlib.contextmanager
def rope_at_positions(model, positions: Tensor, max_seqlen: int):
    """While active, the chunk's rotary embedding returns its table at ``positions`` ``[S]``
    instead of at 0..S-1 (every row of the table depends only on its position, so each sequence
    gets bit for bit the rotations of its padded row). A chunk without RoPE is left alone."""
    rope = getattr(unwrap(model), "rotary_pos_emb", None)
    if rope is None:
        yield
        return
    table_of = rope.forward

    def at_positions(max_seq_len, *args, **kwargs):
        # packed_seq: the whole table, never Megatron's CP slice of it (the positions say which rows)
        table = table_of(max_seqlen, *args, **{**kwargs, "packed_seq": True})  # [max_seqlen, 1, 1, dim]
        if not isinstance(table, Tensor):  # YaRN's (table, mscale): build_model refuses YaRN today
            raise NotImplementedError("packed micro-batches support plain RoPE tables only: set "
                                      "train.micro_batch_tokens: 0 for padded micro-batches")
        return table.index_select(0, positions)  # [S, 1, 1, dim]

    rope.forward = at_positions
    try:
        yield
    finally:
        del rope.forward  # back to the class's forward
