"""GTPO conflict tokens and their weights lambda (docs/algorithms.md sections 5.3-5.4, 5.8).

Definition (from the official code, semantics confirmed by the spec's port):

* Only completions with ``A_i != 0`` take part: P = {A > 0}, N = {A < 0} (unshaped advantages).
* ``raw[i, t] = 1`` iff token ``o_{i,t}`` occurs at position ``t`` in some completion of P **and** in
  some completion of N of the same group (completion ``i`` counts itself). Matching is per position
  and per token id, not per shared context.
* Forward conflicts are the maximal initial run of ``raw``; backward conflicts the same test with
  positions counted from each completion's last masked token (distance 0 = EOS).
* ``lambda``: 1 off-conflict and for inactive completions; ``W`` on a positive completion's conflict
  tokens and 0 on a negative one's. ``overlap="product"`` reproduces the code's ``lambda_fwd *
  lambda_bwd`` (``W*W`` where a positive completion's runs overlap); ``"union"`` gives ``W``.
* ``n_i = max(a_i, b_i)`` with ``a_i``/``b_i`` the forward/backward run lengths: the code's count of
  conflict positions, used by the code-level normalisation ``1/max(1, n_i)``.

Algorithm (vectorised; no loop over tokens or over pairs of completions). Forward and backward
directions are stacked as 2B "rows" (backward rows read token ``len_i - 1 - d`` at distance ``d``
and live in their own group ids). Runs are found by a doubling-window scan: window ``k`` covers
positions ``[s_k, s_k + w_k)`` with ``w_k = first_window * 2**k`` and only loads the groups that
still have an unfinished run. Inside a window the rows are laid out as ``[group, rank in group,
position]`` and each ``(group, position)`` slot is sorted along the rank axis by ``4 * token + code``
(code 1 = positive, 2 = negative): equal tokens become adjacent, positives first, so a token is held
by both signs iff its run starts with a positive and ends with a negative (found with cummax/cummin).
That is O(G log G) per slot, i.e. O(B*T log G) in the worst case (every run reaches the end; the
windows then cover T once) and O(B * longest run) for real text, plus the O(B*T) construction of
lambda. When group sizes are so unequal that padding every group to the largest would more than
double the work, the window falls back to keys ``(group, position, token)`` with one ``torch.unique``
plus one ``index_add_`` (O(N log N)). The loop over windows runs ``log2(T / first_window) + 1`` times
at most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.algo.advantage import group_index
from megatron_gtpo.algo.checks import as_mask, check_finite, check_integer, check_shape
from megatron_gtpo.algo.choices import OVERLAP_MODES

Tensor = torch.Tensor

_NEG_UNIT = 1 << 32  # index_add_ packs (#positive, #negative) holders of a key into one int64
_MAX_SLOT_PADDING = 2.0  # slot kernel only if (open groups x largest group) <= this x rows in the window


@dataclass
class ConflictRuns:
    """Per-completion conflict run lengths of one global batch."""

    fwd: Tensor  # [B] long
    """``a_i``: length of the forward (left-aligned) conflict run; 0 for inactive completions."""
    bwd: Tensor  # [B] long
    """``b_i``: length of the backward run, counted back from the last masked token."""
    lengths: Tensor  # [B] long
    """``|o_i|``: number of masked tokens of each completion."""

    @property
    def n(self) -> Tensor:  # [B] long
        """``n_i = max(a_i, b_i)``: the official code's conflict count (spec 5.8)."""
        return torch.maximum(self.fwd, self.bwd)

    @property
    def num_conflict_tokens(self) -> Tensor:  # [B] long
        """Size of the conflict set ``C_fwd OR C_bwd``: ``min(a_i + b_i, |o_i|)``."""
        return torch.minimum(self.fwd + self.bwd, self.lengths)


def conflict_runs(token_ids: Tensor, mask: Tensor, advantages: Tensor, group_ids: Tensor, *,
                  pad_id: int | None = None, first_window: int = 64) -> ConflictRuns:
    """Forward/backward conflict run lengths of every completion (spec 5.3).

    Args:
      token_ids: [B, T] integer completion tokens, right-padded.
      mask: [B, T] loss mask, a prefix of ones per row (tokens up to and including EOS).
      advantages: [B] *unshaped* advantages; only their sign matters (0 = inactive).
      group_ids: [B] integer prompt id of each completion; groups may differ in size.
      pad_id: tokens with this id never match, so they end a run (the code excludes PAD_ID).
        ``None`` relies on ``mask`` alone.
      first_window: width of the first window of the doubling scan; a performance knob only,
        the result does not depend on it.
    """
    mask, tokens, sign, gidx, num_groups = _validate(token_ids, mask, advantages, group_ids)
    if not (isinstance(first_window, int) and first_window >= 1):
        raise ValueError(f"first_window={first_window!r} must be an int >= 1")
    lengths = mask.sum(dim=1)
    batch = tokens.shape[0]
    runs = _scan_runs(
        tokens, lengths,
        sign=torch.cat([sign, sign]),
        group=torch.cat([gidx, gidx + num_groups]),
        num_groups=2 * num_groups, pad_id=pad_id, first_window=first_window)
    return ConflictRuns(fwd=runs[:batch], bwd=runs[batch:], lengths=lengths)


