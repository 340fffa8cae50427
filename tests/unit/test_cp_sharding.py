"""Context parallelism's pure parts (issue 23): the index maps against Megatron's and TE's
conventions, the shard <-> completion-view maps, the CP share of the loss, Megatron's scaling and
the layout rules. Single process; tests/dist/test_cp.py runs them on real CP groups."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import TokenInputs
from megatron_gtpo.models.shape import shape_from_hf_config
from megatron_gtpo.parallel.cp_index import (cp_attention_mask, cp_padded_length, gathered_index, inverse_index,
                                             load_balanced_index, thd_partitioned_index)
from megatron_gtpo.parallel.dims import ParallelConfig
from megatron_gtpo.parallel.layout import context_parallel_problems, world_problem
from megatron_gtpo.train.batching import micro_batches, packed_micro_batches
from megatron_gtpo.train.cp_shard import shard_micro_batch
from megatron_gtpo.train.model import sequence_multiple
from megatron_gtpo.train.plan import megatron_loss_scale
from megatron_gtpo.train.model_input import block_causal_mask
from megatron_gtpo.utils.configuration import ConfigError
from tests.algo_helpers import spec_of
from tests.dist.scripts._trainstep_common import PAD, make_batch, tiny_config


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


def _te_partitioned_index(cu_padded: list[int], world: int, rank: int) -> list[int]:
    """Transformer Engine's ``thd_partition_indices_kernel``, token by token."""
    local_cu = [c // world for c in cu_padded]
    out = []
    for token in range(cu_padded[-1] // world):
        seq = max(i for i in range(len(local_cu) - 1) if local_cu[i] <= token)
        seq_len, index = local_cu[seq + 1] - local_cu[seq], token - local_cu[seq]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + local_cu[seq] * world + seq_len // 2 * offset)
    return out


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_load_balanced_index_is_megatrons_split(cp, monkeypatch):
    from megatron.core import utils as mutils

    monkeypatch.setattr(mutils, "get_pg_size", lambda group: group.size())
    monkeypatch.setattr(mutils, "get_pg_rank", lambda group: group.rank())
    seq = 4 * cp * 3
    tokens = torch.arange(seq)[None, :].expand(2, -1)
    for rank in range(cp):
        theirs = mutils.get_batch_on_this_cp_rank({"tokens": tokens.clone()}, cp_group=_Group(cp, rank))["tokens"]
        assert torch.equal(theirs[0], load_balanced_index(seq, cp, rank)), rank
    assert load_balanced_index(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_thd_index_is_tes_partition_and_every_map_partitions_the_sequence(cp):
    m = 2 * cp if cp > 1 else 1
    cu = torch.tensor([0, 2 * m, 3 * m, 6 * m, 7 * m])
    for rank in range(cp):
        assert thd_partitioned_index(cu, cp, rank).tolist() == _te_partitioned_index(cu.tolist(), cp, rank)
    for per_rank in ([thd_partitioned_index(cu, cp, r) for r in range(cp)],
                     [load_balanced_index(6 * m, cp, r) for r in range(cp)]):
        assert sorted(gathered_index(per_rank).tolist()) == list(range(sum(len(x) for x in per_rank)))
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        thd_partitioned_index(torch.tensor([0, 6]), 4, 0)
    with pytest.raises(ValueError, match="multiple of 2 x cp"):
        load_balanced_index(10, 4, 0)
    assert cp_padded_length(5, 2) == 8 and cp_padded_length(5, 1) == 5


def test_cp_attention_mask_is_the_global_block_causal_mask_in_any_order():
    cu = torch.tensor([0, 8, 12, 24])
    dense = block_causal_mask(cu, 24)[0, 0]
    keys = gathered_index([thd_partitioned_index(cu, 2, r) for r in range(2)])
    for rank in range(2):
        q = thd_partitioned_index(cu, 2, rank)
        assert torch.equal(cp_attention_mask(q, keys, cu)[0, 0], dense[q][:, keys])
    q = load_balanced_index(16, 2, 1)
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)
    keys = gathered_index([load_balanced_index(16, 2, r) for r in range(2)])
    assert torch.equal(cp_attention_mask(q, keys)[0, 0], causal[q][:, keys])


def _micro_batches(batch, packed: bool):
    if packed:
        return packed_micro_batches(batch, slice(0, batch.size), token_budget=40, count=4, common_length=False)
    return micro_batches(batch, slice(0, batch.size), micro_batch_size=3, common_length=False, pad_to_multiple=4)


@pytest.mark.parametrize("packed", [False, True])
def test_cp_shards_partition_every_completion_and_map_back(packed):
    batch = make_batch(5, num_groups=3, group_size=4)
    for mb in _micro_batches(batch, packed):
        shards = [shard_micro_batch(mb, cp=2, rank=r, pad_id=PAD) for r in range(2)]
        full = shards[0].mb  # packed: re-laid with every sequence padded to 2 x cp
        assert torch.equal(sum(s.held.long() for s in shards), batch.mask[mb.rows, :mb.width].long())
        seq = torch.randn(full.input_ids.shape)  # an output at every sequence position (predicting g + 1)
        together = sum(s.take(seq[:, s.seq_index]) for s in shards)
        assert torch.equal(together, full.take(torch.roll(seq, 1, dims=1)))  # MicroBatch.take: predicted-aligned
        values = torch.randn(len(mb.rows), mb.width)
        for s in shards:
            assert torch.equal(s.take(s.to_shard(values)), torch.where(s.held, values, 0.0))
            assert torch.equal(s.targets, torch.roll(full.input_ids, -1, dims=1)[:, s.seq_index])
            assert torch.equal(s.position_ids, full.position_ids[:, s.seq_index])
        if packed:  # the re-laid row holds the same sequences, each padded to a multiple of 4
            cu = full.cu_seqlens.long()
            assert bool(((cu[1:] - cu[:-1]) % 4 == 0).all())
            for b, row in enumerate(mb.rows.tolist()):
                n = int(batch.lengths[row])
                old = mb.input_ids[0, int(mb.start[b]):int(mb.start[b]) + n]
                assert torch.equal(full.input_ids[0, int(full.start[b]):int(full.start[b]) + n], old)
                assert int(full.position_ids[0, int(full.start[b])]) == int(batch.prompt_lengths[row])
            real = shards[0].cu_seqlens.long()
            assert (real[1:len(mb.rows) + 1] - real[:len(mb.rows)]).tolist() == \
                (batch.prompt_lengths + batch.lengths)[mb.rows].tolist()


def _held_split(mask: torch.Tensor) -> list[torch.Tensor]:
    """A load-balanced split of each row's completion positions over 2 ranks: row b's completion
    starts at column 3 of a 16-token sequence, so its first tokens, middle and end alternate ranks
    (a conflict prefix and the completion's end land on different ranks)."""
    owner = torch.zeros(16, dtype=torch.long)
    owner[load_balanced_index(16, 2, 1)] = 1
    cols = (torch.arange(mask.shape[1]) + 2).clamp(max=15)  # predicting position of column t: start - 1 + t
    return [(owner[cols] == r)[None, :].expand_as(mask) & mask for r in range(2)]


@pytest.mark.parametrize("name", ["gtpo", "grpo", "dapo", "drgrpo"])
def test_cp_shard_losses_add_up_to_the_one_process_loss(name):
    """The per-rank shares (each rank's held tokens, the WHOLE completion lengths) sum to
    compute_loss, in value and gradient, and their D2 weights and KL parts to the whole batch's."""
    batch = make_batch(1, num_groups=2, group_size=4)
    spec = spec_of(name, max_completion_tokens=16, **({"kl_beta": 0.04} if name == "grpo" else {}))
    prepared = algo.prepare_groups(spec, token_ids=batch.token_ids, mask=batch.mask, rewards=batch.rewards,
                                   group_ids=batch.group_ids)
    if prepared.needs_entropy:
        prepared = algo.shape_rows(spec, prepared, torch.linspace(0.2, 1.2, batch.size))
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(batch.mask.shape, generator=g, dtype=torch.float64)).requires_grad_()
    ref = -torch.rand(batch.mask.shape, generator=g, dtype=torch.float64) if spec.kl_beta else None
    tokens = TokenInputs(logp=logp, mask=batch.mask, ref_logp=ref)
    norms = dict(num_tokens=float(batch.mask.sum()), num_seqs=float(batch.size))
    whole, _ = algo.compute_loss(spec, tokens, prepared, **norms)
    (grad_whole,) = torch.autograd.grad(whole, logp)
    held = _held_split(batch.mask)
    assert all(bool(h.any()) for h in held) and torch.equal(held[0] | held[1], batch.mask)
    lengths = batch.lengths
    share_tokens = [dataclasses.replace(tokens, mask=h, lengths=lengths) for h in held]
    shares = [algo.compute_loss(spec, t, prepared, **norms)[0] for t in share_tokens]
    (grad_shares,) = torch.autograd.grad(sum(shares), logp)
    assert abs(float(sum(shares).detach() - whole.detach())) <= 1e-12 * max(abs(float(whole.detach())), 1.0)
    assert torch.allclose(grad_shares, grad_whole, rtol=1e-12, atol=1e-15)
    omega = sum(algo.token_omega(spec, h, prepared, lengths=lengths, check=False, **norms) for h in held)  # D2's weights
    assert torch.allclose(omega, algo.token_omega(spec, batch.mask, prepared, **norms), rtol=1e-12, atol=0)
    if spec.kl_beta:
        kl = algo.kl_k3(logp.detach(), ref)
        parts = sum(algo.kl_penalty(spec, kl, h, prepared, lengths=lengths, check=False, **norms) for h in held)
        assert float(parts) == pytest.approx(float(algo.kl_penalty(spec, kl, batch.mask, prepared, **norms)), rel=1e-12)
    if spec.agg_mode == "seq-mean-token-mean":  # without the whole lengths the shares count held tokens as |o_i|
        naive = sum(algo.compute_loss(spec, dataclasses.replace(tokens, mask=h), prepared, **norms)[0] for h in held)
        assert abs(float((naive - whole).detach())) > 1e-6


def test_cp_megatron_loss_scale_undoes_the_schedule_and_ddp():
    from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss

    config = SimpleNamespace(calculate_per_token_loss=False, timers=None, num_moe_experts=None, mtp_num_layers=None)
    for microbatches, dp, cp in ((1, 1, 1), (3, 2, 2), (4, 1, 4), (2, 3, 2)):
        out, _ = forward_step_calc_loss(SimpleNamespace(), torch.ones((), dtype=torch.float64), lambda t: (t, {}), config, None, False,
                                        microbatches, [], cp_group_size=cp, is_last_stage=True)
        ddp = 1.0 / (dp * cp)  # DistributedDataParallel's gradient scaling over the DP x CP group
        scale = megatron_loss_scale(num_microbatches=microbatches, dp_size=dp, cp_size=cp)
        assert float(out) * ddp * scale == pytest.approx(1.0, rel=1e-12)
        assert scale == microbatches * dp
    with pytest.raises(ValueError, match="cp_size=0"):
        megatron_loss_scale(num_microbatches=1, dp_size=1, cp_size=0)


def test_cp_sequence_multiple_and_layout_rules():
    def config(**kw):
        return SimpleNamespace(**{"context_parallel_size": 1, "fp8": None, "sequence_parallel": False,
                                  "tensor_model_parallel_size": 1, **kw})

    assert sequence_multiple(config()) == 1 and sequence_multiple(config(context_parallel_size=2)) == 4
    assert sequence_multiple(config(context_parallel_size=2, fp8="hybrid")) == 32  # 16 tokens per CP rank
    assert sequence_multiple(config(context_parallel_size=3, sequence_parallel=True,
                                    tensor_model_parallel_size=2)) == 6
    shape = shape_from_hf_config(tiny_config(tied=False), name="tiny")  # 4 heads
    assert context_parallel_problems(shape, tp=1, cp=2) == []
    assert context_parallel_problems(shape, tp=1, cp=2, comm_type="a2a") == []
    (kv,) = context_parallel_problems(shape, tp=1, cp=4, comm_type="a2a")  # TE's a2a splits the KV heads too
    assert "2 KV heads" in kv and "parallel.cp among 1, 2" in kv
    a2a, _ = context_parallel_problems(shape, tp=2, cp=4, comm_type="a2a")  # the heads, then the KV heads
    assert "parallel.cp among 1, 2" in a2a and "cp_comm_type" in a2a
    (local,) = context_parallel_problems(shape, tp=1, cp=2, cp_attention=False)
    assert "parallel.cp=2" in local and "Transformer Engine" in local and "parallel.cp=1" in local
    assert "a2a+p2p" in context_parallel_problems(shape, tp=1, cp=2, comm_type="a2a+p2p")[0]
    assert "TP x CP x PP = 2 x 2 x 1 = 4" in world_problem(6, tp=2, cp=2, pp=1)
    assert world_problem(8, tp=2, cp=2, pp=1) is None
    assert ParallelConfig(tp=2, cp=2, dp=3).world_size == 12
    with pytest.raises(ConfigError, match="cp=0"):
        ParallelConfig(cp=0)


def test_cp_layer_spec_swaps_in_the_cpu_standin_and_refuses_specs_without_cp_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_gtpo.parallel.cp_attention import cp_layer_spec, standin_class

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    core = spec.submodules.self_attention.submodules
    assert cp_layer_spec(spec, cp=1, on_gpu=False) is spec
    swapped = cp_layer_spec(spec, cp=2, on_gpu=False).submodules.self_attention.submodules.core_attention
    assert swapped is standin_class() and issubclass(swapped, DotProductAttention)
    assert swapped.__name__ == "CPUContextParallelAttention" and core.core_attention is DotProductAttention
    with pytest.raises(ValueError, match="parallel.cp=2.*local spec"):
        cp_layer_spec(spec, cp=2, on_gpu=True)
    other = dataclasses.replace(core, core_attention=torch.nn.Identity)
    odd = dataclasses.replace(spec, submodules=dataclasses.replace(
        spec.submodules, self_attention=dataclasses.replace(spec.submodules.self_attention, submodules=other)))
    with pytest.raises(ValueError, match="no context-parallel attention"):
        cp_layer_spec(odd, cp=2, on_gpu=False)


def test_cp_shard_needs_a_prompt_token_and_inverse_index_marks_other_ranks():
    batch = make_batch(1, num_groups=1, group_size=2)
    (mb,) = micro_batches(batch, slice(0, 2), micro_batch_size=2, common_length=False, pad_to_multiple=4)
    with pytest.raises(ValueError, match="prompt of >= 1 token"):
        shard_micro_batch(dataclasses.replace(mb, start=torch.zeros_like(mb.start)), cp=2, rank=0, pad_id=PAD)
    inv = inverse_index(load_balanced_index(8, 2, 1), 8)
    assert inv.tolist() == [-1, -1, 0, 1, 2, 3, -1, -1]


def test_cp_dry_run_layout_multiplies_cp_into_the_world():
    from megatron_gtpo.plan.layout import LayoutError, LayoutRequest, plan_layout

    shape = shape_from_hf_config(tiny_config(tied=False), name="tiny")
    lay = plan_layout(LayoutRequest(shape=shape, nodes=1, gpus_per_node=8, tp=2, pp=1, cp=2, prompts_per_step=2,
                                    group_size=4, max_prompt_tokens=16, max_completion_tokens=16))
    assert (lay.tp, lay.cp, lay.dp, lay.world) == (2, 2, 2, 8)
    with pytest.raises(LayoutError) as err:
        plan_layout(LayoutRequest(shape=shape, nodes=1, gpus_per_node=6, tp=2, pp=1, cp=4, cp_comm_type="a2a"))
    text = str(err.value)
    assert "TP*CP*PP = 2*4*1 = 8" in text and "parallel.cp among 1, 2" in text
