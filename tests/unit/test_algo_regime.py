"""GTPO's regime diagnostics (algo/regime.py): the entropy shift's share of the coefficients, the
length drift D5 and the equal-group share, on the two representative groups of the learning review
(/shared/reviews/gtpo_learning.md, section 3.1 and its appendix), through the real preparation path
(``prepare_batch`` + ``token_omega``). The oracle is an independent plain-Python transcription of the
review's per-token coefficients; the review's published D5 values (-13.7, -13.9, -7.0, +7.0) are
checked too.

Injected bugs, each seen failing once: D5 centred on the batch mean length instead of the group's
(1 test fails: the two-group case); lengths taken from the padded width (6 fail); the shift share
taken from the shaped advantages alone, so the shift counts as advantage (4 fail).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo.algo import prepare_batch, regime_metrics, token_omega
from tests.algo_helpers import spec_of

MIXED = ([1, 0, 0, 0, 0, 0, 0, 0], [25, 25, 25, 64, 64, 64, 64, 64], [1.4, 1.5, 1.5, 1.7, 1.7, 1.7, 1.7, 1.7])
WRONG = ([0] * 8, [25, 25, 64, 64, 64, 64, 64, 64], [1.5, 1.5, 1.7, 1.7, 1.7, 1.7, 1.7, 1.7])
SPECS = {
    "grpo": {"adv_std_scale": True, "agg_mode": "seq-mean-token-mean", "kl_beta": 0.0},
    "drgrpo": {"max_completion_tokens": 64},
    "gtpo": {"entropy_gamma": 0.1, "entropy_threshold": 2.0, "gtpo_prompt_reduction": "sum"},
}


def review_coefficients(algo: str, rewards, lengths, entropies, gamma=0.1):
    """The review appendix's per-token coefficients, split into (advantage part, shift part)."""
    mean = sum(rewards) / len(rewards)
    if algo == "grpo":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
        adv = [0.0 if r == mean else (r - mean) / (std + 1e-4) / (len(rewards) * n) for r, n in zip(rewards, lengths)]
        return adv, [0.0] * len(adv)
    if algo == "drgrpo":
        return [(r - mean) / (len(rewards) * 64) for r in rewards], [0.0] * len(rewards)
    return [(r - mean) / n for r, n in zip(rewards, lengths)], [gamma * h / n for h, n in zip(entropies, lengths)]


def review_d5(coef, lengths):
    mean_len = sum(lengths) / len(lengths)
    return sum(c * (n - mean_len) for c, n in zip(coef, lengths)) / sum(abs(c) for c in coef)


def batch_of(groups, width=64):
    """Token ids unique per completion (no GTPO conflicts: lambda = 1, n_i = 0, as the review assumes)."""
    rewards, lengths, entropies, gids = [], [], [], []
    for g, (r, n, h) in enumerate(groups):
        rewards += r
        lengths += n
        entropies += h
        gids += [g] * len(r)
    rows = len(rewards)
    ids = torch.arange(rows)[:, None] * 1000 + torch.arange(width)[None, :]
    lengths_t = torch.tensor(lengths)
    mask = torch.arange(width)[None, :] < lengths_t[:, None]
    return ids, mask, torch.tensor(rewards, dtype=torch.float32), torch.tensor(gids), torch.tensor(entropies), lengths_t


def metrics_of(algo: str, groups):
    ids, mask, rewards, gids, entropies, lengths = batch_of(groups)
    spec = spec_of(algo, **SPECS[algo])
    prepared = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=entropies)
    omega = token_omega(spec, mask, prepared, num_tokens=float(mask.sum()), num_seqs=float(mask.shape[0]))
    return {k: float(v) for k, v in regime_metrics(omega, prepared, gids, lengths).items()}


@pytest.mark.parametrize("algo, group, published", [("grpo", MIXED, -13.7), ("drgrpo", MIXED, -13.9),
                                                      ("gtpo", MIXED, -7.0), ("gtpo", WRONG, 7.0)])
def test_length_drift_and_shift_share_match_the_review(algo, group, published):
    got = metrics_of(algo, [group])
    adv, shift = review_coefficients(algo, *group)
    coef = [a - s for a, s in zip(adv, shift)]
    assert got["bias/length_drift"] == pytest.approx(review_d5(coef, group[1]), rel=1e-6)
    assert round(got["bias/length_drift"], 1) == published
    share = sum(map(abs, shift)) / (sum(map(abs, adv)) + sum(map(abs, shift)))
    assert got["gtpo/shift_share"] == pytest.approx(share, rel=1e-6)
    assert got["batch/equal_groups_frac"] == (1.0 if group is WRONG else 0.0)


def test_shift_share_is_the_whole_update_on_an_all_wrong_group_and_small_on_the_paper_scale():
    """All-equal group: the shift is the only signal (share 1). The same mixed group on the paper's
    reward scale (x20, as its 0-20 reward) carries a shift share under 5% (0.03); on 0/1 0.36."""
    assert metrics_of("gtpo", [WRONG])["gtpo/shift_share"] == pytest.approx(1.0)
    paper = ([20 * r for r in MIXED[0]], MIXED[1], MIXED[2])
    assert metrics_of("gtpo", [paper])["gtpo/shift_share"] < 0.05
    assert metrics_of("gtpo", [MIXED])["gtpo/shift_share"] == pytest.approx(0.36, abs=0.005)


def test_two_groups_are_centred_on_their_own_mean_length():
    """D5 subtracts each group's mean length: an all-wrong group of long answers next to a mixed one."""
    got = metrics_of("gtpo", [MIXED, WRONG])
    adv_m, shift_m = review_coefficients("gtpo", *MIXED)
    adv_w, shift_w = review_coefficients("gtpo", *WRONG)
    coef_m = [a - s for a, s in zip(adv_m, shift_m)]
    coef_w = [a - s for a, s in zip(adv_w, shift_w)]
    mean_m, mean_w = sum(MIXED[1]) / 8, sum(WRONG[1]) / 8
    num = sum(c * (n - mean_m) for c, n in zip(coef_m, MIXED[1])) + sum(c * (n - mean_w) for c, n in zip(coef_w, WRONG[1]))
    assert got["bias/length_drift"] == pytest.approx(num / sum(map(abs, coef_m + coef_w)), rel=1e-6)
    assert got["batch/equal_groups_frac"] == 0.5


def test_a_filtered_completion_carries_no_shift():
    """delta = 0 (<H>_i above the threshold) removes the completion from both parts."""
    hot = (WRONG[0], WRONG[1], [1.5, 1.5] + [2.5] * 6)   # six above the 2.0 threshold
    got = metrics_of("gtpo", [hot])
    _, shift = review_coefficients("gtpo", *WRONG)
    coef = [-s for s in shift[:2]] + [0.0] * 6
    assert got["bias/length_drift"] == pytest.approx(review_d5(coef, WRONG[1]), rel=1e-6)
    assert got["gtpo/shift_share"] == pytest.approx(1.0)


def test_no_weight_at_all_reports_zero():
    got = metrics_of("grpo", [WRONG])
    assert got == {"gtpo/shift_share": 0.0, "bias/length_drift": 0.0, "batch/equal_groups_frac": 1.0}
