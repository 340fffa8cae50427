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
under other names or fused (Phi-3). A mixture-of-experts family (Qwen3-MoE, Qwen2-MoE, Mixtral) is
a record whose :class:`ExpertLayout` says where config.json keeps the expert count, top-k and
widths, how the router normalises its top-k probabilities, and how the checkpoint names one
expert's tensors, the router and a shared expert (``docs/extension.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gtpo.utils.configuration import ConfigError

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""config.json keys that announce experts: a family without an ExpertLayout refuses them."""


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """How a mixture-of-experts family describes its experts in config.json and its checkpoint.

    Every decoder layer is a sparse block: a softmax router over ``count`` experts picks
    ``top_k`` per token, each expert is a SwiGLU MLP of width ``ffn``, and the chosen experts'
    outputs are summed weighted by their router probabilities (renormalised over the top-k where
    :meth:`normalises` says so); an optional shared expert (Qwen2-MoE) runs on every token, scaled
    by a sigmoid gate. That is what Megatron-Core's MoE layer computes with the settings the
    builder derives (``train/model.py``)."""

    count_keys: tuple[str, ...]
    """config.json keys of the number of routed experts, the first present one counts (Qwen's
    ``num_experts``, which transformers 5 writes as ``num_local_experts``; Mixtral ``num_local_experts``)."""
    ffn_key: str
    """config.json key of one expert's SwiGLU width (``moe_intermediate_size``; Mixtral ``intermediate_size``)."""
    top_k_key: str = "num_experts_per_tok"
    """config.json key of the experts each token is routed to."""
    normalise_key: str | None = "norm_topk_prob"
    """config.json key saying whether the top-k probabilities are renormalised to sum to 1 (absent
    means False, as in transformers); None: the family always renormalises (Mixtral)."""
    block: str = "mlp"
    """HF module of the sparse block inside a layer (``mlp``; Mixtral's checkpoint ``block_sparse_moe``)."""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """HF names of one expert's gate, up and down projections (Mixtral ``w1``, ``w3``, ``w2``),
    under ``{block}.experts.{e}.``."""
    router: str = "gate.weight"
    """HF name of the router's weight [experts, hidden] under ``{block}.``."""
    shared_ffn_key: str | None = None
    """config.json key of the shared expert's width (Qwen2-MoE ``shared_expert_intermediate_size``);
    None: no shared expert. Its tensors are ``{block}.shared_expert.{gate,up,down}_proj.weight``
    and its sigmoid gate ``{block}.shared_expert_gate.weight`` [1, hidden]."""
    dense_layer_keys: tuple[str, ...] = ("mlp_only_layers", "decoder_sparse_step")
    """config.json keys that would make some layers dense; refused unless every layer is sparse
    (empty ``mlp_only_layers``, ``decoder_sparse_step`` 1)."""

    def count(self, hf_config: dict):
        """The routed experts per layer as config.json states them (validated by check_supported)."""
        return next((hf_config[k] for k in self.count_keys if hf_config.get(k) is not None), None)

    def sizes(self, hf_config: dict) -> dict[str, int]:
        """``experts``, ``top_k``, ``ffn`` and ``shared_ffn`` (0: no shared expert) of a checked config."""
        shared = int(hf_config.get(self.shared_ffn_key) or 0) if self.shared_ffn_key else 0
        return {"experts": int(self.count(hf_config)), "top_k": int(hf_config[self.top_k_key]),
                "ffn": int(hf_config[self.ffn_key]), "shared_ffn": shared}

    def normalises(self, hf_config: dict) -> bool:
        """True when the router renormalises its top-k probabilities for this config."""
        return True if self.normalise_key is None else bool(hf_config.get(self.normalise_key, False))

    def expert_hf(self, piece: int) -> str:
        """HF name (relative to the layer, with an ``{e}`` placeholder for the expert) of an
        expert's gate (0), up (1) or down (2) projection weight."""
        return f"{self.block}.experts.{{e}}.{self.expert_names[piece]}.weight"


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
    true_flags: tuple[str, ...] = ()
    """config.json flags that must be true or absent (Qwen2-MoE's ``qkv_bias``: the record's
    ``qkv_bias`` is what the builder and the mapping assume)."""
    experts: ExpertLayout | None = None
    """Mixture-of-experts layout; None for a dense family (which then refuses the expert keys)."""

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
    Family(name="qwen3_moe", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True,
           experts=ExpertLayout(count_keys=("num_experts", "num_local_experts"), ffn_key="moe_intermediate_size")),
    Family(name="qwen2_moe", architecture="Qwen2MoeForCausalLM", model_type="qwen2_moe", qkv_bias=True,
           false_flags=("mlp_bias",), true_flags=("qkv_bias",),
           experts=ExpertLayout(count_keys=("num_experts", "num_local_experts"), ffn_key="moe_intermediate_size",
                                shared_ffn_key="shared_expert_intermediate_size")),
    Family(name="mixtral", architecture="MixtralForCausalLM", model_type="mixtral",
           experts=ExpertLayout(count_keys=("num_local_experts",), ffn_key="intermediate_size", normalise_key=None,
                                block="block_sparse_moe", expert_names=("w1", "w3", "w2"), dense_layer_keys=())),
)}
"""Every supported family by name (Llama 2/3 and SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3; the
mixtures of experts Qwen3-MoE, Qwen2-MoE and Mixtral)."""

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
    problems += [f"field {key!r}=false is not supported for {family.name}"
                 for key in family.true_flags if hf_config.get(key, True) is False]
    problems += _expert_problems(hf_config, family)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return family


