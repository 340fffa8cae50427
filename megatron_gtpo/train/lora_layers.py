"""LoRA adapters on Megatron-Core's parallel linear layers, tensor- and sequence-parallel exact.

Each adapted linear gets a child module ``lora`` (parameters ``lora.a`` [parts*r, in], ``lora.b``
[out, r], local shapes) and a forward hook that adds ``scale * B (A x)`` to the layer's output, so
the base parameters keep their names (loader, exporter and checkpoints see them unchanged) and the
layer's own code runs untouched. The base is frozen (``requires_grad=False``): Megatron's DDP then
allocates no gradient buffer for it and its (distributed) optimizer holds the adapters only.

Tensor parallelism, with ``h = A x`` of width parts*r (small), never a hidden-sized exchange:

* column-parallel (linear_qkv, linear_fc1): x is whole on every TP rank, A is whole, B is split like
  the layer's output rows. Each rank's output rows need all of h, so h needs no exchange forward;
  backward, each rank's dh covers only its rows, so dh is all-reduced over TP (Megatron's
  ``copy_to_tensor_model_parallel_region``). With sequence parallelism x is split by sequence:
  h is all-gathered by sequence forward and reduce-scattered backward (``gather_from_sequence_
  parallel_region``), and A's gradient (one sequence slice per rank) is summed over TP by
  Megatron's ``finalize_model_grads`` (``param.sequence_parallel``).
* row-parallel (linear_proj, linear_fc2): x is split by columns, A the same way, so each rank's
  ``x_r A_r^T`` is a partial sum: h is all-reduced over TP before B (``reduce_from_tensor_model_
  parallel_region``), B is whole, and the result is added after the layer's own reduction. With
  sequence parallelism h is reduce-scattered by sequence instead (the layer's output is), and B's
  gradient is summed over TP like a norm's.

Transformer Engine: ``TELayerNormColumnParallelLinear`` fuses the input norm, so the adapter must
see the normed input: the hook sets TE's ``return_layernorm_output`` and takes the norm output
from the layer's result. Not ``return_layernorm_output_gathered``: TE 2.x's backward drops the
gradient of a gathered norm output (layernorm_linear.py adds ``grad_outputs[1]`` only when not
gathered), and gathering h (r wide) is cheaper than gathering the norm output (hidden wide) anyway.
``TEColumnParallelLinear``/``TERowParallelLinear`` return ``(out, bias)`` like the local layers.
The TE path is written from TE's and Megatron's source and cannot run on a CPU machine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.families import FAMILIES
from megatron_gtpo.train.lora import BY_NAME, LoraConfig, Target
from megatron_gtpo.train.model import layer_offset, unwrap

COLUMN, ROW = "column", "row"


@dataclass(frozen=True)
class Parts:
    """How a layer's output rows belong to its HF projections: ``blocks`` repeats of a row block
    made of one run per projection (qkv: one block per KV group, ``[q | k | v]`` rows; fc1: one
    block ``[gate | up]``; other layers: one block, one run)."""

    blocks: int
    sizes: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.blocks * sum(self.sizes)

    def spans(self) -> list[tuple[int, int]]:
        """``(offset, size)`` of each projection's run inside a block."""
        offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        return list(zip(offsets, self.sizes))


