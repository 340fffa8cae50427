"""Offline conversion (no process group): mapping algebra, CLI round trips, dtype, bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_gtpo.convert import hf_io
from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.cli.convert import main
from megatron_gtpo.models.families import FAMILIES as RECORDS
from tests.helpers import REPO
from tests.tiny_hf import FAMILIES, save_tiny_hf_model, tiny_hf_config


# ----------------------------------------------------------------------------- mapping algebra

def layer(family: str) -> dict[str, mp.ParamMap]:
    return {p.local: p for p in mp.layer_maps(RECORDS[family])}


@pytest.mark.parametrize("heads,groups,head_dim", [(4, 2, 16), (8, 8, 4), (9, 3, 8), (6, 1, 2)])
def test_qkv_fuse_split_and_tp_slicing(heads, groups, head_dim):
    pm = layer("qwen2")["self_attention.linear_qkv.weight"]
    shapes = mp.Shapes(heads=heads, groups=groups, head_dim=head_dim)
    q, k, v = (torch.randn(n * head_dim, 7) for n in (heads, groups, groups))
    fused = mp.fuse(pm, [q, k, v], shapes)
    # Group g of the fused layout holds its q heads, then its k head, then its v head.
    per = heads // groups
    block = fused.view(groups, (per + 2) * head_dim, 7)
    assert torch.equal(block[-1, :per * head_dim], q[-per * head_dim:])
    assert torch.equal(block[0, per * head_dim:(per + 1) * head_dim], k[:head_dim])
    assert all(torch.equal(a, b) for a, b in zip(mp.split(pm, fused, shapes), (q, k, v)))
    for tp in (t for t in (1, 2, 3) if groups % t == 0):
        shards = [mp.tp_shard(pm, fused, tp=tp, rank=r) for r in range(tp)]
        assert torch.equal(mp.tp_unshard(pm, shards), fused)
        # A TP rank holds whole groups: its q rows are exactly the q heads of its groups.
        local = mp.split(pm, shards[-1], mp.Shapes(heads=heads // tp, groups=groups // tp, head_dim=head_dim))
        assert torch.equal(local[0], q.chunk(tp)[-1]) and torch.equal(local[2], v.chunk(tp)[-1])


def test_fc1_and_parallel_linear_slicing():
    fc1, fc2 = layer("llama")["mlp.linear_fc1.weight"], layer("llama")["mlp.linear_fc2.weight"]
    gate, up = torch.randn(12, 5), torch.randn(12, 5)
    fused = mp.fuse(fc1, [gate, up], None)
    shard1 = mp.tp_shard(fc1, fused, tp=2, rank=1)
    assert torch.equal(shard1, torch.cat([gate[6:], up[6:]]))  # [its gate rows ; its up rows]
    assert torch.equal(mp.tp_unshard(fc1, [mp.tp_shard(fc1, fused, tp=2, rank=r) for r in (0, 1)]), fused)
    down = torch.randn(5, 12)
    assert torch.equal(mp.tp_shard(fc2, down, tp=3, rank=2), down[:, 8:])
    assert set(layer("qwen3")) - set(layer("llama")) == {
        "self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"}
    assert [n for pm in mp.post_maps(tied=True) for n in mp.hf_names(pm, None)] == ["model.norm.weight"]


def test_phi3_fused_tensors_are_the_pieces_concatenated():
    """Phi-3 stores q/k/v as one qkv_proj = [all q; all k; all v] and gate/up as one gate_up_proj =
    [gate; up]: fusing either layout gives the same Megatron tensor, and split gives each back."""
    shapes = mp.Shapes(heads=4, groups=2, head_dim=16)
    phi3, llama = layer("phi3"), layer("llama")
    assert phi3["self_attention.linear_qkv.weight"].hf == ("self_attn.qkv_proj.weight",)
    assert phi3["mlp.linear_fc1.weight"].hf == ("mlp.gate_up_proj.weight",)
    q, k, v = (torch.randn(n * 16, 7) for n in (4, 2, 2))
    separate = mp.fuse(llama["self_attention.linear_qkv.weight"], [q, k, v], shapes)
    fused = mp.fuse(phi3["self_attention.linear_qkv.weight"], [torch.cat([q, k, v])], shapes)
    assert torch.equal(fused, separate) and not torch.equal(fused, torch.cat([q, k, v]))  # regrouped per KV group
    (back,) = mp.split(phi3["self_attention.linear_qkv.weight"], fused, shapes)
    assert torch.equal(back, torch.cat([q, k, v]))
    gate_up = torch.randn(24, 7)
    assert torch.equal(mp.fuse(phi3["mlp.linear_fc1.weight"], [gate_up], shapes),
                       mp.fuse(llama["mlp.linear_fc1.weight"], list(gate_up.chunk(2)), shapes))
    assert mp.hf_shapes(phi3["self_attention.linear_qkv.weight"], (128, 64), shapes) == [(128, 64)]
    assert mp.hf_shapes(llama["self_attention.linear_qkv.weight"], (128, 64), shapes) == [(64, 64), (32, 64),
                                                                                          (32, 64)]


def test_vocab_padding_and_stripping():
    emb = next(p for p in mp.pre_maps() if p.kind == mp.VOCAB)
    norm = mp.post_maps(tied=True)[0]
    x = torch.randn(257, 8)
    padded = mp.pad_vocab(emb, x, 512)
    assert padded.shape == (512, 8) and torch.equal(padded[:257], x) and not padded[257:].any()
    assert torch.equal(mp.strip_vocab(emb, padded, 257), x)
    assert mp.pad_vocab(norm, x, 512) is x and mp.strip_vocab(norm, x, 3) is x  # only vocabulary tensors
    with pytest.raises(ValueError, match="do not fit in 256 padded rows"):
        mp.pad_vocab(emb, x, 256)


# ----------------------------------------------------------------------------- CLI round trips

def _convert(*args) -> int:
    return main([str(a) for a in args])


def _same(ref_dir, got_dir):
    ref, got = hf_io.HFReader(ref_dir), hf_io.HFReader(got_dir)
    assert sorted(ref.names()) == sorted(got.names())
    for name in ref.names():
        a, b = ref.get(name), got.get(name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("family", FAMILIES)
def test_roundtrip_each_family(tmp_path, family, capsys):
    hf = save_tiny_hf_model(family, tmp_path / "hf", max_shard_size="120KB" if family == "qwen3" else None)
    assert _convert("--to", "megatron", "--input", hf, "--output", tmp_path / "mc", "--tp", "2", "--pp", "2") == 0
    stats = json.loads(capsys.readouterr().out.split("stats: ")[1])
    assert stats["mb"] > 0.4 and stats["peak_rss_mb"] > 0 and stats["mb_per_s"] > 0
    manifest = json.loads((tmp_path / "mc" / "megatron_gtpo.json").read_text())
    assert manifest["family"] == family and manifest["layout"] == {"tp": 2, "pp": 2, "vpp": None}
    # vocabulary 257 at TP=2: Megatron-LM pads to a multiple of 128 x 2 with zero rows
    assert (manifest["vocab_size"], manifest["padded_vocab_size"], manifest["make_vocab_size_divisible_by"]) == (
        257, 512, 128)
    _assert_padded_rows(tmp_path / "mc" / "model", hf, rows=512, tied=family == "llama")
    assert (tmp_path / "mc" / "config.json").is_file() and (tmp_path / "mc" / "model" / ".metadata").is_file()
    assert _convert("--to", "hf", "--input", tmp_path / "mc", "--output", tmp_path / "back",
                    "--max-shard-mb", "0.2") == 0
    _same(hf, tmp_path / "back")
    assert (tmp_path / "back" / hf_io.INDEX_NAME).is_file()  # several shards + index
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())
    assert not (tmp_path / "back" / "megatron_gtpo.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "mc"]  # no temp dirs left


def _assert_padded_rows(ckpt_dir, hf_dir, *, rows: int, tied: bool) -> None:
    """The checkpoint's vocabulary tensors: ``rows`` rows, the HF rows first, zero padding after."""
    from megatron_gtpo.convert.mcore_ckpt import CheckpointReader

    reader, hf = CheckpointReader(ckpt_dir), hf_io.HFReader(hf_dir)
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight")]
    pairs += [] if tied else [("output_layer.weight", "lm_head.weight")]
    for key, hf_name in pairs:
        size = tuple(reader.tensor_meta(key).size)
        assert size[0] == rows, (key, size)
        (stored,) = reader.read({(key, (0, 0)): size}).values()
        vocab = hf.shape(hf_name)[0]
        assert torch.equal(stored[:vocab], hf.get(hf_name)) and not stored[vocab:].any(), key


