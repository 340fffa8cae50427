"""The distributed loss adapter: one micro-batch's logits -> ``algo.compute_loss`` -> Megatron.

Megatron's schedule calls ``loss_func(output_tensor)`` on the last pipeline stage for every
micro-batch. Here that function:

1. turns the TP-sharded logits ``[mb, s, V/TP]`` into per-token log-probs and entropies with the
   fused vocab-parallel pass (``train/logprobs.py``),
2. moves them to the completion view ``[mb, T]`` that ``algo/`` expects (``MicroBatch.take``),
3. calls the pure ``algo.compute_loss`` with this micro-batch's rows of the per-sequence inputs
   (advantages, GTPO lambda and scales) that were prepared ONCE for the whole global batch, and with
   the GLOBAL normalisers (masked tokens and completions of the global batch), so the per-micro-batch
   losses of all micro-batches on all DP ranks add up to the single-process loss; GTPO's rows are
   shaped here first (``algo.shape_rows``: entropy filter and gamma shift) with the ``<H>_i`` of this
   very forward at the first update (pi_old: the weights before any update), kept for the others,
4. multiplies by the one Megatron rescale factor (``train/step.py::megatron_loss_scale``).

Metrics leave as ``name -> tensor([sum, count])`` so that they can be summed over micro-batches and
DP ranks (``parallel/collectives.py``); min/max metrics travel separately.

One pass (the default, ``StepInputs.old_logp`` None): at mu > 1 pi_old is the detached log-prob of
the first update's own forward, kept per micro-batch for the later updates; the step's separate
no-grad forward (``StepSettings.pre_pass``) hands ``old_logp`` and shaped rows in instead.

Per micro-batch, also: the train-inference mismatch weights (``algo.mismatch_correction``; at
mu = 1 from this forward's detached log-probs, at mu > 1 once from pi_old at the first update and
kept for the others), the parts of the D2 surrogate decomposition only the loss sees (its KL
part and the share due to the mismatch weights, first update) and, at mu > 1, the D4 overshoot
counts: each row's detached log-ratio of inner step k is kept and compared at step k + 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

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
                    inplace_backward: bool = False, temperature: float | None = None):
        """``(logp, entropy)`` ``[mb, s]`` aligned with the predicted tokens (column 0 is 0), at the
        sampling temperature unless ``temperature`` is given (GTPO's raw-logit entropy)."""
        shard = VocabShard(group=self.tp_group, start=self.tp_rank * logits.shape[-1], vocab_size=self.vocab_size)
        return shifted_token_logprobs(logits, input_ids, shard=shard,
                                      temperature=self.temperature if temperature is None else temperature,
                                      chunk_tokens=self.chunk_tokens, entropy_prob_floor=entropy_prob_floor,
                                      inplace_backward=inplace_backward)


@dataclass
class RowCache:
    """Tensors of one step kept from one inner update to the next, keyed by micro-batch (``id(mb)``:
    the step reuses the same MicroBatch objects for every update)."""

    is_weights: dict[int, Tensor] = field(default_factory=dict)
    """mu > 1: the mismatch weights of the first update ([mb, width]), reused by the others."""
    log_ratio: dict[int, Tensor] = field(default_factory=dict)
    """mu > 1: detached ``logp - old_logp`` [mb, width] of the previous update (D4 overshoot)."""
    old_logp: dict[int, Tensor] = field(default_factory=dict)
    """One pass, mu > 1: pi_old, the detached log-probs [mb, width] of the first update's forward."""
    mean_entropy: dict[int, Tensor] = field(default_factory=dict)
    """One pass, GTPO: the rows' <H>_i [mb] of the first update's forward (the step gathers them for
    the whole-batch metrics and diagnostics; later updates reuse them)."""


ZERO_WHEN_EMPTY = ("bias/clip_overshoot_rate",)
"""Rate metrics whose denominator may be empty in a step (no favoured-clipped token): logged as 0."""


@dataclass(kw_only=True)
class StepInputs:
    """Everything the loss of any micro-batch on this rank needs during one optimizer step."""

    spec: AlgoSpec
    """The resolved algorithm."""
    prepared: PreparedBatch
    """Output of ``algo.prepare_groups`` for the whole global batch (on the device); GTPO rows still
    ``needs_entropy`` until the step shapes the whole batch after the first update (one pass), or
    already shaped by ``algo.prepare_batch`` (pre-pass)."""
    mask: Tensor  # [B, T] bool
    """Completion mask of the whole global batch (on the device)."""
    num_tokens: float
    """Masked (loss) tokens of the whole global batch: the token-mean normaliser."""
    num_seqs: float
    """Completions in the whole global batch: the seq-mean normaliser."""
    local: slice
    """This DP rank's rows of the global batch: the rows of ``old_logp``/``ref_logp`` below."""
    old_logp: Tensor | None  # [local B, T]
    """pi_old log-probs of this rank's rows from the pre-pass when mu > 1; None: one pass (update 0:
    ratio = exp(logp - logp.detach()); mu > 1: later updates use ``cache.old_logp``)."""
    ref_logp: Tensor | None  # [local B, T]
    """Reference-model log-probs of this rank's rows for the KL term, or None."""
    sampler_logp: Tensor | None  # [B, T]
    """Rollout engine log-probs: the train-inference mismatch metrics and weights (first update)."""
    scale: float
    """Megatron rescale factor from ``megatron_loss_scale``."""
    metric_weight: float
    """1 / (micro-batches x DP ranks): summing this over all micro-batches gives 1, so a summed
    metric (the loss) survives the (sum, count) reduction unchanged."""
    update: int = 0
    """Index of the inner update (0 .. mu-1) this loss belongs to."""
    cache: RowCache = field(default_factory=lambda: RowCache())
    """Per-micro-batch tensors kept across the mu updates of one step (shared by ``replace`` copies)."""

    def local_rows(self, tensor: Tensor | None, rows: Tensor, width: int) -> Tensor | None:
        """``tensor[rows - local.start, :width]`` for a tensor that holds only this rank's rows."""
        return None if tensor is None else tensor[rows - self.local.start, :width]


def micro_batch_loss(inputs: StepInputs, settings: LogprobSettings, mb: MicroBatch, logits: Tensor):
    """Loss of one micro-batch, already rescaled for Megatron, and its metric pairs."""
    rows, width = mb.rows, mb.width
    prepared = inputs.prepared.rows(rows)
    floor = _entropy_floor(inputs, settings, prepared)
    # The logits (the output layer's fresh output) have no other consumer: their storage can take
    # the gradient, so backward never holds two logits-sized buffers.
    logp_seq, ent_seq = settings.token_stats(logits, mb.input_ids, inplace_backward=True, entropy_prob_floor=floor)
    mask = inputs.mask[rows, :width]
    if prepared.needs_entropy:  # one pass, GTPO: filter and shift from these rows' own <H>_i
        prepared = algo.shape_rows(inputs.spec, prepared, _row_entropy(inputs, settings, mb, logits, ent_seq))
    logp = mb.take(logp_seq)
    old_logp = _old_logp(inputs, mb, logp)
    pairs: dict[str, Tensor] = {}
    tokens = algo.TokenInputs(logp=logp, mask=mask, old_logp=old_logp,
                              ref_logp=inputs.local_rows(inputs.ref_logp, rows, width),
                              is_weights=_mismatch_weights(inputs, mb, logp, old_logp, mask, pairs))
    loss, metrics = algo.compute_loss(inputs.spec, tokens, prepared, num_tokens=inputs.num_tokens,
                                      num_seqs=inputs.num_seqs)
    pairs.update(_metric_pairs(metrics, mask))
    pairs["loss"] = torch.stack([loss.detach().double(), _f64(inputs.metric_weight, loss.device)])
    if not inputs.spec.needs_mean_entropy:  # GTPO: entropy/mean comes with the whole batch's <H>_i
        mean_h = algo.completion_mean_entropy(mb.take(ent_seq.detach()), mask)
        pairs["entropy/mean"] = torch.stack([mean_h.sum().double(), _f64(mask.shape[0], mask.device)])
    if inputs.update == 0 and inputs.sampler_logp is not None:
        pairs.update(_mismatch_pairs(tokens.logp.detach(), inputs.sampler_logp[rows, :width], mask))
    if inputs.update == 0:
        pairs.update(_surrogate_pairs(inputs, tokens, prepared))
    elif old_logp is not None:
        pairs.update(_overshoot_pairs(inputs, mb, tokens, prepared))
    return loss * inputs.scale, pairs


def _entropy_floor(inputs: StepInputs, settings: LogprobSettings, prepared: PreparedBatch) -> float:
    """The probability floor of the training forward's entropy output: GTPO's <H>_i statistic
    (``spec.entropy_prob_floor``) when these rows are shaped from this forward and the statistic is
    at the sampling temperature (the floor changes the entropy output only, never log p or its
    gradient); 0 (the exact entropy) otherwise."""
    spec = inputs.spec
    same = spec.entropy_temperature(settings.temperature) == settings.temperature
    return spec.entropy_prob_floor if prepared.needs_entropy and inputs.update == 0 and same else 0.0


@torch.no_grad()
def _row_entropy(inputs: StepInputs, settings: LogprobSettings, mb: MicroBatch, logits: Tensor,
                 ent_seq: Tensor) -> Tensor:
    """GTPO's <H>_i [mb] of pi_old: computed from this forward at the first update (the floored
    entropy output, or one more no-grad pass at the statistic's own temperature, as ``forward_stats``
    does), cached for the later updates. Taken in the global batch's width, like the pre-pass, so
    the values are the same bit for bit."""
    cache = inputs.cache.mean_entropy
    if inputs.update > 0:
        return cache[id(mb)]
    spec = inputs.spec
    temperature = spec.entropy_temperature(settings.temperature)
    if temperature != settings.temperature:
        _, ent_seq = settings.token_stats(logits.detach(), mb.input_ids, entropy_prob_floor=spec.entropy_prob_floor,
                                          temperature=temperature)
    view = dataclasses.replace(mb, width=inputs.mask.shape[1])
    cache[id(mb)] = algo.completion_mean_entropy(view.take(ent_seq.detach().float()), inputs.mask[mb.rows])
    return cache[id(mb)]


def _old_logp(inputs: StepInputs, mb: MicroBatch, logp: Tensor) -> Tensor | None:
    """pi_old of this micro-batch [mb, width]: the pre-pass's rows, or (one pass, mu > 1) None at the
    first update, whose detached log-probs are kept as pi_old for the later ones."""
    if inputs.old_logp is not None:
        return inputs.local_rows(inputs.old_logp, mb.rows, mb.width)
    if not inputs.spec.needs_old_logp:
        return None
    if inputs.update == 0:
        inputs.cache.old_logp[id(mb)] = logp.detach()
        return None
    return inputs.cache.old_logp[id(mb)]


@torch.no_grad()
def _mismatch_weights(inputs: StepInputs, mb: MicroBatch, logp: Tensor, old_logp: Tensor | None, mask: Tensor,
                      pairs: dict[str, Tensor]) -> Tensor | None:
    """The mismatch weights of this micro-batch (None without a correction); their spread metrics
    go into ``pairs`` at the first update. pi_old is ``old_logp`` (mu > 1) or this forward (mu = 1)."""
    spec = inputs.spec
    if spec.mismatch_correction == "none":
        return None
    if inputs.update > 0:
        return inputs.cache.is_weights[id(mb)]
    rows, width = mb.rows, mb.width
    train_logp = old_logp if old_logp is not None else logp.detach()
    weights, metrics = algo.mismatch_weights(spec, train_logp, inputs.sampler_logp[rows, :width], mask)
    pairs.update(_metric_pairs(metrics, mask))
    if spec.mu > 1:
        inputs.cache.is_weights[id(mb)] = weights
    return weights


@torch.no_grad()
def _surrogate_pairs(inputs: StepInputs, tokens, prepared: PreparedBatch) -> dict[str, Tensor]:
    """D2 parts only the loss sees (first update; summed over micro-batches and DP like the loss):
    the KL part ``kl_beta * aggregate(seq_scale k3)`` and the share of the loss due to the mismatch
    weights, ``sum_i A_i sum_t omega_{i,t} (1 - w_{i,t})`` (``train/diagnostics.py`` adds them up)."""
    spec, mask, out = inputs.spec, tokens.mask, {}
    norms = {"num_tokens": inputs.num_tokens, "num_seqs": inputs.num_seqs}
    weight = _f64(inputs.metric_weight, mask.device)
    if tokens.ref_logp is not None and spec.kl_beta > 0:
        zero = torch.zeros((), dtype=tokens.logp.dtype, device=mask.device)
        kl = algo.kl_k3(torch.where(mask, tokens.logp.detach(), zero), torch.where(mask, tokens.ref_logp, zero))
        out["bias/surrogate_kl_term"] = torch.stack([algo.kl_penalty(spec, kl, mask, prepared, **norms), weight])
    if tokens.is_weights is not None:
        plain = algo.token_omega(spec, mask, prepared, **norms)
        weighted = algo.token_omega(spec, mask, prepared, is_weights=tokens.is_weights, **norms)
        term = ((plain - weighted) * prepared.advantages.double()[:, None]).sum()
        out["bias/surrogate_is_term"] = torch.stack([term, weight])
    return out


@torch.no_grad()
def _overshoot_pairs(inputs: StepInputs, mb: MicroBatch, tokens, prepared: PreparedBatch) -> dict[str, Tensor]:
    """D4 at inner update k >= 1: of the tokens in the advantage-favoured clipped region at update
    k - 1 (>= 1: at update 0 the ratio is 1), the share whose |log rho| grew by update k."""
    zero = torch.zeros((), dtype=tokens.logp.dtype, device=tokens.mask.device)
    log_ratio = torch.where(tokens.mask, tokens.logp.detach() - tokens.old_logp, zero)
    previous = inputs.cache.log_ratio.pop(id(mb), None)
    if inputs.update < inputs.spec.mu - 1:
        inputs.cache.log_ratio[id(mb)] = log_ratio
    if previous is None:
        return {}
    counts = algo.clip_overshoot(inputs.spec, previous, log_ratio, prepared, tokens.mask, is_weights=tokens.is_weights)
    return {"bias/clip_overshoot_rate": torch.stack([counts.overshoot, counts.favoured]).double()}


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
