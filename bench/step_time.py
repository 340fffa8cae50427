"""Train-phase time of GTPO against GRPO on the same batch, in the same process (issue 16).

    python bench/step_time.py [--preset smollm2|tiny] [--layers N] [--completions 64] [--repeats 3]
    python bench/step_time.py --quick                # toy sizes (the suite's smoke run)

One gloo rank (TP = PP = DP = 1; a world of one, no torchrun), a randomly initialised model of the
preset's shape (``smollm2``: SmolLM2-135M, 30 layers, hidden 576, vocabulary 49152; ``--layers``
shortens it), fp32, Adam, and one fixed synthetic batch: ``--completions`` completions in groups of
``--group-size`` that share prefixes and suffixes (GTPO conflicts), with mixed rewards. Each round
times one ``train.step.train_step`` (prepare, forward/backward of every micro-batch, optimizer step,
metrics) of every variant on that batch, in turn (the order rotates from round to round):

* ``grpo``: GRPO, kl_beta = 0 (no reference model, so no reference forward in either algorithm);
* ``gtpo``: GTPO in one pass (the default step: <H>_i from the training forward);
* ``gtpo_prepass``: GTPO with the former separate no-grad forward before the updates (the tests'
  reference step, ``tests/prepass.py``: the bench imports it rather than keep a second copy).

GTPO runs with entropy threshold 777 and gamma 0.1 (a random model's <H>_i ~ ln V would filter every
completion at 0.7; the work is the same either way). Rounds after ``--warmup`` are timed; the output
ends with one JSON line: median wall seconds per variant, ``gtpo_over_grpo`` (goal <= 1.05) and
``gtpo_prepass_over_grpo``, the same ratios of the process's CPU time (``*_cpu``: steadier than
wall time on a shared machine), every timed round and the settings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.quick import parse_quick  # noqa: E402

QUICK = {"preset": "tiny", "layers": 1, "completions": 8, "group_size": 4, "completion_len": 16, "micro_batch": 4,
         "repeats": 1, "warmup": 0}

PRESETS = {
    "smollm2": {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
                "tie_word_embeddings": True},
    "tiny": {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200,
             "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "tie_word_embeddings": False},
}


def synthetic_batch(args, vocab: int):
    """A fixed batch: per group one prompt and a template; each completion keeps a random part of
    the template's head, a random middle, the template's tail and EOS (conflicts at both ends);
    lengths vary around ``--completion-len``; rewards in {0, 0.5, 1}."""
    from megatron_gtpo.types import Batch

    g = torch.Generator().manual_seed(args.seed)
    pad, eos, num = 0, 2, args.completions
    width, plen = args.completion_len, args.prompt_len
    ids = torch.full((num, width), pad, dtype=torch.long)
    prompt_ids = torch.randint(3, vocab, (num, plen), generator=g)
    lengths = torch.randint(width // 2, width + 1, (num,), generator=g)
    group_ids = torch.arange(num) // args.group_size
    for gi in range(int(group_ids.max()) + 1):
        rows = (group_ids == gi).nonzero().flatten()
        prompt_ids[rows] = prompt_ids[rows[0]].clone()
        template = torch.randint(3, vocab, (width,), generator=g)
        for b in rows.tolist():
            n = int(lengths[b])
            ids[b, :n - 1] = torch.randint(3, vocab, (n - 1,), generator=g)
            head = int(torch.randint(0, n // 2, (1,), generator=g))
            ids[b, :head] = template[:head]
            ids[b, n - 4:n - 1] = template[-3:]
            ids[b, n - 1] = eos
    mask = torch.arange(width)[None, :] < lengths[:, None]
    sampler = torch.where(mask, -torch.rand((num, width), generator=g) * 3, torch.zeros(()))
    rewards = torch.randint(0, 3, (num,), generator=g).float() / 2
    return Batch(prompt_ids=prompt_ids, prompt_lengths=torch.full((num,), plen), token_ids=ids, mask=mask,
                 sampler_logprobs=sampler, rewards=rewards, group_ids=group_ids, pad_id=pad)


def variants(max_tokens: int, micro_batch: int) -> dict:
    """name -> (StepSettings, step function) of the compared steps."""
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.train.step import StepSettings, train_step
    from tests.prepass import pre_pass_step

    def settings(cfg):
        return StepSettings(spec=cfg.resolve(max_completion_tokens=max_tokens), micro_batch_size=micro_batch,
                            temperature=1.0)

    gtpo = AlgoConfig(name="gtpo", entropy_threshold=777.0, entropy_gamma=0.1)
    return {"grpo": (settings(AlgoConfig(name="grpo", kl_beta=0.0)), train_step), "gtpo": (settings(gtpo), train_step),
            "gtpo_prepass": (settings(gtpo), pre_pass_step)}


def run(args) -> dict:
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp

    hf = dict(PRESETS[args.preset], **({"num_hidden_layers": args.layers} if args.layers else {}))
    dims = init_distributed(tp=1, pp=1, seed=7)
    torch.manual_seed(0)
    optim = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-6, "clip_grad": 1.0})
    ddp = wrap_ddp(M.build_model(hf, dims=dims), optim)
    optimizer, scheduler = build_optimizer(ddp, optim, total_steps=1000)
    policy = SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler)
    batch = synthetic_batch(args, int(hf["vocab_size"]))
    steps = variants(args.completion_len, args.micro_batch)
    times: dict[str, list[float]] = {name: [] for name in steps}
    cpu_times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for round_ in range(args.warmup + args.repeats):
        for name in names[round_ % 3:] + names[:round_ % 3]:  # rotated: no variant always runs first
            settings, step = steps[name]
            start, cpu = time.perf_counter(), time.process_time()
            step(policy, batch, settings, dims)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
            if round_ >= args.warmup:
                times[name].append(elapsed)
                cpu_times[name].append(cpu)
            print(f"round {round_}{' (warm-up)' if round_ < args.warmup else ''} {name}: {elapsed:.2f} s "
                  f"(cpu {cpu:.2f} s)", file=sys.stderr, flush=True)
    median = {name: statistics.median(v) for name, v in times.items()}
    cpu_median = {name: statistics.median(v) for name, v in cpu_times.items()}
    return {"gtpo_over_grpo": median["gtpo"] / median["grpo"],
            "gtpo_prepass_over_grpo": median["gtpo_prepass"] / median["grpo"],
            **{f"{name}_s": value for name, value in median.items()},
            "gtpo_over_grpo_cpu": cpu_median["gtpo"] / cpu_median["grpo"],
            "gtpo_prepass_over_grpo_cpu": cpu_median["gtpo_prepass"] / cpu_median["grpo"],
            "times_s": times, "cpu_times_s": cpu_times, "preset": args.preset, "layers": int(hf["num_hidden_layers"]),
            "vocab": int(hf["vocab_size"]), "completions": args.completions, "group_size": args.group_size,
            "prompt_len": args.prompt_len, "completion_len": args.completion_len, "micro_batch": args.micro_batch,
            "repeats": args.repeats, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Prints one JSON line: gtpo_over_grpo (goal <= 1.05), median seconds.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2", help="model shape (default smollm2)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--completions", type=int, default=64, help="completions in the batch (default 64)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per row (default 32)")
    parser.add_argument("--completion-len", type=int, default=64, help="longest completion (default 64)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    args = parse_quick(parser, argv, QUICK)
    if args.completions % args.micro_batch or args.completions % args.group_size:
        parser.error("--completions must be a multiple of --micro-batch and of --group-size")
    if args.completion_len < 8:
        parser.error("--completion-len must be >= 8 (shared heads and tails need room)")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
