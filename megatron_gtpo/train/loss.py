"""The distributed loss adapter: one micro-batch's logits -> ``algo.compute_loss`` -> Megatron.

Megatron's schedule calls ``loss_func(output_tensor)`` on the last pipeline stage for every
micro-batch; here that is :meth:`Update.loss`, which

1. turns the TP-sharded logits ``[mb, s, V/TP]`` into per-token log-probs and entropies with the
   fused vocab-parallel pass (``train/logprobs.py``) and moves them to the completion view
   ``[mb, T]`` that ``algo/`` expects (``StepPlan.token_stats``; under context parallelism this
   rank's share, scored on the tokens it holds, ``StepPlan.loss_mask``, with the whole completion
   lengths and <H>_i: train/cp_loss.py),
2. takes this micro-batch's rows of what the step prepared once for the whole global batch
   (``train/plan.py``: advantages, GTPO's lambda and scales) and of what is known about pi_old
   (:class:`PiOld`: GTPO's shaped advantages, pi_old's log-probs at mu > 1, the mismatch weights),
3. calls the pure ``algo.compute_loss`` with the GLOBAL normalisers, so the losses of all
   micro-batches on all DP ranks add up to the single-process loss,
4. returns it times the one Megatron rescale factor (``StepPlan.loss_scale``) and hands the
   metrics to the update's ``MetricSums`` and to the step observer (``train/observer.py``).

Nothing here reads a device value back, so a micro-batch costs no host sync
(``tests/unit/test_loss_syncs.py`` counts them): metrics stay on the device, and non-finite values
(a NaN <H>_i, a NaN loss) are counted there; the step reads the count once per update, before
``optimizer.step()`` (``train/step.py``).

pi_old is the policy before the step's first update, so the first update's own forward *is*
pi_old's. Whatever the step's :class:`PiOld` lacks when the first update starts (everything, but
for the tests' pre-pass reference) is learned from that forward: GTPO's <H>_i (the rows are shaped
right here with them, ``algo.shape_rows``; after the update the whole batch is shaped with every
row's value), at mu > 1 the detached log-probs and the mismatch weights. :meth:`Update.learned`
returns the completed record, which the later updates receive.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import PreparedBatch
from megatron_gtpo.parallel import collectives
from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.cp_shard import CPShard
from megatron_gtpo.train.metric_sums import F64, MetricSums
from megatron_gtpo.train.plan import StepPlan, to_device

Tensor = torch.Tensor


@dataclass(frozen=True, kw_only=True)
class PiOld:
    """What the step knows about pi_old, the policy before its first update; a field left None is
    learned by the first update from its own forward (module docstring). Per-micro-batch tensors
    are indexed like ``StepPlan.micro_batches``."""

    prepared: PreparedBatch | None
    """The whole batch's loss inputs on the device, ready for the loss (GTPO: shaped with every
    row's <H>_i); None: GTPO rows still to be shaped."""
    host_prepared: PreparedBatch | None
    """The same on the CPU: the whole-batch metrics and D1/D2 read it."""
    logp: tuple[Tensor, ...] | None = None
    """mu > 1: pi_old's detached log-probs of each micro-batch's tokens ``[mb, width]``."""
    is_weights: tuple[Tensor, ...] | None = None
    """mu > 1 with a mismatch correction: each micro-batch's weights ``[mb, width]``."""

    @classmethod
    def before_first_update(cls, plan: StepPlan) -> PiOld:
        """Nothing known yet; for all but GTPO the plan's groups are the loss inputs as they are."""
        if plan.spec.needs_mean_entropy:
            return cls(prepared=None, host_prepared=None)
        return cls(prepared=plan.prepared, host_prepared=plan.host_prepared)


