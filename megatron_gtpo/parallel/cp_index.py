"""Which sequence positions a context-parallel rank holds: the index maps of Megatron and TE.

Causal attention makes late tokens cost more than early ones, so a plain split of a sequence into
``cp`` pieces leaves the last rank with most of the work. Megatron splits a sequence of ``S`` tokens
into ``2 cp`` chunks and gives rank ``r`` chunks ``r`` and ``2cp - 1 - r`` (Megatron-Core 0.16.1
``utils.get_batch_on_this_cp_rank``; its RoPE slice ``get_pos_emb_on_this_cp_rank`` assumes the same
order)::

    S = 16, cp = 2, chunks of 4:   rank 0: 0 1 2 3 | 12 13 14 15      rank 1: 4 5 6 7 | 8 9 10 11

A packed row (THD: sequences back to back) is split the same way *per sequence*: each sequence is
padded to a multiple of ``2 cp`` and rank ``r`` holds chunks ``r`` and ``2cp - 1 - r`` of every one,
in sequence order (Transformer Engine's ``thd_get_partitioned_indices``, which Megatron's
``get_thd_batch_on_this_cp_rank`` calls; its ``cu_seqlens`` argument is ``cu_seqlens_padded``).

Pure index arithmetic, no process groups: every rank can compute every rank's map, which is what the
CP attention needs to know where the keys it gathers came from (``gathered_index``).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def cp_multiple(cp: int) -> int:
    """The multiple a sequence (padded row, or each sequence of a packed row) must have under CP:
    2 x cp, two equal chunks per rank; 1 without CP (cp = 1: nothing is split)."""
    if cp < 1:
        raise ValueError(f"parallel.cp={cp} must be an integer >= 1")
    return 2 * cp if cp > 1 else 1


def cp_sequence_multiple(per_rank: int, cp: int) -> int:
    """The multiple a micro-batch's sequence length must have when each CP rank's share must be a
    multiple of ``per_rank`` (FP8 recipe, TP with sequence parallelism) and the sequence splits into
    2 x cp chunks; ``per_rank`` itself without CP."""
    return math.lcm(per_rank * cp, cp_multiple(cp)) if cp > 1 else per_rank


def cp_padded_length(length: int, cp: int) -> int:
    """``length`` rounded up to a multiple of 2 x cp (at least one multiple)."""
    multiple = cp_multiple(cp)
    return -(-max(length, 1) // multiple) * multiple


def load_balanced_index(seq_len: int, cp: int, rank: int, device=None) -> Tensor:
    """``[seq_len / cp]`` long: the sequence positions CP rank ``rank`` holds of a padded row of
    ``seq_len`` tokens (chunks ``rank`` and ``2cp - 1 - rank`` of ``2 cp``), in the order the rank
    stores them."""
    _check_rank(cp, rank)
    if seq_len % cp_multiple(cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split over parallel.cp={cp}: it must be a "
                         f"multiple of 2 x cp = {cp_multiple(cp)} (pad micro-batches to train.model.sequence_multiple)")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunk = seq_len // cp_multiple(cp)
    steps = torch.arange(chunk, device=device)
    return torch.cat([rank * chunk + steps, (2 * cp - 1 - rank) * chunk + steps])


def thd_partitioned_index(cu_seqlens_padded: Tensor, cp: int, rank: int) -> Tensor:
    """``[total / cp]`` long: the positions CP rank ``rank`` holds of a packed row whose sequences
    start at ``cu_seqlens_padded`` (``[n + 1]``, each length a multiple of 2 x cp), in storage order:
    for each sequence, its chunk ``rank`` then its chunk ``2cp - 1 - rank``."""
    _check_rank(cp, rank)
    cu = cu_seqlens_padded.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    if bool((lengths % cp_multiple(cp)).any()):
        raise ValueError(f"packed sequence lengths {lengths.tolist()} must each be a multiple of 2 x cp = "
                         f"{cp_multiple(cp)} (pad every sequence of a packed row: train.cp_shard.pad_packed)")
    if cp == 1:
        return torch.arange(int(cu[-1]), device=cu.device)
    half = lengths // cp_multiple(cp)  # chunk length of each sequence
    local = half * 2  # tokens each rank holds of each sequence
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), local)
    starts = torch.repeat_interleave(torch.cumsum(local, 0) - local, local)
    j = torch.arange(int(local.sum()), device=cu.device) - starts  # index within the rank's share of its sequence
    second = j >= half[seq]
    chunk_id = torch.where(second, torch.full_like(j, 2 * cp - 1 - rank), torch.full_like(j, rank))
    return cu[:-1][seq] + chunk_id * half[seq] + j - second.long() * half[seq]


def gathered_index(per_rank: list[Tensor]) -> Tensor:
    """Sequence positions of the tokens an all-gather over the CP group returns: rank 0's tokens
    first, then rank 1's, each in its storage order."""
    return torch.cat(list(per_rank))


def inverse_index(index: Tensor, seq_len: int) -> Tensor:
    """``[seq_len]`` long: the local slot of each sequence position in ``index``, -1 where this rank
    holds none."""
    out = torch.full((seq_len,), -1, dtype=torch.long, device=index.device)
    out[index] = torch.arange(index.numel(), device=index.device)
    return out


def cp_attention_mask(query_index: Tensor, key_index: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
    """``[1, 1, len(query_index), len(key_index)]`` bool, True = masked (Megatron's convention): a
    query at sequence position p sees the keys at positions <= p of its own sequence (``cu_seqlens``
    bounds the sequences of a packed row; None: one sequence per row). The causal mask from global
    positions, whatever order the ranks hold them in."""
    masked = key_index[None, :] > query_index[:, None]
    if cu_seqlens is not None:
        bounds = cu_seqlens[1:].to(query_index.dtype)
        masked |= torch.bucketize(key_index, bounds, right=True)[None, :] != \
            torch.bucketize(query_index, bounds, right=True)[:, None]
    return masked.view(1, 1, len(query_index), len(key_index))


def _check_rank(cp: int, rank: int) -> None:
    cp_multiple(cp)
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is outside the context-parallel group of size {cp}")
