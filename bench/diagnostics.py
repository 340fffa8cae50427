"""Benchmark of the per-step bias diagnostics D1 and D2 (``megatron_gtpo.algo.prefix`` and
``.diagnostics``) on CPU, on the same synthetic batches as ``bench/conflict_weights.py`` (shared
opening and closing per group, Zipf tokens, varied lengths; ``--worst-case``: identical completions,
so every trie node is shared to the full length).

Times (CPU time of the calling thread, best and median of --repeats, single-threaded unless --threads): the loss's token weights
(``token_omega``), the trie (``shared_prefixes``), the D1 metrics (``prefix_bias_metrics`` with
GTPO's conflict runs) and the D2 decomposition, plus GTPO's ``prepare_batch`` for scale (it runs every
step anyway). The last line is one JSON object.

    python bench/diagnostics.py                      # 64 groups x 8 x 1024, vocab 50k
    python bench/diagnostics.py --worst-case
    python bench/diagnostics.py --quick              # toy sizes (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.conflict_weights import make_batch  # noqa: E402
from bench.quick import parse_quick  # noqa: E402

from megatron_gtpo.algo import (AlgoConfig, prefix_bias_metrics, prepare_batch, shared_prefixes,  # noqa: E402
                                surrogate_decomposition, token_omega)

QUICK = {"groups": 2, "group_size": 4, "seq_len": 64, "vocab": 100, "repeats": 1}


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """(best ms, median ms, last result) of this thread's CPU time: on a shared, oversubscribed
    machine wall-clock time mostly measures the other processes (torch runs single-threaded here, so
    all of the work is on this thread)."""
    times, out = [], None
    for _ in range(repeats):
        start = time.thread_time()
        out = fn()
        times.append(time.thread_time() - start)
    times.sort()
    return 1e3 * times[0], 1e3 * times[len(times) // 2], out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worst-case", action="store_true")
    args = parse_quick(parser, argv, QUICK)
    torch.set_num_threads(args.threads)
    ids, mask, _, gids = make_batch(groups=args.groups, group_size=args.group_size, seq_len=args.seq_len,
                                    vocab=args.vocab, worst_case=args.worst_case, seed=0)
    rewards = torch.randint(0, 2, (ids.shape[0],), generator=torch.Generator().manual_seed(1)).float()
    mean_h = torch.rand(ids.shape[0], generator=torch.Generator().manual_seed(2))
    spec = AlgoConfig(name="gtpo").resolve(max_completion_tokens=args.seq_len)
    prep_ms, _, prep = timed(lambda: prepare_batch(spec, token_ids=ids, mask=mask, rewards=rewards, group_ids=gids,
                                                   mean_entropy=mean_h), max(args.repeats // 3, 1))
    omega_ms, omega_med, omega = timed(lambda: token_omega(spec, mask, prep), args.repeats)
    coeff = omega * prep.advantages.double()[:, None]
    trie_ms, trie_med, tree = timed(lambda: shared_prefixes(ids, mask, gids, prep.raw_advantages), args.repeats)
    d1_ms, d1_med, metrics = timed(lambda: prefix_bias_metrics(tree, coeff, prep.raw_advantages, mask,
                                                               runs=prep.runs), args.repeats)
    d2_ms, d2_med, _ = timed(lambda: surrogate_decomposition(omega, prep, gids), args.repeats)
    total = omega_ms + trie_ms + d1_ms + d2_ms
    wall = time.perf_counter()
    token_omega(spec, mask, prep)
    prefix_bias_metrics(shared_prefixes(ids, mask, gids, prep.raw_advantages), coeff, prep.raw_advantages, mask,
                        runs=prep.runs)
    wall = 1e3 * (time.perf_counter() - wall)
    print(f"batch {ids.shape[0]} x {ids.shape[1]} ({int(mask.sum())} tokens), threads {args.threads}, "
          f"max trie depth {int(tree.depth.max()) + 1 if tree.depth.numel() else 0}")
    print(f"  token_omega {omega_ms:.1f} ms (median {omega_med:.1f}), shared_prefixes {trie_ms:.1f} ({trie_med:.1f}), "
          f"prefix_bias_metrics {d1_ms:.1f} ({d1_med:.1f}), surrogate_decomposition {d2_ms:.1f} ({d2_med:.1f})")
    print(f"  total D1 + D2 (best, CPU) {total:.1f} ms; one wall-clock pass {wall:.1f} ms; "
          f"for scale, GTPO prepare_batch {prep_ms:.1f} ms")
    print(json.dumps({"tokens": int(mask.sum()), "total_ms": round(total, 2), "omega_ms": round(omega_ms, 2),
                      "trie_ms": round(trie_ms, 2), "d1_metrics_ms": round(d1_ms, 2), "d2_ms": round(d2_ms, 2),
                      "prepare_batch_ms": round(prep_ms, 2), "wall_ms": round(wall, 2), "worst_case": args.worst_case,
                      "metrics": {k: round(float(v), 6) for k, v in metrics.items()}}))


if __name__ == "__main__":
    main()
