"""Issue 16's pure pieces: GTPO preparation split into ``prepare_groups`` (token ids, rewards, groups;
once per global batch) and ``shape_rows`` (entropy filter and gamma shift from each row's own <H>_i;
per micro-batch inside the training forward). Any split of the rows gives the whole-batch values of
``prepare_batch`` element for element, and summed micro-batch losses the whole-batch loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_gtpo.algo import TokenInputs, compute_loss, prepare_batch, prepare_groups, shape_batch, shape_rows, \
    surrogate_decomposition, token_omega, validate_loss_inputs
from tests.algo_helpers import spec_of
from tests.unit.test_algo_losses import random_batch

SPLITS = ([slice(0, 5), slice(5, 12)], [slice(0, 1), slice(1, 7), slice(7, 12)],
          [torch.tensor([11, 0, 4]), torch.tensor([1, 2, 3, 5, 6, 7, 8, 9, 10])])


def _gtpo(**fields):
    # threshold inside random_batch's <H> range (uniform [0, 1)): the filter keeps some rows, drops others
    return spec_of("gtpo", entropy_threshold=0.5, entropy_gamma=0.3, **fields)


@pytest.mark.parametrize("split", range(len(SPLITS)))
def test_shaped_rows_equal_the_whole_batch_bit_for_bit(split):
    ids, mask, rewards, gids, mean_h = random_batch()
    spec = _gtpo()
    whole = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    assert 0 < float(whole.delta.mean()) < 1  # the filter really decides something
    groups = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    assert groups.needs_entropy and groups.delta is None and torch.equal(groups.advantages, whole.raw_advantages)
    for idx in SPLITS[split]:
        rows = shape_rows(spec, groups.rows(idx), mean_h[idx])
        want = whole.rows(idx)
        assert not rows.needs_entropy
        for name in ("advantages", "raw_advantages", "delta", "seq_scale", "token_weights", "mean_entropy"):
            assert torch.equal(getattr(rows, name), getattr(want, name)), name


def test_shape_batch_gives_prepare_batch_and_its_entropy_metrics():
    ids, mask, rewards, gids, mean_h = random_batch(seed=3)
    spec = _gtpo()
    whole = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    groups = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    assert "gtpo/filtered_frac" not in groups.metrics and "entropy/mean" not in groups.metrics  # need every <H>_i
    shaped = shape_batch(spec, groups, mean_h)
    assert shaped.metrics.keys() == whole.metrics.keys()
    for name, value in whole.metrics.items():
        assert torch.equal(shaped.metrics[name], value), name
    assert shaped.metrics["gtpo/filtered_frac"].item() == pytest.approx(float((mean_h > 0.5).float().mean()))
    assert torch.equal(shaped.advantages, whole.advantages)


@pytest.mark.parametrize("normalization", ["code", "paper"])
def test_micro_batch_losses_shaped_per_row_sum_to_the_whole_batch_loss(normalization):
    ids, mask, rewards, gids, mean_h = random_batch(seed=5)
    spec = _gtpo(gtpo_normalization=normalization)
    logp = torch.randn(ids.shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
    norms = {"num_tokens": float(mask.sum()), "num_seqs": float(mask.shape[0])}
    whole = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    loss_ref = compute_loss(spec, TokenInputs(logp=logp, mask=mask), whole, **norms)[0]
    (grad_ref,) = torch.autograd.grad(loss_ref, logp)
    groups = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    total = 0.0
    for idx in SPLITS[2]:
        rows = shape_rows(spec, groups.rows(idx), mean_h[idx])
        total = total + compute_loss(spec, TokenInputs(logp=logp[idx], mask=mask[idx]), rows, **norms)[0]
    (grad,) = torch.autograd.grad(total, logp)
    assert loss_ref.abs().item() > 1e-3  # the shift makes the rho = 1 loss non-zero
    assert total.item() == pytest.approx(loss_ref.item(), rel=1e-6, abs=1e-9)
    assert torch.allclose(grad, grad_ref, rtol=1e-6, atol=1e-9)
    # and the shaping matters: the unshaped advantages would give another gradient
    unshaped = dataclasses.replace(groups, needs_entropy=False)
    (grad_raw,) = torch.autograd.grad(compute_loss(spec, TokenInputs(logp=logp, mask=mask), unshaped, **norms)[0], logp)
    assert not torch.allclose(grad_raw, grad_ref, rtol=1e-3, atol=1e-6)


def test_unshaped_gtpo_rows_never_reach_a_loss_or_d2():
    ids, mask, rewards, gids, _ = random_batch()
    spec = _gtpo()
    groups = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    with pytest.raises(ValueError, match="shape_rows"):
        compute_loss(spec, TokenInputs(logp=torch.zeros(ids.shape), mask=mask), groups.rows(slice(0, 3)))
    omega = token_omega(spec, mask, groups)
    with pytest.raises(ValueError, match="shape_rows"):
        surrogate_decomposition(omega, groups, gids)


def test_shape_rows_names_a_nan_entropy_and_leaves_other_algorithms_alone():
    ids, mask, rewards, gids, mean_h = random_batch()
    spec = _gtpo()
    groups = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    bad = mean_h.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match="mean_entropy"):
        shape_rows(spec, groups, bad)
    grpo = spec_of("grpo")
    plain = prepare_groups(grpo, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    assert not plain.needs_entropy and shape_rows(grpo, plain, mean_h) is plain
    assert plain.metrics["gtpo/filtered_frac"].item() == 0.0 and "entropy/mean" not in plain.metrics


def test_validation_of_pi_old_at_mu_two_knows_the_one_pass():
    """mu > 1 without old_logp is an error, unless pi_old comes from the first update's forward."""
    ids, mask, rewards, gids, _ = random_batch()
    spec = spec_of("dapo", mu=2)
    prepared = prepare_groups(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids)
    with pytest.raises(ValueError, match="needs old_logp"):
        validate_loss_inputs(spec, prepared, mask=mask)
    validate_loss_inputs(spec, prepared, mask=mask, old_logp_later=True)
