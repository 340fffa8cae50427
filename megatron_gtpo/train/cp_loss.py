"""The GTPO loss on a context-parallel shard: the pieces the train step calls when cp > 1.

Under CP each rank holds 1/cp of every completion (``train/cp_shard.py``). What that changes:

* **Per-token log-probs and entropies**: the fused vocab-parallel pass (``train/logprobs.py``, the
  vocabulary still never gathered over TP) runs on this rank's logits ``[mb, S/cp, V/TP]`` with the
  sequence's next tokens as targets (:func:`shard_token_stats`); its outputs land in the completion
  view with 0 where another rank holds the token (``CPShard.held`` says which).
* **Per-completion quantities** (GTPO's ``<H>_i`` and so the entropy filter and gamma shift, or
  any other per-row sum) need the whole completion: :func:`completion_view` all-reduces the
  held values over the CP group. Each position is held by exactly one rank, so the sum adds exact
  zeros: the result is bit for bit the single-process completion view, and the one-process
  formulas (``algo.completion_mean_entropy``) apply to it unchanged (:func:`mean_entropy`). Token
  counts ``|o_i|`` need no communication: every rank holds the Batch's mask.
* **The loss**: per token, as without CP, over the held tokens only; the GLOBAL normalisers are
  unchanged. The one per-row normaliser, ``|o_i|`` of ``seq-mean-token-mean`` (GRPO, GTPO), would
  otherwise count a row's held tokens only: :func:`split_rows` moves the global ``1/|o_i|`` into
  the per-row scale, so the per-rank losses add up to the one-process loss (:func:`shard_loss`).
  D2's ``algo.kl_penalty`` and ``algo.token_omega`` take prefix masks only: give them the whole
  mask with these rows (``split_rows``), the held tokens' values (k3 zeroed elsewhere), and keep
  the held tokens of ``token_omega``'s result; the shares then add up over CP like the loss.
* **Conflict weights** (GTPO's lambda) are computed once per global batch in the completion view
  (``algo.prepare_groups``) and used there with the held mask; ``CPShard.to_shard`` puts them on the
  shard's positions where a per-position form is wanted.
* **Metrics**: per-token (sum, count) pairs over the held tokens add up over DP x CP
  (``collectives.reduce_metric_pairs`` over ``get_data_parallel_group(with_context_parallel=True)``),
  min/max over its twin; per-completion metrics from :func:`completion_view` values are complete on
  every CP rank and are reduced over DP only.
* **Megatron's scaling** (:func:`megatron_loss_scale`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoSpec, PreparedBatch, TokenInputs
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.logprobs import VocabShard, vocab_parallel_logprob_entropy

Tensor = torch.Tensor


def megatron_loss_scale(*, num_microbatches: int, dp_size: int, cp_size: int = 1) -> float:
    """The factor that cancels Megatron's own scaling of each micro-batch loss under DP x CP.

    Megatron-Core 0.16.1 treats each CP rank's loss as a mean over its own tokens: the schedule
    (``forward_step_calc_loss``, two-value return) multiplies it by ``cp_size`` and divides it by
    ``num_microbatches``; DDP then scales the gradients by ``1 / (dp_size * cp_size)`` (it reduces
    over ``get_data_parallel_group(with_context_parallel=True)``). Our losses are this rank's share
    of the GLOBALLY normalised batch loss, so their plain sum over micro-batches, DP and CP ranks is
    the batch loss; multiplying by ``num_microbatches * (dp_size * cp_size) / cp_size`` undoes both.
    The CP factors cancel, so the value equals ``num_microbatches * dp_size`` with ``dp_size`` the
    data-parallel size WITHOUT CP (``ParallelDims.dp``); passing the DP x CP size there instead would
    scale the gradients by cp. (This is the proposed body of ``train/step.py::megatron_loss_scale``.)
    """
    if num_microbatches < 1 or dp_size < 1 or cp_size < 1:
        raise ValueError(f"num_microbatches={num_microbatches}, dp_size={dp_size} and cp_size={cp_size} "
                         "must all be >= 1")
    # 1 / (schedule's cp / num_microbatches x DDP's 1 / (dp * cp)), in integers: exact
    return float(num_microbatches * dp_size * cp_size) / cp_size


def cp_groups():
    """``(cp_group, dp_cp_group)`` from parallel_state: the group one sequence is split over, and
    the group gradients and per-token metric pairs are reduced over."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)


