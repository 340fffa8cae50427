"""LoRA rollouts on CPU vLLM: the merged-weight push against the adapter-only push, and generation
with the adapter applied against generation from merged weights.

The policy is the tiny Qwen2 (``megatron_gtpo/models/tiny.py``; ``--model smollm2`` for SmolLM2-135M)
with random adapters of rank ``--rank`` on all seven projections (A as PEFT initialises it, B
random, so the update is not zero). The trainer side is simulated without Megatron: the adapters
and the merge are the project's own (``convert.lora_peft``); what is timed is what each push costs.

    merged   W + (alpha/r) B A for every adapted weight (``merge_global``, one layer at a time), then
             the whole model through ``RolloutEngine.load_weights`` (vLLM's in-place reload: the push
             the trainer makes today). Engine built without LoRA.
    adapter  the PEFT files written to a tmpfs directory, then ``add_lora(LoRARequest(...,
             load_inplace=True))`` (vLLM 0.32 loads adapters from a path only: ``LoRARequest``
             asserts a non-empty ``lora_path`` and ``WorkerLoRAManager._load_adapter`` reads it with
             ``LoRAModel.from_local_checkpoint``). Engine built with ``enable_lora``.
    baseline a plain copy of the merged push's bytes into preallocated tensors (same process).

Generation: the same prompts, ``n`` samples each, sampled tokens per second; the baseline is the
merged engine. Also the LoRA engine with no adapter requested (the cost of ``enable_lora`` alone).
Both engines live in this process and every measurement runs once per round, interleaved, so a
shared machine's load hits all of them alike; the fastest round counts, in wall time and in this
process's CPU time (the engines run in-process: vLLM's V1 multiprocessing is off). Agreement:
greedy tokens of the merged engine and of the adapter engine (both serve W + s B A), and of the
base (should differ). Ends with one JSON line.

    python bench/lora_push.py [--model tiny|smollm2] [--rank 8] [--repeats 3] [--prompts 8] [--n 4]
    python bench/lora_push.py --quick                # one round, 2 prompts (the suite's smoke run)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout
from bench.quick import parse_quick  # noqa: E402

PUSH_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
QUICK = {"repeats": 1, "prompts": 2, "n": 2, "max_tokens": 4}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pushes per mode (fastest kept)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per generation call")
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    return parse_quick(parser, argv, QUICK)


def model_dir(name: str) -> str:
    from megatron_gtpo.models.smollm2 import ensure_smollm2
    from megatron_gtpo.models.tiny import ensure_tiny

    return str(ensure_tiny() if name == "tiny" else ensure_smollm2())


def random_adapters(hf_dir: str, hf_config: dict, cfg) -> dict[str, torch.Tensor]:
    """Global adapters (``adapter_key`` names) of the right shapes: A ~ PEFT's init, B ~ N(0, 0.25)
    (large enough that the adapted model's greedy tokens differ from the base's)."""
    from megatron_gtpo.convert import mapping as mp
    from megatron_gtpo.train.lora_layers import adapter_key

    shapes, g = mp.shapes_of(hf_config), torch.Generator().manual_seed(0)
    q, kv = shapes.heads * shapes.head_dim, shapes.groups * shapes.head_dim
    h, f, r = int(hf_config["hidden_size"]), int(hf_config["intermediate_size"]), cfg.rank
    dims = {"linear_qkv": (q + 2 * kv, h, 3), "linear_proj": (h, q, 1), "linear_fc1": (2 * f, h, 2),
            "linear_fc2": (h, f, 1)}
    out = {}
    for layer in range(int(hf_config["num_hidden_layers"])):
        for target in cfg.targets():
            rows, cols, parts = dims[target.name]
            bound = cols ** -0.5
            out[adapter_key(layer, target, "a")] = torch.empty(parts * r, cols).uniform_(-bound, bound, generator=g)
            out[adapter_key(layer, target, "b")] = 0.5 * torch.randn(rows, r, generator=g)
    return out


def fused_layers(hf_dir: str, hf_config: dict) -> list[tuple]:
    """``(global Megatron name, ParamMap, global tensor)`` of the model, in HF order (the trainer holds these)."""
    from megatron_gtpo.convert import mapping as mp
    from megatron_gtpo.convert.hf_io import HFReader
    from megatron_gtpo.models.families import family_of
    from megatron_gtpo.models.hf_config import tied_embeddings

    reader, shapes, family = HFReader(hf_dir), mp.shapes_of(hf_config), family_of(hf_config)
    out = [(pm.local, pm, reader.get(pm.hf[0])) for pm in mp.pre_maps()]
    for layer in range(int(hf_config["num_hidden_layers"])):
        for pm in mp.layer_maps(family):
            fused = mp.fuse(pm, [reader.get(n) for n in mp.hf_names(pm, layer)], shapes)
            out.append((f"decoder.layers.{layer}.{pm.local}", pm, fused))
    out += [(pm.local, pm, reader.get(pm.hf[0])) for pm in mp.post_maps(tied=tied_embeddings(hf_config))]
    return out


def merged_push(fused: list[tuple], hf_config: dict, adapters: dict, cfg) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of the merged model (what the merged push sends): merged per layer, then split."""
    from megatron_gtpo.convert import lora_peft as P
    from megatron_gtpo.convert import mapping as mp

    shapes, out = mp.shapes_of(hf_config), []
    for name, pm, tensor in fused:
        merged = P.merge_global(name, tensor, adapters, cfg, shapes=shapes)
        layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
        out += list(zip(mp.hf_names(pm, layer), mp.split(pm, merged, shapes)))
    return out


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def prompts_of(engine, count: int):
    from megatron_gtpo.types import Prompt

    tok = engine.tokenizer
    texts = [f"Question {i}: what is {i} + {2 * i}? Answer briefly." for i in range(count)]
    return [Prompt(uid=str(i), token_ids=tok(t)["input_ids"], text=t) for i, t in enumerate(texts)]


