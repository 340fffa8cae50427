"""The dry-run's plan for mixture-of-experts recipes: experts per EP rank in the weights, gradients
and optimizer state, vLLM's expert parallelism in the engine's weights, and refusals that name the
field. Hand-computed from Qwen3-30B-A3B's config (configs/models/qwen3-30b-a3b.json)."""

from __future__ import annotations

import pytest

from megatron_gtpo.cli import dry_run
from megatron_gtpo.models.shape import load_model_shape
from megatron_gtpo.plan.layout import LayoutError, LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import MemorySizes, check_memory, estimate_memory, stage_params
from tests.helpers import REPO

QWEN3_MOE = load_model_shape(REPO / "configs" / "models" / "qwen3-30b-a3b.json")
EXPERTS = 48 * 128 * 3 * 2048 * 768  # 48 layers x 128 experts x SwiGLU (gate, up, down) of 2048 x 768
RECIPE = REPO / "configs" / "gpu" / "gtpo_qwen3-30b-a3b_1x8_moe.yaml"


def _layout(**overrides):
    fields = dict(shape=QWEN3_MOE, nodes=1, gpus_per_node=8, tp=1, pp=1, vpp=None, dp=8, placement="colocated",
                  rollout_tp=8, engines=None, prompts_per_step=32, group_size=8, rows_per_micro_batch=2,
                  max_prompt_tokens=512, max_completion_tokens=1024, ep=8)
    return plan_layout(LayoutRequest(**{**fields, **overrides}))


def test_moe_qwen3_30b_a3b_parameters_match_the_published_checkpoint():
    # the safetensors total of Qwen/Qwen3-30B-A3B (30.5 B on its model card)
    assert QWEN3_MOE.params_total() == 30_532_122_624
    assert QWEN3_MOE.expert_params() * QWEN3_MOE.layers == EXPERTS


def test_moe_plan_counts_experts_per_ep_rank_and_shards_their_optimizer_over_expert_dp():
    ep1, ep8 = _layout(ep=1), _layout()
    assert stage_params(QWEN3_MOE, ep1) - stage_params(QWEN3_MOE, ep8) == EXPERTS - EXPERTS // 8
    sizes = MemorySizes(distributed_optimizer=True, gpu_memory_gib=141.0)
    mem = estimate_memory(QWEN3_MOE, ep8, sizes)
    params, mine = stage_params(QWEN3_MOE, ep8), EXPERTS // 8
    assert (mem.weights, mem.grads, mem.expert_weights) == (2 * params, 4 * params, 2 * mine)
    # 8 ranks, EP=8: each expert is on one rank (expert-DP 1), the rest is sharded over DP=8
    assert mem.optimizer == (params - mine) * 12 // 8 + mine * 12
    two_nodes = estimate_memory(QWEN3_MOE, _layout(nodes=2, dp=16), sizes)  # expert-DP 2
    assert two_nodes.optimizer == (params - mine) * 12 // 16 + mine * 12 // 2


def test_moe_plan_refuses_ep_that_does_not_divide_the_stage_naming_the_field():
    with pytest.raises(LayoutError, match=r"parallel.ep x parallel.etp = 3 x 1 does not divide the 8 ranks"):
        _layout(ep=3)
    with pytest.raises(LayoutError, match=r"parallel.ep x parallel.etp = 8 x 2 does not divide the 8 ranks"):
        _layout(etp=2)
    assert _layout(nodes=2, dp=16, ep=16).ep == 16  # 8 experts per rank over 2 nodes


def test_moe_recipe_that_does_not_fit_is_refused_naming_the_fields(capsys):
    args = [str(RECIPE), "--nodes", "1", "--gpus-per-node", "8", "--gpu-memory-gib", "80",
            "--hf-config", str(REPO / "configs" / "models" / "qwen3-30b-a3b.json")]
    assert dry_run.main(args) != 0
    out = capsys.readouterr().out
    assert "REJECTED: does not fit" in out and "raise parallel.tp/parallel.pp/parallel.ep" in out
    assert "6.8 GiB of it this EP rank's experts" in out and "experts over their 1 expert-DP rank(s)" in out
    mem = estimate_memory(QWEN3_MOE, _layout(), MemorySizes(distributed_optimizer=True, gpu_memory_gib=141.0,
                                                            offload_trainer=True, engine_expert_parallel=True))
    assert check_memory(mem, _layout())[0] == []
