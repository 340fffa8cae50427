"""One rollout batch -> ``mu`` optimizer steps of the Megatron policy, plus no-grad log-prob and
greedy-decoding passes through the same pipeline schedule.

Dataflow of :func:`train_on_batch` (every rank holds the whole global ``TrainBatch``)::

    batch --completion_view--> view [B, T]                                  (same on every rank)
    rows of this DP rank --micro_batches--> [mb_0, mb_1, ...]
    if GTPO or mu > 1:  no-grad forward (compute_logprobs)    -> pi_old logp, <H>_i   (all-gathered over DP)
    algo.prepare_batch(whole batch, <H>)                       -> A / A~, lambda, seq scales   (once)
    repeat mu times:
        Megatron forward_backward_func(loss_func = loss.micro_batch_loss)   # TP/PP/VPP, DDP reduce
        optimizer.step() (grad clip inside), scheduler.step()
    metrics: (sum, count) pairs summed over micro-batches and DP, broadcast from the last PP stage

GTPO's ``<H>_i`` is the mean entropy of pi_old (the policy before the first update); for mu > 1 it
is not recomputed between updates, like the advantages. ``entropy_prob_floor`` (default 1e-6)
reproduces the GTPO reference's clamp inside the log for that statistic (see logprobs.py); the
entropy reported by the loss is exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from megatron_gtpo import algo
from megatron_gtpo.parallel import collectives
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.train.batching import MicroBatch, completion_view, local_rows, micro_batches
from megatron_gtpo.train.logprobs import vocab_parallel_argmax
from megatron_gtpo.train.model import true_vocab_size
from megatron_gtpo.train.loss import (LogprobSettings, StepInputs, global_normalisers, micro_batch_loss,
                                      split_extrema)
from megatron_gtpo.train.optim import current_lr, zero_grads
from megatron_gtpo.types import TrainBatch

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


@dataclass(kw_only=True)
class TokenStats:
    """Per-token log-probs and entropies of a whole global batch (sequence view)."""

    logp: Tensor  # [B, S] fp32
    """``logp[b, t]`` = log pi(input_ids[b, t] | tokens before t) at the given temperature; 0 at t = 0."""
    entropy: Tensor  # [B, S] fp32
    """Entropy (nats) of the distribution that predicted token t; 0 at t = 0."""


@dataclass(kw_only=True)
class _Groups:
    """Process groups the step needs, fetched once from parallel_state."""

    tp: object
    dp: object
    pp: object
    last_stage_rank: int


def _groups() -> _Groups:
    from megatron.core import parallel_state as ps

    return _Groups(tp=ps.get_tensor_model_parallel_group(), dp=ps.get_data_parallel_group(),
                   pp=ps.get_pipeline_model_parallel_group(),
                   last_stage_rank=ps.get_pipeline_model_parallel_last_rank())


def _check_schedule(model_chunks, num_microbatches: int, dims: ParallelDims) -> None:
    """Layout checks Megatron does not make (or makes deep inside), each naming the fix."""
    if not (dims.vpp and dims.pp > 1):
        return
    if num_microbatches % dims.pp != 0:
        raise ValueError(f"interleaved pipeline (vpp={dims.vpp}) needs the micro-batches per DP rank "
                         f"({num_microbatches}) to be a multiple of pp={dims.pp}; change micro_batch_size "
                         "or the rollout batch size")
    from megatron.core.utils import get_model_config

    config = get_model_config(model_chunks[0])
    if dims.pp == 2 and config.batch_p2p_comm:
        # With two stages the previous and the next stage are the same rank, and the interleaved
        # schedule's batched exchange posts two untagged sends to it: activation and gradient are
        # paired in posting order and arrive swapped (same shape, so nothing fails; gradients are
        # silently wrong; measured here on gloo, Megatron-LM issues #750/#1450).
        raise ValueError("pp=2 with virtual pipeline stages needs TransformerConfig batch_p2p_comm=False "
                         "(pass it in the model's Megatron overrides); the batched p2p exchange swaps "
                         "activations and gradients between the two stages")


def _run_schedule(model_chunks, mbs: list[MicroBatch], loss_for, *, forward_only: bool) -> list[dict]:
    """Megatron's forward_backward_func over ``mbs``; ``loss_for(mb, logits)`` runs on the last stage.
    Returns the per-micro-batch metric dicts (last stage only; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = model(mb.input_ids, mb.position_ids, None)  # None: causal mask (CPU shim on gloo)
        return output, partial(loss_for, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in model_chunks],
        model=model_chunks, num_microbatches=len(mbs),
        seq_length=mbs[0].input_ids.shape[1], micro_batch_size=mbs[0].input_ids.shape[0],
        forward_only=forward_only)