def engine_kwargs(**extra) -> dict:
    return {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, **extra}


def pushes(args, hf_dir: str, hf_config: dict, adapters: dict, cfg, engines) -> dict:
    """The round's push callables and the bytes each sends."""
    from vllm.lora.request import LoRARequest

    from megatron_gtpo.convert import lora_peft as P

    merged_engine, lora_engine = engines
    fused = fused_layers(hf_dir, hf_config)
    tensors = merged_push(fused, hf_config, adapters, cfg)
    dst = [torch.empty_like(t) for _, t in tensors]
    peft = list(P.peft_tensors(adapters, cfg, hf_config=hf_config, num_layers=int(hf_config["num_hidden_layers"])))
    config = P.adapter_config(cfg, base_model=hf_dir)
    path = os.path.join(args.tmp, "policy")
    versions = iter(range(1, 1 << 20))
    projections = tuple(f"{hf}.weight" for t in cfg.targets() for hf in t.hf)

    def adapter_push():
        P.write_peft_adapter(path, peft, config)
        lora_engine._llm.llm_engine.add_lora(LoRARequest("policy", 1, path, load_inplace=True))

    return {
        "calls": {"merge": lambda: merged_push(fused, hf_config, adapters, cfg),
                  "reload": lambda: merged_engine.load_weights(iter(tensors), version=next(versions)),
                  "copy": lambda: [d.copy_(t) for d, (_, t) in zip(dst, tensors)],
                  "adapter_files": lambda: P.write_peft_adapter(path, peft, config),
                  "adapter_push": adapter_push},
        "merged_bytes": sum(t.nbytes for _, t in tensors),
        "adapted_bytes": sum(t.nbytes for n, t in tensors if n.endswith(projections)),
        "adapter_bytes": sum(t.nbytes for _, t in peft), "request": LoRARequest("policy", 1, path)}


def generations(args, engines, prompts, request) -> dict:
    """The round's generation callables (sampled, ``n`` per prompt, ``max_tokens`` each, no early stop)."""
    from vllm import SamplingParams

    requests = [{"prompt_token_ids": list(p.token_ids)} for p in prompts]
    sample = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    merged_engine, lora_engine = engines
    return {"gen_merged": lambda: merged_engine._llm.generate(requests, sample, use_tqdm=False),
            "gen_adapter": lambda: lora_engine._llm.generate(requests, sample, use_tqdm=False, lora_request=request),
            "gen_lora_idle": lambda: lora_engine._llm.generate(requests, sample, use_tqdm=False)}


def greedy(llm, prompts, args, request=None) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(n=1, temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p.token_ids)} for p in prompts], params, use_tqdm=False,
                        lora_request=request)
    return [list(o.outputs[0].token_ids) for o in outs]


