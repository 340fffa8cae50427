"""Rollout-pool push: bytes sent to one server and host memory staged on it, for an engine of TP=k (CPU).

One local rollout server whose engine has ``--engine-tp`` vLLM workers, fed by a 1-rank Megatron
trainer (the tiny model, fp32), pushed ``--pushes`` times through the real PoolSync. Baseline, in
the same run: **one copy of the push** (the sum of its packed buckets, from the push plan), which is
what a server needs and the bound the memory plan uses per rollout node.

Reported (one JSON line): the push's one copy in bytes; the bytes the trainer sent to the server per
push (counted at the transfer group's ``send``) and their ratio to one copy; the server's host
staging as it reports it (``status``) and its ratio; the growth of the server's whole process tree
(server + vLLM workers) in proportional set size over the first push (shared pages counted once,
as the OS does) and its ratio; bytes each vLLM worker received.

    VLLM_CPU_OMP_THREADS_BIND='0|1' OMP_NUM_THREADS=1 python bench/pool_staging.py [--engine-tp 2] [--pushes 2]
    python bench/pool_staging.py --quick             # engine TP=1, one push (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from bench.quick import parse_quick  # noqa: E402

QUICK = {"engine_tp": 1, "pushes": 1}


def tree_pss(pid: int) -> int:
    """Proportional set size of a process and all its descendants (bytes)."""
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_full_info().pss
        except psutil.NoSuchProcess:
            pass
    return total


class CountingGroup:
    """A transfer group that counts the bytes handed to ``send`` (the sender's traffic)."""

    def __init__(self, group):
        self.group, self.sent = group, 0

    def send(self, tensors, dst, tag):
        self.sent += sum(t.numel() * t.element_size() for t in tensors)
        return self.group.send(tensors, dst, tag)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine-tp", type=int, default=2, help="vLLM workers of the server's engine")
    parser.add_argument("--pushes", type=int, default=2, help="pushes measured (the first one allocates the staging)")
    args = parse_quick(parser, argv, QUICK)

    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.models.tiny import ensure_tiny
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.rollout import RolloutConfig, build_engines
    from megatron_gtpo.sync import ExportPlan, SyncConfig, build_weight_sync
    from megatron_gtpo.sync.export import Exporter
    from megatron_gtpo.train.model import build_model

    dims = init_distributed(tp=1, seed=1)
    model_dir = str(ensure_tiny())
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=torch.float32, overrides={"init_method_std": 0.1})
    vllm = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20,
            "tensor_parallel_size": args.engine_tp}
    sync_cfg = SyncConfig(transport="separate", bucket_mb=2, timeout_s=900)
    rollout = build_engines(RolloutConfig(n=1, seed=7, vllm=vllm), sync_cfg.placement(), model_dir=model_dir)
    syncer = build_weight_sync(sync_cfg, ExportPlan(hf_config=hf_config, dims=dims, bucket_bytes=2 << 20),
                               rollout.engine)
    pool = rollout.engine
    syncer._groups = [CountingGroup(g) for g in syncer._groups]
    exporter = Exporter(chunks, hf_config=hf_config, dims=dims)
    one_copy = sum(b.nbytes for b in exporter.buckets(syncer.bucket_bytes))
    server_pid = pool._local.procs[0].pid
    before = tree_pss(server_pid)
    growth = None
    for version in range(1, args.pushes + 1):
        syncer.push(exporter, version=version)
        if version == 1:
            growth = tree_pss(server_pid) - before
    sent = sum(g.sent for g in syncer._groups) / args.pushes
    status = pool.links[0].call("status")
    row = {"engine_tp": args.engine_tp, "one_copy_bytes": one_copy, "sent_bytes_per_push": sent,
           "sent_ratio": round(sent / one_copy, 3), "staging_bytes": status["staging_bytes"],
           "staging_ratio": round(status["staging_bytes"] / one_copy, 3), "pss_growth_first_push": growth,
           "pss_growth_ratio": round(growth / one_copy, 3),
           "received_bytes_per_worker": [n // args.pushes for n in status["received_bytes"]]}
    print(json.dumps(row), flush=True)
    rollout.close()


if __name__ == "__main__":
    main()
