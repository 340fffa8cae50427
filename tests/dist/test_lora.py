"""LoRA on the Megatron policy at TP=2, PP=2 and DP=2 equals one process (one 2-rank launch of
tests/dist/scripts/lora_layouts.py; its docstring lists the checks): adapter placement and
initialisation, TP gather and dist-checkpoint entries, merged weights per TP shard, loss, adapter
gradients, grad norm and AdamW update with Megatron DDP + the distributed optimizer over the
adapters only (the frozen base has no grad, no grad buffer, no optimizer state), the merged weight
push of the trained adapters, the adapter-only checkpoint and its bit-exact resume, a bf16 model's
dtypes, and sequence parallelism on the parallel linears themselves."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, torchrun

pytestmark = pytest.mark.slow
LAYOUTS = ([2, 1, 1], [1, 2, 1], [1, 1, 2])
TOL = 1e-6  # fp32


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return torchrun(REPO / "tests/dist/scripts/lora_layouts.py", 2, str(tmp_path_factory.mktemp("lora")), timeout=900)


def rows(records, check, layout=None):
    out = [r for r in records if r["check"] == check and (layout is None or r["layout"] == layout)]
    assert len(out) == 2, (check, layout, out)  # one per rank
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_adapters_are_placed_initialised_and_merged_as_one_process(records, layout):
    for r in rows(records, "lora_init", layout):
        assert r["err"] == 0.0, r  # PEFT-style init drawn per (seed, layer, module): layout independent
    for r in rows(records, "lora_gather", layout):
        per_rank = 32 if layout != [1, 2, 1] else 16  # 4 modules x 4 layers x (A, B); PP halves the layers
        assert r["adapters"] == per_rank and r["err"] == 0.0, r
        assert r["sharded"] == per_rank + per_rank // 8 and r["sharded_err"] == 0.0, r  # fc1's B: 2 entries
    for r in rows(records, "lora_merged", layout):
        assert r["count"] == (16 if layout != [1, 2, 1] else 8) and r["err"] <= TOL, r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_frozen_base_has_no_grad_buffer_or_optimizer_state(records, layout):
    """The base tensors themselves are compared before and after the step and after two pushes:
    bit for bit. (``base_grads`` and ``no_base_main_grad`` only count parameters with
    ``requires_grad=False``, which cannot get a ``.grad`` or a DDP ``main_grad``: they guard the
    set-up, not the step.) Proved against: ``LoraAdapter.merged`` also adding 1e-7 to the frozen
    weight in place (an in-place merge/unmerge that does not round-trip): the first layout's
    ``lora_push`` record read ``base_drift`` 2.0e-7 (TP=2, rank 1) and this failed; its
    ``lora_step`` records, before any push, read 0."""
    for r in rows(records, "lora_step", layout) + rows(records, "lora_push", layout):
        assert r["base_drift"] == 0.0, r
    for r in rows(records, "lora_frozen", layout):
        assert r["trainable_is_adapters"] and r["buffers_are_adapters"] and r["optimizer_holds_adapters"], r
        assert r["buffer_numel"] == r["adapter_numel"] < r["base_numel"] / 5, r
        assert r["no_base_main_grad"], r
    for r in rows(records, "lora_step", layout):
        assert r["base_grads"] == 0 and r["ref_frozen_clean"], r
        assert r["state_numel"] == r["adapter_numel"], r  # Adam state, summed over DP shards


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_step_equals_one_process(records, layout):
    for r in rows(records, "lora_step", layout):
        if r["last_stage"]:
            assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert r["grad_err"] <= TOL, r
        assert abs(r["norm"] - r["ref_norm"]) <= TOL * r["ref_norm"], r
        assert r["update_err"] <= TOL, r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_push_sends_the_merged_weights_of_the_trained_adapters(records, layout):
    """Bugs caught: the push sending the frozen base W (the engine would sample from the initial
    policy forever), or an adapter tensor vLLM does not know, or a merge cached from an earlier push."""
    for r in rows(records, "lora_push", layout):
        assert r["base_vs_merged"] > 1e-3, r  # the trained adapters move the weights: an unmerged push shows
        for push in (r["trained"], r["again"]):
            assert push["err"] <= TOL and push["missing"] == [] and push["adapter_names"] == [], r


@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_checkpoint_holds_adapters_only_and_resumes_bit_exact(records, layout):
    """Bugs caught: the frozen base written into every checkpoint, Adam's moments or the fp32 main
    params of the adapters not restored, the LoRA record not stored."""
    for r in rows(records, "lora_ckpt", layout):
        assert r["step"] == 1 and r["extra"] == {"x": 1} and r["record_ok"], r
        assert r["base_keys"] == [] and r["model_keys"] > 0 and r["optimizer_keys"] > 0, r
        assert r["differs_before"] > 1e-3, r  # the fresh model starts elsewhere: the load must move it
        assert r["adapter_err"] == 0.0 and r["state_err"] == 0.0, r
        assert r["state_count"][0] == r["state_count"][1] > 0, r


def test_lora_bf16_base_and_adapters_with_fp32_main_params(records):
    for r in rows(records, "lora_bf16"):
        assert r["adapter_dtypes"] == r["base_dtypes"] == ["torch.bfloat16"], r
        assert r["main_dtypes"] == ["torch.float32"] and r["main_numel"] == r["adapter_numel"], r
        assert r["held_is_adapters"] and r["ok"], r
        assert abs(r["loss"] - r["ref_loss"]) < 1e-2 * r["ref_loss"], r  # bf16 rounding only


def test_lora_sequence_parallel_linears_equal_dense(records):
    for r in rows(records, "lora_sp"):
        assert r["flags"] == [True, False, False, True], r  # column A and row B summed over TP
        assert r["out_err"] <= TOL * r["out_scale"] and r["x_grad_err"] <= TOL * r["out_scale"], r
        assert r["grad_err"] <= TOL * r["grad_scale"], r
