"""Fused log-prob + entropy (train/logprobs.py) at TP = 1 against a dense float64 reference.

TP = 2 and 4 run the same comparisons inside the multi-rank launches of
tests/dist/test_trainstep_equivalence.py (tests/dist/scripts/_logprob_checks.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.logprob_entropy import peak_extra_bytes
from megatron_gtpo.train.logprobs import (VocabShard, shifted_token_logprobs, vocab_parallel_argmax,
                                          vocab_parallel_logprob_entropy)


def dense(logits, target, *, temperature=1.0, vocab_size=None, floor=0.0):
    """float64 reference: log_softmax over the (unpadded) vocabulary."""
    z = logits.double()[:, :vocab_size] / temperature
    logsm = torch.log_softmax(z, dim=-1)
    p = logsm.exp()
    logp = logsm.gather(1, target[:, None]).squeeze(1)
    entropy = -(p * (p.clamp(min=floor).log() if floor else logsm)).sum(-1)
    return logp, entropy


def grads(fn, logits, target, w_lp, w_h, **kw):
    x = logits.detach().clone().requires_grad_(True)
    lp, h = fn(x, target, **kw)
    ((w_lp.to(lp.dtype) * lp).sum() + (w_h.to(h.dtype) * h).sum()).backward()
    return lp.detach(), h.detach(), x.grad


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), v=st.integers(2, 70), temperature=st.sampled_from([1.0, 0.6, 1.7]),
       chunk=st.integers(1, 50), pad=st.integers(0, 5), scale=st.sampled_from([0.1, 3.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_float64_values_and_grads_match_dense(n, v, temperature, chunk, pad, scale, seed):
    g = torch.Generator().manual_seed(seed)
    vocab = max(1, v - pad)
    logits = scale * torch.randn(n, v, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (n,), generator=g)
    w_lp, w_h = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    lp, h, gx = grads(lambda x, t: vocab_parallel_logprob_entropy(x, t, shard=VocabShard(vocab_size=vocab), temperature=temperature,
                                                                  chunk_tokens=chunk), logits, target, w_lp, w_h)
    ref_fn = lambda x, t: dense(x, t, temperature=temperature, vocab_size=vocab)  # noqa: E731
    rlp, rh, rgx = grads(ref_fn, logits, target, w_lp, w_h)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-10 * (1 + scale))
    torch.testing.assert_close(h, rh, rtol=0, atol=1e-10 * (1 + scale))
    torch.testing.assert_close(gx, rgx, rtol=0, atol=1e-10 * (1 + scale))
    assert (gx[:, vocab:] == 0).all()  # padding columns get no gradient


def test_gradcheck_both_outputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 7, (5,), generator=g)
    assert torch.autograd.gradcheck(lambda z: vocab_parallel_logprob_entropy(z, t, temperature=0.8, chunk_tokens=2),
                                    (x,))


def test_fp32_and_bf16_inputs_are_computed_in_fp32():
    g = torch.Generator().manual_seed(1)
    logits = 5 * torch.randn(64, 300, generator=g)
    target = torch.randint(0, 300, (64,), generator=g)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 2e-5)):
        x = logits.to(dtype)
        lp, h = vocab_parallel_logprob_entropy(x, target, chunk_tokens=16)
        assert lp.dtype == torch.float32 and h.dtype == torch.float32
        rlp, rh = dense(x.double(), target)  # reference on the same (rounded) values
        torch.testing.assert_close(lp.double(), rlp, rtol=0, atol=tol * 10)
        torch.testing.assert_close(h.double(), rh, rtol=0, atol=tol * 10)
    x = logits.to(torch.bfloat16).requires_grad_(True)
    lp, _ = vocab_parallel_logprob_entropy(x, target)
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()


def test_extreme_rows():
    v = 50
    logits = torch.zeros(3, v, dtype=torch.float64)
    logits[1, 7] = 1e4  # one-hot: entropy 0, logp 0, no NaN from exp underflow
    logits[2] = -1e4  # constant but huge negative: uniform
    lp, h = vocab_parallel_logprob_entropy(logits, torch.tensor([3, 7, 9]))
    torch.testing.assert_close(h, torch.tensor([math.log(v), 0.0, math.log(v)], dtype=torch.float64))
    torch.testing.assert_close(lp, torch.tensor([-math.log(v), 0.0, -math.log(v)], dtype=torch.float64))


def test_entropy_prob_floor_matches_gtpo_reference_and_refuses_grad():
    g = torch.Generator().manual_seed(2)
    logits = 6 * torch.randn(20, 200, generator=g, dtype=torch.float64)
    target = torch.randint(0, 200, (20,), generator=g)
    lp, h = vocab_parallel_logprob_entropy(logits, target, entropy_prob_floor=1e-6, chunk_tokens=3)
    _, rh = dense(logits, target, floor=1e-6)
    _, exact = dense(logits, target)
    torch.testing.assert_close(h, rh, rtol=0, atol=1e-12)
    assert (exact - rh).max() > 1e-6  # the clamp really changes the value for these peaky rows
    x = logits.clone().requires_grad_(True)
    lp, h = vocab_parallel_logprob_entropy(x, target, entropy_prob_floor=1e-6)
    lp.sum().backward()  # log-prob gradient is still available
    assert torch.isfinite(x.grad).all()
    x.grad = None
    lp, h = vocab_parallel_logprob_entropy(x, target, entropy_prob_floor=1e-6)
    with pytest.raises(RuntimeError, match="entropy_prob_floor"):
        h.sum().backward()


def test_logits_are_not_modified_and_bad_arguments_rejected():
    logits = torch.randn(4, 9)
    before = logits.clone()
    vocab_parallel_logprob_entropy(logits, torch.tensor([0, 1, 2, 8]), temperature=0.5, chunk_tokens=1)
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy(logits, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        vocab_parallel_logprob_entropy(logits, torch.zeros(4, dtype=torch.long), chunk_tokens=0)


def test_shifted_alignment_against_causal_lm_convention():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 11, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 11, (2, 6), generator=g)
    lp, h = shifted_token_logprobs(logits, ids, temperature=0.9, chunk_tokens=4)
    logsm = torch.log_softmax(logits / 0.9, dim=-1)
    want = logsm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)  # logits at t predict token t+1
    assert lp.shape == ids.shape and (lp[:, 0] == 0).all() and (h[:, 0] == 0).all()
    torch.testing.assert_close(lp[:, 1:], want)
    torch.testing.assert_close(h[:, 1:], -(logsm.exp() * logsm).sum(-1)[:, :-1])


def test_argmax_single_rank_matches_torch():
    logits = torch.randn(5, 13)
    logits[0, 4] = logits[0, 9] = 100.0  # tie: first index, like torch.argmax
    assert torch.equal(vocab_parallel_argmax(logits), logits.argmax(-1))
    assert torch.equal(vocab_parallel_argmax(logits, vocab_size=8), logits[:, :8].argmax(-1))


def test_inplace_backward_reuses_the_logits_storage():
    g = torch.Generator().manual_seed(5)
    base = 4 * torch.randn(30, 40, generator=g, dtype=torch.float64)
    target = torch.randint(0, 40, (30,), generator=g)
    w = torch.randn(30, generator=g, dtype=torch.float64)
    _, _, ref_grad = grads(lambda x, t: vocab_parallel_logprob_entropy(x, t, chunk_tokens=7), base, target, w, w)
    hidden = base.clone().requires_grad_(True)
    logits = hidden * 1.0  # a non-leaf, like the output layer's result
    lp, h = vocab_parallel_logprob_entropy(logits, target, chunk_tokens=7, inplace_backward=True)
    ((w * lp).sum() + (w * h).sum()).backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, ref_grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.detach(), ref_grad, rtol=0, atol=1e-12)  # the storage now holds it
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()  # a second backward cannot silently read the overwritten logits


def test_extra_memory_is_bounded_by_the_chunk():
    """Forward + backward keep nothing logits-sized besides the logits and their gradient: the
    extra peak is about two fp32 chunk buffers (2 x chunk/N of the shard), unlike a dense path."""
    n, v, chunk = 1024, 2048, 64
    logits = torch.randn(n, v, requires_grad=True)
    target = torch.randint(0, v, (n,))
    shard = logits.numel() * 4

    def fused():
        lp, h = vocab_parallel_logprob_entropy(logits, target, chunk_tokens=chunk)
        (lp.sum() + h.sum()).backward()

    def dense_path():
        lp, h = dense(logits.float(), target)
        (lp.sum() + h.sum()).backward()

    peak, _ = peak_extra_bytes(fused)
    extra = (peak - shard) / shard  # minus the gradient, which any path must produce
    assert extra <= 2 * chunk / n + 0.02, extra
    logits.grad = None

    def fused_inplace():
        lp, h = vocab_parallel_logprob_entropy(logits * 1.0, target, chunk_tokens=chunk, inplace_backward=True)
        (lp.sum() + h.sum()).backward()

    peak_inplace, _ = peak_extra_bytes(fused_inplace)  # the copy `logits * 1.0` stands for the model's output
    assert (peak_inplace - 2 * shard) / shard <= 2 * chunk / n + 0.02  # its grad lands in that copy
    logits.grad = None
    peak_dense, _ = peak_extra_bytes(dense_path)
    assert (peak_dense - shard) / shard >= 2.0  # the measurement sees a naive path's buffers


@pytest.mark.parametrize("pad_logit", [1e4, -1e4, 80.0])
def test_padding_columns_are_ignored_whatever_their_logits(pad_logit):
    """A vocabulary padded from 50 to 128 columns (TP=1), the padding holding large arbitrary
    logits: log-probs, entropies (exact and floored) and greedy ids equal those of the unpadded
    logits bit for bit, and the padding columns get exactly zero gradient."""
    g = torch.Generator().manual_seed(9)
    true_v, padded_v = 50, 128
    real = 5 * torch.randn(40, true_v, generator=g)
    pad = pad_logit * torch.rand(40, padded_v - true_v, generator=g)
    target = torch.randint(0, true_v, (40,), generator=g)
    w = torch.randn(40, generator=g)
    for floor in (0.0, 1e-6):
        x_pad = torch.cat([real, pad], dim=1).requires_grad_(True)
        x_real = real.clone().requires_grad_(True)
        lp, h = vocab_parallel_logprob_entropy(x_pad, target, shard=VocabShard(vocab_size=true_v), temperature=0.7,
                                               entropy_prob_floor=floor)
        lp0, h0 = vocab_parallel_logprob_entropy(x_real, target, temperature=0.7, entropy_prob_floor=floor)
        assert torch.equal(lp, lp0) and torch.equal(h, h0)
        (w * lp).sum().backward()
        (w * lp0).sum().backward()
        assert torch.equal(x_pad.grad[:, :true_v], x_real.grad)
        assert torch.equal(x_pad.grad[:, true_v:], torch.zeros(40, padded_v - true_v))
    padded = torch.cat([real, torch.full((40, padded_v - true_v), 1e4)], dim=1)
    assert torch.equal(vocab_parallel_argmax(padded, vocab_size=true_v), real.argmax(-1))