def parts_of(target: Target, *, rows: int, groups: int = 1, per_group: int = 1, head_dim: int = 0) -> Parts:
    """Row structure of ``rows`` output rows of ``target`` holding ``groups`` KV groups of
    ``per_group`` query heads of width ``head_dim`` (qkv only)."""
    if target.name == "linear_qkv":
        return Parts(groups, (per_group * head_dim, head_dim, head_dim))
    if target.name == "linear_fc1":
        return Parts(1, (rows // 2, rows // 2))
    return Parts(1, (rows,))


def layer_parts(target: Target, config, *, tp: int, rows: int) -> Parts:
    """Row structure of ``target``'s local (TP-rank) shard for a Megatron TransformerConfig."""
    if target.name == "linear_fc1" and not config.gated_linear_unit:
        raise ValueError("LoRA on linear_fc1 expects a gated MLP (gate_proj, up_proj)")
    groups = config.num_query_groups
    return parts_of(target, rows=rows, groups=groups // tp, per_group=config.num_attention_heads // groups,
                    head_dim=config.kv_channels)


def base_param_map(target: Target) -> mp.ParamMap:
    """The mapping entry of ``target``'s base weight in the default (unfused) HF layout: its kind and
    the per-projection HF names (q/k/v_proj, gate/up_proj) that PEFT's adapters are named after."""
    return next(pm for pm in mp.layer_maps(FAMILIES["llama"]) if pm.local == f"{target.path}.weight")


# ----------------------------------------------------------------------------- pure math

def up_project(h: torch.Tensor, b: torch.Tensor, parts: Parts, rank: int) -> torch.Tensor:
    """``B h`` where h holds one rank-``rank`` slice per projection (or one shared slice): the rows of
    projection p of every block use slice p. ``h`` [..., n*rank], ``b`` [rows, rank] -> [..., rows]."""
    if h.shape[-1] == rank:
        return F.linear(h, b)
    grouped = b.view(parts.blocks, sum(parts.sizes), rank)
    outs = [F.linear(h[..., p * rank:(p + 1) * rank], grouped[:, off:off + size].reshape(-1, rank))
            .unflatten(-1, (parts.blocks, size)) for p, (off, size) in enumerate(parts.spans())]
    return torch.cat(outs, dim=-1).flatten(-2)


def merge_into(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, parts: Parts, *, rank: int,
               scale: float) -> torch.Tensor:
    """Adds ``scale * B A`` (per projection when A has one slice per projection) to ``weight``
    [rows, in] in place and returns it; one fused multiply-add per projection, no full-size temporary."""
    grouped = weight.view(parts.blocks, sum(parts.sizes), weight.shape[1])
    b_grouped = b.to(weight.dtype).view(parts.blocks, sum(parts.sizes), rank)
    a = a.to(weight.dtype)
    for p, (off, size) in enumerate(parts.spans()):
        a_p = a if a.shape[0] == rank else a[p * rank:(p + 1) * rank]
        grouped[:, off:off + size].baddbmm_(b_grouped[:, off:off + size], a_p.expand(parts.blocks, *a_p.shape),
                                            alpha=scale)
    return weight


# ----------------------------------------------------------------------------- the adapter module

class LoraAdapter(torch.nn.Module):
    """The A/B pair of one linear layer (this TP rank's pieces) and its forward (module docstring)."""

    def __init__(self, linear: torch.nn.Module, target: Target, cfg: LoraConfig):
        super().__init__()
        config = linear.config
        self.target, self.rank, self.scale, self.p = target, cfg.rank, cfg.scale, cfg.dropout
        self.tp_group = _tp_group_of(linear)
        self.tp = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", config.sequence_parallel)) and self.tp > 1
        self.enabled = True
        out, inp = linear.weight.shape
        self.parts = layer_parts(target, config, tp=self.tp, rows=out)
        if out != self.parts.rows:
            raise ValueError(f"{target.name}: weight has {out} rows, the layer's config implies {self.parts.rows}")
        a_rows = cfg.parts(target) * cfg.rank
        like = dict(dtype=linear.weight.dtype, device=linear.weight.device)
        self.a = torch.nn.Parameter(torch.zeros(a_rows, inp, **like))
        self.b = torch.nn.Parameter(torch.zeros(out, cfg.rank, **like))
        # The replicated piece's gradient comes from one sequence slice per rank under sequence
        # parallelism: finalize_model_grads sums it over TP (like a norm's).
        column = target.parallel == COLUMN
        _set_parallel_attributes(self.a, split=not column, dim=1, sequence_parallel=column and self.sequence_parallel)
        _set_parallel_attributes(self.b, split=column, dim=0, sequence_parallel=not column and self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        x = self._dropout(x)
        h = F.linear(x, self.a)
        group = self.tp_group
        if self.target.parallel == COLUMN:
            h = (mappings.gather_from_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.copy_to_tensor_model_parallel_region(h, group=group))
        else:
            h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=group) if self.sequence_parallel
                 else mappings.reduce_from_tensor_model_parallel_region(h, group=group))
        return up_project(h, self.b, self.parts, self.rank) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Masks drawn like Megatron's: from the default generator where x is whole on every TP
        rank (the same mask everywhere, as A is whole), from the TP-rank-specific tracker state
        where x is a TP- or sequence-slice (attention dropout's convention)."""
        if not self.training or self.p == 0.0:
            return x
        if self.target.parallel == COLUMN and not self.sequence_parallel:
            return F.dropout(x, self.p, training=True)
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.p, training=True)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``W + scale * B A`` for this TP rank's shard of ``weight`` (a new tensor of its dtype and
        shape, one layer's shard: what the merged weight push sends instead of ``weight``)."""
        return merge_into(weight.detach().clone(), self.a, self.b, self.parts, rank=self.rank, scale=self.scale)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """Dist-checkpoint entries whose global tensors are the TP=1 adapters: B split by rows on
        column layers (fc1 as Megatron splits its [gate; up] weight), A split by columns on row
        layers, the other one replicated."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        axis = {"b": 0} if self.target.parallel == COLUMN else {"a": 1}
        out = make_sharded_tensors_for_checkpoint({"a": self.a, "b": self.b}, prefix, axis, sharded_offsets,
                                                  tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        if self.target.name == "linear_fc1":
            out[f"{prefix}b"] = apply_swiglu_sharded_factory(out[f"{prefix}b"], sharded_offsets,
                                                             metadata.get("singleton_local_shards", False))
        return out


def _tp_group_of(linear):
    from megatron.core import parallel_state as ps

    group = getattr(linear, "tp_group", None) or getattr(linear, "_tp_group", None)
    return group if group is not None else ps.get_tensor_model_parallel_group()


def _set_parallel_attributes(param: torch.nn.Parameter, *, split: bool, dim: int, sequence_parallel: bool) -> None:
    """Megatron's TP attributes (grad-norm de-duplication, checkpoint axis) and DP reduction flag."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    set_tensor_model_parallel_attributes(param, split, dim if split else -1, 1)
    param.allreduce = True
    param.sequence_parallel = sequence_parallel


# ----------------------------------------------------------------------------- attaching

def _lora_hook(module, args, output):
    """Forward hook: ``(out, bias)`` -> ``(out + lora(x), bias)``; unpacks TE's norm output."""
    out, bias, lora_input = _unpack(output, args[0])
    if module.lora.enabled:
        out = out + module.lora(lora_input)
    return out, bias


def _unpack(output, x):
    """Megatron linears return ``(out, bias)``; TE's LayerNormLinear with return_layernorm_output
    returns ``((out, ln_out), None)``, or ``(out, bias, ln_out)`` when it returns the bias."""
    if len(output) == 3:
        return output
    out, bias = output
    if isinstance(out, tuple):
        out, ln_out = out
        return out, bias, ln_out
    return out, bias, x


def _check_linear(linear, target: Target) -> None:
    mode = getattr(linear, "parallel_mode", None)  # TE layers
    if mode is None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        kind = {ColumnParallelLinear: COLUMN, RowParallelLinear: ROW}.get(type(linear))
        ok = kind == target.parallel and not getattr(linear, "gather_output", False) \
            and getattr(linear, "input_is_parallel", True) and not getattr(linear, "explicit_expert_comm", False)
    else:
        ok = mode == target.parallel
    if not ok or hasattr(linear, "lora"):
        raise ValueError(f"{target.name}: cannot attach LoRA to {type(linear).__name__} "
                         f"(expected an unadapted {target.parallel}-parallel linear of the dense GPT layer)")


def attach(linear: torch.nn.Module, adapter: LoraAdapter) -> None:
    """Registers ``adapter`` as ``linear.lora``, hooks it into the forward and the dist-checkpoint."""
    _check_linear(linear, adapter.target)
    linear.lora = adapter
    if hasattr(linear, "return_layernorm_output"):  # TE's fused norm + linear: the adapter needs the norm output
        linear.return_layernorm_output = True
        linear.return_layernorm_output_gathered = False
    linear.register_forward_hook(_lora_hook)
    base = linear.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        # The layer's own method would store lora.* as TP-replicated; the adapter knows its split.
        out = {k: v for k, v in base(prefix, sharded_offsets, metadata).items() if not k.startswith(f"{prefix}lora.")}
        out.update(adapter.sharded_state_dict(f"{prefix}lora.", sharded_offsets, metadata))
        return out

    linear.sharded_state_dict = sharded_state_dict


# ----------------------------------------------------------------------------- the model

def adapter_key(layer: int, target: Target, which: str) -> str:
    """Global (TP=1, PP=1) name of an adapter tensor: ``decoder.layers.{layer}.{path}.lora.{a|b}``."""
    return f"decoder.layers.{layer}.{target.path}.lora.{which}"


def is_adapter_name(name: str) -> bool:
    """True for the name of an adapter parameter (``...linear_qkv.lora.a``): the base loader and
    exporter skip these."""
    return ".lora." in name


def adapters(model_chunks: list[torch.nn.Module]) -> Iterator[tuple[int, LoraAdapter, torch.nn.Module]]:
    """``(global layer, adapter, its linear)`` over this rank's chunks, in layer order."""
    for chunk in model_chunks:
        model = unwrap(chunk)
        offset = layer_offset(model)
        for j, layer in enumerate(model.decoder.layers):
            for name in BY_NAME:
                linear = layer.get_submodule(BY_NAME[name].path)
                if hasattr(linear, "lora"):
                    yield offset + j, linear.lora, linear


def apply_lora(model_chunks: list[torch.nn.Module], cfg: LoraConfig, *, seed: int) -> int:
    """Freezes every parameter of the (not yet DDP-wrapped) chunks and attaches adapters to
    ``cfg.targets()`` of every layer: A drawn as PEFT draws it (uniform, bound 1/sqrt(fan_in)), B
    zero, so the model starts equal to the base. The draw depends on (seed, global layer, target)
    only: identical at every TP/PP size. Returns the number of adapters."""
    if not cfg.enabled:
        raise ValueError("apply_lora needs model.lora.rank > 0")
    count = 0
    for chunk in model_chunks:
        if hasattr(chunk, "zero_grad_buffer"):
            raise ValueError("apply_lora must run before wrap_ddp: DDP has already built gradient buffers")
        model = unwrap(chunk)
        model.requires_grad_(False)
        offset = layer_offset(model)
        for j, layer in enumerate(model.decoder.layers):
            for target in cfg.targets():
                linear = layer.get_submodule(target.path)
                adapter = LoraAdapter(linear, target, cfg)
                attach(linear, adapter)
                a, b = initial_adapter(adapter, seed=seed, layer=offset + j, index=list(BY_NAME).index(target.name))
                set_adapter(adapter, a, b)
                count += 1
    return count


def initial_adapter(adapter: LoraAdapter, *, seed: int, layer: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (TP=1) initial A and B of one adapter, on the host."""
    a_shape, b_shape = global_shapes(adapter)
    generator = torch.Generator().manual_seed((seed * 1_000_003 + layer * 16 + index) % (1 << 62))
    bound = 1.0 / math.sqrt(a_shape[1])
    a = torch.empty(a_shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
    return a, torch.zeros(b_shape, dtype=torch.float32)


def global_shapes(adapter: LoraAdapter) -> tuple[tuple[int, int], tuple[int, int]]:
    """Shapes of A and B at TP=1."""
    (a_rows, a_cols), (b_rows, b_cols) = adapter.a.shape, adapter.b.shape
    if adapter.target.parallel == COLUMN:
        return (a_rows, a_cols), (b_rows * adapter.tp, b_cols)
    return (a_rows, a_cols * adapter.tp), (b_rows, b_cols)


def _tp_rank(adapter: LoraAdapter) -> int:
    return dist.get_rank(adapter.tp_group) if adapter.tp > 1 else 0


def local_pieces(adapter: LoraAdapter, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's pieces of global (TP=1) A and B (or of tensors shaped like them: gradients)."""
    if (tuple(a.shape), tuple(b.shape)) != global_shapes(adapter):
        raise ValueError(f"{adapter.target.name}: adapter shapes {tuple(a.shape)}, {tuple(b.shape)} do not match "
                         f"{global_shapes(adapter)} (rank, target modules or share_a differ)")
    pm, rank = base_param_map(adapter.target), _tp_rank(adapter)
    if adapter.target.parallel == COLUMN:
        return a, mp.tp_shard(pm, b, tp=adapter.tp, rank=rank)
    return mp.tp_shard(pm, a, tp=adapter.tp, rank=rank), b


@torch.no_grad()
def set_adapter(adapter: LoraAdapter, a: torch.Tensor, b: torch.Tensor) -> None:
    """Copies global (TP=1) A and B into this rank's pieces (cast to the adapter's dtype)."""
    a, b = local_pieces(adapter, a, b)
    adapter.a.copy_(a)
    adapter.b.copy_(b)


@torch.no_grad()
def gather_adapter(adapter: LoraAdapter) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (TP=1) A and B of one adapter on every TP rank (an all-gather of the split piece
    over the TP group, device tensors)."""
    split = adapter.b if adapter.target.parallel == COLUMN else adapter.a
    whole = split
    if adapter.tp > 1:
        pieces = [torch.empty_like(split) for _ in range(adapter.tp)]
        dist.all_gather(pieces, split.detach().contiguous(), group=adapter.tp_group)
        whole = mp.tp_unshard(base_param_map(adapter.target), pieces)
    if adapter.target.parallel == COLUMN:
        return adapter.a.detach(), whole
    return whole, adapter.b.detach()


def set_adapters(model_chunks: list[torch.nn.Module], tensors: dict[str, torch.Tensor]) -> int:
    """Loads global adapter tensors (``adapter_key`` names, e.g. from :func:`gather_adapters` or a
    checkpoint) into this rank's adapters; KeyError names a missing one. Returns adapters set."""
    count = 0
    for layer, adapter, _ in adapters(model_chunks):
        set_adapter(adapter, tensors[adapter_key(layer, adapter.target, "a")],
                    tensors[adapter_key(layer, adapter.target, "b")])
        count += 1
    return count


def gather_adapters(model_chunks: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Global adapter tensors of this pipeline stage's layers, on every TP rank of the stage."""
    out = {}
    for layer, adapter, _ in adapters(model_chunks):
        a, b = gather_adapter(adapter)
        out[adapter_key(layer, adapter.target, "a")], out[adapter_key(layer, adapter.target, "b")] = a, b
    return out


def merge_sources(model_chunks: list[torch.nn.Module]) -> dict[tuple[str, int], LoraAdapter]:
    """``{(base weight's mapping name, global layer): adapter}``: the merged weight push replaces each
    such weight's shard by ``adapter.merged(weight)`` (one layer at a time, on the rank holding it)."""
    return {(f"{adapter.target.path}.weight", layer): adapter for layer, adapter, _ in adapters(model_chunks)}


def merged_weights(model_chunks: list[torch.nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(global weight name, merged local shard)`` for every adapted layer of this rank, one at a
    time (each a new tensor the size of one shard; nothing else is copied)."""
    for layer, adapter, linear in adapters(model_chunks):
        yield f"decoder.layers.{layer}.{adapter.target.path}.weight", adapter.merged(linear.weight)


def adapter_parameters(model_chunks: list[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """Every adapter parameter of this rank (what the optimizer must hold, and nothing else)."""
    return [p for _, adapter, _ in adapters(model_chunks) for p in (adapter.a, adapter.b)]


@contextlib.contextmanager
def lora_disabled(model_chunks: list[torch.nn.Module]):
    """The base model inside the block (adapters skipped): GRPO's frozen reference with LoRA needs
    no second copy of the model."""
    found = [adapter for _, adapter, _ in adapters(model_chunks)]
    for adapter in found:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in found:
            adapter.enabled = True
