"""One global ``Batch`` -> ``mu`` optimizer steps of the Megatron policy: a plan, the updates, an
observer; and the no-grad forward the learner needs for the reference model's log-probs.

Dataflow of :func:`train_step` (every rank holds the whole Batch; rows are split over DP)::

    plan   = plan_step(batch)                 rows, micro-batches, algo.prepare_groups of the whole
                                              batch, normalisers, Megatron's loss factor (train/plan.py)
    pi_old = PiOld.before_first_update(plan)  what is known about pi_old: nothing yet (train/loss.py)
    repeat mu times:                          update(plan, k, pi_old)
        Megatron forward_backward_func(loss_func = Update.loss)   # TP/PP/VPP, DDP reduce
            first update: learns pi_old from its own forward (GTPO <H>_i, mu > 1: log-probs, weights)
        non-finite count read (one host read) -> raise before the optimizer touches the weights
        optimizer.step() (grad clip inside), scheduler.step()
        first update: returns the completed PiOld (GTPO: the whole batch shaped with every <H>_i)
    finish: every update's metrics read at once (one host read, DP-reduced), merged; the observer's
            D1/D2/D4 (train/observer.py); handed from the last stage to every rank

Why one pass suffices: GTPO's ``<H>_i`` depends only on completion i's own logits and its conflict
weights only on token ids and the signs of the unshaped advantages, so nothing needs a forward over
the whole batch before training: the first update's forward runs on the weights before any update
(pi_old) and yields ``<H>_i`` and, for mu > 1, pi_old itself. A separate no-grad forward gives the
same values bit for bit (tests/dist/test_onepass_step.py keeps it as the reference: it hands
``update`` a PiOld it measured before the first update). ``forward_stats`` is that no-grad forward,
in production the reference model's (KL term, ``train/learner.py``).

Metric values are means over the mu updates except ``mismatch/*`` and D2's ``bias/surrogate_*``
(first update), ``optim/lr`` (last) and ``optim/grad_norm_max``; names are the logged ones
(``megatron_gtpo.metrics``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from megatron_gtpo import algo
from megatron_gtpo.parallel import collectives, control
from megatron_gtpo.parallel.dims import ParallelDims
from megatron_gtpo.parallel.layout import pipeline_problem
from megatron_gtpo.train import cp_loss, cp_shard, metric_sums, model_input
from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.logprobs import LogprobSettings
from megatron_gtpo.train.loss import PiOld, Update
from megatron_gtpo.train.observer import ZERO_WHEN_EMPTY, StepObserver
from megatron_gtpo.train.optim import current_lr, zero_grads
from megatron_gtpo.train.plan import (StepPlan, StepSettings, logprob_settings, plan_step, process_groups,
                                      rank_micro_batches, token_stats)
from megatron_gtpo.types import Batch

Tensor = torch.Tensor

__all__ = ["ForwardStats", "StepSettings", "check_schedule", "finish", "forward_stats", "logprob_settings",
           "plan_step", "process_groups", "rank_micro_batches", "run_schedule", "train_step", "update"]
"""The train step's public names; the plan's (``StepSettings``, ``rank_micro_batches``, ...) are
re-exported so callers import the step from one module."""


def train_step(policy, batch: Batch, settings: StepSettings, dims: ParallelDims, *,
               ref_logp: Tensor | None = None) -> dict[str, float]:
    """``spec.mu`` optimizer steps of ``policy`` (chunks, optimizer, scheduler) on one global batch;
    returns metrics identical on every rank. ``ref_logp`` [local B, T]: the reference model's
    log-probs of this rank's rows (last stage), when ``kl_beta > 0``."""
    plan = plan_step(policy.chunks, batch, settings, dims, ref_logp=ref_logp)
    check_schedule(policy.chunks, len(plan.micro_batches), dims)
    observer, pi_old, updates = StepObserver(plan), PiOld.before_first_update(plan), []
    for k in range(plan.spec.mu):
        pi_old, result = update(policy, plan, k, pi_old, observer)
        updates.append(result)
    return finish(plan, pi_old, updates, observer)


@dataclass(kw_only=True)
class UpdateResult:
    """What one update leaves for the end of the step."""

    sums: metric_sums.MetricSums | None
    """Its metrics on the device (last stage; None elsewhere)."""
    optim: dict[str, float]
    """Megatron's optimizer step: grad norm, update applied, learning rate."""


def update(policy, plan: StepPlan, k: int, pi_old: PiOld, observer: StepObserver) -> tuple[PiOld, UpdateResult]:
    """Update ``k`` of the step: forward/backward over all micro-batches (Megatron schedule; DP grad
    reduction in its finalize hook), the finiteness check, the clipped optimizer step and the LR
    schedule step. Returns pi_old as known after it (the first update completes it) and its result."""
    zero_grads(policy.chunks, policy.optimizer)
    step = Update(plan, k, pi_old, observer)
    run_schedule(policy.chunks, plan.micro_batches, step.loss, forward_only=False)
    bad = step.sums.nonfinite() if plan.is_last_stage else {}
    if control.any_rank(bool(bad)):  # every rank stops here, before the optimizer changes the weights
        raise FloatingPointError(f"update {k} of the step: non-finite values in {bad or 'another rank'}; no update "
                                 "was applied. Look for NaN/inf logits (learning rate, loss scale, the model's "
                                 "weights) or broken inputs (rewards, sampler log-probs)")
    update_ok, grad_norm, _ = policy.optimizer.step()
    policy.scheduler.step(increment=1)
    observer.after_update(policy.optimizer)
    optim = {"optim/grad_norm": float("nan") if grad_norm is None else float(grad_norm),
             "optim/update_ok": float(bool(update_ok)), "optim/lr": current_lr(policy.optimizer)}
    if plan.is_last_stage and k == 0:
        pi_old = step.learned()
    return pi_old, UpdateResult(sums=step.sums if plan.is_last_stage else None, optim=optim)


def finish(plan: StepPlan, pi_old: PiOld, updates: list[UpdateResult], observer: StepObserver) -> dict[str, float]:
    """The step's metrics, on every rank: every update's sums read in one go (last stage, reduced
    over DP x CP), merged over the updates, with the whole-batch metrics and the observer's."""
    result = None
    if plan.is_last_stage:
        per_update = metric_sums.read([u.sums for u in updates], plan.metric_group)
        for metrics, u in zip(per_update, updates):
            metrics.update({name: 0.0 for name in ZERO_WHEN_EMPTY if math.isnan(metrics.get(name, 0.0))})
            metrics.update(u.optim)
        result = _merge_updates(per_update)
        result.update({name: float(value) for name, value in pi_old.host_prepared.metrics.items()})
        result.update(observer.finish(pi_old.host_prepared, per_update[0]))
    return collectives.broadcast_from_last_stage(result, pp_group=plan.comm.pp,
                                                 last_stage_rank=plan.comm.last_stage_rank)


def _merge_updates(per_update: list[dict[str, float]]) -> dict[str, float]:
    """Means over the mu updates that logged each name (D4's overshoot only from the third on),
    except first-update-only, last and max entries (module docstring)."""
    out = {}
    for name in dict.fromkeys(name for m in per_update for name in m):
        values = [m[name] for m in per_update if name in m]
        out[name] = values[-1] if name == "optim/lr" else sum(values) / len(values)
    for name in per_update[0]:
        if name.startswith("mismatch/"):
            out[name] = per_update[0][name]
    out["optim/grad_norm_max"] = max(m["optim/grad_norm"] for m in per_update)
    return out


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


def run_schedule(model_chunks, mbs: list[MicroBatch] | list[CPShard], loss_for, *, forward_only: bool) -> list[dict]:
    """Megatron's forward_backward_func over ``mbs`` (under CP this rank's shares: the model runs on
    them, Megatron's schedule takes the WHOLE sequence length and divides it by CP itself);
    ``loss_for(mb, logits)`` runs on the last stage. Returns what the loss functions returned next
    to the loss (last stage only; empty elsewhere)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    extra = forward_kwargs(model_chunks[0])
    sharded = isinstance(mbs[0], CPShard)
    model_call = cp_shard.forward if sharded else model_input.forward

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return model_call(model, mb, **extra), partial(loss_for, mb)

    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(mbs) for _ in model_chunks],
        model=model_chunks, num_microbatches=len(mbs),
        seq_length=mbs[0].seq_len if sharded else mbs[0].input_ids.shape[1],
        micro_batch_size=mbs[0].input_ids.shape[0], forward_only=forward_only)


@dataclass(kw_only=True)
class ForwardStats:
    """No-grad per-token statistics of this DP rank's rows (last pipeline stage only)."""

    logp: Tensor  # [local B, T] float32, completion view
    """log pi of each completion token at the sampling temperature."""
    entropy: Tensor  # [local B, T] float32
    """Entropy of the distribution that sampled each completion token (with the caller's floor)."""
    mean_entropy: Tensor  # [local B] float32
    """<H>_i of each row (with the probability floor the caller asked for)."""


@torch.no_grad()
def forward_stats(model_chunks, batch: Batch, mbs: list[MicroBatch] | list[CPShard], settings: LogprobSettings, *,
                  entropy_prob_floor: float = 0.0, entropy_temperature: float | None = None) -> ForwardStats | None:
    """No-grad forward of this rank's micro-batches: per-token log-probs and <H>_i of its rows in
    the global batch's completion width. Returns None on all but the last pipeline stage.
    ``entropy_temperature``: the entropies' temperature when it differs from the sampling one
    (GTPO's raw-logit statistic, one more pass over the logits). Under CP (``mbs`` are this rank's
    shares) the values are gathered over the CP group: every CP rank returns whole completions."""
    width = batch.token_ids.shape[1]
    other = entropy_temperature is not None and entropy_temperature != settings.temperature
    cp_group = cp_loss.cp_groups()[0] if isinstance(mbs[0], CPShard) else None

    def loss_for(mb, logits):
        logp, ent = token_stats(settings, mb, logits, entropy_prob_floor=entropy_prob_floor, width=width)
        if other:
            _, ent = token_stats(settings, mb, logits, entropy_prob_floor=entropy_prob_floor,
                                 temperature=entropy_temperature, width=width)
        if cp_group is not None:  # one all-reduce of both: each token's values come from the rank holding it
            logp, ent = cp_loss.completion_view(torch.stack([logp.float(), ent.float()]).flatten(0, 1),
                                                torch.cat([mb.held, mb.held]), cp_group).unflatten(0, (2, -1))
        return logits.new_zeros(()), {"logp": logp.float(), "entropy": ent.float()}

    store = run_schedule(model_chunks, mbs, loss_for, forward_only=True)
    if not store:
        return None
    rows, order = torch.cat([mb.rows for mb in mbs]).sort()  # packing spreads the rows: back to row order
    entropy = torch.cat([out["entropy"] for out in store])[order]
    return ForwardStats(logp=torch.cat([out["logp"] for out in store])[order], entropy=entropy,
                        mean_entropy=algo.completion_mean_entropy(entropy, batch.mask[rows.cpu()].to(entropy.device)))
