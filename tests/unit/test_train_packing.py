"""Packed micro-batches (train/batching.py, train/model_input.py): the token-budget partition, the
packed model input and its mapping back to the completion view, the block-diagonal causal mask, the
micro-batch count every DP rank agrees on, and the config's budget rules; single process, no
Megatron model (tests/dist/test_packing.py runs the packed train step against the padded one)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_gtpo.train.batching import (balanced_partition, fewest_bins, micro_batch_count, micro_batches,
                                          pack_rows, packed_micro_batches, row_tokens, token_budget_problem)
from megatron_gtpo.train.model_input import block_causal_mask
from tests.unit.test_train_batching import ROWS, batch_of

# prompt + completion tokens: 5, 5, 1, 7 (row 2 has an empty completion)


def _sequence_value(row: int, pos: int) -> float:
    """A distinct value for every (row, position in its own sequence)."""
    return 1000.0 * (row + 1) + pos


def test_packed_input_is_rows_back_to_back_with_restarting_positions():
    batch = batch_of(ROWS, pad=99)
    (mb,) = packed_micro_batches(batch, slice(0, 4), token_budget=18, count=1, common_length=False)
    assert mb.rows.tolist() == [0, 1, 2, 3] and mb.input_ids.shape == (1, 18)
    assert mb.input_ids[0].tolist() == [5, 6, 7, 8, 9, 5, 6, 10, 11, 12, 1, 3, 3, 3, 4, 4, 4, 4]
    assert mb.position_ids[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]
    assert mb.cu_seqlens.tolist() == [0, 5, 10, 11, 18] and mb.cu_seqlens.dtype == torch.int32
    assert mb.max_seqlen == 7 and mb.start.tolist() == [2, 9, 11, 14] and mb.width == 4


def test_take_maps_packed_outputs_to_the_same_completion_view_as_padded():
    """A model output that depends only on (row, position within the row's own sequence) must
    reach the loss identically through both layouts: this is what makes every per-token quantity
    (log-probs, entropies, and through the row indices the conflict masks and advantages) line up."""
    batch = batch_of(ROWS * 3, pad=99)
    (padded,) = micro_batches(batch, slice(0, 12), micro_batch_size=12, common_length=False)
    seq = torch.tensor([[_sequence_value(r, p) for p in range(padded.input_ids.shape[1])] for r in range(12)])
    want = padded.take(seq)
    for budget, count in ((60, 1), (20, 3), (20, 5), (7, 12)):
        mbs = packed_micro_batches(batch, slice(0, 12), token_budget=budget, count=count, common_length=False)
        assert len(mbs) == count and sorted(r for mb in mbs for r in mb.rows.tolist()) == list(range(12))
        for mb in mbs:
            seg = torch.searchsorted(mb.cu_seqlens[1:].long(), torch.arange(mb.input_ids.shape[1]), right=True)
            rows = torch.cat([mb.rows, torch.tensor([-1])])  # the padding tail maps to no row
            packed_seq = torch.tensor([[_sequence_value(int(rows[s]), int(p)) for s, p in
                                        zip(seg.tolist(), mb.position_ids[0].tolist())]])
            assert int((mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).max()) == mb.max_seqlen
            assert int(mb.cu_seqlens[len(mb.rows)]) <= budget  # real tokens within the budget
            got = mb.take(packed_seq)
            assert torch.equal(got, want[mb.rows, :mb.width]), (budget, count, mb.rows)
            assert torch.equal(mb.input_ids[0, :int(mb.cu_seqlens[-2])],
                               torch.cat([padded.input_ids[r, :int(n)] for r, n in
                                          zip(mb.rows.tolist(), row_tokens(batch)[mb.rows].tolist())])[
                                   :int(mb.cu_seqlens[-2])])


def test_common_length_and_multiple_pad_a_tail_segment():
    batch = batch_of(ROWS * 2, pad=99)
    mbs = packed_micro_batches(batch, slice(0, 8), token_budget=12, count=3, common_length=True, pad_to_multiple=8)
    assert {mb.input_ids.shape[1] for mb in mbs} == {16}  # the longest pack (<= 12) rounded to 8, for all
    for mb in mbs:
        real = int(row_tokens(batch)[mb.rows].sum())
        assert mb.cu_seqlens.tolist()[-2:] == [real, 16] and (mb.input_ids[0, real:] == 99).all()
        assert mb.position_ids[0, real:].tolist() == list(range(16 - real))


def test_block_causal_mask_keeps_attention_inside_each_sequence():
    cu = torch.tensor([0, 3, 4, 7], dtype=torch.int32)
    mask = block_causal_mask(cu, 7)
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == torch.bool
    seg = [0, 0, 0, 1, 2, 2, 2]
    want = [[not (seg[i] == seg[j] and j <= i) for j in range(7)] for i in range(7)]  # True = masked
    assert mask[0, 0].tolist() == want


def test_partition_fits_the_budget_covers_every_row_and_balances():
    rng = random.Random(0)
    for trial in range(60):
        lengths = [rng.choice([rng.randint(1, 30), rng.randint(30, 300)]) for _ in range(rng.randint(1, 40))]
        budget = max(lengths) + rng.randint(0, 400)
        fewest = fewest_bins(lengths, budget)
        assert fewest >= -(-sum(lengths) // budget)
        if fewest > 1:  # one bin fewer does not fit with the same (deterministic) partition
            assert max(sum(lengths[i] for i in b) for b in balanced_partition(lengths, fewest - 1)) > budget
        for count in range(fewest, len(lengths) + 1):
            bins = pack_rows(lengths, count, budget)
            assert len(bins) == count and all(bins), (trial, count)
            assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
            loads = [sum(lengths[i] for i in b) for b in bins]
            assert max(loads) <= budget, (trial, count, loads)
        assert bins == pack_rows(lengths, count, budget)  # deterministic: every PP stage packs alike
    # LPT balances: 10 rows of 100 and 10 of 10 in 4 bins -> 275 each, not 100 * 3 + ... lopsided
    loads = sorted(sum(([100] * 10 + [10] * 10)[i] for i in b) for b in balanced_partition([100] * 10 + [10] * 10, 4))
    assert loads[-1] - loads[0] <= 100 and sum(loads) == 1100


def test_every_dp_rank_uses_the_count_of_the_neediest_rank():
    rows = [([5, 6], [7] * 20), ([5], [8] * 18), ([1, 2], [3]), ([4], [5, 6])]  # rank 0 long, rank 1 short
    batch = batch_of(rows)
    assert fewest_bins(row_tokens(batch)[:2].tolist(), 30) == 2 and fewest_bins(row_tokens(batch)[2:].tolist(), 30) == 1
    assert micro_batch_count(batch, dp=2, token_budget=30) == 2  # both ranks run 2 micro-batches
    assert micro_batch_count(batch, dp=1, token_budget=60) == 1
    assert micro_batch_count(batch, dp=1, token_budget=30, multiple=2) == 2
    assert micro_batch_count(batch, dp=1, token_budget=60, multiple=3) == 3  # interleaved PP=3
    assert micro_batch_count(batch, dp=2, token_budget=60, multiple=3) == 2  # capped: 2 rows per rank
    for rank in range(2):  # the short rank splits its rows into 2 micro-batches as well
        mbs = packed_micro_batches(batch, slice(2 * rank, 2 * rank + 2), token_budget=30, count=2,
                                   common_length=False)
        assert [mb.rows.tolist() for mb in mbs] == [[2 * rank], [2 * rank + 1]]


def test_a_budget_below_the_longest_row_names_the_field_and_the_fix():
    problem = token_budget_problem(100, 120, "the longest possible row")
    assert problem.startswith("train.micro_batch_tokens=100 cannot hold the longest possible row (120 tokens")
    assert "at least 120" in problem and "set it to 0" in problem
    assert token_budget_problem(0, 10**6) is None and token_budget_problem(120, 120) is None
    with pytest.raises(ValueError, match="train.micro_batch_tokens=6 cannot hold the longest row"):
        fewest_bins([3, 7, 2], 6)
    batch = batch_of([([], [1, 2])] + ROWS[:1])
    with pytest.raises(ValueError, match="prompt of >= 1 token"):
        packed_micro_batches(batch, slice(0, 2), token_budget=50, count=1, common_length=False)


def test_config_default_is_packed_and_zero_is_padded():
    from megatron_gtpo.config import load_config
    from megatron_gtpo.utils.configuration import ConfigError
    from tests.helpers import REPO

    cfg = load_config(REPO / "configs" / "gtpo.yaml")
    assert cfg.train.micro_batch_tokens is None and cfg.train.rows_per_micro_batch == 1
    assert cfg.token_budget == cfg.data.max_prompt_tokens + cfg.rollout.max_tokens == 5500
    assert load_config(REPO / "configs" / "tiny.yaml").token_budget == 0  # tiny_reference.json: padded
    assert load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_size=3"]).token_budget == 5500
    assert load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_tokens=8192"]).token_budget == 8192
    with pytest.raises(ConfigError, match="not divisible by parallel.dp x train.micro_batch_size = 1 x 3"):
        load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_tokens=0", "train.micro_batch_size=3"])
    padded = load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_tokens=0"])
    assert padded.token_budget == 0 and padded.train.rows_per_micro_batch == padded.train.micro_batch_size
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens=1000 cannot hold the longest possible row, "
                                          r"data.max_prompt_tokens \+ rollout.max_tokens \(5500 tokens"):
        load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_tokens=1000"])
    with pytest.raises(ConfigError, match="train.micro_batch_tokens=-1 is not allowed"):
        load_config(REPO / "configs" / "gtpo.yaml", ["train.micro_batch_tokens=-1"])


def test_rope_table_restarts_at_every_sequence(monkeypatch):
    """Inside ``rope_at_positions`` Megatron's rotary embedding (called with the packed length, as
    GPTModel does) returns, for every packed position, exactly the rotation of that token's position
    in its own sequence; outside, the class's own forward is back."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_gtpo.train.model_input import rope_at_positions

    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # RoPE's table device
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=10000, use_cpu_initialization=True)
    batch = batch_of(ROWS, pad=99)
    (mb,) = packed_micro_batches(batch, slice(0, 4), token_budget=20, count=1, common_length=False, pad_to_multiple=4)
    seq_len, own = mb.input_ids.shape[1], rope(mb.max_seqlen)  # [max_seqlen, 1, 1, 16]
    with rope_at_positions(SimpleNamespace(rotary_pos_emb=rope), mb.position_ids[0], mb.max_seqlen):
        packed = rope(seq_len)
    assert packed.shape == (seq_len, 1, 1, 16)
    assert torch.equal(packed, own[mb.position_ids[0]])  # bit for bit the padded row's rotations
    assert not torch.equal(packed, rope(seq_len))  # and not the row positions 0..S-1
    assert "forward" not in vars(rope)
    with rope_at_positions(SimpleNamespace(), mb.position_ids[0], mb.max_seqlen):  # a chunk without RoPE
        pass
