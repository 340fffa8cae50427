"""D1 shared-prefix weight (algo/prefix.py, spec 6 Prop. 1, spec 10.2) against the spec's tables, hand
values and a brute-force trie over Python tuples."""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.algo import prefix_bias, prefix_bias_metrics, prepare_batch, shared_prefixes, token_omega
from tests.algo_helpers import spec_of
from tests.unit.test_algo_conflict import EXAMPLE1, EXAMPLE2, padded

REWARDS1 = torch.tensor([1.0, 1.0, 0.0, 0.0])
ENTROPY1 = torch.tensor([0.35, 0.50, 0.90, 0.40])
GROUP1 = torch.zeros(4, dtype=torch.long)


def d1(algo, ids, mask, rewards, gids, mean_h=None, constant=None, **fields):
    """D1 metrics through the real prepare_batch and the loss's own weights (whole batch)."""
    if mean_h is None:
        mean_h = torch.full((len(rewards),), 0.3)
    spec = spec_of(algo, max_completion_tokens=constant or 16, **fields)
    prep = prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids, mean_entropy=mean_h)
    omega = token_omega(spec, mask, prep)
    c = omega * prep.advantages.double()[:, None]
    return prefix_bias(ids, mask, gids, prep.raw_advantages, c, runs=prep.runs), prep, c


def test_example1_trie_and_spec_w_agg_table():
    """Spec 5.9: token 0 (id 5) is shared by all four completions, token 1 (id 7) by o1, o2, o3."""
    ids, mask = padded(EXAMPLE1)
    tree = shared_prefixes(ids, mask, GROUP1, torch.tensor([0.5, 0.5, -0.5, -0.5]))
    assert tree.node[:, :2].tolist() == [[0, 1], [0, 1], [0, 1], [0, -1]]
    assert torch.all(tree.node[:, 2:] == -1)
    assert tree.size.tolist() == [4, 3] and tree.positive.tolist() == [2, 2] and tree.negative.tolist() == [2, 1]
    assert tree.depth.tolist() == [0, 1] and tree.common_len.tolist() == [1] and tree.common.tolist() == [True, False]
    z = 0.5 / (torch.tensor([1.0, 1, 0, 0]).std().item() + 1e-4)
    lengths = torch.tensor([5.0, 5.0, 6.0, 5.0])
    grpo, _, c = d1("grpo", ids, mask, REWARDS1, GROUP1)
    expected = (z * torch.tensor([1.0, 1, -1, -1]) / (4 * lengths)).sum().item()     # sum A_i / (G |o_i|)
    assert grpo["bias/prefix_wagg_common"].item() == pytest.approx(expected, rel=1e-6)
    assert grpo["bias/prefix_wagg_common"].item() == pytest.approx(0.0072, abs=5e-5)
    node2 = (z / 20 + z / 20 - z / 24)                                              # o1, o2, o3 at t = 1
    assert grpo["bias/prefix_wagg_abs_mean"].item() == pytest.approx((abs(expected) + node2) / 2, rel=1e-6)
    assert grpo["bias/prefix_mixed_nodes_per_group"].item() == 2.0
    assert grpo["bias/prefix_common_len"].item() == 1.0
    for algo, constant in (("drgrpo", 6), ("dapo", None)):
        out, _, _ = d1(algo, ids, mask, REWARDS1, GROUP1, constant=constant)
        assert abs(out["bias/prefix_wagg_common"].item()) < 1e-9
    for normalization, value in (("paper", 0.0915), ("code", 0.183)):
        out, _, _ = d1("gtpo", ids, mask, REWARDS1, GROUP1, mean_h=ENTROPY1, gtpo_normalization=normalization)
        assert out["bias/prefix_wagg_common"].item() == pytest.approx(value, abs=1e-7)
        assert out["bias/prefix_wagg_common_sum"].item() == pytest.approx(value, abs=1e-7)   # one position
    assert "bias/prefix_wagg_len_corr" not in grpo                                    # one group: undefined


def test_example2_conflicts_beyond_true_prefixes():
    """Spec 5.9 example 2: o1's forward run covers 5 tokens but it shares only ``5 7 9`` with o3."""
    ids, mask = padded(EXAMPLE2)
    out, prep, _ = d1("gtpo", ids, mask, REWARDS1, GROUP1)
    assert prep.runs.fwd.tolist() == [5, 2, 3, 1] and prep.runs.num_conflict_tokens.tolist() == [5, 4, 4, 4]
    tree = shared_prefixes(ids, mask, GROUP1, prep.raw_advantages)
    assert tree.mixed_prefix_lengths().tolist() == [3, 2, 3, 1]
    assert out["bias/conflict_true_prefix_per_seq"].item() == pytest.approx(9 / 4)
    assert out["bias/conflict_fwd_excess_per_seq"].item() == pytest.approx(2 / 4)
    assert out["bias/conflict_beyond_prefix_frac"].item() == pytest.approx((17 - 9) / 17)


