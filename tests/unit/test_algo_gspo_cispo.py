"""GSPO and CISPO (docs/algorithms.md 13, 14) against independent transcriptions of their papers.

The oracles below are written from the papers' equations, not from ``algo/losses.py``: GSPO's
sequence-level objective (arXiv 2507.18071, its objective with the sequence ratio s_i) differentiated through ``s_i`` itself (no token
form), and CISPO's ``sg(clip(r)) A log pi`` (arXiv 2506.13585, Eq. 4-5) differentiated through
``log pi``. They are compared with the real ``compute_loss`` on random groups, at mu = 1 and at mu > 1
with the clip engaged on both sides.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algo import (TokenInputs, clip_regions, compute_loss, favoured_clip_mask, prepare_batch,
                                sequence_log_ratio, surrogate_log_ratio, token_omega)
from tests.algo_helpers import prepared_of, spec_of

F64 = torch.float64


def random_groups(seed: int, groups: int = 4, size: int = 4, width: int = 9):
    """Rewards with both signs in every group, varied lengths, log-probs, and a pi_old whose per-row mean
    log-ratio spreads over [-2e-3, 2e-3] (GSPO's 3e-4 / 4e-4 range is crossed on both sides)."""
    gen = torch.Generator().manual_seed(seed)
    batch = groups * size
    lengths = torch.randint(2, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gids = torch.arange(groups).repeat_interleave(size)
    rewards = torch.randint(0, 3, (batch,), generator=gen).to(F64)
    rewards[::size] = 0.0
    rewards[1::size] = 2.0
    logp = (-torch.rand(batch, width, generator=gen, dtype=F64) * 3).masked_fill(~mask, float("-inf"))
    shift = (torch.rand(batch, 1, generator=gen, dtype=F64) - 0.5) * 4e-3
    noise = 0.3 * torch.randn(batch, width, generator=gen, dtype=F64)
    old = logp - shift - (noise - (noise * mask).sum(1, keepdim=True) / lengths[:, None]) * mask
    return mask, gids, rewards, logp, torch.where(mask, old, torch.zeros((), dtype=F64))


def paper_advantages(rewards: torch.Tensor, gids: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Both papers: A_i = (R_i - mean(R)) / std(R) within each group (unbiased std + the stack's eps)."""
    out = torch.empty_like(rewards)
    for g in gids.unique():
        r = rewards[gids == g]
        out[gids == g] = (r - r.mean()) / (r.std() + eps)
    return out


def gspo_paper_loss(logp, old, mask, adv, eps_low, eps_high):
    """-J_GSPO = -(1/B) sum_i min(s_i A_i, clip(s_i, 1-eps_low, 1+eps_high) A_i), s_i = (pi/pi_old)^(1/|o_i|)."""
    terms = []
    for i in range(logp.shape[0]):
        m = mask[i]
        s = torch.exp((logp[i][m] - old[i][m]).sum() / m.sum())
        terms.append(torch.minimum(s * adv[i], s.clamp(1 - eps_low, 1 + eps_high) * adv[i]))
    return -torch.stack(terms).mean()


def cispo_paper_loss(logp, old, mask, adv, eps_low, eps_high):
    """-J_CISPO = -(1/sum_i |o_i|) sum_{i,t} sg(clip(r_{i,t}, 1-eps_low, 1+eps_high)) A_i log pi(o_{i,t})."""
    total = torch.zeros((), dtype=logp.dtype)
    for i in range(logp.shape[0]):
        m = mask[i]
        r = torch.exp(logp[i][m] - old[i][m]).detach()
        total = total + (r.clamp(1 - eps_low, 1 + eps_high) * adv[i] * logp[i][m]).sum()
    return -total / mask.sum()


def ours(spec, logp, mask, gids, rewards, old=None, **kw):
    prepared = prepare_batch(spec, token_ids=torch.zeros(mask.shape, dtype=torch.long), mask=mask, rewards=rewards,
                             group_ids=gids)
    leaf = logp.clone().requires_grad_()
    loss, metrics = compute_loss(spec, TokenInputs(logp=leaf, mask=mask, old_logp=old, **kw), prepared)
    loss.backward()
    return loss, leaf.grad, metrics, prepared


def oracle(fn, logp, old, mask, adv, spec):
    leaf = logp.clone().requires_grad_()
    loss = fn(leaf, old, mask, adv, spec.clip_eps_low, spec.clip_eps_high)
    loss.backward()
    return loss, torch.where(mask, leaf.grad, torch.zeros((), dtype=F64))


@pytest.mark.parametrize("seed", range(3))
def test_gspo_equals_the_papers_sequence_objective(seed):
    """Loss and gradient of GSPO (defaults 3e-4 / 4e-4) equal the sequence-level transcription at
    mu > 1, with completions clipped below (A < 0) and above (A > 0), whose gradient is 0, and at mu = 1.
    Injected bugs seen failing (seed 0): the clip bounds swapped (``1 - eps_high``, ``1 + eps_low``): loss
    9.356e-5 against the oracle's 8.894e-5; the token ratio instead of the sequence one: loss 0.0894."""
    mask, gids, rewards, logp, old = random_groups(seed)
    spec = spec_of("gspo", mu=2)
    assert (spec.clip_eps_low, spec.clip_eps_high, spec.agg_mode, spec.adv_std_scale) == (
        3e-4, 4e-4, "seq-mean-token-mean", True)
    loss, grad, metrics, prepared = ours(spec, logp, mask, gids, rewards, old)
    adv = paper_advantages(rewards, gids)
    assert torch.allclose(prepared.advantages.to(F64), adv, rtol=1e-6, atol=1e-9)
    ref_loss, ref_grad = oracle(gspo_paper_loss, logp, old, mask, adv, spec)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-9, abs=1e-12)
    assert torch.allclose(grad, ref_grad, rtol=1e-8, atol=1e-12)
    s = torch.exp(torch.where(mask, logp - old, 0.0).sum(1) / mask.sum(1))
    low, high = (s < 1 - 3e-4) & (adv < 0), (s > 1 + 4e-4) & (adv > 0)
    assert low.any() and high.any() and (~(low | high)).any()          # both sides clipped, some active
    assert torch.all(grad[low | high] == 0) and torch.all(grad[~(low | high)].abs().sum(1) > 0)
    per_token = mask.sum().to(F64)
    assert metrics["clip/low_frac"].item() == pytest.approx((mask[low].sum() / per_token).item())
    assert metrics["clip/high_frac"].item() == pytest.approx((mask[high].sum() / per_token).item())
    # mu = 1: s = 1 (pi_old = pi_theta), the gradient of (1/G) sum_i A_i mean_t log pi: GRPO's
    loss1, grad1, _, _ = ours(spec_of("gspo"), logp, mask, gids, rewards)
    ref1, ref_grad1 = oracle(gspo_paper_loss, logp, logp.detach(), mask, adv, spec)
    assert loss1.item() == pytest.approx(ref1.item(), abs=1e-12)
    assert torch.allclose(grad1, ref_grad1, rtol=1e-8, atol=1e-12)
    _, grpo_grad, _, _ = ours(spec_of("grpo", kl_beta=0.0), logp, mask, gids, rewards)
    assert torch.allclose(grad1, grpo_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("eps_low", [None, 0.2])
def test_cispo_gradient_equals_the_papers_detached_clipped_weight(seed, eps_low):
    """The gradient of CISPO equals that of the paper's sg(clip(r)) A log pi with 1 / sum|o_i|, at
    mu > 1 with weights truncated above (eps_high 0.28) and, with eps_low 0.2, below: every token keeps
    a gradient, truncated ones with the capped weight. The value is -sum clip(r) A / sum|o_i| (the
    ratio form). Injected bugs seen failing: the weight not detached (``clipped`` instead of
    ``clipped.detach()``): gradient 0.0144 against the oracle's 0.0072 on an untruncated token; the
    bounds swapped (``1 - eps_high``, ``1 + eps_low``): 0.0188 against 0.0120 on a truncated one."""
    mask, gids, rewards, logp, old = random_groups(seed)
    old = torch.where(mask, old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed),
                                                    dtype=F64), torch.zeros((), dtype=F64))
    spec = spec_of("cispo", mu=2, clip_eps_low=eps_low)
    assert (spec.clip_eps_low, spec.clip_eps_high, spec.agg_mode) == (eps_low or 1.0, 0.28, "token-mean")
    loss, grad, metrics, _ = ours(spec, logp, mask, gids, rewards, old)
    adv = paper_advantages(rewards, gids)
    _, ref_grad = oracle(cispo_paper_loss, logp, old, mask, adv, spec)
    assert torch.allclose(grad, ref_grad, rtol=1e-8, atol=1e-12)
    r = torch.where(mask, torch.exp(logp - old), torch.ones((), dtype=F64))
    weight = r.clamp(1 - spec.clip_eps_low, 1 + spec.clip_eps_high)
    expected = -(torch.where(mask, weight * adv[:, None], 0.0)).sum() / mask.sum()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-9)
    above, below = mask & (r > 1.28), mask & (r < 1 - spec.clip_eps_low)
    assert above.any() and (below.any() == (eps_low is not None))
    nonzero = mask & (adv[:, None] != 0)
    assert torch.all(grad[nonzero] != 0)                                     # no token loses its gradient
    assert metrics["clip/high_frac"].item() == pytest.approx((above.sum() / mask.sum()).item())
    assert metrics["clip/low_frac"].item() == pytest.approx((below.sum() / mask.sum()).item())


def test_cispo_at_mu1_is_the_token_mean_policy_gradient():
    """r = 1: every weight is 1, the gradient is DAPO's (token-mean) at rho = 1."""
    mask, gids, rewards, logp, _ = random_groups(5)
    _, grad, _, _ = ours(spec_of("cispo"), logp, mask, gids, rewards)
    _, dapo, _, _ = ours(spec_of("dapo"), logp, mask, gids, rewards)
    assert torch.allclose(grad, dapo, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("name", ["gspo", "cispo"])
def test_mismatch_weights_multiply_each_tokens_advantage(name):
    """TIS/MIS weights w enter as A_{i,t} = A_i w_{i,t} (GSPO: GSPO-token with token advantages)."""
    mask, gids, rewards, logp, old = random_groups(2)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3), dtype=F64) + 0.5
    spec = spec_of(name, mu=2, mismatch_correction="tis")
    _, grad, _, prepared = ours(spec, logp, mask, gids, rewards, old, is_weights=w)
    leaf = logp.clone().requires_grad_()
    seq = sequence_log_ratio(torch.where(mask, logp - old, 0.0), mask)
    s = torch.exp(leaf - leaf.detach() + seq[:, None])
    a = prepared.advantages.to(F64)[:, None] * w
    if name == "gspo":
        term = torch.maximum(-s * a, -s.clamp(1 - spec.clip_eps_low, 1 + spec.clip_eps_high) * a)
        loss = (torch.where(mask, term, 0.0).sum(1) / mask.sum(1)).mean()
    else:
        r = torch.exp(logp - old).clamp(1 - spec.clip_eps_low, 1 + spec.clip_eps_high)
        loss = -torch.where(mask, r * a * leaf, 0.0).sum() / mask.sum()
    loss.backward()
    assert torch.allclose(grad, torch.where(mask, leaf.grad, 0.0), rtol=1e-8, atol=1e-12)


