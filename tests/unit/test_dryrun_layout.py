"""dry-run arithmetic: parameter counts, layout rules and the memory estimate, against hand-computed values."""

from __future__ import annotations

import pytest

from megatron_gtpo.plan.layout import LayoutError, LayoutRequest
from megatron_gtpo.plan.layout import plan_layout as _plan
from megatron_gtpo.plan.memory import (GIB, EngineBudget, MemorySizes, check_engine_start, check_memory,
                                       estimate_memory, stage_params)
from megatron_gtpo.models.shape import load_model_shape, shape_from_hf_config
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO

LLAMA = load_model_shape(REPO / "configs" / "models" / "llama3-8b.json")
QWEN = load_model_shape(REPO / "configs" / "models" / "qwen2.5-32b.json")

# A layout that passes every rule for Llama-3-8B on 2 x 8 GPUs; tests change one thing at a time.
LLAMA_2X8 = dict(shape=LLAMA, nodes=2, gpus_per_node=8, tp=2, pp=1, vpp=None, dp=8, placement="colocated",
                 rollout_tp=1, engines=None, prompts_per_step=64, group_size=8, rows_per_micro_batch=4,
                 max_prompt_tokens=1024, max_completion_tokens=1024)


def plan_layout(**fields):
    return _plan(LayoutRequest(**fields))


def test_parameter_counts_match_the_published_checkpoints():
    # Llama-3-8B: 8,030,261,248 (Meta's model card, "8.03B"); Qwen2.5-32B: the safetensors total on the Hub.
    assert LLAMA.params_total() == 8_030_261_248
    assert QWEN.params_total() == 32_763_876_352
    assert (QWEN.kv_heads, QWEN.head_dim, QWEN.qkv_bias, QWEN.tied_embeddings) == (8, 128, True, False)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3"])
def test_parameter_count_equals_transformers_model(family):
    """The formula per family (biases, q/k norms, head_dim != hidden/heads, tied embeddings) against
    the real HF module of a tiny random model."""
    import transformers

    from tests.tiny_hf import tiny_hf_config

    raw = tiny_hf_config(family)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    assert shape_from_hf_config(raw, name=family).params_total() == sum(p.numel() for p in model.parameters())


def test_unsupported_configs_are_rejected_with_the_key():
    with pytest.raises(ConfigError, match=r"model_type='gpt2' \(and no 'architectures'\) is not supported"):
        shape_from_hf_config({"model_type": "gpt2"}, name="x")
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        shape_from_hf_config({"model_type": "qwen2", "num_experts": 8}, name="x")
    with pytest.raises(ConfigError, match="hidden_size must be a positive integer"):
        shape_from_hf_config({"model_type": "llama", "num_attention_heads": 8}, name="x")


def test_llama3_8b_on_2x8_gpus():
    lay = plan_layout(**LLAMA_2X8)
    assert (lay.tp, lay.pp, lay.dp, lay.world, lay.trainer_nodes) == (2, 1, 8, 16, 2)
    assert (lay.engines, lay.rollout_tp, lay.sequences_per_engine) == (16, 1, 32)
    assert (lay.sequences, lay.microbatches, lay.seq_len) == (512, 16, 2048)  # 512 / (8 DP * 4)
    assert lay.warnings == []


def test_qwen25_32b_on_4x8_gpus_with_interleaved_pipeline():
    lay = plan_layout(**{**LLAMA_2X8, "shape": QWEN, "nodes": 4, "tp": 4, "pp": 2, "vpp": 2, "dp": 4,
                         "rollout_tp": 4, "rows_per_micro_batch": 2})
    assert (lay.dp, lay.layers_per_stage, lay.engines, lay.sequences_per_engine) == (4, 32, 8, 64)
    assert lay.microbatches == 64  # 512 / (4 DP * 2): a multiple of PP, as the interleaved schedule needs


