"""LoRA at start-up and in the memory plan (issue 25): the driver's checks before anything is built
(``checkpoint.adapters.lora_start``: a rank that does not fit, a resume point of other LoRA settings,
of another base, or of the other kind), and what the plan counts with LoRA on (adapters, their
gradients and optimizer state, the frozen base, no KL reference copy)."""

from __future__ import annotations

import shutil

import pytest

from megatron_gtpo.checkpoint import adapters as A
from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.models.shape import load_model_shape
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import MemorySizes, estimate_memory
from megatron_gtpo.train.lora import LoraConfig
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO
from tests.tiny_hf import save_tiny_hf_model

LLAMA = REPO / "configs" / "models" / "llama3.1-8b-instruct.json"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    init_distributed(tp=1, seed=0)  # identify_base gathers the per-rank digests (one rank here)
    return save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_base") / "hf")


def model(path, **lora) -> ModelConfig:
    return ModelConfig(path=str(path), lora=LoraConfig(**lora))


def saved_at(monkeypatch, record):
    """A resume point whose common state holds ``record`` (the real round trip: tests/dist/test_lora.py)."""
    monkeypatch.setattr(A, "saved_lora", lambda step_dir: record)


def test_lora_start_identifies_the_base_and_accepts_its_own_resume_point(base, monkeypatch, tmp_path):
    assert A.lora_start(model(base), None) is None  # LoRA off: nothing hashed
    identity = A.lora_start(model(base, rank=4), None)
    assert identity.path == str(base.resolve()) and identity.files == 1 and len(identity.sha256) == 64
    saved_at(monkeypatch, A.lora_record(LoraConfig(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                           "gate_proj", "up_proj", "down_proj"]),
                                        identity))
    assert A.lora_start(model(base, rank=4), tmp_path) == identity  # HF names of the same adapters: the same


def test_lora_start_refuses_another_base_naming_both(base, monkeypatch, tmp_path):
    """Bug caught: adapters resumed onto weights they were not trained on (silently wrong policy)."""
    other = shutil.copytree(base, tmp_path / "other")
    weights = other / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    saved_at(monkeypatch, A.lora_record(LoraConfig(rank=4), A.identify_base(base)))
    with pytest.raises(ConfigError) as err:
        A.lora_start(model(other, rank=4), tmp_path)
    text = str(err.value)
    assert f"model.path={other.resolve()}" in text and str(base.resolve()) in text and "point model.path" in text


def test_lora_start_refuses_other_settings_and_the_other_kind(base, monkeypatch, tmp_path):
    saved_at(monkeypatch, A.lora_record(LoraConfig(rank=4), A.identify_base(base)))
    with pytest.raises(ConfigError, match=r"model.lora.rank=8 \(saved: 4\)"):
        A.lora_start(model(base, rank=8), tmp_path)
    with pytest.raises(ConfigError, match=r"model.lora.target_modules=.*\(saved"):
        A.lora_start(model(base, rank=4, target_modules=["linear_qkv"]), tmp_path)
    with pytest.raises(ConfigError, match="holds LoRA adapters .*resume with model.lora.rank=4"):
        A.lora_start(model(base), tmp_path)  # a LoRA checkpoint resumed as full fine-tuning
    saved_at(monkeypatch, None)
    with pytest.raises(ConfigError, match="holds full weights .*drop model.lora.rank"):
        A.lora_start(model(base, rank=4), tmp_path)


def test_lora_start_refuses_a_rank_above_a_layer_dimension_before_hashing(base, monkeypatch):
    monkeypatch.setattr(A, "identify_base", lambda _: pytest.fail("hashed before the rank check"))
    with pytest.raises(ConfigError, match="model.lora.rank"):
        A.lora_start(model(base, rank=4096), None)


def _plan(lora: LoraConfig | None, *, reference: bool = False):
    shape = load_model_shape(LLAMA)
    layout = plan_layout(LayoutRequest(shape=shape, nodes=2, gpus_per_node=8, tp=2, pp=1, prompts_per_step=16,
                                       group_size=8, max_prompt_tokens=512, max_completion_tokens=1536))
    sizes = MemorySizes(distributed_optimizer=True, reference=reference, lora=lora)
    return estimate_memory(shape, layout, sizes), layout


def test_lora_memory_plan_counts_adapters_and_drops_the_frozen_state():
    """The paper's recipe (r=128, alpha=128, all seven projections) on Llama-3.1-8B at TP=2 x DP=8."""
    full, layout = _plan(None)
    lora, _ = _plan(LoraConfig(rank=128, alpha=128.0))
    adapters = lora.adapters // 2  # bf16
    # per layer and TP rank (A of column layers and B of row layers whole, the rest halved), by hand:
    # q 4096r + 2048r, k and v 4096r + 512r, o 2048r + 4096r, gate and up 4096r + 7168r, down 7168r + 4096r
    assert adapters == 32 * 128 * (6144 + 2 * 4608 + 6144 + 3 * 11264) == 226_492_416  # 335.5 M at TP=1
    assert lora.weights == full.weights + lora.adapters and lora.full_state == full.grads + full.optimizer
    sizes = MemorySizes()
    assert lora.grads == adapters * sizes.grad_bytes and lora.optimizer == adapters * 12 // layout.dp
    share = (lora.grads + lora.optimizer) / (full.grads + full.optimizer)  # 5.6%: what the adapters' share of
    assert share == pytest.approx(adapters / (full.weights // 2), rel=1e-12)  # this rank's parameters is
    assert lora.activations > full.activations  # each adapter's A x is kept for backward
    with_kl, _ = _plan(LoraConfig(rank=128), reference=True)
    assert with_kl.reference == 0 and _plan(None, reference=True)[0].reference == full.weights  # the base is it
