"""Global ``TrainBatch`` -> this data-parallel rank's micro-batches, and the completion view that
``algo/`` works in.

Two coordinate systems meet here::

    sequence view   [B, S]  prompt + completion, what the model consumes; loss_mask marks completions
    completion view [B, T]  completion token t of row b at column t (left-aligned, prefix mask):
                            what algo/ (conflicts, advantages, loss) expects

``CompletionView.take`` maps a sequence-view tensor to the completion view. Every rank builds the
view of the WHOLE global batch (token ids and masks are small), so per-sequence quantities such as
GTPO's conflict weights are computed once, exactly as in a single process, and then sliced.

Data parallelism takes contiguous row blocks (DP rank r owns rows ``r*B/dp .. (r+1)*B/dp - 1``), so
a prompt's group may straddle ranks and micro-batches; nothing here needs groups to stay together.
Variable lengths are handled by padding: each micro-batch is cut to its longest used sequence
(right padding never influences earlier positions under the causal mask). With pipeline
parallelism every micro-batch of the step uses one common length instead, because Megatron's p2p
buffers have a fixed shape (``variable_seq_lengths`` would add a shape exchange to every send).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo.types import TrainBatch

Tensor = torch.Tensor


@dataclass(kw_only=True)
class CompletionView:
    """Where each row's completion sits inside its padded sequence, for the whole global batch."""

    start: Tensor  # [B] long
    """Sequence position of the first completion (loss) token of each row."""
    lengths: Tensor  # [B] long
    """Number of loss tokens of each row (``|o_i|``; 0 for a fully masked completion)."""
    token_ids: Tensor  # [B, T] long
    """Completion tokens, left-aligned, right-padded with the batch's pad id."""
    mask: Tensor  # [B, T] bool
    """Prefix mask: True for the first ``lengths[b]`` columns."""

    @property
    def width(self) -> int:
        """T: the longest completion of the global batch."""
        return self.mask.shape[1]

    def take(self, seq: Tensor, rows: Tensor | slice | None = None, width: int | None = None) -> Tensor:
        """Completion view of a sequence-view tensor: ``seq`` ``[b, S']`` holds rows ``rows`` of the
        batch (all rows when None); returns ``[b, width]``, zero outside each row's completion."""
        start = (self.start if rows is None else self.start[rows]).to(seq.device)
        lengths = (self.lengths if rows is None else self.lengths[rows]).to(seq.device)
        width = self.width if width is None else width
        cols = torch.arange(width, device=seq.device)
        index = (start[:, None] + cols).clamp(max=seq.shape[1] - 1)
        out = seq.gather(1, index)
        return torch.where(cols < lengths[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


    def to(self, device) -> "CompletionView":
        """The same view with every tensor on ``device`` (the step moves it next to the logits)."""
        return CompletionView(start=self.start.to(device), lengths=self.lengths.to(device),
                              token_ids=self.token_ids.to(device), mask=self.mask.to(device))


def completion_view(batch: TrainBatch) -> CompletionView:
    """Builds the completion view; the loss mask must be one contiguous run per row (or empty)."""
    mask = batch.loss_mask != 0
    lengths = mask.sum(dim=1)
    if batch.completion_start is not None:
        start = batch.completion_start.long()
    else:  # first loss position; 0 for an empty row (its length is 0, so it is never read)
        start = torch.where(lengths > 0, mask.long().argmax(dim=1), torch.zeros_like(lengths))
    seq_cols = torch.arange(mask.shape[1])
    contiguous = (seq_cols >= start[:, None]) & (seq_cols < (start + lengths)[:, None])
    if not torch.equal(contiguous, mask):
        row = int((contiguous != mask).any(dim=1).nonzero()[0])
        raise ValueError(f"TrainBatch.loss_mask row {row} is not one contiguous run of completion tokens "
                         "(starting at completion_start); mask whole completions, not scattered tokens")
    width = max(int(lengths.max()) if lengths.numel() else 0, 1)
    view = CompletionView(start=start, lengths=lengths, token_ids=torch.empty(0, dtype=torch.long),
                          mask=torch.arange(width)[None, :] < lengths[:, None])
    ids = view.take(batch.input_ids)
    view.token_ids = torch.where(view.mask, ids, torch.full_like(ids, batch.pad_id))
    return view


def local_rows(batch_size: int, *, dp: int, dp_rank: int, micro_batch_size: int) -> slice:
    """This DP rank's contiguous block of global rows; the global batch must split evenly into DP
    ranks and micro-batches (Megatron's pipeline schedules need equally sized micro-batches)."""
    if batch_size % (dp * micro_batch_size) != 0:
        raise ValueError(f"global batch of {batch_size} rows does not split into dp={dp} ranks x micro-batches "
                         f"of {micro_batch_size}; make rollout prompts x samples a multiple of {dp * micro_batch_size}")
    per_rank = batch_size // dp
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


@dataclass(kw_only=True)
class MicroBatch:
    """One micro-batch as the forward step consumes it (sequence view cut to ``seq_len``)."""

    rows: Tensor  # [mb] long
    """Indices of these rows in the global batch (to slice per-sequence values)."""
    input_ids: Tensor  # [mb, seq_len] long
    position_ids: Tensor  # [mb, seq_len] long
    width: int
    """Completion-view width of this micro-batch: its longest completion (>= 1)."""


def used_length(view: CompletionView, rows: Tensor) -> int:
    """Sequence length that covers every completion token of ``rows`` (the rest is padding)."""
    return max(int((view.start[rows] + view.lengths[rows]).max()), 1)


def micro_batches(batch: TrainBatch, view: CompletionView, rows: slice, *, micro_batch_size: int,
                  common_length: bool, pad_to_multiple: int = 1, device=None) -> list[MicroBatch]:
    """Cuts ``rows`` of the global batch into micro-batches of ``micro_batch_size`` rows.

    ``common_length`` (pipeline parallel): one sequence length for all micro-batches. The length is
    rounded up to ``pad_to_multiple`` (GPU kernels prefer multiples of 8/64) but never past ``S``.
    ``device``: where the micro-batch tensors are placed (the model's device; default: CPU).
    """
    all_rows = torch.arange(batch.input_ids.shape[0])[rows]
    chunks = list(all_rows.split(micro_batch_size))
    full = batch.input_ids.shape[1]

    def rounded(length: int) -> int:
        return min(-(-length // pad_to_multiple) * pad_to_multiple, full)

    shared = rounded(used_length(view, all_rows)) if common_length else None
    out = []
    for idx in chunks:
        seq_len = shared or rounded(used_length(view, idx))
        out.append(MicroBatch(rows=idx.to(device), input_ids=batch.input_ids[idx, :seq_len].to(device),
                              position_ids=batch.position_ids[idx, :seq_len].to(device),
                              width=max(int(view.lengths[idx].max()), 1)))
    return out
