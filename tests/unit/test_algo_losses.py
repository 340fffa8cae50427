"""Loss invariants of spec section 10 (1-6), checked on coefficients obtained by autograd.

The coefficient ``c_{i,t}`` is the weight of ``grad log pi(o_{i,t})`` in ``grad J`` at rho = 1; the
losses return ``-J``, so ``c = -d loss / d logp``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algo import ALGO_NAMES, TokenInputs, aggregate, compute_loss, conflict_weights, prepare_batch, \
    validate_loss_inputs
from tests.algo_helpers import policy_loss, prepared_of, spec_of
from tests.unit.test_algo_conflict import EXAMPLE1, padded

REWARDS1 = torch.tensor([1.0, 1.0, 0.0, 0.0])
ENTROPY1 = torch.tensor([0.35, 0.50, 0.90, 0.40])
GROUP1 = torch.zeros(4, dtype=torch.long)
REQUIRED_METRICS = {"entropy/mean", "gtpo/filtered_frac", "gtpo/conflict_tokens_per_completion",
                    "gtpo/lambda_zero_share", "gtpo/lambda_ge2_share", "clip/low_frac", "clip/high_frac",
                    "train/ratio_mean", "train/ratio_min", "train/ratio_max"}


def coefficients(algo: str, ids, mask, rewards, group_ids, *, mean_entropy=None, **fields):
    """(c [B, T], loss, metrics) of ``policy_loss`` at rho = 1 (mu = 1, old_logp None); ``fields``
    are AlgoConfig fields."""
    logp = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)).requires_grad_()
    loss, metrics = policy_loss(spec_of(algo, **fields), logp=logp, mask=mask, rewards=rewards, group_ids=group_ids,
                                token_ids=ids, mean_entropy=mean_entropy)
    loss.backward()
    return -logp.grad, loss.detach(), metrics


def rows_of(c, rows=EXAMPLE1):
    return [c[i, :len(r)].tolist() for i, r in enumerate(rows)]


@pytest.mark.parametrize("normalization, o1, o2, o4", [
    ("paper", [.0465, .0465, .02325, .0465, .0465], [.045, .045, .0225, .045, .045], [0, -.027, -.027, 0, 0]),
    ("code", [.093, .093, .0465, .093, .093], [.09, .09, .045, .09, .09], [0, -.054, -.054, 0, 0]),
])
def test_example1_gtpo_coefficients(normalization, o1, o2, o4):  # invariant 6, spec 5.9
    ids, mask = padded(EXAMPLE1)
    c, _, metrics = coefficients("gtpo", ids, mask, REWARDS1, GROUP1, mean_entropy=ENTROPY1,
                                 gtpo_normalization=normalization)
    got = rows_of(c)
    assert got[0] == pytest.approx(o1, abs=1e-7)
    assert got[1] == pytest.approx(o2, abs=1e-7)
    assert got[2] == [0.0] * 6                          # filtered (delta = 0): exactly zero
    assert got[3] == pytest.approx(o4, abs=1e-7)
    assert got[3][0] == 0.0 and got[3][3] == 0.0        # negative conflict tokens: exactly zero
    assert c[:, 0].sum().item() == pytest.approx(0.0915 if normalization == "paper" else 0.183, abs=1e-7)
    assert REQUIRED_METRICS <= set(metrics)
    assert metrics["gtpo/filtered_frac"].item() == 0.25
    assert metrics["gtpo/conflict_tokens_per_completion"].item() == 3.5
    assert metrics["gtpo/lambda_zero_share"].item() == pytest.approx(6 / 21)
    assert metrics["gtpo/lambda_ge2_share"].item() == pytest.approx(8 / 21)
    assert metrics["entropy/mean"].item() == pytest.approx(0.5375)
    assert metrics["train/ratio_mean"].item() == metrics["train/ratio_min"].item() == metrics["train/ratio_max"].item() == 1.0


def test_example1_shared_first_token_w_agg():  # invariant 2 and spec 5.9's W_agg table
    ids, mask = padded(EXAMPLE1)
    lengths = torch.tensor([5.0, 5.0, 6.0, 5.0])
    c, _, _ = coefficients("grpo", ids, mask, REWARDS1, GROUP1, kl_beta=0.0)
    adv = (REWARDS1 - 0.5) / (torch.tensor([1.0, 1, 0, 0]).std() + 1e-4)
    assert c[:, 0].sum().item() == pytest.approx((adv / (4 * lengths)).sum().item(), abs=1e-8)
    assert c[:, 0].sum().item() == pytest.approx(0.0072, abs=5e-5)
    c, _, _ = coefficients("drgrpo", ids, mask, REWARDS1, GROUP1, drgrpo_constant=6)
    assert c[:, 0].sum().item() == 0.0
    assert c[0, 0].item() == pytest.approx(0.5 / (4 * 6))   # A / (G L)
    c, _, _ = coefficients("dapo", ids, mask, REWARDS1, GROUP1)
    assert c[:, 0].sum().item() == pytest.approx(0.0, abs=1e-7)
    assert c[0, 0].item() == pytest.approx(adv[0].item() / 21)  # A / sum |o|


def random_batch(seed=0, groups=(4, 3, 5), width=12, vocab=4):
    gen = torch.Generator().manual_seed(seed)
    batch = sum(groups)
    ids = torch.randint(0, vocab, (batch, width), generator=gen)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gids = torch.cat([torch.full((g,), 10 * k) for k, g in enumerate(groups)])
    rewards = torch.randint(0, 3, (batch,), generator=gen).float()
    rewards[:2] = torch.tensor([0.0, 2.0])   # group 0 is never all-equal
    mean_h = torch.rand(batch, generator=gen)
    return ids, mask, rewards, gids, mean_h


def test_invariant1_loss_values_at_rho_one():
    ids, mask, rewards, gids, _ = random_batch()
    _, loss, _ = coefficients("grpo", ids, mask, rewards, gids, kl_beta=0.0)
    assert abs(loss.item()) < 1e-7
    lengths = mask.sum(1).float()
    adv = prepare_batch(spec_of("dapo"), token_ids=ids, mask=mask, rewards=rewards, group_ids=gids).advantages
    _, loss, _ = coefficients("dapo", ids, mask, rewards, gids)
    assert loss.item() == pytest.approx(-(adv * lengths).sum().item() / lengths.sum().item(), abs=1e-7)
    adv = prepare_batch(spec_of("drgrpo"), token_ids=ids, mask=mask, rewards=rewards, group_ids=gids).advantages
    _, loss, _ = coefficients("drgrpo", ids, mask, rewards, gids, drgrpo_constant=20)
    assert loss.item() == pytest.approx(-(adv * lengths).sum().item() / (len(rewards) * 20), abs=1e-7)


@pytest.mark.parametrize("overlap", ["product", "union"])
def test_invariant3_conflict_gradients(overlap):
    ids, mask, rewards, gids, mean_h = random_batch(seed=3, width=10, vocab=2)
    spec = spec_of("gtpo", entropy_threshold=777.0, conflict_overlap=overlap)
    prep = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    lam = prep.token_weights
    grads = []
    for weights in (lam, torch.ones_like(lam)):
        logp = torch.zeros(ids.shape, requires_grad=True)
        loss, _ = compute_loss(spec, TokenInputs(logp=logp, mask=mask),
                               prepared_of(prep.advantages, token_weights=weights, seq_scale=prep.seq_scale))
        loss.backward()
        grads.append(logp.grad)
    gtpo, plain = grads
    neg_conflict = mask & (lam == 0)
    pos_conflict = mask & (lam > 1)
    assert neg_conflict.any() and pos_conflict.any()
    assert torch.all(gtpo[neg_conflict] == 0.0)
    assert torch.all(plain[neg_conflict] != 0.0)
    expected_w = {2.0, 4.0} if overlap == "product" else {2.0}
    assert set(lam[pos_conflict].tolist()) <= expected_w
    assert torch.allclose(gtpo[pos_conflict], lam[pos_conflict] * plain[pos_conflict], rtol=1e-6, atol=0)
    off = mask & (lam == 1)
    assert torch.equal(gtpo[off], plain[off])


def test_invariant4_filtered_completion_still_creates_conflicts():
    ids, mask = padded(EXAMPLE1)
    hot = ENTROPY1.clone()
    cold = torch.tensor([0.35, 0.50, 0.10, 0.40])      # o3 below the threshold: not filtered
    c_hot, _, _ = coefficients("gtpo", ids, mask, REWARDS1, GROUP1, mean_entropy=hot)
    assert torch.all(c_hot[2] == 0.0)
    prep_hot = prepare_batch(spec_of("gtpo"), token_ids=ids, mask=mask, rewards=REWARDS1, group_ids=GROUP1,
                             mean_entropy=hot)
    prep_cold = prepare_batch(spec_of("gtpo"), token_ids=ids, mask=mask, rewards=REWARDS1, group_ids=GROUP1,
                              mean_entropy=cold)
    assert torch.equal(prep_hot.token_weights, prep_cold.token_weights)
    # without o3 as a negative, o1's second token (7, supported only by o3 among N) is no conflict
    lam_without = conflict_weights(ids, mask, torch.tensor([0.5, 0.5, 0.0, -0.5]), GROUP1)
    assert prep_hot.token_weights[0, 1] == 2.0 and lam_without[0, 1] == 1.0


@pytest.mark.parametrize("normalization, norm", [("paper", 4.0), ("code", 1.0)])
def test_invariant5_all_zero_advantages(normalization, norm):
    ids, mask = padded(EXAMPLE1)
    c, _, metrics = coefficients("gtpo", ids, mask, torch.ones(4), GROUP1, mean_entropy=ENTROPY1,
                                 gtpo_normalization=normalization)
    lengths = [5, 5, 6, 5]
    for i in (0, 1, 3):
        expected = -0.1 * ENTROPY1[i].item() / (lengths[i] * norm)
        assert rows_of(c)[i] == pytest.approx([expected] * lengths[i], rel=1e-6)
    assert torch.all(c[2] == 0.0)
    assert metrics["gtpo/lambda_zero_share"].item() == 0.0 and metrics["gtpo/lambda_ge2_share"].item() == 0.0


def test_mu_greater_than_one_clipping_and_metrics():
    mask = torch.ones(2, 3, dtype=torch.bool)
    old = torch.zeros(2, 3)
    # row 0: A > 0, ratios e^{0.5} (clipped high), 1.0, e^{-0.5}; row 1: A < 0, same ratios
    logp = torch.tensor([[0.5, 0.0, -0.5], [0.5, 0.0, -0.5]], requires_grad=True)
    loss, m = compute_loss(spec_of("dapo", mu=2), TokenInputs(logp=logp, mask=mask, old_logp=old),
                           prepared_of(torch.tensor([1.0, -1.0])))
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0.0 and g[1, 2] == 0.0                         # advantage-favoured clipped side
    ratio = torch.exp(torch.tensor([0.5, 0.0, -0.5]))
    assert torch.allclose(g[0, 1:], -ratio[1:] / 6) and torch.allclose(g[1, :2], ratio[:2] / 6)
    assert m["clip/high_frac"].item() == pytest.approx(1 / 6) and m["clip/low_frac"].item() == pytest.approx(1 / 6)
    assert m["train/ratio_max"].item() == pytest.approx(ratio[0].item()) and m["train/ratio_min"].item() == \
        pytest.approx(ratio[2].item())
    assert loss.item() == pytest.approx((-1.28 - 1 - ratio[2].item() + ratio[0].item() + 1 + 0.8) / 6, rel=1e-6)


def test_old_logp_equal_to_logp_gives_the_on_policy_gradient():
    ids, mask, rewards, gids, mean_h = random_batch(seed=5)
    logp = torch.randn(ids.shape)
    grads = []
    for old in (None, logp.clone()):
        x = logp.clone().requires_grad_()
        loss, _ = policy_loss(spec_of("gtpo"), logp=x, mask=mask, rewards=rewards, group_ids=gids, token_ids=ids,
                              mean_entropy=mean_h, old_logp=old)
        loss.backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)


def test_k3_kl_value_and_gradient():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0, float("nan")]], requires_grad=True)   # NaN padding must not leak
    ref = torch.tensor([[-1.5, -1.0, 0.0]])
    loss, m = compute_loss(spec_of("grpo", kl_beta=0.5), TokenInputs(logp=logp, mask=mask, ref_logp=ref),
                           prepared_of(torch.zeros(1)))
    d = torch.tensor([-0.5, 1.0])
    k3 = torch.exp(d) - d - 1
    assert loss.item() == pytest.approx(0.5 * k3.mean().item(), rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad[0, :2], 0.5 * (1 - torch.exp(d)) / 2)
    assert logp.grad[0, 2] == 0.0 and m["train/kl_mean"].item() == pytest.approx(k3.mean().item(), rel=1e-6)


@pytest.mark.parametrize("algo", sorted(ALGO_NAMES))
def test_every_loss_returns_required_metrics_and_is_finite(algo):
    ids, mask, rewards, gids, mean_h = random_batch(seed=7)
    logp = torch.randn(ids.shape).masked_fill(~mask, float("-inf")).requires_grad_()
    entropy = torch.rand(ids.shape)
    loss, metrics = policy_loss(spec_of(algo, kl_beta=0.01, drgrpo_constant=12, mu=2), logp=logp, mask=mask,
                                rewards=rewards, group_ids=gids, token_ids=ids, entropy=entropy,
                                old_logp=logp.detach() + 0.1, ref_logp=logp.detach() - 0.1)
    loss.backward()
    assert REQUIRED_METRICS <= set(metrics)
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("case, match", [
    ("kl_without_ref", "kl_beta=0.1 needs ref_logp"),
    ("mu2_without_old", "mu=2 needs old_logp"),
    ("grpo_token_weights", "token_weights are GTPO's lambda"),
    ("gtpo_without_weights", "needs token_weights"),
    ("old_shape", "old_logp has shape"),
    ("old_nan", "old_logp holds a non-finite value"),
    ("adv_shape", "advantages has shape"),
    ("mask", "mask row 0 is not a prefix of ones"),
    ("negative_lambda", "token_weights must be >= 0"),
])
def test_loss_inputs_are_validated_at_the_batch_boundary(case, match):
    mask = torch.ones(2, 3, dtype=torch.bool)
    spec, prepared, kw = spec_of("grpo", kl_beta=0.0), prepared_of(torch.tensor([1.0, -1.0])), {}
    if case == "kl_without_ref":
        spec = spec_of("grpo", kl_beta=0.1)
    elif case == "mu2_without_old":
        spec = spec_of("dapo", mu=2)
    elif case == "grpo_token_weights":
        prepared = prepared_of(prepared.advantages, token_weights=torch.ones(2, 3))
    elif case == "gtpo_without_weights":
        spec = spec_of("gtpo")
    elif case == "old_shape":
        kw["old_logp"] = torch.zeros(2, 4)
    elif case == "old_nan":
        kw["old_logp"] = torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]])
    elif case == "adv_shape":
        prepared = prepared_of(torch.ones(3))
    elif case == "mask":
        mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    elif case == "negative_lambda":
        spec = spec_of("gtpo")
        prepared = prepared_of(prepared.advantages, token_weights=-torch.ones(2, 3), seq_scale=torch.ones(2))
    with pytest.raises(ValueError, match=match):
        validate_loss_inputs(spec, prepared, mask=mask, **kw)


def test_aggregate_rejects_unknown_modes_and_a_missing_constant():
    x, mask = torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="mode='sum' must be one of"):
        aggregate(x, mask, mode="sum")
    with pytest.raises(ValueError, match="needs the constant L"):
        aggregate(x, mask, mode="seq-mean-token-sum-norm")


def test_gtpo_prepare_requires_entropy():
    ids, mask = padded(EXAMPLE1)
    with pytest.raises(ValueError, match="needs mean_entropy"):
        prepare_batch(spec_of("gtpo"), token_ids=ids, mask=mask, rewards=REWARDS1, group_ids=GROUP1)
    with pytest.raises(ValueError, match="rewards has shape"):
        prepare_batch(spec_of("grpo"), token_ids=ids, mask=mask, rewards=torch.ones(3), group_ids=GROUP1[:3])


@pytest.mark.parametrize("normalization", ["code", "paper"])
def test_gtpo_prompt_reduction_sum_is_the_code_step_loss(normalization):
    """gtpo_prompt_reduction: mean averages the per-prompt objectives, sum adds them (the code's
    sum_i L_i over every completion of the step, spec 5.8): with 3 prompts the gradient is 3x; with
    one prompt both equal the reference code exactly."""
    ids, mask, rewards, gids, mean_h = random_batch(seed=4)
    grads = {}
    for reduction in ("mean", "sum"):
        grads[reduction] = coefficients("gtpo", ids, mask, rewards, gids, mean_entropy=mean_h,
                                        gtpo_normalization=normalization, gtpo_prompt_reduction=reduction)[0]
    assert grads["mean"].abs().sum() > 0
    assert torch.allclose(grads["sum"], 3 * grads["mean"], rtol=1e-6, atol=1e-12)
    one = gids == gids[0]
    single = [coefficients("gtpo", ids[one], mask[one], rewards[one], gids[one], mean_entropy=mean_h[one],
                           gtpo_normalization=normalization, gtpo_prompt_reduction=r)[0] for r in ("mean", "sum")]
    assert torch.equal(single[0], single[1])
