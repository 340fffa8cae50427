"""The memory plan's new terms: activations (against what Megatron really keeps), the reference
model, the recipe's KV cache, the logits copies, and the phases of engines that cannot sleep."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gtpo.models.shape import load_model_shape, shape_from_hf_config
from megatron_gtpo.plan.layout import LayoutRequest, plan_layout
from megatron_gtpo.plan.memory import MemorySizes, activation_bytes, estimate_memory, micro_batch_dims
from tests.helpers import REPO

LLAMA = load_model_shape(REPO / "configs" / "models" / "llama3-8b.json")


def layout_of(shape, *, micro_batch_size: int, seq_len: int, tp: int = 1, pp: int = 1, vpp=None, prompts: int = 4):
    request = LayoutRequest(shape=shape, nodes=1, gpus_per_node=tp * pp, tp=tp, pp=pp, vpp=vpp,
                            rows_per_micro_batch=micro_batch_size, prompts_per_step=prompts, group_size=micro_batch_size,
                            max_prompt_tokens=seq_len - 8, max_completion_tokens=8)
    return plan_layout(request)


def _tiny_model(kv_heads: int | None = None):
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.models.tiny import ensure_tiny_char
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train.model import build_model

    hf = read_hf_config(ensure_tiny_char())
    hf = hf if kv_heads is None else {**hf, "num_key_value_heads": kv_heads}  # 4 query heads
    return build_model(hf, dims=init_distributed(tp=1, seed=0))[0], shape_from_hf_config(hf, name="tiny")


def _saved_bytes(model, forward) -> int:
    """Bytes of every floating tensor autograd keeps during ``forward()``, once per storage,
    parameters and RoPE tables excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        rope = t.dim() == 4 and t.shape[1:3] == (1, 1)  # cos/sin tables [s, 1, 1, d]: not per token
        if t.is_floating_point() and not rope and t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved.values())


@pytest.mark.parametrize("mb,seq_len,kv_heads", [(2, 40, None), (3, 64, None), (2, 40, 1), (2, 40, 4)])
def test_local_spec_activations_are_exactly_what_megatron_saves_for_backward(mb, seq_len, kv_heads):
    """Every tensor autograd keeps during the forward of the local-spec model (the CPU trainer),
    counted once per storage, parameters excluded, equals the plan's term (its core attention
    through SDPA: no score matrix, no mask for padded rows), at 1, 2 and 4 KV heads (the rotated k
    and the fused QKV output that v is a view of count KV heads, q and SDPA's output query heads)."""
    model, shape = _tiny_model(kv_heads)
    ids = torch.randint(0, 100, (mb, seq_len))
    saved = _saved_bytes(model, lambda: model(ids, torch.arange(seq_len).expand(mb, seq_len), None))
    lay = layout_of(shape, micro_batch_size=mb, seq_len=seq_len)
    assert saved == activation_bytes(shape, lay, MemorySizes(param_bytes=4, layer_spec="local"))


def test_packed_micro_batch_activations_are_those_of_one_budget_long_row():
    """A packed micro-batch (the default) on the local spec keeps exactly what the plan says of one
    row of its packed length (attention sequence by sequence: each sequence's output and their
    concatenation, no mask), whatever ``micro_batch_size`` says."""
    from megatron_gtpo.train.batching import packed_micro_batches
    from megatron_gtpo.train.model_input import forward
    from tests.unit.test_train_batching import ROWS, batch_of

    model, shape = _tiny_model()
    (mb,) = packed_micro_batches(batch_of(ROWS * 3, pad=99), slice(0, 12), token_budget=60, count=1,
                                 common_length=False)
    tokens = mb.input_ids.shape[1]
    assert tokens == 54  # 3 x (5 + 5 + 1 + 7) tokens back to back
    saved = _saved_bytes(model, lambda: forward(model, mb))
    lay = layout_of(shape, micro_batch_size=4, seq_len=16)
    packed = MemorySizes(param_bytes=4, layer_spec="local", micro_batch_tokens=tokens)
    assert saved == activation_bytes(shape, lay, packed)
    assert micro_batch_dims(lay, packed) == (1, 54) and micro_batch_dims(lay, MemorySizes()) == (4, 16)
    mem = estimate_memory(shape, lay, packed)
    assert mem.logits == 2 * 54 * shape.vocab * 2  # one packed row, two copies (logits_bytes 2)