class Update:
    """One optimizer update of a step: the loss function Megatron calls per micro-batch
    (:meth:`loss`), its metrics (``sums``) and, at the first update, what it learns about pi_old."""

    def __init__(self, plan: StepPlan, index: int, pi_old: PiOld, observer):
        self.plan, self.index, self.pi_old, self.observer = plan, index, pi_old, observer
        self.sums = MetricSums()
        count = len(plan.micro_batches)
        self._mean_entropy: list[Tensor | None] = [None] * count
        self._logp: list[Tensor | None] = [None] * count
        self._weights: list[Tensor | None] = [None] * count

    def loss(self, mb: MicroBatch | CPShard, logits: Tensor):
        """Loss of one micro-batch, already rescaled for Megatron, and an empty dict (its metrics
        stay on the device in ``self.sums``)."""
        plan, spec = self.plan, self.plan.spec
        same_temperature = spec.entropy_temperature(plan.logprobs.temperature) == plan.logprobs.temperature
        # GTPO's <H>_i statistic (its floored entropy) comes from this forward when its rows are
        # shaped here; the floor changes the entropy output only, never log p or its gradient.
        floor = spec.entropy_prob_floor if self.pi_old.prepared is None and same_temperature else 0.0
        # The logits (the output layer's fresh output) have no other consumer: their storage can
        # take the gradient, so backward never holds two logits-sized buffers.
        logp, entropy = plan.token_stats(mb, logits, inplace_backward=True, entropy_prob_floor=floor)
        mask = plan.loss_mask(mb)  # under CP: the tokens this rank holds; mb.lengths the whole completions
        rows = self._rows(mb, logits, entropy)
        old_logp = self._old_logp(mb, logp)
        tokens = algo.TokenInputs(logp=logp, mask=mask, lengths=mb.lengths, old_logp=old_logp,
                                  ref_logp=plan.local(plan.ref_logp, mb),
                                  is_weights=self._is_weights(mb, logp.detach() if old_logp is None else old_logp,
                                                              mask),
                                  seq_log_ratio=self._seq_log_ratio(mb, logp, old_logp, mask))
        loss, metrics = algo.compute_loss(spec, tokens, rows, num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
        tokens_f64 = mask.sum().to(F64)
        self.sums.add_token_metrics(metrics, tokens_f64)
        self.sums.add("loss", loss.detach(), torch.full((), plan.metric_weight, dtype=F64, device=loss.device))
        self.sums.count_nonfinite("loss", loss)
        self.observer.micro_batch(self, mb, tokens, rows, entropy)
        return loss * plan.loss_scale, {}

    def _rows(self, mb: MicroBatch | CPShard, logits: Tensor, entropy: Tensor) -> PreparedBatch:
        """This micro-batch's loss inputs; GTPO's at the first update shaped with this forward's <H>_i."""
        if self.pi_old.prepared is not None:
            return self.pi_old.prepared.rows(mb.rows)
        mean_h = self._row_entropy(mb, logits, entropy)
        self._mean_entropy[mb.index] = mean_h
        return algo.shape_rows(self.plan.spec, self.plan.prepared.rows(mb.rows), mean_h, check=False)

    @torch.no_grad()
    def _row_entropy(self, mb: MicroBatch | CPShard, logits: Tensor, entropy: Tensor) -> Tensor:
        """GTPO's <H>_i [mb] of pi_old from this forward (``entropy``: the completion view): its
        floored entropy output, or one more no-grad pass at the statistic's own temperature (raw
        logits), averaged over each whole completion (under CP: over the CP group, the same on every
        CP rank, so the filter decides alike). Non-finite values are counted (checked before the
        optimizer step), not raised here."""
        spec, logprobs = self.plan.spec, self.plan.logprobs
        temperature = spec.entropy_temperature(logprobs.temperature)
        if temperature != logprobs.temperature:
            _, entropy = self.plan.token_stats(mb, logits.detach(), entropy_prob_floor=spec.entropy_prob_floor,
                                               temperature=temperature)
        mean_h = self.plan.completion_mean(entropy.detach().float(), mb)
        self.sums.count_nonfinite("GTPO's <H>_i (mean token entropy of a completion)", mean_h)
        return mean_h

    @torch.no_grad()
    def _seq_log_ratio(self, mb: MicroBatch | CPShard, logp: Tensor, old_logp: Tensor | None,
                       mask: Tensor) -> Tensor | None:
        """GSPO's ``log s_i`` [mb] once pi_old is known (None before: the ratio is then exactly 1, and
        for the other algorithms): each whole completion's mean log-ratio, summed over the CP group
        (``StepPlan.completion_mean``, the step's one per-completion reduction)."""
        if self.plan.spec.surrogate != "gspo" or old_logp is None:
            return None
        return self.plan.completion_mean(algo.token_log_ratio(logp, old_logp, mask), mb)

    def _old_logp(self, mb: MicroBatch | CPShard, logp: Tensor) -> Tensor | None:
        """pi_old's log-probs [mb, width]: known, or (first update) None, the ratio being exactly 1
        on pi_old's own forward; kept at mu > 1 for the later updates."""
        if self.pi_old.logp is not None:
            return self.pi_old.logp[mb.index]
        if self.plan.spec.needs_old_logp:
            self._logp[mb.index] = logp.detach()
        return None

    @torch.no_grad()
    def _is_weights(self, mb: MicroBatch | CPShard, train_logp: Tensor, mask: Tensor) -> Tensor | None:
        """The mismatch weights (None without a correction): known, or computed from pi_old's
        log-probs ``train_logp`` once, their spread metrics recorded, kept at mu > 1."""
        spec = self.plan.spec
        if self.pi_old.is_weights is not None:
            return self.pi_old.is_weights[mb.index]
        weights, metrics = algo.mismatch_weights(spec, train_logp, self.plan.sampler_logp[mb.rows, :mb.width], mask,
                                                 check=False)
        self.sums.add_token_metrics(metrics, mask.sum().to(F64))
        if weights is not None and spec.needs_old_logp:
            self._weights[mb.index] = weights
        return weights

    def learned(self) -> PiOld:
        """The step's PiOld completed with what this (first) update learned (last stage; GTPO's
        shaping gathers every row's <H>_i over DP: a collective of the DP group)."""
        pi_old, spec, changes = self.pi_old, self.plan.spec, {}
        if pi_old.prepared is None:
            host = algo.shape_batch(spec, self.plan.host_prepared, self._gathered_entropy())
            changes.update(host_prepared=host, prepared=to_device(host, collectives.comm_device()))
        if pi_old.logp is None and spec.needs_old_logp:
            changes["logp"] = tuple(self._logp)
        if pi_old.is_weights is None and spec.needs_old_logp and spec.mismatch_correction != "none":
            changes["is_weights"] = tuple(self._weights)
        return dataclasses.replace(pi_old, **changes)

    def _gathered_entropy(self) -> Tensor:
        """Every row's <H>_i [B] (CPU), in row order: packed micro-batches hold rows out of order, so
        each value is placed by its row index before the DP all-gather."""
        rows = torch.cat([mb.rows for mb in self.plan.micro_batches])
        values = torch.cat(self._mean_entropy)
        local = values.new_empty(values.shape).index_copy_(0, (rows - self.plan.rows.start).to(values.device), values)
        return collectives.all_gather_rows(local, self.plan.comm.dp).cpu()