def shard_token_stats(settings, logits: Tensor, shard: CPShard, *, entropy_prob_floor: float = 0.0,
                      inplace_backward: bool = False, temperature: float | None = None) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[mb, width]`` in the completion view (0 where another CP rank holds the
    token) from this rank's logits ``[mb, S/cp, V/TP]``. ``settings``: the step's ``LogprobSettings``
    (TP group and rank, true vocabulary, sampling temperature, chunking); the other arguments as in
    ``vocab_parallel_logprob_entropy``."""
    vocab = VocabShard(group=settings.tp_group, start=settings.tp_rank * logits.shape[-1],
                       vocab_size=settings.vocab_size)
    logp, entropy = vocab_parallel_logprob_entropy(
        logits, shard.targets.to(logits.device), shard=vocab,
        temperature=settings.temperature if temperature is None else temperature,
        chunk_tokens=settings.chunk_tokens, entropy_prob_floor=entropy_prob_floor, inplace_backward=inplace_backward)
    return shard.take(logp), shard.take(entropy)


@torch.no_grad()
def completion_view(values: Tensor, held: Tensor, group) -> Tensor:
    """The whole completion view ``[mb, width]`` on every rank of the CP ``group`` from each rank's
    held values (all-reduce SUM of the held entries; exact: one rank holds each token)."""
    full = torch.where(held.to(values.device), values.detach(), torch.zeros((), dtype=values.dtype,
                                                                            device=values.device)).contiguous()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
    return full


def mean_entropy(entropy: Tensor, held: Tensor, mask: Tensor, group) -> Tensor:
    """GTPO's ``<H>_i`` ``[mb]`` of completions split over the CP ``group``: the one-process
    ``algo.completion_mean_entropy`` of the gathered completion view (so the entropy filter and the
    gamma shift see the whole completion on every CP rank)."""
    return algo.completion_mean_entropy(completion_view(entropy, held, group), mask)


def split_rows(spec: AlgoSpec, prepared: PreparedBatch, mask: Tensor) -> tuple[AlgoSpec, PreparedBatch]:
    """The algorithm and rows to aggregate a CP rank's share of ``prepared``'s completions with
    (``mask`` [mb, T]: their WHOLE masks). ``seq-mean-token-mean`` divides a row's token sum by its
    length ``|o_i|``, which ``aggregate`` reads off the mask it is given, the held tokens under CP;
    as ``seq-mean-token-sum`` with ``seq_scale_i / |o_i|`` it is the same formula with the global
    length. The other modes have no per-row normaliser and are returned unchanged."""
    if spec.agg_mode != "seq-mean-token-mean":
        return spec, prepared
    lengths = mask.sum(dim=1).clamp(min=1).to(torch.float64)
    scale = 1.0 / lengths if prepared.seq_scale is None else prepared.seq_scale.to(torch.float64) / lengths
    rows = dataclasses.replace(prepared, seq_scale=scale)  # fp64: compute_loss casts it to the log-probs' dtype
    return dataclasses.replace(spec, agg_mode="seq-mean-token-sum"), rows


def shard_loss(spec: AlgoSpec, tokens: TokenInputs, prepared: PreparedBatch, held: Tensor, *,
               num_tokens: float, num_seqs: float) -> tuple[Tensor, dict[str, Tensor]]:
    """This CP rank's share of ``algo.compute_loss`` over the held tokens: the per-rank values add
    up over the CP group (and DP, micro-batches) to the one-process loss. ``tokens.mask`` is the
    whole completion mask; the metrics are means over the held tokens (weight them by
    ``(tokens.mask & held).sum()`` to reduce them over DP x CP)."""
    mask = tokens.mask
    rows_spec, rows = split_rows(spec, prepared, mask)
    local = dataclasses.replace(tokens, mask=mask & held.to(mask.device))
    return algo.compute_loss(rows_spec, local, rows, num_tokens=num_tokens, num_seqs=num_seqs)
