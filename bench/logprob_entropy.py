"""Benchmark: fused vocab-parallel log-prob + entropy against the naive and the Megatron paths.

    python bench/logprob_entropy.py [--tokens 8192] [--vocab 49152] [--naive-tokens 2048] [--reps 4]
    python bench/logprob_entropy.py --quick          # 256 tokens, vocabulary 512 (the suite's smoke run)

Re-launches itself on 2 gloo ranks (torchrun). TP = 1 runs on rank 0 alone (rank 1 waits, to keep
peak memory of the machine down), TP = 2 on both ranks. fp32 logits ``[tokens, vocab/TP]`` per rank,
temperature 1, forward + backward of each path:

* ``fused``:      ``train/logprobs.py`` (log-prob and entropy, gradient through both);
* ``fused_lp``:   the same, gradient through the log-prob only (GTPO's no-grad entropy);
* ``megatron``:   log-prob alone via ``megatron.core.tensor_parallel.vocab_parallel_cross_entropy``
  (note: in fp32 it overwrites its input with the softmax, which is why its extra memory is ~0;
  callers that still need the logits must clone them first: +1 shard);
* ``naive``:      all-gather the vocabulary (Megatron's autograd-aware gather), full ``log_softmax``,
  then entropy ``-(p * logp).sum()``.

Memory is the peak of live tensor bytes allocated during forward + backward (PyTorch profiler
allocation events; the logits exist beforehand), minus the logits' gradient when it is a new
buffer (a shard every path must hand on; paths that write it over the logits pay nothing),
divided by the shard size. ``fused`` runs with ``inplace_backward=True`` as the train step does.
A CP row runs the same pass on one sequence of ``--tokens`` split over context parallelism
(``train/cp_loss.py::shard_token_stats``: the CP shard's targets, the completion-view map, and
GTPO's <H>_i all-reduced over the CP group): CP = 1 on rank 0 alone, CP = 2 on both ranks, each rank
holding ``tokens / cp`` rows of logits; time per token and extra memory over the shard, same run.
Every naive buffer is ``tokens x vocab``, so its ratio does not depend on the token count; it is
measured at ``--naive-tokens`` (default 2048) so that two ranks of the naive path fit next to other
jobs (at 8192 tokens it needs ~8 GB per rank). Time is
the minimum over ``--reps`` rounds without the profiler, the paths interleaved in each round.
The fused path's scratch is a fixed 32 MiB (``logprobs.CHUNK_ELEMENTS["cpu"]``), so its ratio is only
small for realistic shards; at toy sizes it exceeds 1. The output ends with one JSON line per TP size.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.quick import parse_quick  # noqa: E402

QUICK = {"tokens": 256, "vocab": 512, "naive_tokens": 128, "reps": 1}


def peak_extra_bytes(fn) -> tuple[int, int]:
    """``(peak, final)`` bytes of CPU tensor memory allocated while ``fn()`` runs, relative to its
    start (profiler allocation events; tensors that existed before are not counted)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == _EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    current = peak = 0
    for _, size in sorted(events):
        current += size
        peak = max(peak, current)
    return peak, current


def _paths(group, tp_rank: int, shard: int):
    from megatron.core import tensor_parallel

    from megatron_gtpo.train.logprobs import VocabShard, vocab_parallel_logprob_entropy

    def fused(logits, target, entropy_grad=True):
        lp, h = vocab_parallel_logprob_entropy(logits, target, shard=VocabShard(group, tp_rank * shard),
                                               inplace_backward=True)  # as the train step calls it
        (lp.sum() + (h.sum() if entropy_grad else 0.0)).backward()

    def naive(logits, target):
        full = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        logsm = torch.log_softmax(full, dim=-1)
        lp = logsm.gather(1, target[:, None]).squeeze(1)
        h = -(logsm.exp() * logsm).sum(-1)
        (lp.sum() + h.sum()).backward()

    def megatron(logits, target):
        (-tensor_parallel.vocab_parallel_cross_entropy(logits, target)).sum().backward()

    return {"fused": fused, "fused_lp": lambda x, t: fused(x, t, entropy_grad=False),
            "megatron": megatron, "naive": naive}


def _device_inputs(gen, tokens: int, shard: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [tokens, shard], targets [tokens])`` on the collectives' device, where the train step
    holds them. Drawn on the host (the seeded generator) and moved: host tensors handed to the TP
    group's all-reduces are what NCCL refuses, and what strict device groups refuse here."""
    from megatron_gtpo.parallel.collectives import comm_device

    device = comm_device()
    target = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    logits = (3.0 * torch.randn(tokens, shard, generator=gen)).to(device).requires_grad_(True)
    return logits, target


