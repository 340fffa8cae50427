"""D1 shared-prefix weight [spec 6 Prop. 1 and D1, S4 arXiv 2601.05002 §4]: per group, a prefix trie
over the completions; on every node shared by completions of both advantage signs, the net weight
``W_agg = sum_{i in node} omega_{i,t} A_i`` that the token at that node receives.

Prop. 1: completions that share ``y_{1:k}`` push ``log pi(y_t | y_<t)`` for ``t <= k`` with
``sum_{t<=k} grad log pi(y_t) * W_agg(t)``. Here ``W_agg(t) = sum_{i in node(t)} c_{i,t}`` with ``c`` the
loss's own coefficient (``diagnostics.token_omega(...) * advantages``), so it includes GTPO's lambda,
delta and entropy shift, and whatever normaliser the aggregation mode uses. Expected on the
longest common prefix of a whole group (spec 10.2): exactly 0 for Dr. GRPO and DAPO,
``sum_i A_i / (G |o_i|)`` for GRPO seq-mean (non-zero when lengths differ), > 0 for GTPO
(positives get lambda = W there, negatives 0).

Scale: reported ``W_agg`` values are multiplied by the number of groups in the batch, so that with
per-prompt normalisers they equal the spec's one-prompt formulas whatever the prompts per step
(GRPO ``A_i/(G|o_i|)``, Dr. GRPO ``A_i/(G L)``, GTPO paper ``A~_i lambda/(G|o_i|)``; DAPO's
``1/sum_j |o_j|`` becomes one over the mean tokens per group).

Multi-token common prefix: ``bias/prefix_wagg_common`` is the MEAN over its positions of
``W_agg(t)`` (the per-token net weight; for length-normalised or constant weights W_agg does not
depend on t and this is exactly Prop. 1's W_agg); ``bias/prefix_wagg_common_sum`` is the SUM over
positions (the total push on the prefix's log-likelihood). Both are 0 for an empty common prefix.

Algorithm, O(B*T) after one sort: rows are sorted lexicographically by (group, tokens) with
``torch.unique(dim=0)``; the longest common prefix ``lcp_k`` of sorted rows k and k+1 then says that
they share the trie node at every depth ``t < lcp_k``, so the node of token (k, t) is a maximal run of
sorted rows linked at depth t (a column-wise cumsum). Only depths below ``max lcp`` are materialised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.algo.advantage import group_index
from megatron_gtpo.algo.checks import as_mask, check_finite, check_integer, check_shape
from megatron_gtpo.algo.conflict import ConflictRuns, _initial_run

Tensor = torch.Tensor
F64 = torch.float64


@dataclass
class SharedPrefixes:
    """Trie nodes shared by >= 2 completions of one group, for a whole batch (N nodes)."""

    node: Tensor  # [B, T] long
    """Node id (0..N-1) of token (i, t), i.e. of the prefix ``o_{i,<=t}``; -1 if no other completion of
    the group shares that prefix, or outside the mask."""
    size: Tensor  # [N] long
    """Completions in the node."""
    positive: Tensor  # [N] long
    """Completions in the node with A > 0."""
    negative: Tensor  # [N] long
    """Completions in the node with A < 0."""
    group: Tensor  # [N] long
    """Compact group index (``advantage.group_index``) of the node."""
    depth: Tensor  # [N] long
    """Position t of the node's token (0-based)."""
    row_group: Tensor  # [B] long
    """Compact group index of every completion."""
    group_size: Tensor  # [num_groups] long
    """Completions per group."""
    common_len: Tensor  # [num_groups] long
    """Length of the longest prefix shared by ALL completions of the group (0 for a singleton group)."""

    @property
    def mixed(self) -> Tensor:  # [N] bool
        """Node holds completions of both advantage signs."""
        return (self.positive > 0) & (self.negative > 0)

    @property
    def common(self) -> Tensor:  # [N] bool
        """Node lies on its group's longest common prefix (holds every completion of the group)."""
        return self.size == self.group_size[self.group]

    def mixed_prefix_lengths(self) -> Tensor:  # [B] long
        """Per completion, the length of its longest prefix shared with a completion of the opposite
        sign: the number of positions whose node is mixed (a deeper node is a subset of a shallower one)."""
        if self.size.numel() == 0:
            return torch.zeros(self.node.shape[0], dtype=torch.long)
        node = self.node[:, :int(self.depth.max()) + 1]
        return ((node >= 0) & self.mixed[node.clamp(min=0)]).sum(dim=1)


