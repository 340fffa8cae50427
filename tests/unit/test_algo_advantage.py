"""Group advantages, entropy filter and GTPO shaping (spec 2-5.6, example 1), and DAPO filters (invariant 7)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_gtpo.algo import (completion_mean_entropy, dapo_group_filter, entropy_filter, entropy_from_logits,
                                group_advantages, shape_advantages)
from megatron_gtpo.reward.functions import OverlongPunishment

ONE_GROUP = torch.zeros(4, dtype=torch.long)


def test_example1_mean_only_and_grpo_std():
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    assert group_advantages(rewards, ONE_GROUP, std_scale=False).tolist() == [0.5, 0.5, -0.5, -0.5]
    grpo = group_advantages(rewards, ONE_GROUP, std_scale=True, eps=1e-4)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 1, 0, 0] = 0.577
    assert grpo.tolist() == pytest.approx([0.5 / (std + 1e-4)] * 2 + [-0.5 / (std + 1e-4)] * 2, rel=1e-6)
    assert grpo[0].item() == pytest.approx(0.866, abs=5e-4)
    biased = group_advantages(rewards, ONE_GROUP, std_scale=True, eps=0.0, unbiased=False)
    assert biased.tolist() == [1.0, 1.0, -1.0, -1.0]


def test_groups_of_different_sizes_are_independent():
    rewards = torch.tensor([3.0, 0.0, 1.0, 5.0, 2.0, 4.0])
    gids = torch.tensor([9, 2, 9, 2, 2, 9])  # group 9: [3, 1, 4], group 2: [0, 5, 2]
    adv = group_advantages(rewards, gids, std_scale=False)
    assert adv.tolist() == pytest.approx([3 - 8 / 3, 0 - 7 / 3, 1 - 8 / 3, 5 - 7 / 3, 2 - 7 / 3, 4 - 8 / 3])
    z = group_advantages(rewards, gids, std_scale=True, eps=0.0)
    for members in ([0, 2, 5], [1, 3, 4]):
        r = rewards[members].double()
        assert z[members].tolist() == pytest.approx(((r - r.mean()) / r.std()).tolist(), rel=1e-6)


@pytest.mark.parametrize("std_scale", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-4])
def test_all_equal_rewards_give_exact_zero(std_scale, eps):
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.1, 0.2])  # group 0 all equal (mean has rounding error)
    adv = group_advantages(rewards, torch.tensor([0, 0, 0, 1, 1, 1]), std_scale=std_scale, eps=eps)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[5].item() == 0.0 and adv[4] < 0 < adv[3]  # group 1 = [0.3, 0.1, 0.2], mean 0.2
    assert torch.isfinite(adv).all()


def test_rounding_residue_is_snapped_so_signs_are_reliable():
    adv = group_advantages(torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64), torch.zeros(3, dtype=torch.long),
                           std_scale=False)
    assert adv[1].item() == 0.0 and adv[0] < 0 < adv[2]


def test_bad_rewards_and_groups():
    with pytest.raises(ValueError, match="rewards holds a non-finite value"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long), std_scale=True)
    with pytest.raises(ValueError, match="group_ids: group 5 has a single completion"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1, 1, 5]), std_scale=False)
    with pytest.raises(ValueError, match="group_ids has shape"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.zeros(3, dtype=torch.long), std_scale=False)
    with pytest.raises(ValueError, match="group_ids must have an integer dtype"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2), std_scale=False)
    with pytest.raises(ValueError, match="eps=-1"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), std_scale=True, eps=-1)


def test_example1_entropy_filter_and_shaping():
    mean_h = torch.tensor([0.35, 0.50, 0.90, 0.40])
    delta = entropy_filter(mean_h, threshold=0.7)
    assert delta.tolist() == [1.0, 1.0, 0.0, 1.0]
    shaped = shape_advantages(torch.tensor([0.5, 0.5, -0.5, -0.5]), delta=delta, mean_entropy=mean_h, gamma=0.1)
    assert shaped.tolist() == pytest.approx([0.465, 0.450, 0.0, -0.540], abs=1e-7)
    # A = 0 with delta = 1 is pushed by -gamma <H> (spec 5.6)
    assert shape_advantages(torch.zeros(1), delta=torch.ones(1), mean_entropy=torch.tensor([0.5]),
                            gamma=0.1).item() == pytest.approx(-0.05)
    assert entropy_filter(torch.tensor([0.7, 0.7001]), threshold=0.7).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError, match="mean_entropy holds a non-finite value"):
        entropy_filter(torch.tensor([float("nan")]), threshold=0.7)


def test_completion_mean_entropy_and_entropy_from_logits():
    ent = torch.tensor([[1.0, 3.0, 100.0], [2.0, 2.0, 2.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert completion_mean_entropy(ent, mask).tolist() == [2.0, 2.0, 0.0]
    uniform = entropy_from_logits(torch.zeros(2, 3, 8))
    assert torch.allclose(uniform, torch.full((2, 3), math.log(8)))
    peaked = entropy_from_logits(torch.tensor([[0.0, -1e4]]))  # p = [1, 0]; the 1e-6 floor keeps 0 * log 0 = 0
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


def test_dapo_group_filter_drops_all_equal_groups():  # invariant 7
    acc = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])
    gids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])
    assert dapo_group_filter(acc, gids).tolist() == [False] * 3 + [True] * 3 + [False] * 3
    with pytest.raises(ValueError, match="values holds a non-finite value"):
        dapo_group_filter(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))


def test_soft_overlong_punishment_values():  # invariant 7
    max_len, buffer = 20480, 4096
    lengths = [100, max_len - buffer, max_len - buffer // 2, max_len, max_len + 1]
    punish = OverlongPunishment(max_tokens=max_len, cache_tokens=buffer)
    assert [punish(n) for n in lengths] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert OverlongPunishment(max_tokens=max_len, cache_tokens=buffer, factor=2.0)(lengths[2]) == -1.0
    with pytest.raises(ValueError, match="cache_tokens > 0"):
        OverlongPunishment(max_tokens=max_len, cache_tokens=0)(5)
