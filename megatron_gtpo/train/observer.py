"""The step observer: the hidden-objective-bias diagnostics D1-D4 (docs/algorithms.md section 6) and
the train-inference mismatch metrics, next to the train step rather than inside its loss.

On by default (this is a bias-research stack): ``train_step`` builds one per step. Where each
metric comes from (the pure functions are in ``algo/``, the optimizer-state readings in
``train/diagnostics.py``)::

    per micro-batch, inside the loss      device work only, into the update's MetricSums (no host sync);
                                          under CP on the tokens this rank holds (their sums add up
                                          over DP x CP like the loss's)
        every update      entropy/mean (all but GTPO, whose <H>_i comes with the whole batch)
        first update      mismatch/* (engine vs trainer log-probs, pi_old = this forward)
                          D2's KL part and the share of the loss due to the mismatch weights
        update k >= 1     D4 overshoot counts (each row's log-ratio at k - 1 against k)
    after every update    D4's Adam update norm (mu > 1; a collective over the optimizer's shards)
    once per step         D1 shared-prefix weights and D2's decomposition of the whole batch (CPU),
                          with the first update's reduced loss; D4's momentum ratio
"""

from __future__ import annotations

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import PreparedBatch, TokenInputs
from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.diagnostics import AdamStep, adam_step, batch_bias, momentum_metrics
from megatron_gtpo.train.metric_sums import F64, MetricSums
from megatron_gtpo.train.plan import StepPlan

Tensor = torch.Tensor

ZERO_WHEN_EMPTY = ("bias/clip_overshoot_rate",)
"""Rate metrics whose denominator may be empty in a step (no favoured-clipped token): logged as 0."""


class StepObserver:
    """D1-D4 and the mismatch metrics of one step (module docstring)."""

    def __init__(self, plan: StepPlan):
        self.plan = plan
        self._log_ratio: dict[int, Tensor] = {}
        """D4: micro-batch index -> its detached ``logp - old_logp`` at the previous update."""
        self._adam: list[AdamStep | None] = []

    @torch.no_grad()
    def micro_batch(self, update, mb: MicroBatch | CPShard, tokens: TokenInputs, rows: PreparedBatch,
                    entropy: Tensor) -> None:
        """Called by ``Update.loss`` (``train/loss.py``) for every micro-batch, with the loss's own
        inputs (under CP: the tokens this rank holds, ``tokens.mask``, of the whole completions,
        ``tokens.lengths``); ``entropy`` is the forward's entropy in the completion view ``[mb, width]``."""
        sums, spec = update.sums, self.plan.spec
        if not spec.needs_mean_entropy:  # whole completions on every CP rank: the pair's mean is unchanged
            mean_h = self.plan.completion_mean(entropy.detach(), mb)
            sums.add("entropy/mean", mean_h.sum(), torch.full((), tokens.mask.shape[0], dtype=F64,
                                                              device=mean_h.device))
        if update.index == 0:
            mismatch_metrics(sums, tokens.logp.detach(), self.plan.sampler_logp[mb.rows, :mb.width], tokens.mask)
            self._surrogate_parts(sums, tokens, rows)
        elif tokens.old_logp is not None:
            self._overshoot(sums, update.index, mb, tokens, rows)

    def _surrogate_parts(self, sums: MetricSums, tokens: TokenInputs, rows: PreparedBatch) -> None:
        """D2 parts only the loss sees (first update; summed over micro-batches and DP like the loss):
        the KL part ``kl_beta * aggregate(seq_scale k3)`` and the share of the loss due to the mismatch
        weights, ``sum_i A_i sum_t omega_{i,t} (1 - w_{i,t})`` (``BatchBias.metrics`` adds them up)."""
        plan, mask = self.plan, tokens.mask
        norms = {"num_tokens": plan.num_tokens, "num_seqs": plan.num_seqs, "lengths": tokens.lengths, "check": False}
        weight = torch.full((), plan.metric_weight, dtype=F64, device=mask.device)
        if tokens.ref_logp is not None and plan.spec.kl_beta > 0:
            zero = torch.zeros((), dtype=tokens.logp.dtype, device=mask.device)
            kl = algo.kl_k3(torch.where(mask, tokens.logp.detach(), zero), torch.where(mask, tokens.ref_logp, zero))
            sums.add("bias/surrogate_kl_term", algo.kl_penalty(plan.spec, kl, mask, rows, **norms), weight)
        if tokens.is_weights is not None:
            plain = algo.token_omega(plan.spec, mask, rows, **norms)
            weighted = algo.token_omega(plan.spec, mask, rows, is_weights=tokens.is_weights, **norms)
            sums.add("bias/surrogate_is_term", ((plain - weighted) * rows.advantages.double()[:, None]).sum(), weight)

    def _overshoot(self, sums: MetricSums, update: int, mb: MicroBatch | CPShard, tokens: TokenInputs,
                   rows: PreparedBatch) -> None:
        """D4 at inner update k >= 1: of the tokens in the advantage-favoured clipped region at update
        k - 1 (>= 1: at update 0 the ratio is 1), the share whose |log rho| grew by update k."""
        log_ratio = algo.surrogate_log_ratio(self.plan.spec, tokens)   # GSPO: the sequence ratio
        previous = self._log_ratio.pop(mb.index, None)
        if update < self.plan.spec.mu - 1:
            self._log_ratio[mb.index] = log_ratio
        if previous is None:
            return
        counts = algo.clip_overshoot(self.plan.spec, previous, log_ratio, rows, tokens.mask,
                                     is_weights=tokens.is_weights, check=False)
        sums.add("bias/clip_overshoot_rate", counts.overshoot, counts.favoured)

    def after_update(self, optimizer) -> None:
        """D4's Adam update norm of the update just taken (mu > 1). Collective: every rank of the
        optimizer's grad-stats group calls it, on every pipeline stage."""
        if self.plan.spec.mu > 1:
            self._adam.append(adam_step(optimizer))

    def finish(self, host_prepared: PreparedBatch, first_update: dict[str, float]) -> dict[str, float]:
        """D1, D2 and D4's momentum ratio of the step (last stage, CPU): ``host_prepared`` the whole
        batch's shaped loss inputs, ``first_update`` the first update's reduced metrics."""
        plan = self.plan
        bias = batch_bias(plan.spec, plan.batch, host_prepared, num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
        return {**bias.metrics(first_update), **momentum_metrics(self._adam)}


def mismatch_metrics(sums: MetricSums, logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> None:
    """Train-inference mismatch of one micro-batch on the first update (``logp`` = pi_old's): mean and
    max of |logp_train - logp_engine|, and k3 with r = pi_train / pi_engine, the unbiased estimate of
    KL(pi_engine || pi_train) for tokens the engine sampled; the means are token-weighted."""
    tokens = mask.sum().to(F64)
    abs_diff = torch.where(mask, (logp - sampler_logp).abs(), 0.0)
    k3 = torch.where(mask, algo.kl_k3(sampler_logp, logp), 0.0).sum()
    sums.add("mismatch/logprob_abs_mean", abs_diff.sum(), tokens)
    sums.add("mismatch/kl_k3", k3, tokens)
    sums.add_extremum("mismatch/logprob_abs_max", abs_diff.max(), tokens > 0, largest=True)