def test_every_violated_rule_is_reported_with_its_key():
    with pytest.raises(LayoutError) as err:
        plan_layout(**{**LLAMA_2X8, "shape": QWEN, "nodes": 4, "tp": 16, "pp": 3, "dp": None, "rollout_tp": 3,
                       "prompts_per_step": 60, "rows_per_micro_batch": 7, "max_completion_tokens": 200_000})
    text = "\n".join(err.value.problems)
    for expected in ["num_attention_heads=40 is not divisible by TP=16",
                     "num_key_value_heads=8 is not divisible by TP=16",
                     "num_hidden_layers=64 is not divisible by PP=3", "32 trainer GPUs are not divisible by TP*PP",
                     "global batch of 480 sequences", "exceeds the model's max_position_embeddings=131072",
                     "not divisible by the rollout TP=3", "num_key_value_heads=8 and rollout TP=3",
                     "rollout TP=3 must divide the 8 GPUs of a node"]:
        assert expected in text
    assert len(err.value.problems) == 9


@pytest.mark.parametrize("change, message", [
    ({"rows_per_micro_batch": 3}, "global batch of 512 sequences (train.prompts_per_step x rollout.n) is not divisible "
                              "by parallel.dp x train.micro_batch_size = 8 x 3 = 24"),
    ({"dp": 1}, "parallel.dp=1, but 16 trainer GPUs / (TP*PP = 2) give 8 data-parallel ranks: set parallel.dp=8"),
    ({"vpp": 2}, "VPP=2 needs PP >= 2"),
    ({"pp": 2, "vpp": 3, "dp": 4}, "16 layers per PP stage (num_hidden_layers=32 / PP=2) are not divisible by VPP=3"),
    ({"pp": 2, "vpp": 2, "dp": 4, "prompts_per_step": 3, "rows_per_micro_batch": 2},
     "micro-batches per DP rank (3) to be a multiple of PP=2"),
    ({"placement": "separate", "engines": 2, "rollout_tp": 8}, "leaving none of the 2 for the trainer"),
    ({"rollout_tp": 16}, "an engine spanning nodes needs a Ray cluster"),
    ({"engines": 4}, "16 engines of TP=1, not 4"),
])
def test_each_rule(change, message):
    with pytest.raises(LayoutError) as err:
        plan_layout(**{**LLAMA_2X8, **change})
    assert message in str(err.value)


def test_separate_placement_gives_each_rollout_server_a_node_of_its_own():
    lay = plan_layout(**{**LLAMA_2X8, "nodes": 3, "placement": "separate", "engines": 1, "rollout_tp": 4})
    assert (lay.trainer_nodes, lay.rollout_nodes, lay.world, lay.engines) == (2, 1, 16, 1)
    assert lay.sequences_per_engine == 512
    assert any("leaves 4 GPU(s) of its node idle" in w for w in lay.warnings)
    lay = plan_layout(**{**LLAMA_2X8, "nodes": 4, "placement": "separate", "engines": 2, "rollout_tp": 8})
    assert (lay.trainer_nodes, lay.rollout_nodes, lay.engines, lay.sequences_per_engine) == (2, 2, 2, 256)


def test_rollout_servers_hold_the_batches_of_k_steps_and_their_kv_cache_counts_them():
    pool = {**LLAMA_2X8, "nodes": 4, "placement": "separate", "engines": 2, "rollout_tp": 8}
    on, off = plan_layout(**pool), plan_layout(**{**pool, "staleness": 3})
    assert (on.sequences_in_flight, off.sequences_in_flight) == (256, 3 * 256)
    sizes = MemorySizes(distributed_optimizer=True)
    assert estimate_memory(LLAMA, off, sizes).kv_needed == 3 * estimate_memory(LLAMA, on, sizes).kv_needed
    tight = MemorySizes(distributed_optimizer=True, kv_cache_bytes=estimate_memory(LLAMA, on, sizes).kv_needed)
    assert check_memory(estimate_memory(LLAMA, on, tight), on)[1] == []
    assert any("KV cache for all 768 sequences" in w for w in check_memory(estimate_memory(LLAMA, off, tight), off)[1])
    # colocated engines generate the batches ahead one at a time
    assert plan_layout(**{**LLAMA_2X8, "staleness": 3}).sequences_in_flight == plan_layout(**LLAMA_2X8).sequences_per_engine


