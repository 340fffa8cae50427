"""``LoraConfig`` (the ``model.lora`` block): low-rank adapters on a frozen Megatron policy.

LoRA (Hu et al. 2021) trains ``W x + (alpha / r) B A x`` with the base ``W`` frozen. Adapters sit on
the four parallel linear layers of every transformer layer, named as Megatron names them; each
covers one or more Hugging Face projections (what PEFT's ``target_modules`` lists)::

    Megatron      parallel   HF projections it fuses           adapter shapes (global, TP=1)
    linear_qkv    column     q_proj, k_proj, v_proj            A [parts*r, hidden]  B [q+k+v rows, r]
    linear_proj   row        o_proj                            A [r, q width]       B [hidden, r]
    linear_fc1    column     gate_proj, up_proj                A [parts*r, hidden]  B [2*ffn, r]
    linear_fc2    row        down_proj                         A [r, ffn]           B [hidden, r]

``parts`` is the number of HF projections a fused layer covers (3 for qkv, 2 for fc1) unless
``share_a`` gives the whole fused layer one A. With TP, a column-parallel layer keeps A whole on
every rank and B split like its output rows; a row-parallel layer splits A like its input columns
and keeps B whole (``train/lora_layers.py`` has the math). This module is pure configuration and
arithmetic: validation, which modules are adapted, and adapter parameter counts for the plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_gtpo.models.shape import ModelShape
from megatron_gtpo.utils.configuration import ConfigError, require


@dataclass(frozen=True)
class Target:
    """One adaptable Megatron linear layer of a transformer layer."""

    name: str
    """Megatron module name (``linear_qkv`` ...), what ``target_modules`` lists."""
    path: str
    """Module path inside a TransformerLayer (``self_attention.linear_qkv``)."""
    parallel: str
    """``column`` (output rows split over TP) or ``row`` (input columns split over TP)."""
    hf_parent: str
    """HF module holding the projections (``self_attn`` or ``mlp``)."""
    hf: tuple[str, ...]
    """HF projections this layer fuses, in Megatron's fusion order."""


