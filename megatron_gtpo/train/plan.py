"""The plan of one train step, built once per step before any forward: rows, micro-batches, the
prepared groups, the normalisers and Megatron's loss factor (``train/step.py`` runs it).

    Batch --plan_step--> StepPlan
        rows, micro_batches        this DP rank's rows and their model inputs (padded or packed;
                                   under CP this rank's share of each: train/cp_shard.py)
        prepared / host_prepared   algo.prepare_groups of the WHOLE global batch (last stage; device / CPU)
        num_tokens, num_seqs       the global normalisers (every rank computes them from the Batch)
        loss_scale, metric_weight  the one factor that cancels Megatron's averaging; 1 / (mbs x DP x CP)

Only the last pipeline stage computes losses, so only it prepares the groups, checks the loss
inputs (once per step, at the batch boundary: ``algo.validate_loss_inputs``) and places per-token
inputs on the device; the other stages' plans hold rows and micro-batches only.

Context parallelism (``parallel.cp``) splits each sequence over the ranks of a CP group: a
micro-batch of the plan is then a ``CPShard`` (padded rows: Megatron's load-balanced split;
packed rows: per sequence, THD), which the step uses where it uses a ``MicroBatch`` without CP.
What differs is in three methods, the step's one home for it: :meth:`StepPlan.token_stats`
(log-probs and entropies in the completion view, 0 on the tokens another CP rank holds),
:meth:`StepPlan.loss_mask` (the completion mask restricted to the tokens this rank holds) and
:meth:`StepPlan.completion_mean` (per-completion means such as GTPO's <H>_i, over the CP group's
whole completion: identical on every CP rank). Metric sums are reduced over ``comm.metrics``
(DP x CP; DP without CP), see train/cp_loss.py for why each kind of metric adds up.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoSpec, PreparedBatch
from megatron_gtpo.parallel import collectives
from megatron_gtpo.parallel.cp_index import cp_multiple
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train import cp_loss
from megatron_gtpo.train.batching import (MicroBatch, global_normalisers, local_rows, micro_batch_count, micro_batches,
                                          packed_micro_batches)
from megatron_gtpo.train.cp_shard import CPShard, shard_micro_batch
from megatron_gtpo.train.logprobs import LogprobSettings
from megatron_gtpo.train.model import true_vocab_size
from megatron_gtpo.types import Batch

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """How a Batch becomes updates; fixed for a run (built once by the driver and the learner)."""

    spec: AlgoSpec
    """The resolved algorithm (``RunConfig.algorithm``)."""
    micro_batch_size: int
    """Completions per micro-batch on one DP rank."""
    temperature: float
    """The rollout's sampling temperature: log-probs and entropies refer to that distribution."""
    vocab_size: int | None = None
    """True vocabulary size (padding columns of the output layer excluded); None: the model's own
    (``train.model.true_vocab_size``)."""
    chunk_tokens: int | None = None
    """Rows per chunk of the fused log-prob/entropy pass (None: automatic)."""
    pad_to_multiple: int = 1
    """Micro-batch sequence lengths are rounded up to this multiple."""
    micro_batch_tokens: int = 0
    """> 0: packed micro-batches of at most this many tokens (``train.micro_batch_tokens``); 0: padded
    micro-batches of ``micro_batch_size`` rows."""


@dataclass(kw_only=True)
class Groups:
    """Process groups the step needs, fetched once from parallel_state."""

    tp: object
    dp: object
    """Data parallelism without CP: the ranks holding other rows (GTPO's <H>_i gathered over it)."""
    pp: object
    last_stage_rank: int
    cp: object = None
    """The context-parallel group (ranks sharing each sequence); None without CP."""
    metrics: object = None
    """What the step's metric sums are reduced over: DP x CP under CP, else ``dp`` (None: ``dp``)."""


