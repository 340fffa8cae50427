"""TrainBatch -> completion view and micro-batches (train/batching.py), and the optimizer config's
validation (train/optim.py); single process, no parallel state."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.train.batching import completion_view, local_rows, micro_batches
from megatron_gtpo.types import TrainBatch
from megatron_gtpo.utils.configuration import ConfigError


def batch_of(rows: list[tuple[list[int], list[int]]], pad: int = 0, extra: int = 2) -> TrainBatch:
    """rows: (prompt, completion) token lists."""
    width = max(len(p) + len(c) for p, c in rows) + extra
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    for b, (p, c) in enumerate(rows):
        ids[b, :len(p) + len(c)] = torch.tensor(p + c)
        mask[b, len(p):len(p) + len(c)] = 1
    n = len(rows)
    return TrainBatch(input_ids=ids, loss_mask=mask, position_ids=torch.arange(width).expand(n, width),
                      group_ids=torch.zeros(n, dtype=torch.long), rewards=torch.zeros(n), advantages=torch.zeros(n),
                      sampler_logprobs=torch.zeros(n, width), pad_id=pad)


ROWS = [([5, 6], [7, 8, 9]), ([5, 6, 10, 11], [12]), ([1], []), ([3, 3, 3], [4, 4, 4, 4])]


def test_completion_view_left_aligns_completions():
    batch = batch_of(ROWS, pad=99)
    view = completion_view(batch)
    assert view.start.tolist() == [2, 4, 0, 3] and view.lengths.tolist() == [3, 1, 0, 4]
    assert view.width == 4
    assert view.token_ids.tolist() == [[7, 8, 9, 99], [12, 99, 99, 99], [99] * 4, [4, 4, 4, 4]]
    assert view.mask.int().tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    seq = torch.arange(batch.input_ids.numel(), dtype=torch.float32).view_as(batch.input_ids)
    taken = view.take(seq)
    for b, (p, c) in enumerate(ROWS):  # value at completion column t = sequence value at start + t
        assert taken[b, :len(c)].tolist() == seq[b, len(p):len(p) + len(c)].tolist()
        assert (taken[b, len(c):] == 0).all()
    assert view.take(seq[1:3], rows=slice(1, 3), width=2).tolist() == taken[1:3, :2].tolist()


def test_completion_start_given_or_derived_agree_and_gaps_are_rejected():
    batch = batch_of(ROWS)
    derived = completion_view(batch)
    batch.completion_start = torch.tensor([2, 4, 1, 3])  # empty row: any start is fine
    assert torch.equal(completion_view(batch).token_ids, derived.token_ids)
    batch.loss_mask[0, 3] = 0  # hole inside a completion
    with pytest.raises(ValueError, match="row 0 is not one contiguous run"):
        completion_view(batch)


def test_local_rows_and_micro_batches():
    batch = batch_of(ROWS * 2)
    view = completion_view(batch)
    assert local_rows(8, dp=2, dp_rank=1, micro_batch_size=2) == slice(4, 8)
    with pytest.raises(ValueError, match="multiple of 6"):
        local_rows(8, dp=2, dp_rank=0, micro_batch_size=3)
    mbs = micro_batches(batch, view, slice(0, 4), micro_batch_size=2, common_length=False)
    assert [mb.rows.tolist() for mb in mbs] == [[0, 1], [2, 3]]
    assert [mb.input_ids.shape[1] for mb in mbs] == [5, 7]  # cut to the longest used sequence
    assert [mb.width for mb in mbs] == [3, 4]
    assert torch.equal(mbs[0].input_ids, batch.input_ids[:2, :5])
    shared = micro_batches(batch, view, slice(0, 4), micro_batch_size=2, common_length=True, pad_to_multiple=4)
    assert [mb.input_ids.shape[1] for mb in shared] == [8, 8]  # one length for pipeline p2p buffers
    capped = micro_batches(batch, view, slice(0, 4), micro_batch_size=4, common_length=False, pad_to_multiple=64)
    assert capped[0].input_ids.shape[1] == batch.input_ids.shape[1]  # never longer than S


def test_optim_config_rejects_mirrored_or_unknown_fields():
    from megatron_gtpo.train.optim import OptimConfig

    cfg = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-5, "clip_grad": 0.1},
                      scheduler={"lr_warmup_steps": 3, "lr_decay_style": "cosine"})
    assert cfg.optimizer["clip_grad"] == 0.1
    with pytest.raises(ConfigError, match="optimizer.not_a_field"):
        OptimConfig(optimizer={"lr": 1e-6, "not_a_field": 1})
    with pytest.raises(ConfigError, match="optimizer.bf16"):
        OptimConfig(optimizer={"lr": 1e-6, "bf16": True})
    with pytest.raises(ConfigError, match="ddp.use_distributed_optimizer"):
        OptimConfig(ddp={"use_distributed_optimizer": True})
    with pytest.raises(ConfigError, match="scheduler.max_lr"):
        OptimConfig(scheduler={"max_lr": 1.0})
    with pytest.raises(ConfigError, match="lr_warmup_steps"):
        OptimConfig(scheduler={"lr_warmup_steps": -1})
