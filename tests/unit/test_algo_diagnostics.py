"""Diagnostics D2-D4 and the shared token weights omega (algo/diagnostics.py, spec 6 Props. 2-4).

omega is checked against autograd of the REAL ``compute_loss`` (so it cannot drift from the loss), D2
against the real loss value of every algorithm, D4 against torch.optim.Adam on a toy problem.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_gtpo.algo import (TokenInputs, adam_update_sq_norm, clip_overshoot, compute_loss, favoured_clip_mask,
                                kl_k3, kl_penalty, momentum_step_ratio, momentum_step_ratio_limit, prepare_batch,
                                small_second_moment_counts, surrogate_decomposition, token_omega)
from tests.algo_helpers import prepared_of, spec_of
from tests.unit.test_algo_conflict import EXAMPLE1, padded

REWARDS1 = torch.tensor([1.0, 1.0, 0.0, 0.0])
ENTROPY1 = torch.tensor([0.35, 0.50, 0.90, 0.40])
GROUP1 = torch.zeros(4, dtype=torch.long)
# AlgoConfig fields per case: every algorithm, both GTPO normalisations and prompt reductions, KL on and off
CASES = [
    ("gtpo", {"gtpo_normalization": "code"}),
    ("gtpo", {"gtpo_normalization": "paper", "entropy_gamma": 0.3}),
    ("gtpo", {"gtpo_normalization": "code", "gtpo_prompt_reduction": "sum"}),
    ("gtpo", {"gtpo_normalization": "code", "kl_beta": 0.05}),
    ("grpo", {"kl_beta": 0.04}),
    ("grpo", {"kl_beta": 0.0}),
    ("drgrpo", {"max_completion_tokens": 20}),
    ("dapo", {}),
    ("grpo", {"agg_mode": "seq-mean-token-sum", "kl_beta": 0.1}),
]


def random_batch(seed: int, groups=(5, 3, 8, 4), width=20, vocab=3):
    gen = torch.Generator().manual_seed(seed)
    batch = sum(groups)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gids = torch.cat([torch.full((g,), 7 * k + 1) for k, g in enumerate(groups)])
    rewards = torch.randint(0, 3, (batch,), generator=gen).float()
    rewards[:2] = torch.tensor([0.0, 2.0])
    mean_h = torch.rand(batch, generator=gen) * 0.9      # some above GTPO's 0.7 threshold: delta = 0
    logp = -torch.rand(batch, width, generator=gen) * 3
    ref = logp - 0.3 * torch.randn(batch, width, generator=gen)
    return ids, mask, gids, rewards, mean_h, logp, ref


def _spec_and_prepared(name, fields, ids, mask, gids, rewards, mean_h):
    spec = spec_of(name, **fields)
    return spec, prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)


@pytest.mark.parametrize("name, fields", CASES)
def test_omega_times_advantage_is_the_gradient_of_the_real_loss(name, fields):
    """c = omega * A equals -d loss / d logp of compute_loss at rho = 1 (KL off: it is not part of omega);
    also on a micro-batch with GLOBAL normalisers and with mismatch weights."""
    ids, mask, gids, rewards, mean_h, logp, _ = random_batch(1)
    spec, prep = _spec_and_prepared(name, {**fields, "kl_beta": 0.0}, ids, mask, gids, rewards, mean_h)
    is_w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) * 2
    rows = torch.tensor([0, 3, 4, 9, 15, 19])
    for index, weights, glob in ((slice(None), None, {}), (rows, is_w[rows],
                                                          {"num_tokens": int(mask.sum()), "num_seqs": len(rewards)})):
        part = prep.rows(index)
        x = logp[index].clone().requires_grad_()
        loss, _ = compute_loss(spec, TokenInputs(logp=x, mask=mask[index], is_weights=weights), part, **glob)
        loss.backward()
        omega = token_omega(spec, mask[index], part, is_weights=weights, **glob)
        c = omega * part.advantages.double()[:, None]
        assert torch.allclose(c, -x.grad.double(), rtol=1e-5, atol=1e-9)
        assert torch.all(omega[~mask[index]] == 0)


@pytest.mark.parametrize("name, fields", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_d2_decomposition_equals_the_real_loss(name, fields, seed):
    """D2 (Prop. 4): the loss at inner step 1 (old_logp None) equals -(sum A Omega - entropy part) + KL."""
    ids, mask, gids, rewards, mean_h, logp, ref = random_batch(seed)
    spec, prep = _spec_and_prepared(name, fields, ids, mask, gids, rewards, mean_h)
    loss, _ = compute_loss(spec, TokenInputs(logp=logp, mask=mask, ref_logp=ref if spec.kl_beta else None), prep)
    omega = token_omega(spec, mask, prep)
    kl_term = kl_penalty(spec, kl_k3(logp, ref), mask, prep)
    dec = surrogate_decomposition(omega, prep, gids, kl_term=kl_term)
    assert abs(dec.gap(loss).item()) < 1e-6
    assert dec.metrics(loss)["bias/surrogate_loss_gap"].item() == dec.gap(loss).item()
    # Cov identity: sum_i A_i Omega_i = B Cov_within + sum_g G_g mean A mean Omega, the last ~0 (centred A)
    assert dec.adv_term.item() == pytest.approx(len(rewards) * dec.cov_within.item() + dec.mean_term.item(), abs=1e-12)
    assert abs(dec.mean_term.item()) < 1e-6
    if name == "gtpo" and seed == 0:
        # the check can fail: without the entropy part (gamma <H>) the prediction misses the loss
        assert dec.entropy_term.item() > 1e-4
        assert abs(loss.item() - (-dec.adv_term.item() + dec.kl_term.item())) > 1e-4
    if spec.kl_beta:
        assert dec.kl_term.item() > 1e-4


def test_d2_gap_accounts_for_mismatch_weights():
    """With mismatch weights the loss moves by is_term = sum_i A~_i sum_t omega (1 - w); the gap stays 0."""
    ids, mask, gids, rewards, mean_h, logp, _ = random_batch(7)
    spec, prep = _spec_and_prepared("gtpo", {}, ids, mask, gids, rewards, mean_h)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) * 2
    loss, _ = compute_loss(spec, TokenInputs(logp=logp, mask=mask, is_weights=w), prep)
    omega = token_omega(spec, mask, prep)
    is_term = ((token_omega(spec, mask, prep, is_weights=w) - omega) * -prep.advantages.double()[:, None]).sum()
    dec = surrogate_decomposition(omega, prep, gids)
    assert abs(dec.gap(loss, is_term).item()) < 1e-6 and abs(dec.gap(loss).item()) > 1e-4


def test_d2_hand_values_example1():
    """Spec 5.9 example 1 (one group, lengths 5 5 6 5) through Prop. 4, by hand."""
    ids, mask = padded(EXAMPLE1)
    lengths = torch.tensor([5.0, 5.0, 6.0, 5.0])
    out = {}
    for name, fields in (("grpo", {}), ("drgrpo", {"max_completion_tokens": 6}), ("dapo", {}),
                         ("gtpo", {"gtpo_normalization": "paper"})):
        spec = spec_of(name, **fields)
        prep = prepare_batch(spec, token_ids=ids, mask=mask, rewards=REWARDS1, group_ids=GROUP1, mean_entropy=ENTROPY1)
        out[name] = surrogate_decomposition(token_omega(spec, mask, prep), prep, GROUP1)
    z = 0.5 / (torch.tensor([1.0, 1, 0, 0]).std().item() + 1e-4)        # GRPO/DAPO z-score, |A| = 0.866
    assert abs(out["grpo"].adv_term.item()) < 1e-7                          # length-normalised: 0
    assert out["dapo"].adv_term.item() == pytest.approx(z * (5 + 5 - 6 - 5) / 21, rel=1e-6)
    assert out["drgrpo"].adv_term.item() == pytest.approx(0.5 * (5 + 5 - 6 - 5) / (4 * 6), rel=1e-6)
    gtpo = out["gtpo"]
    # Omega = delta sum_t lambda / (G |o|) = [9/20, 9/20, 0 (filtered), 2/20]; A = [.5, .5, -.5, -.5]
    assert gtpo.adv_term.item() == pytest.approx(0.5 * 0.45 * 2 - 0.5 * 0.1, rel=1e-6)          # 0.4
    assert gtpo.entropy_term.item() == pytest.approx(0.1 * (0.35 * 0.45 + 0.5 * 0.45 + 0.4 * 0.1), rel=1e-6)
    assert gtpo.cov_within.item() == pytest.approx(0.1, rel=1e-6)           # (1/4) sum A (Omega - 0.25)
    assert gtpo.predicted_loss.item() == pytest.approx(-0.35775, rel=1e-6)   # = -(sum of spec 5.9's c)
    assert lengths.sum().item() == 21


def test_kl_penalty_is_the_loss_with_zero_advantages():
    ids, mask, gids, rewards, mean_h, logp, ref = random_batch(4)
    spec, prep = _spec_and_prepared("gtpo", {"kl_beta": 0.2}, ids, mask, gids, rewards, mean_h)
    zero = dataclasses.replace(prep, advantages=torch.zeros(len(rewards)))
    loss, _ = compute_loss(spec, TokenInputs(logp=logp, mask=mask, ref_logp=ref), zero)
    kl = kl_penalty(spec, kl_k3(logp, ref), mask, prep)
    assert kl.item() == pytest.approx(loss.item(), rel=1e-6)


def test_favoured_clip_region_and_overshoot_by_hand():
    spec = spec_of("dapo")                                                    # clip 0.2 / 0.28
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    # row 0 (A > 0): rho = 1.5 (above 1.28), 1.1, 0.5, 2.0; row 1 (A < 0): rho = 0.7 (below 0.8), 1.5, 0.79, pad
    rho = torch.tensor([[1.5, 1.1, 0.5, 2.0], [0.7, 1.5, 0.79, 0.1]])
    prep = prepared_of(torch.tensor([1.0, -1.0]))
    region = favoured_clip_mask(spec, rho.log(), prep, mask)
    assert region.tolist() == [[True, False, False, True], [True, False, True, False]]
    lam = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])           # lambda = 0: never clipped
    with_lambda = favoured_clip_mask(spec, rho.log(), prepared_of(prep.advantages, token_weights=lam), mask)
    assert with_lambda[0, 3].item() is False
    masked_is = torch.ones(2, 4)
    masked_is[1, 0] = 0.0                                                        # a mis-masked token: never clipped
    assert favoured_clip_mask(spec, rho.log(), prep, mask, is_weights=masked_is)[1, 0].item() is False
    nxt = torch.tensor([[1.6, 1.0, 0.5, 1.9], [0.6, 1.0, 0.79, 0.01]])          # grows: (0,0), (1,0); (1,2) equal
    counts = clip_overshoot(spec, rho.log(), nxt.log(), prep, mask)
    assert (int(counts.tokens), int(counts.favoured), int(counts.overshoot)) == (7, 4, 2)
    both = counts + counts
    assert both.rates() == {"favoured_frac": 4 / 7, "overshoot_rate": 0.5}


def test_momentum_step_ratio_by_hand():
    # T = 2, k = 0, (0.9, 0.95): 0.9 * 0.1 / 0.19 * sqrt(0.0975 / (0.95 * 0.05))
    assert momentum_step_ratio(2, 0, beta1=0.9, beta2=0.95) == pytest.approx(0.678648, abs=1e-6)
    assert momentum_step_ratio_limit(0, beta1=0.9, beta2=0.95) == pytest.approx(0.923381, abs=1e-6)
    assert momentum_step_ratio_limit(4, beta1=0.9, beta2=0.95) == pytest.approx(0.671280, abs=1e-6)  # 5 steps
    for k in (0, 3, 10):
        assert momentum_step_ratio(10_000, k, beta1=0.9, beta2=0.95) == pytest.approx(
            momentum_step_ratio_limit(k, beta1=0.9, beta2=0.95), rel=1e-9)
    with pytest.raises(ValueError, match="enter_step=1 must be an int >= 2"):
        momentum_step_ratio(1, 0, beta1=0.9, beta2=0.95)
    with pytest.raises(ValueError, match="betas"):
        momentum_step_ratio_limit(0, beta1=0.9, beta2=1.0)


def run_toy(lr: float, betas=(0.9, 0.95), tokens=4, steps=400, extra=12):
    """Adam (no weight decay) on the real DAPO loss of ``tokens`` identical A > 0 tokens whose log-prob
    IS the parameter (old_logp = 0): the gradient is -rho/N until rho > 1.28, then exactly 0.
    Returns (T, update norms by 1-based Adam step, log-ratios by step, optimizer)."""
    theta = torch.zeros(1, tokens, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=lr, betas=betas, eps=1e-12, weight_decay=0.0)
    mask = torch.ones(1, tokens, dtype=torch.bool)
    norms, ratios, enter = {}, {}, None
    for step in range(1, steps + 1):
        opt.zero_grad()
        tokens = TokenInputs(logp=theta, mask=mask, old_logp=torch.zeros_like(theta))
        loss, _ = compute_loss(spec_of("dapo", mu=2), tokens, prepared_of(torch.ones(1, dtype=torch.float64)))
        loss.backward()
        ratios[step] = theta.detach().clone()
        if enter is None and bool((theta.grad == 0).all()):
            enter = step
        before = theta.detach().clone()
        opt.step()
        norms[step] = (theta.detach() - before).norm().item()
        state = opt.state[theta]          # the update norm from the optimizer state alone matches
        assert adam_update_sq_norm([state["exp_avg"]], [state["exp_avg_sq"]], step=step, lr=lr, beta1=betas[0],
                                   beta2=betas[1], eps=1e-12).item() == pytest.approx(norms[step] ** 2, rel=1e-9)
        if enter is not None and step >= enter + extra:
            return enter, norms, ratios, opt
    raise AssertionError("the ratio never entered the clipped region")


def test_d4_adam_overshoot_matches_the_bias_corrected_formula():
    """Prop. 3 on a toy: after the ratio enters the clipped region at step T (gradient exactly 0), the
    update norms decay as C_{T,k}; the ratio keeps growing (overshoot rate 1)."""
    enter, norms, ratios, _ = run_toy(lr=0.05)
    assert 3 <= enter <= 30                                  # small T: bias correction matters
    for k in (0, 1, 2, 5, 10):
        measured = norms[enter + k] / norms[enter - 1]
        predicted = momentum_step_ratio(enter, k, beta1=0.9, beta2=0.95)
        assert measured == pytest.approx(predicted, rel=1e-6)   # far inside the 5% asked for
    # the large-T limit is NOT the right prediction at small T (this is why the exact form is given)
    assert abs(norms[enter] / norms[enter - 1] - momentum_step_ratio_limit(0, beta1=0.9, beta2=0.95)) > 0.02
    mask = torch.ones(1, 4, dtype=torch.bool)
    spec, prep = spec_of("dapo", mu=2), prepared_of(torch.ones(1))
    for step in range(enter, enter + 5):
        counts = clip_overshoot(spec, ratios[step], ratios[step + 1], prep, mask)
        assert counts.rates() == {"favoured_frac": 1.0, "overshoot_rate": 1.0}
    before = clip_overshoot(spec, ratios[enter - 1], ratios[enter], prep, mask)
    assert int(before.favoured) == 0


def test_d4_large_t_limit_within_five_percent():
    """With a tiny learning rate the region is entered late (large T) and (beta1/sqrt(beta2))^(k+1) holds."""
    enter, norms, _, _ = run_toy(lr=0.002, steps=2000, extra=6)
    assert enter > 100
    for k in (0, 2, 5):
        measured = norms[enter + k] / norms[enter - 1]
        assert measured == pytest.approx(momentum_step_ratio_limit(k, beta1=0.9, beta2=0.95), rel=0.05)
        assert measured == pytest.approx(momentum_step_ratio(enter, k, beta1=0.9, beta2=0.95), rel=1e-6)


def test_d3_small_second_moment_counts_by_hand():
    v = [torch.tensor([1e-18, 2e-17, 0.0]), torch.tensor([[1e-10, 5e-15]])]
    # step 1, beta2 0.999: v_hat = v / 1e-3 < (10 * 1e-8)^2 = 1e-14  <=>  v < 1e-17: 1e-18 and 0
    small, total = small_second_moment_counts(v, step=1, beta2=0.999, eps=1e-8)
    assert (int(small), int(total)) == (2, 5)
    # late in training bias correction ~1: v < 1e-14 also takes 2e-17 and 5e-15
    small, total = small_second_moment_counts(v, step=100_000, beta2=0.999, eps=1e-8)
    assert (int(small), int(total)) == (4, 5)
    small, _ = small_second_moment_counts(v, step=100_000, beta2=0.999, eps=1e-5)     # RL's eps = 1e-5: sqrt < 1e-4
    assert int(small) == 5
    assert math.sqrt(1e-10) < 10 * 1e-5
    with pytest.raises(ValueError, match="step=0"):
        small_second_moment_counts(v, step=0, beta2=0.999, eps=1e-8)


def test_token_omega_rejects_bad_shapes():
    mask = torch.ones(2, 3, dtype=torch.bool)
    spec = spec_of("dapo")
    with pytest.raises(ValueError, match="seq_scale has shape"):
        token_omega(spec, mask, prepared_of(torch.ones(2), seq_scale=torch.ones(3)))
    with pytest.raises(ValueError, match="token_weights has shape"):
        token_omega(spec, mask, prepared_of(torch.ones(2), token_weights=torch.ones(3, 4)))
    with pytest.raises(ValueError, match="mode='x' must be one of"):
        token_omega(dataclasses.replace(spec, agg_mode="x"), mask, prepared_of(torch.ones(2)))
