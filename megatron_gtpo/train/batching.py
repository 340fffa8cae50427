"""Scored groups -> the global ``Batch`` (completion view) -> this data-parallel rank's micro-batches.

Two coordinate systems meet here::

    completion view [B, T]  completion token t of row b at column t (left-aligned, prefix mask):
                            the Batch record and everything in algo/ (conflicts, advantages, loss)
    sequence view   [mb, S] prompt + completion, what the model consumes; built per micro-batch

``collate`` builds the completion view once per step; ``micro_batches`` makes the model input of
one micro-batch from it, and ``take`` maps the model's per-position outputs back to the completion
view. Every rank holds the whole Batch (token ids and rewards are small), so per-sequence
quantities such as GTPO's conflict weights are computed once, exactly as in a single process.

Data parallelism takes contiguous row blocks (DP rank r owns rows ``r*B/dp .. (r+1)*B/dp - 1``), so
a prompt's group may straddle ranks and micro-batches; nothing here needs groups to stay together.
Each micro-batch is cut to its longest used sequence (right padding never influences earlier
positions under the causal mask). With pipeline parallelism every micro-batch of the step uses one
common length instead, because Megatron's p2p buffers have a fixed shape.

Packed micro-batches (``train.micro_batch_tokens`` > 0, :func:`packed_micro_batches`): instead of
``micro_batch_size`` rows padded to the longest, each micro-batch is ONE row holding whole
sequences back to back (no padding between them) up to a token budget, with ``cu_seqlens`` marking
where each starts; attention is kept inside each sequence and positions restart at 0 per sequence
(``train/model_input.py`` turns this into Megatron's input). The rows of a DP rank are spread over
the micro-batches by token count (longest-processing-time first, as verl's balanced partitions), and
every DP rank uses the same number of micro-batches (Megatron's schedule and the loss rescale need
it): the count is a pure function of the global Batch that every rank holds, so all ranks compute
the same number without communicating::

    rows of DP rank r --fewest_bins--> k_r      K = max_r k_r (every rank computes all k_r)
    rows of this rank --pack_rows(K)--> K bins of row indices, each <= budget tokens
    bin --_packed--> input_ids [1, S]: [p0 c0 | p1 c1 | ... | pad]   cu_seqlens [0, l0, l0+l1, ..., S]
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass

import torch

from megatron_gtpo.parallel.layout import batch_split_problem
from megatron_gtpo.types import Batch, ScoredGroup

Tensor = torch.Tensor


def collate(groups: list[ScoredGroup], *, pad_id: int) -> Batch:
    """The completion-view Batch of ``groups`` (rows in group order, completions in sampling order).

    The mask covers the completion tokens (EOS included, as TRL and the GTPO code); the sampler
    log-probs sit on the same columns. Advantages are not computed here: ``algo.prepare_batch``
    derives them from the rewards with the run's algorithm settings.
    """
    rows = [(gi, g.prompt.token_ids, c, r) for gi, g in enumerate(groups) for c, r in zip(g.completions, g.rewards)]
    num = len(rows)
    prompt_width = max(len(p) for _, p, _, _ in rows)
    width = max(max(len(c.token_ids) for _, _, c, _ in rows), 1)
    prompt_ids = torch.full((num, prompt_width), pad_id, dtype=torch.long)
    token_ids = torch.full((num, width), pad_id, dtype=torch.long)
    sampler = torch.zeros((num, width), dtype=torch.float32)
    lengths = torch.tensor([len(c.token_ids) for _, _, c, _ in rows], dtype=torch.long)
    for b, (_, prompt, comp, _) in enumerate(rows):
        prompt_ids[b, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        if comp.token_ids:
            token_ids[b, :len(comp.token_ids)] = torch.tensor(comp.token_ids, dtype=torch.long)
            sampler[b, :len(comp.token_ids)] = torch.tensor(comp.logprobs, dtype=torch.float32)
    return Batch(prompt_ids=prompt_ids, prompt_lengths=torch.tensor([len(p) for _, p, _, _ in rows], dtype=torch.long),
                 token_ids=token_ids, mask=torch.arange(width)[None, :] < lengths[:, None], sampler_logprobs=sampler,
                 rewards=torch.tensor([r for *_, r in rows], dtype=torch.float32),
                 group_ids=torch.tensor([gi for gi, *_ in rows], dtype=torch.long), pad_id=pad_id)


def local_rows(batch_size: int, *, dp: int, dp_rank: int, micro_batch_size: int) -> slice:
    """This DP rank's contiguous block of global rows; the global batch must split evenly into DP
    ranks and micro-batches (Megatron's pipeline schedules need equally sized micro-batches)."""
    problem = batch_split_problem(batch_size, dp=dp, rows_per_micro_batch=micro_batch_size)
    if problem:
        raise ValueError(problem)
    per_rank = batch_size // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def global_normalisers(batch: Batch) -> tuple[float, float]:
    """``(num_tokens, num_seqs)`` of the whole global batch: every rank computes them from the same
    global record, so no communication is needed."""
    return float(batch.lengths.sum()), float(batch.size)


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch as the forward step consumes it, plus how to map its outputs back."""

    rows: Tensor  # [mb] long
    """Indices of these rows in the global batch (to slice per-sequence values)."""
    input_ids: Tensor  # [mb, seq_len] long: prompt + completion, right-padded; packed: [1, seq_len]
    position_ids: Tensor  # [mb, seq_len] long; packed: [1, seq_len], restarting at 0 in every sequence
    start: Tensor  # [mb] long
    """Sequence position of each row's first completion token (its prompt length; packed: plus the
    offset of its sequence in the packed row)."""
    lengths: Tensor  # [mb] long
    """Completion lengths of the rows."""
    width: int
    """Completion-view width of this micro-batch: its longest completion (>= 1)."""
    cu_seqlens: Tensor | None = None  # [segments + 1] int32
    """Packed micro-batch: where each sequence starts in the single packed row, then its end (a
    padding tail is one more segment); None: one row per sequence (padded micro-batch)."""
    max_seqlen: int = 0
    """Packed micro-batch: its longest segment (THD attention's ``max_seqlen``, the RoPE table length)."""
    index: int = 0
    """Position in the step's list of micro-batches (schedule order): how an update refers to what
    an earlier update of the step kept for this micro-batch (``train/loss.py``)."""

    def to(self, device) -> MicroBatch:
        """This micro-batch with every tensor on ``device`` (None: where they are)."""
        if device is None:
            return self
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})

    def take(self, seq: Tensor) -> Tensor:
        """Completion view ``[mb, width]`` of a sequence-view output ``seq`` ``[mb, seq_len]``
        (packed: ``[1, seq_len]``): the value predicting completion token t of row b at column t;
        0 outside the completion. This is the one mapping from model positions to the loss's view."""
        cols = torch.arange(self.width, device=seq.device)
        index = (self.start.to(seq.device)[:, None] + cols).clamp(max=seq.shape[1] - 1)
        out = seq[0][index] if self.cu_seqlens is not None else seq.gather(1, index)
        return torch.where(cols < self.lengths.to(seq.device)[:, None], out,
                           torch.zeros((), dtype=out.dtype, device=out.device))


