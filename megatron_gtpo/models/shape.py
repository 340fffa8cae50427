"""The shape of a dense decoder read from a Hugging Face ``config.json``, and its parameter counts.

Pure arithmetic (no torch, no transformers): ``dry-run`` uses it to check a parallel layout and to
estimate memory before any job is submitted. The counts follow the HF modules of the supported
families (``models/families.py``: GQA attention, SwiGLU MLP, RMSNorm), which are also what
Megatron-Core builds for them, so ``params_total`` equals the checkpoint's parameter count
(8,030,261,248 for Llama-3-8B; 32,763,876,352 for Qwen2.5-32B). The family is read, and refused,
exactly as the model builder does (``families.check_supported``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatron_gtpo.models.families import check_supported
from megatron_gtpo.models.hf_config import head_dim_of, num_kv_heads_of, read_hf_config, tied_embeddings
from megatron_gtpo.utils.configuration import ConfigError


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Sizes of a dense decoder-only transformer."""

    name: str
    """Display name (the config file's directory or stem)."""
    family: str
    """Family name (``models.families.FAMILIES``)."""
    layers: int
    """Transformer blocks (``num_hidden_layers``)."""
    hidden: int
    """Residual width (``hidden_size``)."""
    ffn: int
    """SwiGLU inner width (``intermediate_size``)."""
    heads: int
    """Query heads (``num_attention_heads``)."""
    kv_heads: int
    """Key/value heads (``num_key_value_heads``); Megatron calls them query groups."""
    head_dim: int
    """Width of one head (``head_dim``, else hidden / heads)."""
    vocab: int
    """Vocabulary rows of the embedding as stored in the checkpoint (``vocab_size``)."""
    tied_embeddings: bool
    """True when the output layer reuses the input embedding (``tie_word_embeddings``)."""
    qkv_bias: bool
    """q/k/v projections carry biases (Qwen2)."""
    qk_norm: bool
    """Per-head RMSNorm on queries and keys (Qwen3)."""
    max_positions: int
    """Longest sequence the position embedding covers (``max_position_embeddings``)."""

    # Counts below take the tensor-parallel degree of whoever holds the weights: Megatron splits
    # heads and the MLP evenly (it rejects kv_heads % tp != 0 itself); vLLM replicates a KV head
    # on several ranks when tp > kv_heads, so a rank never holds less than one KV head.

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one tensor-parallel rank holds (at least one: vLLM replicates beyond kv_heads)."""
        return max(self.kv_heads // tp, 1)

    def layer_params(self, tp: int = 1) -> int:
        """Parameters of one transformer block held by one rank of a ``tp``-way split."""
        q_width = self.heads * self.head_dim // tp
        kv_width = self.kv_heads_per_rank(tp) * self.head_dim
        attention = self.hidden * (q_width + 2 * kv_width) + q_width * self.hidden
        if self.qkv_bias:
            attention += q_width + 2 * kv_width
        mlp = 3 * self.hidden * self.ffn // tp
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)  # replicated on every rank
        return attention + mlp + norms

    def embedding_params(self, tp: int = 1) -> int:
        """One vocabulary matrix (input embedding or output layer) on one rank of a ``tp``-way split."""
        return self.vocab * self.hidden // tp

    def params_total(self) -> int:
        """Parameters of the unsharded checkpoint."""
        outputs = 1 if self.tied_embeddings else 2
        return self.layers * self.layer_params() + outputs * self.embedding_params() + self.hidden

    def kv_bytes_per_token(self, *, tp: int, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies on one rank of a ``tp``-way engine (keys and values)."""
        return 2 * self.layers * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes


def load_model_shape(path: str | Path) -> ModelShape:
    """Reads ``config.json`` (or a directory holding one); ConfigError names the missing key."""
    path = Path(path)
    name = path.parent.name if path.name == "config.json" else (path.name if path.is_dir() else path.stem)
    return shape_from_hf_config(read_hf_config(path), name=name, source=str(path))


def shape_from_hf_config(raw: dict, *, name: str, source: str = "config.json") -> ModelShape:
    """Builds a ModelShape from a parsed HF config dict (``text_config`` of multimodal configs too)."""
    raw = raw.get("text_config", raw)
    family = check_supported(raw, source=source)

    def need(key: str) -> int:
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise ConfigError(f"{source}: {key} must be a positive integer, got {raw.get(key)!r}")
        return raw[key]

    heads, hidden = need("num_attention_heads"), need("hidden_size")
    return ModelShape(
        name=name, family=family.name, layers=need("num_hidden_layers"), hidden=hidden,
        ffn=need("intermediate_size"), heads=heads,
        kv_heads=num_kv_heads_of(raw), head_dim=head_dim_of(raw), vocab=need("vocab_size"),
        tied_embeddings=tied_embeddings(raw),
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, max_positions=need("max_position_embeddings"),
    )
