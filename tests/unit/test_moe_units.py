"""Mixture-of-experts pieces without a process group: families' refusals, expert layout rules, the
mapping of expert tensors, the sequence-to-Megatron token order of replayed routing, the router
metrics, the validation of routing replay."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from megatron_gtpo.config import load_config
from megatron_gtpo.convert import mapping as mp
from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.models.families import FAMILIES, check_supported
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel.dims import ParallelConfig
from megatron_gtpo.parallel.layout import model_split_problems
from megatron_gtpo.rollout.routing import completion_routing, replay_problem
from megatron_gtpo.sync.shards import Entry, delivered, delivery_mode, plan_buckets, sender_ranks
from megatron_gtpo.train.batching import micro_batches, packed_micro_batches
from megatron_gtpo.train.routing import batch_routing, moe_metrics, tokens_of
from megatron_gtpo.types import Batch, Completion
from megatron_gtpo.utils.configuration import ConfigError
from tests.tiny_hf import tiny_hf_config


@pytest.mark.parametrize("patch,match", [
    ({"num_local_experts": None, "num_experts": None}, "'num_experts' or 'num_local_experts'=None must be a positive"),
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok'=9 exceeds the 4 experts"),
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"scoring_func": "sigmoid"}, "only the softmax top-k router"),
])
def test_moe_configs_refused_naming_the_field(patch, match):
    raw = {**tiny_hf_config("qwen3_moe"), **patch}
    for read in (lambda: check_supported(raw), lambda: shape_from_hf_config(raw, name="x")):
        with pytest.raises(ConfigError, match=match):
            read()


def test_moe_dense_family_refuses_expert_keys_and_names_the_moe_architectures():
    with pytest.raises(ConfigError, match="mixture-of-experts configs need one of Qwen3MoeForCausalLM"):
        check_supported({**tiny_hf_config("qwen3"), "num_experts": 8})


def test_moe_qwen2_moe_needs_its_qkv_bias():
    with pytest.raises(ConfigError, match="'qkv_bias'=false is not supported for qwen2_moe"):
        check_supported({**tiny_hf_config("qwen2_moe"), "qkv_bias": False})


def test_moe_shape_counts_every_parameter_and_experts_per_ep_rank():
    import transformers

    for family in ("qwen3_moe", "qwen2_moe", "mixtral"):
        raw = tiny_hf_config(family)
        shape = shape_from_hf_config(raw, name=family)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
        assert shape.params_total() == sum(p.numel() for p in model.parameters()), family
        # EP=2: half the experts' weights per rank, everything else unchanged
        assert shape.layer_params(ep=2) == shape.layer_params() - shape.expert_params() // 2


def test_moe_split_rules_name_the_setting():
    shape = shape_from_hf_config(tiny_hf_config("qwen2_moe"), name="q2m")  # 4 experts, width 32, shared 48
    assert model_split_problems(shape, tp=1, pp=1, vpp=None, ep=4) == []
    assert "4 experts per layer are not divisible by EP=3" in model_split_problems(shape, tp=1, pp=1, vpp=None, ep=3)[0]
    assert "expert width 32 is not divisible by ETP=3" in model_split_problems(shape, tp=1, pp=1, vpp=None, etp=3)[0]
    dense = shape_from_hf_config(tiny_hf_config("qwen3"), name="dense")
    assert "need a mixture-of-experts model" in model_split_problems(dense, tp=1, pp=1, vpp=None, ep=2)[0]
    with pytest.raises(ConfigError, match="parallel.ep x parallel.etp = 4 x 1 does not divide the 2 ranks"):
        ParallelConfig(tp=2, ep=4)
    assert ParallelConfig(tp=2, ep=2).world_size == 2  # EP takes its ranks from TP x DP: no extra ranks


def test_moe_megatron_settings_the_model_decides_are_refused():
    with pytest.raises(ConfigError, match="megatron.moe_router_topk.*comes from config.json"):
        ModelConfig(megatron={"moe_router_topk": 4})
    with pytest.raises(ConfigError, match="megatron.expert_model_parallel_size.*parallel.ep"):
        ModelConfig(megatron={"expert_model_parallel_size": 2})
    with pytest.raises(ConfigError, match="recompute"):
        ModelConfig(moe_routing_replay="rollout", megatron={"recompute_granularity": "full"})
    ModelConfig(megatron={"moe_aux_loss_coeff": 1e-3, "moe_z_loss_coeff": 1e-3})  # passes through


def test_moe_replay_refused_where_engines_return_no_routing():
    assert "sync.transport='separate'" in replay_problem(transport="separate", vllm={})
    assert "pipeline_parallel_size=2" in replay_problem(transport="colocated", vllm={"pipeline_parallel_size": 2})
    assert replay_problem(transport="colocated", vllm={}) is None
    with pytest.raises(ConfigError, match="rollout servers.*do not send routed experts"):
        load_config("configs/tiny_moe.yaml", ["sync.transport=separate"])


def test_moe_expert_mapping_names_and_split():
    family = FAMILIES["mixtral"]
    fc1 = next(pm for pm in mp.layer_maps(family) if pm.kind == mp.EXPERT_FC1)
    assert mp.hf_names(fc1, 3, 2) == ("model.layers.3.block_sparse_moe.experts.2.w1.weight",
                                      "model.layers.3.block_sparse_moe.experts.2.w3.weight")
    assert mp.find_param_map("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", family, tied=False)[1:] \
        == (1, 1)
    assert mp.find_param_map("decoder.layers.0.mlp.experts.linear_fc2.weight3", family, tied=False)[2] == 3  # TE name
    assert mp.global_expert(1, experts=8, ep=4, ep_rank=2) == 5
    gate, up = torch.arange(8.0).reshape(4, 2), 10 + torch.arange(8.0).reshape(4, 2)
    full = mp.fuse(fc1, [gate, up], mp.Shapes(heads=1, groups=1, head_dim=1))
    assert torch.equal(mp.tp_shard(fc1, full, tp=2, rank=1), torch.cat([gate[2:], up[2:]]))  # expert TP: gate/up rows


def test_moe_push_plan_one_sender_per_ep_rank():
    coords = [dict(rank=r, pp=0, tp=r % 2, dp=0, cp=0, ep=r % 2, etp=0, edp=0) for r in range(2)]  # TP2 x EP2, one stage
    assert sender_ranks(coords, moe=False) == [0] and sender_ranks(coords, moe=True) == [0, 1]
    family, shapes = FAMILIES["qwen3_moe"], mp.shapes_of(tiny_hf_config("qwen3_moe"))
    entries = [Entry(local="mlp.experts.linear_fc2.weight", layer=0, owner=0, shard_shape=(64, 32), dtype="torch.float32",
                     expert=e, ep_owner=e // 2, split=1, source=e // 2) for e in range(4)]
    plan = plan_buckets(entries, family=family, shapes=shapes, tp=2, bucket_bytes=1 << 30)
    assert [b.owner for b in plan] == [0, 1]  # each EP rank's own experts, never one rank for all
    assert [m.name for m in plan[1].tensors] == [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in (2, 3)]
    assert delivered(entries[3], "full", family=family, shapes=shapes, tp=2)[0].shape == (64, 32)  # not cut by TP
    assert delivery_mode(transport="colocated", trainer_tp=2, engine_tp=2, family=family) == "full"


def _batch(prompts, completions, routed):
    comps = [Completion(prompt_index=0, prompt_token_ids=list(range(1, p + 1)), token_ids=list(range(10, 10 + c)),
                        logprobs=[0.0] * c, routed_experts=r) for p, c, r in zip(prompts, completions, routed)]
    rows = batch_routing(comps)
    width = max(completions)
    return comps, Batch(prompt_ids=torch.ones(len(prompts), max(prompts), dtype=torch.long),
                        prompt_lengths=torch.tensor(prompts), token_ids=torch.ones(len(prompts), width, dtype=torch.long),
                        mask=torch.arange(width)[None] < torch.tensor(completions)[:, None],
                        sampler_logprobs=torch.zeros(len(prompts), width), rewards=torch.zeros(len(prompts)),
                        group_ids=torch.zeros(len(prompts), dtype=torch.long), routed_experts=rows)


def test_moe_routing_in_megatron_token_order_padded_and_packed():
    """Token t of row b: padded micro-batches flatten [s, b] sequence-major (index s * rows + b),
    packed ones are one row; positions the engine never fed (a completion's last token, padding)
    are -1 and never compared."""
    prompts, completions = [2, 3], [3, 1]
    routed = [np.stack([np.full((2, 2), 10 * b + p) for p in range(prompts[b] + completions[b] - 1)]).astype(np.int16)
              for b in range(2)]
    _, batch = _batch(prompts, completions, routed)
    assert batch.routed_experts.shape == (2, 5, 2, 2)
    mb = micro_batches(batch, slice(0, 2), micro_batch_size=2, common_length=False)[0]
    tokens = tokens_of(batch.routed_experts, mb, prompt_lengths=batch.prompt_lengths, lengths=batch.lengths, device="cpu")
    seq = mb.input_ids.shape[1]
    engine = tokens.engine[:, 0, 0].view(seq, 2)  # [s, b]
    assert engine[:, 0].tolist() == [0, 1, 2, 3, -1] and engine[:, 1].tolist() == [10, 11, 12, -1, -1]
    assert tokens.completion.view(seq, 2)[:, 0].tolist() == [False, False, True, True, False]  # fed completion tokens
    assert tokens.real.view(seq, 2)[:, 1].tolist() == [True, True, True, True, False]
    packed = packed_micro_batches(batch, slice(0, 2), token_budget=16, count=1, common_length=False)[0]
    tokens = tokens_of(batch.routed_experts, packed, prompt_lengths=batch.prompt_lengths, lengths=batch.lengths,
                       device="cpu")
    assert tokens.engine[:, 1, 1].tolist() == [0, 1, 2, 3, -1, 10, 11, 12, -1]
    assert tokens.completion.tolist() == [False, False, True, True, False, False, False, False, False]


def test_moe_batch_routing_all_or_none():
    assert batch_routing([Completion(prompt_index=0, prompt_token_ids=[1], token_ids=[2], logprobs=[0.0])]) is None
    with pytest.raises(ValueError, match="some completions carry routed experts"):
        _batch([1, 1], [1, 1], [np.zeros((1, 1, 1), np.int16), None])


def test_moe_metrics_from_sums():
    sums = torch.zeros(2, 4 + 5, dtype=torch.float64)
    sums[0, :4] = torch.tensor([6.0, 2.0, 0.0, 0.0])  # 4 tokens x top-2, expert 0 busiest
    sums[0, 4:] = torch.tensor([4.0, 4.0 * 1.2, 0.0, 3.0, 4.0])
    sums[1, :4] = 2.0
    sums[1, 4:] = torch.tensor([4.0, 4.0 * 0.8, 0.0, 4.0, 4.0])
    out = moe_metrics(sums)
    assert out["moe/expert_load/L0"] == pytest.approx(3.0) and out["moe/expert_load/L1"] == pytest.approx(1.0)
    assert out["moe/expert_load_max"] == pytest.approx(3.0) and out["moe/router_entropy"] == pytest.approx(1.0)
    assert out["moe/routing_agreement"] == pytest.approx(7 / 8) and out["moe/dropped_frac"] == 0.0
    assert "moe/routing_agreement" not in moe_metrics(sums * 0)  # nothing compared: not logged


def test_moe_captured_routing_found_by_vllm_request_names():
    rows = {"0_7-ab12": np.zeros((3, 1, 2)), "1_7-cd34": np.ones((3, 1, 2)), "8-ef56": np.full((2, 1, 2), 5)}
    assert completion_routing(rows, "7", 1, n=2)[0, 0, 0] == 1
    assert completion_routing(rows, "8", 0, n=1)[0, 0, 0] == 5
    with pytest.raises(RuntimeError, match="0 captured requests"):
        completion_routing(rows, "9", 0, n=2)
