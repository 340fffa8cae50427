"""Weight-sync bandwidth: SmolLM2-135M pushed from a Megatron trainer into vLLM, per transport.

    Megatron (TP=1, SmolLM2 weights + a simulated update) --export_hf_weights--> buckets (timed once)
    for each transport: build engine (from the checkpoint) -> push the same buckets `repeats` times
    baseline: a plain copy of the same bytes into preallocated tensors (same process, same run)

Reported per transport: the fastest of ``repeats`` pushes in seconds, GB/s (bytes in the engine
dtype), the ratio to the plain copy's GB/s (also the fastest of ``repeats``: on a shared machine the
minimum is the stable statistic), and the max |log-prob(engine) - log-prob(trainer)| over sampled tokens after the
push (plus the same before the push, which shows the push changed what the engine serves). The
output ends with one JSON line per transport.

    python bench/weight_sync.py [--dtype bf16|fp32] [--repeats 3] [--transports colocated,separate] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

QUESTIONS = ["What is 12 + 30?", "Name three colors.", "Write one sentence about the sea.", "What is a prime number?"]
TEMPERATURE, MAX_TOKENS, PAD = 1.0, 32, 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="trainer and engine dtype")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed pushes per transport and plain copies (fastest reported)")
    parser.add_argument("--transports", default="colocated,separate", help="comma-separated transports")
    parser.add_argument("--bucket-mb", type=int, default=256, help="exporter bucket size in MiB")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch/OpenMP threads per process (1, like the tests: on a shared 2-core machine every "
                             "2-thread region waits for the busy other core, ~5 ms per tensor op)")
    return parser.parse_args()


def build_trainer(model_dir: str, dtype: torch.dtype):
    """SmolLM2 in Megatron (one rank), with a small deterministic perturbation standing in for an
    optimizer step, so the push changes what the engine (started from the checkpoint) serves."""
    from megatron_gtpo.convert.load import load_hf_weights
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.train.model import build_model

    dims = init_distributed(tp=1, seed=1234)
    hf_config = read_hf_config(model_dir)
    chunks = build_model(hf_config, dims=dims, dtype=dtype)
    load_hf_weights(chunks, hf_dir=model_dir, hf_config=hf_config, dims=dims)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.02 * p.float().std())
    return dims, chunks, hf_config


def export_buckets(chunks, hf_config: dict, dims, bucket_bytes: int):
    from megatron_gtpo.sync.export import export_hf_weights

    start = time.perf_counter()
    buckets = [[(n, t.clone()) for n, t in b]  # TP=1 exports may alias the parameters
               for b in export_hf_weights(chunks, hf_config=hf_config, dims=dims, bucket_bytes=bucket_bytes)]
    return buckets, time.perf_counter() - start


def plain_copy(buckets, repeats: int) -> dict[str, float]:
    """Fastest wall and CPU seconds to copy every exported byte into preallocated, already-touched
    tensors (the ratio's baseline: the fastest plain copy), and wall seconds into fresh tensors."""
    sources = [t for b in buckets for _, t in b]
    targets = [torch.empty_like(t) for t in sources]
    walls, cpus, clones = [], [], []
    for _ in range(repeats + 1):  # the first pass faults the target pages in; not timed
        wall, cpu = time.perf_counter(), time.process_time()
        for dst, src in zip(targets, sources):
            dst.copy_(src)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        wall = time.perf_counter()
        fresh = [src.clone() for src in sources]
        clones.append(time.perf_counter() - wall)
        del fresh
    return {"seconds": min(walls[1:]), "cpu_seconds": min(cpus[1:]), "clone_seconds": min(clones[1:]),
            "bytes": sum(t.numel() * t.element_size() for t in sources)}


def make_transport(name: str, model_dir: str, vllm: dict):
    from megatron_gtpo.rollout import RolloutEngine
    from megatron_gtpo.sync import ColocatedSync, SeparateEngine, SeparateSync

    # export=None: the benchmark pushes pre-exported buckets (timed apart from the export)
    if name == "colocated":
        engine = RolloutEngine(model_dir=model_dir, vllm_kwargs=vllm, seed=0)
        return engine, ColocatedSync(engine, export=None)
    engine = SeparateEngine(model_dir=model_dir, vllm_kwargs=vllm, seed=0)
    return engine, SeparateSync(engine, export=None)


def chat_prompt(tokenizer, question: str, uid: str):
    from megatron_gtpo.types import Prompt

    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return Prompt(uid=uid, token_ids=list(tokenizer(text, add_special_tokens=False)["input_ids"]), text=text)


def logprob_diff(engine, chunks, dims, hf_config: dict) -> dict[str, float]:
    """Engine vs trainer log-probs of tokens the engine samples now (temperature 1)."""
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.train.batching import collate
    from megatron_gtpo.train.step import (StepSettings, forward_stats, logprob_settings, process_groups,
                                          rank_micro_batches)
    from megatron_gtpo.types import ScoredGroup

    prompts = [chat_prompt(engine.tokenizer, q, uid=str(i)) for i, q in enumerate(QUESTIONS)]
    completions = engine.generate(prompts, n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=MAX_TOKENS, seed=1)
    groups = [ScoredGroup(prompt=p, completions=[c for c in completions if c.prompt_index == i], rewards=[0.0, 0.0])
              for i, p in enumerate(prompts)]
    batch = collate(groups, pad_id=PAD)
    settings = StepSettings(spec=AlgoConfig().resolve(max_completion_tokens=MAX_TOKENS), micro_batch_size=batch.size,
                            temperature=TEMPERATURE, vocab_size=int(hf_config["vocab_size"]))
    _, mbs = rank_micro_batches(batch, settings, dims)
    trainer = forward_stats(chunks, batch, mbs, logprob_settings(settings, dims, process_groups(), chunks)).logp
    diff = (batch.sampler_logprobs.double() - trainer.double())[batch.mask].abs()
    return {"max": diff.max().item(), "mean": diff.mean().item()}


def timed_pushes(syncer, buckets, repeats: int) -> tuple[list, list[float]]:
    """Push stats and process CPU seconds of each push (the latter covers this process only)."""
    stats, cpus = [], []
    for version in range(1, repeats + 1):
        cpu = time.process_time()
        stats.append(syncer.push(buckets, version=version))
        cpus.append(time.process_time() - cpu)
    return stats, cpus


def bench_transport(name: str, *, model_dir: str, vllm: dict, buckets, repeats: int, copy: dict,
                    trainer) -> dict:
    start = time.perf_counter()
    engine, syncer = make_transport(name, model_dir, vllm)
    startup = time.perf_counter() - start
    before = logprob_diff(engine, *trainer)
    stats, cpus = timed_pushes(syncer, buckets, repeats)
    seconds = min(s.seconds for s in stats)
    reload_s = cpu_ratio = check_s = None
    if name == "colocated":  # split one push: our check + staging vs vLLM's in-place reload
        from megatron_gtpo.sync import PushChecker, WeightSpec

        start = time.perf_counter()
        checker = PushChecker(WeightSpec.from_model_dir(model_dir, dtype=engine.dtype), repeats + 1)
        staged = [item for b in buckets for item in checker.prepare(b)]
        checker.finish()
        check_s = round(time.perf_counter() - start, 4)
        start = time.perf_counter()
        engine.load_weights(staged, version=repeats + 1)
        reload_s = round(time.perf_counter() - start, 4)
        # Everything runs in this process: CPU time is a contention-proof stand-in for wall time.
        cpu_ratio = round(copy["cpu_seconds"] / min(cpus), 3)
    gb_per_s = stats[0].num_bytes / seconds / 1e9
    copy_gbps = copy["bytes"] / copy["seconds"] / 1e9
    after = logprob_diff(engine, *trainer)
    engine.close()
    syncer.close()
    return {"transport": name, "seconds": round(seconds, 4), "gb_per_s": round(gb_per_s, 3),
            "ratio_vs_copy": round(gb_per_s / copy_gbps, 3), "ratio_vs_copy_cpu_time": cpu_ratio,
            "max_abs_logprob_diff": after["max"],
            "mean_abs_logprob_diff": after["mean"], "max_abs_logprob_diff_before_push": before["max"],
            "gigabytes": round(stats[0].num_bytes / 1e9, 4), "tensors": stats[0].num_tensors,
            "push_seconds_all": [round(s.seconds, 4) for s in stats], "check_and_stage_seconds": check_s,
            "engine_load_weights_seconds": reload_s,
            "engine_startup_seconds": round(startup, 1)}


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the separate engine's process
    torch.set_num_threads(args.threads)
    from megatron_gtpo.models.smollm2 import ensure_smollm2

    model_dir = str(ensure_smollm2())
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    dims, chunks, hf_config = build_trainer(model_dir, dtype)
    buckets, export_s = export_buckets(chunks, hf_config, dims, args.bucket_mb << 20)
    copy = plain_copy(buckets, args.repeats)
    copy_gbps, clone_gbps = copy["bytes"] / copy["seconds"] / 1e9, copy["bytes"] / copy["clone_seconds"] / 1e9
    print(f"model {model_dir} dtype {args.dtype}: {copy['bytes'] / 1e9:.3f} GB in {sum(map(len, buckets))} tensors, "
          f"{len(buckets)} buckets; export {export_s:.3f} s; plain copy {copy['seconds']:.4f} s = {copy_gbps:.2f} GB/s "
          f"(into fresh tensors: {clone_gbps:.2f} GB/s)", flush=True)
    vllm = {"dtype": {"bf16": "bfloat16", "fp32": "float32"}[args.dtype], "max_model_len": 512,
            "kv_cache_memory_bytes": 256 << 20}
    results = []
    for name in args.transports.split(","):
        results.append(bench_transport(name, model_dir=model_dir, vllm=vllm, buckets=buckets, repeats=args.repeats,
                                       copy=copy, trainer=(chunks, dims, hf_config)))
        print(f"{name}: {results[-1]}", flush=True)
    for row in results:
        print(json.dumps({**row, "dtype": args.dtype, "copy_gb_per_s": round(copy_gbps, 3),
                          "clone_gb_per_s": round(clone_gbps, 3), "export_seconds": round(export_s, 3)}))


if __name__ == "__main__":  # the separate transport spawns a process that re-imports this module
    main()
