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
"""

from __future__ import annotations

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
    problem = batch_split_problem(batch_size, dp=dp, micro_batch_size=micro_batch_size)
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
    input_ids: Tensor  # [mb, seq_len] long: prompt + completion, right-padded
    position_ids: Tensor  # [mb, seq_len] long
    start: Tensor  # [mb] long
    """Sequence position of each row's first completion token (its prompt length)."""
    lengths: Tensor  # [mb] long
    """Completion lengths of the rows."""
    width: int
    """Completion-view width of this micro-batch: its longest completion (>= 1)."""

    def take(self, seq: Tensor) -> Tensor:
        """Completion view ``[mb, width]`` of a sequence-view output ``seq`` ``[mb, seq_len]``
        (the value predicting completion token t of row b at column t; 0 outside the completion)."""
        cols = torch.arange(self.width, device=seq.device)
        index = (self.start.to(seq.device)[:, None] + cols).clamp(max=seq.shape[1] - 1)
        out = seq.gather(1, index)
        return torch.where(cols < self.lengths.to(seq.device)[:, None], out,
                           torch.zeros((), dtype=out.dtype, device=out.device))


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

    def rounded(length: int) -> int:
        return -(-max(length, 1) // pad_to_multiple) * pad_to_multiple

    shared = rounded(int(ends[all_rows].max())) if common_length else None
    out = []
    for idx in all_rows.split(micro_batch_size):
        seq_len = shared or rounded(int(ends[idx].max()))
        out.append(MicroBatch(rows=idx.to(device), input_ids=_model_input(batch, idx, seq_len).to(device),
                              position_ids=torch.arange(seq_len).expand(len(idx), seq_len).contiguous().to(device),
                              start=batch.prompt_lengths[idx].to(device), lengths=batch.lengths[idx].to(device),
                              width=max(int(batch.lengths[idx].max()), 1)))
    return out
