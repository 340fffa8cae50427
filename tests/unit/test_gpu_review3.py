"""Refusals from the third GPU-readiness review (issue 33) that validation makes before anything
starts: each names the key and the fix. The CP recipe's dry-run line with ``cp_comm_type:
all_gather`` fails where Transformer Engine would (packed rows), and passes padded."""

from __future__ import annotations

import pytest

from megatron_gtpo.cli import dry_run
from megatron_gtpo.config import load_config
from megatron_gtpo.models.config import ModelConfig
from megatron_gtpo.utils.configuration import ConfigError
from tests.helpers import REPO
from tests.unit.test_gpu_recipes import _dry_run_line

TINY = str(REPO / "configs" / "tiny.yaml")
PACKED = ["parallel.cp=2", "train.micro_batch_tokens=null"]  # tiny.yaml's own micro-batches are padded
CP_RECIPE = REPO / "configs" / "gpu" / "gtpo_qwen3-8b_32k_2x8_cp.yaml"


def test_cp_all_gather_with_packed_micro_batches_is_refused_naming_the_key_and_the_fix():
    """N2: TE's all-gather CP attention asserts ``qkv_format != "thd"``, and packed rows reach it as
    THD: validation accepted the pair and the run crashed at the first forward. Injected:
    ``cp_packing_problem`` returning None -> no ConfigError, this fails."""
    with pytest.raises(ConfigError, match=r"cp_comm_type='all_gather' cannot take packed micro-batches.*"
                                          r"p2p or a2a.*train.micro_batch_tokens=0"):
        load_config(TINY, [*PACKED, "model.megatron.cp_comm_type=all_gather"])
    padded = load_config(TINY, ["parallel.cp=2", "model.megatron.cp_comm_type=all_gather", "train.micro_batch_tokens=0"])
    assert padded.token_budget == 0
    for kind in ("p2p", "a2a"):  # TE's THD paths
        load_config(TINY, [*PACKED, f"model.megatron.cp_comm_type={kind}"])
    load_config(TINY, ["train.micro_batch_tokens=null", "model.megatron.cp_comm_type=all_gather"])  # CP=1: no CP attention at all


def test_cp_recipe_dry_run_refuses_all_gather_packed_and_takes_it_padded(capsys):
    line = _dry_run_line(CP_RECIPE)
    assert dry_run.main([*line, "model.megatron.cp_comm_type=all_gather"]) == 2  # a config error
    out = capsys.readouterr()
    assert "cannot take packed micro-batches" in out.out + out.err
    padded = ["train.micro_batch_tokens=0", "train.micro_batch_size=1"]  # one 32k row per micro-batch, as packed
    assert dry_run.main([*line, "model.megatron.cp_comm_type=all_gather", *padded]) == 0


def test_router_fusion_with_routing_replay_is_refused():
    """N4: Megatron 0.16.1's fused router returns TE's top-k before it consults the replay, so
    ``moe_router_fusion: true`` silently turned ``moe_routing_replay: rollout`` off. Injected: the
    ``require`` on moe_router_fusion removed -> no ConfigError, this fails."""
    with pytest.raises(ConfigError, match="moe_routing_replay.*moe_router_fusion: true.*bypasses the replay"):
        ModelConfig(moe_routing_replay="rollout", megatron={"moe_router_fusion": True})
    ModelConfig(megatron={"moe_router_fusion": True})  # without replay the fused router is fine


def test_freezing_the_heap_frees_the_garbage_of_reference_cycles_first():
    """N6: ``gc.freeze()`` without a collection first moved unreachable reference cycles (maybe
    holding device memory) into the permanent generation, never freed. Injected: no ``gc.collect()``
    in ``freeze_imported_heap`` -> the cycle's object outlives the freeze, this fails."""
    import gc
    import weakref

    from megatron_gtpo.utils.runtime import freeze_imported_heap

    class Node:
        pass

    gc.disable()  # no automatic collection between the del and the freeze: only the function's own
    try:
        node = Node()
        node.self = node  # a cycle: only the cycle collector frees it
        alive = weakref.ref(node)
        del node
        freeze_imported_heap()
        assert alive() is None, "a garbage cycle was frozen instead of freed"
    finally:
        gc.unfreeze()
        gc.enable()


def test_only_the_first_rank_of_an_engine_sends_its_completions(monkeypatch):
    """N5: every rank of a TP=k engine sent the same completions (with a mixture's routed experts,
    ~1.5 MB each at 30B scale) to the all-gather, and all but the first copy were dropped: k times
    the bytes over gloo. Injected: every rank sends its shard -> rank 1's payload is not None, this fails."""
    from types import SimpleNamespace

    from megatron_gtpo.parallel import control
    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.rollout.group import RolloutGroup
    from megatron_gtpo.types import Prompt

    def completions():
        return [SimpleNamespace(prompt_index=0, prompt_token_ids=None) for _ in range(2)]

    engine = SimpleNamespace(submit=lambda prompts, seeds, sampling: completions(), wait=lambda ticket: ticket)
    sent = []

    def gather(payload, records=()):
        sent.append(payload)
        return [(0, completions()), payload]  # rank 0 (the engine's first rank), then this rank

    monkeypatch.setattr(control, "world", lambda: (1, 2))
    monkeypatch.setattr(control, "all_gather_data", gather)
    group = RolloutGroup(engine, shard=True, model_dir="/m", ranks_per_engine=2)
    prompt = Prompt(uid="p", token_ids=[1, 2])
    out = group.generate([prompt], Sampling(n=2, temperature=1.0, max_tokens=4))
    assert sent == [(0, None)] and len(out) == 2 and all(c.prompt_token_ids == [1, 2] for c in out)


def test_moe_dry_run_states_the_routing_bytes_per_step(capsys):
    """N5 on paper: the 1x8 MoE recipe's dry-run prints what the routed experts cost per step (256
    sequences of up to 2012 tokens x 48 layers x top-8 x int16 = 0.37 GiB to every rank, once per
    engine); a dense recipe prints no such line."""
    moe = REPO / "configs" / "gpu" / "gtpo_qwen3-30b-a3b_1x8_moe.yaml"
    assert dry_run.main(_dry_run_line(moe)) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("routing"))
    assert "<= 0.37 GiB" in line and "256 sequences" in line and "8 ranks sending would be 8x" in line, line
    assert dry_run.main(_dry_run_line(REPO / "configs" / "gpu" / "gtpo_qwen2.5-3b_1x8.yaml")) == 0
    assert "routing" not in capsys.readouterr().out