def brute_force(ids, mask, gids, adv, c):
    """Trie over Python tuples: {(group, prefix tuple): [rows]} for every prefix shared by >= 2 rows."""
    nodes = {}
    lengths = mask.sum(1).tolist()
    for i in range(ids.shape[0]):
        for t in range(lengths[i]):
            nodes.setdefault((int(gids[i]), tuple(ids[i, :t + 1].tolist())), []).append(i)
    return {key: rows for key, rows in nodes.items() if len(rows) >= 2}


@pytest.mark.parametrize("seed", range(6))
def test_trie_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    groups = [int(g) for g in torch.randint(2, 9, (5,), generator=gen)]
    batch, width = sum(groups), 9
    ids = torch.randint(0, 2 + seed % 3, (batch, width), generator=gen)
    mask = torch.arange(width)[None, :] < torch.randint(0, width + 1, (batch,), generator=gen)[:, None]
    gids = torch.cat([torch.full((g,), 100 - 3 * k) for k, g in enumerate(groups)])   # unsorted ids
    perm = torch.randperm(batch, generator=gen)                                        # groups interleaved
    ids, mask, gids = ids[perm], mask[perm], gids[perm]
    adv = torch.randint(-1, 2, (batch,), generator=gen).float()
    c = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    tree = shared_prefixes(ids, mask, gids, adv)
    nodes = brute_force(ids, mask, gids, adv, c)
    assert tree.size.numel() == len(nodes)
    num_groups = len(groups)
    w_node = {}
    for (group, prefix), rows in nodes.items():
        t = len(prefix) - 1
        ids_here = {int(tree.node[i, t]) for i in rows}
        assert len(ids_here) == 1 and -1 not in ids_here                     # one node, all its rows
        n = ids_here.pop()
        assert int(tree.size[n]) == len(rows) and int(tree.depth[n]) == t
        assert int(tree.positive[n]) == sum(adv[i] > 0 for i in rows)
        assert int(tree.negative[n]) == sum(adv[i] < 0 for i in rows)
        w_node[n] = sum(c[i, t].item() for i in rows) * num_groups
    shared = {(i, len(p) - 1) for (_, p), rows in nodes.items() for i in rows}
    for i in range(batch):
        for t in range(width):
            assert (int(tree.node[i, t]) >= 0) == ((i, t) in shared)
    mixed = [w for n, w in w_node.items() if tree.positive[n] > 0 and tree.negative[n] > 0]
    out = prefix_bias_metrics(tree, c, adv, mask)
    expected = sum(abs(w) for w in mixed) / len(mixed) if mixed else 0.0
    assert out["bias/prefix_wagg_abs_mean"].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # common prefix length per group and per-row opposite-sign shared-prefix length
    for g in set(gids.tolist()):
        rows = (gids == g).nonzero().squeeze(1).tolist()
        lengths = [int(mask[i].sum()) for i in rows]
        common = 0
        while common < min(lengths) and len({int(ids[i, common]) for i in rows}) == 1:
            common += 1
        gi = sorted(set(gids.tolist())).index(g)
        assert int(tree.common_len[gi]) == common
    for i in range(batch):
        true_len = sum(1 for (group, p), rows in nodes.items() if i in rows
                       and any(adv[j] > 0 for j in rows) and any(adv[j] < 0 for j in rows))
        assert int(tree.mixed_prefix_lengths()[i]) == true_len