def process_groups() -> Groups:
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size() > 1
    return Groups(tp=ps.get_tensor_model_parallel_group(), dp=ps.get_data_parallel_group(),
                  pp=ps.get_pipeline_model_parallel_group(),
                  last_stage_rank=ps.get_pipeline_model_parallel_last_rank(),
                  cp=ps.get_context_parallel_group() if cp else None,
                  metrics=ps.get_data_parallel_group(with_context_parallel=True) if cp else None)


def megatron_loss_scale(*, num_microbatches: int, dp_size: int, cp_size: int = 1) -> float:
    """The one factor that cancels Megatron's own loss/gradient scaling (multiply each
    micro-batch loss by it), with ``dp_size`` the data-parallel size WITHOUT CP (``ParallelDims.dp``).

    Megatron assumes each micro-batch loss is a *mean* over its rank's tokens and averages: the
    schedule (``forward_step_calc_loss``, two-value return, Megatron-Core 0.16.1) multiplies the
    loss returned by ``loss_func`` by the CP size and divides it by ``num_microbatches``, and DDP
    scales gradients by ``1 / (dp_size * cp_size)`` before (or averages during) the reduction over
    ``get_data_parallel_group(with_context_parallel=True)``. Our micro-batch losses are this rank's
    share of the GLOBALLY normalised batch loss, so their plain sum over micro-batches, DP and CP
    ranks is the batch loss; multiplying by ``num_microbatches * (dp_size * cp_size) / cp_size``
    undoes both. The two CP factors cancel: the value is ``num_microbatches * dp_size`` for every
    CP size (passing the DP x CP size as ``dp_size`` would scale the gradients by cp). The fp16
    loss scale (``grad_scale_func``) is undone by the optimizer itself and needs nothing here.
    """
    if num_microbatches < 1 or dp_size < 1 or cp_size < 1:
        raise ValueError(f"num_microbatches={num_microbatches}, dp_size={dp_size} and cp_size={cp_size} "
                         "must all be >= 1")
    # 1 / (schedule's cp / num_microbatches x DDP's 1 / (dp * cp)), in integers: exact
    return float(num_microbatches * dp_size * cp_size) / cp_size


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """One step's layout and loss inputs (module docstring); the same for its mu updates."""

    spec: AlgoSpec
    dims: ParallelDims
    comm: Groups
    """Process groups (TP, DP, PP)."""
    logprobs: LogprobSettings
    """How logits become log-probs and entropies on this rank."""
    batch: Batch
    """The global batch (CPU; every rank holds all of it)."""
    rows: slice
    """This DP rank's rows of the global batch."""
    micro_batches: list[MicroBatch | CPShard]
    """This rank's micro-batches (on the device), in schedule order; an update refers to one by its
    index. Under CP this rank's shares of them (``CPShard``: the same ``rows``, ``width``, ``index``)."""
    prepared: PreparedBatch | None = None
    """Last stage: ``algo.prepare_groups`` of the whole batch, on the device (GTPO: not yet shaped)."""
    host_prepared: PreparedBatch | None = None
    """Last stage: the same on the CPU (whole-batch metrics, D1/D2)."""
    mask: Tensor | None = None  # [B, T] bool, device
    """Completion mask of the whole global batch."""
    sampler_logp: Tensor | None = None  # [B, T], device
    """The rollout engine's log-probs of the sampled tokens (mismatch metrics and weights)."""
    ref_logp: Tensor | None = None  # [local B, T], device
    """The reference model's log-probs of this rank's rows (``kl_beta > 0``), or None."""
    num_tokens: float = 0.0
    """Masked tokens of the whole global batch: the token-mean normaliser."""
    num_seqs: float = 0.0
    """Completions of the whole global batch: the seq-mean normaliser."""
    loss_scale: float = 1.0
    """Megatron rescale factor (``megatron_loss_scale``)."""
    metric_weight: float = 1.0
    """1 / (micro-batches x DP x CP ranks): summed over all micro-batches of the metric group it
    gives 1, so a summed metric (the loss) survives the (sum, count) reduction unchanged."""

    @property
    def is_last_stage(self) -> bool:
        return self.dims.is_last_stage

    @property
    def metric_group(self):
        """The group the step's metric sums are reduced over (DP x CP; DP without CP)."""
        return self.comm.dp if self.comm.metrics is None else self.comm.metrics

    def local(self, tensor: Tensor | None, mb: MicroBatch | CPShard) -> Tensor | None:
        """``mb``'s rows of a tensor that holds only this rank's rows, in the micro-batch's width."""
        return None if tensor is None else tensor[mb.rows - self.rows.start, :mb.width]

    def token_stats(self, mb: MicroBatch | CPShard, logits: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
        """``(logp, entropy)`` ``[mb, width]`` of one micro-batch's logits in the completion view
        (:func:`token_stats`; keyword arguments as there)."""
        return token_stats(self.logprobs, mb, logits, **kwargs)

    def loss_mask(self, mb: MicroBatch | CPShard) -> Tensor:
        """``[mb, width]`` bool: the loss tokens of ``mb`` this rank computes (under CP the held
        share of each completion; its whole lengths are ``mb.lengths``)."""
        mask = self.mask[mb.rows, :mb.width]
        return mask & mb.held if isinstance(mb, CPShard) else mask

    def completion_mean(self, values: Tensor, mb: MicroBatch | CPShard) -> Tensor:
        """``[mb]`` mean of completion-view ``values`` ``[mb, width]`` (from :meth:`token_stats`) over
        each WHOLE completion, in the global batch's width (the pre-update statistic of GTPO's filter
        is taken exactly so): the step's one per-completion reduction. Under CP the held values of
        the group are summed first (``cp_loss.completion_view``, exact), so every CP rank gets the
        same value, the one-process one."""
        width = self.mask.shape[1]
        if isinstance(mb, CPShard):
            values = cp_loss.completion_view(widen(values, width), mb.held, self.comm.cp)
        return algo.completion_mean_entropy(widen(values, width), self.mask[mb.rows], check=False)


def widen(values: Tensor, width: int | None) -> Tensor:
    """``values`` ``[mb, w]`` with zero columns up to ``width`` (None or <= w: unchanged)."""
    if width is None or width <= values.shape[1]:
        return values
    return torch.nn.functional.pad(values, (0, width - values.shape[1]))


def token_stats(settings: LogprobSettings, mb: MicroBatch | CPShard, logits: Tensor, *, width: int | None = None,
                **kwargs) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[mb, width]`` (default: the micro-batch's width) in the completion view
    from ``mb``'s logits (the fused vocab-parallel pass, ``settings.token_stats``; under CP on this
    rank's share, ``cp_loss.shard_token_stats``, 0 where another CP rank holds the token).
    Keyword arguments: ``entropy_prob_floor``, ``inplace_backward``, ``temperature``."""
    if isinstance(mb, CPShard):
        return cp_loss.shard_token_stats(settings, logits, mb, width=width, **kwargs)
    logp, entropy = settings.token_stats(logits, mb.input_ids, **kwargs)
    return widen(mb.take(logp), width), widen(mb.take(entropy), width)


def logprob_settings(settings: StepSettings, dims: ParallelDims, groups: Groups, model_chunks) -> LogprobSettings:
    """How ``model_chunks``' logits become log-probs; ``settings.vocab_size`` None: the model's true
    vocabulary (``build_model`` records it), so padding columns of the output layer are never scored."""
    vocab = true_vocab_size(model_chunks) if settings.vocab_size is None else settings.vocab_size
    return LogprobSettings(tp_group=groups.tp, tp_rank=dims.tp_rank, vocab_size=vocab,
                           temperature=settings.temperature, chunk_tokens=settings.chunk_tokens)


def rank_micro_batches(batch: Batch, settings: StepSettings,
                       dims: ParallelDims) -> tuple[slice, list[MicroBatch] | list[CPShard]]:
    """This DP rank's rows and their micro-batches (on the model's device): padded, or packed by
    ``settings.micro_batch_tokens`` into as many micro-batches as the neediest DP rank requires.
    Under CP: this CP rank's share of each (``CPShard``; lengths padded to a multiple of 2 x cp,
    packed sequences each, the token budget counting them so), cut on the host, then moved."""
    budget, device, cp = settings.micro_batch_tokens, collectives.comm_device(), dims.cp
    multiple = math.lcm(settings.pad_to_multiple, cp_multiple(cp))
    place = None if cp > 1 else device
    rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank,
                      micro_batch_size=1 if budget else settings.micro_batch_size)
    if not budget:
        mbs = micro_batches(batch, rows, micro_batch_size=settings.micro_batch_size, common_length=dims.pp > 1,
                            pad_to_multiple=multiple, device=place)
    else:
        count = micro_batch_count(batch, dp=dims.dp, token_budget=budget, seq_multiple=cp_multiple(cp),
                                  multiple=dims.pp if (dims.vpp and dims.pp > 1) else 1)
        mbs = packed_micro_batches(batch, rows, token_budget=budget, count=count, common_length=dims.pp > 1,
                                   pad_to_multiple=multiple, seq_multiple=cp_multiple(cp), device=place)
    if cp == 1:
        return rows, mbs
    return rows, [shard_micro_batch(mb, cp=cp, rank=dims.cp_rank, pad_id=batch.pad_id,
                                    seq_len=int(mb.input_ids.shape[1]) if budget else None).to(device) for mb in mbs]


def plan_step(model_chunks, batch: Batch, settings: StepSettings, dims: ParallelDims, *,
              ref_logp: Tensor | None = None) -> StepPlan:
    """The plan of one step of ``model_chunks`` (module docstring). ``ref_logp`` [local B, T]: the
    reference model's log-probs of this rank's rows (last stage), when ``kl_beta > 0``."""
    comm = process_groups()
    return make_plan(batch, settings, dims, comm=comm, logprobs=logprob_settings(settings, dims, comm, model_chunks),
                     ref_logp=ref_logp)


def make_plan(batch: Batch, settings: StepSettings, dims: ParallelDims, *, comm: Groups, logprobs: LogprobSettings,
              ref_logp: Tensor | None = None) -> StepPlan:
    """``plan_step`` with the process groups and log-prob settings given (no Megatron state needed)."""
    rows, mbs = rank_micro_batches(batch, settings, dims)
    plan = StepPlan(spec=settings.spec, dims=dims, comm=comm, batch=batch, rows=rows, micro_batches=mbs,
                    logprobs=logprobs)
    if not dims.is_last_stage:
        return plan
    spec, device = settings.spec, collectives.comm_device()
    prepared = algo.prepare_groups(spec, token_ids=batch.token_ids, mask=batch.mask, rewards=batch.rewards,
                                   group_ids=batch.group_ids)
    algo.validate_loss_inputs(spec, prepared.rows(torch.arange(batch.size)[rows]), mask=batch.mask[rows],
                              ref_logp=None if ref_logp is None else ref_logp.cpu(),
                              sampler_logp=batch.sampler_logprobs[rows], old_logp_later=True)
    num_tokens, num_seqs = global_normalisers(batch)
    return dataclasses.replace(
        plan, prepared=to_device(prepared, device), host_prepared=prepared, mask=batch.mask.to(device),
        sampler_logp=batch.sampler_logprobs.to(device), ref_logp=None if ref_logp is None else ref_logp.to(device),
        num_tokens=num_tokens, num_seqs=num_seqs,
        loss_scale=megatron_loss_scale(num_microbatches=len(mbs), dp_size=dims.dp, cp_size=dims.cp),
        metric_weight=1.0 / (len(mbs) * dims.dp * dims.cp))


def to_device(record, device):
    """Copy of a dataclass record (``PreparedBatch`` and its ``ConflictRuns``) with tensors on ``device``."""
    changes = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, Tensor):
            changes[field.name] = value.to(device)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = to_device(value, device)
    return dataclasses.replace(record, **changes)
