"""Scored groups -> the completion-view Batch -> micro-batches (train/batching.py), and the optimizer
config's validation (train/optim.py); single process, no parallel state."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.train.batching import collate, global_normalisers, local_rows, micro_batches
from megatron_gtpo.types import Completion, Prompt, ScoredGroup
from megatron_gtpo.utils.configuration import ConfigError

ROWS = [([5, 6], [7, 8, 9]), ([5, 6, 10, 11], [12]), ([1], []), ([3, 3, 3], [4, 4, 4, 4])]


def batch_of(rows: list[tuple[list[int], list[int]]], pad: int = 0):
    """One group per (prompt, completion) row; sampler log-probs -0.1 * (t + 1)."""
    groups = []
    for b, (prompt, comp) in enumerate(rows):
        c = Completion(prompt_index=0, prompt_token_ids=prompt, token_ids=comp,
                       logprobs=[-0.1 * (t + 1) for t in range(len(comp))])
        groups.append(ScoredGroup(prompt=Prompt(uid=str(b), token_ids=prompt), completions=[c], rewards=[float(b)]))
    return collate(groups, pad_id=pad)


def test_collate_builds_the_completion_view():
    batch = batch_of(ROWS, pad=99)
    assert batch.prompt_lengths.tolist() == [2, 4, 1, 3] and batch.lengths.tolist() == [3, 1, 0, 4]
    assert batch.token_ids.tolist() == [[7, 8, 9, 99], [12, 99, 99, 99], [99] * 4, [4, 4, 4, 4]]
    assert batch.mask.int().tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert batch.prompt_ids.tolist() == [[5, 6, 99, 99], [5, 6, 10, 11], [1, 99, 99, 99], [3, 3, 3, 99]]
    assert batch.group_ids.tolist() == [0, 1, 2, 3] and batch.rewards.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.allclose(batch.sampler_logprobs[3], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert batch.sampler_logprobs[1, 1:].abs().sum() == 0
    assert global_normalisers(batch) == (8.0, 4.0)


def test_micro_batch_input_is_prompt_then_completion_and_take_maps_back():
    batch = batch_of(ROWS, pad=99)
    (mb,) = micro_batches(batch, slice(0, 4), micro_batch_size=4, common_length=False)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9, 99, 99], [5, 6, 10, 11, 12, 99, 99], [1, 99, 99, 99, 99, 99, 99],
                                     [3, 3, 3, 4, 4, 4, 4]]
    assert mb.position_ids.tolist() == [list(range(7))] * 4
    seq = torch.arange(mb.input_ids.numel(), dtype=torch.float32).view_as(mb.input_ids)
    taken = mb.take(seq)
    for b, (p, c) in enumerate(ROWS):  # value at completion column t = sequence value at start + t
        assert taken[b, :len(c)].tolist() == seq[b, len(p):len(p) + len(c)].tolist()
        assert (taken[b, len(c):] == 0).all()


def test_local_rows_and_micro_batches():
    batch = batch_of(ROWS * 2)
    assert local_rows(8, dp=2, dp_rank=1, micro_batch_size=2) == slice(4, 8)
    with pytest.raises(ValueError, match="not divisible by parallel.dp x train.micro_batch_size = 2 x 3 = 6"):
        local_rows(8, dp=2, dp_rank=0, micro_batch_size=3)
    mbs = micro_batches(batch, slice(0, 4), micro_batch_size=2, common_length=False)
    assert [mb.rows.tolist() for mb in mbs] == [[0, 1], [2, 3]]
    assert [mb.input_ids.shape[1] for mb in mbs] == [5, 7]  # cut to the longest used sequence
    assert [mb.width for mb in mbs] == [3, 4]
    shared = micro_batches(batch, slice(0, 4), micro_batch_size=2, common_length=True)
    assert [mb.input_ids.shape[1] for mb in shared] == [7, 7]  # one length for pipeline p2p buffers
    shared = micro_batches(batch, slice(0, 2), micro_batch_size=1, common_length=True, pad_to_multiple=4)
    assert [mb.input_ids.shape[1] for mb in shared] == [8, 8]  # rounded up to the multiple


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


def test_fp8_and_sequence_parallel_padding_goes_past_the_longest_row():
    """FP8 needs token counts divisible by 16, sequence parallelism sequence lengths divisible by TP:
    micro-batches are padded to that multiple even past the batch's longest sequence (7 tokens here),
    with pad tokens after every real token and the completion view unchanged."""
    from types import SimpleNamespace

    from megatron_gtpo.train.model import sequence_multiple

    assert sequence_multiple(SimpleNamespace(fp8=None, sequence_parallel=False, tensor_model_parallel_size=2)) == 1
    assert sequence_multiple(SimpleNamespace(fp8="hybrid", sequence_parallel=False, tensor_model_parallel_size=2)) == 16
    assert sequence_multiple(SimpleNamespace(fp8=None, sequence_parallel=True, tensor_model_parallel_size=3)) == 3
    assert sequence_multiple(SimpleNamespace(fp8="e4m3", sequence_parallel=True, tensor_model_parallel_size=3)) == 48
    batch = batch_of(ROWS, pad=99)
    for common in (False, True):
        mbs = micro_batches(batch, slice(0, 4), micro_batch_size=2, common_length=common, pad_to_multiple=16)
        assert [mb.input_ids.shape[1] for mb in mbs] == [16, 16]
        plain = micro_batches(batch, slice(0, 4), micro_batch_size=2, common_length=common)
        for mb, ref in zip(mbs, plain):
            width = ref.input_ids.shape[1]
            assert torch.equal(mb.input_ids[:, :width], ref.input_ids) and (mb.input_ids[:, width:] == 99).all()
            seq = torch.randn(mb.input_ids.shape)
            assert torch.equal(mb.take(seq), ref.take(seq[:, :width]))
