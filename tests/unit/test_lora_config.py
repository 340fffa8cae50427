"""``model.lora``: validation, the target table against the HF<->Megatron mapping, rank checks
against the model's shape, adapter counts, and the layer hook's handling of every return shape."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.train import lora_layers as L
from megatron_gtpo.train.lora import TARGETS, LoraConfig, adapter_params, check_rank_fits
from megatron_gtpo.utils.configuration import ConfigError, build
from tests.tiny_hf import tiny_hf_config


def test_lora_is_off_by_default_and_turned_on_by_rank():
    assert not ModelConfig().lora.enabled
    cfg = build(ModelConfig, {"lora": {"rank": 8}}, "model").lora
    assert cfg.enabled and cfg.scale == 1.0  # alpha defaults to rank (the paper's 128 / 128)
    assert [t.name for t in cfg.targets()] == ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
    assert LoraConfig(rank=8, alpha=32).scale == 4.0


def test_lora_targets_by_hf_name_and_errors():
    hf_names = ["q_proj", "k_proj", "v_proj", "down_proj"]
    assert [t.name for t in LoraConfig(rank=4, target_modules=hf_names).targets()] == ["linear_qkv", "linear_fc2"]
    with pytest.raises(ConfigError, match=r"model\.lora\.target_modules: unknown module\(s\) 'qkv'; valid names: "
                                          r"linear_qkv, linear_proj, linear_fc1, linear_fc2, q_proj, k_proj"):
        build(ModelConfig, {"lora": {"rank": 4, "target_modules": ["qkv"]}}, "model")
    with pytest.raises(ConfigError, match="lists q_proj, v_proj without k_proj.*linear_qkv"):
        LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="lists gate_proj without up_proj"):
        LoraConfig(rank=4, target_modules=["gate_proj", "linear_qkv"])
    for bad in ({"rank": -1}, {"rank": 4, "alpha": 0}, {"rank": 4, "dropout": 1.0}, {"rank": 4, "target_modules": []}):
        with pytest.raises(ConfigError):
            LoraConfig(**bad)


def test_lora_target_table_matches_the_weight_mapping():
    """The HF projections each target covers are exactly the HF tensors of its base weight."""
    for target in TARGETS:
        pm = L.base_param_map(target)
        assert pm.hf == tuple(f"{target.hf_parent}.{hf}.weight" for hf in target.hf), target
        assert (pm.kind == mp.ROW) == (target.parallel == "row"), target


def test_lora_rank_larger_than_a_layer_is_refused_before_anything_starts():
    shape = shape_from_hf_config(tiny_hf_config("qwen2"), name="tiny-qwen2")  # k/v: 2 heads x 16 = 32 rows
    check_rank_fits(LoraConfig(rank=32), shape)
    with pytest.raises(ConfigError, match=r"rank=33 exceeds the smallest dimension of linear_qkv \(k_proj: 32 x 64\) "
                                          r"of tiny-qwen2; use rank <= 32"):
        check_rank_fits(LoraConfig(rank=33), shape)
    check_rank_fits(LoraConfig(rank=64, target_modules=["linear_fc1", "linear_fc2"]), shape)  # 96 x 64 fits
    with pytest.raises(ConfigError, match=r"linear_fc2 \(down_proj: 64 x 96\)"):
        check_rank_fits(LoraConfig(rank=65, target_modules=["linear_fc2"]), shape)


@pytest.mark.parametrize("share_a", [False, True])
def test_lora_adapter_counts_equal_the_built_model(share_a):
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train.model import build_model

    hf = tiny_hf_config("qwen3")  # head_dim 32: q width 128 != hidden 64
    cfg = LoraConfig(rank=4, share_a=share_a)
    chunks = build_model(hf, dims=init_distributed(tp=1, seed=0))
    assert L.apply_lora(chunks, cfg, seed=0) == 16
    built = sum(p.numel() for p in L.adapter_parameters(chunks))
    assert built == adapter_params(cfg, shape_from_hf_config(hf, name="q3"))
    assert all(not p.requires_grad for n, p in chunks[0].named_parameters() if not L.is_adapter_name(n))
    q, kv, h, f = 128, 64, 64, 96
    a = 4 * h * (1 if share_a else 3) + 4 * q + 4 * h * (1 if share_a else 2) + 4 * f
    assert built == 4 * (a + 4 * (q + 2 * kv) + 4 * h + 4 * 2 * f + 4 * h)
    assert adapter_params(cfg, shape_from_hf_config(hf, name="q3"), tp=2) < built
    with pytest.raises(ValueError, match="cannot attach LoRA"):
        L.apply_lora(chunks, cfg, seed=0)  # a second adapter on the same layer


def test_lora_dropout_acts_in_training_only():
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train.model import build_model, causal_mask

    chunks = build_model(tiny_hf_config("qwen2"), dims=init_distributed(tp=1, seed=0))
    L.apply_lora(chunks, LoraConfig(rank=4, dropout=0.5), seed=0)
    for _, adapter, _ in L.adapters(chunks):
        torch.nn.init.normal_(adapter.b, std=0.1)
    model, ids = chunks[0], torch.randint(0, 200, (2, 8))

    def run(train: bool):
        model.train(train)
        with torch.no_grad():
            return model(ids, torch.arange(8).expand(2, 8), causal_mask(8))

    assert torch.equal(run(False), run(False)) and not torch.equal(run(True), run(True))
    with L.lora_disabled(chunks):
        assert torch.equal(run(True), run(False))  # only the adapters' inputs are dropped


def test_lora_hook_unpacks_every_linear_return_shape():
    """Local and TE linears return (out, bias); TE's LayerNormLinear with return_layernorm_output
    ((out, ln_out), None) or (out, bias, ln_out): the adapter must see ln_out there, x otherwise."""
    class Adapter:
        enabled = True

        def __call__(self, x):
            return 10 * x

    layer = SimpleNamespace(lora=Adapter())
    x, out, ln, bias = torch.ones(2), torch.zeros(2), torch.full((2,), 2.0), torch.full((2,), 7.0)
    for output, seen, want_bias in (((out, bias), x, bias), (((out, ln), None), ln, None), ((out, bias, ln), ln, bias)):
        got, got_bias = L._lora_hook(layer, (x,), output)
        assert torch.equal(got, 10 * seen) and got_bias is want_bias
