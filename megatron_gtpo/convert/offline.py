"""Offline conversion HF safetensors <-> Megatron torch_dist checkpoint, streamed tensor by tensor.

Megatron checkpoint directory produced by ``hf_to_megatron`` (and read by ``megatron_to_hf``)::

    OUT/config.json, tokenizer*, generation_config.json ...   HF side files, copied verbatim
    OUT/megatron_gtpo.json                                    manifest (format, family, dtype, layout)
    OUT/model/{.metadata, __0_0.distcp, common.pt, metadata.json}   the dist checkpoint

The dist checkpoint is layout-free (global tensors, see ``mcore_ckpt``): ``--tp/--pp/--vpp`` are
validated against config.json and recorded as the intended layout, and Megatron loads the same
files at any layout. ``megatron_to_hf`` also reads training checkpoints (model keys only).

Vocabulary padding: the embedding and output layer are stored with
``padded_vocab_size(vocab_size, tp, make_vocab_size_divisible_by)`` rows (Megatron-LM's convention,
zero padding rows); the manifest and the copied config.json record the true ``vocab_size``, and
``--to hf`` keeps only those rows, so HF -> Megatron -> HF is exact. Megatron-Core marks these two
tensors ``allow_shape_mismatch``, so a model padded for another TP loads the same files (rows
missing from the file are zero-filled, extra stored rows are not read).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.convert.hf_io import HFReader, HFWriter, copy_side_files, torch_dtype_name
from megatron_gtpo.convert.mcore_ckpt import CheckpointReader, Chunk, ObjectItem, write_checkpoint
from megatron_gtpo.models.config import VOCAB_DIVISIBLE_BY
from megatron_gtpo.models.families import Family, check_supported, family_of
from megatron_gtpo.models.hf_config import read_hf_config, tied_embeddings
from megatron_gtpo.train.model import check_layout, padded_vocab_size
from megatron_gtpo.utils.configuration import ConfigError

MANIFEST = "megatron_gtpo.json"
FORMAT = "megatron_gtpo.mcore_torch_dist.v1"
MODEL_SUBDIR = "model"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _expected_shapes(hf_config: dict, family: Family, tied: bool) -> dict[str, list[int]]:
    """HF tensor shapes implied by config.json (checked before any output is written)."""
    shapes = mp.shapes_of(hf_config)
    out = {}
    layers = range(int(hf_config["num_hidden_layers"]))
    maps = [(pm, None) for pm in mp.pre_maps()] + [(pm, layer) for layer in layers for pm in mp.layer_maps(family)]
    for pm, layer in maps + [(pm, None) for pm in mp.post_maps(tied=tied)]:
        hf = mp.hf_shapes(pm, mp.global_shape(pm, shapes), shapes)
        out.update({name: list(shape) for name, shape in zip(mp.hf_names(pm, layer), hf)})
    return out


def _chunk_for(pm: mp.ParamMap, reader: HFReader, names: tuple[str, ...], *, layer: int | None,
               num_layers: int, shapes: mp.Shapes, padded_vocab: int) -> list[tuple[Chunk, object]]:
    """Planned chunks (+ producers) of one Megatron parameter; fc1 is stored as gate and up chunks,
    vocabulary tensors with ``padded_vocab`` rows (zero padding)."""
    dtype = _DTYPES[reader.dtype(names[0])]
    hf_shapes = [reader.shape(n) for n in names]
    stack = () if layer is None else (num_layers,)
    at = () if layer is None else (layer,)
    one = () if layer is None else (1,)

    def read(name):
        return lambda: reader.get(name).to(dtype).reshape(*one, *reader.shape(name))

    if pm.kind == mp.FC1:  # gate rows then up rows, as Megatron's swiglu sharded factory stores them
        rows = sum(s[0] for s in hf_shapes) // 2
        full, half = (*stack, 2 * rows, *hf_shapes[0][1:]), (rows, *hf_shapes[0][1:])
        if pm.fused:  # one [gate; up] tensor: each chunk reads it and keeps its half
            halves = [lambda i=i: reader.get(names[0]).to(dtype).chunk(2, dim=0)[i].reshape(*one, *half)
                      for i in range(2)]
        else:
            halves = [read(name) for name in names]
        return [(Chunk(pm.ckpt_key, full, (*at, i * rows, *[0] * (len(full) - len(at) - 1)),
                       (*one, *half), dtype), halves[i]) for i in range(2)]
    rows = padded_vocab if pm.kind == mp.VOCAB else sum(s[0] for s in hf_shapes)
    full = (*stack, rows, *hf_shapes[0][1:])

    def produce():
        fused = mp.pad_vocab(pm, mp.fuse(pm, [reader.get(n).to(dtype) for n in names], shapes), rows)
        return fused.reshape(*one, *fused.shape)

    return [(Chunk(pm.ckpt_key, full, (*at, *[0] * (len(full) - len(at))), (*one, rows, *hf_shapes[0][1:]),
                   dtype), produce)]


def plan_from_hf(reader: HFReader, hf_config: dict, *, padded_vocab: int) -> tuple[list, list[ObjectItem], int]:
    """(chunks with producers, extra-state objects, total bytes) for one HF checkpoint, the
    vocabulary padded to ``padded_vocab`` rows."""
    family, tied = family_of(hf_config), tied_embeddings(hf_config)
    layers, shapes = int(hf_config["num_hidden_layers"]), mp.shapes_of(hf_config)
    common = dict(num_layers=layers, shapes=shapes, padded_vocab=padded_vocab)
    chunks: list = []
    for pm in mp.pre_maps():
        chunks += _chunk_for(pm, reader, mp.hf_names(pm, None), layer=None, **common)
    objects = []
    for layer in range(layers):
        for pm in mp.layer_maps(family):
            chunks += _chunk_for(pm, reader, mp.hf_names(pm, layer), layer=layer, **common)
        objects += [ObjectItem(f"decoder.layers.{m}._extra_state/shard_{layer}_{layers}", None)
                    for m in mp.EXTRA_STATE_MODULES]
    for pm in mp.post_maps(tied=tied):
        chunks += _chunk_for(pm, reader, mp.hf_names(pm, None), layer=None, **common)
    total = sum(torch.Size(c.sizes).numel() * c.dtype.itemsize for c, _ in chunks)
    return chunks, objects, total


def open_hf(input_dir: Path, *, tp: int, pp: int, vpp: int | None) -> tuple[HFReader, dict]:
    """Validates an HF checkpoint (config, layout, tensor names and shapes) before any write."""
    hf_config = read_hf_config(input_dir)
    family = check_supported(hf_config, source=str(input_dir / "config.json"))
    check_layout(hf_config, tp=tp, pp=pp, vpp=vpp)
    tied = tied_embeddings(hf_config)
    reader = HFReader(input_dir)
    expected = _expected_shapes(hf_config, family, tied)
    reader.require(list(expected), expected)
    # A tied checkpoint may still carry lm_head; old Llama files carry RoPE buffers: both unused.
    extra = sorted(n for n in set(reader.names()) - set(expected) - {"lm_head.weight"}
                   if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise ConfigError(f"{input_dir}: tensor {extra[0]!r} has no Megatron counterpart for {family.name} "
                          f"({len(extra)} unexpected tensors); is config.json the right one?")
    for name in expected:
        if reader.dtype(name) not in _DTYPES:
            raise ConfigError(f"{input_dir / reader.weight_map[name]}: tensor {name!r} has dtype "
                              f"{reader.dtype(name)}; supported: {', '.join(_DTYPES)}")
    return reader, hf_config


def hf_to_megatron(input_dir: Path, output_dir: Path, *, tp: int, pp: int, vpp: int | None,
                   vocab_divisible_by: int = VOCAB_DIVISIBLE_BY) -> dict:
    """Converts into ``output_dir`` (must exist and be empty); returns the manifest written.
    The vocabulary is padded for ``tp`` as Megatron-LM does (``make_vocab_size_divisible_by``)."""
    reader, hf_config = open_hf(input_dir, tp=tp, pp=pp, vpp=vpp)
    vocab = int(hf_config["vocab_size"])
    padded = padded_vocab_size(vocab, tp=tp, divisible_by=vocab_divisible_by)
    chunks, objects, total = plan_from_hf(reader, hf_config, padded_vocab=padded)
    (output_dir / MODEL_SUBDIR).mkdir()
    write_checkpoint(output_dir / MODEL_SUBDIR, chunks=chunks, objects=objects)
    copy_side_files(input_dir, output_dir)
    manifest = {"format": FORMAT, "family": family_of(hf_config).name,
                "dtype": torch_dtype_name(chunks[0][0].dtype), "layout": {"tp": tp, "pp": pp, "vpp": vpp},
                "vocab_size": vocab, "padded_vocab_size": padded,
                "make_vocab_size_divisible_by": vocab_divisible_by, "source": str(input_dir), "bytes": total}
    (output_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def checkpoint_model_dir(directory: Path) -> Path:
    """The dist-checkpoint folder of a converted dir (``model/``) or a training step dir (itself)."""
    for candidate in (directory / MODEL_SUBDIR, directory):
        if (candidate / ".metadata").is_file():
            return candidate
    raise ConfigError(f"{directory} is not a Megatron checkpoint: neither {directory / MODEL_SUBDIR / '.metadata'} "
                      f"nor {directory / '.metadata'} exists")


def validate_checkpoint(ckpt_dir: Path, hf_config: dict) -> None:
    """ConfigError naming the first model key that is missing or whose global shape contradicts
    config.json (checked from the checkpoint metadata before anything is written). Vocabulary
    tensors may carry padding rows beyond ``vocab_size`` (any amount: the padding rule of the
    writer, e.g. Megatron-LM at another TP, is not ours to assume)."""
    family, tied = check_supported(hf_config), tied_embeddings(hf_config)
    layers = int(hf_config["num_hidden_layers"])
    expected = _expected_shapes(hf_config, family, tied)
    reader = CheckpointReader(ckpt_dir)
    for pm in mp.pre_maps() + mp.layer_maps(family) + mp.post_maps(tied=tied):
        is_layer = pm.ckpt_key.startswith("decoder.layers.")
        hf_shapes = [expected[n] for n in mp.hf_names(pm, 0 if is_layer else None)]
        rows = sum(s[0] for s in hf_shapes)
        want = ([layers] if is_layer else []) + [rows] + hf_shapes[0][1:]
        meta = reader.tensor_meta(pm.ckpt_key)
        got = None if meta is None else list(meta.size)
        if pm.kind == mp.VOCAB and got is not None and got[0] >= rows:
            got[0] = rows  # padding rows, stripped on the way out
        if got != want:
            found = "missing" if meta is None else f"shape {list(meta.size)}"
            hint = " (at least; more rows are vocabulary padding)" if pm.kind == mp.VOCAB else ""
            raise ConfigError(f"{ckpt_dir}: checkpoint tensor {pm.ckpt_key!r} is {found}, but config.json "
                              f"({family.name}, {layers} layers, tied={tied}) implies shape {want}{hint}")


def check_manifest(directory: Path, hf_config: dict) -> None:
    """ConfigError when the converted dir's manifest records another ``vocab_size`` than config.json
    (the padding could not be stripped correctly); no manifest (a training checkpoint): nothing to check."""
    file = directory / MANIFEST
    if not file.is_file():
        return
    recorded = json.loads(file.read_text()).get("vocab_size")
    if recorded is not None and int(recorded) != int(hf_config["vocab_size"]):
        raise ConfigError(f"{file} records vocab_size={recorded}, but config.json says {hf_config['vocab_size']}; "
                          "pass the config.json of this checkpoint (--hf-config)")


def iter_hf_tensors(ckpt_dir: Path, hf_config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """HF ``(name, tensor)`` pairs read layer by layer from a torch_dist checkpoint, stored dtype;
    vocabulary padding rows are dropped (config.json's ``vocab_size`` rows are kept)."""
    family, tied = family_of(hf_config), tied_embeddings(hf_config)
    layers, shapes = int(hf_config["num_hidden_layers"]), mp.shapes_of(hf_config)
    vocab = int(hf_config["vocab_size"])
    reader = CheckpointReader(ckpt_dir)

    def emit(pms, layer):
        requests = {}
        for pm in pms:
            meta = reader.tensor_meta(pm.ckpt_key)
            if meta is None:
                raise ConfigError(f"{ckpt_dir}: checkpoint has no tensor {pm.ckpt_key!r}; "
                                  f"does config.json ({family.name}, tied={tied}) belong to it?")
            size = tuple(meta.size)
            if pm.kind == mp.VOCAB:  # read the real rows only: the padding is dropped
                size = (vocab, *size[1:])
            requests[(pm.ckpt_key, (0,) * len(size) if layer is None else (layer,) + (0,) * (len(size) - 1))] = (
                size if layer is None else (1, *size[1:]))
        got = reader.read(requests)
        for pm, tensor in zip(pms, got.values()):
            tensor = tensor if layer is None else tensor[0]
            yield from zip(mp.hf_names(pm, layer), mp.split(pm, tensor, shapes))

    yield from emit(mp.pre_maps(), None)
    for layer in range(layers):
        yield from emit(mp.layer_maps(family), layer)
    yield from emit(mp.post_maps(tied=tied), None)


def megatron_to_hf(input_dir: Path, output_dir: Path, *, config_dir: Path, shard_bytes: int = 5 << 30) -> int:
    """Streams a Megatron checkpoint's model tensors into HF safetensors shards in ``output_dir``
    (which must not exist) and copies config/tokenizer files from ``config_dir``; returns the bytes
    written. ConfigError when the checkpoint and config.json disagree (checked before writing)."""
    hf_config = read_hf_config(config_dir)
    ckpt_dir = checkpoint_model_dir(Path(input_dir))
    check_manifest(Path(input_dir), hf_config)
    validate_checkpoint(ckpt_dir, hf_config)
    writer = HFWriter(Path(output_dir), shard_bytes=shard_bytes)
    for name, tensor in iter_hf_tensors(ckpt_dir, hf_config):
        writer.add(name, tensor)
    writer.close()
    copy_side_files(config_dir, output_dir, exclude=(MANIFEST,))
    return writer.total_bytes
