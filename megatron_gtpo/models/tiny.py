"""A tiny random Qwen2-style policy with SmolLM2's real tokenizer, for tests and ``configs/tiny.yaml``.

The model is small enough for a training step of a few seconds on 2 CPU cores, yet uses the real
code paths: GQA, q/k/v biases, untied embeddings, head_dim 32 (vLLM's CPU attention needs >= 32),
and a real tokenizer with a chat template (borrowed from SmolLM2, vocabulary 49152).
Weights are seeded, so every machine builds the same model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib.metadata import version
from pathlib import Path

from megatron_gtpo.models.smollm2 import default_cache_dir, ensure_smollm2
from megatron_gtpo.utils.atomic import atomic_directory

TINY_NAME = "tiny-qwen2-smollm2tok"

TINY_CONFIG = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


BUILD = "torch.manual_seed(seed); transformers.Qwen2ForCausalLM(config) in float32"
"""How a seed becomes weights: part of the cache key with the config and the library versions."""


def cache_key(config: dict, tokenizer: str, seed: int) -> str:
    """Directory suffix of a cached tiny model: a hash of everything its weights and files depend
    on (the config, the tokenizer, how the seed is used, torch's and transformers' versions), so
    that a change to any of them builds a new model instead of silently reusing a stale one."""
    what = {"config": config, "tokenizer": tokenizer, "build": BUILD, "torch": version("torch"),
            "transformers": version("transformers")}
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:10]
    return f"{digest}-seed{seed}"


def ensure_tiny(cache_dir: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """Returns an HF directory with the tiny random model (built once, then cached)."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / f"{TINY_NAME}-{cache_key(TINY_CONFIG, 'smollm2', seed)}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    tok_dir = ensure_smollm2(root)
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**TINY_CONFIG)
    config.architectures = ["Qwen2ForCausalLM"]
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    with atomic_directory(out, replace=False) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        for name in os.listdir(tok_dir):
            if name.startswith(("tokenizer", "chat_template", "special_tokens")):
                shutil.copy(tok_dir / name, tmp / name)
    return out


CHAR_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAR_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


CHAR_CONFIG = {**TINY_CONFIG, "vocab_size": 128, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def _char_tokenizer():
    """A character-level fast tokenizer: 3 specials, then tab, newline and printable ASCII.

    Byte-level BPE with no merges: every character is one token. It is byte-level (space is 'Ġ',
    newline 'Ċ', tab 'ĉ', as GPT-2's byte-to-unicode table) because transformers loads a
    qwen2-typed model's tokenizer as Qwen2Tokenizer, which installs Qwen's byte-level
    pre-tokenizer; a plain character vocabulary would silently lose every space.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def byte_char(code: int) -> str:  # GPT-2 bytes_to_unicode for the ASCII range used here
        return chr(code) if 33 <= code <= 126 else chr(256 + code)

    chars = [byte_char(c) for c in (9, 10, *range(32, 127))]
    vocab = {tok: i for i, tok in enumerate(CHAR_SPECIALS + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|endoftext|>", pad_token="<|im_end|>")
    tok.add_special_tokens({"additional_special_tokens": CHAR_SPECIALS})
    tok.chat_template = CHAR_TEMPLATE
    return tok


def ensure_tiny_char(cache_dir: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """The tiny Qwen2 with a character-level tokenizer (vocabulary 128).

    With ~100 live tokens a random policy samples every token often, so a policy-gradient loss
    moves it within a few steps: the learning tests and ``configs/tiny.yaml`` use it. (Over a
    49k-token vocabulary each sampled token is rarely seen twice and learning is far slower.)
    """
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    key = cache_key(CHAR_CONFIG, f"char {CHAR_SPECIALS} {CHAR_TEMPLATE}", seed)
    out = root / f"tiny-qwen2-char-{key}"
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**CHAR_CONFIG)
    config.architectures = ["Qwen2ForCausalLM"]
    model = transformers.Qwen2ForCausalLM(config).to(torch.float32)
    with atomic_directory(out, replace=False) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        _char_tokenizer().save_pretrained(tmp)
    return out