def test_vocab_divisor_option_and_manifest_check(tmp_path, capsys):
    hf = save_tiny_hf_model("mistral", tmp_path / "hf")
    assert _convert("--to", "megatron", "--input", hf, "--output", tmp_path / "mc", "--tp", "2",
                    "--make-vocab-size-divisible-by", "1") == 0
    assert json.loads((tmp_path / "mc" / "megatron_gtpo.json").read_text())["padded_vocab_size"] == 258
    _assert_padded_rows(tmp_path / "mc" / "model", hf, rows=258, tied=False)
    assert _convert("--to", "hf", "--input", tmp_path / "mc", "--output", tmp_path / "back") == 0
    _same(hf, tmp_path / "back")
    capsys.readouterr()
    other = tmp_path / "other"  # a config.json that disagrees with the recorded true vocabulary
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**tiny_hf_config("mistral"), "vocab_size": 250}))
    _fails(tmp_path, capsys, "--to", "hf", "--input", tmp_path / "mc", "--hf-config", other,
           expect="records vocab_size=257, but config.json says 250")
    (other / "config.json").write_text(json.dumps({**tiny_hf_config("mistral"), "vocab_size": 300}))
    (tmp_path / "mc" / "megatron_gtpo.json").unlink()  # e.g. a training checkpoint: no manifest
    _fails(tmp_path, capsys, "--to", "hf", "--input", tmp_path / "mc", "--hf-config", other,
           expect="'embedding.word_embeddings.weight' is shape [258, 64], but config.json")
    _fails(tmp_path, capsys, "--to", "megatron", "--input", hf, "--make-vocab-size-divisible-by", "0",
           expect="--make-vocab-size-divisible-by=0 must be >= 1")