def measure(args, hf_dir: str, hf_config: dict, adapters: dict, cfg) -> dict:
    from megatron_gtpo.rollout import RolloutEngine

    engines = (RolloutEngine(model_dir=hf_dir, seed=0, vllm_kwargs=engine_kwargs()),
               RolloutEngine(model_dir=hf_dir, seed=0, vllm_kwargs=engine_kwargs(
                   enable_lora=True, max_lora_rank=args.rank, max_loras=1)))
    push = pushes(args, hf_dir, hf_config, adapters, cfg, engines)
    prompts = prompts_of(engines[0], args.prompts)
    calls = {**push["calls"], **generations(args, engines, prompts, push["request"])}
    push["calls"]["adapter_push"]()
    for fn in generations(SimpleNamespace(n=1, max_tokens=2), engines, prompts[:1], push["request"]).values():
        fn()  # warm-up
    rounds = {name: [] for name in calls}
    for index in range(args.repeats):
        for name, fn in calls.items():
            rounds[name].append(timed(fn))
            print(f"[round {index + 1}/{args.repeats}] {name}: {rounds[name][-1][0]:.3f} s", file=sys.stderr, flush=True)
    agreement = greedy(engines[0]._llm, prompts, args), greedy(engines[1]._llm, prompts, args, push["request"]), \
        greedy(engines[1]._llm, prompts, args)
    for engine in engines:
        engine.close()
    best = {name: (min(w for w, _ in times), min(c for _, c in times)) for name, times in rounds.items()}
    return {"best": best, "merged_bytes": push["merged_bytes"], "adapted_bytes": push["adapted_bytes"],
            "adapter_bytes": push["adapter_bytes"], "tokens": args.prompts * args.n * args.max_tokens,
            "same": sum(a == b for a, b in zip(agreement[0], agreement[1])) / args.prompts,
            "base_same": sum(a == b for a, b in zip(agreement[0], agreement[2])) / args.prompts}


def report(m: dict, args) -> dict:
    (merge, merge_cpu), (reload, reload_cpu) = m["best"]["merge"], m["best"]["reload"]
    adapter, adapter_cpu = m["best"]["adapter_push"]
    tps = {k: (m["tokens"] / m["best"][k][0], m["tokens"] / m["best"][k][1])
           for k in ("gen_merged", "gen_adapter", "gen_lora_idle")}
    result = {"model": args.model, "rank": args.rank, "seconds_wall_cpu": m["best"],
              "merged_bytes": m["merged_bytes"], "adapted_bytes": m["adapted_bytes"], "adapter_bytes": m["adapter_bytes"],
              "push_bytes_ratio_adapter_vs_merged": m["adapter_bytes"] / m["merged_bytes"],
              "push_seconds_ratio_adapter_vs_merged": adapter / (merge + reload),
              "push_cpu_ratio_adapter_vs_merged": adapter_cpu / (merge_cpu + reload_cpu),
              "merged_push_vs_plain_copy": (merge + reload) / m["best"]["copy"][0],
              "tokens_per_s_wall_cpu": tps,
              "generation_ratio_adapter_vs_merged": tps["gen_adapter"][1] / tps["gen_merged"][1],
              "generation_ratio_lora_idle_vs_merged": tps["gen_lora_idle"][1] / tps["gen_merged"][1],
              "greedy_agreement_adapter_vs_merged": m["same"], "greedy_agreement_base_vs_merged": m["base_same"]}
    print(f"merged push: {m['merged_bytes'] / 1e6:.1f} MB ({m['adapted_bytes'] / 1e6:.1f} MB in adapted layers) in "
          f"{merge + reload:.3f} s wall (merge {merge:.3f} s + vLLM reload {reload:.3f} s; plain copy "
          f"{m['best']['copy'][0]:.4f} s)")
    print(f"adapter push: {m['adapter_bytes'] / 1e6:.3f} MB in {adapter:.4f} s wall (PEFT files "
          f"{m['best']['adapter_files'][0]:.4f} s + add_lora); adapter/merged: bytes "
          f"{result['push_bytes_ratio_adapter_vs_merged']:.4f}, wall {result['push_seconds_ratio_adapter_vs_merged']:.3f}, "
          f"CPU {result['push_cpu_ratio_adapter_vs_merged']:.3f}")
    print("generation tokens/s (wall, CPU): " + ", ".join(f"{k[4:]} {w:.0f}, {c:.0f}" for k, (w, c) in tps.items())
          + f"; adapter/merged x{result['generation_ratio_adapter_vs_merged']:.3f} (CPU), LoRA engine idle/merged "
          f"x{result['generation_ratio_lora_idle_vs_merged']:.3f}; greedy agreement adapter/merged {m['same']:.2f}, "
          f"base/merged {m['base_same']:.2f}")
    print(json.dumps(result))
    return result


def main(argv=None) -> dict:
    from megatron_gtpo.models.hf_config import read_hf_config
    from megatron_gtpo.train.lora import LoraConfig

    args = parse_args(argv)
    hf_dir = model_dir(args.model)
    hf_config = read_hf_config(hf_dir)
    cfg = LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    adapters = random_adapters(hf_dir, hf_config, cfg)
    with tempfile.TemporaryDirectory(dir=PUSH_DIR) as tmp:
        args.tmp = tmp
        return report(measure(args, hf_dir, hf_config, adapters, cfg), args)


if __name__ == "__main__":
    main()
