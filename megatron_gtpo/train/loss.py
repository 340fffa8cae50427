"""The distributed loss adapter: one micro-batch's logits -> ``algo.compute_loss`` -> Megatron.

Megatron's schedule calls ``loss_func(output_tensor)`` on the last pipeline stage for every
micro-batch. Here that function:

1. turns the TP-sharded logits ``[mb, s, V/TP]`` into per-token log-probs and entropies with the
   fused vocab-parallel pass (``train/logprobs.py``),
2. moves them to the completion view ``[mb, T]`` that ``algo/`` expects (``MicroBatch.take``),
3. calls the pure ``algo.compute_loss`` with this micro-batch's rows of the per-sequence inputs
   (advantages, GTPO lambda and scales) that were prepared ONCE for the whole global batch, and with
   the GLOBAL normalisers (masked tokens and completions of the global batch), so the per-micro-batch
   losses of all micro-batches on all DP ranks add up to the single-process loss,
4. multiplies by the one Megatron rescale factor (``train/step.py::megatron_loss_scale``).

Metrics leave as ``name -> tensor([sum, count])`` so that they can be summed over micro-batches and
DP ranks (``parallel/collectives.py``); min/max metrics travel separately.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_gtpo import algo
from megatron_gtpo.algo import AlgoSpec, PreparedBatch
from megatron_gtpo.train.batching import MicroBatch
from megatron_gtpo.train.logprobs import VocabShard, shifted_token_logprobs

Tensor = torch.Tensor


@dataclass(kw_only=True)
class LogprobSettings:
    """How logits become log-probs on this rank (fixed for a run)."""

    tp_group: object
    """Tensor-parallel process group (the vocabulary is sharded over it)."""
    tp_rank: int
    """This rank's index in ``tp_group``: its shard starts at ``tp_rank * V/TP``."""
    vocab_size: int | None
    """True vocabulary size (excludes padding columns); None = the logits' full width x TP."""
    temperature: float
    """Rollout sampling temperature; logits are divided by it."""
    chunk_tokens: int | None
    """Rows per chunk of the fused log-prob/entropy pass (None: automatic; see logprobs.py)."""

    def token_stats(self, logits: Tensor, input_ids: Tensor, *, entropy_prob_floor: float = 0.0,
                    inplace_backward: bool = False):
        """``(logp, entropy)`` ``[mb, s]`` aligned with the predicted tokens (column 0 is 0)."""
        shard = VocabShard(group=self.tp_group, start=self.tp_rank * logits.shape[-1], vocab_size=self.vocab_size)
        return shifted_token_logprobs(logits, input_ids, shard=shard, temperature=self.temperature,
                                      chunk_tokens=self.chunk_tokens, entropy_prob_floor=entropy_prob_floor,
                                      inplace_backward=inplace_backward)


@dataclass(kw_only=True)
class StepInputs:
    """Everything the loss of any micro-batch on this rank needs during one optimizer step."""

    spec: AlgoSpec
    """The resolved algorithm."""
    prepared: PreparedBatch
    """Output of ``algo.prepare_batch`` for the whole global batch (on the device)."""
    mask: Tensor  # [B, T] bool
    """Completion mask of the whole global batch (on the device)."""
    num_tokens: float
    """Masked (loss) tokens of the whole global batch: the token-mean normaliser."""
    num_seqs: float
    """Completions in the whole global batch: the seq-mean normaliser."""
    local: slice
    """This DP rank's rows of the global batch: the rows of ``old_logp``/``ref_logp`` below."""
    old_logp: Tensor | None  # [local B, T]
    """pi_old log-probs of this rank's rows when mu > 1; None: ratio = exp(logp - logp.detach())."""
    ref_logp: Tensor | None  # [local B, T]
    """Reference-model log-probs of this rank's rows for the KL term, or None."""
    sampler_logp: Tensor | None  # [B, T]
    """Rollout engine log-probs, for the train-inference mismatch metric (first update only)."""
    scale: float
    """Megatron rescale factor from ``megatron_loss_scale``."""
    metric_weight: float
    """1 / (micro-batches x DP ranks): summing this over all micro-batches gives 1, so a summed
    metric (the loss) survives the (sum, count) reduction unchanged."""

    def local_rows(self, tensor: Tensor | None, rows: Tensor, width: int) -> Tensor | None:
        """``tensor[rows - local.start, :width]`` for a tensor that holds only this rank's rows."""
        return None if tensor is None else tensor[rows - self.local.start, :width]