def _rounded(length: int, multiple: int) -> int:
    """``length`` (at least 1) rounded up to ``multiple``."""
    return -(-max(length, 1) // multiple) * multiple


def _model_input(batch: Batch, rows: Tensor, seq_len: int) -> Tensor:
    """``[len(rows), seq_len]``: prompt tokens, then completion tokens, then pad_id."""
    cols = torch.arange(seq_len)[None, :]
    start = batch.prompt_lengths[rows][:, None]
    in_prompt = cols < start
    prompt = batch.prompt_ids[rows].gather(1, cols.clamp(max=batch.prompt_ids.shape[1] - 1).expand(len(rows), -1))
    offset = (cols - start).clamp(min=0, max=batch.token_ids.shape[1] - 1)
    completion = batch.token_ids[rows].gather(1, offset)
    in_completion = ~in_prompt & (cols < start + batch.lengths[rows][:, None])
    return torch.where(in_prompt, prompt, torch.where(in_completion, completion, batch.pad_id))


def micro_batches(batch: Batch, rows: slice, *, micro_batch_size: int, common_length: bool,
                  pad_to_multiple: int = 1, device=None) -> list[MicroBatch]:
    """Cuts ``rows`` of the global batch into micro-batches of ``micro_batch_size`` rows.

    ``common_length`` (pipeline parallel): one sequence length for all micro-batches. Lengths are
    rounded up to ``pad_to_multiple`` (``train.model.sequence_multiple``: FP8, sequence parallelism),
    past the batch's longest sequence if need be: the extra positions hold pad tokens, come after
    every real token under the causal mask and never reach the loss. ``device``: where the
    micro-batch tensors are placed (the model's device; default: CPU).
    """
    ends = batch.prompt_lengths + batch.lengths
    all_rows = torch.arange(batch.size)[rows]
    shared = _rounded(int(ends[all_rows].max()), pad_to_multiple) if common_length else None
    out = []
    for index, idx in enumerate(all_rows.split(micro_batch_size)):
        seq_len = shared or _rounded(int(ends[idx].max()), pad_to_multiple)
        out.append(MicroBatch(rows=idx.to(device), input_ids=_model_input(batch, idx, seq_len).to(device),
                              position_ids=torch.arange(seq_len).expand(len(idx), seq_len).contiguous().to(device),
                              start=batch.prompt_lengths[idx].to(device), lengths=batch.lengths[idx].to(device),
                              width=max(int(batch.lengths[idx].max()), 1), index=index))
    return out


# ----------------------------------------------------------------------------- packed micro-batches


def token_budget_problem(budget: int, longest: int, what: str = "the longest row") -> str | None:
    """Why a token budget of ``budget`` cannot hold a row of ``longest`` tokens, or None. The one
    home of the rule: config validation asks it with the longest possible row (data.max_prompt_tokens
    + rollout.max_tokens), the packer with the rows it is given."""
    if budget and longest > budget:
        return (f"train.micro_batch_tokens={budget} cannot hold {what} ({longest} tokens, prompt + completion): "
                f"raise train.micro_batch_tokens to at least {longest}, or set it to 0 for padded "
                "micro-batches of train.micro_batch_size rows")
    return None


def row_tokens(batch: Batch, multiple: int = 1) -> Tensor:
    """``[B]`` long: model tokens of every row of the batch (prompt + completion, at least 1), each
    rounded up to ``multiple`` (context parallelism pads every packed sequence to 2 x cp)."""
    tokens = (batch.prompt_lengths + batch.lengths).clamp(min=1)
    return tokens if multiple == 1 else -(-tokens // multiple) * multiple


def balanced_partition(lengths: list[int], count: int) -> list[list[int]]:
    """``count`` (<= len(lengths)) non-empty bins of indices into ``lengths`` whose token sums are
    balanced: longest first, each into the bin with the fewest tokens so far (LPT, within 4/3 of the
    best possible largest bin); ties go to the lower index, so the result is deterministic. Indices
    ascend within a bin; bins are ordered by their first index."""
    heap = [(0, b) for b in range(count)]
    bins: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, b = heapq.heappop(heap)  # the first `count` rows each open an empty bin (lengths >= 1)
        bins[b].append(i)
        heapq.heappush(heap, (load + lengths[i], b))
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def _largest_bin(lengths: list[int], bins: list[list[int]]) -> int:
    return max(sum(lengths[i] for i in b) for b in bins)


def fewest_bins(lengths: list[int], budget: int) -> int:
    """The smallest count whose balanced partition keeps every bin within ``budget`` tokens (at most
    ``len(lengths)``: one row per bin always fits); ValueError when one row alone does not fit."""
    problem = token_budget_problem(budget, max(lengths))
    if problem:
        raise ValueError(problem)
    count = max(1, -(-sum(lengths) // budget))
    while _largest_bin(lengths, balanced_partition(lengths, count)) > budget:
        count += 1
    return count


def pack_rows(lengths: list[int], count: int, budget: int) -> list[list[int]]:
    """``count`` (``fewest_bins(lengths, budget) <= count <= len(lengths)``) bins of indices, each
    within ``budget`` tokens, balanced. More bins than the fewest almost always balance within the
    budget too; where LPT's greedy choice overshoots it, the fewest-bins partition is refined by
    splitting its fullest bins in two (a part of a fitting bin fits)."""
    bins = balanced_partition(lengths, count)
    if _largest_bin(lengths, bins) <= budget:
        return bins
    bins = balanced_partition(lengths, fewest_bins(lengths, budget))
    while len(bins) < count:
        fullest = max((b for b in bins if len(b) > 1), key=lambda b: (sum(lengths[i] for i in b), -b[0]))
        bins.remove(fullest)
        halves = balanced_partition([lengths[i] for i in fullest], 2)
        bins += [[fullest[i] for i in half] for half in halves]
    return sorted(bins, key=lambda b: b[0])


def micro_batch_count(batch: Batch, *, dp: int, token_budget: int, multiple: int = 1, seq_multiple: int = 1) -> int:
    """Packed micro-batches per DP rank for this step: the most any DP rank needs (every rank holds
    the whole Batch and computes every rank's need, so all agree without communicating), rounded up
    to ``multiple`` (the interleaved pipeline schedule needs a multiple of PP) where the rows allow.
    ``seq_multiple``: every sequence counts as its length rounded up to it (``packed_micro_batches``)."""
    lengths, per_rank = row_tokens(batch, seq_multiple).tolist(), batch.size // dp
    count = max(fewest_bins(lengths[r * per_rank:(r + 1) * per_rank], token_budget) for r in range(dp))
    return min(-(-count // multiple) * multiple, per_rank)


def packed_micro_batches(batch: Batch, rows: slice, *, token_budget: int, count: int, common_length: bool,
                         pad_to_multiple: int = 1, seq_multiple: int = 1, device=None) -> list[MicroBatch]:
    """``count`` packed micro-batches of ``rows`` (each one row of whole sequences, at most
    ``token_budget`` real tokens; ``micro_batch_count`` gives the count every DP rank must use).

    The packed length is rounded up to ``pad_to_multiple`` (FP8, sequence parallelism) with a
    padding tail; ``common_length`` (pipeline parallel): every micro-batch takes the longest packed
    length of the step. ``seq_multiple``: each sequence counts as its length rounded up to it, in
    the budget and the packed length (context parallelism pads every sequence to 2 x cp when it
    splits the row: ``train/cp_shard.py``; the row built here holds the sequences unpadded, with a
    tail to that length). ``device``: where the tensors are placed (default: CPU).
    """
    all_rows = torch.arange(batch.size)[rows]
    lengths = row_tokens(batch, seq_multiple)[all_rows].tolist()
    bins = pack_rows(lengths, count, token_budget)
    totals = [sum(lengths[i] for i in b) for b in bins]
    shared = _rounded(max(totals), pad_to_multiple) if common_length else None
    return [dataclasses.replace(_packed(batch, all_rows[torch.tensor(b)], shared or _rounded(total, pad_to_multiple)),
                                index=index).to(device) for index, (b, total) in enumerate(zip(bins, totals))]


def _packed(batch: Batch, idx: Tensor, seq_len: int) -> MicroBatch:
    """One packed micro-batch of rows ``idx`` in a row of ``seq_len`` tokens (CPU)."""
    if (batch.prompt_lengths[idx] < 1).any():  # its first completion token would be predicted from
        raise ValueError("packed micro-batches need a prompt of >= 1 token in every row")  # the previous row
    seqs = row_tokens(batch)[idx]  # [n]
    padded = _model_input(batch, idx, int(seqs.max()))  # [n, longest]
    tokens = padded[torch.arange(padded.shape[1])[None, :] < seqs[:, None]]  # row after row
    tail = seq_len - int(seqs.sum())
    segments = torch.cat([seqs, torch.tensor([tail] if tail else [], dtype=seqs.dtype)])
    offsets = torch.cumsum(segments, 0) - segments
    input_ids = torch.cat([tokens, torch.full((tail,), batch.pad_id, dtype=tokens.dtype)])[None, :]
    positions = torch.arange(seq_len) - torch.repeat_interleave(offsets, segments)
    return MicroBatch(rows=idx, input_ids=input_ids, position_ids=positions[None, :],
                      start=offsets[:len(idx)] + batch.prompt_lengths[idx], lengths=batch.lengths[idx],
                      width=max(int(batch.lengths[idx].max()), 1),
                      cu_seqlens=torch.cat([offsets, offsets[-1:] + segments[-1:]]).to(torch.int32),
                      max_seqlen=int(segments.max()))
