"""Megatron's local attention computed by PyTorch's fused ``scaled_dot_product_attention`` (issue 39).

Megatron-Core's local ``DotProductAttention`` (the layer spec without Transformer Engine: CPU, and
GPUs without TE) materialises the ``[b * heads, s, s]`` score matrix in fp32, masks it, runs an
unfused softmax and keeps the probabilities for the backward. PyTorch's SDPA does the same math
in one fused kernel (flash attention on CPU and on GPU) that never stores the score matrix: the
same values up to fp32 summation order, less memory traffic, and a cheaper backward.
``SDPADotProductAttention`` keeps the parent's constructor and parameters (same checkpoint keys)
and hands every case it does not cover to the parent: attention dropout while training, a learnable
softmax offset, an attention bias or packed-sequence parameters (THD is Transformer Engine's).

Masks: None is Megatron's causal mask (``is_causal``); a packed row's block-diagonal mask under
``packed_segments`` is one causal call per sequence; any other boolean ``[b or 1, 1, sq, sk]`` mask
(Megatron's convention, True = masked out: the CP stand-in's) becomes SDPA's additive mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.nn.functional as F


@functools.cache
def sdpa_attention_class():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class SDPADotProductAttention(DotProductAttention):
        """``DotProductAttention`` through ``F.scaled_dot_product_attention`` (module docstring)."""

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            dropout = self.training and self.attention_dropout.p > 0
            if packed_seq_params is not None or attention_bias is not None or self.softmax_offset is not None \
                    or dropout:
                return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                       packed_seq_params)
            # the parent divides its scale by the layer number and FusedScaleMaskSoftmax multiplies it back
            scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
            groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
            segments = _SEGMENTS.get()
            if attention_mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=groups > 1)
            elif segments is not None and q.shape[2] == k.shape[2]:  # a packed row: each sequence on its own
                bounds = segments + [q.shape[2]] if segments[-1] < q.shape[2] else segments
                out = torch.cat([F.scaled_dot_product_attention(
                    q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], is_causal=True, scale=scale, enable_gqa=groups > 1)
                    for lo, hi in zip(bounds, bounds[1:]) if hi > lo], dim=2)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(attention_mask, q.dtype),
                                                     scale=scale, enable_gqa=groups > 1)
            return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], self.hidden_size_per_partition)

    return SDPADotProductAttention


_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("packed_segments", default=None)


@contextlib.contextmanager
def packed_segments(cu_seqlens: torch.Tensor):
    """While active, attention over a packed row (one row of whole sequences whose boundaries are
    ``cu_seqlens``, with their block-diagonal causal mask) runs each sequence on its own, causal and
    unmasked: exactly the keys the mask allows, at the sum of the sequences' squares instead of the
    whole row's square, and no mask kept for the backward. A tail past ``cu_seqlens[-1]`` is one
    more sequence, as the mask treats it (train/model_input.py: ``block_causal_mask``)."""
    token = _SEGMENTS.set([int(b) for b in cu_seqlens.tolist()])
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


_LAST_MASK: list = [None, None, None]  # Megatron's boolean mask, the dtype, its additive form


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Megatron's boolean mask (True = masked out) as SDPA's additive mask (0 or -inf) in the
    queries' dtype, made once per mask object: every layer of a micro-batch gets the same mask
    tensor, and SDPA keeps its mask for the backward, so one shared copy (not one per layer) is what
    the memory plan counts."""
    if _LAST_MASK[0] is not mask or _LAST_MASK[1] != dtype:
        additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
        _LAST_MASK[:] = [mask, dtype, additive]
    return _LAST_MASK[2]


def with_sdpa_attention(spec):
    """The local layer spec ``spec`` with its core attention computed by SDPA (a copy)."""
    import copy

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = sdpa_attention_class()
    return spec