def test_activations_by_hand_for_llama3_8b_te_and_recompute():
    lay = layout_of(LLAMA, micro_batch_size=2, seq_len=2048, tp=2)
    h, f, d = 4096, 14336, 128
    a, g = 32 // 2, 8 // 2
    layer = 4 * h + (2 * a + 2 * g) * d + 3 * f // 2 + 2  # TE: norms+inputs, q k v + output, SwiGLU
    tokens = 2 * 2048
    assert activation_bytes(LLAMA, lay, MemorySizes()) == tokens * (32 * layer + 3 * h + 1) * 2
    selective = activation_bytes(LLAMA, lay, MemorySizes(recompute="selective"))
    assert selective == tokens * (32 * (layer - (a + 2 * g) * d) + 3 * h + 1) * 2
    full = activation_bytes(LLAMA, lay, MemorySizes(recompute="full"))
    assert full == tokens * (32 * h + layer + 3 * h + 1) * 2 and full < selective / 5


def test_pipeline_keeps_micro_batches_in_flight():
    h, layer = 4096, 4 * 4096 + (2 * 32 + 2 * 8) * 128 + 3 * 14336 + 2  # TE layer at TP=1
    pp4 = layout_of(LLAMA, micro_batch_size=1, seq_len=1024, pp=4, prompts=8)
    assert pp4.layers_per_stage == 8 and pp4.microbatches == 8
    per_micro_batch = 1024 * (8 * layer + 3 * h + 1) * 2
    assert activation_bytes(LLAMA, pp4, MemorySizes()) == 4 * per_micro_batch  # 1F1B: PP in flight
    vpp = layout_of(LLAMA, micro_batch_size=1, seq_len=1024, pp=4, vpp=2, prompts=8)
    assert activation_bytes(LLAMA, vpp, MemorySizes()) == int(4 * (1 + 3 / 8) * per_micro_batch)
    assert activation_bytes(LLAMA, layout_of(LLAMA, micro_batch_size=1, seq_len=1024, prompts=8),
                            MemorySizes()) == 1024 * (32 * layer + 3 * h + 1) * 2


def test_reference_kv_cache_logits_and_phases_of_an_engine_that_cannot_sleep():
    lay = layout_of(LLAMA, micro_batch_size=2, seq_len=1024)
    plain = estimate_memory(LLAMA, lay, MemorySizes(param_bytes=4, grad_bytes=4, rollout_bytes=4))
    mem = estimate_memory(LLAMA, lay, MemorySizes(param_bytes=4, grad_bytes=4, rollout_bytes=4, reference=True,
                                                  kv_cache_bytes=3 << 30, logits_bytes=4))
    assert mem.reference == mem.weights and plain.reference == 0
    assert mem.trainer_resident == plain.trainer_resident + mem.weights
    assert mem.trainer_total == mem.weights * 2 + mem.grads + mem.optimizer + mem.logits + mem.activations
    assert mem.logits == 2 * 2 * 1024 * 128_256 * 4  # two fp32 copies of one micro-batch
    assert mem.kv_cache == 3 << 30 and plain.kv_cache == plain.kv_available
    engine = mem.rollout_weights + (3 << 30)
    assert mem.phases(engine_sleeps=False) == {
        "rollout": mem.trainer_resident + engine, "train": mem.trainer_total + engine,
        "push": mem.trainer_state + mem.push + engine}
    # An engine that sleeps is out of the train phase and holds only its weights during the push.
    assert mem.phases() == {"rollout": mem.trainer_resident + engine, "train": mem.trainer_total,
                            "push": mem.trainer_state + mem.push + mem.rollout_weights}
    # Without a recipe KV size the rollout phase holds vLLM's whole share, as before.
    assert plain.phases()["rollout"] == plain.trainer_resident + plain.engine_share
    with_share = dataclasses.replace(plain, kv_cache_bytes=None)
    assert with_share.engine == plain.engine_share
