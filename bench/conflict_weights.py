"""Benchmark of ``megatron_gtpo.algo.conflict_weights`` (GTPO conflict tokens, spec 5.3-5.4).

Builds a synthetic global batch that looks like real GRPO/GTPO rollouts: per group, completions copy
a shared opening of random length (reasoning-tag boilerplate), then continue with Zipf-distributed
tokens, and end with a shared closing (answer tags) plus EOS; lengths vary and some completions are
truncated at the max length. Times the vectorised implementation (best of --repeats) and a plain
Python loop reference that transcribes the spec. The loop reference is timed on --loop-groups groups
only and extrapolated per token to the full batch; the output says so. The two are checked for
equality on those groups. The last line is one JSON object.

    python bench/conflict_weights.py                 # 64 groups x 8 x 4096, vocab 50k
    python bench/conflict_weights.py --quick         # toy sizes (the suite's smoke run)
    python bench/conflict_weights.py --worst-case    # every completion identical: runs span everything
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.quick import parse_quick  # noqa: E402
from megatron_gtpo.algo import conflict_weights  # noqa: E402

EOS = 2
QUICK = {"groups": 2, "group_size": 4, "seq_len": 64, "vocab": 100, "repeats": 1, "loop_groups": 1}


def make_batch(*, groups: int, group_size: int, seq_len: int, vocab: int, worst_case: bool, seed: int):
    """Returns token_ids [B, T], mask [B, T], advantages [B], group_ids [B] (see module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    batch = groups * group_size
    zipf = 1.0 / torch.arange(1, vocab - 2, dtype=torch.float64) ** 1.1
    cdf = torch.cumsum(zipf / zipf.sum(), 0)
    tokens = torch.searchsorted(cdf, torch.rand(batch, seq_len, generator=gen, dtype=torch.float64)) + 3
    tokens = tokens.clamp(max=vocab - 1)
    base = tokens[::group_size].repeat_interleave(group_size, dim=0)   # one "template" per group
    positions = torch.arange(seq_len)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=gen)
    lengths[torch.rand(batch, generator=gen) < 0.1] = seq_len           # truncated completions
    if worst_case:
        tokens, lengths = base.clone(), torch.full((batch,), seq_len)
    else:
        opening = torch.randint(0, 65, (batch,), generator=gen)
        tokens = torch.where(positions < opening[:, None], base, tokens)
        closing = torch.randint(1, 17, (batch,), generator=gen)
        dist = lengths[:, None] - 1 - positions                          # distance from the last token
        closing_tok = base.gather(1, (seq_len - 1 - dist).clamp(0, seq_len - 1))
        tokens = torch.where((dist >= 0) & (dist < closing[:, None]), closing_tok, tokens)
        has_eos = lengths < seq_len
        tokens[has_eos, lengths[has_eos] - 1] = EOS
    mask = positions < lengths[:, None]
    tokens = torch.where(mask, tokens, 0)
    rewards = torch.randint(0, 2, (batch,), generator=gen).float()
    group_ids = torch.arange(groups).repeat_interleave(group_size)
    advantages = rewards - rewards.view(groups, group_size).mean(1).repeat_interleave(group_size)
    return tokens, mask, advantages, group_ids


