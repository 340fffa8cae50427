"""LoRA in one process against Hugging Face: the Megatron model with adapters equals the HF model
with the merged weights ``W + (alpha/r) B A``, and the exported PEFT adapter, loaded by the real
``peft`` library onto the HF base, gives the merged model's logits (fp32, 1e-6) and merges to the
same weights. Also: the adapters start at zero effect, and ``lora_disabled`` is the base model."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gtpo.convert import lora_peft as P
from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.convert.hf_io import HFReader
from megatron_gtpo.convert.load import load_hf_weights
from megatron_gtpo.models.families import family_of
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.train import lora_layers as L
from megatron_gtpo.train.lora import LoraConfig
from megatron_gtpo.train.model import build_model, causal_mask
from tests.tiny_hf import VOCAB_SIZE, save_tiny_hf_model

peft = pytest.importorskip("peft")  # pinned in the test extra (pyproject.toml)
SEQ = 12


def megatron_logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(SEQ).expand(ids.shape[0], SEQ), causal_mask(SEQ))[..., :VOCAB_SIZE]


def merged_hf_state(hf_dir, hf_config, adapters, cfg) -> dict:
    """The HF checkpoint with every adapted weight merged (fused to Megatron's layout, merged, split)."""
    reader, shapes, family = HFReader(hf_dir), mp.shapes_of(hf_config), family_of(hf_config)
    state = {}
    for layer in range(hf_config["num_hidden_layers"]):
        for pm in mp.layer_maps(family):
            names = mp.hf_names(pm, layer)
            fused = mp.fuse(pm, [reader.get(n) for n in names], shapes)
            merged = P.merge_global(f"decoder.layers.{layer}.{pm.local}", fused, adapters, cfg, shapes=shapes)
            state.update(zip(names, mp.split(pm, merged, shapes)))
    return state


@pytest.mark.parametrize("family,share_a", [("qwen2", False), ("qwen3", True)])
def test_lora_peft_export_loads_in_peft_with_the_merged_logits(tmp_path, family, share_a):
    import transformers

    hf_dir = save_tiny_hf_model(family, tmp_path / "hf")
    hf_config = read_hf_config(hf_dir)
    dims = init_distributed(tp=1, seed=0)
    chunks = build_model(hf_config, dims=dims)
    load_hf_weights(chunks, hf_dir=hf_dir, hf_config=hf_config, dims=dims)
    model = chunks[0].eval()
    ids = torch.randint(0, VOCAB_SIZE, (2, SEQ), generator=torch.Generator().manual_seed(1))
    base = megatron_logits(model, ids)

    cfg = LoraConfig(rank=4, alpha=8.0, share_a=share_a)
    L.apply_lora(chunks, cfg, seed=3)
    assert torch.equal(megatron_logits(model, ids), base)  # B starts at zero
    g = torch.Generator().manual_seed(5)
    adapters = {k: (0.1 * torch.randn(v.shape, generator=g) if k.endswith(".b") else v.clone())
                for k, v in L.gather_adapters(chunks).items()}  # A as initialised, B random
    L.set_adapters(chunks, adapters)
    lora = megatron_logits(model, ids)
    with L.lora_disabled(chunks):
        assert torch.equal(megatron_logits(model, ids), base)
    assert (lora - base).abs().max() > 0.1  # the adapters matter: a dropped one would show

    state = merged_hf_state(hf_dir, hf_config, adapters, cfg)
    merged = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    merged.load_state_dict(state, strict=False)
    with torch.no_grad():
        merged_logits = merged(ids).logits
    torch.testing.assert_close(merged_logits, lora, rtol=0, atol=2e-6)  # Megatron vs HF kernels, fp32

    out = P.write_peft_adapter(tmp_path / "adapter", P.peft_tensors(adapters, cfg, hf_config=hf_config, num_layers=4),
                               P.adapter_config(cfg, base_model=str(hf_dir)))
    written = json.loads((out / P.CONFIG_FILE).read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8 and len(written["target_modules"]) == 7
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    loaded = peft.PeftModel.from_pretrained(base_hf, str(out)).eval()
    with torch.no_grad():
        peft_logits = loaded(ids).logits
    torch.testing.assert_close(peft_logits, merged_logits, rtol=0, atol=1e-6)
    peft_merged = loaded.merge_and_unload().state_dict()
    assert max(float((peft_merged[n] - t).abs().max()) for n, t in state.items()) <= 1e-6
