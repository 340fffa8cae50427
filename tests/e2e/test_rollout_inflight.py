"""InflightGenerator on a real (CPU) vLLM engine: jobs stepped in the background while weights change.

One tiny random Llama (tied embeddings, SmolLM2's tokenizer) for the module. The "new" weights are
the checkpoint plus noise of the weights' own scale, so whatever they sample differs from v0's. Every
test that swaps puts the checkpoint back afterwards (a newer version with the old weights).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.types import Prompt
from tests.helpers import in_process_engine, tiny_tied_llama

pytestmark = pytest.mark.slow

LONG = Sampling(n=2, temperature=0.8, top_p=1.0, max_tokens=48)
SEEDS = [11, 200]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_tied_llama(tmp_path_factory.mktemp("tiny_inflight_llama"), max_positions=256)


@pytest.fixture(scope="module")
def engine(model_dir):
    with in_process_engine(model_dir, {"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": 32 << 20,
                                       "max_num_batched_tokens": 256, "block_size": 32}) as eng:
        yield eng


@pytest.fixture(scope="module")
def weights(model_dir):
    """(checkpoint, other weights) as lists of (HF name, tensor); no lm_head (tied)."""
    from safetensors.torch import load_file

    base = {k: v for k, v in load_file(f"{model_dir}/model.safetensors").items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(1)
    other = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}
    return list(base.items()), list(other.items())


@pytest.fixture
def generator(engine, weights):
    from megatron_gtpo.rollout.inflight import InflightGenerator

    gen = InflightGenerator(engine)
    yield gen
    gen.close()
    assert not engine.has_unfinished_requests()
    engine.load_weights(weights[0], version=engine.weight_version + 1)  # the checkpoint again


@pytest.fixture(scope="module")
def prompts():
    """Longer than a KV block (32 tokens): their prompt blocks enter vLLM's prefix cache."""
    gen = torch.Generator().manual_seed(2)
    return [Prompt(uid=u, token_ids=torch.randint(3, 49152, (n,), generator=gen).tolist())
            for u, n in (("a", 40), ("b", 45))]


def slow_steps(monkeypatch, engine, delay_s: float = 0.05) -> list[int]:
    """Slows every engine step down (so a test can act in the middle of a job); counts the steps."""
    real, steps = engine.step, []

    def step():
        time.sleep(delay_s)
        steps.append(1)
        return real()
    monkeypatch.setattr(engine, "step", step)
    return steps