TARGETS = (
    Target("linear_qkv", "self_attention.linear_qkv", "column", "self_attn", ("q_proj", "k_proj", "v_proj")),
    Target("linear_proj", "self_attention.linear_proj", "row", "self_attn", ("o_proj",)),
    Target("linear_fc1", "mlp.linear_fc1", "column", "mlp", ("gate_proj", "up_proj")),
    Target("linear_fc2", "mlp.linear_fc2", "row", "mlp", ("down_proj",)),
)
BY_NAME = {t.name: t for t in TARGETS}
_BY_HF = {hf: t for t in TARGETS for hf in t.hf}
VALID_NAMES = tuple(t.name for t in TARGETS) + tuple(_BY_HF)


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA adapters on the policy (off unless ``rank`` > 0)."""

    rank: int = 0
    """Rank r of every adapter; 0 turns LoRA off (full fine-tuning). Must not exceed the smallest
    dimension of any adapted projection (checked against the model before anything starts)."""
    alpha: float | None = None
    """Scaling numerator: the update is (alpha / rank) B A. None means alpha = rank (scale 1), the
    GTPO paper's setting (rank 128, alpha 128)."""
    dropout: float = 0.0
    """Dropout on the adapter's input in training (PEFT's lora_dropout), 0 <= p < 1. With p > 0 a
    TP layout draws its masks like Megatron's own dropout, so it is not bit-equal to one process."""
    target_modules: list[str] = field(default_factory=lambda: [t.name for t in TARGETS])
    """Layers to adapt, by Megatron name (linear_qkv, linear_proj, linear_fc1, linear_fc2) or by
    the HF projections they cover (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
    A fused Megatron layer is adapted whole: list all of its HF projections or none. Default: all
    four (q, k, v, o, gate, up, down, as in the GTPO paper)."""
    share_a: bool = False
    """False: each HF projection of a fused layer (q, k, v; gate, up) has its own A, exactly PEFT's
    LoRA on those modules (the exported adapter loads in peft as trained). True: one A per fused
    Megatron layer (Megatron-Bridge's LoRA, fewer parameters; the PEFT export repeats it)."""

    def __post_init__(self):
        require(isinstance(self.rank, int) and self.rank >= 0, "rank", self.rank,
                "an integer >= 0 (0 = LoRA off)")
        require(self.alpha is None or self.alpha > 0, "alpha", self.alpha, "a number > 0, or null (= rank)")
        require(0.0 <= self.dropout < 1.0, "dropout", self.dropout, "a probability 0 <= p < 1")
        self.targets()  # validates target_modules

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of B A."""
        return float(self.alpha if self.alpha is not None else self.rank) / self.rank

    def targets(self) -> tuple[Target, ...]:
        """The adapted layers in TARGETS order; ConfigError on an unknown name or a fused layer
        whose HF projections are listed only in part."""
        names = list(self.target_modules)
        unknown = [n for n in names if n not in VALID_NAMES]
        if unknown:
            raise ConfigError(f"target_modules: unknown module(s) {', '.join(map(repr, unknown))}; valid names: "
                              f"{', '.join(VALID_NAMES)} (Megatron layers or the HF projections they cover)")
        if not names:
            raise ConfigError("target_modules=[] adapts nothing: list at least one of " + ", ".join(VALID_NAMES))
        chosen = {n for n in names if n in BY_NAME} | {_BY_HF[n].name for n in names if n in _BY_HF}
        for target in TARGETS:
            listed = [hf for hf in target.hf if hf in names]
            if target.name not in names and listed and len(listed) < len(target.hf):
                missing = [hf for hf in target.hf if hf not in names]
                raise ConfigError(
                    f"target_modules lists {', '.join(listed)} without {', '.join(missing)}: Megatron fuses "
                    f"{', '.join(target.hf)} into {target.name}, which is adapted whole; list all of them "
                    f"(or {target.name}), or none")
        return tuple(t for t in TARGETS if t.name in chosen)

    def parts(self, target: Target) -> int:
        """Number of A matrices (of ``rank`` rows each) of ``target``'s adapter."""
        return 1 if self.share_a else len(target.hf)


def projection_dims(shape: ModelShape, target: Target) -> dict[str, tuple[int, int]]:
    """``{hf projection: (out, in)}`` of ``target`` for a model of ``shape`` (global sizes)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    h, f = shape.hidden, shape.ffn
    dims = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    return {name: dims[name] for name in target.hf}


def check_rank_fits(cfg: LoraConfig, shape: ModelShape) -> None:
    """ConfigError when ``cfg.rank`` exceeds the smallest dimension of an adapted projection (the
    update B A could not have that rank). Cheap: runs in the dry-run and before the model is built."""
    if not cfg.enabled:
        return
    for target in cfg.targets():
        for name, (out, inp) in projection_dims(shape, target).items():
            if cfg.rank > min(out, inp):
                raise ConfigError(
                    f"model.lora.rank={cfg.rank} exceeds the smallest dimension of {target.name} ({name}: "
                    f"{out} x {inp}) of {shape.name}; use rank <= {min(out, inp)} or drop {target.name} "
                    "from model.lora.target_modules")


def adapter_params(cfg: LoraConfig, shape: ModelShape, *, tp: int = 1) -> int:
    """Adapter parameters one TP rank of a ``tp``-way split holds for the whole model (all layers;
    PP splits them further by layers). Column layers: A whole, B split; row layers: A split, B whole."""
    if not cfg.enabled:
        return 0
    per_layer = 0
    for target in cfg.targets():
        dims = projection_dims(shape, target)
        inp = next(iter(dims.values()))[1]
        out = sum(o for o, _ in dims.values())
        a_rows = cfg.parts(target) * cfg.rank
        if target.parallel == "column":
            per_layer += a_rows * inp + out // tp * cfg.rank
        else:
            per_layer += a_rows * inp // tp + out * cfg.rank
    return shape.layers * per_layer