def conflict_weights(token_ids: Tensor, mask: Tensor, advantages: Tensor, group_ids: Tensor, *,
                     weight: float = 2.0, overlap: str = "product", pad_id: int | None = None,
                     return_runs: bool = False) -> Tensor | tuple[Tensor, ConflictRuns]:
    """GTPO token weights ``lambda`` [B, T] (float32) of spec 5.3-5.4.

    ``weight`` is W (2.0 in the official code). ``overlap="product"`` gives ``W*W`` where a positive
    completion's forward and backward runs overlap (the code); ``"union"`` gives ``W``. Negative
    completions get 0 on conflict tokens, inactive completions (A = 0) 1 everywhere, and positions
    outside ``mask`` get the neutral 1 (the loss mask removes them). With ``return_runs=True`` also
    returns the :class:`ConflictRuns` (``n_i`` for the code-level normalisation).
    """
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap={overlap!r} must be one of {OVERLAP_MODES}")
    if not (isinstance(weight, (int, float)) and 0.0 < weight < float("inf")):
        raise ValueError(f"weight={weight!r} must be a finite number > 0 (the official code uses 2.0)")
    runs = conflict_runs(token_ids, mask, advantages, group_ids, pad_id=pad_id)
    positions = torch.arange(token_ids.shape[1], device=token_ids.device)
    in_fwd = positions < runs.fwd[:, None]
    in_bwd = (positions >= (runs.lengths - runs.bwd)[:, None]) & (positions < runs.lengths[:, None])
    # Positive rows scale by W, negative rows by 0; inactive rows have empty runs.
    row_w = torch.where(advantages > 0, float(weight), 0.0).to(torch.float32)[:, None]
    one = torch.ones((), dtype=torch.float32, device=token_ids.device)
    if overlap == "product":
        lam = torch.where(in_fwd, row_w, one) * torch.where(in_bwd, row_w, one)
    else:
        lam = torch.where(in_fwd | in_bwd, row_w, one)
    return (lam, runs) if return_runs else lam


def _validate(token_ids, mask, advantages, group_ids):
    mask = as_mask(mask)
    check_shape(token_ids, tuple(mask.shape), name="token_ids", what="[B, T], like mask")
    check_integer(token_ids, name="token_ids")
    check_shape(advantages, (mask.shape[0],), name="advantages", what="[B], one per completion")
    check_finite(advantages, name="advantages")
    check_shape(group_ids, (mask.shape[0],), name="group_ids", what="[B], one prompt id per completion")
    gidx, sizes = group_index(group_ids)
    sign = torch.sign(advantages.detach()).to(torch.int8)
    # Padding may hold any id (e.g. -100): only masked tokens are ever compared, so neutralise the rest.
    tokens = torch.where(mask, token_ids.long(), 0)
    return mask, tokens, sign, gidx, sizes.numel()


def _scan_runs(tokens: Tensor, lengths: Tensor, *, sign: Tensor, group: Tensor, num_groups: int,
               pad_id: int | None, first_window: int) -> Tensor:
    """Initial-run lengths [R] of the R = 2B stacked rows (forward rows first, then backward)."""
    batch, width_total = tokens.shape
    rows_total = sign.shape[0]
    device = tokens.device
    row_len = torch.cat([lengths, lengths])
    runs = torch.zeros(rows_total, dtype=torch.long, device=device)
    running = (sign != 0) & (row_len > 0)
    key_base = _key_base(tokens, num_groups, width_total)
    start, width = 0, first_window
    while start < width_total:
        open_groups = torch.zeros(num_groups, dtype=torch.bool, device=device)
        open_groups[group[running]] = True
        rows = ((sign != 0) & open_groups[group]).nonzero().squeeze(1)
        if rows.numel() == 0:
            break
        width = min(width, width_total - start)
        dist = torch.arange(start, start + width, device=device)  # [w] distance from the aligned end
        rl = row_len[rows][:, None]
        valid = dist[None, :] < rl                                 # [r, w]
        backward = (rows >= batch)[:, None]
        col = torch.where(backward, rl - 1 - dist[None, :], dist[None, :]).clamp(min=0)
        tok = tokens[(rows % batch)[:, None], col]                 # [r, w]
        if pad_id is not None:
            valid &= tok != pad_id
        match = _window_match(tok, valid, sign[rows], group[rows], key_base)
        ext = _initial_run(match)
        was_running = running[rows]
        runs[rows] += torch.where(was_running, ext, 0)
        running[rows] = was_running & (ext == width)
        start, width = start + width, width * 2
    return runs