def _settings(model_chunks, dims: ParallelDims, groups: _Groups, *, temperature: float, vocab_size: int | None,
              chunk_tokens: int | None) -> LogprobSettings:
    """``vocab_size`` None: the model's true vocabulary (its padding columns are never scored)."""
    vocab_size = true_vocab_size(model_chunks) if vocab_size is None else vocab_size
    return LogprobSettings(tp_group=groups.tp, tp_rank=dims.tp_rank, vocab_size=vocab_size,
                           temperature=temperature, chunk_tokens=chunk_tokens)


def _token_stats(model_chunks, batch: TrainBatch, mbs: list[MicroBatch], settings: LogprobSettings,
                 dims: ParallelDims, groups: _Groups, *, entropy_prob_floor: float) -> TokenStats:
    """No-grad forward over this rank's micro-batches; result gathered over DP and PP."""
    def loss_for(mb, logits):
        logp, ent = settings.token_stats(logits, mb.input_ids, entropy_prob_floor=entropy_prob_floor)
        return logits.new_zeros(()), {"logp": logp.float(), "entropy": ent.float()}

    with torch.no_grad():
        store = _run_schedule(model_chunks, mbs, loss_for, forward_only=True)
    full_shape = (batch.input_ids.shape[0], 2, batch.input_ids.shape[1])
    packed = None
    if dims.is_last_stage:
        local = torch.zeros(len(mbs) * mbs[0].rows.numel(), 2, batch.input_ids.shape[1])
        for i, (mb, out) in enumerate(zip(mbs, store)):
            block = local[i * mb.rows.numel():(i + 1) * mb.rows.numel()]
            block[:, 0, :out["logp"].shape[1]] = out["logp"]
            block[:, 1, :out["entropy"].shape[1]] = out["entropy"]
        packed = collectives.all_gather_rows(local.to(collectives.comm_device()), groups.dp)
    packed = collectives.broadcast_tensor_from_last_stage(
        packed, shape=full_shape, dtype=torch.float32, pp_group=groups.pp,
        last_stage_rank=groups.last_stage_rank).cpu()
    return TokenStats(logp=packed[:, 0], entropy=packed[:, 1])


def compute_logprobs(model_chunks, batch: TrainBatch, *, dims: ParallelDims, micro_batch_size: int,
                     temperature: float = 1.0, vocab_size: int | None = None,
                     chunk_tokens: int | None = None, entropy_prob_floor: float = 0.0) -> TokenStats:
    """No-grad log-probs and entropies of ``batch`` under ``model_chunks`` (the policy for pi_old or
    the mismatch metric, or a reference model for GRPO's KL). Every rank returns the whole batch.
    ``vocab_size`` None (the normal case): the model's true vocabulary, padding columns excluded."""
    groups = _groups()
    view = completion_view(batch)
    rows = local_rows(batch.input_ids.shape[0], dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=micro_batch_size)
    mbs = micro_batches(batch, view, rows, micro_batch_size=micro_batch_size, common_length=dims.pp > 1,
                        device=collectives.comm_device())
    _check_schedule(model_chunks, len(mbs), dims)
    settings = _settings(model_chunks, dims, groups, temperature=temperature, vocab_size=vocab_size,
                         chunk_tokens=chunk_tokens)
    return _token_stats(model_chunks, batch, mbs, settings, dims, groups, entropy_prob_floor=entropy_prob_floor)


