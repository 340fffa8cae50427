"""Model FLOPs of the train phase, from the model's shape: the numerator of MFU.

Pure arithmetic, like ``models/shape.py``. The count is the PaLM convention (Chowdhery et al. 2022,
"PaLM", Appendix B), which is the per-token form of Megatron-LM's (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters", section 5.1)::

    training FLOPs per token = 6 N + 12 L d S

* ``N``: the weights a token meets in a matmul (``matmul_params``): attention projections, the MLP
  (a mixture: the router and the top-k routed experts a token is sent to, plus the shared expert),
  and the output layer. Not the embedding lookup and not the norms (no matmul). 6 = 2 FLOPs per
  multiply-add x 3 (forward, backward's activation gradient, backward's weight gradient).
* ``12 L d S``: attention's two matmuls (QK^T and AV, 2 x 2 x d x S FLOPs per token per layer
  forward, x 3 with the backward), ``d`` = heads x head_dim, ``S`` the token's sequence length.
  Counted over the whole S x S score matrix, as PaLM and Megatron-LM do (a causal kernel skips about
  half: their MFU, and ours, counts it anyway).

What differs from pre-training:

* LoRA: the frozen base computes no weight gradient, so its weights cost 4 FLOPs per token, not 6;
  the adapters' cost 6 each (``lora_params``: ``train.lora.adapter_params``).
* Sequences of different lengths (packed or padded micro-batches): the attention term is summed
  per sequence, 12 L d s^2 for a sequence of s tokens. Padding is not model work and is not counted.
* Context parallelism splits a sequence over ranks but not its work: ``s`` is the whole sequence's
  length, never a CP shard's, and CP's padding to 2 x cp is not counted.
* The train phase runs ``updates`` (``algo.mu``) forward + backward passes over the batch and
  ``forward_passes`` no-grad forwards (the KL term's reference model): ``train_phase_flops``.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_gtpo.models.shape import ModelShape


def matmul_params(shape: ModelShape) -> int:
    """Weights one token multiplies with in a forward pass (the ``N`` of 6N): every layer's
    attention projections (biases included) and MLP, or a mixture's router, top-k experts and
    shared expert with its gate; plus the output layer (tied or not: the logits are a matmul)."""
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    attention = shape.hidden * (q + 2 * kv) + q * shape.hidden + (q + 2 * kv if shape.qkv_bias else 0)
    if shape.is_moe:
        shared = 3 * shape.hidden * shape.shared_ffn + shape.hidden if shape.shared_ffn else 0
        mlp = shape.experts * shape.hidden + shape.top_k * 3 * shape.hidden * shape.expert_ffn + shared
    else:
        mlp = 3 * shape.hidden * shape.ffn
    return shape.layers * (attention + mlp) + shape.vocab * shape.hidden


def sequence_flops(shape: ModelShape, length: int, *, backward: bool = True, lora_params: int = 0) -> float:
    """FLOPs of one sequence of ``length`` tokens: a forward, plus its backward when ``backward``
    (with ``lora_params`` > 0 the base is frozen: no weight gradient for it, 6 per adapter weight)."""
    weights = matmul_params(shape)
    attention = 4 * shape.layers * shape.heads * shape.head_dim * length * length  # forward, QK^T + AV
    if not backward:
        return 2.0 * weights * length + attention
    base = (4 if lora_params else 6) * weights
    return float(base + 6 * lora_params) * length + 3 * attention


def train_phase_flops(shape: ModelShape, lengths: Iterable[int], *, updates: int = 1, forward_passes: int = 0,
                      lora_params: int = 0) -> float:
    """Model FLOPs of one train phase over sequences of ``lengths`` (prompt + completion tokens):
    ``updates`` forward + backward passes and ``forward_passes`` no-grad forwards of each."""
    total = 0.0
    for length in lengths:
        total += updates * sequence_flops(shape, int(length), lora_params=lora_params)
        if forward_passes:
            total += forward_passes * sequence_flops(shape, int(length), backward=False)
    return total
