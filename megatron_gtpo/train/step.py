"""One global ``Batch`` -> ``mu`` optimizer steps of the Megatron policy, and the no-grad forward
passes the step needs (the reference model's log-probs; the optional pre-pass below).

Dataflow of :func:`train_step` (every rank holds the whole Batch; rows are split over DP)::

    rows of this DP rank --micro_batches--> [mb_0, mb_1, ...]   (model input [mb, S] built per micro-batch)
    last stage: algo.prepare_groups(spec, whole batch)      -> A, GTPO lambda and seq scales   (once)
    repeat mu times:
        Megatron forward_backward_func(loss_func = loss.micro_batch_loss)   # TP/PP/VPP, DDP reduce
            first update, per micro-batch: GTPO <H>_i of its rows -> algo.shape_rows (filter, shift);
            mu > 1: its detached log-probs are pi_old for the later updates
        optimizer.step() (grad clip inside), scheduler.step()
        after the first: GTPO <H>_i all-gathered over DP -> algo.shape_batch (whole-batch A~, metrics)
        mu > 1: the Adam update norm from the optimizer state (D4)
    last stage: D1 shared-prefix weights, D2 decomposition (train/diagnostics.py)   (once, CPU)
    metrics: (sum, count) pairs summed over micro-batches and DP on the last stage, then handed to
             every rank; D2's gap needs the first update's loss

One pass: GTPO's ``<H>_i`` depends only on completion i's own logits and its conflict weights only
on token ids and the signs of the unshaped advantages, so nothing needs a forward over the whole
batch before training: the first update's forward runs on the weights before any update (pi_old)
and yields ``<H>_i`` and, for mu > 1, pi_old itself. ``StepSettings.pre_pass`` restores the former
separate no-grad forward (``forward_stats``) before the updates; no algorithm needs it (the
values are the same bit for bit, tests/dist/test_onepass_step.py): it is the reference the one-pass
step is tested and benchmarked against (bench/step_time.py). ``forward_stats`` itself remains the
reference model's forward (KL term, ``train/learner.py``), a different model.

Only the last pipeline stage computes losses, so only it prepares the batch and holds per-token
inputs. GTPO's ``<H>_i`` is the mean entropy of pi_old (before the first update) with the reference
code's 1e-6 probability floor (``AlgoSpec.entropy_prob_floor``); for mu > 1 it is not recomputed
between updates, like the advantages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoSpec, PreparedBatch
from megatron_gtpo.parallel import collectives
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.parallel.layout import pipeline_problem
from megatron_gtpo.train import model_input
from megatron_gtpo.train.batching import (MicroBatch, global_normalisers, local_rows, micro_batch_count, micro_batches,
                                          packed_micro_batches)
from megatron_gtpo.train.diagnostics import adam_step, batch_bias, momentum_metrics
from megatron_gtpo.train.loss import ZERO_WHEN_EMPTY, LogprobSettings, StepInputs, micro_batch_loss, split_extrema
from megatron_gtpo.train.model import true_vocab_size
from megatron_gtpo.train.optim import current_lr, zero_grads
from megatron_gtpo.types import Batch

Tensor = torch.Tensor


def megatron_loss_scale(*, num_microbatches: int, dp_size: int) -> float:
    """The one factor that cancels Megatron's own loss/gradient scaling (multiply each
    micro-batch loss by it).

    Megatron assumes each micro-batch loss is a *mean* and averages twice: the schedule divides the
    loss returned by ``loss_func`` by ``num_microbatches`` (``forward_step_calc_loss``, two-value
    return, CP size 1), and DDP scales gradients by ``1 / dp_size`` before (or averages during) the
    data-parallel reduction. Our micro-batch losses are already normalised by GLOBAL counts, so
    their plain sum over micro-batches and DP ranks is the batch loss; multiplying by
    ``num_microbatches * dp_size`` undoes both averages. (The fp16 loss scale, ``grad_scale_func``,
    is undone by the optimizer itself and needs nothing here. Context parallelism is not supported:
    a CP size > 1 would also change the schedule's factor.)
    """
    return float(num_microbatches * dp_size)


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """How a Batch becomes updates; fixed for a run (built once by the learner)."""

    spec: AlgoSpec
    """The resolved algorithm."""
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
    pre_pass: bool = False
    """Run a separate no-grad forward over this rank's rows before the updates for pi_old (mu > 1)
    and GTPO's <H>_i, as the step did before issue 16. No algorithm needs it (the first update's
    forward gives the same values); kept as the reference of the one-pass step's tests and bench."""
    micro_batch_tokens: int = 0
    """> 0: packed micro-batches of at most this many tokens (``train.micro_batch_tokens``); 0: padded
    micro-batches of ``micro_batch_size`` rows."""


