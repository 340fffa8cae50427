"""Attention under context parallelism: Transformer Engine's kernel on GPU, an exact CPU stand-in.

Under CP every rank holds 1/cp of each sequence (``parallel/cp_index.py``: Megatron's load-balanced
chunks), so a query must see keys and values that other ranks hold.

* **GPU: Transformer Engine's CP attention.** Megatron's TE layer spec (``TEDotProductAttention``)
  takes the CP group from parallel_state and runs TE's context-parallel kernels; the communication
  scheme is Megatron's own ``TransformerConfig.cp_comm_type`` (``p2p`` ring exchange of K/V chunks
  by default, ``all_gather`` or ``a2a``; pass it among the model's Megatron overrides). Packed rows
  go in as THD with ``cu_seqlens_padded`` (``train/cp_shard.py::thd_params``). This path cannot run
  on the development machine (no GPU, no TE): it is written to the Megatron-Core 0.16.1 / TE 2.x
  APIs and untested here.
* **CPU: :class:`CPUContextParallelAttention`, a stand-in for TE's kernel, not TE.** Megatron-Core
  0.16.1's local ``DotProductAttention`` refuses CP (``context_parallel_size == 1`` assert). The
  stand-in all-gathers K and V over the CP group (backward: the gradients of K and V are
  reduce-scattered back to the ranks that hold them; Megatron's own sequence-parallel gather does
  both), then runs Megatron's local attention (through SDPA, train/sdpa_attention.py) on the local
  queries against the whole sequence with
  the causal mask built from global positions (``cp_index.cp_attention_mask``): each query sees
  exactly the keys it sees without CP, so the result is the same math as TE's ring (p2p) or
  all-gather CP attention, up to fp32 summation order. It holds the whole sequence's K/V on every
  rank (the all-gather variant's memory) and, as Megatron's local attention does, a score matrix
  of the local queries against all keys (``[heads, s/cp, s]``: 1/cp of the CP=1 one).
  ``cp_comm_type`` does not change its values, only what it accepts: as TE's all-gather kernel, it
  refuses packed rows under ``all_gather`` (validation refuses that pair first:
  ``parallel.layout.cp_packing_problem``).

``cp_layer_spec`` hooks the stand-in into Megatron's local layer spec when cp > 1 (CPU only).
"""

from __future__ import annotations

import copy
import functools

import torch

from megatron_gtpo.parallel.cp_index import cp_attention_mask, gathered_index, load_balanced_index
from megatron_gtpo.train.sdpa_attention import sdpa_attention_class

Tensor = torch.Tensor


def _dot_product_attention():
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def _make_standin_class():
    base = sdpa_attention_class()  # DotProductAttention's math through PyTorch's fused SDPA

    class CPUContextParallelAttention(base):
        """CPU stand-in for Transformer Engine's context-parallel attention (not TE; module doc).

        Same constructor as Megatron's ``DotProductAttention``; built with a copy of the config whose
        ``context_parallel_size`` is 1 (the parent's assert), then keeps the real one.
        ``attention_mask``: None for a padded micro-batch in Megatron's load-balanced layout (the
        causal mask from global positions is built here), or ``[1, 1, s/cp, s]`` (True = masked) with
        keys in all-gather order (``train/cp_shard.py`` builds it for packed rows).
        """

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            local = copy.copy(config)
            local.context_parallel_size = 1
            super().__init__(local, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                             softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
            self.config = config
            self.cp_comm_type = cp_comm_type if cp_comm_type is not None else getattr(config, "cp_comm_type", None)
            from megatron.core import parallel_state as ps

            self.cp_group = getattr(pg_collection, "cp", None) or ps.get_context_parallel_group()

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:
                raise ValueError("the CPU CP attention takes packed rows as an explicit mask "
                                 "(train/cp_shard.py), not as THD PackedSeqParams")
            if attention_mask is not None and self.cp_comm_type == "all_gather":
                # What TE refuses, refused here too: packed rows are THD for TE, and its all-gather CP
                # attention asserts qkv_format != "thd" (TE 2.11 AttnFuncWithCPAndKVAllGather)
                raise AssertionError("thd format is not supported! (cp_comm_type=all_gather with packed rows: "
                                     "Transformer Engine refuses it; the CPU stand-in does as TE does)")
            key, value = gather_sequence(key, self.cp_group), gather_sequence(value, self.cp_group)
            if attention_mask is None:
                attention_mask = load_balanced_mask(query.shape[0], self.cp_group.size(), self.cp_group.rank(),
                                                    query.device)
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)

    return CPUContextParallelAttention


@functools.cache
def standin_class():
    """The stand-in's class (made once, after Megatron imports)."""
    return _make_standin_class()


def gather_sequence(tensor: Tensor, group) -> Tensor:
    """``[s/cp, ...]`` -> ``[s, ...]`` in rank order over ``group``; backward reduce-scatters the
    gradient (a rank's K/V gradient is the sum of what every rank's queries sent it). Megatron's
    own sequence-parallel gather, given the CP group."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(tensor, tensor_parallel_output_grad=True, group=group)


@functools.lru_cache(maxsize=8)
def _load_balanced_mask(local_len: int, cp: int, rank: int) -> Tensor:
    seq_len = local_len * cp
    keys = gathered_index([load_balanced_index(seq_len, cp, r) for r in range(cp)])
    return cp_attention_mask(load_balanced_index(seq_len, cp, rank), keys)


def load_balanced_mask(local_len: int, cp: int, rank: int, device) -> Tensor:
    """``[1, 1, s/cp, s]`` causal mask of a padded row in Megatron's load-balanced layout, keys in
    all-gather order (cached: every layer of a micro-batch asks for the same one)."""
    return _load_balanced_mask(local_len, cp, rank).to(device)


def cp_layer_spec(spec, *, cp: int, on_gpu: bool):
    """``spec`` ready for ``cp`` ranks: unchanged at cp = 1 or when its attention is TE's (TE runs CP
    itself); Megatron's local ``DotProductAttention`` is swapped for the stand-in on CPU. Raises
    ValueError for a spec with no CP attention (the local spec on GPU, or any other core attention),
    naming ``parallel.cp`` and what works."""
    if cp == 1:
        return spec
    attention = spec.submodules.self_attention.submodules
    core = attention.core_attention
    if _is_te_attention(core):
        return spec
    if core is _dot_product_attention() and not on_gpu:
        spec = copy.deepcopy(spec)
        spec.submodules.self_attention.submodules.core_attention = standin_class()
        return spec
    where = "on GPU Megatron's local spec" if core is _dot_product_attention() else f"core attention {core!r}"
    raise ValueError(f"parallel.cp={cp}: {where} has no context-parallel attention; use Transformer Engine's "
                     f"layer spec (TEDotProductAttention) on GPU, or run on CPU, where the exact stand-in "
                     f"replaces the local attention; parallel.cp=1 works with every spec")


def _is_te_attention(core) -> bool:
    if not torch.cuda.is_available():
        return False  # without TE, Megatron's TE classes are MagicMock stand-ins (train.model.te_available)
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    return isinstance(core, type) and issubclass(core, TEDotProductAttention)
