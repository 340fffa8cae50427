"""Evaluation throughput: ``megatron-gtpo eval``'s path against a plain ``vllm.LLM.generate``.

    one RolloutEngine (the eval CLI's engine and settings) --> for each repeat, interleaved:
        eval      megatron_gtpo.cli.eval.run(config, generate=engine.generate): per-prompt seeds,
                  sampler log-probs, chunking, answer checking, report and samples file
        generate  the same prompts in ONE vllm.LLM.generate call of the same engine: no seeds, no
                  log-probs, no checking (what vLLM alone does with the work)
        (--breakdown adds: one generate call per benchmark; one seeded call with log-probs)

Takes the eval CLI's own flags (same prompts, same engine settings) plus ``--repeats``/``--breakdown``.
Reports completion tokens per wall second (and per CPU second of this process, steadier on a shared
machine) for each variant, and ends with one JSON line whose ``ratio_vs_generate`` is the median over
repeats of eval tok/s / generate tok/s measured back to back (goal >= 0.8), with min and max.

    python bench/eval_throughput.py --model smollm2 --limit 20 --n 2 --k 1,2 --max-tokens 64 \\
        --temperature 0.7 --vllm max_model_len=2048 --vllm kv_cache_memory_bytes=268435456
    python bench/eval_throughput.py --quick          # the tiny model, 2 prompts (the suite's smoke run)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Heavy imports stay inside functions: the answer-checking workers are spawned processes that
# re-import this file, and should not pay for torch. megatron_gtpo.cli.eval loads first: it sets
# the OpenMP wait policy before torch loads, as the eval CLI does.

QUICK = ["--model", "tiny", "--benchmarks", "gsm8k", "--limit", "2", "--n", "2", "--k", "1,2", "--max-tokens", "8",
         "--workers", "1", "--repeats", "1", "--vllm", "dtype=float32", "--vllm", "kv_cache_memory_bytes=67108864"]


def parse_args(argv: list[str] | None = None):
    from bench.quick import parse_quick
    from megatron_gtpo.cli import eval as eval_cli

    parser = eval_cli.build_parser()
    parser.prog, parser.description, parser.epilog = "bench/eval_throughput.py", __doc__.split("\n")[0], None
    parser.add_argument("--repeats", type=int, default=2, help="interleaved eval/generate pairs (median reported)")
    parser.add_argument("--breakdown", action="store_true",
                        help="also time one generate call per benchmark and one seeded call with log-probs")
    args = parse_quick(parser, argv, QUICK)
    return args, eval_cli.config_from_args(args)


def timed(llm, fn) -> tuple[int, float, float]:
    """``(completion tokens, wall s, CPU s of this process)`` of ``fn()``, which returns the tokens.
    The prefix cache is emptied first: no variant reuses the prompt KV of the one before."""
    llm.reset_prefix_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return tokens, time.perf_counter() - wall, time.process_time() - cpu


def plain_generate(llm, prompt_lists: list[list], config) -> int:
    """One ``LLM.generate`` call per list in ``prompt_lists``; returns the completion tokens."""
    from vllm import SamplingParams

    params = SamplingParams(n=config.n, temperature=config.temperature, top_p=config.top_p,
                            max_tokens=config.max_tokens)
    tokens = 0
    for prompts in prompt_lists:
        outputs = llm.generate([{"prompt_token_ids": list(p.token_ids)} for p in prompts], params, use_tqdm=False)
        tokens += sum(len(c.token_ids) for out in outputs for c in out.outputs)
    return tokens


def eval_path(engine, scorer, config, tokenizer, out_dir: str) -> int:
    """The eval CLI's run with this engine and answer checker; returns the completion tokens."""
    import dataclasses

    from megatron_gtpo.cli import eval as eval_cli

    config = dataclasses.replace(config, output=os.path.join(out_dir, "report.json"))
    report = eval_cli.run(config, generate=engine.generate, tokenizer=tokenizer, scorer=scorer)
    return round(sum(r.mean_completion_tokens * r.num_problems * r.n for r in report.results))