def shared_prefixes(token_ids: Tensor, mask: Tensor, group_ids: Tensor, advantages: Tensor) -> SharedPrefixes:
    """The shared trie nodes of every group (module docstring). ``token_ids``/``mask`` [B, T] in the
    completion view (prefix mask); ``group_ids`` [B]; ``advantages`` [B]: only the sign is used (pass
    the unshaped group-relative A, the same signs as GTPO's conflicts)."""
    mask = as_mask(mask).cpu()                                # a per-step CPU computation on the whole batch
    batch, width = mask.shape
    check_shape(token_ids, (batch, width), name="token_ids", what="[B, T], like mask")
    check_integer(token_ids, name="token_ids")
    check_shape(advantages, (batch,), name="advantages", what="[B], one per completion")
    check_finite(advantages, name="advantages")
    check_shape(group_ids, (batch,), name="group_ids", what="[B], one prompt id per completion")
    token_ids, advantages = token_ids.cpu(), advantages.detach().cpu()
    gidx, gsize = group_index(group_ids.cpu())
    tokens = torch.where(mask, token_ids.long(), -1)          # -1 sorts a shorter prefix first
    if bool(((token_ids < 0) & mask).any()):
        raise ValueError("token_ids must be >= 0 inside the mask (got a negative id)")
    order = torch.argsort(torch.unique(torch.cat([gidx[:, None], tokens], dim=1), dim=0,
                                       return_inverse=True)[1], stable=True)
    s, sg = tokens[order], gidx[order]
    eq = (s[:-1] == s[1:]) & (s[:-1] >= 0) & (sg[:-1] == sg[1:])[:, None]
    lcp = _initial_run(eq) if eq.numel() else torch.zeros(max(batch - 1, 0), dtype=torch.long)
    depth = int(lcp.max()) if lcp.numel() else 0
    linked = lcp[:, None] > torch.arange(depth)[None, :]      # [B-1, W]: sorted k, k+1 share node at t
    shared = torch.zeros(batch, depth, dtype=torch.bool)
    shared[:-1] |= linked
    shared[1:] |= linked
    start = shared.clone()
    start[1:] &= ~linked                                      # first sorted row of each shared node
    ids = (torch.cumsum(start.T.reshape(-1), 0) - 1).reshape(depth, batch).T   # column-major numbering
    ids = torch.where(shared, ids, -1)
    first = start.T.nonzero()                                 # [N, 2] (t, k) in id order
    sign = torch.sign(advantages)[order][:, None].expand(batch, depth)[shared]
    flat = ids[shared]
    num = first.shape[0]
    node = torch.full((batch, width), -1, dtype=torch.long)
    node[order, :depth] = ids
    same = sg[:-1] == sg[1:]
    common = torch.full((gsize.numel(),), width, dtype=torch.long).scatter_reduce_(
        0, sg[:-1][same], lcp[same], "amin")
    return SharedPrefixes(
        node=node, size=torch.bincount(flat, minlength=num), positive=torch.bincount(flat[sign > 0], minlength=num),
        negative=torch.bincount(flat[sign < 0], minlength=num), group=sg[first[:, 1]], depth=first[:, 0],
        row_group=gidx, group_size=gsize, common_len=torch.where(gsize >= 2, common, 0))


def prefix_bias(token_ids: Tensor, mask: Tensor, group_ids: Tensor, advantages: Tensor, coefficients: Tensor, *,
                runs: ConflictRuns | None = None) -> dict[str, Tensor]:
    """D1 metrics of one batch: ``shared_prefixes`` then ``prefix_bias_metrics`` (see there)."""
    prefixes = shared_prefixes(token_ids, mask, group_ids, advantages)
    return prefix_bias_metrics(prefixes, coefficients, advantages, mask, runs=runs)


