"""Megatron (TP=2, gloo) -> vLLM weight-sync round trip through one transport, with real engines.

Usage: torchrun --nproc_per_node=2 sync_roundtrip.py --transport colocated|separate --dtype fp32|bf16
       [--engine-tp 1|2]

--engine-tp 2 (colocated): one vLLM engine of TP=2 over both ranks, aligned with Megatron's TP=2,
so each rank pushes only its own shards. --transport separate: one local rollout server.

Checks (one ``RESULT {json}`` line each, from every rank):
  push_v1        push the freshly initialised Megatron policy (the engine started from other weights)
  greedy         vLLM greedy tokens == Megatron greedy tokens (8 prompts x 32 tokens)        [fp32]
  bad_push       a push from a different architecture raises WeightPushError on every rank and the
                 engine's greedy tokens are unchanged
  broken_pushes  pushes of perturbed weights (v1 + noise of the weights' scale) that fail: a
                 truncated push (last bucket missing) is rejected before any byte moves and the
                 engine serves v1 unchanged; a push whose export raises half-way fails on every
                 rank: staged (separate) the servers keep v1; streamed (colocated) the engine
                 refuses to generate until the next complete push. The control: the same
                 perturbed weights pushed completely change the greedy tokens; v1 pushed again
                 restores them
  train_step     one GRPO optimizer step on engine samples (the trainer's mismatch/* metrics too)
  logprobs_v2    after pushing v2: engine log-probs of fresh samples == trainer log-probs, while the
                 v1 samples' engine log-probs are far from the v2 trainer's (the push changed them)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from types import SimpleNamespace

from megatron_gtpo.algo import AlgoConfig
from megatron_gtpo.models.hf_config import read_hf_config
from megatron_gtpo.models.tiny import ensure_tiny
from megatron_gtpo.parallel.dims import init_distributed
from megatron_gtpo.rollout.config import RolloutConfig, Sampling
from megatron_gtpo.sync import ExportPlan, SyncConfig, WeightPushError
from megatron_gtpo.sync.export import Exporter
from megatron_gtpo.train.batching import collate
from megatron_gtpo.train.model import build_model, unwrap
from megatron_gtpo.train.optim import OptimConfig, build_optimizer, wrap_ddp
from megatron_gtpo.train.step import (StepSettings, forward_stats, logprob_settings, process_groups,
                                      rank_micro_batches, train_step)
from megatron_gtpo.types import Batch, ScoredGroup
from tests.helpers import chat_prompt
from tests.megatron_greedy import greedy_generate
from tests.sync_helpers import ListSource, build_rollout

QUESTIONS = ["What is 2 + 2?", "Name a color.", "Count to five.", "Say hello.", "Why is the sky blue?",
             "Write a haiku.", "What is 7 times 8?", "Spell 'cat'."]
TEMPERATURE, MAX_TOKENS, PAD = 0.8, 16, 0
T0 = time.time()


def emit(check: str, **record) -> None:
    """One RESULT line in a single write: both ranks (and vLLM's progress output) share the pipe."""
    line = json.dumps({"check": check, "rank": dist.get_rank(), "t": round(time.time() - T0, 1), **record})
    sys.stdout.flush()
    os.write(1, f"\nRESULT {line}\n".encode())


def to_batch(prompts, completions, seed: int) -> Batch:
    """The completions as a Batch (one group per prompt), with random 0/1 rewards so GRPO's
    advantages (and the update) are not zero."""
    rewards = (torch.rand(len(completions), generator=torch.Generator().manual_seed(seed)) > 0.5).float().tolist()
    groups = [ScoredGroup(prompt=p, completions=[], rewards=[]) for p in prompts]
    for c, r in zip(completions, rewards):
        groups[c.prompt_index].completions.append(c)
        groups[c.prompt_index].rewards.append(r)
    return collate(groups, pad_id=PAD)


def mismatch(sampler: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """|engine log-prob - trainer log-prob| over the sampled tokens (mean, max, token count)."""
    diff = (sampler.double() - trainer.double())[mask]
    return {"train_infer/num_tokens": float(diff.numel()), "train_infer/logprob_abs_diff_mean": diff.abs().mean().item(),
            "train_infer/logprob_abs_diff_max": diff.abs().max().item()}


def wrong_architecture_buckets(hf_config: dict) -> list:
    """HF tensors of a model with one more layer and a wider MLP than the engine's."""
    import transformers

    cfg = dict(hf_config, num_hidden_layers=hf_config["num_hidden_layers"] + 1,
               intermediate_size=hf_config["intermediate_size"] * 2)
    config = transformers.Qwen2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "layer_types")})
    torch.manual_seed(3)
    items = list(transformers.Qwen2ForCausalLM(config).state_dict().items())
    return [items[i:i + 8] for i in range(0, len(items), 8)]


