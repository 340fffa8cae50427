"""Model families as records: everything that tells one Hugging Face decoder family from another.

Every part that depends on the family reads its :class:`Family` record and nothing else: the model
builder (``train/model.py``: q/k/v biases, q/k norms), the shape reader (``models/shape.py``: the
dry-run's parameter counts), the HF <-> Megatron mapping (``convert/mapping.py``: the HF names of
each Megatron parameter, fused or not) and the weight push (``sync/``: which delivery a layout
allows). Which family a config.json describes follows one rule, :func:`family_of`; what a family
cannot reproduce is refused by one check, :func:`check_supported`, for every reader alike.

All families here are pre-norm decoders with RMSNorm, SwiGLU, RoPE (rotate-half) and GQA, which
Megatron-Core's GPT layer builds; they differ only in the fields below. Adding a dense family is
one record in :data:`FAMILIES`, plus an ``hf_names`` entry where its checkpoint stores a parameter
under other names or fused (Phi-3). ``docs/extension.md`` says how mixture-of-experts families
extend the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gtpo.utils.configuration import ConfigError

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that announce experts: no dense family accepts them."""


@dataclass(frozen=True, eq=False, kw_only=True)
class Family:
    """One HF model family, as the builder, the shape reader and the mapping see it."""

    name: str
    """Short name in manifests, messages and tests (``qwen2``)."""
    architecture: str
    """``architectures[0]`` of its config.json (``Qwen2ForCausalLM``): the class vLLM serves."""
    model_type: str
    """``model_type`` of its config.json (``qwen2``): the class transformers' Auto classes build."""
    qkv_bias: bool = False
    """q/k/v projections carry biases and o_proj does not (Qwen2): Megatron's ``add_qkv_bias``."""
    qk_norm: bool = False
    """RMSNorm per head on queries and keys before RoPE (Qwen3): Megatron's ``qk_layernorm``."""
    hf_names: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Megatron parameter (``ParamMap.local`` of convert/mapping.py) -> its HF tensor names (relative
    to ``model.layers.{i}.``), where they differ from the default layout (separate q/k/v_proj and
    gate/up_proj). One name for a fused Megatron parameter means that the HF checkpoint stores its
    pieces concatenated along dim 0, in Megatron's order: Phi-3's ``self_attn.qkv_proj`` is
    [all q heads; all k heads; all v heads], its ``mlp.gate_up_proj`` is [gate; up]."""
    false_flags: tuple[str, ...] = ("attention_bias", "mlp_bias")
    """config.json flags that must be false or absent: options Megatron's GPT layer cannot
    reproduce (Llama's and Qwen3's ``attention_bias`` also puts a bias on o_proj, Megatron's
    ``add_qkv_bias`` covers q/k/v only)."""

    @property
    def fused(self) -> bool:
        """True when the checkpoint fuses pieces of a Megatron parameter into one HF tensor."""
        return any(len(names) == 1 for names in self.hf_names.values())


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(name="llama", architecture="LlamaForCausalLM", model_type="llama"),
    Family(name="mistral", architecture="MistralForCausalLM", model_type="mistral"),
    Family(name="qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", qkv_bias=True, false_flags=()),
    Family(name="qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True),
    Family(name="phi3", architecture="Phi3ForCausalLM", model_type="phi3", hf_names={
        "self_attention.linear_qkv.weight": ("self_attn.qkv_proj.weight",),
        "mlp.linear_fc1.weight": ("mlp.gate_up_proj.weight",)}),
)}
"""Every supported family by name (Llama 2/3 and SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3)."""

_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES.values()}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def family_of(hf_config: dict, *, source: str = "config.json") -> Family:
    """The family of a config.json. The rule: ``architectures`` (exactly one entry) names it; a
    config without ``architectures`` is named by ``model_type``; when both are present they must
    name the same family. ConfigError names the field, the value and the supported ones."""
    archs, model_type = hf_config.get("architectures"), hf_config.get("model_type")
    if archs is None:
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ConfigError(f"{source}: model_type={model_type!r} (and no 'architectures') is not supported; "
                          f"supported: {', '.join(sorted(_BY_MODEL_TYPE))}")
    if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in _BY_ARCHITECTURE:
        raise ConfigError(f"{source}: field 'architectures'={archs!r} is not supported; expected exactly one of "
                          f"{', '.join(sorted(_BY_ARCHITECTURE))}")
    family = _BY_ARCHITECTURE[archs[0]]
    if model_type is not None and model_type != family.model_type:
        raise ConfigError(f"{source}: architectures={archs!r} is the {family.name} family, whose model_type is "
                          f"{family.model_type!r}, but model_type={model_type!r}; fix one of the two")
    return family


def check_supported(hf_config: dict, *, source: str = "config.json") -> Family:
    """The family of ``hf_config`` after refusing what Megatron's GPT layer cannot reproduce exactly
    (every problem in one ConfigError). The model builder, the converter and the dry-run's shape
    reader all call this, so they accept and refuse the same configs."""
    family = family_of(hf_config, source=source)
    problems = []
    if hf_config.get("hidden_act", "silu") != "silu":
        problems.append(f"field 'hidden_act'={hf_config['hidden_act']!r} is not supported; expected 'silu'")
    problems += [f"field {key!r}=true is not supported for {family.name}"
                 for key in family.false_flags if hf_config.get(key)]
    if hf_config.get("use_sliding_window"):
        problems.append("field 'use_sliding_window'=true is not supported; Megatron's local attention has no "
                        "per-layer sliding window")
    moe = [key for key in MOE_KEYS if hf_config.get(key)]
    if moe:
        problems.append(f"field {moe[0]!r}={hf_config[moe[0]]!r}: mixture-of-experts configs are not supported "
                        f"(dense families only: {', '.join(FAMILIES)})")
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return family
