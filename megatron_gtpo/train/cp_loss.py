"""The GTPO loss on a context-parallel shard: the pieces the train step calls when cp > 1.

Under CP each rank holds 1/cp of every completion (``train/cp_shard.py``). What that changes, and
where the step (``train/plan.py``, ``train/loss.py``, ``train/observer.py``) handles it:

* **Per-token log-probs and entropies**: the fused vocab-parallel pass (``train/logprobs.py``, the
  vocabulary still never gathered over TP) runs on this rank's logits ``[mb, S/cp, V/TP]`` with the
  sequence's next tokens as targets (:func:`shard_token_stats`); its outputs land in the completion
  view with 0 where another rank holds the token (``CPShard.held`` says which).
* **Per-completion quantities** (GTPO's ``<H>_i`` and so the entropy filter and gamma shift, or
  any other per-row statistic) need the whole completion: :func:`completion_view` all-reduces the
  held values over the CP group. Each position is held by exactly one rank, so the sum adds exact
  zeros: the result is bit for bit the single-process completion view, identical on every CP rank
  (the filter decides the same everywhere), and the one-process formulas
  (``algo.completion_mean_entropy``) apply to it unchanged (:func:`mean_entropy`). Token counts
  ``|o_i|`` need no communication: every rank holds the Batch's mask and lengths.
* **The loss**: per token, as without CP, over the held tokens only (``mask & held``), with the
  GLOBAL normalisers unchanged and the WHOLE completion lengths (``TokenInputs.lengths``: the one
  per-row normaliser, ``|o_i|`` of ``seq-mean-token-mean``, would otherwise count a row's held
  tokens only), so the per-rank losses add up to the one-process loss. D2's ``algo.kl_penalty``
  and ``algo.token_omega`` take the same held mask and lengths; their shares add up likewise.
* **Conflict weights** (GTPO's lambda) are computed once per global batch in the completion view
  (``algo.prepare_groups``) and used there with the held mask: each rank applies the weights of
  exactly the tokens it holds (``CPShard.to_shard`` gives them on the shard's positions where a
  per-position form is wanted).
* **Metrics**: per-token (sum, count) pairs over the held tokens add up over DP x CP (the step
  reduces every metric over ``get_data_parallel_group(with_context_parallel=True)``); per-completion
  metrics from :func:`completion_view` values are complete on every CP rank, their (sum, count)
  pairs cp times over, which leaves the mean unchanged; the loss's weight is ``1 / (mbs x DP x CP)``.
* **Megatron's scaling**: ``train/plan.py::megatron_loss_scale`` (the one home).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gtpo import algo
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.logprobs import VocabShard, vocab_parallel_logprob_entropy

Tensor = torch.Tensor


def cp_groups():
    """``(cp_group, dp_cp_group)`` from parallel_state: the group one sequence is split over, and
    the group gradients and per-token metric pairs are reduced over."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True)


def shard_token_stats(settings, logits: Tensor, shard: CPShard, *, entropy_prob_floor: float = 0.0,
                      inplace_backward: bool = False, temperature: float | None = None,
                      width: int | None = None) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[mb, width]`` in the completion view (0 where another CP rank holds the
    token) from this rank's logits ``[mb, S/cp, V/TP]``. ``settings``: the step's ``LogprobSettings``
    (TP group and rank, true vocabulary, sampling temperature, chunking); ``width``: the view's
    width (default: the micro-batch's); the other arguments as in ``vocab_parallel_logprob_entropy``."""
    vocab = VocabShard(group=settings.tp_group, start=settings.tp_rank * logits.shape[-1],
                       vocab_size=settings.vocab_size)
    logp, entropy = vocab_parallel_logprob_entropy(
        logits, shard.targets.to(logits.device), shard=vocab,
        temperature=settings.temperature if temperature is None else temperature,
        chunk_tokens=settings.chunk_tokens, entropy_prob_floor=entropy_prob_floor, inplace_backward=inplace_backward)
    return shard.take(logp, width), shard.take(entropy, width)


@torch.no_grad()
def completion_view(values: Tensor, held: Tensor, group) -> Tensor:
    """The whole completion view ``[mb, width]`` on every rank of the CP ``group`` from each rank's
    held values (all-reduce SUM of the held entries; exact: one rank holds each token). ``held``
    may be narrower than ``values`` (columns beyond it: nobody's)."""
    keep = held.to(values.device)
    if keep.shape[1] < values.shape[1]:
        keep = torch.nn.functional.pad(keep, (0, values.shape[1] - keep.shape[1]))
    full = torch.where(keep, values.detach(), torch.zeros((), dtype=values.dtype, device=values.device)).contiguous()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=group)
    return full


def mean_entropy(entropy: Tensor, held: Tensor, mask: Tensor, group) -> Tensor:
    """GTPO's ``<H>_i`` ``[mb]`` of completions split over the CP ``group``: the one-process
    ``algo.completion_mean_entropy`` of the gathered completion view (so the entropy filter and the
    gamma shift see the whole completion on every CP rank)."""
    return algo.completion_mean_entropy(completion_view(entropy, held, group), mask, check=False)