class RaisingSource(ListSource):
    """A push whose export fails after its first bucket's worth of tensors (an exporter crash)."""

    def tensors(self, mode):
        yield from self.items[:4]
        raise RuntimeError("export failed half-way")

    def pack(self, bucket, buffer):
        if bucket.index >= 1:
            raise RuntimeError("export failed half-way")
        return super().pack(bucket, buffer)


@dataclass
class Run:
    """Everything the phases share."""

    dims: object
    hf_config: dict
    chunks: list
    rollout: object
    syncer: object
    sync_cfg: SyncConfig
    rollout_cfg: RolloutConfig
    prompts: list = field(default_factory=list)

    @property
    def vocab(self) -> int:
        return int(self.hf_config["vocab_size"])

    def source(self):
        return Exporter(self.chunks, hf_config=self.hf_config, dims=self.dims)

    def full_buckets(self):
        """The whole push as ready tensors, shaped as this transport delivers them (8 per bucket)."""
        items = [(n, t.clone()) for n, t in self.source().tensors("local" if self.syncer.mode == "local" else "full")]
        return [items[i:i + 8] for i in range(0, len(items), 8)]

    def greedy(self) -> list[list[int]]:
        return [c.token_ids for c in self.greedy_completions()]

    def greedy_completions(self):
        return self.rollout.generate(self.prompts, Sampling(n=1, temperature=0.0, max_tokens=32))


def setup(transport: str, dtype: torch.dtype, engine_tp: int) -> Run:
    dims = init_distributed(tp=2, seed=1234)
    model_dir = str(ensure_tiny())
    hf_config = read_hf_config(model_dir)
    # fp32: a wider init than HF's 0.02 keeps greedy argmax gaps far above fp32 noise. bf16: HF's
    # init; both sides round logits to bf16 (step 2**-7 below 1, 2**-5 near 4), so larger logits
    # would mostly measure that rounding.
    std = 0.1 if dtype == torch.float32 else 0.02
    # Divisor 100 pads the 49152-token vocabulary to 49200 rows (a multiple of 100 x TP): the 48
    # padding rows hold random, non-zero weights, so the push must strip them (vLLM takes HF shapes)
    # and Megatron's greedy tokens and log-probs must ignore their logits.
    model = build_model(hf_config, dims=dims, dtype=dtype, overrides={"init_method_std": std}, vocab_divisible_by=100)
    assert unwrap(model[0]).output_layer.weight.shape[0] * dims.tp == 49200
    chunks = wrap_ddp(model, OptimConfig())
    rollout_cfg = RolloutConfig(n=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=7, vllm={
        "dtype": "float32" if dtype == torch.float32 else "bfloat16", "max_model_len": 256,
        "kv_cache_memory_bytes": 64 << 20, "tensor_parallel_size": engine_tp})
    sync_cfg = SyncConfig(transport=transport, bucket_mb=2)  # several buckets per push
    rollout, syncer = build_rollout(rollout_cfg, sync_cfg, model_dir=model_dir,
                                    export=ExportPlan(hf_config=hf_config, dims=dims, bucket_bytes=sync_cfg.bucket_size))
    run = Run(dims=dims, hf_config=hf_config, chunks=chunks, rollout=rollout, syncer=syncer, sync_cfg=sync_cfg,
              rollout_cfg=rollout_cfg)
    run.prompts = [chat_prompt(rollout.tokenizer, q, uid=str(i)) for i, q in enumerate(QUESTIONS)]
    emit("engines_up")
    return run


def first_push_and_greedy(run: Run, *, compare_greedy: bool) -> list[list[int]]:
    before = run.greedy()  # the HF checkpoint's weights
    stats = run.syncer.push(run.source(), version=1)
    engine_greedy = run.greedy()
    emit("push_v1", mode=run.syncer.mode, version=stats.version, tensors=stats.num_tensors, bytes=stats.num_bytes, seconds=stats.seconds,
         changed=sum(a != b for a, b in zip(before, engine_greedy)))
    if compare_greedy:
        megatron_greedy = greedy_generate(run.chunks, [p.token_ids for p in run.prompts], 32, run.dims,
                                          eos_id=int(run.hf_config["eos_token_id"]), vocab_size=run.vocab)
        emit("greedy", equal=[a == b for a, b in zip(engine_greedy, megatron_greedy)],
             lengths=[len(t) for t in engine_greedy], engine=engine_greedy[0][:8], megatron=megatron_greedy[0][:8])
    return engine_greedy


