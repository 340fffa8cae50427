"""``model.lm_head_fp32`` on a real bf16 vLLM engine: the engine computes its logits with an fp32 head.

The recipe is run_dapo_bf16's (configs/tiny.yaml, ``rollout.vllm.dtype=bfloat16``,
``model.lm_head_fp32=true``). Its engine kwargs come from the product's own builds: the rollout
server's (``cli.rollout_server.spec_from_args``, the ``megatron-gtpo rollout-server CONFIG`` path)
starts the engine, and the colocated build's (``trainer.engine_rollout_config``) must give the same
head settings. A hook on the live model's LogitsProcessor records the bf16 body's hidden states
``h`` and the logits of every sampled token; the engine's returned log-probs are compared with

* (a) an fp32 head on the same ``h`` and the engine's own bf16 lm_head weight (the trainer's head),
* (b) a bf16 head on the same inputs (bf16 logits: what the engine gives without the override).

Measured (48 tokens, AVX-512 Zen host): healthy, max |engine - (a)| = 4.6e-7 and
mean |engine - (b)| = 1.8e-4 (a bf16 rounding of logits of size ~0.8); the logits are float32.
Proved against (each injected once, run, reverted):
* the ``head_dtype`` override dropped from ``RolloutConfig.for_engines`` (the rule both builds
  share): max |engine - (a)| = 9.0e-4 (mean 1.8e-4) against the bound of 1e-5, the engine matched
  (b) to 1.3e-7 on average, and the logits were bfloat16 (also caught on its own);
* ``spec_from_args`` passing ``lm_head_fp32=False``: both tests fail (the same 9.0e-4; the builds'
  ``hf_overrides`` differ);
* ``engine_rollout_config`` passing ``lm_head_fp32=False``: the builds' ``hf_overrides`` differ.
That trainer.build starts its engines with ``engine_rollout_config``'s settings is
test_mismatch_correction.py's test_fp32_head_reaches_the_engines (a real training run).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Prompt
from tests.helpers import REPO, in_process_engine

pytestmark = pytest.mark.slow

FP32_HEAD_TOL = 1e-5
"""Largest |engine - fp32 head| per token: fp32 summation order and fp32 vs fp64 log-softmax
(4.6e-7 measured); a bf16 head is off by up to ~1e-3 (one bf16 rounding of a logit of ~0.8)."""


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32_head") / "recipe.yaml"
    # run_dapo_bf16's engine settings (tests/e2e/runs.py DAPO_BF16) on configs/tiny.yaml
    path.write_text(f"base: {REPO / 'configs' / 'tiny.yaml'}\nmodel:\n  lm_head_fp32: true\n"
                    "rollout:\n  vllm:\n    dtype: bfloat16\n")
    return path


@pytest.fixture(scope="module")
def server_spec(recipe):
    from megatron_gtpo.cli import rollout_server as cli

    # --host: the address is no part of this check (bind_host reads the job's environment otherwise)
    return cli.spec_from_args(cli.build_parser().parse_args([str(recipe), "--host", "127.0.0.1"]))


@pytest.fixture(scope="module")
def engine(server_spec):
    with in_process_engine(server_spec.model_dir, server_spec.vllm) as eng:
        yield eng


def _head_settings(vllm: dict) -> dict:
    # What decides the head's computation; the rest (a GPU memory share, sleep mode) may differ.
    return {k: vllm.get(k) for k in ("dtype", "hf_overrides")}


def test_colocated_and_server_builds_give_the_engines_the_same_head(recipe, server_spec):
    from megatron_gtpo.config import load_config
    from megatron_gtpo.models.hf_config import has_hf_weights
    from megatron_gtpo.trainer import engine_rollout_config

    cfg = load_config(recipe)
    colocated, _ = engine_rollout_config(cfg, model_dir=server_spec.model_dir, world=1,
                                         hf_weights=has_hf_weights(server_spec.model_dir))
    assert _head_settings(colocated.vllm) == _head_settings(server_spec.vllm)
    assert server_spec.vllm["dtype"] == "bfloat16"  # the body in bf16: the head's dtype is what differs


def _sample_with_head_inputs(engine, prompt: Prompt, seed: int):
    """One completion, with the (hidden states, logits) the LogitsProcessor saw for each token."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module, inputs, logits):
        calls.append((inputs[1].detach().clone(), logits.detach().clone()))

    handles = engine._llm.apply_model(lambda model: model.logits_processor.register_forward_hook(record))
    try:
        out = engine.generate([prompt], Sampling(n=1, temperature=1.0, top_p=1.0, max_tokens=16), seed=seed)[0]
    finally:
        for handle in handles:
            handle.remove()
    # One request: each engine step computes the logits of exactly one token, in order.
    assert len(calls) == len(out.token_ids), (len(calls), len(out.token_ids))
    return out, torch.cat([h for h, _ in calls]), torch.cat([lg for _, lg in calls])


def _token_logprobs(logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    # T = 1: the engine's processed log-probs are log_softmax(logits) of the sampled tokens.
    return torch.log_softmax(logits.double(), dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def test_bf16_engine_computes_its_logits_with_an_fp32_head(engine):
    weight = engine._llm.apply_model(lambda model: model.lm_head.weight.detach().clone())[0]
    assert weight.dtype == torch.bfloat16  # the head's weight stays bf16; its product must not
    gen = torch.Generator().manual_seed(0)
    to_fp32, to_bf16, dtypes = [], [], set()
    for i in range(3):
        prompt = Prompt(uid=str(i), token_ids=torch.randint(3, 120, (20,), generator=gen).tolist())
        out, hidden, logits = _sample_with_head_inputs(engine, prompt, seed=i)
        dtypes.add((hidden.dtype, logits.dtype))
        w = weight[:logits.shape[1]]  # rows past the vocabulary (padding) never reach the sampler
        got = torch.tensor(out.logprobs, dtype=torch.float64)
        to_fp32.append(got - _token_logprobs(F.linear(hidden.float(), w.float()), out.token_ids))  # (a)
        to_bf16.append(got - _token_logprobs(F.linear(hidden, w), out.token_ids))  # (b): bf16 logits
    to_fp32, to_bf16 = torch.cat(to_fp32).abs(), torch.cat(to_bf16).abs()
    numbers = f"max |engine - fp32 head| {to_fp32.max():.3g}, mean |engine - bf16 head| {to_bf16.mean():.3g}"
    assert to_fp32.max() < FP32_HEAD_TOL, numbers
    # The two heads are told apart on these tokens: (b) is far further off than (a)'s bound.
    assert to_bf16.mean() > 10 * to_fp32.max(), numbers
    # The live head's computation: a bf16 body's hidden states in, float32 logits out.
    assert dtypes == {(torch.bfloat16, torch.float32)}, dtypes
