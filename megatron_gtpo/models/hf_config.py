"""Reading a Hugging Face ``config.json`` and the model facts derived from it (one leaf module).

Used by the trainer's model builder, the converter, the dry-run's shape model and evaluation, so
that every part of the stack reads a model directory the same way.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gtpo.utils.configuration import ConfigError

# Megatron's llama3 RoPE scaling hard-codes these; other values are re-applied after build.
LLAMA3_ROPE_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}


def read_hf_config(path: str | Path) -> dict:
    """Reads a Hugging Face ``config.json`` (the file, or a directory holding it); ConfigError
    names the file. The one reader of config.json in the package."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() or not path.suffix else path
    if not file.is_file():
        raise ConfigError(f"{file} does not exist; pass a Hugging Face model directory that holds config.json "
                          "(copies for common models: configs/models/)")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{file} is not valid JSON ({err}); re-download or re-save the model") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def head_dim_of(hf_config: dict) -> int:
    """Per-head width: ``head_dim`` when present (Qwen3, Mistral-NeMo), else hidden/heads."""
    if hf_config.get("head_dim"):
        return int(hf_config["head_dim"])
    return int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


def num_kv_heads_of(hf_config: dict) -> int:
    """Key/value heads (query groups); equals the head count for models without GQA."""
    return int(hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"])


def tied_embeddings(hf_config: dict) -> bool:
    """True when lm_head shares the input embedding (SmolLM2); every family defaults to False."""
    return bool(hf_config.get("tie_word_embeddings", False))


def rope_settings(hf_config: dict) -> dict:
    """``{"theta", "type", "partial", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}`` from transformers-5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` pair. ``partial`` is the share of each head's dimensions that
    RoPE rotates (``partial_rotary_factor``, 1.0 unless set: Phi-4-mini uses 0.75)."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    if kind not in ("default", "llama3"):
        raise ConfigError(f"config.json rope type {kind!r} is not supported; supported: default, llama3")
    partial = params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    if not 0 < float(partial) <= 1:
        raise ConfigError(f"config.json partial_rotary_factor={partial!r} must be in (0, 1]")
    out = {"theta": float(theta), "type": kind, "partial": float(partial)}
    if kind == "llama3":
        out["factor"] = float(merged["factor"])
        for key, default in LLAMA3_ROPE_DEFAULTS.items():
            out[key] = float(merged.get(key, default))
    return out


def has_hf_weights(model_dir: str | Path) -> bool:
    """True when ``model_dir`` holds HF safetensors weights (vLLM and the trainer can load them)."""
    model_dir = Path(model_dir)
    return (model_dir / "model.safetensors").is_file() or (model_dir / "model.safetensors.index.json").is_file()