def batch_with_common_prefixes(seed: int, groups: int = 6, size: int = 5, width: int = 16):
    """Random groups whose completions share a 1-4 token common prefix; lengths differ."""
    gen = torch.Generator().manual_seed(seed)
    batch = groups * size
    ids = torch.randint(0, 50, (batch, width), generator=gen)
    common = torch.randint(1, 5, (groups,), generator=gen)
    for g in range(groups):
        ids[g * size:(g + 1) * size, :int(common[g])] = ids[g * size, :int(common[g])]
    lengths = torch.randint(6, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    gids = torch.arange(groups).repeat_interleave(size)
    rewards = torch.tensor([1.0, 0.0] * (batch // 2) + [1.0] * (batch % 2))
    return ids, mask, gids, rewards, common, lengths


@pytest.mark.parametrize("seed", range(4))
def test_common_prefix_expectations_per_algorithm(seed):
    """Spec 10.2 on many groups: 0 for Dr. GRPO and DAPO, sum_i A_i/(G|o_i|) for GRPO (per group,
    averaged; the num_groups scaling makes it the one-prompt value), > 0 for GTPO."""
    ids, mask, gids, rewards, common, lengths = batch_with_common_prefixes(seed)
    groups = len(common)
    for algo, constant in (("drgrpo", 16), ("dapo", None)):
        out, _, _ = d1(algo, ids, mask, rewards, gids, constant=constant)
        assert abs(out["bias/prefix_wagg_common"].item()) < 1e-7
        assert abs(out["bias/prefix_wagg_common_sum"].item()) < 1e-6
    out, prep, _ = d1("grpo", ids, mask, rewards, gids)
    per_group = torch.zeros(groups, dtype=torch.float64).index_add_(
        0, gids, prep.advantages.double() / (5 * lengths.double()))
    assert out["bias/prefix_wagg_common"].item() == pytest.approx(per_group.mean().item(), rel=1e-9)
    assert abs(out["bias/prefix_wagg_common"].item()) > 1e-4                       # lengths differ: not 0
    assert out["bias/prefix_wagg_common_sum"].item() == pytest.approx(
        (per_group * common.double()).mean().item(), rel=1e-9)
    assert out["bias/prefix_common_len"].item() == pytest.approx(common.double().mean().item())
    gap = torch.tensor([lengths[gids == g][rewards[gids == g] > 0.5].double().mean()
                        - lengths[gids == g][rewards[gids == g] < 0.5].double().mean() for g in range(groups)])
    x, y = per_group - per_group.mean(), gap - gap.mean()
    pearson = (x * y).sum() / (x.square().sum() * y.square().sum()).sqrt()
    assert out["bias/prefix_wagg_len_corr"].item() == pytest.approx(pearson.item(), rel=1e-9)
    for normalization in ("paper", "code"):
        out, _, _ = d1("gtpo", ids, mask, rewards, gids, gtpo_normalization=normalization, entropy_gamma=0.01)
        assert out["bias/prefix_wagg_common"].item() > 0
        assert out["bias/conflict_fwd_excess_per_seq"].item() >= 0


def test_groups_without_both_signs_and_empty_prefixes():
    """All-equal groups are left out of the common-prefix mean; an empty common prefix counts as 0."""
    rows = [[1, 2, 3], [1, 2, 4], [5, 6], [7, 6, 2], [9, 9], [9, 9, 9]]
    ids, mask = padded(rows)
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])        # group 2 all equal (A = 0)
    out, _, _ = d1("grpo", ids, mask, rewards, gids)
    a = 0.5 / (torch.tensor([1.0, 0.0]).std().item() + 1e-4)
    group0 = a / (2 * 3) - a / (2 * 3)                          # equal lengths: 0
    assert out["bias/prefix_wagg_common"].item() == pytest.approx((group0 + 0.0) / 2, abs=1e-12)
    assert out["bias/prefix_common_len"].item() == pytest.approx((2 + 0) / 2)
    assert out["bias/prefix_mixed_nodes_per_group"].item() == pytest.approx(2 / 3)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    out = prefix_bias(torch.zeros(2, 3, dtype=torch.long), empty, torch.zeros(2, dtype=torch.long),
                      torch.tensor([1.0, -1.0]), torch.zeros(2, 3))
    assert all(v.item() == 0.0 for v in out.values())


def test_prefix_bad_input():
    ids, mask = padded(EXAMPLE1)
    with pytest.raises(ValueError, match="token_ids must have an integer dtype"):
        shared_prefixes(ids.float(), mask, GROUP1, REWARDS1)
    with pytest.raises(ValueError, match="advantages has shape"):
        shared_prefixes(ids, mask, GROUP1, REWARDS1[:3])
    with pytest.raises(ValueError, match="token_ids must be >= 0 inside the mask"):
        shared_prefixes(-ids, mask, GROUP1, REWARDS1)
    tree = shared_prefixes(ids, mask, GROUP1, REWARDS1 - 0.5)
    with pytest.raises(ValueError, match="coefficients has shape"):
        prefix_bias_metrics(tree, torch.zeros(4, 5), REWARDS1, mask)
