"""Sampled-token log-prob and full-vocabulary entropy from vocabulary-sharded logits, in one pass.

With tensor parallelism the output layer leaves each TP rank holding ``logits[:, v0:v0 + V/TP]``.
Gathering the vocabulary would cost TP x the shard; keeping the softmax for backward (Megatron's
``vocab_parallel_cross_entropy``, verl's entropy) costs one more shard. Here nothing logits-sized is
kept besides the logits themselves:

    forward   m      = max_v z                         one read pass, 1 all-reduce(MAX) of [N]
              for each chunk of rows (two chunk-sized scratch buffers, cache-sized):
                  e  = exp(z - m);  S = sum e;  D = sum e (z - m);  z_target - m
              all-reduce(SUM) of the stacked [3, N] statistics
              log p(target) = (z_target - m) - log S          H = log S - D / S
    backward  recompute p = exp(z - lse) chunk by chunk (no communication):
              dlogp/dz = onehot - p        dH/dz = -p (log p + H)
              written into a new gradient buffer, or (``inplace_backward``, what the train step
              uses) over the logits themselves, chunk by chunk after they were read

Extra memory is two ``chunk x V/TP`` scratch buffers (32 MiB by default, whatever the token
count): 0.02 x the logits shard at 8192 tokens x 49152 vocabulary, against >= 4 x for the
gather-and-log-softmax path (bench/logprob_entropy.py). The price is a second exp pass in backward;
on CPU the cache-sized chunks make the whole forward + backward about as fast as Megatron's
log-prob-only ``vocab_parallel_cross_entropy``.

``z`` is ``logits / temperature``: the distribution the rollout engine sampled from, so the ratio
against vLLM's log-probs and GTPO's entropy both refer to that distribution; the gradient carries
the 1/temperature factor. All arithmetic is in fp32 (fp64 when the logits are fp64); bf16 logits are
upcast one chunk at a time.

Entropy: natural log, exact (no clamp). The GTPO reference code computes ``<H>`` as
``-sum p log(max(p, 1e-6))``; the clamp only guards its naive ``log(softmax)`` against log(0). Here
``log p`` comes from log-sum-exp and is always finite, so the default is the exact entropy. The clamp
makes ``H`` smaller by ``sum_{p<eps} p log(eps/p)`` (at most ``V * eps / e``, 0.018 nats at V = 49152;
typically far less). ``entropy_prob_floor=1e-6`` reproduces the reference value for the entropy
filter (no-grad use only; it costs one more chunk pass and all-reduce).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}
"""Default chunk size in logits elements per device type (rows = elements // (V/TP), at least 1).
CPU: two fp32 scratch buffers of 16 MiB each, whatever the token count (85 rows at V/TP = 49152),
small enough that the passes over one chunk hit the CPU cache (64-128 rows measured 1.5-2x faster
than 256), large enough that per-chunk Python overhead stays negligible. CUDA: 256 MiB buffers
(1365 rows at V/TP = 49152), so each chunk's kernels fill the GPU and launches do not dominate."""


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's logit columns sit in the (possibly padded) vocabulary."""

    group: object = None
    """The tensor-parallel process group (None or size 1: no communication)."""
    start: int = 0
    """Global id of this shard's first column (``tp_rank * V/TP``)."""
    vocab_size: int | None = None
    """True vocabulary size; columns at global ids >= it are padding and excluded (None: none)."""


@dataclass(frozen=True)
class _Pass:
    """The resolved options of one fused pass (handed to the autograd function as one argument)."""

    group: object
    vocab_start: int
    n_valid: int
    temperature: float
    chunk_tokens: int
    floor: float
    inplace: bool


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _all_reduce(tensor: torch.Tensor, op, group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)


class _Scratch:
    """Two ``chunk x n_valid`` buffers reused for every chunk of one call. Fresh chunk-sized
    allocations per chunk would be returned to the OS and page-faulted back in each time (tens of
    MB per chunk), which costs more than the arithmetic on CPU."""

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device):
        self.a = torch.empty(rows, cols, dtype=dtype, device=device)
        self.b = torch.empty(rows, cols, dtype=dtype, device=device)

    def shifted(self, logits, rows: slice, n_valid: int, shift: torch.Tensor, temperature: float) -> torch.Tensor:
        """``logits[rows, :n_valid] / T - shift[rows]`` written into buffer ``a`` (fp32/fp64)."""
        out = self.a[:rows.stop - rows.start]
        z = logits[rows, :n_valid]
        if temperature == 1.0:
            torch.sub(z, shift[rows, None], out=out)
        else:  # z / T - shift = (z - shift * T) / T: two passes, no extra buffer
            torch.sub(z, shift[rows, None] * temperature, out=out).mul_(1.0 / temperature)
        return out