def _measure(path, tokens: int, shard: int, vocab: int) -> float:
    """Peak transient memory of one forward + backward, over the shard size."""
    logits, target = _device_inputs(torch.Generator().manual_seed(0), tokens, shard, vocab)
    storage = logits.untyped_storage().data_ptr()
    peak, _ = peak_extra_bytes(lambda: path(logits, target))
    shard_bytes = logits.numel() * logits.element_size()
    # a gradient in a new buffer is a shard every path must hand on; one written over the logits
    # (Megatron's CE, fused in place) costs nothing extra
    grad_bytes = 0 if logits.grad.untyped_storage().data_ptr() == storage else shard_bytes
    return (peak - grad_bytes) / shard_bytes


def _time_round_robin(paths: dict, tokens: int, shard: int, vocab: int, reps: int, group) -> dict[str, float]:
    """Seconds per forward + backward of each path: the minimum over ``reps`` rounds, the paths
    interleaved within a round, so that load from other jobs hits them alike (shared machines)."""
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(reps):
        for name, path in paths.items():
            # fresh logits for every run: two of the paths overwrite them
            logits, target = _device_inputs(gen, tokens, shard, vocab)
            _barrier(group)  # TP ranks start together: the time includes waiting in collectives
            start = time.perf_counter()
            path(logits, target)
            times[name].append(time.perf_counter() - start)
            del logits
    return {name: min(values) for name, values in times.items()}


def _barrier(group=None):
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier(group=group)


def run_tp(tp: int, args) -> dict | None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_gtpo.parallel.dims import init_distributed

    dims = init_distributed(tp=tp, pp=1, seed=0)
    result = None
    if dims.dp_rank == 0:  # TP=1: rank 0 only; TP=2: the one TP group
        shard = args.vocab // tp
        group = ps.get_tensor_model_parallel_group()
        paths = _paths(group, dims.tp_rank, shard)
        result = {"tp": tp, "tokens": args.tokens, "vocab": args.vocab, "naive_tokens": args.naive_tokens,
                  "shard_mb": args.tokens * shard * 4 / 2**20}
        for name in ("fused", "fused_lp", "megatron"):
            result[f"{name}_extra_over_shard"] = _measure(paths[name], args.tokens, shard, args.vocab)
        result["naive_extra_over_shard"] = _measure(paths["naive"], args.naive_tokens, shard, args.vocab)
        timed = {name: paths[name] for name in ("fused", "fused_lp", "megatron")}
        for name, seconds in _time_round_robin(timed, args.tokens, shard, args.vocab, args.reps, group).items():
            result[f"{name}_seconds"] = seconds
    dist.barrier()
    ps.destroy_model_parallel()
    return result


def _cp_path(cp: int, rank: int, tokens: int, vocab: int):
    """The fused pass on this CP rank's share of one sequence of ``tokens`` (prompt of 64 tokens):
    log-probs and entropies in the completion view, <H>_i over the CP group, gradient through both."""
    from megatron_gtpo.parallel.collectives import comm_device
    from megatron_gtpo.train.batching import MicroBatch
    from megatron_gtpo.train.cp_loss import cp_groups, mean_entropy, shard_token_stats
    from megatron_gtpo.train.cp_shard import shard_micro_batch
    from megatron_gtpo.train.logprobs import LogprobSettings

    gen = torch.Generator().manual_seed(2)
    prompt, width = 64, tokens - 64
    mb = MicroBatch(rows=torch.zeros(1, dtype=torch.long), input_ids=torch.randint(0, vocab, (1, tokens), generator=gen),
                    position_ids=torch.arange(tokens)[None, :], start=torch.tensor([prompt]),
                    lengths=torch.tensor([width]), width=width)
    # built on the host, then moved, as the train step's plan does (train/plan.py)
    shard = shard_micro_batch(mb, cp=cp, rank=rank, pad_id=0).to(comm_device())
    mask = torch.ones(1, width, dtype=torch.bool, device=comm_device())
    group = cp_groups()[0] if cp > 1 else None
    settings = LogprobSettings(tp_group=None, tp_rank=0, vocab_size=vocab, temperature=1.0, chunk_tokens=None)

    def path(logits, _target=None):
        logp, entropy = shard_token_stats(settings, logits, shard, inplace_backward=True)
        mean_entropy(entropy, shard.held, mask, group)
        (logp.sum() + entropy.sum()).backward()

    return path, tokens // cp