@dataclass(kw_only=True)
class Groups:
    """Process groups the step needs, fetched once from parallel_state."""

    tp: object
    dp: object
    pp: object
    last_stage_rank: int


def process_groups() -> Groups:
    from megatron.core import parallel_state as ps

    return Groups(tp=ps.get_tensor_model_parallel_group(), dp=ps.get_data_parallel_group(),
                  pp=ps.get_pipeline_model_parallel_group(),
                  last_stage_rank=ps.get_pipeline_model_parallel_last_rank())


@dataclass(kw_only=True)
class ForwardStats:
    """No-grad per-token statistics of this DP rank's rows (last pipeline stage only)."""

    logp: Tensor  # [local B, T] float32, completion view
    """log pi of each completion token at the sampling temperature."""
    entropy: Tensor  # [local B, T] float32
    """Entropy of the distribution that sampled each completion token (with the caller's floor)."""
    mean_entropy: Tensor  # [local B] float32
    """<H>_i of each row (with the probability floor the caller asked for)."""


def check_schedule(model_chunks, num_microbatches: int, dims: ParallelDims) -> None:
    """Layout checks Megatron does not make (or makes deep inside), each naming the fix."""
    if not (dims.vpp and dims.pp > 1):
        return
    problem = pipeline_problem(num_microbatches, pp=dims.pp, vpp=dims.vpp)
    if problem:
        raise ValueError(problem)
    from megatron.core.utils import get_model_config

    if dims.pp == 2 and get_model_config(model_chunks[0]).batch_p2p_comm:
        # With two stages the previous and the next stage are the same rank, and the interleaved
        # schedule's batched exchange posts two untagged sends to it: activation and gradient are
        # paired in posting order and arrive swapped (same shape, so nothing fails; gradients are
        # silently wrong; measured here on gloo, Megatron-LM issues #750/#1450).
        raise ValueError("pp=2 with virtual pipeline stages needs TransformerConfig batch_p2p_comm=False "
                         "(pass it in the model's Megatron overrides); the batched p2p exchange swaps "
                         "activations and gradients between the two stages")


def forward_kwargs(chunk) -> dict:
    """Keyword arguments of a model chunk's forward: a bf16/fp16 model (Megatron's Float16Module)
    returns its logits in its own dtype instead of an fp32 copy; the fused log-prob pass upcasts
    them chunk by chunk (``train/logprobs.py``), so the values are the same and one logits-sized
    fp32 copy per micro-batch is saved."""
    from megatron.core.transformer.module import Float16Module

    inner = getattr(chunk, "module", None)  # DDP wraps the Float16Module
    return {"fp32_output": False} if isinstance(chunk, Float16Module) or isinstance(inner, Float16Module) else {}


