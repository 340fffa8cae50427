"""Per-GPU memory plan of a layout, phase by phase, and the vLLM share it leaves (pure arithmetic).

Terms (bytes on the rank that holds them; trainer figures for the largest pipeline stage):

* weights: the model dtype; gradients: Megatron DDP's grad buffer (fp32 with
  ``ddp.grad_reduce_in_fp32``), never sharded; optimizer: Adam's two moments plus an fp32 master
  copy for half-precision models (12 B/param; 8 for fp32), SGD one moment plus the copy, divided by
  DP under the distributed optimizer;
* logits: one micro-batch of logits on the last stage, three copies: the fp32 log-softmax input and
  two in the model dtype (the output layer's and the loss's);
* push: what a weight push holds on top (``sync.bucket_mb``): colocated engines receive tensors
  one at a time into vLLM's layer-wise reload, which keeps up to one decoder layer, plus one
  gathered tensor; a sender of the separate pool holds one bucket plus one gathered tensor;
* rollout: the engine's weights at its TP (KV heads replicated beyond ``num_key_value_heads``) and
  the KV cache of all of an engine's sequences at full length;
* reserve: 5% of the GPU for the CUDA context, NCCL buffers and allocator fragmentation, outside
  both budgets.

Phases of a colocated step (sync/memory.py runs them): *rollout* (trainer weights, plus gradients
and optimizer unless ``rollout.offload_trainer``, next to vLLM's share); *train* (the engine asleep:
trainer total); *push* (engine weights awake, KV cache still free: trainer + engine weights + push).
vLLM's share (``gpu_memory_utilization``) is what the rollout phase leaves, unless the recipe sets
it. Activations are not counted: they depend on recompute settings and sequence packing.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.plan.layout import Layout
from megatron_gtpo.utils.configuration import ConfigError

GIB = 1 << 30
RESERVE = 0.05
"""Share of a GPU kept free of both budgets (CUDA context, NCCL buffers, fragmentation)."""
SEPARATE_UTILIZATION = 0.9
"""vLLM's share on a rollout node, which holds nothing else (vLLM's own default)."""


@dataclass(frozen=True, kw_only=True)
class MemorySizes:
    """The recipe's byte sizes and memory settings."""

    param_bytes: int = 2
    """Bytes of a trainer parameter (model dtype)."""
    grad_bytes: int = 4
    """Bytes of a gradient in Megatron's grad buffer."""
    optimizer: str = "adam"
    """Optimizer name (adam|sgd)."""
    distributed_optimizer: bool = False
    """Whether optimizer state is sharded over DP."""
    rollout_bytes: int = 2
    """Bytes of an engine weight / KV entry (vLLM dtype)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU."""
    gpu_memory_utilization: float | None = None
    """rollout.vllm.gpu_memory_utilization as the recipe sets it; None: planned here."""
    bucket_bytes: int = 256 << 20
    """sync.bucket_mb in bytes."""
    offload_trainer: bool = False
    """rollout.offload_trainer: gradients and optimizer state leave the GPU while engines generate."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Every term of the plan, bytes per GPU (see the module docstring)."""

    weights: int
    """Trainer parameters in the model dtype."""
    grads: int
    """Megatron DDP gradient buffer."""
    optimizer: int
    """Optimizer state (master copy + moments), after distributed-optimizer sharding."""
    logits: int
    """One micro-batch of logits on the last stage, all three copies."""
    push: int
    """Extra memory of a weight push (buffers and in-flight tensors)."""
    rollout_weights: int
    """vLLM engine weights on one GPU."""
    kv_per_sequence: int
    """KV bytes of one full-length sequence on one GPU of an engine."""
    kv_needed: int
    """KV cache for every sequence of an engine at full length, on one GPU of the engine."""
    gpu: int
    """Memory of one GPU."""
    gpu_memory_utilization: float
    """vLLM's share of a GPU: planned (see ``planned``) or the recipe's."""
    planned: bool
    """True when ``gpu_memory_utilization`` comes from this plan."""
    offload_trainer: bool
    """Gradients and optimizer state are on the host while engines generate."""
    colocated: bool
    """Engines share the trainer's GPUs."""

    @property
    def trainer_total(self) -> int:
        """Train phase: everything the trainer holds."""
        return self.weights + self.grads + self.optimizer + self.logits

    @property
    def trainer_resident(self) -> int:
        """What the trainer keeps on the GPU while colocated engines generate."""
        return self.weights + (0 if self.offload_trainer else self.grads + self.optimizer)

    @property
    def push_phase(self) -> int:
        """Push phase: trainer state, the engine's weights (colocated) and the push's buffers."""
        return self.weights + self.grads + self.optimizer + self.push + (self.rollout_weights if self.colocated else 0)

    @property
    def engine_share(self) -> int:
        return int(self.gpu * self.gpu_memory_utilization)

    @property
    def reserve(self) -> int:
        return int(self.gpu * RESERVE)

    @property
    def kv_available(self) -> int:
        """KV cache vLLM can hold: its share minus its weights (0 if none)."""
        return max(self.engine_share - self.rollout_weights, 0)

    @property
    def concurrent_sequences(self) -> int:
        """Full-length sequences whose KV fits at once on one engine."""
        return self.kv_available // max(self.kv_per_sequence, 1)


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


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest single HF tensor (a vocabulary matrix, an MLP matrix or q_proj)."""
    return max(shape.vocab * shape.hidden, shape.ffn * shape.hidden, shape.heads * shape.head_dim * shape.hidden)


def estimate_memory(shape: ModelShape, layout: Layout, sizes: MemorySizes) -> MemoryEstimate:
    """Every term of the plan for ``layout`` (see the module docstring)."""
    params = stage_params(shape, layout)
    opt = params * optimizer_bytes_per_param(optimizer=sizes.optimizer, param_bytes=sizes.param_bytes)
    if sizes.distributed_optimizer:
        opt //= layout.dp
    logits = layout.micro_batch_size * layout.seq_len * (shape.vocab // layout.tp) * (4 + 2 * sizes.param_bytes)
    rtp, colocated = layout.rollout_tp, layout.placement == "colocated"
    rollout_weights = (shape.layers * shape.layer_params(rtp)
                       + shape.embedding_params(rtp) * (1 if shape.tied_embeddings else 2)) * sizes.rollout_bytes
    held = shape.layer_params(rtp) * sizes.rollout_bytes if colocated else sizes.bucket_bytes
    push = held + largest_tensor(shape) * sizes.param_bytes
    kv_sequence = layout.seq_len * shape.kv_bytes_per_token(tp=rtp, dtype_bytes=sizes.rollout_bytes)
    gpu = int(sizes.gpu_memory_gib * GIB)
    resident = params * sizes.param_bytes + (0 if sizes.offload_trainer else params * sizes.grad_bytes + opt)
    util = sizes.gpu_memory_utilization
    if util is None:
        util = _share(gpu, resident) if colocated else SEPARATE_UTILIZATION
    return MemoryEstimate(
        weights=params * sizes.param_bytes, grads=params * sizes.grad_bytes, optimizer=opt, logits=logits, push=push,
        rollout_weights=rollout_weights, kv_per_sequence=kv_sequence, kv_needed=layout.sequences_per_engine * kv_sequence,
        gpu=gpu, gpu_memory_utilization=util, planned=sizes.gpu_memory_utilization is None,
        offload_trainer=sizes.offload_trainer, colocated=colocated)


def check_memory(mem: MemoryEstimate, layout: Layout) -> tuple[list[str], list[str]]:
    """(problems, warnings): what cannot start or run, and what will run slower."""
    problems, warnings, gib = [], [], _gib
    usable = mem.gpu - mem.reserve
    if mem.trainer_total > usable:
        problems.append(f"trainer needs {gib(mem.trainer_total)} GiB per GPU (weights + gradients + optimizer + "
                        f"logits) but a GPU has {gib(usable)} GiB after the reserve: raise parallel.tp/parallel.pp, "
                        f"set optim.optimizer.use_distributed_optimizer=true, or use more GPUs")
    if mem.rollout_weights >= mem.engine_share:
        problems.append(f"a vLLM engine needs {gib(mem.rollout_weights)} GiB of weights per GPU, more than its share "
                        f"gpu_memory_utilization={mem.gpu_memory_utilization} x {gib(mem.gpu)} GiB: raise "
                        f"rollout.vllm.tensor_parallel_size" + _offload_hint(mem))
    elif mem.kv_needed > mem.kv_available:
        warnings.append(f"KV cache for all {layout.sequences_per_engine} sequences of an engine at full length "
                        f"needs {gib(mem.kv_needed)} GiB per GPU, {gib(mem.kv_available)} GiB available: vLLM "
                        f"runs about {mem.concurrent_sequences} at once and queues the rest")
    if mem.colocated and mem.trainer_resident + mem.engine_share > usable:
        most = _share(mem.gpu, mem.trainer_resident)
        problems.append(f"colocated rollout: trainer resident {gib(mem.trainer_resident)} GiB + vLLM's share "
                        f"{gib(mem.engine_share)} GiB (gpu_memory_utilization={mem.gpu_memory_utilization}) exceed "
                        f"the {gib(usable)} GiB of a GPU after the reserve: the engine would refuse to start; set "
                        f"rollout.vllm.gpu_memory_utilization <= {most:.2f} (or leave it unset to plan it)"
                        + _offload_hint(mem))
    if mem.push_phase > usable:
        problems.append(f"weight push: trainer {gib(mem.weights + mem.grads + mem.optimizer)} GiB + engine weights "
                        f"{gib(mem.rollout_weights if mem.colocated else 0)} GiB + push buffers {gib(mem.push)} GiB "
                        f"exceed {gib(usable)} GiB: lower sync.bucket_mb or raise the trainer's or engine's TP")
    return problems, warnings


@dataclass(frozen=True, kw_only=True)
class EngineBudget:
    """What the driver checks before a colocated engine starts on a GPU."""

    gpu_memory_utilization: float
    """vLLM's share of a GPU."""
    planned: bool
    """The share comes from the plan (not the recipe)."""
    trainer_resident: int
    """Bytes the plan expects the trainer to hold when the engine starts."""


