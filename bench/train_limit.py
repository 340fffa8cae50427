"""Our train phase against plain PyTorch on the same tokens: how far from the limit (issue 39).

    python bench/train_limit.py [--preset smollm2] [--completions 64] [--repeats 3] [--profile]
    python bench/train_limit.py --quick              # toy sizes (the suite's smoke run)

One process, one gloo rank (TP = PP = DP = 1), fp32, a randomly initialised model of the preset's
shape (``smollm2``: SmolLM2-135M; ``bench/step_time.py``'s presets) and one fixed batch of
``--completions`` rows (``step_time.synthetic_batch``: ``--prompt-len`` prompt tokens, completions
of ``--completion-len``/2 .. ``--completion-len`` tokens; the defaults are bench/vs_trl.py's work,
64 rows of up to 275 tokens). Each round runs, in a rotating order:

* ``ours_padded``: ``train.step.train_step`` (GRPO, kl_beta 0, mu 1: the whole train phase, plan,
  Megatron forward/backward of every micro-batch, fused log-prob + entropy pass, loss, DDP finalize,
  Adam step with clipping, metrics) with ``--micro-batch`` rows per micro-batch, each padded;
* ``ours_packed``: the same with packed micro-batches of ``--budget`` tokens (the default budget of
  bench/vs_trl.py's runs: its longest row, 1024);
* ``torch``: the limit, a plain Hugging Face model of the same shape (``transformers``, SDPA attention)
  on the same rows in micro-batches of ``--micro-batch``, padded: forward, ``log_softmax`` of the
  completion tokens, a policy-gradient loss (advantage x log-prob, token mean), backward, then
  gradient clipping at 1.0 and ``torch.optim.AdamW`` once per batch.

Our phase's parts are timed by wrapping the functions that do them (CPU work is synchronous, so wall
timers are exact): ``model_forward`` (``model_input.forward``), ``logprob_fwd`` / ``logprob_bwd``
(the fused pass's autograd function), ``loss`` (the rest of ``Update.loss``), ``backward`` (Megatron's
``backward_step`` less the fused pass's backward), ``finalize`` (DDP grad finalize), ``optimizer``
and ``other`` (the rest: plan, packing, host reads, Python). ``--profile`` also prints
``torch.profiler``'s top operators of one ``ours_packed`` step to stderr.

The output ends with one JSON line: ``ours_over_torch`` (packed / torch, wall medians; goal <= 1.1),
``ours_padded_over_torch``, the same ratios of CPU time, the medians and each part's median share.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.quick import parse_quick  # noqa: E402
from bench.step_time import PRESETS, synthetic_batch  # noqa: E402

QUICK = {"preset": "tiny", "layers": 1, "completions": 8, "group_size": 4, "prompt_len": 8, "completion_len": 16,
         "micro_batch": 4, "budget": 64, "repeats": 1, "warmup": 0}
VARIANTS = ("ours_padded", "ours_packed", "torch")


class PartTimer:
    """Seconds per named part, accumulated while ``active``."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, name: str, fn, *, minus: str | None = None):
        """``fn`` timed as ``name`` (less the time ``minus`` accumulated inside it)."""
        def timed(*args, **kwargs):
            inner = self.seconds[minus] if minus else 0.0
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    nested = (self.seconds[minus] - inner) if minus else 0.0
                    self.seconds[name] += time.perf_counter() - start - nested
        return timed

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def instrument(timer: PartTimer, policy) -> None:
    """Wraps the functions of our train phase's parts (module attributes, looked up at call time)."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.utils import get_model_config

    from megatron_gtpo.train import loss, model_input
    from megatron_gtpo.train.logprobs import VocabParallelLogProbEntropy as fused

    model_input.forward = timer.wrap("model_forward", model_input.forward)
    fused.forward = staticmethod(timer.wrap("logprob_fwd", fused.forward))
    fused.backward = staticmethod(timer.wrap("logprob_bwd", fused.backward))
    loss.Update.loss = timer.wrap("loss", loss.Update.loss, minus="logprob_fwd")
    schedules.backward_step = timer.wrap("backward", schedules.backward_step, minus="logprob_bwd")
    config = get_model_config(policy.chunks[0])
    config.finalize_model_grads_func = timer.wrap("finalize", config.finalize_model_grads_func)
    policy.optimizer.step = timer.wrap("optimizer", policy.optimizer.step)


def hf_model(hf: dict):
    """A plain transformers model of the preset's shape (random weights, fp32, SDPA)."""
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    kind = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[hf["architectures"][0]]
    config = CONFIG_MAPPING[kind](**{k: v for k, v in hf.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)


def torch_step(model, optimizer, batch, micro_batch: int, parts: dict[str, float]) -> float:
    """Plain PyTorch on ``batch``'s rows: padded micro-batches, forward, completion log-probs, a
    token-mean policy-gradient loss, backward; clip and AdamW once. Returns the summed loss."""
    adv = batch.rewards - batch.rewards.mean()
    total, tokens = 0.0, int(batch.mask.sum())
    for start in range(0, batch.token_ids.shape[0], micro_batch):
        rows = slice(start, start + micro_batch)
        plen, clen = batch.prompt_lengths[rows], batch.mask[rows].sum(1)
        width = int((plen + clen).max())
        ids = torch.full((plen.numel(), width), batch.pad_id, dtype=torch.long)
        for i in range(plen.numel()):
            p, c = int(plen[i]), int(clen[i])
            ids[i, :p] = batch.prompt_ids[start + i, :p]
            ids[i, p:p + c] = batch.token_ids[start + i, :c]
        attention = (torch.arange(width)[None, :] < (plen + clen)[:, None]).long()
        t0 = time.perf_counter()
        logits = model(input_ids=ids, attention_mask=attention).logits
        t1 = time.perf_counter()
        # completion token j of row i sits at position p_i + j, predicted by position p_i + j - 1
        cols = (plen[:, None] - 1 + torch.arange(batch.token_ids.shape[1])[None, :]).clamp(max=width - 2)
        picked = logits.gather(1, cols[:, :, None].expand(-1, -1, logits.shape[-1]))
        logp = torch.log_softmax(picked, -1).gather(-1, batch.token_ids[rows, :, None]).squeeze(-1)
        loss = -(logp * adv[rows, None] * batch.mask[rows]).sum() / tokens
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        total += float(loss)
        for name, seconds in (("forward", t1 - t0), ("loss", t2 - t1), ("backward", t3 - t2)):
            parts[name] += seconds
    t0 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    parts["optimizer"] += time.perf_counter() - t0
    return total


def build_ours(hf: dict, args):
    from megatron_gtpo.algo import AlgoConfig
    from megatron_gtpo.parallel.dims import init_distributed
    from megatron_gtpo.train import model as M
    from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
    from megatron_gtpo.train.step import StepSettings

    dims = init_distributed(tp=1, pp=1, seed=7)
    optim = OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-6, "clip_grad": 1.0})
    ddp = wrap_ddp(M.build_model(hf, dims=dims), optim)
    optimizer, scheduler = build_optimizer(ddp, optim, total_steps=1000)
    policy = SimpleNamespace(chunks=ddp, optimizer=optimizer, scheduler=scheduler)
    spec = AlgoConfig(name="grpo", kl_beta=0.0).resolve(max_completion_tokens=args.completion_len)
    settings = {"ours_padded": StepSettings(spec=spec, micro_batch_size=args.micro_batch, temperature=1.0),
                "ours_packed": StepSettings(spec=spec, micro_batch_size=args.micro_batch, temperature=1.0,
                                            micro_batch_tokens=args.budget)}
    return policy, dims, settings