def train_on_batch(model_chunks, optimizer, scheduler, batch: TrainBatch, *, algo_name: str,
                   prepare_kwargs: dict, loss_kwargs: dict, micro_batch_size: int, mu: int, temperature: float,
                   dims: ParallelDims, ref_logp: Tensor | None = None, vocab_size: int | None = None,
                   chunk_tokens: int | None = None, entropy_prob_floor: float = 1e-6,
                   pad_to_multiple: int = 1) -> dict[str, float]:
    """``mu`` optimizer steps on one global rollout batch; returns metrics identical on every rank.

    ``prepare_kwargs``/``loss_kwargs``: ``AlgoConfig.prepare_kwargs()`` and ``.loss_kwargs(...)``.
    ``ref_logp`` [B, S]: reference-model log-probs (``compute_logprobs`` of the reference model) when
    ``kl_beta > 0``. ``temperature`` must be the rollout's sampling temperature. Metric names:
    ``loss``, ``train/*`` (algo.compute_loss), ``batch/*`` (algo.prepare_batch), ``mismatch/*``
    (first update vs the sampler's log-probs), ``optim/*``; values are means over the mu updates
    except ``mismatch/*`` (first update), ``optim/lr`` (last) and ``optim/grad_norm_max``.
    ``batch.advantages`` is not read: advantages come from ``batch.rewards`` through
    ``algo.prepare_batch`` with ``prepare_kwargs``, so they cannot disagree with the loss settings.
    ``vocab_size`` None (the normal case): the model's true vocabulary (``build_model`` records it),
    so padding columns of the output layer never enter log-probs or entropies.
    """
    if mu < 1:
        raise ValueError(f"mu={mu} must be >= 1 (optimizer steps per rollout batch)")
    groups, device = _groups(), collectives.comm_device()
    view = completion_view(batch)
    rows = local_rows(batch.input_ids.shape[0], dp=dims.dp, dp_rank=dims.dp_rank, micro_batch_size=micro_batch_size)
    mbs = micro_batches(batch, view, rows, micro_batch_size=micro_batch_size, common_length=dims.pp > 1,
                        pad_to_multiple=pad_to_multiple, device=device)
    _check_schedule(model_chunks, len(mbs), dims)
    settings = _settings(model_chunks, dims, groups, temperature=temperature, vocab_size=vocab_size,
                         chunk_tokens=chunk_tokens)
    old_logp = mean_entropy = None
    if mu > 1 or algo.get_algorithm(algo_name).conflict_aware:  # pi_old and/or GTPO's <H>_i: forward first
        stats = _token_stats(model_chunks, batch, mbs, settings, dims, groups, entropy_prob_floor=entropy_prob_floor)
        mean_entropy = algo.completion_mean_entropy(view.take(stats.entropy), view.mask)
        old_logp = view.take(stats.logp).to(device) if mu > 1 else None
    prepared = algo.prepare_batch(algo_name, token_ids=view.token_ids, mask=view.mask, rewards=batch.rewards,
                                  group_ids=batch.group_ids, mean_entropy=mean_entropy, **prepare_kwargs)
    num_tokens, num_seqs = global_normalisers(view)
    # per-sequence inputs are built on the CPU from global metadata, then placed next to the logits
    inputs = StepInputs(
        algo=algo_name, prepared=_to_device(prepared, device), view=view.to(device), loss_kwargs=loss_kwargs,
        num_tokens=num_tokens, num_seqs=num_seqs, old_logp=old_logp,
        ref_logp=None if ref_logp is None else view.take(ref_logp).to(device),
        sampler_logp=view.take(batch.sampler_logprobs).to(device),
        scale=megatron_loss_scale(num_microbatches=len(mbs), dp_size=dims.dp),
        metric_weight=1.0 / (len(mbs) * dims.dp))
    out = _merge_updates([_update(model_chunks, optimizer, scheduler, mbs, inputs if i == 0 else
                                  dataclasses.replace(inputs, sampler_logp=None), settings, dims, groups)
                          for i in range(mu)])
    out.update({f"batch/{k}": float(v) for k, v in prepared.metrics.items()})
    return out


