"""Model families as records (models/families.py): one key rule, one refusal check shared by every
reader of config.json, and mapping rows that name exactly the tensors of transformers' own models."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.convert.offline import _expected_shapes
from megatron_gtpo.models.families import FAMILIES, check_supported, family_of
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.train import model as M
from megatron_gtpo.utils.configuration import ConfigError
from tests.tiny_hf import FAMILIES as TINY, tiny_hf_config


def test_every_family_has_a_tiny_model_and_its_record():
    assert set(TINY) == set(FAMILIES)
    for name in TINY:
        assert family_of(tiny_hf_config(name)) is FAMILIES[name]


def test_one_key_rule_architectures_first_then_model_type():
    qwen2 = FAMILIES["qwen2"]
    assert family_of({"architectures": ["Qwen2ForCausalLM"]}) is qwen2
    assert family_of({"model_type": "qwen2"}) is qwen2  # no architectures: model_type names it
    with pytest.raises(ConfigError, match="is the qwen2 family, whose model_type is 'qwen2', but model_type='llama'"):
        family_of({"architectures": ["Qwen2ForCausalLM"], "model_type": "llama"})
    with pytest.raises(ConfigError, match="'architectures'=\\['GPT2LMHeadModel'\\] is not supported"):
        family_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="exactly one of"):
        family_of({"architectures": ["LlamaForCausalLM", "Qwen2ForCausalLM"]})


@pytest.mark.parametrize("family,patch,match", [
    ("llama", {"attention_bias": True}, "'attention_bias'=true is not supported for llama"),
    ("qwen3", {"attention_bias": True}, "'attention_bias'=true is not supported for qwen3"),
    ("mistral", {"mlp_bias": True}, "'mlp_bias'=true is not supported for mistral"),
    ("phi3", {"hidden_act": "gelu_new"}, "hidden_act"),
    ("qwen2", {"num_experts": 8}, "mixture-of-experts"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
])
def test_builder_and_shape_reader_refuse_the_same_configs(family, patch, match):
    """The dry-run's shape reader and the model builder read the family and its refusals through
    the same check (the shape reader once accepted attention_bias that the builder rejected)."""
    raw = {**tiny_hf_config(family), **patch}
    for read in (lambda: shape_from_hf_config(raw, name="x"),
                 lambda: M.transformer_config_from_hf(raw, tp=1, pp=1, vpp=None, dtype=torch.float32),
                 lambda: check_supported(raw)):
        with pytest.raises(ConfigError, match=match):
            read()


def test_qwen2_accepts_attention_bias_as_transformers_does():
    """transformers' Qwen2 always has q/k/v biases and ignores an attention_bias key: so do both readers."""
    raw = {**tiny_hf_config("qwen2"), "attention_bias": True}
    assert shape_from_hf_config(raw, name="x").qkv_bias
    assert M.transformer_config_from_hf(raw, tp=1, pp=1, vpp=None, dtype=torch.float32).add_qkv_bias


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_mapping_rows_name_transformers_tensors_with_their_shapes(family):
    """Every HF tensor the mapping expects (names from the record, shapes from the Megatron layout)
    is a parameter of transformers' own model of that family, with that shape, and nothing is left
    out (a tied lm_head is the embedding)."""
    import transformers

    raw = tiny_hf_config(family)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    want = {name: list(p.shape) for name, p in model.named_parameters()}
    assert _expected_shapes(raw, FAMILIES[family], M.tied_embeddings(raw)) == want