def wait_for_tokens(generator, job: int, at_least: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while min(generator.progress(job)) < at_least:
        assert time.monotonic() < deadline, f"job {job}: {generator.progress(job)} tokens after {timeout_s} s"
        time.sleep(0.01)


def same(got, want) -> None:
    assert [(c.prompt_index, c.token_ids, c.finish_reason, c.truncated, c.text) for c in got] == \
        [(c.prompt_index, c.token_ids, c.finish_reason, c.truncated, c.text) for c in want]
    for a, b in zip(got, want):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
        assert a.prompt_token_ids is b.prompt_token_ids


def test_a_job_samples_what_sample_samples(engine, generator, prompts):
    """n=1 requests seeded seeds[i] + j are vLLM's n>1 fan-out: equal completions. The job's
    generation window (what ``fetch`` reports for ``rollout/overlap_s``) lies within its life."""
    sampling = Sampling(n=3, temperature=0.8, top_p=1.0, max_tokens=16)
    before = time.time()
    generator.submit(1, prompts, SEEDS, sampling, partial="continue")
    generator.submit(2, prompts[1:], [7], sampling, partial="abort")  # another job in the same batch
    (got, window), other = generator.take(1, timeout_s=120), generator.result(2, timeout_s=120)
    assert before <= window[0] < window[1] <= time.time(), (before, window)
    same(got, engine.sample(prompts, seeds=SEEDS, sampling=sampling))
    same(other, engine.sample(prompts[1:], seeds=[7], sampling=sampling))
    assert all(c.weight_version == engine.weight_version and c.token_versions is None for c in got + other)
    assert len({tuple(c.token_ids) for c in got}) == len(got)  # every sample its own seed
    with pytest.raises(KeyError):
        generator.result(1)  # taken


def test_continue_keeps_the_old_tokens_and_samples_the_rest_with_the_new_weights(
        engine, generator, prompts, weights, monkeypatch):
    v0 = engine.weight_version
    uninterrupted = engine.sample(prompts, seeds=SEEDS, sampling=LONG)
    slow_steps(monkeypatch, engine)
    generator.submit(5, prompts, SEEDS, LONG, partial="continue")
    wait_for_tokens(generator, 5, 4)
    with generator.swapping():
        engine.load_weights(weights[1], version=v0 + 1)
    got = generator.result(5, timeout_s=120)
    assert len(got) == 4
    for c, ref in zip(got, uninterrupted):
        assert c.token_versions is not None and c.weight_version == v0
        cut = c.token_versions.index(v0 + 1)
        assert 4 <= cut < len(c.token_ids)
        assert c.token_versions == [v0] * cut + [v0 + 1] * (len(c.token_ids) - cut)
        assert c.token_ids[:cut] == ref.token_ids[:cut]  # the old weights' tokens are kept as sampled
        assert max(abs(a - b) for a, b in zip(c.logprobs[:cut], ref.logprobs[:cut])) < 1e-5
        # The control, from the boundary on: the new weights sampled the rest (a token tagged v1 but
        # sampled by v0 would have v0's log-prob).
        assert c.token_ids[cut] != ref.token_ids[cut] or abs(c.logprobs[cut] - ref.logprobs[cut]) > 1e-3
        assert c.token_ids[cut:] != ref.token_ids[cut:]
        assert c.versions() == c.token_versions


def test_abort_starts_again_on_the_new_weights(engine, generator, prompts, weights, monkeypatch):
    v0 = engine.weight_version
    steps = slow_steps(monkeypatch, engine)
    generator.submit(6, prompts, SEEDS, LONG, partial="abort")
    wait_for_tokens(generator, 6, 4)
    with generator.swapping():
        engine.load_weights(weights[1], version=v0 + 1)
    got = generator.result(6, timeout_s=120)
    assert len(steps) > LONG.max_tokens + 3  # it did start again
    assert all(c.weight_version == v0 + 1 and c.token_versions is None for c in got)
    same(got, engine.sample(prompts, seeds=SEEDS, sampling=LONG))  # a fresh run on the new weights


def test_off_finishes_before_the_weights_change(engine, generator, prompts, weights, monkeypatch):
    v0 = engine.weight_version
    slow_steps(monkeypatch, engine, delay_s=0.02)
    generator.submit(7, prompts, SEEDS, LONG, partial="off")
    longer = Sampling(n=2, temperature=0.8, top_p=1.0, max_tokens=80)
    generator.submit(8, prompts[:1], SEEDS[:1], longer, partial="continue")
    wait_for_tokens(generator, 7, 2)
    with generator.swapping():
        got = generator.result(7, timeout_s=0)  # finished before the block (else TimeoutError)
        assert max(generator.progress(8)) < longer.max_tokens  # the continue job did not have to
        engine.load_weights(weights[1], version=v0 + 1)
    assert all(c.weight_version == v0 and c.token_versions is None for c in got)
    wait_for_tokens(generator, 8, 50)  # the continue job went on with the new weights
    generator.drop(8)  # a job that is not fetched is dropped: its requests are aborted
    assert not engine.has_unfinished_requests()
    monkeypatch.undo()
    engine.load_weights(weights[0], version=v0 + 2)
    same(got, engine.sample(prompts, seeds=SEEDS, sampling=LONG))


def test_a_failing_step_fails_the_job_and_the_generator_goes_on(engine, generator, prompts, monkeypatch):
    real, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in the engine step")
        return real()
    monkeypatch.setattr(engine, "step", step)
    generator.submit(9, prompts, SEEDS, LONG, partial="continue")
    with pytest.raises(RuntimeError, match="boom in the engine step"):
        generator.result(9, timeout_s=120)
    assert not engine.has_unfinished_requests()  # its requests were aborted
    small = Sampling(n=1, temperature=0.8, top_p=1.0, max_tokens=4)
    generator.submit(10, prompts, SEEDS, small, partial="off")
    assert [len(c.token_ids) for c in generator.result(10, timeout_s=120)] == [4, 4]


def test_the_lock_keeps_the_control_thread_out_of_a_step(engine, generator, prompts, monkeypatch):
    """A weight change (here: a direct load) never runs while the thread is inside a step."""
    inside = threading.Event()
    real, overlaps = engine.step, []

    def step():
        inside.set()
        time.sleep(0.02)
        out = real()
        inside.clear()
        return out
    monkeypatch.setattr(engine, "step", step)
    generator.submit(11, prompts[:1], SEEDS[:1], Sampling(n=1, temperature=0.8, top_p=1.0, max_tokens=24))
    for _ in range(5):
        with engine.lock:
            overlaps.append(inside.is_set())
        time.sleep(0.01)
    generator.result(11, timeout_s=120)
    assert not any(overlaps)


def test_server_submit_and_fetch_answer_like_generate_with_token_versions(
        engine, generator, prompts, weights, monkeypatch):
    """The server's submit/fetch handlers over this engine (no socket: ``_answer`` as the request
    loop calls it), a weight change while the job runs, and what the trainer decodes."""
    from types import SimpleNamespace

    import megatron_gtpo.rollout.messages as msg
    from megatron_gtpo.rollout.server import RolloutServer

    server = RolloutServer.__new__(RolloutServer)  # the handlers only: no listener, no second engine
    server.engine, server.generator, server._receiver = engine, generator, None
    server.limits = msg.GenerateLimits(max_model_len=engine.max_model_len, vocab_size=engine.vocab_size)
    server.ops = server._own_ops()

    def ask(op, args, blobs=()):
        header, out = server._answer(op, SimpleNamespace(header={"op": op, "args": args}, blobs=list(blobs)))
        return header, out

    v0 = engine.weight_version
    slow_steps(monkeypatch, engine)
    assert ask("submit", *msg.encode_submit(3, "continue", prompts, SEEDS, LONG)) == ({"ok": True, "result": {}}, [])
    refused = ask("submit", *msg.encode_submit(3, "off", prompts, SEEDS, LONG))[0]
    assert refused["kind"] == "ProtocolError" and "already in flight" in refused["message"]
    assert "partial" in ask("submit", *msg.encode_submit(4, "later", prompts, SEEDS, LONG))[0]["message"]
    assert "already in flight" in ask("submit", *msg.encode_submit(-1, "off", prompts, SEEDS, LONG))[0]["message"]
    server.limits = msg.GenerateLimits(max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                                       max_sequences=6)  # 4 in flight: 4 more are too many
    assert "in flight; fetch first" in ask("submit", *msg.encode_submit(4, "off", prompts, SEEDS, LONG))[0]["message"]
    assert not generator.has(4)
    assert ask("fetch", {"job": 99})[0]["kind"] == "ProtocolError"
    busy = ask("generate", *msg.encode_generate(prompts, SEEDS, LONG))[0]
    assert busy["kind"] == "RuntimeError" and "unfinished" in busy["message"]
    wait_for_tokens(generator, 3, 4)
    with generator.swapping():
        engine.load_weights(weights[1], version=v0 + 1)
    header, blobs = ask("fetch", {"job": 3})
    assert header["ok"] and len(blobs) == 3, header
    version, got = msg.decode_completions(header["result"], blobs, prompts)
    assert version == v0 + 1 and len(got) == 4
    assert all(c.weight_version == v0 and c.token_versions[0] == v0 and c.token_versions[-1] == v0 + 1 for c in got)
    assert ask("fetch", {"job": 3})[0]["kind"] == "ProtocolError"  # fetched once
    header, blobs = ask("generate", *msg.encode_generate(prompts, SEEDS, Sampling(n=1, temperature=0.8, max_tokens=4)))
    assert header["ok"] and len(blobs) == 2
    ask("submit", *msg.encode_submit(5, "abort", prompts, SEEDS, LONG))
    server._drop_push()  # the trainer went away: its jobs go with it
    assert not generator.has(5) and not engine.has_unfinished_requests()


def test_a_restart_that_fails_fails_its_job(engine, generator, prompts, weights, monkeypatch):
    v0 = engine.weight_version
    slow_steps(monkeypatch, engine)
    generator.submit(12, prompts, SEEDS, LONG, partial="abort")
    wait_for_tokens(generator, 12, 2)

    def refuse(requests, sampling):
        raise RuntimeError("engine refused the restarted requests")
    monkeypatch.setattr(engine, "add_requests", refuse)
    with generator.swapping():
        engine.load_weights(weights[1], version=v0 + 1)
    with pytest.raises(RuntimeError, match="refused the restarted"):
        generator.result(12, timeout_s=60)
    assert not engine.has_unfinished_requests()