def loop_reference(token_ids, mask, advantages, group_ids, *, weight=2.0, early_exit=False):
    """Spec 5.3-5.4 transcribed with Python loops (product overlap); returns lambda as nested lists.

    ``early_exit=False`` evaluates ``raw`` at every position and then takes the initial run (the
    definition, as the reference code's masks do); ``early_exit=True`` stops at each run's end.
    """
    ids, lens = token_ids.tolist(), mask.sum(1).tolist()
    adv, gid = advantages.tolist(), group_ids.tolist()
    lam = [[1.0] * len(row) for row in ids]
    for g in set(gid):
        members = [i for i in range(len(ids)) if gid[i] == g]
        pos = [j for j in members if adv[j] > 0]
        neg = [j for j in members if adv[j] < 0]
        for i in pos + neg:
            w = weight if adv[i] > 0 else 0.0
            for backward in (False, True):
                def at(j, d):
                    return ids[j][lens[j] - 1 - d if backward else d] if d < lens[j] else None
                run = True
                for d in range(lens[i]):
                    tok = at(i, d)
                    raw = any(at(j, d) == tok for j in pos) and any(at(j, d) == tok for j in neg)
                    run = run and raw
                    if run:
                        lam[i][lens[i] - 1 - d if backward else d] *= w
                    elif early_exit:
                        break
    return lam


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64, help="prompts (groups) in the batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt G")
    parser.add_argument("--seq-len", type=int, default=4096, help="max completion tokens T")
    parser.add_argument("--vocab", type=int, default=50_000, help="vocabulary size")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of the vectorised version (best is kept)")
    parser.add_argument("--loop-groups", type=int, default=2, help="groups timed with the loop reference")
    parser.add_argument("--worst-case", action="store_true", help="identical completions: runs cover everything")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_quick(parser, argv, QUICK)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens, mask, adv, gids = make_batch(groups=args.groups, group_size=args.group_size, seq_len=args.seq_len,
                                         vocab=args.vocab, worst_case=args.worst_case, seed=args.seed)
    n_tokens = tokens.numel()
    conflict_weights(tokens, mask, adv, gids)  # warm-up
    best, best_cpu = float("inf"), float("inf")
    for _ in range(args.repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        lam = conflict_weights(tokens, mask, adv, gids)
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - start_cpu)
    sub = slice(0, min(args.loop_groups, args.groups) * args.group_size)
    timings = {}
    for early in (False, True):
        start = time.perf_counter()
        ref = loop_reference(tokens[sub], mask[sub], adv[sub], gids[sub], early_exit=early)
        timings[early] = (time.perf_counter() - start) * n_tokens / tokens[sub].numel()
    agree = torch.equal(torch.tensor(ref, dtype=torch.float32) * mask[sub], lam[sub] * mask[sub])
    conflict = (lam != 1) & mask
    result = {
        "tokens": n_tokens, "masked_tokens": int(mask.sum()), "seconds": best, "tokens_per_s": n_tokens / best,
        "cpu_seconds": best_cpu, "tokens_per_cpu_s": n_tokens / max(best_cpu, 1e-9),
        "loop_groups": min(args.loop_groups, args.groups), "loop_seconds_extrapolated": timings[False],
        "speedup_vs_loop": timings[False] / best, "early_exit_loop_seconds_extrapolated": timings[True],
        "speedup_vs_early_exit_loop": timings[True] / best, "agrees_with_loop": agree,
        "conflict_tokens_per_seq": float(conflict.sum()) / tokens.shape[0],
        "threads": torch.get_num_threads(), "worst_case": args.worst_case,
    }
    print(f"batch: {args.groups} groups x {args.group_size} completions x {args.seq_len} tokens = {n_tokens:,} "
          f"tokens ({result['masked_tokens']:,} masked), vocab {args.vocab}, {torch.get_num_threads()} threads"
          f"{', WORST CASE (identical completions)' if args.worst_case else ''}")
    print(f"vectorised: {best * 1e3:.1f} ms wall (best of {args.repeats}) = "
          f"{result['tokens_per_s'] / 1e6:.1f} M tokens/s; "
          f"{best_cpu * 1e3:.1f} ms CPU time of this process (all threads; robust to a shared machine) = "
          f"{result['tokens_per_cpu_s'] / 1e6:.1f} M tokens per CPU-second; "
          f"{result['conflict_tokens_per_seq']:.1f} conflict tokens per completion")
    print(f"loop reference (raw at every position, as defined): timed on {result['loop_groups']} group(s) and "
          f"EXTRAPOLATED per token to the full batch: {timings[False]:.1f} s -> "
          f"speed-up x{result['speedup_vs_loop']:.0f}")
    print(f"loop reference with early exit at each run's end: EXTRAPOLATED {timings[True]:.2f} s -> speed-up "
          f"x{result['speedup_vs_early_exit_loop']:.1f}; vectorised and loop results on that subset "
          f"{'agree' if agree else 'DISAGREE'}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["agrees_with_loop"] else 1)