def check_engine_start(budget: EngineBudget, *, free: int, total: int) -> None:
    """Refuses (ConfigError naming the numbers) an engine whose share does not fit in what the
    trainer left free on this GPU; vLLM would otherwise fail later with a less precise message."""
    need = int(budget.gpu_memory_utilization * total)
    if need > free:
        source = "planned from the memory plan" if budget.planned else "set by rollout.vllm.gpu_memory_utilization"
        raise ConfigError(
            f"the colocated vLLM engine needs gpu_memory_utilization={budget.gpu_memory_utilization} x "
            f"{_gib(total)} GiB = {_gib(need)} GiB ({source}), but only {_gib(free)} GiB are free on this GPU "
            f"(the plan expected the trainer to hold {_gib(budget.trainer_resident)} GiB): lower "
            f"rollout.vllm.gpu_memory_utilization to <= {free / total:.2f}, set rollout.offload_trainer=true, or "
            f"check the layout with `megatron-gtpo dry-run`")


def _share(gpu: int, resident: int) -> float:
    """What the rollout phase leaves vLLM of a GPU, as a share rounded down to a percent."""
    return max(int((gpu * (1 - RESERVE) - resident) * 100 / gpu), 0) / 100


def _offload_hint(mem: MemoryEstimate) -> str:
    return "" if mem.offload_trainer or not mem.colocated else ", or set rollout.offload_trainer=true"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"