def test_gspo_context_parallel_shares_sum_to_the_whole_completion():
    """Under CP a rank holds part of each completion: with the whole rows' log s_i and lengths passed in
    (the train step sums them over the CP group), the shares' losses and gradients add up to the whole.
    Injected bug seen failing: ``compute_loss`` ignoring ``seq_log_ratio`` (each share's own mean):
    summed loss 0.0193 against 2.89e-4."""
    mask, gids, rewards, logp, old = random_groups(1)
    spec = spec_of("gspo", mu=2)
    prepared = prepare_batch(spec, token_ids=torch.zeros(mask.shape, dtype=torch.long), mask=mask, rewards=rewards,
                             group_ids=gids)
    whole, whole_grad, _, _ = ours(spec, logp, mask, gids, rewards, old)
    held = torch.zeros(mask.shape, dtype=torch.bool)
    held[:, ::2] = True                                                     # two interleaved shares per row
    seq = sequence_log_ratio(torch.where(mask, logp - old, 0.0), mask)
    total, grad = torch.zeros((), dtype=F64), torch.zeros(mask.shape, dtype=F64)
    for share in (held, ~held):
        leaf = logp.clone().requires_grad_()
        tokens = TokenInputs(logp=leaf, mask=mask & share, old_logp=old, lengths=mask.sum(1), seq_log_ratio=seq)
        loss, _ = compute_loss(spec, tokens, prepared, num_seqs=mask.shape[0])
        loss.backward()
        total, grad = total + loss.detach(), grad + torch.where(mask & share, leaf.grad, 0.0)
        assert torch.equal(surrogate_log_ratio(spec, tokens), torch.where(mask & share, seq[:, None], 0.0))
    assert total.item() == pytest.approx(whole.item(), rel=1e-9)
    assert torch.allclose(grad, whole_grad, rtol=1e-8, atol=1e-12)


