"""Train-inference mismatch weights (algo/importance.py) and ``TokenInputs.is_weights`` in compute_loss."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import ALGO_NAMES, AlgoConfig, TokenInputs, compute_loss, mismatch_weights
from megatron_gtpo.utils.configuration import ConfigError
from tests.algo_helpers import spec_of
from tests.unit.test_algo_diagnostics import random_batch


def logps(ratios, mask_rows=None):
    """(train_logp, sampler_logp, mask) [1, n] with pi_train / pi_sampler = ratios."""
    r = torch.tensor([ratios], dtype=torch.float64)
    sampler = torch.full_like(r, -1.5)
    mask = torch.ones_like(r, dtype=torch.bool) if mask_rows is None else torch.tensor([mask_rows], dtype=torch.bool)
    return sampler + r.log(), sampler, mask


def test_tis_by_hand():
    train, sampler, mask = logps([0.5, 1.0, 3.0, 1.5, 7.0], [1, 1, 1, 1, 0])    # the 7.0 is padding
    w, m = mismatch_weights(spec_of("gtpo", mismatch_correction="tis", mismatch_cap=2.0), train, sampler, mask)
    assert w[0].tolist() == pytest.approx([0.5, 1.0, 2.0, 1.5, 1.0])              # padding: neutral 1
    assert m["mismatch/is_cut_frac"].item() == pytest.approx(1 / 4)
    assert m["mismatch/is_weight_mean"].item() == pytest.approx(5.0 / 4)
    assert m["mismatch/is_weight_max"].item() == pytest.approx(2.0)
    assert m["mismatch/is_ratio_max"].item() == pytest.approx(3.0)
    assert m["mismatch/is_ratio_min"].item() == pytest.approx(0.5)
    assert not w.requires_grad


def test_mis_by_hand_two_sided_and_one_sided():
    train, sampler, mask = logps([0.4, 1.0, 3.0, 1.5, 0.6, 1.9])
    w, m = mismatch_weights(spec_of("dapo", mismatch_correction="mis"), train, sampler, mask)   # keep [1/2, 2]
    assert w[0].tolist() == pytest.approx([0.0, 1.0, 0.0, 1.5, 0.6, 1.9])
    assert m["mismatch/is_cut_frac"].item() == pytest.approx(2 / 6)
    w, m = mismatch_weights(spec_of("dapo", mismatch_correction="mis", mismatch_cap_low=0.0), train, sampler, mask)
    assert w[0].tolist() == pytest.approx([0.4, 1.0, 0.0, 1.5, 0.6, 1.9])          # top only
    assert m["mismatch/is_cut_frac"].item() == pytest.approx(1 / 6)


def test_none_and_bad_input():
    train, sampler, mask = logps([1.0, 2.0])
    assert mismatch_weights(spec_of("gtpo"), train, sampler, mask) == (None, {})
    with pytest.raises(ConfigError, match="mismatch_correction"):
        AlgoConfig(mismatch_correction="is")
    with pytest.raises(ConfigError, match="mismatch_cap"):
        AlgoConfig(mismatch_correction="tis", mismatch_cap=1.0)
    with pytest.raises(ConfigError, match="mismatch_cap_low"):
        AlgoConfig(mismatch_correction="mis", mismatch_cap_low=1.5)
    with pytest.raises(ValueError, match="sampler_logp has shape"):
        mismatch_weights(spec_of("gtpo", mismatch_correction="tis"), train, sampler[:, :1], mask)


def test_sampler_logprobs_checked_once_per_step_when_corrected():
    """A non-finite engine log-prob fails at the batch boundary (validate_loss_inputs) with its name,
    only when a correction uses it."""
    ids, mask, gids, rewards, mean_h, logp, _ = random_batch(3)
    spec = spec_of("grpo", kl_beta=0.0, mismatch_correction="tis")
    prepared = algo.prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    bad = logp.clone()
    bad[0, 0] = -math.inf
    with pytest.raises(ValueError, match="sampler_logp holds a non-finite value"):
        algo.validate_loss_inputs(spec, prepared, mask=mask, sampler_logp=bad)
    algo.validate_loss_inputs(spec, prepared, mask=mask, sampler_logp=logp)
    algo.validate_loss_inputs(spec_of("grpo", kl_beta=0.0), prepared, mask=mask, sampler_logp=bad)  # unused: fine


def _loss_and_grad(spec, prep, mask, logp, old, ref, is_weights=None):
    x = logp.clone().requires_grad_()
    tokens = TokenInputs(logp=x, mask=mask, old_logp=old, ref_logp=ref, is_weights=is_weights)
    loss, metrics = compute_loss(spec, tokens, prep)
    loss.backward()
    return loss.detach(), x.grad, metrics


@pytest.mark.parametrize("name", sorted(ALGO_NAMES))
@pytest.mark.parametrize("mu_gt_1", [False, True])
def test_default_none_is_bit_identical_and_weights_scale_each_token(name, mu_gt_1):
    """mode none (is_weights None) and all-ones weights leave loss and gradient bit-identical; weights w
    scale each token's policy-gradient term (also through the clip at mu > 1 and GTPO's lambda), not KL."""
    ids, mask, gids, rewards, mean_h, logp, ref = random_batch(5)
    spec = spec_of(name, kl_beta=0.05, mu=2 if mu_gt_1 else 1, mismatch_correction="tis")
    prep = algo.prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1)) if mu_gt_1 else None
    base_loss, base_grad, base_m = _loss_and_grad(spec, prep, mask, logp, old, None)
    weights, _ = mismatch_weights(spec_of(name), logp, logp, mask)                 # mode none: None
    for w in (weights, torch.ones_like(logp)):
        loss, grad, metrics = _loss_and_grad(spec, prep, mask, logp, old, None, is_weights=w)
        assert torch.equal(loss, base_loss) and torch.equal(grad, base_grad)
        assert all(torch.equal(metrics[k], base_m[k]) for k in base_m)
    sampler = logp - 0.5 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(2))
    w, _ = mismatch_weights(spec, logp if old is None else old, sampler, mask)
    assert bool((w[mask] != 1).any()) and bool((w <= 2.0).all())
    _, grad, _ = _loss_and_grad(spec, prep, mask, logp, old, None, is_weights=w)
    assert torch.allclose(grad, w * base_grad, rtol=1e-5, atol=1e-9)
    # the KL term is not weighted: with A = 0 the weights change nothing
    zero_adv = algo.prepare_batch(spec, token_ids=ids, mask=mask, rewards=torch.ones_like(rewards), group_ids=gids,
                                  mean_entropy=torch.zeros_like(mean_h))
    kl_plain, _, _ = _loss_and_grad(spec, zero_adv, mask, logp, old, ref)
    kl_weighted, _, _ = _loss_and_grad(spec, zero_adv, mask, logp, old, ref, is_weights=w)
    assert kl_plain.item() > 0 and torch.equal(kl_plain, kl_weighted)