def run_cp(cp: int, args) -> dict | None:
    """Time per token and extra memory of the fused pass on a CP shard (CP = 1: rank 0 alone)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_gtpo.parallel.dims import init_distributed

    dims = init_distributed(tp=1, cp=cp, pp=1, seed=0)
    result = None
    if dims.dp_rank == 0:
        path, local = _cp_path(cp, dims.cp_rank, args.tokens, args.vocab)
        logits_shape = (1, local, args.vocab)
        extra = _measure(lambda x, t: path(x.view(logits_shape)), local, args.vocab, args.vocab)
        group = ps.get_context_parallel_group()  # size 1 at CP = 1: rank 1 sits that one out
        seconds = _time_round_robin({"cp": lambda x, t: path(x.view(logits_shape))}, local, args.vocab, args.vocab,
                                    args.reps, group)["cp"]
        result = {"cp": cp, "local_tokens": local, "extra_over_shard": extra, "seconds": seconds,
                  "us_per_token": 1e6 * seconds / local, "shard_mb": local * args.vocab * 4 / 2**20}
    dist.barrier()
    ps.destroy_model_parallel()
    return result


def _cp_summary(cp1: dict, cp2: dict) -> dict:
    return {"cp": 2, "tokens": cp1["local_tokens"], "logits_shard_vs_cp1": round(cp2["shard_mb"] / cp1["shard_mb"], 3),
            "extra_mem_over_shard_cp1": round(cp1["extra_over_shard"], 4),
            "extra_mem_over_shard_cp2": round(cp2["extra_over_shard"], 4),
            "time_per_token_vs_cp1": round(cp2["us_per_token"] / cp1["us_per_token"], 3),
            "us_per_token_cp1": round(cp1["us_per_token"], 3), "us_per_token_cp2": round(cp2["us_per_token"], 3)}


def main_rank(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = [run_tp(1, args), run_tp(2, args)]
    cp_results = [run_cp(1, args), run_cp(2, args)]
    if dist.get_rank() != 0:
        return
    cp = _cp_summary(*cp_results)
    print(f"CP=2 vs CP=1 (one sequence of {cp['tokens']} tokens): logits per rank {cp['logits_shard_vs_cp1']}x, "
          f"extra/shard {cp['extra_mem_over_shard_cp2']} (CP=1 {cp['extra_mem_over_shard_cp1']}), time per token "
          f"{cp['time_per_token_vs_cp1']}x ({cp['us_per_token_cp2']} vs {cp['us_per_token_cp1']} us)", flush=True)
    lines = []
    for r in results:
        summary = {"tp": r["tp"], "extra_mem_over_shard": round(r["fused_extra_over_shard"], 4),
                   "naive_extra_mem_over_shard": round(r["naive_extra_over_shard"], 4),
                   "megatron_extra_mem_over_shard": round(r["megatron_extra_over_shard"], 4),
                   "time_vs_logprob_only": round(r["fused_seconds"] / r["megatron_seconds"], 3),
                   "time_vs_logprob_only_entropy_nograd": round(r["fused_lp_seconds"] / r["megatron_seconds"], 3),
                   "fused_s": round(r["fused_seconds"], 3), "fused_lp_s": round(r["fused_lp_seconds"], 3),
                   "megatron_s": round(r["megatron_seconds"], 3), "tokens": r["tokens"], "vocab": r["vocab"],
                   "naive_tokens": r["naive_tokens"], "shard_mb": round(r["shard_mb"], 1)}
        print(f"TP={r['tp']}: shard {summary['shard_mb']} MB | extra/shard fused {summary['extra_mem_over_shard']}"
              f" naive {summary['naive_extra_mem_over_shard']} megatron-CE {summary['megatron_extra_mem_over_shard']}"
              f" | time fused {summary['fused_s']}s (lp-grad only {summary['fused_lp_s']}s)"
              f" megatron-CE {summary['megatron_s']}s", flush=True)
        lines.append(json.dumps(summary))
    lines.append(json.dumps(cp))
    print("\n".join(lines), flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--naive-tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=4)
    return parse_quick(parser, argv, QUICK)


if __name__ == "__main__":
    ARGS = parse_args()
    if "RANK" in os.environ:
        main_rank(ARGS)
    else:  # relaunch on two gloo ranks
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", __file__, *sys.argv[1:]]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONPATH": str(REPO)}
        sys.exit(subprocess.call(cmd, env=env))