class VocabParallelLogProbEntropy(torch.autograd.Function):
    """``(logits [N, V/TP], target [N]) -> (log p(target) [N], entropy [N])`` over the full vocabulary.

    ``target`` holds global vocabulary ids; each rank's shard covers ``[vocab_start, vocab_start +
    n_valid)`` where ``n_valid`` excludes vocabulary padding columns (which get zero probability and
    zero gradient); a shard made only of padding (``n_valid = 0``, e.g. vocabulary 128 padded to
    256 at TP=2) contributes nothing but still joins the reductions. Every rank of ``group`` must
    call with the same ``N`` and chunking.
    """

    @staticmethod
    def forward(ctx, logits, target, opts: _Pass):
        group, vocab_start, n_valid, temperature = opts.group, opts.vocab_start, opts.n_valid, opts.temperature
        chunk_tokens, entropy_prob_floor, inplace_backward = opts.chunk_tokens, opts.floor, opts.inplace
        cdtype = _compute_dtype(logits.dtype)
        n = logits.shape[0]
        # max_v (z / T) = max_v z / T for T > 0: one read pass, no buffer.
        if n_valid:
            m = logits[:, :n_valid].amax(dim=-1).to(cdtype).mul_(1.0 / temperature)
        else:  # padding-only shard: the other ranks hold every real column
            m = torch.full((n,), -math.inf, dtype=cdtype, device=logits.device)
        _all_reduce(m, dist.ReduceOp.MAX, group)
        stats = torch.zeros(3, n, dtype=cdtype, device=logits.device)  # S, D, z_target - m
        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < n_valid)
        local_t = torch.where(in_shard, local_t, torch.zeros_like(local_t))
        scratch = _Scratch(min(chunk_tokens, n), n_valid, cdtype, logits.device)
        for start in range(0, n if n_valid else 0, chunk_tokens):
            rows = slice(start, min(start + chunk_tokens, n))
            shifted = scratch.shifted(logits, rows, n_valid, m, temperature)  # z - m
            e = torch.exp(shifted, out=scratch.b[:shifted.shape[0]])
            stats[0, rows] = e.sum(dim=-1)
            stats[1, rows] = torch.linalg.vecdot(e, shifted)
            picked = shifted.gather(1, local_t[rows, None]).squeeze(1)
            stats[2, rows] = torch.where(in_shard[rows], picked, torch.zeros_like(picked))
        _all_reduce(stats, dist.ReduceOp.SUM, group)
        log_s = stats[0].log()
        logp = stats[2] - log_s
        entropy = log_s - stats[1] / stats[0]
        lse = m + log_s
        if entropy_prob_floor > 0.0:
            entropy = entropy - _floor_correction(logits, lse, scratch, group, n_valid, temperature,
                                                  chunk_tokens, entropy_prob_floor)
        del scratch
        ctx.save_for_backward(logits, local_t, in_shard, lse, entropy)
        ctx.n_valid, ctx.temperature, ctx.chunk_tokens = n_valid, temperature, chunk_tokens
        ctx.floored, ctx.inplace = entropy_prob_floor > 0.0, inplace_backward
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, local_t, in_shard, lse, entropy = ctx.saved_tensors
        if grad_entropy is not None and ctx.floored:
            raise RuntimeError("entropy_prob_floor > 0 gives a no-grad statistic; use the exact "
                               "entropy (entropy_prob_floor=0) for an entropy bonus")
        if grad_logp is None and grad_entropy is None:
            return None, None, None
        n, n_valid, cdtype = logits.shape[0], ctx.n_valid, lse.dtype
        # In place: each chunk's logits are copied into scratch before its gradient rows overwrite
        # them, so the gradient can reuse the logits' storage (no second logits-sized buffer).
        grad = logits if ctx.inplace else torch.empty_like(logits)
        if n_valid < logits.shape[1]:
            grad[:, n_valid:] = 0
        # dL/dz = g_lp (onehot - p) - g_H p (log p + H) = -p (a + g_H log p) + g_lp onehot,
        # a = g_lp + g_H H per row; 1/T (d/dlogits = d/dz / T) is folded into the row scales.
        inv_t = 1.0 / ctx.temperature
        g_lp = grad_logp.to(cdtype) * inv_t if grad_logp is not None else torch.zeros_like(lse)
        g_h = grad_entropy.to(cdtype) * inv_t if grad_entropy is not None else None
        neg_a = -(g_lp if g_h is None else g_lp + g_h * entropy)
        hit = torch.where(in_shard, g_lp, torch.zeros_like(g_lp))
        scratch = _Scratch(min(ctx.chunk_tokens, n), n_valid, cdtype, logits.device)
        for start in range(0, n if n_valid else 0, ctx.chunk_tokens):
            rows = slice(start, min(start + ctx.chunk_tokens, n))
            logp_all = scratch.shifted(logits, rows, n_valid, lse, ctx.temperature)
            p = torch.exp(logp_all, out=scratch.b[:logp_all.shape[0]])
            out = grad[rows, :n_valid]
            if g_h is None:
                torch.mul(p, neg_a[rows, None], out=out)
            else:  # -(a + g_H log p), in place over log p, then times p straight into the gradient
                torch.addcmul(neg_a[rows, None], logp_all, -g_h[rows, None], out=logp_all)
                torch.mul(logp_all, p, out=out)
            out.scatter_add_(1, local_t[rows, None], hit[rows, None].to(out.dtype))
        return grad, None, None