def _key_base(tokens: Tensor, num_groups: int, width_total: int) -> int:
    """Token-id range for the keys ``(group * w + position) * base + token``; must fit in int64."""
    if tokens.numel() and int(tokens.min()) < 0:
        raise ValueError("token_ids must be >= 0 inside the mask (got a negative id)")
    base = int(tokens.max()) + 1 if tokens.numel() else 1
    if num_groups * width_total * base >= 2 ** 62:
        raise ValueError(f"token_ids range ({base}) x positions ({width_total}) x groups ({num_groups // 2}) "
                         "overflows int64 keys; split the batch into fewer prompts per call")
    return base


def _window_match(tok: Tensor, valid: Tensor, sign: Tensor, group: Tensor, base: int) -> Tensor:
    """``raw`` [r, w]: token held at this (group, position) by >= 1 positive and >= 1 negative row."""
    _, local, sizes = torch.unique(group, return_inverse=True, return_counts=True)
    order = torch.argsort(local, stable=True)
    starts = torch.cumsum(sizes, 0) - sizes
    rank = torch.empty_like(local)
    rank[order] = torch.arange(local.numel(), device=local.device) - starts[local[order]]
    largest = int(sizes.max())
    if sizes.numel() * largest > _MAX_SLOT_PADDING * local.numel():
        return _match_by_keys(tok, valid, sign, local, base)
    return _match_by_slots(tok, valid, sign, local, rank, sizes.numel(), largest)


def _match_by_slots(tok, valid, sign, local, rank, num_groups: int, largest: int) -> Tensor:
    """Slot kernel (module docstring): sort each (group, position) slot by 4 * token + sign code."""
    width = tok.shape[1]
    ranks = torch.arange(largest, device=tok.device)
    # Distinct negative fillers (code 0) for padding and invalid entries: they never match anything.
    filler = (-4 * (ranks + 1))[None, :, None].expand(num_groups, largest, width)
    slots = filler.clone()
    code = torch.where(sign > 0, 1, 2)[:, None]
    slots[local, rank] = torch.where(valid, tok * 4 + code, filler[0, rank])
    ordered, perm = slots.sort(dim=1)
    token, code = ordered >> 2, ordered & 3
    change = token[:, 1:] != token[:, :-1]                      # [g, G-1, w] run boundaries
    edge = torch.ones_like(token[:, :1], dtype=torch.bool)
    is_start = torch.cat([edge, change], dim=1)
    is_end = torch.cat([change, edge], dim=1)
    idx = ranks[None, :, None]
    first = torch.where(is_start, idx, 0).cummax(dim=1).values
    last = torch.where(is_end, idx, largest).flip(1).cummin(dim=1).values.flip(1)
    both = (code.gather(1, first) == 1) & (code.gather(1, last) == 2)
    unsorted = torch.empty_like(both).scatter_(1, perm, both)
    return unsorted[local, rank] & valid


def _match_by_keys(tok, valid, sign, local, base: int) -> Tensor:
    """Key kernel: one ``torch.unique`` over keys (group, position, token) of the valid entries."""
    width = tok.shape[1]
    pos = torch.arange(width, device=tok.device)
    keys = ((local[:, None] * width + pos[None, :]) * base + tok)[valid]
    code = torch.where(sign > 0, 1, _NEG_UNIT)[:, None].expand_as(valid)[valid]
    uniq, inverse = torch.unique(keys, return_inverse=True)
    holders = torch.zeros(uniq.shape[0], dtype=torch.long, device=tok.device).index_add_(0, inverse, code)
    both = ((holders & (_NEG_UNIT - 1)) > 0) & ((holders >> 32) > 0)
    match = torch.zeros_like(valid)
    match[valid] = both[inverse]
    return match


def _initial_run(match: Tensor) -> Tensor:
    """Length [r] of the leading run of True in each row of ``match`` [r, w]."""
    first_false = (~match).to(torch.uint8).argmax(dim=1)  # 0 when the row has no False
    return torch.where(match.all(dim=1), match.shape[1], first_false)
