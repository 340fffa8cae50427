"""Aggregation modes and the distributed contract: micro-batch losses with GLOBAL normalisers sum to
the single-process loss (values and gradients), for every algorithm and aggregation mode."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algo import (AGG_MODES, ALGO_NAMES, TokenInputs, aggregate, aggregation_weights, compute_loss,
                                prepare_batch)
from tests.algo_helpers import spec_of


def test_aggregation_modes_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert aggregate(x, mask, mode="token-mean").item() == 10 / 4
    assert aggregate(x, mask, mode="seq-mean-token-mean").item() == (2 + 4) / 2
    assert aggregate(x, mask, mode="seq-mean-token-sum").item() == 10 / 2
    assert aggregate(x, mask, mode="seq-mean-token-sum-norm", constant=5).item() == 10 / (2 * 5)
    assert aggregate(x, mask, mode="token-mean", num_tokens=8).item() == 10 / 8
    assert aggregate(x, mask, mode="seq-mean-token-mean", num_seqs=torch.tensor(6.0)).item() == 1.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert aggregate(x, empty, mode="token-mean").item() == 0.0


def make_batch(seed=0, groups=(6, 3, 8, 4), width=16, vocab=3):
    gen = torch.Generator().manual_seed(seed)
    batch = sum(groups)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(0, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gids = torch.cat([torch.full((g,), k) for k, g in enumerate(groups)])
    rewards = torch.randint(0, 2, (batch,), generator=gen).float() + 0.5 * torch.rand(batch, generator=gen)
    old = torch.randn(batch, width, generator=gen) * 0.1
    logp = old + torch.randn(batch, width, generator=gen) * 0.3     # mu > 1: ratios away from 1, some clipped
    ref = old + torch.randn(batch, width, generator=gen) * 0.2
    entropy = torch.rand(batch, width, generator=gen) * 1.4
    return ids, mask, rewards, gids, old, logp, ref, entropy


CASES = [(algo, None) for algo in sorted(ALGO_NAMES)] + [("grpo", mode) for mode in AGG_MODES]


@pytest.mark.parametrize("algo, agg_mode", CASES)
def test_micro_batches_with_global_normalisers_sum_to_whole_batch(algo, agg_mode):
    ids, mask, rewards, gids, old, logp, ref, entropy = make_batch()
    spec = spec_of(algo, agg_mode=agg_mode, kl_beta=0.05 if algo == "grpo" else None, mu=2)
    mean_h = (entropy * mask).sum(1) / mask.sum(1).clamp(min=1)
    prepared = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids,
                             mean_entropy=mean_h)     # ONCE, over the whole global batch

    def run(rows, normalisers):
        x = logp.clone().requires_grad_()
        width = int(mask[rows].sum(1).max().clamp(min=1))   # each micro-batch trimmed to its own width
        tokens = TokenInputs(logp=x[rows, :width], mask=mask[rows, :width], old_logp=old[rows, :width],
                             ref_logp=ref[rows, :width])
        loss, _ = compute_loss(spec, tokens, prepared.rows(rows, width=width), **normalisers)
        loss.backward()
        return loss.detach(), x.grad

    whole, whole_grad = run(torch.arange(len(rewards)), {})
    order = torch.randperm(len(rewards), generator=torch.Generator().manual_seed(1))  # groups straddle chunks
    chunks = [order[k:k + 5] for k in range(0, len(order), 5)]
    glob = {"num_tokens": int(mask.sum()), "num_seqs": len(rewards)}
    total, grad = torch.zeros(()), torch.zeros_like(logp)
    for rows in chunks:
        loss, g = run(rows, glob)
        total, grad = total + loss, grad + g
    assert total.item() == pytest.approx(whole.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(grad, whole_grad, rtol=1e-5, atol=1e-8)
    # the test can fail: with local normalisers the sum is not the whole-batch loss
    local = sum(run(rows, {})[0] for rows in chunks)
    assert local.item() != pytest.approx(whole.item(), rel=1e-3)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregation_weights_reproduce_aggregate(mode):
    """``aggregation_weights`` (the diagnostics' omega) gives the same scalar as ``aggregate``, with local
    and with global normalisers, and is 0 outside the mask."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.arange(7)[None, :] < torch.tensor([7, 3, 0, 5, 1])[:, None]
    for normalisers in ({}, {"num_tokens": 40, "num_seqs": 9}, {"num_tokens": torch.tensor(33.0),
                                                                 "num_seqs": torch.tensor(6.0)}):
        w = aggregation_weights(mask, mode=mode, constant=8, **normalisers)
        assert torch.all(w[~mask] == 0)
        expected = aggregate(x, mask, mode=mode, constant=8, **normalisers)
        assert (w * x).sum().item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-15)
    # by hand, local normalisers: 16 masked tokens, 5 rows, row lengths 7 3 0 5 1
    w = aggregation_weights(mask, mode=mode, constant=8)
    hand = {"token-mean": 1 / 16, "seq-mean-token-mean": 1 / (5 * 3), "seq-mean-token-sum": 1 / 5,
            "seq-mean-token-sum-norm": 1 / (5 * 8)}[mode]
    assert w[1, 0].item() == pytest.approx(hand)