def test_d4_regions_gspo_by_sequence_cispo_none():
    """D4's favoured-clip region: GSPO's by the sequence ratio (every token of a clipped completion);
    CISPO has none (truncated weights keep their gradient), though its clip fractions count them."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    old = torch.zeros(2, 3, dtype=F64)
    logp = torch.tensor([[0.01, -0.01, 0.0015], [0.0, -0.3, 0.0]], dtype=F64)   # log s = 5e-4, -0.15
    gspo = spec_of("gspo", mu=2)
    tokens = TokenInputs(logp=logp, mask=mask, old_logp=old)
    log_s = surrogate_log_ratio(gspo, tokens)
    assert torch.allclose(log_s, torch.tensor([[5e-4] * 3, [-0.15, -0.15, 0.0]], dtype=F64))
    adv = prepared_of(torch.tensor([1.0, -1.0], dtype=F64))
    assert favoured_clip_mask(gspo, log_s, adv, mask).tolist() == mask.tolist()
    token_level = favoured_clip_mask(spec_of("grpo", mu=2), surrogate_log_ratio(spec_of("grpo", mu=2), tokens),
                                     adv, mask)
    assert token_level.tolist() == [[False, False, False], [False, True, False]]
    cispo = spec_of("cispo", mu=2, clip_eps_low=0.1)
    assert not favoured_clip_mask(cispo, log_s, adv, mask).any()
    low, high = clip_regions(cispo, torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, -1.0, -1.0]))
    assert low.tolist() == [True, False, False] and high.tolist() == [False, False, True]


def test_omega_is_the_gradient_at_rho_one():
    """D1/D2's omega * A equals -d loss / d logp at rho = 1 for both (GSPO: GRPO's weights, CISPO: DAPO's)."""
    mask, gids, rewards, logp, _ = random_groups(4)
    for name in ("gspo", "cispo"):
        spec = spec_of(name)
        _, grad, _, prepared = ours(spec, logp, mask, gids, rewards)
        omega = token_omega(spec, mask, prepared)
        assert torch.allclose(-grad, omega * prepared.advantages.to(F64)[:, None], rtol=1e-9, atol=1e-14)


def test_documented_d1_d4_table_is_what_the_functions_give():
    """docs/algorithms.md 16 holds bench/bias_table.py's rows for all six algorithms, recomputed here
    from the real prepare_batch / token_omega / prefix_bias / compute_loss / favoured_clip_mask.
    Injected bug seen failing: CISPO's favoured-clip region not emptied (D4 0.09524 instead of 0)."""
    from bench.bias_table import markdown, row
    from megatron_gtpo.algo import ALGO_NAMES
    from tests.helpers import REPO

    doc = (REPO / "docs" / "algorithms.md").read_text().split("## 16. ")[1]
    documented = [line for line in doc.splitlines() if line.startswith("| ") and not line.startswith("| algorithm")]
    assert documented == [markdown(name, row(name)) for name in ALGO_NAMES]