def test_vllm_replicates_kv_heads_beyond_their_count():
    shape = shape_from_hf_config({"model_type": "qwen2", "num_attention_heads": 8, "num_key_value_heads": 2,
                                  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                                  "vocab_size": 1000, "max_position_embeddings": 512}, name="t")
    assert [shape.kv_heads_per_rank(tp) for tp in (1, 2, 4, 8)] == [2, 1, 1, 1]
    # vLLM accepts TP=4 with 2 KV heads (replication); Megatron does not.
    plan_layout(**{**LLAMA_2X8, "shape": shape, "tp": 2, "rollout_tp": 4, "max_completion_tokens": 100,
                   "max_prompt_tokens": 100})
    with pytest.raises(LayoutError, match="num_key_value_heads=2 is not divisible by TP=4"):
        plan_layout(**{**LLAMA_2X8, "shape": shape, "tp": 4, "dp": 4, "max_completion_tokens": 100,
                       "max_prompt_tokens": 100})


def test_memory_estimate_llama3_8b_tp2_by_hand():
    lay = plan_layout(**LLAMA_2X8)
    # One TP=2 rank of a block: q 4096x2048 + k,v 4096x512 each + o 2048x4096 + MLP 3x4096x14336/2 + 2 norms.
    block = 4096 * (2048 + 2 * 512) + 2048 * 4096 + 3 * 4096 * 14336 // 2 + 2 * 4096
    params = 32 * block + 2 * 128_256 * 4096 // 2 + 4096  # + embedding and output halves + final norm
    assert stage_params(LLAMA, lay) == params == 4_015_263_744
    mem = estimate_memory(LLAMA, lay, MemorySizes(distributed_optimizer=True, gpu_memory_utilization=0.5))
    assert (mem.weights, mem.grads, mem.optimizer) == (2 * params, 4 * params, 12 * params // 8)
    assert mem.logits == 2 * 4 * 2048 * (128_256 // 2) * 2  # two bf16 copies (the output layer returns bf16)
    assert mem.rollout_weights == 2 * 8_030_261_248 - 2 * 4096  # the engine keeps no final-norm-free copy
    # vLLM's layer-wise reload holds one TP=1 layer; one gathered tensor: the 128256 x 4096 embedding
    assert mem.push == 2 * LLAMA.layer_params(1) + 2 * 128_256 * 4096
    assert mem.kv_per_sequence == 2048 * 2 * 32 * 8 * 128 * 2  # tokens x (K,V) x layers x KV heads x dim x bf16
    assert mem.kv_needed == 32 * mem.kv_per_sequence
    assert mem.trainer_resident == mem.weights + mem.grads + mem.optimizer and not mem.planned
    assert mem.push_phase == mem.trainer_resident + mem.rollout_weights + mem.push
    assert check_memory(mem, lay) == ([], [])


def test_planned_vllm_share_is_what_the_rollout_phase_leaves():
    lay = plan_layout(**LLAMA_2X8)
    mem = estimate_memory(LLAMA, lay, MemorySizes(distributed_optimizer=True))
    left = (80 * GIB * 0.95 - mem.trainer_resident) / (80 * GIB)
    assert mem.planned and mem.gpu_memory_utilization == int(left * 100) / 100 == 0.59
    assert check_memory(mem, lay) == ([], [])
    offloaded = estimate_memory(LLAMA, lay, MemorySizes(distributed_optimizer=True, offload_trainer=True))
    assert offloaded.trainer_resident == offloaded.weights and offloaded.gpu_memory_utilization == 0.85
    # A recipe share that leaves the trainer too little is refused, with the share that fits.
    problems, _ = check_memory(estimate_memory(LLAMA, lay, MemorySizes(distributed_optimizer=True,
                                                                        gpu_memory_utilization=0.9)), lay)
    assert len(problems) == 1 and "set rollout.vllm.gpu_memory_utilization <= 0.59" in problems[0]
    assert "rollout.offload_trainer=true" in problems[0]


def test_engine_start_is_refused_with_the_numbers_when_the_share_is_not_free():
    budget = EngineBudget(gpu_memory_utilization=0.6, planned=True, trainer_resident=30 * GIB)
    check_engine_start(budget, free=50 * GIB, total=80 * GIB)  # 48 GiB fit
    with pytest.raises(ConfigError) as err:
        check_engine_start(budget, free=40 * GIB, total=80 * GIB)
    for part in ("gpu_memory_utilization=0.6 x 80.0 GiB = 48.0 GiB", "planned from the memory plan",
                 "only 40.0 GiB are free", "trainer to hold 30.0 GiB", "<= 0.50", "rollout.offload_trainer=true"):
        assert part in str(err.value)


def test_memory_that_cannot_fit_is_rejected_phase_by_phase():
    lay = plan_layout(**{**LLAMA_2X8, "shape": QWEN, "nodes": 4, "tp": 1, "dp": 32, "rows_per_micro_batch": 2})
    mem = estimate_memory(QWEN, lay, MemorySizes())
    problems, _ = check_memory(mem, lay)
    # Unsharded: 2 + 4 + 12 bytes per parameter plus one micro-batch of logits (2 bf16 copies) and activations.
    assert mem.trainer_total == 18 * 32_763_876_352 + 2 * 2 * 2048 * 152_064 * 2 + mem.activations
    assert any(f"trainer needs {mem.trainer_total / GIB:.1f} GiB per GPU" in p for p in problems)
    assert any(p.startswith("weight push: trainer") for p in problems)
    # The engine alone: 61 GiB of bf16 weights fits 0.9 x 80 GiB, not 0.5 x 80 GiB.
    sep = plan_layout(**{**LLAMA_2X8, "shape": QWEN, "nodes": 4, "tp": 1, "dp": 24, "rows_per_micro_batch": 2,
                         "prompts_per_step": 48, "placement": "separate"})
    assert any("raise rollout.vllm.tensor_parallel_size" in p for p in check_memory(
        estimate_memory(QWEN, sep, MemorySizes(gpu_memory_utilization=0.5)), sep)[0])
    assert not any("tensor_parallel_size" in p for p in check_memory(estimate_memory(QWEN, sep, MemorySizes()), sep)[0])


def test_qwen25_32b_engine_tp4_layout_fits_4x8():
    lay = plan_layout(**{**LLAMA_2X8, "shape": QWEN, "nodes": 4, "tp": 4, "pp": 2, "vpp": 2, "dp": 4,
                         "rollout_tp": 4, "rows_per_micro_batch": 2})
    mem = estimate_memory(QWEN, lay, MemorySizes(distributed_optimizer=True))
    assert check_memory(mem, lay)[0] == [] and 0.5 <= mem.gpu_memory_utilization <= 0.6


@pytest.mark.parametrize("path", ["llama3-8b.json", "qwen2.5-32b.json"])
def test_model_builder_raises_every_dry_run_problem(path):
    """The model builder (train.model.check_layout) and the dry-run share one rule set
    (parallel.layout.model_split_problems): the builder raises exactly when the dry-run objects."""
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.parallel.layout import model_split_problems
    from megatron_gtpo.train.model import check_layout

    raw = read_hf_config(REPO / "configs" / "models" / path)
    shape = load_model_shape(REPO / "configs" / "models" / path)
    for tp in (1, 2, 3, 4, 5, 8, 16):
        for pp, vpp in ((1, None), (2, None), (3, None), (4, 2), (2, 3), (8, 4)):
            problems = model_split_problems(shape, tp=tp, pp=pp, vpp=vpp)
            try:
                check_layout(raw, tp=tp, pp=pp, vpp=vpp)
                builder_ok = True
            except ConfigError as err:
                builder_ok = False
                assert all(p in str(err) for p in problems), (err, problems)
            assert (problems == []) == builder_ok, (tp, pp, vpp, problems)