def rejected_pushes(run: Run, engine_greedy: list[list[int]]) -> None:
    error = None
    try:
        run.syncer.push(ListSource(wrong_architecture_buckets(run.hf_config)), version=2)
    except WeightPushError as err:
        error = str(err)
    after = run.greedy_completions()
    emit("bad_push", error=error, unchanged=[c.token_ids for c in after] == engine_greedy,
         versions=sorted({c.weight_version for c in after}))

    # Failed pushes carry weights the engine does not serve (v1 + noise of the weights' own scale),
    # so a push applied half-way would change what the engine serves.
    perturbed = perturbed_buckets(run.full_buckets())
    errors, refused, unchanged = [], None, []
    for bad in (ListSource(perturbed[:-1]), RaisingSource(perturbed)):
        try:
            run.syncer.push(bad, version=3)
        except (WeightPushError, RuntimeError) as err:
            errors.append(f"{type(err).__name__}: {err}"[:300])
        try:  # streamed (colocated): the half-done push left the engine unusable
            unchanged.append(run.greedy() == engine_greedy)
        except RuntimeError as err:
            refused = str(err)[:200]
    # Positive control: the same perturbed weights, pushed completely, change the greedy tokens (and
    # repair a streamed engine); then the real v1 weights again restore them exactly.
    run.syncer.push(ListSource(perturbed), version=3)
    perturbed_greedy = run.greedy()
    run.syncer.push(run.source(), version=4)
    after = run.greedy_completions()
    emit("broken_pushes", errors=errors, refused=refused, unchanged=unchanged,
         perturbed_changed=sum(a != b for a, b in zip(perturbed_greedy, engine_greedy)),
         restored=[c.token_ids for c in after] == engine_greedy, versions=sorted({c.weight_version for c in after}),
         num_buckets=len(perturbed))


def perturbed_buckets(buckets: list) -> list:
    """The same tensors plus Gaussian noise of half each tensor's own spread (at least 0.02)."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for bucket in buckets:
        noisy = []
        for name, t in bucket:
            scale = max(0.5 * t.float().std().item(), 0.02) if t.numel() > 1 else 0.02
            noisy.append((name, (t.float() + scale * torch.randn(t.shape, generator=gen)).to(t.dtype)))
        out.append(noisy)
    return out


def train_push_compare(run: Run) -> None:
    sampling = run.rollout_cfg.sampling()
    samples_v1 = run.rollout.generate(run.prompts, sampling, seed=11)
    algo = AlgoConfig(name="grpo", kl_beta=0.0)
    optimizer, scheduler = build_optimizer(run.chunks, OptimConfig(optimizer={"optimizer": "adam", "lr": 1e-3}),
                                           total_steps=1)
    settings = StepSettings(spec=algo.resolve(max_completion_tokens=MAX_TOKENS), micro_batch_size=4,
                            temperature=TEMPERATURE, vocab_size=run.vocab)
    policy = SimpleNamespace(chunks=run.chunks, optimizer=optimizer, scheduler=scheduler)
    metrics = train_step(policy, to_batch(run.prompts, samples_v1, seed=5), settings, run.dims)
    emit("train_step", **{k: v for k, v in metrics.items() if k.startswith(("mismatch/", "optim/grad_norm", "loss"))})

    stats = run.syncer.push(run.source(), version=5)
    samples_v2 = run.rollout.generate(run.prompts, sampling, seed=11)
    checks = {}
    for name, samples in (("v2", samples_v2), ("v1_samples", samples_v1)):
        batch = to_batch(run.prompts, samples, seed=0)
        rows, mbs = rank_micro_batches(batch, settings, run.dims)  # TP=2, DP=1: every rank holds every row
        trainer = forward_stats(run.chunks, batch, mbs, logprob_settings(settings, run.dims, process_groups(), run.chunks)).logp
        checks[name] = mismatch(batch.sampler_logprobs[rows], trainer, batch.mask[rows])
    emit("logprobs_v2", push_seconds=stats.seconds, versions=sorted({c.weight_version for c in samples_v2}),
         **{f"{k}:{m}": v for k, d in checks.items() for m, v in d.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transport", choices=["colocated", "separate"], required=True)
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--engine-tp", type=int, default=1)
    args = parser.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    run = setup(args.transport, dtype, args.engine_tp)
    engine_greedy = first_push_and_greedy(run, compare_greedy=dtype == torch.float32)
    rejected_pushes(run, engine_greedy)
    train_push_compare(run)
    run.rollout.close()
    run.syncer.close()
    dist.barrier()


if __name__ == "__main__":  # the separate transport spawns a process that re-imports this module
    main()
