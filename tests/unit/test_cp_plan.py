"""Context parallelism in the memory plan and at validation (issue 23): what one CP rank holds of a
micro-batch, the long-context recipe that needs CP (its CP=1 layout must fail the plan, naming the
CP size that fits), and bad CP settings refused before anything starts, naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_gtpo.cli import dry_run
from megatron_gtpo.config import load_config
from megatron_gtpo.models.shape import load_model_shape
from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import MemorySizes, activation_bytes, check_memory, estimate_memory
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO

QWEN3 = REPO / "configs" / "models" / "qwen3-8b.json"
RECIPE = REPO / "configs" / "gpu" / "gtpo_qwen3-8b_32k_2x8_cp.yaml"


def _layout(cp: int, *, seq: int = 8192, tp: int = 2):
    request = LayoutRequest(shape=load_model_shape(QWEN3), nodes=2, gpus_per_node=8, tp=tp, pp=1, cp=cp,
                            prompts_per_step=16, group_size=8, max_prompt_tokens=1024, max_completion_tokens=seq - 1024)
    return plan_layout(request)


def test_cp_memory_plan_divides_the_sequence_terms_per_rank():
    shape, sizes = load_model_shape(QWEN3), MemorySizes(distributed_optimizer=True, micro_batch_tokens=8192)
    one, two = (estimate_memory(shape, _layout(cp), sizes) for cp in (1, 2))
    assert two.logits * 2 == one.logits and two.activations * 2 == one.activations  # TE: every term per local token
    assert two.weights == one.weights and two.grads == one.grads and two.optimizer == one.optimizer  # DP x CP = 8
    # the CPU stand-in keeps the gathered K and V of the WHOLE sequence (2 g d s per layer and row, which
    # does not halve) and one additive mask [s/2, s]; the packed CP=1 row keeps the rotated k, the fused
    # QKV output, q and the per-sequence outputs (3 a d + 3 g d per token, which halves): so CP=2 keeps
    # (g d - 2 a d) s per layer, plus the mask, more than half of CP=1
    local = dataclasses.replace(sizes, layer_spec="local", micro_batch_tokens=512)
    act1, act2 = (activation_bytes(shape, _layout(cp), local) for cp in (1, 2))
    a, g, d, s = shape.heads // 2, shape.kv_heads // 2, shape.head_dim, 512
    assert 2 * act2 == act1 + (shape.layers * (g * d - 2 * a * d) * s + s * s) * local.param_bytes, (act1, act2)


def test_cp_long_context_recipe_fits_only_with_cp(capsys):
    """The recipe's dry-run line passes (tests/unit/test_gpu_recipes.py runs it too); the same 16 GPUs at
    CP=1 or CP=2 fail the plan with the trainer's numbers and the CP size that fits."""
    argv = [str(RECIPE), "--nodes", "2", "--gpus-per-node", "8", "--hf-config", str(QWEN3)]
    assert dry_run.main(argv) == 0
    out = capsys.readouterr().out
    assert "TP=2 x CP=4 x PP=1 x DP=2 = 16 ranks" in out and "8192 of them on each of CP=4 ranks" in out
    for cp, dp in ((1, 8), (2, 4)):
        assert dry_run.main([*argv, f"parallel.cp={cp}", f"parallel.dp={dp}"]) == 1
        out = capsys.readouterr().out
        assert "REJECTED: does not fit" in out and f"at CP={cp}" in out and "set parallel.cp=4" in out, out


def test_cp_over_budget_message_names_the_state_when_the_sequence_is_small():
    shape, sizes = load_model_shape(QWEN3), MemorySizes(gpu_memory_gib=24.0)  # no distributed optimizer
    lay = _layout(1, seq=2048, tp=1)
    problems, _ = check_memory(estimate_memory(shape, lay, sizes), lay)
    assert problems and "use_distributed_optimizer" in problems[0] and "parallel.cp" not in problems[0]


def test_cp_bad_sizes_are_refused_at_validation_naming_the_field(capsys):
    tiny = str(REPO / "configs" / "tiny.yaml")
    # the world: 2 GPUs cannot hold TP=2 x CP=2
    assert dry_run.main([tiny, "parallel.cp=2", "--nodes", "1", "--gpus-per-node", "2"]) == 1
    assert "parallel.tp/parallel.cp/parallel.pp" in capsys.readouterr().out
    # the heads: a2a scatters each TP rank's heads (and KV heads) over the CP ranks
    assert dry_run.main([tiny, "parallel.cp=4", "parallel.dp=1", "model.megatron.cp_comm_type=a2a", "--nodes", "1",
                         "--gpus-per-node", "8"]) == 1
    assert "cp_comm_type=a2a" in capsys.readouterr().out
    # the token budget must hold the longest row padded to a multiple of 2 x CP (every packed sequence is)
    shorter = ["parallel.cp=4", "data.max_prompt_tokens=250"]  # 250 + 24 = 274 tokens -> 280 under CP=4
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=274 cannot hold .*\(280 tokens"):
        load_config(tiny, [*shorter, "train.micro_batch_tokens=274"])
    assert load_config(tiny, [*shorter, "train.micro_batch_tokens=280"]).longest_row == 280
