"""Tiny random Hugging Face models of each supported family, made offline with ``transformers``.

Shapes are chosen to exercise every mapping path: GQA (4 query heads, 2 KV groups), a Qwen3
``head_dim`` different from hidden/heads, Qwen2 q/k/v biases, a tied-embedding Llama with
non-default llama3 RoPE scaling (the path Megatron does not cover natively), Phi-3's fused
``qkv_proj`` / ``gate_up_proj`` with RoPE on half of each head (``partial_rotary_factor``), and 4
layers so PP=2 x VPP=2 has one layer per virtual stage. The vocabulary (257, prime) divides no TP size, so
every conversion and load pads it (Megatron-LM's make_vocab_size_divisible_by, 128 x TP rows) and
every export strips the padding again. RoPE uses a non-default theta (12345), so a converter
that dropped it (Megatron's default is 10000) fails the logits parity checks.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3")

VOCAB_SIZE = 257
ROPE_THETA = 12345.0

_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB_SIZE, max_position_embeddings=256, rms_norm_eps=1e-5)
_ROPE = {"rope_type": "default", "rope_theta": ROPE_THETA}


def tiny_hf_config(family: str) -> dict:
    """``config.json`` contents (as transformers 5 writes them) for a tiny model of ``family``."""
    import transformers

    if family == "llama":
        cfg = transformers.LlamaConfig(**_BASE, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": ROPE_THETA, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**_BASE, tie_word_embeddings=False, rope_parameters=dict(_ROPE))
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**_BASE, head_dim=32, tie_word_embeddings=False, rope_parameters=dict(_ROPE))
    elif family == "mistral":
        cfg = transformers.MistralConfig(**_BASE, head_dim=16, tie_word_embeddings=False, rope_parameters=dict(_ROPE))
    elif family == "phi3":
        cfg = transformers.Phi3Config(**_BASE, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                      rope_parameters={**_ROPE, "partial_rotary_factor": 0.5})
    else:
        raise ValueError(family)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    return cfg.to_dict()


def make_tiny_hf_model(family: str, seed: int = 0):
    """A randomly initialised ``*ForCausalLM`` (fp32, eval mode) with weights of a non-trivial scale."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**tiny_hf_config(family))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # norms start at exactly 1.0; randomise them so a dropped norm is caught
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model


def save_tiny_hf_model(family: str, out_dir: str | Path, *, seed: int = 0, dtype=None,
                       max_shard_size: str | None = None) -> Path:
    """Saves a tiny model as safetensors (sharded with an index when ``max_shard_size`` is set)."""
    out_dir = Path(out_dir)
    model = make_tiny_hf_model(family, seed)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir
