"""The hidden-objective-bias diagnostics of spec 6 (S4, arXiv 2601.05002) in the train step.

Where each one is computed (the pure functions are in ``algo/diagnostics.py`` and ``algo/prefix.py``)::

    D1  batch_bias          last stage, once per step, whole batch on CPU: the loss's own token
                            weights omega (global normalisers) x A on every shared-prefix trie node
    D5  batch_bias          the same omega: length drift, GTPO's shift share (algo/regime.py)
    D2  batch_bias + loss   sum_i A_i Omega_i, Cov(A, Omega) and the entropy part before the update;
                            the KL part and the mismatch-weight part from the first update's micro-
                            batches (train/loss.py); BatchBias.metrics compares with that loss
    D3  small_v_fraction    from the optimizer state (the reward-scale probe, megatron_gtpo/probe.py)
    D4  loss.py + adam_step mu > 1: overshoot counts per micro-batch (train/loss.py), and the Adam
                            update norm of every inner step from the optimizer state (momentum_metrics)

Megatron's optimizer keeps Adam state per parameter it steps (``optimizer.optimizer.state``;
a ``ChainedOptimizer`` holds several): the model parameters themselves (fp32 models), fp32 main
copies (bf16 models) or this rank's shard of them (distributed optimizer); where the step lives
and how the moments are stored depends on the Adam in use (torch, TE or apex FusedAdam), which
``train.optim_state`` reads. Sums over the state skip
shared and tensor-parallel duplicate parameters and are all-reduced over the group Megatron uses
for the grad norm (``get_grad_stats_parallel_group``: model-parallel, or the world with the
distributed optimizer), so every parameter entry counts exactly once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoSpec, PreparedBatch, SurrogateDecomposition
from megatron_gtpo.parallel import collectives
from megatron_gtpo.train import optim_state
from megatron_gtpo.types import Batch

Tensor = torch.Tensor
F64 = torch.float64


@dataclass(kw_only=True)
class BatchBias:
    """D1 and the batch part of D2 for one step (last pipeline stage)."""

    prefix: dict[str, float]
    """D1 metrics (``algo.prefix_bias_metrics``)."""
    regime: dict[str, float]
    """D5 and the regime guards' inputs (``algo.regime_metrics``): shift share, length drift, equal groups."""
    surrogate: SurrogateDecomposition
    """D2 before the loss is known (its KL part is filled in from the first update)."""

    def metrics(self, first_update: dict[str, float]) -> dict[str, float]:
        """D1 and D2 metrics; ``first_update`` holds the first update's reduced ``loss`` and the D2
        parts its micro-batches summed (``bias/surrogate_kl_term``, ``bias/surrogate_is_term``)."""
        is_term = first_update.get("bias/surrogate_is_term", 0.0)
        kl = torch.tensor(first_update.get("bias/surrogate_kl_term", 0.0), dtype=F64)
        d2 = dataclasses.replace(self.surrogate, kl_term=kl).metrics(first_update["loss"], is_term)
        out = {**self.prefix, **self.regime, **{name: float(value) for name, value in d2.items()}}
        if "bias/surrogate_is_term" in first_update:
            out["bias/surrogate_is_term"] = is_term
        return out


def batch_bias(spec: AlgoSpec, batch: Batch, prepared: PreparedBatch, *, num_tokens: float,
               num_seqs: float) -> BatchBias:
    """D1 and D2 of the whole global batch with the loss's own weights (``algo.token_omega``, the
    same global normalisers as the loss). CPU work, O(B x T) after one sort (bench/diagnostics.py)."""
    omega = algo.token_omega(spec, batch.mask, prepared, num_tokens=num_tokens, num_seqs=num_seqs)
    coefficients = omega * prepared.advantages.double()[:, None]
    prefix = algo.prefix_bias(batch.token_ids, batch.mask, batch.group_ids, prepared.raw_advantages, coefficients,
                              runs=prepared.runs)
    regime = algo.regime_metrics(omega, prepared, batch.group_ids, batch.lengths)
    return BatchBias(prefix={name: float(value) for name, value in prefix.items()},
                     regime={name: float(value) for name, value in regime.items()},
                     surrogate=algo.surrogate_decomposition(omega, prepared, batch.group_ids))


@dataclass(frozen=True)
class AdamStep:
    """The Adam update just taken, read from the optimizer state (summed over ranks)."""

    norm: float
    """``||dtheta||`` of the momentum part ``lr m_hat / (sqrt(v_hat) + eps)`` (no weight decay)."""
    step: int
    """Adam's 1-based step count."""
    beta1: float
    beta2: float


def _adam_states(optimizer):
    """``(param group, step, [(exp_avg, exp_avg_sq), ...])`` for every Adam param group of a Megatron
    optimizer, read by the rules of the optimizer in use (``train.optim_state``: torch keeps the step
    per parameter, TE/apex FusedAdam in the group); shared and tensor-parallel duplicate parameters
    are left out."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    for adam in optim_state.adam_groups(optimizer):
        kept = [p for p in adam.params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)]
        yield adam.group, adam.step, [adam.moments(p) for p in kept]


def _sum_over_shards(values: list[float], optimizer) -> list[float]:
    """Sums ``values`` over the ranks that hold the other shards of the optimizer state."""
    total = torch.tensor(values, dtype=F64, device=collectives.comm_device())
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    group = subs[0].get_grad_stats_parallel_group() if subs else None
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.tolist()


def adam_step(optimizer) -> AdamStep | None:
    """The update norm of the Adam step just taken (D4); None when the optimizer keeps no Adam state
    (SGD). Collective: every rank of the optimizer's grad-stats group must call it (a rank whose
    shard is empty contributes zeros)."""
    sq, holders, steps, betas = 0.0, 0.0, 0.0, None
    for group, step, states in _adam_states(optimizer):
        betas = betas or (tuple(group["betas"]) if "betas" in group else None)
        if not states:
            continue
        holders, steps = holders + 1, steps + step
        sq += float(algo.adam_update_sq_norm([m for m, _ in states], [v for _, v in states],
                                             step=step, lr=group["lr"], beta1=betas[0], beta2=betas[1],
                                             eps=group["eps"]))
    holders, steps, total = _sum_over_shards([holders, steps, sq], optimizer)
    if not holders or betas is None:
        return None
    return AdamStep(norm=math.sqrt(total), step=round(steps / holders), beta1=betas[0], beta2=betas[1])


def small_v_fraction(optimizer, *, eps: float | None = None, factor: float = 10.0) -> float | None:
    """D3: the share of Adam second-moment entries with ``sqrt(v_hat) < factor * eps`` (``eps``:
    the optimizer's own adam eps by default), where Adam's eps is not negligible and reward-scale
    invariance breaks (spec 6 Prop. 2). None without Adam state. Collective like ``adam_step``."""
    small = total = 0
    for group, step, states in _adam_states(optimizer):
        if not states:
            continue
        s, t = algo.small_second_moment_counts([v for _, v in states], step=step,
                                               beta2=group["betas"][1], eps=group["eps"] if eps is None else eps,
                                               factor=factor)
        small, total = small + int(s), total + int(t)
    small, total = _sum_over_shards([float(small), float(total)], optimizer)
    return None if total == 0 else small / total


def momentum_metrics(steps: list[AdamStep | None]) -> dict[str, float]:
    """D4's ``||dtheta_{T+k}|| / ||dtheta_{T-1}||`` over one step's mu updates (T - 1 = the first
    update, where the ratio is 1 and nothing is clipped; T + k = the last) next to Adam's
    momentum-only prediction ``C_{T,k}`` (spec 6 Prop. 3; ``(beta1/sqrt(beta2))^(k+1)`` for large
    T). A measured ratio near the prediction means the last updates were driven by momentum alone."""
    if len(steps) < 2 or any(s is None for s in steps) or steps[0].norm == 0 or steps[1].step < 2:
        return {}
    first, last = steps[0], steps[-1]
    return {"bias/adam_step_ratio": last.norm / first.norm,
            "bias/adam_step_ratio_momentum": algo.momentum_step_ratio(steps[1].step, len(steps) - 2,
                                                                      beta1=last.beta1, beta2=last.beta2)}
