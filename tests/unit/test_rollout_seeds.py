"""rollout.request_seeds: seeded requests by default on CPU and GPU (reproducible across layouts; on
GPUs vLLM 0.32's model runner V2 samples seeded requests in one batched kernel, and unseeded ones
would draw their seeds from each rank's global NumPy RNG)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_gtpo.rollout.config import RolloutConfig, Sampling
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.types import Prompt


class _FakeLLM:
    """Records the SamplingParams vLLM would get; returns one empty sample per requested one."""

    def __init__(self):
        self.params = []

    def generate(self, requests, params, use_tqdm=False):
        self.params.extend(params)
        return [SimpleNamespace(outputs=[SimpleNamespace(index=j, token_ids=[5], logprobs=[{5: SimpleNamespace(
            logprob=-1.0)}], finish_reason="stop", text="") for j in range(p.n)]) for p in params]


def _engine(monkeypatch, **kwargs) -> tuple[RolloutEngine, _FakeLLM]:
    fake = _FakeLLM()
    monkeypatch.setattr(RolloutEngine, "_make_llm", staticmethod(lambda kw: fake))
    return RolloutEngine(model_dir="/nonexistent", vllm_kwargs={"skip_tokenizer_init": True}, seed=3, **kwargs), fake


@pytest.mark.parametrize("request_seeds, expect_seeded", [(True, True), (False, False)])
def test_engine_seeds_requests_only_when_asked(monkeypatch, request_seeds, expect_seeded):
    engine, fake = _engine(monkeypatch, request_seeds=request_seeds)
    prompts = [Prompt(uid=f"p{i}", token_ids=[1, 2, 3]) for i in range(3)]
    engine.sample(prompts, seeds=[10, 20, 30], sampling=Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4))
    seeds = [p.seed for p in fake.params]
    assert seeds == ([10, 20, 30] if expect_seeded else [None, None, None])


@pytest.mark.parametrize("cuda", [False, True])
def test_seeded_by_default_on_cpu_and_gpu_and_explicit_values_win(monkeypatch, cuda):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert RolloutConfig().seeded_requests() is True
    assert RolloutConfig(request_seeds=None).seeded_requests() is True  # the old "auto" of resolved configs
    assert RolloutConfig(request_seeds=True).seeded_requests() is True
    assert RolloutConfig(request_seeds=False).seeded_requests() is False


def test_engine_is_an_immediate_future_of_the_declared_protocol(monkeypatch):
    """RolloutEngine implements rollout/protocol.py's Engine and LocalWeights: every declared member
    exists with the declared keyword parameters, and ``submit`` has generated before it returns."""
    import inspect

    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.rollout.protocol import Engine, LocalWeights

    for protocol in (Engine, LocalWeights):
        for name, member in vars(protocol).items():
            if name.startswith("_") or not (callable(member) or isinstance(member, property)):
                continue
            mine = getattr(RolloutEngine, name)
            assert isinstance(mine, property) == isinstance(member, property), name
            if callable(member):
                want = [p for p in inspect.signature(member).parameters if p != "self"]
                assert [p for p in inspect.signature(mine).parameters if p != "self"] == want, name
    engine, fake = _engine(monkeypatch)
    prompts = [Prompt(uid="p", token_ids=[1, 2])]
    ticket = engine.submit(prompts, seeds=[4], sampling=Sampling(n=3, temperature=1.0, max_tokens=2))
    assert len(fake.params) == 1 and fake.params[0].n == 3  # generated inside submit
    assert engine.wait(ticket) is ticket.completions and len(ticket.completions) == 3
