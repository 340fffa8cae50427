"""The shard plan of a push (pure): delivery modes per placement, shapes each engine rank receives,
bucket cutting, and the rollout pool's prompt split and server discovery."""

from __future__ import annotations

import pytest

from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.families import FAMILIES
from megatron_gtpo.sync.config import SyncConfig
from megatron_gtpo.rollout.pool import balanced_runs, server_addresses
from megatron_gtpo.sync.shards import Entry, delivered, delivery_mode, plan_buckets, push_bytes, receives

SHAPES = mp.Shapes(heads=8, groups=4, head_dim=16)  # hidden 128, GQA 2:1
QWEN2 = FAMILIES["qwen2"]


def entries(tp: int, pp: int, layers: int = 4) -> list[Entry]:
    """A Qwen2 pipeline as the exporter's plan lists it (TP-local shard shapes)."""
    hidden, inter, vocab, qkv = 128, 256, 512, (8 + 2 * 4) * 16
    out = [Entry(local="embedding.word_embeddings.weight", layer=None, owner=0, shard_shape=(vocab // tp, hidden),
                 dtype="torch.bfloat16")]
    per_layer = [("input_layernorm.weight", (hidden,)), ("self_attention.linear_qkv.weight", (qkv // tp, hidden)),
                 ("self_attention.linear_qkv.bias", (qkv // tp,)), ("self_attention.linear_proj.weight", (hidden, 128 // tp)),
                 ("pre_mlp_layernorm.weight", (hidden,)), ("mlp.linear_fc1.weight", (2 * inter // tp, hidden)),
                 ("mlp.linear_fc2.weight", (hidden, inter // tp))]
    for layer in range(layers):
        out += [Entry(local=n, layer=layer, owner=layer * pp // layers, shard_shape=s, dtype="torch.bfloat16")
                for n, s in per_layer]
    out += [Entry(local="decoder.final_layernorm.weight", layer=None, owner=pp - 1, shard_shape=(hidden,),
                  dtype="torch.bfloat16"),
            Entry(local="output_layer.weight", layer=None, owner=pp - 1, shard_shape=(vocab // tp, hidden),
                  dtype="torch.bfloat16")]
    return out


def test_engine_tp_delivery_mode_per_placement():
    mode = lambda **kw: delivery_mode(family=QWEN2, **kw)  # noqa: E731
    assert mode(transport="separate", trainer_tp=4, engine_tp=4) == "senders"
    assert mode(transport="colocated", trainer_tp=2, engine_tp=2) == "local"  # aligned: shards only
    assert mode(transport="colocated", trainer_tp=2, engine_tp=1) == "full"  # engine per rank
    assert mode(transport="colocated", trainer_tp=1, engine_tp=2) == "full"  # vLLM reshards
    assert mode(transport="colocated", trainer_tp=4, engine_tp=2) == "full"
    # vLLM cuts a fused qkv_proj by its full q/k/v sizes: Phi-3's shards can only arrive whole
    assert delivery_mode(transport="colocated", trainer_tp=2, engine_tp=2, family=FAMILIES["phi3"]) == "full"


def test_engine_tp_local_shapes_are_each_ranks_slice_and_full_elsewhere():
    e = entries(tp=2, pp=1)
    qkv = next(x for x in e if x.local.endswith("linear_qkv.weight"))
    local = delivered(qkv, "local", family=QWEN2, shapes=SHAPES, tp=2)
    full = delivered(qkv, "full", family=QWEN2, shapes=SHAPES, tp=2)
    assert [m.name.rsplit(".", 2)[-2] for m in local] == ["q_proj", "k_proj", "v_proj"]
    assert [m.shape for m in local] == [(64, 128), (32, 128), (32, 128)]  # 4 of 8 heads, 2 of 4 KV heads
    assert [m.shape for m in full] == [(128, 128), (64, 128), (64, 128)]
    row = next(x for x in e if x.local.endswith("linear_proj.weight"))
    assert delivered(row, "local", family=QWEN2, shapes=SHAPES, tp=2)[0].shape == (128, 64)
    embed = e[0]  # vocabulary tensors always arrive whole (vLLM pads the vocabulary its own way)
    assert delivered(embed, "local", family=QWEN2, shapes=SHAPES, tp=2)[0].shape == (512, 128)
    local_bytes = push_bytes([m for x in e for m in delivered(x, "local", family=QWEN2, shapes=SHAPES, tp=2)])
    full_bytes = push_bytes([m for x in e for m in delivered(x, "full", family=QWEN2, shapes=SHAPES, tp=2)])
    assert local_bytes < full_bytes


def test_only_the_owning_stages_tp0_dp0_rank_sends():
    assert receives("senders", tp_rank=0, dp_rank=0, pp_rank=1, owner=1, rank=5)
    assert not receives("senders", tp_rank=1, dp_rank=0, pp_rank=1, owner=1, rank=6)
    assert not receives("senders", tp_rank=0, dp_rank=1, pp_rank=1, owner=1, rank=7)
    assert not receives("senders", tp_rank=0, dp_rank=0, pp_rank=0, owner=1, rank=0)
    assert receives("full", tp_rank=3, dp_rank=2, pp_rank=0, owner=1, rank=9)
    assert receives("first", tp_rank=0, dp_rank=0, pp_rank=0, owner=1, rank=0)


@pytest.mark.parametrize("bucket", [8 << 10, 64 << 10, 1 << 20])
def test_buckets_hold_whole_parameters_of_one_stage_and_respect_the_size(bucket):
    e = entries(tp=2, pp=2)
    plan = plan_buckets(e, family=QWEN2, shapes=SHAPES, tp=2, bucket_bytes=bucket)
    seen = [i for b in plan for i in b.entries]
    assert seen == list(range(len(e)))  # every parameter once, in order
    names = [m.name for b in plan for m in b.tensors]
    assert len(names) == len(set(names)) == 3 + 4 * 12  # embed/norm/lm_head + 12 HF tensors per Qwen2 layer
    for b in plan:
        assert {e[i].owner for i in b.entries} == {b.owner}
        assert b.nbytes <= bucket or len(b.entries) == 1  # a larger parameter travels alone
        assert all(m.offset % 64 == 0 for m in b.tensors) and b.tensors[0].offset == 0
    owners = [b.owner for b in plan]
    assert owners == sorted(owners)  # stage 0's buckets, then stage 1's


def test_rollout_server_prompts_split_by_count_whole_groups():
    assert balanced_runs(5, 2) == [(0, 3), (3, 5)]
    assert balanced_runs(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert balanced_runs(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_rollout_nodes_addresses_from_config_then_slurm_then_local(monkeypatch):
    monkeypatch.delenv("MGTPO_ROLLOUT_HOSTS", raising=False)
    assert server_addresses(SyncConfig(transport="separate")) is None  # rank 0 starts local servers
    monkeypatch.setenv("MGTPO_ROLLOUT_HOSTS", "10.0.0.3,10.0.0.4")
    monkeypatch.setenv("MGTPO_ROLLOUT_PORT", "30000")
    assert server_addresses(SyncConfig(transport="separate")) == ["10.0.0.3:30000", "10.0.0.4:30000"]
    assert server_addresses(SyncConfig(transport="separate", servers=["h:1"])) == ["h:1"]
