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
    from megatron_gtpo.rollout.config import Sampling
    from megatron_gtpo.rollout.protocol import Engine, LocalWeights
    from tests.unit.test_rollout_server_units import assert_implements

    for protocol in (Engine, LocalWeights):
        assert_implements(RolloutEngine, protocol)
    engine, fake = _engine(monkeypatch)
    prompts = [Prompt(uid="p", token_ids=[1, 2])]
    ticket = engine.submit(prompts, seeds=[4], sampling=Sampling(n=3, temperature=1.0, max_tokens=2))
    assert len(fake.params) == 1 and fake.params[0].n == 3  # generated inside submit
    assert engine.wait(ticket) is ticket.completions and len(ticket.completions) == 3


@pytest.mark.parametrize("prompts, n, engines", [(2, 4, 4), (5, 2, 2), (6, 4, 4), (3, 8, 4), (1, 2, 3), (0, 4, 2),
                                                 (2, 4, 1), (7, 3, 16)])
def test_engine_shares_cover_every_sample_once_in_order(prompts, n, engines):
    """RolloutGroup's split of one call over colocated engines (issue 35): concatenated in engine
    order the shares are every (prompt, sample) once, prompt-major, so the all-gathered batch is the
    one-engine batch; each engine's share is one vLLM call (one sample count); with fewer prompts
    than engines a prompt's samples are split, so every engine samples while samples >= engines
    (the tiny CP=2 recipe: 2 prompts x 4 over 4 engines, CP rank 1's engines included)."""
    from megatron_gtpo.rollout.group import engine_shares

    shares = engine_shares(prompts, n, engines)
    assert len(shares) == engines
    flat = [(p, first + k) for lo, hi, first, count in shares for p in range(lo, hi) for k in range(count)]
    assert flat == [(p, j) for p in range(prompts) for j in range(n)]
    sizes = [(hi - lo) * count for lo, hi, _, count in shares]
    if prompts >= engines:  # whole prompts, runs differing by at most one prompt
        assert all(first == 0 and count == n for _, _, first, count in shares)
        assert max(sizes) - min(sizes) <= n
    if prompts * n >= engines:
        assert min(sizes) > 0, shares  # no engine idles


def test_split_prompt_keeps_its_seeds(monkeypatch):
    """A prompt's samples split over engines keep the seeds the whole request gives them: the share
    with samples first..first+count-1 is requested with seed + first and n = count, which vLLM seeds
    seed + first + k (its n > 1 fan-out), i.e. samples j of the whole request."""
    from megatron_gtpo.parallel import control
    from megatron_gtpo.rollout.group import RolloutGroup

    engine, fake = _engine(monkeypatch)
    from megatron_gtpo.rollout.engine import prompt_seeds

    monkeypatch.setattr(control, "world", lambda: (3, 4))  # the last of 4 one-rank engines
    monkeypatch.setattr(control, "all_gather_data", lambda payload, records=(): [(0, []), (0, []), (1, []), payload])
    group = RolloutGroup(engine, shard=True, model_dir="/m", seed=3)
    prompts = [Prompt(uid=f"p{i}", token_ids=[1, 2, 3]) for i in range(2)]
    out = group.generate(prompts, Sampling(n=4, temperature=1.0, max_tokens=4), seed=9)
    assert [(p.seed, p.n) for p in fake.params] == [(prompt_seeds(9, 2, 4)[1] + 2, 2)]  # prompt 1, samples 2-3
    assert [c.prompt_index for c in out] == [1, 1] and all(c.prompt_token_ids is prompts[1].token_ids for c in out)