def micro_batch_loss(inputs: StepInputs, settings: LogprobSettings, mb: MicroBatch, logits: Tensor):
    """Loss of one micro-batch, already rescaled for Megatron, and its metric pairs."""
    # The logits (the output layer's fresh output) have no other consumer: their storage can take
    # the gradient, so backward never holds two logits-sized buffers.
    logp_seq, ent_seq = settings.token_stats(logits, mb.input_ids, inplace_backward=True)
    rows, width = mb.rows, mb.width
    mask = inputs.mask[rows, :width]
    tokens = algo.TokenInputs(logp=mb.take(logp_seq), mask=mask,
                              old_logp=inputs.local_rows(inputs.old_logp, rows, width),
                              ref_logp=inputs.local_rows(inputs.ref_logp, rows, width))
    loss, metrics = algo.compute_loss(inputs.spec, tokens, inputs.prepared.rows(rows), num_tokens=inputs.num_tokens,
                                      num_seqs=inputs.num_seqs)
    pairs = _metric_pairs(metrics, mask)
    pairs["loss"] = torch.stack([loss.detach().double(), _f64(inputs.metric_weight, loss.device)])
    if not inputs.spec.needs_mean_entropy:  # GTPO's <H>_i pre-pass reports entropy/mean itself
        mean_h = algo.completion_mean_entropy(mb.take(ent_seq.detach()), mask)
        pairs["entropy/mean"] = torch.stack([mean_h.sum().double(), _f64(mask.shape[0], mask.device)])
    if inputs.sampler_logp is not None:
        pairs.update(_mismatch_pairs(tokens.logp.detach(), inputs.sampler_logp[rows, :width], mask))
    return loss * inputs.scale, pairs


def _metric_pairs(metrics: dict[str, Tensor], mask: Tensor) -> dict[str, Tensor]:
    """``compute_loss`` metrics are means over this micro-batch's tokens; weighting by that count
    makes the reduced value the global-batch mean. ``*_min``/``*_max`` are kept as (value, 1) under
    a ``min:``/``max:`` prefix for a min/max reduce."""
    tokens = mask.sum().double()
    out = {}
    for name, value in metrics.items():
        value = value.detach().double()
        if name.endswith(("_min", "_max")):
            if tokens > 0:
                out[f"{name[-3:]}:{name}"] = torch.stack([value, _f64(1.0, value.device)])
            continue
        out[name] = torch.stack([value * tokens, tokens])
    return out


def _f64(value: float, device) -> Tensor:
    return torch.tensor(float(value), dtype=torch.float64, device=device)


@torch.no_grad()
def _mismatch_pairs(logp: Tensor, sampler_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Train-inference mismatch on the first update (logp = pi_old): mean and max of
    |logp_train - logp_engine|, and k3 with r = pi_train / pi_engine, the unbiased estimate of
    KL(pi_engine || pi_train) for tokens the engine sampled; the means are token-weighted."""
    tokens = mask.sum().double()
    abs_diff = torch.where(mask, (logp - sampler_logp).abs(), 0.0)
    diff = abs_diff.sum().double()
    k3 = torch.where(mask, algo.kl_k3(sampler_logp, logp), 0.0).sum().double()
    out = {"mismatch/logprob_abs_mean": torch.stack([diff, tokens]),
           "mismatch/kl_k3": torch.stack([k3, tokens])}
    if tokens > 0:  # the max over the global batch: reduced with the other max: entries
        out["max:mismatch/logprob_abs_max"] = torch.stack([abs_diff.max().double(), _f64(1.0, logp.device)])
    return out


def split_extrema(pairs: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, float], dict[str, float]]:
    """Separates ``min:``/``max:`` entries (see ``_metric_pairs``) from the (sum, count) pairs."""
    plain, lows, highs = {}, {}, {}
    for name, value in pairs.items():
        if name.startswith("min:"):
            lows[name[4:]] = min(lows.get(name[4:], float("inf")), float(value[0]))
        elif name.startswith("max:"):
            highs[name[4:]] = max(highs.get(name[4:], float("-inf")), float(value[0]))
        else:
            plain[name] = value
    return plain, lows, highs