def test_bf16_is_kept(tmp_path):
    hf = save_tiny_hf_model("qwen2", tmp_path / "hf", dtype=torch.bfloat16)
    assert _convert("--to", "megatron", "--input", hf, "--output", tmp_path / "mc") == 0
    assert json.loads((tmp_path / "mc" / "megatron_gtpo.json").read_text())["dtype"] == "bfloat16"
    assert _convert("--to", "hf", "--input", tmp_path / "mc", "--output", tmp_path / "back") == 0
    _same(hf, tmp_path / "back")
    assert hf_io.HFReader(tmp_path / "back").get("model.embed_tokens.weight").dtype == torch.bfloat16


def test_help_through_the_wrapper():
    env = {**os.environ, "MEGATRON_GTPO_PYTHON": sys.executable}
    proc = subprocess.run([str(REPO / "tools" / "convert_hf_checkpoint"), "--help"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and "--to {megatron,hf}" in proc.stdout and "--tp" in proc.stdout


# ----------------------------------------------------------------------------- bad input

def _fails(tmp_path, capsys, *args, expect: str):
    out = tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    assert _convert(*args, "--output", out) == 2
    err = capsys.readouterr().err
    assert expect in err, err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp dir left behind
    return err


@pytest.fixture()
def sharded(tmp_path):
    return save_tiny_hf_model("qwen2", tmp_path / "hf", max_shard_size="150KB")


def test_missing_shard(tmp_path, capsys, sharded):
    index = json.loads((sharded / hf_io.INDEX_NAME).read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (sharded / victim).unlink()
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, expect=f"shard {sharded / victim}")


def test_corrupt_index(tmp_path, capsys, sharded):
    (sharded / hf_io.INDEX_NAME).write_text('{"weight_map": ')
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, expect=f"{sharded / hf_io.INDEX_NAME} is corrupt")


def test_truncated_shard(tmp_path, capsys, sharded):
    victim = sorted(sharded.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, expect=f"shard {victim}")


def test_heads_not_divisible_by_tp(tmp_path, capsys, sharded):
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, "--tp", "3",
           expect="num_attention_heads=4 is not divisible by TP=3")


def test_unknown_architecture(tmp_path, capsys, sharded):
    config = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, expect="'architectures'=['GPT2LMHeadModel']")


def test_shape_contradicts_config(tmp_path, capsys, sharded):
    config = json.loads((sharded / "config.json").read_text())
    (sharded / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    _fails(tmp_path, capsys, "--to", "megatron", "--input", sharded, expect="mlp.gate_proj.weight' has shape [96, 64]")


def test_existing_output(tmp_path, capsys, sharded):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert _convert("--to", "megatron", "--input", sharded, "--output", tmp_path / "out") == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_megatron_dir_with_wrong_config(tmp_path, capsys, sharded):
    assert _convert("--to", "megatron", "--input", sharded, "--output", tmp_path / "mc") == 0
    capsys.readouterr()
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(tiny_hf_config("qwen3")))
    _fails(tmp_path, capsys, "--to", "hf", "--input", tmp_path / "mc", "--hf-config", other,
           expect="linear_qkv.weight' is shape [4, 128, 64], but config.json (qwen3")
    _fails(tmp_path, capsys, "--to", "hf", "--input", sharded, expect="is not a Megatron checkpoint")


def test_failure_midway_leaves_nothing(tmp_path, sharded, monkeypatch):
    calls = {"n": 0}
    original = hf_io.HFReader.get

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == 10:
            raise OSError("disk went away")
        return original(self, name)

    monkeypatch.setattr(hf_io.HFReader, "get", flaky)
    with pytest.raises(OSError, match="disk went away"):
        _convert("--to", "megatron", "--input", sharded, "--output", tmp_path / "out")
    assert calls["n"] == 10 and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_streaming_safetensors_writer(tmp_path):
    """HFWriter's hand-written files read back with the safetensors library, every dtype, in
    shards of the requested size (one oversized tensor alone), with a matching index."""
    from safetensors import safe_open

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}.{str(dt)[6:]}": (torch.randn(5, 3 + i, generator=gen) * 50).to(dt)
               for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64])}
    tensors["big"] = torch.randn(40, 40, generator=gen)
    tensors["scalar"] = torch.tensor(3.5)
    writer = hf_io.HFWriter(tmp_path, shard_bytes=300)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    index = json.loads((tmp_path / hf_io.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(tensors) and index["metadata"]["total_size"] == writer.total_bytes
    assert len(set(index["weight_map"].values())) >= 4 and not list(tmp_path.glob("*.body"))
    for name, tensor in tensors.items():
        with safe_open(tmp_path / index["weight_map"][name], framework="pt") as handle:
            got = handle.get_tensor(name)
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
    single = hf_io.HFWriter(tmp_path / "one")
    single.add("x", tensors["big"])
    single.close()
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["model.safetensors"]