def _floor_correction(logits, lse, scratch: _Scratch, group, n_valid, temperature, chunk_tokens, floor):
    """``sum_{p < floor} p log(floor / p)`` per row: the amount by which clamping p at ``floor``
    inside the log lowers the entropy (GTPO reference semantics)."""
    log_floor = math.log(floor)
    corr = torch.zeros(logits.shape[0], dtype=lse.dtype, device=logits.device)
    for start in range(0, logits.shape[0], chunk_tokens):
        rows = slice(start, min(start + chunk_tokens, logits.shape[0]))
        logp_all = scratch.shifted(logits, rows, n_valid, lse, temperature)
        p = torch.exp(logp_all, out=scratch.b[:logp_all.shape[0]])
        gap = logp_all.neg_().add_(log_floor).clamp_(min=0.0)  # log(floor / p) where p < floor
        corr[rows] = torch.linalg.vecdot(p, gap)
    _all_reduce(corr, dist.ReduceOp.SUM, group)
    return corr


def vocab_parallel_logprob_entropy(logits: torch.Tensor, target: torch.Tensor, *, shard: VocabShard = VocabShard(),
                                   temperature: float = 1.0, chunk_tokens: int | None = None,
                                   entropy_prob_floor: float = 0.0,
                                   inplace_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``target`` and entropy (nats) of ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V/TP]`` this rank's vocabulary shard (any float dtype; not modified).
        target: ``[...]`` global token ids.
        shard: the TP group, this shard's first global id and the true vocabulary size.
        temperature: the sampling temperature of the rollout engine (> 0).
        chunk_tokens: rows processed at a time (None: ``CHUNK_ELEMENTS[device] // (V/TP)``); extra
            memory is two ``chunk x V/TP`` fp32 buffers, independent of the number of tokens.
        entropy_prob_floor: 0 for the exact entropy; e.g. 1e-6 for the GTPO reference's clamped
            ``<H>`` (then the entropy output must not receive a gradient).
        inplace_backward: write the gradient into the logits' own storage (as Megatron's
            ``vocab_parallel_cross_entropy`` does with its softmax). Saves one logits-sized buffer
            in backward; only for callers whose logits have no other use after this call (the
            train step's loss). A second backward through the same graph then fails loudly.

    Returns ``(logp, entropy)``, each shaped like ``target``, fp32 (fp64 for fp64 logits).
    Differentiable in both outputs (the log-prob for the policy loss, the entropy for a bonus).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    width, vocab_size = logits.shape[-1], shard.vocab_size
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    n_valid = width if vocab_size is None else max(0, min(width, vocab_size - shard.start))
    if chunk_tokens is None:
        budget = CHUNK_ELEMENTS["cuda" if logits.is_cuda else "cpu"]
        chunk_tokens = max(1, budget // max(n_valid, 1))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    opts = _Pass(group=shard.group, vocab_start=shard.start, n_valid=n_valid, temperature=float(temperature),
                 chunk_tokens=int(chunk_tokens), floor=float(entropy_prob_floor), inplace=bool(inplace_backward))
    out = VocabParallelLogProbEntropy.apply(logits.reshape(-1, width), target.reshape(-1), opts)
    return out[0].view(target.shape), out[1].view(target.shape)


def shifted_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob and entropy of a causal LM's next-token predictions.

    ``logits`` ``[b, s, V/TP]`` (position t predicts token t + 1), ``input_ids`` ``[b, s]``.
    Returns ``(logp, entropy)`` ``[b, s]`` aligned with the *predicted* token: ``logp[:, t]`` is the
    log-prob of ``input_ids[:, t]`` given the tokens before it; column 0 (no prediction) is 0.
    The whole ``[b*s, V/TP]`` view is processed (slicing off the last position would copy the
    logits); the wasted last-row work is 1/s of the total. Keyword arguments go to
    :func:`vocab_parallel_logprob_entropy`.
    """
    targets = torch.roll(input_ids, shifts=-1, dims=1)  # target of position t is token t + 1
    logp, entropy = vocab_parallel_logprob_entropy(logits, targets, **kwargs)
    zeros = logp.new_zeros(logp.shape[0], 1)
    return torch.cat([zeros, logp[:, :-1]], dim=1), torch.cat([zeros, entropy[:, :-1]], dim=1)


@dataclass(kw_only=True)
class LogprobSettings:
    """How a model's logits become log-probs and entropies on this rank (fixed for a run)."""

    tp_group: object
    """Tensor-parallel process group (the vocabulary is sharded over it)."""
    tp_rank: int
    """This rank's index in ``tp_group``: its shard starts at ``tp_rank * V/TP``."""
    vocab_size: int | None
    """True vocabulary size (excludes padding columns); None = the logits' full width x TP."""
    temperature: float
    """Rollout sampling temperature; logits are divided by it."""
    chunk_tokens: int | None
    """Rows per chunk of the fused log-prob/entropy pass (None: automatic, ``CHUNK_ELEMENTS``)."""

    def token_stats(self, logits: torch.Tensor, input_ids: torch.Tensor, *, entropy_prob_floor: float = 0.0,
                    inplace_backward: bool = False, temperature: float | None = None):
        """``(logp, entropy)`` ``[mb, s]`` aligned with the predicted tokens (column 0 is 0), at the
        sampling temperature unless ``temperature`` is given (GTPO's raw-logit entropy)."""
        shard = VocabShard(group=self.tp_group, start=self.tp_rank * logits.shape[-1], vocab_size=self.vocab_size)
        return shifted_token_logprobs(logits, input_ids, shard=shard,
                                      temperature=self.temperature if temperature is None else temperature,
                                      chunk_tokens=self.chunk_tokens, entropy_prob_floor=entropy_prob_floor,
                                      inplace_backward=inplace_backward)


@torch.no_grad()
def vocab_parallel_argmax(logits: torch.Tensor, *, group=None, vocab_start: int = 0,
                          vocab_size: int | None = None) -> torch.Tensor:
    """Greedy token ``[...]`` (global ids) from vocabulary-sharded ``logits`` ``[..., V/TP]``.

    Each rank reduces its shard to (max, argmax); only those two numbers per row are gathered. Ties
    go to the lowest global id, as ``torch.argmax`` on the full vocabulary does. Columns at ids
    ``>= vocab_size`` (padding) are never chosen; a padding-only shard offers -inf.
    """
    shard = logits.shape[-1]
    n_valid = shard if vocab_size is None else max(0, min(shard, vocab_size - vocab_start))
    if n_valid:
        value, index = logits[..., :n_valid].float().max(dim=-1)
    else:
        value = logits.new_full(logits.shape[:-1], -math.inf, dtype=torch.float32)
        index = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    index = index + vocab_start
    if group is None or dist.get_world_size(group) == 1:
        return index
    size = dist.get_world_size(group)
    # gathered along dim 0 as [size * n] (the layout gloo and NCCL both accept), then split by rank
    values = value.new_empty(size * value.numel())
    indices = index.new_empty(size * index.numel())
    dist.all_gather_into_tensor(values, value.reshape(-1).contiguous(), group=group)
    dist.all_gather_into_tensor(indices, index.reshape(-1).contiguous(), group=group)
    values, indices = values.view(size, *value.shape), indices.view(size, *index.shape)
    best = values.argmax(dim=0, keepdim=True)  # first maximum = lowest rank = lowest id
    return indices.gather(0, best).squeeze(0)
