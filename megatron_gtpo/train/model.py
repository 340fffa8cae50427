"""Builds Megatron-Core ``GPTModel`` chunks from a Hugging Face ``config.json``.

Supported families (records in ``models/families.py``): Llama 2/3 (incl. SmolLM2, tied
embeddings), Qwen2/2.5 (bias on q/k/v), Qwen3 (RMSNorm on q and k per head), Mistral, Phi-3 (q/k/v
and gate/up fused in the HF checkpoint). All are pre-norm decoders with RMSNorm, SwiGLU, RoPE
(rotate-half, non-interleaved; ``partial_rotary_factor`` rotates the first part of each head) and GQA.

HF -> Megatron names (``i`` = global layer, ``j`` = layer index inside this (virtual) stage,
``i = offset(stage) + j``; TE spec names in brackets, same dist-checkpoint keys either way):

=============================================  ================================================
HF                                             Megatron-Core
=============================================  ================================================
model.embed_tokens.weight                      embedding.word_embeddings.weight (vocab split, dim 0)
model.layers.i.input_layernorm.weight          decoder.layers.j.input_layernorm.weight
                                               [decoder.layers.j.self_attention.linear_qkv.layer_norm_weight]
model.layers.i.self_attn.{q,k,v}_proj.weight   decoder.layers.j.self_attention.linear_qkv.weight
  (and .bias for Qwen2; Phi-3: one qkv_proj     rows grouped per KV group g: [q heads of g | k_g | v_g],
  = [all q; all k; all v])                       each head ``head_dim`` rows; TP splits whole groups (dim 0)
model.layers.i.self_attn.o_proj.weight         decoder.layers.j.self_attention.linear_proj.weight (dim 1 split)
model.layers.i.self_attn.{q,k}_norm.weight     decoder.layers.j.self_attention.{q,k}_layernorm.weight (Qwen3)
model.layers.i.post_attention_layernorm.weight decoder.layers.j.pre_mlp_layernorm.weight
                                               [decoder.layers.j.mlp.linear_fc1.layer_norm_weight]
model.layers.i.mlp.{gate,up}_proj.weight       decoder.layers.j.mlp.linear_fc1.weight: each TP rank holds
  (Phi-3: one gate_up_proj = [gate; up])         [its gate rows ; its up rows] (dim 0 split of each half)
model.layers.i.mlp.down_proj.weight            decoder.layers.j.mlp.linear_fc2.weight (dim 1 split)
model.norm.weight                              decoder.final_layernorm.weight
lm_head.weight                                 output_layer.weight (vocab split, dim 0); absent when tied:
                                                 the last stage then keeps a copy of the embedding
=============================================  ================================================

In the dist-checkpoint (``sharded_state_dict``) the per-layer tensors are stacked under keys
without the layer number (``decoder.layers.self_attention.linear_qkv.weight`` of global shape
``[num_layers, ...]``), norms live under the TE names, and the global (unsharded) tensor is the
TP=1 layout above. The conversion code in ``megatron_gtpo/convert`` relies on exactly this table.

Vocabulary padding: as Megatron-LM's ``_vocab_size_with_padding``, the embedding and output layer
have ``padded_vocab_size(vocab_size, tp, divisible_by)`` rows (a multiple of
``make_vocab_size_divisible_by`` x TP, default 128 x TP), so any vocabulary splits over any TP.
Rows ``>= vocab_size`` are padding: zero when loaded from HF, excluded from log-probs, entropy and
greedy argmax (``true_vocab_size`` gives the trainer the real size), stripped on export/conversion.

Mixture-of-experts families (``Family.experts``: Qwen3-MoE, Qwen2-MoE, Mixtral) get Megatron's MoE
layer in every block (:func:`moe_settings`): a softmax top-k router (``moe_router_pre_softmax``
where the family does not renormalise the top-k probabilities, so both give exactly HF's weights),
the routed experts (SequentialMLP on the local spec; TEGroupedMLP, grouped GEMM, with TE), Qwen2-MoE's
shared expert with its sigmoid gate, and the alltoall token dispatcher. HF -> Megatron::

    model.layers.i.{block}.gate.weight                  decoder.layers.j.mlp.router.weight (replicated)
    model.layers.i.{block}.experts.e.{gate,up}          decoder.layers.j.mlp.experts.local_experts.l.linear_fc1.weight
      (Mixtral w1, w3)                                    [gate ; up], l = e - ep_rank * E/ep (TE: linear_fc1.weight{l})
    model.layers.i.{block}.experts.e.down (Mixtral w2)  decoder.layers.j.mlp.experts.local_experts.l.linear_fc2.weight
    model.layers.i.mlp.shared_expert.{gate,up,down}     decoder.layers.j.mlp.shared_experts.linear_fc{1,2}.weight
    model.layers.i.mlp.shared_expert_gate.weight        decoder.layers.j.mlp.shared_experts.gate_weight

In the dist-checkpoint the experts are stacked as ``decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight``
of global shape ``[num_layers, num_experts, ...]`` (SequentialMLP's and TEGroupedMLP's common format).

Not mapped: Mistral's and Phi-3's ``sliding_window`` (sequences longer than the window attend
further than in HF); ``attention_bias``/``mlp_bias`` where the family has no such bias and RoPE types
other than default/llama3 (Phi-3's longrope) are rejected (``families.check_supported``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from megatron_gtpo.models.config import VOCAB_DIVISIBLE_BY
from megatron_gtpo.models.families import Family, check_supported
from megatron_gtpo.models.hf_config import (LLAMA3_ROPE_DEFAULTS, head_dim_of, num_kv_heads_of, rope_settings,
                                            tied_embeddings)
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel import cpu_shims, strict
from megatron_gtpo.parallel.cp_attention import cp_layer_spec
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.parallel.cp_index import cp_sequence_multiple
from megatron_gtpo.parallel.layout import context_parallel_problems, model_split_problems
from megatron_gtpo.train.sdpa_attention import with_sdpa_attention
from megatron_gtpo.utils.configuration import ConfigError

def padded_vocab_size(vocab_size: int, *, tp: int, divisible_by: int = VOCAB_DIVISIBLE_BY) -> int:
    """Rows of the Megatron embedding/output layer: ``vocab_size`` rounded up to a multiple of
    ``divisible_by * tp`` (Megatron-LM's ``_vocab_size_with_padding``). The one place that decides it:
    model builder, HF loader, converter and exporter all call this."""
    if vocab_size < 1 or tp < 1:
        raise ConfigError(f"vocab_size={vocab_size} and tp={tp} must be >= 1")
    if divisible_by < 1:
        raise ConfigError(f"make_vocab_size_divisible_by={divisible_by} must be an integer >= 1 "
                          f"(1 pads only up to a multiple of tp; Megatron's default is {VOCAB_DIVISIBLE_BY})")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def check_layout(hf_config: dict, *, tp: int, pp: int, vpp: int | None, cp: int = 1, cp_comm_type=None,
                 experts: tuple[int, int] = (1, 1)) -> None:
    """Raises ConfigError with every reason ``hf_config`` cannot be split into this layout
    (``parallel.layout.model_split_problems``: the rules the dry-run reports too); ``experts`` =
    (ep, etp) of a mixture of experts."""
    shape = shape_from_hf_config(hf_config, name="model")
    problems = model_split_problems(shape, tp=tp, pp=pp, vpp=vpp, ep=experts[0], etp=experts[1])
    problems += context_parallel_problems(shape, tp=tp, cp=cp, comm_type=cp_comm_type,
                                          cp_attention=te_available() or not torch.cuda.is_available())
    if problems:
        raise ConfigError("config.json: " + "; ".join(problems))


def validate_overrides(overrides: dict | None) -> dict:
    """Checks that every key is a real ``TransformerConfig`` field (Megatron settings are passed
    through natively, not mirrored); ConfigError names an unknown key."""
    from megatron.core.transformer import TransformerConfig

    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown Megatron TransformerConfig field(s) in overrides: {', '.join(unknown)}; "
                          "use field names of megatron.core.transformer.TransformerConfig")
    return overrides


def moe_settings(hf_config: dict, family: Family, *, ep: int, etp: int) -> dict:
    """Megatron's MoE settings for a mixture-of-experts family ({} for a dense one). The router is
    the family's (top-k over softmax scores; pre-softmax where HF does not renormalise the top-k),
    experts are split ``ep`` x ``etp`` ways, tokens move with the alltoall dispatcher (the one that
    scales with EP), and no auxiliary loss is added by default (``moe_aux_loss_coeff`` 0, no
    z-loss): RL fine-tunes a pretrained router whose balance the policy gradient should not trade
    against (README, Mixture of experts); both pass through ``model.megatron`` (``moe_aux_loss_coeff``,
    ``moe_z_loss_coeff``)."""
    layout = family.experts
    if layout is None:
        return {}
    sizes = layout.sizes(hf_config)
    out = dict(num_moe_experts=sizes["experts"], moe_router_topk=sizes["top_k"],
               moe_ffn_hidden_size=sizes["ffn"], moe_router_score_function="softmax",
               moe_router_pre_softmax=not layout.normalises(hf_config), moe_token_dispatcher_type="alltoall",
               moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
               expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if sizes["shared_ffn"]:
        out.update(moe_shared_expert_intermediate_size=sizes["shared_ffn"], moe_shared_expert_gate=True)
    return out


def _cpu_safe_defaults(*, on_gpu: bool) -> dict:
    """Fusion flags: the CUDA-only kernels stay off on CPU (megatron_cpu.md section 4). On GPU the
    recipes turn on what their stack provides: configs/gpu/*.yaml set ``apply_rope_fusion`` (TE's
    fused RoPE; Megatron refuses it without TE). ``gradient_accumulation_fusion`` stays off: Megatron's
    output layer needs apex's ``fused_weight_gradient_mlp_cuda`` for it (plan/preflight.check_fusions)."""
    return {
        "masked_softmax_fusion": False, "persist_layer_norm": False,
        "gradient_accumulation_fusion": False, "apply_rope_fusion": False,
        "bias_activation_fusion": on_gpu, "bias_dropout_fusion": on_gpu,
    }


def init_settings(*, on_gpu: bool, weights_loaded: bool) -> dict:
    """How Megatron initialises parameters. On GPU a model whose weights are loaded right after
    (the trainer always loads them) is neither initialised on the CPU first (minutes and tens of
    GB of host RAM for 70B: every rank builds full unsharded layers) nor randomly initialised at
    all; on CPU the TP-size-independent CPU initialisation stays (tests compare layouts with it)."""
    return {"use_cpu_initialization": not on_gpu, "perform_initialization": not (on_gpu and weights_loaded)}


def transformer_config_from_hf(hf_config: dict, *, tp: int, pp: int, vpp: int | None, dtype: torch.dtype,
                               overrides: dict | None = None, weights_loaded: bool = False, cp: int = 1):
    """``TransformerConfig`` for an HF config of a supported family at layout (tp, pp, vpp, cp).

    ``overrides`` are native TransformerConfig fields applied last (e.g. recompute, fp8,
    ``cp_comm_type``, MoE ``moe_aux_loss_coeff``; the builder passes a mixture's expert-parallel
    sizes as ``expert_model_parallel_size`` / ``expert_tensor_parallel_size``); an unknown key or a
    value TransformerConfig rejects raises ConfigError. ``weights_loaded``: real weights are loaded
    after the build (see ``init_settings``). ``cp``: context-parallel size (``context_parallel_size``).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnBackend

    family = check_supported(hf_config)
    overrides = validate_overrides(overrides)
    ep, etp = overrides.pop("expert_model_parallel_size", 1), overrides.pop("expert_tensor_parallel_size", 1)
    check_layout(hf_config, tp=tp, pp=pp, vpp=vpp, cp=cp, cp_comm_type=overrides.get("cp_comm_type"),
                 experts=(ep, etp))
    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        num_layers=int(hf_config["num_hidden_layers"]), hidden_size=int(hf_config["hidden_size"]),
        num_attention_heads=int(hf_config["num_attention_heads"]),
        num_query_groups=num_kv_heads_of(hf_config), kv_channels=head_dim_of(hf_config),
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        layernorm_epsilon=float(hf_config.get("rms_norm_eps", 1e-6)), normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=family.qkv_bias, qk_layernorm=family.qk_norm,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=(dtype == torch.bfloat16), fp16=(dtype == torch.float16), sequence_parallel=False,
        **init_settings(on_gpu=on_gpu, weights_loaded=weights_loaded),
        # The local spec always uses DotProductAttention; "local" only pins the NVTE_* env vars.
        attention_backend=AttnBackend.auto if on_gpu else AttnBackend.local,
        **_cpu_safe_defaults(on_gpu=on_gpu),
        **moe_settings(hf_config, family, ep=ep, etp=etp),
    )
    if pp == 2 and vpp:
        # With two stages the previous and next stage are the same rank, and Megatron's batched
        # p2p exchange then swaps activations and gradients (same shapes, silently wrong grads;
        # upstream Megatron-LM #750/#1450). Unbatched p2p is correct (tests/dist trainstep VPP).
        kwargs["batch_p2p_comm"] = False
    kwargs.update(overrides)
    if family.experts is not None and tp > 1 and on_gpu and not kwargs["sequence_parallel"]:
        raise ConfigError(f"a mixture of experts with TP={tp} trains only with sequence parallelism (Megatron-Core "
                          "refuses it otherwise: every TP rank would dispatch the same tokens): set "
                          "model.megatron.sequence_parallel: true")
    try:
        return TransformerConfig(**kwargs)
    except (ValueError, AssertionError, TypeError) as err:
        raise ConfigError(f"TransformerConfig rejected the settings (overrides {sorted(overrides)}): {err}") from None


# Token counts Transformer Engine 2.11 needs per low-precision recipe (Megatron's fp8_recipe names;
# "nvfp4" is the fp4 recipe): (the whole micro-batch, each sequence-parallel shard).
#  * the whole micro-batch: the token dimension is a leading dimension of the FP8 weight-gradient
#    GEMM, which cuBLASLt needs 16-byte aligned (TE common/gemm/cublaslt_gemm.cu "ld % 16 ... Caller
#    must pad"; Megatron's get_fp8_align_size: 16, 32 for mxfp8) and a whole number of scaling blocks
#    for the block-scaled recipes;
#  * each shard: with sequence parallelism TE checks the local input of a column-parallel linear
#    *before* its all-gather (module/layernorm_linear.py, layernorm_mlp.py, linear.py):
#    assert_dim_for_fp8_exec wants the product of all but the last dimension divisible by 8, and
#    assert_dim_for_all_gather wants it quantizable: rows divisible by the scaling block,
#    MXFP8_BLOCK_SCALING_SIZE = 32, Float8BlockQuantizer.block_len = 128, NVFP4 16.
# "custom" recipes get the largest TE block (128): their quantizer is not known here.
LOW_PRECISION_TOKEN_MULTIPLES = {"delayed": (16, 8), "tensorwise": (16, 8), "mxfp8": (32, 32),
                                 "blockwise": (128, 128), "nvfp4": (32, 16), "custom": (128, 128)}


def padding_multiple(*, recipe: str | None, tp: int, sequence_parallel: bool) -> int:
    """The multiple every micro-batch's token count must be padded to: the one home of the rule.
    ``recipe``: the FP8 (or FP4) recipe in use, None for bf16/fp32; with sequence parallelism the
    sequence is split over the ``tp`` ranks and every shard must satisfy the per-shard rule, so
    ``T % (shard x tp) == 0`` (delayed/tensorwise: 8 x tp, mxfp8: 32 x tp, blockwise: 128 x tp)."""
    if recipe is None:
        whole, shard = 1, 1
    elif recipe in LOW_PRECISION_TOKEN_MULTIPLES:
        whole, shard = LOW_PRECISION_TOKEN_MULTIPLES[recipe]
    else:
        raise ConfigError(f"model.megatron.fp8_recipe={recipe!r}: no padding rule for it; use one of "
                          f"{', '.join(LOW_PRECISION_TOKEN_MULTIPLES)}")
    return math.lcm(whole, shard * tp) if sequence_parallel and tp > 1 else whole


def low_precision_recipe(settings) -> str | None:
    """The FP8/FP4 recipe name of a TransformerConfig or of ``model.megatron`` overrides (a dict),
    None when neither ``fp8`` nor ``fp4`` is set (Megatron's default recipes: delayed, nvfp4)."""
    get = settings.get if isinstance(settings, dict) else lambda key, default=None: getattr(settings, key, default)
    if get("fp8"):
        recipe = get("fp8_recipe") or "delayed"
    elif get("fp4"):
        name = str(getattr(get("fp4_recipe"), "value", get("fp4_recipe") or "nvfp4"))
        return "nvfp4" if name == "nvfp4" else "custom"
    else:
        return None
    return str(getattr(recipe, "value", recipe))


def sequence_multiple(config) -> int:
    """The multiple every micro-batch's sequence length must be padded to for this TransformerConfig:
    ``padding_multiple`` of its FP8/FP4 recipe, TP size and sequence parallelism. With context
    parallelism that rule holds for each rank's 1/cp share, and the sequence itself splits into
    2 x cp chunks (parallel/cp_index.py)."""
    per_rank = padding_multiple(recipe=low_precision_recipe(config), tp=int(config.tensor_model_parallel_size),
                                sequence_parallel=bool(getattr(config, "sequence_parallel", False)))
    return cp_sequence_multiple(per_rank, int(getattr(config, "context_parallel_size", 1) or 1))


def te_available() -> bool:
    """True when Transformer Engine imports and CUDA is present (never faked on CPU)."""
    if not torch.cuda.is_available():
        return False
    from megatron.core.models.gpt import gpt_layer_specs

    return bool(gpt_layer_specs.HAVE_TE)


def layer_spec(*, qk_layernorm: bool, use_te: bool, cp: int = 1, num_experts: int | None = None,
               grouped_gemm: bool = False):
    """Megatron layer spec: the TE spec on CUDA with TE, otherwise the pure-PyTorch local spec with
    its core attention computed by PyTorch's fused SDPA (train/sdpa_attention.py; with cp > 1 on CPU:
    the exact CP stand-in, parallel/cp_attention.py, which computes through SDPA too);
    with ``num_experts`` the MoE layer in every block (grouped GEMM experts with ``grouped_gemm``)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)

    moe = {"num_experts": num_experts, "moe_grouped_gemm": grouped_gemm} if num_experts else {}
    if use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **moe)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **moe)
    try:
        spec = cp_layer_spec(spec, cp=cp, on_gpu=torch.cuda.is_available())
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return spec if use_te or cp > 1 else with_sdpa_attention(spec)  # the CP stand-in computes through SDPA too


def _resolve_use_te(use_te: bool | None) -> bool:
    if use_te is None:
        return te_available()
    if use_te and not te_available():
        raise ConfigError("use_te=True but Transformer Engine or CUDA is missing; use use_te=None (auto) or False")
    return use_te


def build_model(hf_config: dict, *, dims: ParallelDims, dtype: torch.dtype = torch.float32,
                overrides: dict | None = None, use_te: bool | None = None, weights_loaded: bool = False,
                vocab_divisible_by: int = VOCAB_DIVISIBLE_BY, lm_head_fp32: bool = False) -> list[torch.nn.Module]:
    """One ``GPTModel`` per virtual pipeline stage of this rank (a list of one without VPP).

    Requires ``parallel.dims.init_distributed`` first. Weights are random (Megatron's CPU init,
    identical at every TP size) unless ``weights_loaded`` says real ones follow (then, on GPU,
    nothing is initialised: ``init_settings``); load them with ``megatron_gtpo.convert`` or a
    checkpoint. bf16/fp16 chunks are wrapped in ``Float16Module`` (fp32 inputs are cast; the train
    step asks it for bf16 logits, which the fused log-prob pass upcasts chunk by chunk). The
    vocabulary is padded to ``padded_vocab_size(vocab_size, tp, vocab_divisible_by)`` rows; each
    chunk records the true size for :func:`true_vocab_size`. ``lm_head_fp32``: the output layer's
    matmul runs in fp32 (``fp32_output_layer``), so the logits are fp32 even then.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    use_te = _resolve_use_te(use_te)
    if check_supported(hf_config).experts is not None:  # grouped GEMM where TE provides it (GPU)
        overrides = {"moe_grouped_gemm": use_te, **(overrides or {}), "expert_model_parallel_size": dims.ep,
                     "expert_tensor_parallel_size": dims.etp}
    config = transformer_config_from_hf(hf_config, tp=dims.tp, pp=dims.pp, vpp=dims.vpp, dtype=dtype,
                                        overrides=overrides, weights_loaded=weights_loaded, cp=dims.cp)
    spec = layer_spec(qk_layernorm=config.qk_layernorm, use_te=use_te, cp=dims.cp, num_experts=config.num_moe_experts,
                      grouped_gemm=config.moe_grouped_gemm)
    rope = rope_settings(hf_config)
    vocab = int(hf_config["vocab_size"])
    padded = padded_vocab_size(vocab, tp=dims.tp, divisible_by=vocab_divisible_by)
    chunks = []
    for vp_stage in range(dims.vpp or 1):
        stage = vp_stage if dims.vpp else None
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=padded,
            max_sequence_length=int(hf_config.get("max_position_embeddings", 4096)),
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=tied_embeddings(hf_config),
            position_embedding_type="rope", rotary_base=rope["theta"], rotary_percent=rope["partial"],
            rope_scaling=rope["type"] == "llama3", rope_scaling_factor=rope.get("factor", 8.0),
            vp_stage=stage,
        )
        _apply_llama3_rope(model, rope)
        model.true_vocab_size = vocab  # GPTModel.vocab_size is the padded row count
        if lm_head_fp32 and model.post_process and (config.bf16 or config.fp16):
            fp32_output_layer(model.output_layer)
        if torch.cuda.is_available() or strict.active():  # strict mode takes the GPU path: all on the device
            model.cuda(torch.cuda.current_device())
        if config.num_moe_experts and dims.tp > 1 and not torch.cuda.is_available():
            cpu_shims.lift_moe_tp_guard(model, tp=dims.tp)  # no sequence parallelism on the local spec (see there)
        if config.fp16 or config.bf16:
            model = Float16Module(config, model)
        chunks.append(model)
    return chunks


def fp32_output_layer(layer) -> None:
    """Makes a ``ColumnParallelLinear`` output layer multiply in fp32: hidden states and weight
    (its own, or the tied embedding passed in) are upcast, so the logits are fp32 products of the
    bf16 values instead of bf16-rounded ones. Megatron-Core 0.16.1 has no option for this (the
    ``fp32_output`` of ``Float16Module`` only casts the finished bf16 logits). The weight's fp32
    copy is a differentiable cast, so its gradient reaches the bf16 parameter through autograd;
    the fused wgrad accumulation (which writes to ``weight.main_grad`` directly) is turned off for
    this one layer, and Megatron's DDP hook adds ``param.grad`` to the main grad instead."""
    layer.gradient_accumulation_fusion = False
    forward = layer.forward

    def forward_fp32(input_, weight=None, runtime_gather_output=None):
        weight = layer.weight if weight is None else weight
        return forward(input_.float(), weight=weight.float(), runtime_gather_output=runtime_gather_output)

    layer.forward = forward_fp32


def _apply_llama3_rope(model, rope: dict) -> None:
    """Megatron's llama3 scaling fixes low/high freq factors at 1/4 and the original context at
    8192; checkpoints with other values get their inverse frequencies recomputed exactly."""
    if rope["type"] != "llama3" or all(rope[k] == v for k, v in LLAMA3_ROPE_DEFAULTS.items()):
        return
    emb = model.rotary_pos_emb
    dim = emb.inv_freq.numel() * 2
    base = 1.0 / (rope["theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    emb.inv_freq = emb._apply_scaling(
        base.to(emb.inv_freq.device), factor=rope["factor"], low_freq_factor=rope["low_freq_factor"],
        high_freq_factor=rope["high_freq_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"])


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The bare ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def true_vocab_size(model_chunks: list[torch.nn.Module]) -> int:
    """Real vocabulary of a model from ``build_model`` (logit columns at ids >= it are padding);
    ``GPTModel.vocab_size`` (no padding known) for a model built elsewhere."""
    model = unwrap(model_chunks[0])
    return int(getattr(model, "true_vocab_size", model.vocab_size))


def layer_offset(chunk: torch.nn.Module) -> int:
    """Global index of this chunk's first transformer layer (PP and VPP aware)."""
    layers = unwrap(chunk).decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def causal_mask(seq_len: int) -> torch.Tensor:
    """Boolean ``[1, 1, s, s]`` mask, True = masked, as Megatron's local attention expects."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1).view(1, 1, seq_len, seq_len)