def seeded_call(engine, prompts: list, config) -> int:
    """All prompts in one engine call with per-prompt seeds and sampler log-probs."""
    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.rollout.engine import prompt_seeds

    sampling = Sampling(n=config.n, temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens)
    done = engine.sample(prompts, seeds=prompt_seeds(config.seed, len(prompts), config.n), sampling=sampling)
    return sum(len(c.token_ids) for c in done)


def row(name: str, tokens: int, wall: float, cpu: float) -> dict:
    return {"variant": name, "tokens": tokens, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "tok_per_s": round(tokens / wall, 2), "tok_per_cpu_s": round(tokens / max(cpu, 1e-9), 2),
            "load1": round(os.getloadavg()[0], 1)}


def measure(engine, scorer, sets: dict, config, tokenizer, args) -> list[dict]:
    """Every variant once per repeat, back to back (order alternating); one row per run."""
    llm = engine._llm  # the same vLLM engine the eval path uses (bench-only access)
    prompts = [p for ps in sets.values() for p in ps]
    plain_generate(llm, [prompts[:2]], config)  # warm-up (first-call allocations), not timed
    variants = {"generate": lambda: plain_generate(llm, [prompts], config),
                "eval": lambda: eval_path(engine, scorer, config, tokenizer, args.out_dir)}
    if args.breakdown:
        variants["generate_per_benchmark"] = lambda: plain_generate(llm, list(sets.values()), config)
        variants["seeded_logprobs_one_call"] = lambda: seeded_call(engine, prompts, config)
    rows = []
    for repeat in range(args.repeats):
        order = list(variants) if repeat % 2 == 0 else list(reversed(variants))  # no order bias
        got = {name: row(name, *timed(llm, variants[name])) for name in order}
        for name in order:
            got[name]["repeat"] = repeat
            print(json.dumps(got[name]), flush=True)
        rows += got.values()
    return rows


def summarize(rows: list[dict], config, num_prompts: int, engine_info: dict) -> dict:
    by_repeat = {}
    for r in rows:
        by_repeat.setdefault(r["repeat"], {})[r["variant"]] = r
    ratios = [got["eval"]["tok_per_s"] / got["generate"]["tok_per_s"] for got in by_repeat.values()]
    summary = {"bench": "eval_throughput", "model": config.model, "prompts": num_prompts, "n": config.n,
               "max_tokens": config.max_tokens, "repeats": len(ratios), **engine_info,
               "ratio_vs_generate": round(statistics.median(ratios), 3),
               "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    for name in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == name]
        summary[f"{name}_tok_per_s"] = statistics.median(r["tok_per_s"] for r in mine)
        summary[f"{name}_tok_per_cpu_s"] = statistics.median(r["tok_per_cpu_s"] for r in mine)
    return summary


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    from megatron_gtpo.cli import eval as eval_cli
    from megatron_gtpo.models.resolve import as_hf_dir
    from megatron_gtpo.rollout.engine import RolloutEngine

    with as_hf_dir(config.model, hf_config=args.hf_config) as model_dir, tempfile.TemporaryDirectory() as out_dir, \
            eval_cli.answer_checker(config) as scorer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        config = eval_cli._fit_context(config, model_dir)
        sets, _ = eval_cli.load_prompt_sets(config, tokenizer=tokenizer)
        num_prompts = sum(len(ps) for ps in sets.values())
        start = time.perf_counter()
        scorer.start()  # as the eval CLI: the checking workers start while the engine loads
        kwargs = eval_cli.engine_vllm_kwargs(config)
        engine = RolloutEngine(model_dir=str(model_dir), vllm_kwargs=kwargs, seed=config.seed)
        info = {"engine_dtype": str(engine.dtype).removeprefix("torch."), "block_size": kwargs.get("block_size"),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        print(f"engine up in {time.perf_counter() - start:.1f} s: {num_prompts} prompts x n={config.n}, "
              f"{sum(len(p.token_ids) for ps in sets.values() for p in ps)} prompt tokens, {info}", flush=True)
        args.out_dir = out_dir
        rows = measure(engine, scorer, sets, config, tokenizer, args)
        engine.close()
    print(json.dumps(summarize(rows, config, num_prompts, info)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