def _expert_problems(hf_config: dict, family: Family) -> list[str]:
    """What a config says about experts that ``family`` cannot build: expert keys on a dense family,
    missing or invalid counts on a mixture of experts, dense layers mixed into one, a router other
    than softmax top-k."""
    layout = family.experts
    if layout is None:
        moe = [key for key in MOE_KEYS if hf_config.get(key)]
        dense = ", ".join(name for name, f in FAMILIES.items() if f.experts is None)
        return [f"field {moe[0]!r}={hf_config[moe[0]]!r}: {family.name} is a dense family ({dense}); "
                f"mixture-of-experts configs need one of {', '.join(moe_architectures())}"] if moe else []
    problems = []
    count, top_k = layout.count(hf_config), hf_config.get(layout.top_k_key)
    count_key = " or ".join(repr(k) for k in layout.count_keys)
    for key, value in ((count_key, count), (repr(layout.top_k_key), top_k),
                       (repr(layout.ffn_key), hf_config.get(layout.ffn_key))):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            problems.append(f"field {key}={value!r} must be a positive integer for {family.name}")
    if isinstance(count, int) and isinstance(top_k, int) and top_k > count:
        problems.append(f"field {layout.top_k_key!r}={top_k} exceeds the {count} experts")
    if hf_config.get("mlp_only_layers") and "mlp_only_layers" in layout.dense_layer_keys:
        problems.append(f"field 'mlp_only_layers'={hf_config['mlp_only_layers']!r}: dense layers between sparse "
                        "ones are not supported; every layer must be a sparse block (mlp_only_layers: [])")
    if hf_config.get("decoder_sparse_step", 1) != 1 and "decoder_sparse_step" in layout.dense_layer_keys:
        problems.append(f"field 'decoder_sparse_step'={hf_config['decoder_sparse_step']!r}: only every layer "
                        "sparse is supported (decoder_sparse_step: 1)")
    for key in ("scoring_func", "topk_method"):  # DeepSeek-style routers: sigmoid scores, grouped top-k
        if hf_config.get(key) not in (None, "softmax", "greedy"):
            problems.append(f"field {key!r}={hf_config[key]!r}: only the softmax top-k router is supported")
    return problems


def moe_architectures() -> list[str]:
    """``architectures`` of the supported mixture-of-experts families."""
    return [f.architecture for f in FAMILIES.values() if f.experts is not None]