def run(args) -> dict:
    from megatron_gtpo.train.step import train_step

    hf = dict(PRESETS[args.preset], **({"num_hidden_layers": args.layers} if args.layers else {}))
    torch.manual_seed(0)
    policy, dims, settings = build_ours(hf, args)
    plain = hf_model(hf)
    adamw = torch.optim.AdamW(plain.parameters(), lr=1e-6)
    batch = synthetic_batch(args, int(hf["vocab_size"]))
    timer = PartTimer()
    instrument(timer, policy)
    wall, cpu, parts = (defaultdict(list) for _ in range(3))
    for round_ in range(args.warmup + args.repeats):
        order = VARIANTS[round_ % 3:] + VARIANTS[:round_ % 3]
        for name in order:
            torch_parts: dict[str, float] = defaultdict(float)
            timer.take()
            timer.active = True
            start, start_cpu = time.perf_counter(), time.process_time()
            if name == "torch":
                torch_step(plain, adamw, batch, args.micro_batch, torch_parts)
            else:
                train_step(policy, batch, settings[name], dims)
            elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
            timer.active = False
            measured = dict(torch_parts) if name == "torch" else timer.take()
            measured["other"] = elapsed - sum(measured.values())
            print(f"round {round_}{' (warm-up)' if round_ < args.warmup else ''} {name}: {elapsed:.2f} s "
                  f"(cpu {used:.2f} s) " + " ".join(f"{k} {v:.2f}" for k, v in sorted(measured.items())),
                  file=sys.stderr, flush=True)
            if round_ >= args.warmup:
                wall[name].append(elapsed)
                cpu[name].append(used)
                parts[name].append(measured)
    if args.profile:
        profile_once(policy, batch, settings["ours_packed"], dims)
    return summary(args, hf, batch, wall, cpu, parts)


