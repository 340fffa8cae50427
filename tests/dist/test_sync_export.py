"""The exporter's delivery modes (local shards for engines of TP=k, sender buckets for the rollout
pool) and the push's memory bound, on 2 gloo ranks without vLLM (tests/dist/scripts/export_modes.py).
The engines that consume these streams run in tests/e2e/test_sync_megatron.py and
tests/e2e/test_rollout_server.py."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun
from tests.tiny_hf import save_tiny_hf_model

SLACK = 1 << 20  # RSS noise: allocator metadata, Python objects, partially touched pages


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("export_modes")
    for seed, family in enumerate(("qwen2", "qwen3", "phi3")):
        save_tiny_hf_model(family, root / family / "hf", seed=seed)
    # ~40 MB fp32: 30+ buckets of 1 MiB; largest tensor the 4 MiB embedding (vocab-parallel at TP=2)
    big = transformers.Qwen2Config(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=4096, max_position_embeddings=128,
                                   tie_word_embeddings=False)
    big.architectures = ["Qwen2ForCausalLM"]
    transformers.Qwen2ForCausalLM(big).save_pretrained(root / "big" / "hf")
    # Peak RSS measures live memory only if freed blocks go back to the OS: glibc's dynamic mmap
    # threshold would otherwise keep multi-MB tensors in its heap after they are freed.
    return torchrun(REPO / "tests/dist/scripts/export_modes.py", 2, str(root), timeout=900,
                    env={"MALLOC_MMAP_THRESHOLD_": str(64 << 10)})


def by(results, check):
    return [r for r in results if r["check"] == check]


def test_local_mode_gives_each_engine_rank_its_own_shard(results):
    rows = by(results, "local")
    assert len(rows) == 2 * 2  # 2 families x 2 ranks at TP=2
    for r in rows:
        assert r["bad"] == [] and r["tensors"] == r["planned"] == r["expected"], r
        assert r["sharded"] >= 7 * 4, r  # q/k/v/o/gate/up/down of 4 layers (+ qwen2 biases) arrive as shards


def test_sender_buckets_cover_the_model_once_from_the_owning_stage(results):
    for layout in ([2, 1], [1, 2]):
        for family in ("qwen2", "qwen3", "phi3"):
            rows = {r["rank"]: r for r in by(results, "senders") if r["layout"] == layout and r["family"] == family}
            assert all(r["bad"] == [] for r in rows.values()), rows
            names = rows[0]["names"] + rows[1]["names"]
            assert len(names) == len(set(names)) == rows[0]["expected"] >= 4 * 6 + 3, rows
            if layout == [2, 1]:  # TP=2: rank 0 (TP rank 0) sends everything, rank 1 only helps gather
                assert rows[1]["names"] == [] and rows[0]["owners"] == [0], rows
            else:  # PP=2: each stage sends its own layers, in one run of buckets per stage
                assert rows[0]["names"] and rows[1]["names"] and rows[0]["owners"] == [0, 1], rows
                assert rows[0]["stage_runs"] == 1, rows


def test_push_peak_memory_is_one_bucket_plus_the_largest_tensor_engine_tp(results):
    rows = by(results, "memory")
    assert len(rows) == 2
    for r in rows:
        bound = r["bucket"] + r["largest"]
        assert r["buckets"] >= 10 and r["push"] >= 5 * bound, r  # the old whole-push staging would show
        assert r["pack_extra"] <= bound + SLACK, r
        assert r["stream_extra"] <= bound + SLACK, r
