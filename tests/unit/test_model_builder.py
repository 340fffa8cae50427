"""HF config -> TransformerConfig mapping and single-process GPTModel builds for every family."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.models.families import FAMILIES as RECORDS
from megatron_gtpo.models.families import family_of
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.train import model as M
from megatron_gtpo.utils.configuration import ConfigError
from tests.tiny_hf import FAMILIES, tiny_hf_config


@pytest.mark.parametrize("family", FAMILIES)
def test_config_mapping(family):
    hf = tiny_hf_config(family)
    cfg = M.transformer_config_from_hf(hf, tp=2, pp=2, vpp=None, dtype=torch.float32)
    assert (cfg.num_layers, cfg.hidden_size, cfg.ffn_hidden_size) == (4, 64, 96)
    assert (cfg.num_attention_heads, cfg.num_query_groups) == (4, 2)
    assert cfg.kv_channels == (32 if family == "qwen3" else 16)
    assert cfg.add_qkv_bias == (family == "qwen2") == RECORDS[family].qkv_bias
    assert cfg.qk_layernorm == (family == "qwen3") == RECORDS[family].qk_norm
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
    assert M.rope_settings(legacy) == {"theta": 500000.0, "type": "llama3", "partial": 1.0, "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192.0}
    with pytest.raises(ConfigError, match="yarn"):
        M.rope_settings({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}})
    assert M.rope_settings(tiny_hf_config("phi3"))["partial"] == 0.5  # transformers 5: inside rope_parameters
    assert M.rope_settings({"partial_rotary_factor": 0.75})["partial"] == 0.75  # older config.json: top level
    with pytest.raises(ConfigError, match="partial_rotary_factor=0 must be in"):
        M.rope_settings({"partial_rotary_factor": 0})


def test_llama3_rope_matches_transformers():
    """The tiny Llama uses original_max_position_embeddings=64, which Megatron's built-in llama3
    scaling (hard-coded 8192) gets wrong; build_model recomputes the inverse frequencies."""
    import transformers
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = tiny_hf_config("llama")
    rope = M.rope_settings(hf)
    emb = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=rope["theta"], rope_scaling=True,
                          rope_scaling_factor=rope["factor"], use_cpu_initialization=True)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](transformers.AutoConfig.for_model(**hf), "cpu")
    assert not torch.allclose(emb.inv_freq, want.float())  # Megatron alone: wrong for this config
    holder = type("Chunk", (), {"rotary_pos_emb": emb})
    M._apply_llama3_rope(holder, rope)
    torch.testing.assert_close(emb.inv_freq, want.float(), rtol=1e-6, atol=0)


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
        family_of({**hf, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ConfigError, match="num_attention_heads=4 is not divisible by TP=3"):
        M.transformer_config_from_hf(hf, tp=3, pp=1, vpp=None, dtype=torch.float32)
    with pytest.raises(ConfigError, match="not divisible by VPP=4"):
        M.transformer_config_from_hf(hf, tp=1, pp=2, vpp=4, dtype=torch.float32)
    with pytest.raises(ConfigError, match="hidden_act"):
        M.transformer_config_from_hf({**hf, "hidden_act": "gelu"}, tp=1, pp=1, vpp=None, dtype=torch.float32)
    with pytest.raises(ConfigError, match="config.json does not exist"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_hf_config(tmp_path)


def test_latest_step_ignores_partial_saves(tmp_path):
    from megatron_gtpo.checkpoint.store import latest_step, step_dir

    assert latest_step(tmp_path / "missing") is None and latest_step(tmp_path) is None
    for step in (3, 12):
        step_dir(tmp_path, step).mkdir()
    (tmp_path / ".tmp_step_00000020").mkdir()
    (tmp_path / "step_junk").mkdir()
    assert latest_step(tmp_path) == 12 and step_dir(tmp_path, 12).name == "step_00000012"


def test_gpu_builds_skip_the_cpu_init_when_weights_are_loaded():
    """GPU: no full unsharded CPU init per rank and no random init of weights that are loaded right
    after; CPU keeps Megatron's TP-size-independent CPU init (the layout tests compare with it)."""
    assert M.init_settings(on_gpu=True, weights_loaded=True) == {"use_cpu_initialization": False,
                                                                 "perform_initialization": False}
    assert M.init_settings(on_gpu=True, weights_loaded=False) == {"use_cpu_initialization": False,
                                                                  "perform_initialization": True}
    for loaded in (True, False):
        assert M.init_settings(on_gpu=False, weights_loaded=loaded) == {"use_cpu_initialization": True,
                                                                        "perform_initialization": True}
    cfg = M.transformer_config_from_hf(tiny_hf_config("llama"), tp=1, pp=1, vpp=None, dtype=torch.float32,
                                       weights_loaded=True)
    assert cfg.use_cpu_initialization is not torch.cuda.is_available()


def test_padded_vocab_size_follows_megatron_lm():
    """Megatron-LM's _vocab_size_with_padding: round up to a multiple of divisible_by x TP."""
    cases = {(257, 1, 128): 384, (257, 2, 128): 512, (257, 4, 128): 512, (128, 2, 128): 256,
             (128, 2, 64): 128, (49152, 8, 128): 49152, (151936, 2, 128): 152064, (128256, 4, 128): 128512,
             (257, 2, 1): 258, (7, 3, 1): 9, (1, 1, 1): 1}
    for (vocab, tp, div), want in cases.items():
        assert M.padded_vocab_size(vocab, tp=tp, divisible_by=div) == want, (vocab, tp, div)
    with pytest.raises(ConfigError, match="make_vocab_size_divisible_by=0 must be an integer >= 1"):
        M.padded_vocab_size(257, tp=2, divisible_by=0)
    # no vocabulary rule in the layout check any more: 257 tokens at TP=2 pass (the dist tests
    # build and load such models: tests/dist/test_convert_dist.py checks the padded row counts)
    M.check_layout(tiny_hf_config("qwen2"), tp=2, pp=2, vpp=None)

