"""LoRA adapters between Megatron's layout and Hugging Face PEFT's, and merged HF weights.

Pure tensor code on global (TP=1) adapters, i.e. what ``train.lora_layers.gather_adapters``
returns or an adapter checkpoint holds, named ``decoder.layers.{i}.{path}.lora.{a|b}``:

* **PEFT adapter**: ``adapter_config.json`` + ``adapter_model.safetensors`` that the ``peft``
  library loads onto the HF base (``PeftModel.from_pretrained``) and vLLM serves as a LoRA
  adapter. A fused Megatron layer becomes one PEFT adapter per HF projection: B's rows are cut
  like the fused weight (``mapping.split``: q/k/v out of the per-group layout, gate/up halves),
  A is that projection's slice (or the shared A, repeated, with ``share_a``). Same r and alpha
  on every projection, so each HF projection computes exactly what its rows of the fused layer do.
* **merged weight**: ``W + (alpha / r) B A`` on a global Megatron weight, before it is split into
  HF tensors (``merge_global``); the live push merges per TP shard instead
  (``LoraAdapter.merged``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.train.lora import LoraConfig, Target
from megatron_gtpo.train.lora_layers import adapter_key, base_param_map, merge_into, parts_of
from megatron_gtpo.utils.atomic import atomic_directory

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's names for a causal LM wrap the HF names: ``base_model.model.model.layers.{i}...``."""


def _hf_modules(target: Target) -> list[str]:
    """HF module paths (relative to ``model.layers.{i}.``) of ``target``'s projections."""
    return [name.removesuffix(".weight") for name in base_param_map(target).hf]


def global_parts(target: Target, shapes: mp.Shapes, rows: int):
    """Row structure of the global (TP=1) weight or B of ``target``."""
    return parts_of(target, rows=rows, groups=shapes.groups, per_group=shapes.heads // shapes.groups,
                    head_dim=shapes.head_dim)


def peft_layer_tensors(layer: int, target: Target, a: torch.Tensor, b: torch.Tensor, *, rank: int,
                       shapes: mp.Shapes) -> list[tuple[str, torch.Tensor]]:
    """PEFT tensors of one adapter (global A [n*r, in], B [rows, r]): ``lora_A``/``lora_B`` of each
    HF projection, in HF order; fresh contiguous tensors (safetensors refuses shared storage)."""
    b_parts = mp.split(base_param_map(target), b, shapes)
    a_parts = [a] * len(b_parts) if a.shape[0] == rank else list(a.split(rank, dim=0))
    if len(a_parts) != len(b_parts):
        raise ValueError(f"{target.name}: A has {a.shape[0]} rows, expected {rank} or {rank * len(b_parts)}")
    out = []
    for module, a_p, b_p in zip(_hf_modules(target), a_parts, b_parts):
        name = f"{PEFT_PREFIX}model.layers.{layer}.{module}"
        out += [(f"{name}.lora_A.weight", a_p.clone().contiguous()), (f"{name}.lora_B.weight", b_p.clone().contiguous())]
    return out


def peft_tensors(adapters: dict[str, torch.Tensor], cfg: LoraConfig, *, hf_config: dict,
                 num_layers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Every PEFT tensor of a whole model's global adapters (``adapter_key`` names), layer by layer;
    KeyError names a missing adapter."""
    shapes = mp.shapes_of(hf_config)
    for layer in range(num_layers):
        for target in cfg.targets():
            a, b = adapters[adapter_key(layer, target, "a")], adapters[adapter_key(layer, target, "b")]
            yield from peft_layer_tensors(layer, target, a, b, rank=cfg.rank, shapes=shapes)


def adapter_config(cfg: LoraConfig, *, base_model: str) -> dict:
    """``adapter_config.json`` contents (PEFT's LoraConfig fields) for ``cfg``."""
    alpha = cfg.scale * cfg.rank
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": cfg.rank, "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": cfg.dropout, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
        "target_modules": sorted(hf for target in cfg.targets() for hf in target.hf),
    }


def write_peft_adapter(out_dir: str | Path, tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> Path:
    """Writes a PEFT adapter directory atomically (complete or absent). Tensors go to the host."""
    from safetensors.torch import save_file

    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return Path(out_dir)


@torch.no_grad()
def merge_global(name: str, weight: torch.Tensor, adapters: dict[str, torch.Tensor], cfg: LoraConfig, *,
                 shapes: mp.Shapes) -> torch.Tensor:
    """``weight`` (global Megatron tensor called ``name``, e.g. ``decoder.layers.3.mlp.linear_fc1.weight``)
    with its adapter merged in (a new tensor), or ``weight`` itself when no adapter covers it."""
    if not name.startswith("decoder.layers.") or not name.endswith(".weight"):
        return weight
    layer, path = name.removeprefix("decoder.layers.").removesuffix(".weight").split(".", 1)
    target = next((t for t in cfg.targets() if t.path == path), None)
    if target is None:
        return weight
    a, b = adapters[adapter_key(int(layer), target, "a")], adapters[adapter_key(int(layer), target, "b")]
    parts = global_parts(target, shapes, weight.shape[0])
    return merge_into(weight.detach().clone(), a, b, parts, rank=cfg.rank, scale=cfg.scale)

