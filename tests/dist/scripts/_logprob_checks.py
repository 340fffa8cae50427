"""Vocab-parallel log-prob/entropy/argmax against a dense float64 reference, run inside a
multi-rank launch: the vocabulary is split over ``tp`` consecutive ranks (several TP groups when
the world is larger). Returns plain records; the pytest side asserts on them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_gtpo.train.logprobs import VocabShard, vocab_parallel_argmax, vocab_parallel_logprob_entropy

N_TOKENS, VOCAB = 29, 96


def _my_group(tp: int):
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + tp))) for start in range(0, world, tp)]
    return groups[rank // tp], rank % tp


def _dense(logits, target, w_lp, w_h, *, temperature, vocab_size, floor):
    full = logits.detach().clone().requires_grad_(True)
    z = full[:, :vocab_size] / temperature
    logsm = torch.log_softmax(z, dim=-1)
    p = logsm.exp()
    logp = logsm.gather(1, target[:, None]).squeeze(1)
    entropy = -(p * (p.clamp(min=floor).log() if floor else logsm)).sum(-1)
    loss = (w_lp * logp).sum() + (0.0 if floor else (w_h * entropy).sum())
    loss.backward()
    return logp.detach(), entropy.detach(), full.grad


# (case, dtype, temperature, true vocab size, chunk, entropy floor, padding logits): columns at ids
# >= the true size are vocabulary padding. "pad_large" fills them with huge arbitrary logits (what
# random padding rows x a sharp output layer give); "pad_only_shard" leaves whole shards padding-only
# at TP >= 2 (as Megatron's 128 x TP padding of a small vocabulary does).
CASES = [
    ("fp64", torch.float64, 1.0, VOCAB, 4, 0.0, None),
    ("fp64_temp_pad", torch.float64, 0.7, VOCAB - 7, 64, 0.0, None),
    ("fp64_floor", torch.float64, 0.9, VOCAB, 5, 1e-6, None),
    ("fp32_temp", torch.float32, 0.6, VOCAB, 8, 0.0, None),
    ("fp64_pad_large", torch.float64, 0.8, VOCAB - 37, 6, 0.0, 1e4),
    ("fp32_pad_large_floor", torch.float32, 1.0, VOCAB - 37, 7, 1e-6, -3e4),
    ("fp64_pad_only_shard", torch.float64, 0.9, 20, 5, 0.0, 5e3),
]


def check_vocab_parallel(tp: int) -> list[dict]:
    group, tp_rank = _my_group(tp)
    shard = VOCAB // tp
    out = []
    for case, dtype, temperature, vocab_size, chunk, floor, pad_logit in CASES:
        g = torch.Generator().manual_seed(3)  # same full tensors on every rank
        logits = (4.0 * torch.randn(N_TOKENS, VOCAB, generator=g, dtype=torch.float64))
        logits[0, :] = 0.0  # uniform row: entropy = log V exactly
        logits[1, 5] = 60.0  # near one-hot row: tiny probabilities everywhere else
        if pad_logit is not None:  # arbitrary large padding logits (up to |pad_logit|)
            logits[:, vocab_size:] = pad_logit * torch.rand(N_TOKENS, VOCAB - vocab_size, generator=g,
                                                            dtype=torch.float64)
        target = torch.randint(0, vocab_size, (N_TOKENS,), generator=g)
        w_lp = torch.randn(N_TOKENS, generator=g, dtype=torch.float64)
        w_h = torch.randn(N_TOKENS, generator=g, dtype=torch.float64)
        ref_lp, ref_h, ref_grad = _dense(logits, target, w_lp, w_h, temperature=temperature,
                                         vocab_size=vocab_size, floor=floor)
        local = logits[:, tp_rank * shard:(tp_rank + 1) * shard].to(dtype).clone().requires_grad_(True)
        lp, h = vocab_parallel_logprob_entropy(local, target, shard=VocabShard(group, tp_rank * shard, vocab_size),
                                               temperature=temperature,
                                               chunk_tokens=chunk, entropy_prob_floor=floor)
        loss = (w_lp.to(lp.dtype) * lp).sum() + (0.0 if floor else (w_h.to(h.dtype) * h).sum())
        loss.backward()
        lp, h = lp.detach(), h.detach()
        want_grad = ref_grad[:, tp_rank * shard:(tp_rank + 1) * shard]
        out.append({"tp": tp, "case": case, "logp_err": float((lp.double() - ref_lp).abs().max()),
                    "entropy_err": float((h.double() - ref_h).abs().max()),
                    "grad_err": float((local.grad.double() - want_grad).abs().max()),
                    "grad_scale": float(want_grad.abs().max()), "dtype": str(dtype)})
    # argmax: planted maxima in different shards, and an exact tie between two shards
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, VOCAB, generator=g)
    logits[0, VOCAB - 1] = 50.0
    logits[1, 0] = 50.0
    logits[2, shard - 1] = 50.0
    logits[2, VOCAB - 1] = 50.0  # tie across shards: lowest id wins like torch.argmax
    got = vocab_parallel_argmax(logits[:, tp_rank * shard:(tp_rank + 1) * shard], group=group,
                                vocab_start=tp_rank * shard)
    out.append({"tp": tp, "case": "argmax", "argmax_ok": torch.equal(got, logits.argmax(-1))})
    # argmax over a padded vocabulary: padding columns hold the largest logits but are never chosen
    for vocab_size in (VOCAB - 37, 20):  # a partly padded last shard; padding-only shards at TP >= 2
        padded = logits.clone()
        padded[:, vocab_size:] = 1e4
        got = vocab_parallel_argmax(padded[:, tp_rank * shard:(tp_rank + 1) * shard], group=group,
                                    vocab_start=tp_rank * shard, vocab_size=vocab_size)
        out.append({"tp": tp, "case": f"argmax_pad{vocab_size}",
                    "argmax_ok": torch.equal(got, logits[:, :vocab_size].argmax(-1))})
    return out
