"""Per-GPU memory estimate of a layout: trainer weights, gradients, optimizer state, logits; rollout
weights and KV cache. Pure arithmetic on a :class:`ModelShape` and a :class:`Layout`.

What is counted (bytes per parameter on the rank that holds it):

* weights: the model dtype (2 for bf16);
* gradients: Megatron DDP's main-grad buffer, fp32 with ``ddp.grad_reduce_in_fp32`` (the
  project default), else the model dtype; never sharded (the distributed optimizer reduce-scatters
  into the full buffer);
* optimizer: Adam keeps exp_avg and exp_avg_sq in fp32 plus an fp32 master copy when the model
  is bf16/fp16 (12 bytes; 8 for fp32 models); SGD keeps momentum and the master copy; both are
  divided by DP under ``optimizer.use_distributed_optimizer``;
* logits: one micro-batch of fp32 logits on the last pipeline stage (RL log-probs need them all);
* rollout: the engine's weights in its dtype, split by the rollout TP (KV heads replicated beyond
  ``num_key_value_heads``), and the KV cache all of an engine's sequences would take at full length.

Activations are not counted: they depend on recompute settings and sequence packing.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.plan.layout import Layout
from megatron_gtpo.models.shape import ModelShape

GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per GPU; trainer figures are for the largest pipeline stage."""

    weights: int
    """Trainer parameters in the model dtype."""
    grads: int
    """Megatron DDP gradient buffer."""
    optimizer: int
    """Optimizer state (master copy + moments), after distributed-optimizer sharding."""
    logits: int
    """fp32 logits of one micro-batch on the last stage."""
    rollout_weights: int
    """vLLM engine weights on one GPU."""
    kv_needed: int
    """KV cache for every sequence of an engine at full length, on one GPU of the engine."""
    kv_available: int
    """KV cache vLLM can hold: gpu_memory_utilization * GPU memory - engine weights (0 if none)."""
    kv_per_sequence: int
    """KV bytes of one full-length sequence on one GPU of an engine."""
    gpu: int
    """Memory of one GPU."""
    gpu_memory_utilization: float
    """Share of a GPU vLLM may take (rollout.vllm.gpu_memory_utilization)."""

    @property
    def trainer_total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.logits

    @property
    def concurrent_sequences(self) -> int:
        """Full-length sequences whose KV fits at once on one engine."""
        return self.kv_available // self.kv_per_sequence


def stage_params(shape: ModelShape, layout: Layout) -> int:
    """Parameters on one rank of the largest pipeline stage (embedding on the first, output on the last)."""
    blocks = layout.layers_per_stage * shape.layer_params(layout.tp)
    vocab = shape.embedding_params(layout.tp)
    if layout.pp == 1:
        return blocks + vocab * (1 if shape.tied_embeddings else 2) + shape.hidden
    # With PP > 1 the last stage keeps its own output matrix even when embeddings are tied.
    return blocks + vocab + shape.hidden


def optimizer_bytes_per_param(*, optimizer: str, param_bytes: int) -> int:
    """fp32 state per parameter: moments (Adam 2, SGD 1) plus a master copy for half-precision models."""
    moments = 2 if optimizer == "adam" else 1
    return 4 * (moments + (1 if param_bytes < 4 else 0))


def estimate_memory(*, shape: ModelShape, layout: Layout, param_bytes: int = 2, grad_bytes: int = 4,
                    optimizer: str = "adam", distributed_optimizer: bool = False,
                    rollout_bytes: int = 2, gpu_memory_gib: float = 80.0,
                    gpu_memory_utilization: float = 0.9) -> MemoryEstimate:
    """Estimates per-GPU memory of ``layout``; byte sizes follow the recipe (see module docstring)."""
    params = stage_params(shape, layout)
    opt = params * optimizer_bytes_per_param(optimizer=optimizer, param_bytes=param_bytes)
    if distributed_optimizer:
        opt //= layout.dp
    logits = layout.micro_batch_size * layout.seq_len * (shape.vocab // layout.tp) * 4
    rtp = layout.rollout_tp
    rollout_weights = (shape.layers * shape.layer_params(rtp)
                       + shape.embedding_params(rtp) * (1 if shape.tied_embeddings else 2)) * rollout_bytes
    kv_sequence = layout.seq_len * shape.kv_bytes_per_token(tp=rtp, dtype_bytes=rollout_bytes)
    gpu = int(gpu_memory_gib * GIB)
    return MemoryEstimate(
        weights=params * param_bytes, grads=params * grad_bytes, optimizer=opt, logits=logits,
        rollout_weights=rollout_weights, kv_needed=layout.sequences_per_engine * kv_sequence,
        kv_available=max(int(gpu * gpu_memory_utilization) - rollout_weights, 0), kv_per_sequence=kv_sequence,
        gpu=gpu, gpu_memory_utilization=gpu_memory_utilization)


def check_memory(mem: MemoryEstimate, layout: Layout) -> tuple[list[str], list[str]]:
    """(problems, warnings): what cannot start, and what will run slower or needs care."""
    problems, warnings = [], []
    gib = _gib
    if mem.trainer_total > mem.gpu:
        problems.append(f"trainer needs {gib(mem.trainer_total)} GiB per GPU (weights + gradients + optimizer + "
                        f"logits) but a GPU has {gib(mem.gpu)} GiB: raise parallel.tp/parallel.pp, set "
                        f"optim.optimizer.use_distributed_optimizer=true, or use more GPUs")
    budget = int(mem.gpu * mem.gpu_memory_utilization)
    if mem.rollout_weights >= budget:
        problems.append(f"a vLLM engine needs {gib(mem.rollout_weights)} GiB of weights per GPU, more than "
                        f"gpu_memory_utilization={mem.gpu_memory_utilization} x {gib(mem.gpu)} GiB: raise "
                        f"rollout.vllm.tensor_parallel_size")
    elif mem.kv_needed > mem.kv_available:
        warnings.append(f"KV cache for all {layout.sequences_per_engine} sequences of an engine at full length "
                        f"needs {gib(mem.kv_needed)} GiB per GPU, {gib(mem.kv_available)} GiB available: vLLM "
                        f"runs about {mem.concurrent_sequences} at once and queues the rest")
    if layout.placement == "colocated" and mem.trainer_total + budget > mem.gpu:
        most = max(mem.gpu - mem.trainer_total, 0) / mem.gpu
        warnings.append(f"colocated: trainer ({gib(mem.trainer_total)} GiB) + vLLM's share "
                        f"({gib(budget)} GiB) exceed {gib(mem.gpu)} GiB unless the trainer frees memory "
                        f"during rollout; otherwise lower rollout.vllm.gpu_memory_utilization below "
                        f"{most:.2f}")
    return problems, warnings


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"