def profile_once(policy, batch, settings, dims) -> None:
    from torch.profiler import ProfilerActivity, profile

    from megatron_gtpo.train.step import train_step

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(policy, batch, settings, dims)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


def summary(args, hf: dict, batch, wall, cpu, parts) -> dict:
    med = {name: statistics.median(v) for name, v in wall.items()}
    cpu_med = {name: statistics.median(v) for name, v in cpu.items()}
    shares = {}
    for name, rounds in parts.items():
        keys = sorted({k for r in rounds for k in r})
        shares[name] = {k: round(statistics.median(r.get(k, 0.0) for r in rounds), 3) for k in keys}
    tokens = int((batch.prompt_lengths + batch.mask.sum(1)).sum())
    return {"ours_over_torch": round(med["ours_packed"] / med["torch"], 3),
            "ours_padded_over_torch": round(med["ours_padded"] / med["torch"], 3),
            "ours_over_torch_cpu": round(cpu_med["ours_packed"] / cpu_med["torch"], 3),
            "ours_padded_over_torch_cpu": round(cpu_med["ours_padded"] / cpu_med["torch"], 3),
            **{f"{name}_s": round(v, 3) for name, v in med.items()}, "parts_s": shares, "times_s": dict(wall),
            "tokens": tokens, "preset": args.preset, "layers": int(hf["num_hidden_layers"]),
            "completions": args.completions, "micro_batch": args.micro_batch, "budget": args.budget,
            "repeats": args.repeats, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     epilog="Prints one JSON line: ours_over_torch (goal <= 1.1).")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smollm2", help="model shape (default smollm2)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--completions", type=int, default=64, help="rows in the batch (default 64)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--prompt-len", type=int, default=147, help="prompt tokens per row (default 147)")
    parser.add_argument("--completion-len", type=int, default=128, help="longest completion (default 128)")
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per padded micro-batch (default 8)")
    parser.add_argument("--budget", type=int, default=1024, help="tokens per packed micro-batch (default 1024)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds; medians reported (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic batch")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's top ops of one packed step")
    args = parse_quick(parser, argv, QUICK)
    if args.completions % args.micro_batch or args.completions % args.group_size:
        parser.error("--completions must be a multiple of --micro-batch and of --group-size")
    with contextlib.redirect_stdout(sys.stderr):  # library chatter off the JSON line
        result = run(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