def prefix_bias_metrics(prefixes: SharedPrefixes, coefficients: Tensor, advantages: Tensor, mask: Tensor, *,
                        runs: ConflictRuns | None = None) -> dict[str, Tensor]:
    """D1 metrics (0-d float64 tensors) from the trie and the loss coefficients ``c`` [B, T]
    (``token_omega(...) * prepared.advantages[:, None]``); ``advantages`` [B] are the unshaped A
    (their signs define "mixed" and the length gap). "Mixed groups" have both signs.

    * ``bias/prefix_wagg_common`` (``_sum``): mean over mixed groups of ``W_agg`` on the group's longest
      common prefix, mean (sum) over its positions, 0 when it is empty (module docstring);
    * ``bias/prefix_common_len``: mean length of that prefix over mixed groups;
    * ``bias/prefix_wagg_abs_mean``: mean ``|W_agg|`` over all mixed shared nodes (0 if none);
    * ``bias/prefix_mixed_nodes_per_group``: number of mixed shared nodes per group;
    * ``bias/prefix_wagg_len_corr``: Pearson correlation, over mixed groups with a non-empty common
      prefix, of ``W_agg(common)`` with ``mean|o|(A>0) - mean|o|(A<0)``; absent when undefined
      (fewer than 2 such groups or a constant series);
    * with GTPO's ``runs`` (``prepared.runs``), how far position-matched conflicts (spec 5.3) reach
      beyond true shared prefixes, over completions with A != 0: ``bias/conflict_beyond_prefix_frac``
      (share of conflict tokens not inside a prefix shared with an opposite-sign completion),
      ``bias/conflict_true_prefix_per_seq`` and ``bias/conflict_fwd_excess_per_seq`` (forward run
      length minus true shared-prefix length; a true opposite-sign shared prefix always lies inside
      the forward run, unless ``pad_id`` tokens occur inside the mask).
    """
    mask = as_mask(mask).cpu()
    check_shape(coefficients, tuple(mask.shape), name="coefficients", what="[B, T], like mask")
    check_shape(advantages, tuple(mask.shape[:1]), name="advantages", what="[B], one per completion")
    num_groups = prefixes.group_size.numel()
    depth = int(prefixes.depth.max()) + 1 if prefixes.depth.numel() else 0    # columns beyond: no shared node
    node = prefixes.node[:, :depth]
    hit = node >= 0                                                           # inside the mask by construction
    c = coefficients[:, :depth].detach().cpu()[hit].to(F64)
    w_node = torch.zeros(prefixes.size.numel(), dtype=F64).index_add_(0, node[hit], c) * num_groups
    mixed = prefixes.mixed
    sign = torch.sign(advantages.detach().cpu())
    out = {"bias/prefix_wagg_abs_mean": _mean(w_node[mixed].abs()),
           "bias/prefix_mixed_nodes_per_group": torch.tensor(int(mixed.sum()) / max(num_groups, 1), dtype=F64),
           **_common_prefix_metrics(prefixes, w_node, sign, mask.sum(dim=1).to(F64))}
    if runs is not None:
        out.update(_conflict_vs_prefix(prefixes, runs, sign != 0))
    return out


def _common_prefix_metrics(prefixes: SharedPrefixes, w_node: Tensor, sign: Tensor, lens: Tensor) -> dict[str, Tensor]:
    """The ``bias/prefix_wagg_common*``, ``_common_len`` and ``_len_corr`` entries (see the caller)."""
    num_groups = prefixes.group_size.numel()
    index = prefixes.row_group

    def per_group(values: Tensor) -> Tensor:                  # [B] -> [num_groups] sums
        return torch.zeros(num_groups, dtype=F64).index_add_(0, index, values.to(F64))

    positive, negative = sign > 0, sign < 0
    group_mixed = (per_group(positive) > 0) & (per_group(negative) > 0)
    on_common = prefixes.common
    w_sum = torch.zeros(num_groups, dtype=F64).index_add_(0, prefixes.group[on_common], w_node[on_common])
    length = prefixes.common_len
    w_mean = torch.where(length > 0, w_sum / length.clamp(min=1), 0.0)
    out = {"bias/prefix_wagg_common": _mean(w_mean[group_mixed]),
           "bias/prefix_wagg_common_sum": _mean(w_sum[group_mixed]),
           "bias/prefix_common_len": _mean(length[group_mixed].to(F64))}
    gap = (per_group(torch.where(positive, lens, 0.0)) / per_group(positive).clamp(min=1)
           - per_group(torch.where(negative, lens, 0.0)) / per_group(negative).clamp(min=1))
    keep = group_mixed & (length > 0)
    corr = _pearson(w_mean[keep], gap[keep])
    if corr is not None:
        out["bias/prefix_wagg_len_corr"] = corr
    return out


def _conflict_vs_prefix(prefixes: SharedPrefixes, runs: ConflictRuns, active: Tensor) -> dict[str, Tensor]:
    true_len = prefixes.mixed_prefix_lengths()
    inside = torch.minimum(true_len, runs.fwd)
    total = runs.num_conflict_tokens[active].sum()
    beyond = total - inside[active].sum()
    return {"bias/conflict_beyond_prefix_frac": torch.tensor(int(beyond) / max(int(total), 1), dtype=F64),
            "bias/conflict_true_prefix_per_seq": _mean(true_len[active].to(F64)),
            "bias/conflict_fwd_excess_per_seq": _mean((runs.fwd - inside)[active].to(F64))}


def _mean(x: Tensor) -> Tensor:
    return x.to(F64).mean() if x.numel() else torch.zeros((), dtype=F64)


def _pearson(x: Tensor, y: Tensor) -> Tensor | None:
    if x.numel() < 2:
        return None
    dx, dy = x - x.mean(), y - y.mean()
    denom = (dx.square().sum() * dy.square().sum()).sqrt()
    return None if float(denom) == 0.0 else (dx * dy).sum() / denom
