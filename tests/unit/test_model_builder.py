"""HF config -> TransformerConfig mapping and single-process GPTModel builds for every family."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.train import model as M
from megatron_gtpo.utils.configuration import ConfigError
from tests.tiny_hf import FAMILIES, make_tiny_hf_model, tiny_hf_config


@pytest.mark.parametrize("family", FAMILIES)
def test_config_mapping(family):
    hf = tiny_hf_config(family)
    cfg = M.transformer_config_from_hf(hf, tp=2, pp=2, vpp=None, dtype=torch.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_query_groups) == (4, 2)
    assert cfg.kv_channels == (32 if family == "qwen3" else 16)
    assert cfg.add_qkv_bias == (family == "qwen2")
    assert cfg.qk_layernorm == (family == "qwen3")
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and not cfg.add_bias_linear
    assert cfg.layernorm_epsilon == 1e-5
    assert cfg.tensor_model_parallel_size == 2 and cfg.pipeline_model_parallel_size == 2
    assert cfg.use_cpu_initialization and cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    assert not (cfg.masked_softmax_fusion or cfg.apply_rope_fusion or cfg.gradient_accumulation_fusion)


def test_rope_and_tied_settings():
    llama = tiny_hf_config("llama")
    assert M.tied_embeddings(llama) and not M.tied_embeddings(tiny_hf_config("qwen2"))
    rope = M.rope_settings(llama)
    assert rope["type"] == "llama3" and rope["original_max_position_embeddings"] == 64.0
    legacy = {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}
    assert M.rope_settings(legacy) == {"theta": 500000.0, "type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192.0}
    with pytest.raises(ConfigError, match="yarn"):
        M.rope_settings({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})


def test_bf16_and_overrides():
    hf = tiny_hf_config("qwen3")
    cfg = M.transformer_config_from_hf(hf, tp=1, pp=1, vpp=None, dtype=torch.bfloat16,
                                       overrides={"recompute_granularity": "full", "recompute_method": "uniform",
                                                  "recompute_num_layers": 1})
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and cfg.recompute_granularity == "full"
    with pytest.raises(ConfigError, match="not_a_field"):
        M.transformer_config_from_hf(hf, tp=1, pp=1, vpp=None, dtype=torch.float32, overrides={"not_a_field": 1})
    with pytest.raises(ConfigError, match="TransformerConfig rejected"):
        M.transformer_config_from_hf(hf, tp=1, pp=1, vpp=None, dtype=torch.float32,
                                     overrides={"recompute_granularity": "bogus"})


def test_bad_configs_name_the_field(tmp_path):
    hf = tiny_hf_config("llama")
    with pytest.raises(ConfigError, match="'architectures'"):
        M.architecture_of({**hf, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by tp=3"):
        M.transformer_config_from_hf(hf, tp=3, pp=1, vpp=None, dtype=torch.float32)
    with pytest.raises(ConfigError, match="num_hidden_layers=4 is not divisible by pp\\*vpp=8"):
        M.transformer_config_from_hf(hf, tp=1, pp=2, vpp=4, dtype=torch.float32)
    with pytest.raises(ConfigError, match="hidden_act"):
        M.transformer_config_from_hf({**hf, "hidden_act": "gelu"}, tp=1, pp=1, vpp=None, dtype=torch.float32)
    with pytest.raises(ConfigError, match="config.json does not exist"):
        M.hf_config_from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        M.hf_config_from_dir(tmp_path)


@pytest.fixture()
def single_rank():
    from megatron_gtpo.parallel.dims import destroy, init_distributed

    yield init_distributed(tp=1, pp=1, seed=1)
    destroy()


def test_build_each_family_tp1(single_rank):
    """Parameter count equals the HF model's (tied lm_head counted once) and forward gives
    [batch, seq, vocab] fp32 logits; bf16 chunks are Float16Module-wrapped."""
    from megatron.core.transformer.module import Float16Module

    tokens = torch.randint(0, 128, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    for family in FAMILIES:
        hf_cfg = tiny_hf_config(family)
        chunks = M.build_model(hf_cfg, dims=single_rank, dtype=torch.float32)
        assert len(chunks) == 1 and M.layer_offset(chunks[0]) == 0
        n_mcore = sum(p.numel() for p in chunks[0].parameters())
        n_hf = sum(p.numel() for p in make_tiny_hf_model(family).parameters())
        assert n_mcore == n_hf, family
        with torch.no_grad():
            logits = chunks[0](tokens, positions, M.causal_mask(8))
        assert logits.shape == (2, 8, 128) and torch.isfinite(logits).all()
    bf16 = M.build_model(tiny_hf_config("qwen2"), dims=single_rank, dtype=torch.bfloat16)[0]
    assert isinstance(bf16, Float16Module) and M.unwrap(bf16).decoder is not None
    with torch.no_grad():
        assert bf16(tokens, positions, M.causal_mask(8)).shape == (2, 8, 128)