def run_schedule(model_chunks, mbs: list[MicroBatch], loss_for, *, forward_only: bool) -> list[dict]:
    """Megatron's forward_backward_func over ``mbs``; ``loss_for(mb, logits)`` runs on the last stage.
    Returns the per-micro-batch metric dicts (last stage only; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = forward_kwargs(model_chunks[0])

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_input.forward(model, mb, **extra), partial(loss_for, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in model_chunks],
        model=model_chunks, num_microbatches=len(mbs),
        seq_length=mbs[0].input_ids.shape[1], micro_batch_size=mbs[0].input_ids.shape[0],
        forward_only=forward_only)


def logprob_settings(settings: StepSettings, dims: ParallelDims, groups: Groups, model_chunks) -> LogprobSettings:
    """How ``model_chunks``' logits become log-probs; ``settings.vocab_size`` None: the model's true
    vocabulary (``build_model`` records it), so padding columns of the output layer are never scored."""
    vocab = true_vocab_size(model_chunks) if settings.vocab_size is None else settings.vocab_size
    return LogprobSettings(tp_group=groups.tp, tp_rank=dims.tp_rank, vocab_size=vocab,
                           temperature=settings.temperature, chunk_tokens=settings.chunk_tokens)


def rank_micro_batches(batch: Batch, settings: StepSettings, dims: ParallelDims) -> tuple[slice, list[MicroBatch]]:
    """This DP rank's rows and their micro-batches (on the model's device): padded, or packed by
    ``settings.micro_batch_tokens`` into as many micro-batches as the neediest DP rank requires."""
    budget, device = settings.micro_batch_tokens, collectives.comm_device()
    rows = local_rows(batch.size, dp=dims.dp, dp_rank=dims.dp_rank,
                      micro_batch_size=1 if budget else settings.micro_batch_size)
    if not budget:
        return rows, micro_batches(batch, rows, micro_batch_size=settings.micro_batch_size,
                                   common_length=dims.pp > 1, pad_to_multiple=settings.pad_to_multiple, device=device)
    count = micro_batch_count(batch, dp=dims.dp, token_budget=budget,
                              multiple=dims.pp if (dims.vpp and dims.pp > 1) else 1)
    return rows, packed_micro_batches(batch, rows, token_budget=budget, count=count, common_length=dims.pp > 1,
                                      pad_to_multiple=settings.pad_to_multiple, device=device)


@torch.no_grad()
def forward_stats(model_chunks, batch: Batch, mbs: list[MicroBatch], settings: LogprobSettings, *,
                  entropy_prob_floor: float = 0.0, entropy_temperature: float | None = None) -> ForwardStats | None:
    """No-grad forward of this rank's micro-batches: per-token log-probs and <H>_i of its rows in
    the global batch's completion width. Returns None on all but the last pipeline stage.
    ``entropy_temperature``: the entropies' temperature when it differs from the sampling one
    (GTPO's raw-logit statistic, one more pass over the logits)."""
    width = batch.token_ids.shape[1]
    other = entropy_temperature is not None and entropy_temperature != settings.temperature

    def loss_for(mb, logits):
        logp, ent = settings.token_stats(logits, mb.input_ids, entropy_prob_floor=entropy_prob_floor)
        if other:
            _, ent = settings.token_stats(logits, mb.input_ids, entropy_prob_floor=entropy_prob_floor,
                                          temperature=entropy_temperature)
        view = dataclasses.replace(mb, width=width)  # the global width: rows line up with the Batch
        return logits.new_zeros(()), {"logp": view.take(logp.float()), "entropy": view.take(ent.float())}

    store = run_schedule(model_chunks, mbs, loss_for, forward_only=True)
    if not store:
        return None
    rows, order = torch.cat([mb.rows for mb in mbs]).sort()  # packing spreads the rows: back to row order
    entropy = torch.cat([out["entropy"] for out in store])[order]
    return ForwardStats(logp=torch.cat([out["logp"] for out in store])[order], entropy=entropy,
                        mean_entropy=algo.completion_mean_entropy(entropy, batch.mask[rows.cpu()].to(entropy.device)))


def train_step(policy, batch: Batch, settings: StepSettings, dims: ParallelDims, *,
               ref_logp: Tensor | None = None) -> dict[str, float]:
    """``spec.mu`` optimizer steps of ``policy`` (chunks, optimizer, scheduler) on one global batch;
    returns metrics identical on every rank.

    ``ref_logp`` [local B, T]: the reference model's log-probs of this rank's rows (last stage),
    when ``kl_beta > 0``. Metric names are the logged ones (``megatron_gtpo.metrics``); values are
    means over the mu updates except ``mismatch/*`` and D2's ``bias/surrogate_*`` (first update),
    ``optim/lr`` (last) and ``optim/grad_norm_max``.
    """
    spec, groups = settings.spec, process_groups()
    rows, mbs = rank_micro_batches(batch, settings, dims)
    check_schedule(policy.chunks, len(mbs), dims)
    lp_settings = logprob_settings(settings, dims, groups, policy.chunks)
    stats = None
    if settings.pre_pass and (spec.needs_old_logp or spec.needs_mean_entropy):  # the reference path only
        stats = forward_stats(policy.chunks, batch, mbs, lp_settings, entropy_prob_floor=spec.entropy_prob_floor,
                              entropy_temperature=spec.entropy_temperature(settings.temperature))
    inputs = prepared = None
    if dims.is_last_stage:
        inputs, prepared = _step_inputs(batch, settings, dims, groups, rows=rows, stats=stats, ref_logp=ref_logp,
                                        num_microbatches=len(mbs))
    per_update, adam = [], []
    for update in range(spec.mu):
        step_inputs = None if inputs is None else dataclasses.replace(inputs, update=update)
        per_update.append(_update(policy, mbs, step_inputs, lp_settings, dims, groups))
        if update == 0 and prepared is not None and prepared.needs_entropy:
            inputs, prepared = _shape_batch(inputs, prepared, mbs, groups)
        if spec.mu > 1:  # D4: every rank takes part in the reduction over the optimizer's shards
            adam.append(adam_step(policy.optimizer))
    result = None
    if dims.is_last_stage:
        bias = batch_bias(spec, batch, prepared, num_tokens=inputs.num_tokens, num_seqs=inputs.num_seqs)
        result = _merge_updates(per_update)
        result.update({k: float(v) for k, v in prepared.metrics.items()})
        result.update(bias.metrics(per_update[0]))
        result.update(momentum_metrics(adam))
    return collectives.broadcast_from_last_stage(result, pp_group=groups.pp, last_stage_rank=groups.last_stage_rank)


def _step_inputs(batch: Batch, settings: StepSettings, dims: ParallelDims, groups: Groups, *, rows: slice,
                 stats: ForwardStats | None, ref_logp: Tensor | None,
                 num_microbatches: int) -> tuple[StepInputs, PreparedBatch]:
    """Prepares the whole global batch once (last stage) and places the loss inputs on the device.
    Returns them with the CPU record (GTPO without the pre-pass: not yet shaped, see ``_shape_batch``)."""
    device = collectives.comm_device()
    spec = settings.spec
    if stats is None:  # one pass: GTPO's rows are shaped inside the first update's forward
        prepared = algo.prepare_groups(spec, token_ids=batch.token_ids, mask=batch.mask, rewards=batch.rewards,
                                       group_ids=batch.group_ids)
    else:
        mean_entropy = None
        if spec.needs_mean_entropy:
            mean_entropy = collectives.all_gather_rows(stats.mean_entropy.to(device), groups.dp).cpu()
        prepared = algo.prepare_batch(spec, token_ids=batch.token_ids, mask=batch.mask, rewards=batch.rewards,
                                      group_ids=batch.group_ids, mean_entropy=mean_entropy)
    old_logp = stats.logp.to(device) if stats is not None and spec.needs_old_logp else None
    algo.validate_loss_inputs(spec, prepared.rows(torch.arange(batch.size)[rows]), mask=batch.mask[rows],
                              old_logp=None if old_logp is None else old_logp.cpu(),
                              ref_logp=None if ref_logp is None else ref_logp.cpu(),
                              sampler_logp=batch.sampler_logprobs[rows], old_logp_later=stats is None)
    num_tokens, num_seqs = global_normalisers(batch)
    inputs = StepInputs(spec=spec, prepared=_to_device(prepared, device), mask=batch.mask.to(device),
                        num_tokens=num_tokens, num_seqs=num_seqs, local=rows, old_logp=old_logp,
                        ref_logp=None if ref_logp is None else ref_logp.to(device),
                        sampler_logp=batch.sampler_logprobs.to(device),
                        scale=megatron_loss_scale(num_microbatches=num_microbatches, dp_size=dims.dp),
                        metric_weight=1.0 / (num_microbatches * dims.dp))
    return inputs, prepared


def _shape_batch(inputs: StepInputs, prepared: PreparedBatch, mbs: list[MicroBatch],
                 groups: Groups) -> tuple[StepInputs, PreparedBatch]:
    """One pass, GTPO, after the first update (last stage): the <H>_i its micro-batches computed
    (``loss.py``), all-gathered over DP, shape the whole batch as the pre-pass did (the same values,
    the whole-batch metrics ``entropy/mean`` and ``gtpo/filtered_frac``, the input of D1/D2); the
    later updates take their rows already shaped."""
    # [local B] in row order: packed micro-batches hold rows out of order, so place each by index
    rows = torch.cat([mb.rows for mb in mbs])
    values = torch.cat([inputs.cache.mean_entropy[id(mb)] for mb in mbs])
    local = values.new_empty(values.shape).index_copy_(0, (rows - rows.min()).to(values.device), values)
    mean_entropy = collectives.all_gather_rows(local, groups.dp).cpu()
    prepared = algo.shape_batch(inputs.spec, prepared, mean_entropy)
    return dataclasses.replace(inputs, prepared=_to_device(prepared, collectives.comm_device())), prepared


def _update(policy, mbs, inputs: StepInputs | None, lp_settings, dims, groups) -> dict[str, float] | None:
    """One optimizer step: forward/backward over all micro-batches (Megatron schedule; DP grad
    reduction in its finalize hook), clipped optimizer step, LR schedule step; metrics reduced over
    DP on the last stage (None elsewhere)."""
    zero_grads(policy.chunks, policy.optimizer)
    store = run_schedule(policy.chunks, mbs, partial(micro_batch_loss, inputs, lp_settings), forward_only=False)
    update_ok, grad_norm, _ = policy.optimizer.step()
    policy.scheduler.step(increment=1)
    if not dims.is_last_stage:
        return None
    metrics = _reduce_metrics(store, groups)
    metrics.update({name: 0.0 for name in ZERO_WHEN_EMPTY if math.isnan(metrics.get(name, 0.0))})
    metrics.update({"optim/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                    "optim/update_ok": float(bool(update_ok)), "optim/lr": current_lr(policy.optimizer)})
    return metrics


def _to_device(record, device):
    """Copy of a dataclass record (``PreparedBatch`` and its ``ConflictRuns``) with tensors on ``device``."""
    changes = {}
    for field in dataclasses.fields(record):
        value = getattr(record, field.name)
        if isinstance(value, Tensor):
            changes[field.name] = value.to(device)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = _to_device(value, device)
    return dataclasses.replace(record, **changes)


def _reduce_metrics(store: list[dict], groups: Groups) -> dict[str, float]:
    """Sums the last stage's per-micro-batch pairs over DP (min/max entries reduced as such)."""
    pairs, lows, highs = [], {}, {}
    for item in store:
        plain, low, high = split_extrema(item)
        pairs.append(plain)
        lows.update({k: min(v, lows.get(k, v)) for k, v in low.items()})
        highs.update({k: max(v, highs.get(k, v)) for k, v in high.items()})
    result = collectives.reduce_metric_pairs(collectives.sum_metric_pairs(pairs), groups.dp)
    result.update(collectives.reduce_min_max(lows, highs, groups.dp))
    return result


def _merge_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """Means over the mu updates that logged each name (D4's overshoot only from the third on),
    except first-update-only, last and max entries (see train_step)."""
    out = {}
    for name in dict.fromkeys(name for m in per_update for name in m):
        values = [m[name] for m in per_update if name in m]
        out[name] = values[-1] if name == "optim/lr" else sum(values) / len(values)
    for name in per_update[0]:
        if name.startswith("mismatch/"):
            out[name] = per_update[0][name]
    out["optim/grad_norm_max"] = max(m["optim/grad_norm"] for m in per_update)
    return out
