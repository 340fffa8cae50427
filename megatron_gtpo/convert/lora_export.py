"""Offline export of a LoRA training checkpoint: a merged HF model, or a PEFT adapter.

A LoRA step dir holds the adapters (global TP=1 tensors, stacked over layers under
``decoder.layers.<path>.lora.{a|b}``, fc1's B as Megatron stores its weight: ``[gate; up]``) and,
in common.pt, the LoRA settings and the base's identity (``checkpoint.adapters``). Both exports
read the adapters without building a model and check the base's hash first:

* ``merged_to_hf``: the base's HF tensors streamed one layer at a time (an HF directory, or a
  Megatron one read chunk by chunk), each adapted weight fused into Megatron's layout, merged
  ``W + (alpha / r) B A`` in fp32, rounded once to the base's dtype, split back into HF tensors;
  never more than one layer's weights in memory.
* ``adapter_to_peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` that the ``peft``
  library loads onto the HF base (``PeftModel.from_pretrained``), one LoRA pair per HF projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_gtpo.checkpoint.adapters import check_same_base, identify_base, saved_config, saved_lora
from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.convert.hf_io import HFReader, HFWriter, copy_side_files
from megatron_gtpo.convert.lora_peft import adapter_config, merge_global, peft_tensors, write_peft_adapter
from megatron_gtpo.convert.mcore_ckpt import CheckpointReader
from megatron_gtpo.convert.offline import MANIFEST, checkpoint_model_dir, iter_hf_tensors
from megatron_gtpo.models.families import family_of
from megatron_gtpo.models.hf_config import has_hf_weights, read_hf_config
from megatron_gtpo.train.lora import LoraConfig
from megatron_gtpo.train.lora_layers import adapter_key
from megatron_gtpo.utils.configuration import ConfigError


def lora_checkpoint(step_dir: Path) -> dict | None:
    """The LoRA record of a training step dir (None: not a LoRA checkpoint, or not a step dir)."""
    if not (Path(step_dir) / "common.pt").is_file():
        return None
    return saved_lora(Path(step_dir))


def checked_base(step_dir: Path, record: dict, base: Path | None) -> Path:
    """The base directory of a LoRA step dir (``base``, else the recorded path), its hash checked
    against the record; ConfigError naming ``--base`` when it is missing or another model."""
    directory = Path(base if base is not None else record["base"]["path"])
    if not directory.is_dir():
        raise ConfigError(f"{step_dir} holds LoRA adapters on the base {record['base']['path']}, which does not "
                          f"exist here: pass --base with the base model's directory")
    check_same_base(record, identify_base(directory), source=str(step_dir), field="--base")
    return directory


def read_adapters(step_dir: Path, cfg: LoraConfig, *, num_layers: int) -> dict[str, torch.Tensor]:
    """Every global adapter tensor of a LoRA step dir, ``adapter_key`` names (stored dtype)."""
    reader = CheckpointReader(step_dir)
    out = {}
    for target in cfg.targets():
        for which in ("a", "b"):
            key = f"decoder.layers.{target.path}.lora.{which}"
            meta = reader.tensor_meta(key)
            if meta is None or meta.size[0] != num_layers:
                raise ConfigError(f"{step_dir}: checkpoint tensor {key!r} is "
                                  f"{'missing' if meta is None else f'of shape {list(meta.size)}'}; expected "
                                  f"{num_layers} layers of {target.name} adapters (does --base match it?)")
            stacked = reader.read({(key, (0,) * len(meta.size)): tuple(meta.size)})[(key, (0,) * len(meta.size))]
            out.update({adapter_key(layer, target, which): stacked[layer] for layer in range(num_layers)})
    return out


def _base_hf_tensors(base: Path, hf_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The base's HF tensors, one at a time (an HF directory, or a Megatron dir read chunk by chunk)."""
    if has_hf_weights(base):
        reader = HFReader(base)
        for name in reader.names():
            yield name, reader.get(name)
    else:
        yield from iter_hf_tensors(checkpoint_model_dir(base), hf_config)


def merged_tensors(tensors: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor], cfg: LoraConfig,
                   *, hf_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` (HF names) with every adapted weight merged: an adapted layer's HF tensors are
    held until all of its pieces (q, k, v; gate, up) have come, then fused, merged in fp32 and split."""
    shapes, family = mp.shapes_of(hf_config), family_of(hf_config)
    paths = {f"{t.path}.weight" for t in cfg.targets()}
    owners = {name: (pm, layer) for layer in range(int(hf_config["num_hidden_layers"]))
              for pm in mp.layer_maps(family) if pm.local in paths for name in mp.hf_names(pm, layer)}
    pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        if name not in owners:
            yield name, tensor
            continue
        pm, layer = owners[name]
        group = pending.setdefault((pm.local, layer), {})
        group[name] = tensor
        names = mp.hf_names(pm, layer)
        if len(group) < len(names):
            continue
        del pending[(pm.local, layer)]
        fused = mp.fuse(pm, [group[n] for n in names], shapes)
        merged = merge_global(f"decoder.layers.{layer}.{pm.local}", fused.float(), adapters, cfg, shapes=shapes)
        yield from zip(names, (t.to(fused.dtype) for t in mp.split(pm, merged, shapes)))
    if pending:
        raise ConfigError(f"the base lacks pieces of the adapted weights {sorted(pending)[:3]}")


def merged_to_hf(step_dir: Path, output_dir: Path, *, base: Path | None = None, shard_bytes: int = 5 << 30) -> int:
    """Writes the merged HF model of a LoRA step dir into ``output_dir`` (must not exist): the
    base's tensors with the adapters merged, the base's config and tokenizer files. Returns the bytes."""
    record = _record(step_dir)
    base = checked_base(step_dir, record, base)
    hf_config, cfg = read_hf_config(base), saved_config(record)
    adapters = read_adapters(step_dir, cfg, num_layers=int(hf_config["num_hidden_layers"]))
    writer = HFWriter(output_dir, shard_bytes=shard_bytes)
    for name, tensor in merged_tensors(_base_hf_tensors(base, hf_config), adapters, cfg, hf_config=hf_config):
        writer.add(name, tensor)
    writer.close()
    copy_side_files(base, output_dir, exclude=(MANIFEST,))
    return writer.total_bytes


def adapter_to_peft(step_dir: Path, output_dir: Path, *, base: Path | None = None) -> int:
    """Writes the PEFT adapter of a LoRA step dir into ``output_dir`` (must not exist); returns the bytes."""
    record = _record(step_dir)
    base = checked_base(step_dir, record, base)
    hf_config, cfg = read_hf_config(base), saved_config(record)
    fused = [pm.local for pm in mp.layer_maps(family_of(hf_config)) if pm.fused]
    if fused:
        raise ConfigError(f"{base}: {family_of(hf_config).name} fuses {', '.join(fused)} into one HF module each, so "
                          "a PEFT adapter per HF projection (q_proj, k_proj, ...) does not apply to it; export the "
                          "merged model with --to hf instead")
    layers = int(hf_config["num_hidden_layers"])
    tensors = list(peft_tensors(read_adapters(step_dir, cfg, num_layers=layers), cfg, hf_config=hf_config,
                                num_layers=layers))
    write_peft_adapter(output_dir, tensors, adapter_config(cfg, base_model=str(base)))
    return sum(t.numel() * t.element_size() for _, t in tensors)


def _record(step_dir: Path) -> dict:
    record = lora_checkpoint(step_dir)
    if record is None:
        raise ConfigError(f"--input {step_dir} is not a LoRA training checkpoint (a step dir whose common.pt records "
                          "model.lora); --to peft exports the adapters of one")
    return record