def _update(model_chunks, optimizer, scheduler, mbs, inputs: StepInputs, settings, dims, groups) -> dict[str, float]:
    """One optimizer step: forward/backward over all micro-batches (Megatron schedule; DP grad
    reduction in its finalize hook), clipped optimizer step, LR schedule step, reduced metrics."""
    zero_grads(model_chunks, optimizer)
    store = _run_schedule(model_chunks, mbs, partial(micro_batch_loss, inputs, settings), forward_only=False)
    update_ok, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    metrics = _reduce_metrics(store, dims, groups)
    metrics.update({"optim/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                    "optim/update_ok": float(bool(update_ok)), "optim/lr": current_lr(optimizer)})
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


def _reduce_metrics(store: list[dict], dims: ParallelDims, groups: _Groups) -> dict[str, float]:
    """Sums the last stage's per-micro-batch pairs over DP, then hands the result to every stage."""
    result = None
    if dims.is_last_stage:
        pairs, lows, highs = [], {}, {}
        for item in store:
            plain, low, high = split_extrema(item)
            pairs.append(plain)
            lows.update({k: min(v, lows.get(k, v)) for k, v in low.items()})
            highs.update({k: max(v, highs.get(k, v)) for k, v in high.items()})
        result = collectives.reduce_metric_pairs(collectives.sum_metric_pairs(pairs), groups.dp)
        result.update(collectives.reduce_min_max(lows, highs, groups.dp))
    return collectives.broadcast_from_last_stage(result, pp_group=groups.pp, last_stage_rank=groups.last_stage_rank)


def _merge_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """Means over the mu updates, except first-update-only, last and max entries (see train_on_batch)."""
    out = {}
    for name in per_update[0]:
        values = [m[name] for m in per_update if name in m]
        out[name] = values[-1] if name == "optim/lr" else sum(values) / len(values)
    for name in per_update[0]:
        if name.startswith("mismatch/"):
            out[name] = per_update[0][name]
    out["optim/grad_norm_max"] = max(m["optim/grad_norm"] for m in per_update)
    return out


@torch.no_grad()
def greedy_generate(model_chunks, prompt_ids: list[list[int]], max_new_tokens: int, dims: ParallelDims, *,
                    eos_id: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Greedy continuation of each prompt with plain Megatron forwards (no KV cache: O(n^2), meant
    for comparing against vLLM's greedy tokens on short prompts). Works with TP, PP and VPP: every
    token goes through the forward-only pipeline schedule and is broadcast from the last stage.
    Returns the new tokens per prompt (stops after ``eos_id`` when given)."""
    groups = _groups()
    vocab_size = true_vocab_size(model_chunks) if vocab_size is None else vocab_size
    results = []
    for prompt in prompt_ids:
        tokens = list(prompt)
        new: list[int] = []
        for _ in range(max_new_tokens):
            device = collectives.comm_device()
            ids = torch.tensor([tokens], dtype=torch.long, device=device)
            mb = MicroBatch(rows=torch.zeros(1, dtype=torch.long), input_ids=ids,
                            position_ids=torch.arange(len(tokens), device=device)[None, :], width=1)

            def loss_for(mb, logits):
                nxt = vocab_parallel_argmax(logits[:, -1], group=groups.tp, vocab_start=dims.tp_rank * logits.shape[-1],
                                            vocab_size=vocab_size)
                return logits.new_zeros(()), {"next": nxt}

            # the interleaved schedule needs >= pp micro-batches: repeat the same one (greedy is a test aid)
            repeats = dims.pp if (dims.vpp and dims.pp > 1) else 1
            store = _run_schedule(model_chunks, [mb] * repeats, loss_for, forward_only=True)
            nxt = store[0]["next"].to(collectives.comm_device()) if dims.is_last_stage else None
            nxt = collectives.broadcast_tensor_from_last_stage(
                nxt, shape=(1,), dtype=torch.long, pp_group=groups.pp, last_stage_rank=groups.last_stage_rank)
            token = int(nxt[0])
            tokens.append(token)
            new.append(token)
            if eos_id is not None and token == eos_id:
                break
        results.append(new)
    return results
