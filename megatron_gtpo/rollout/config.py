"""Rollout settings: how many completions per prompt and how they are sampled, and where engines run.

    RolloutConfig (the ``rollout:`` block) --sampling()--> Sampling: the one record every layer
    passes down (collector -> RolloutGroup -> engine or pool -> rollout server -> vLLM SamplingParams)
    SyncConfig.placement() --> EnginePlacement: where the engines run (``rollout.build_engines``)

vLLM's own engine settings are not mirrored here: ``vllm`` is handed to ``vllm.LLM(...)`` as is
(see :mod:`megatron_gtpo.rollout.engine` for the few values the engine fills in itself).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_gtpo.rollout.staleness import PARTIAL_MODES
from megatron_gtpo.utils.configuration import require


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How each prompt's completions are sampled: built once from the config, handed down unchanged
    to the engine, which turns it into vLLM ``SamplingParams`` (one per prompt, with its seed)."""

    n: int
    """Completions per prompt (G)."""
    temperature: float
    """Sampling temperature; 0 is greedy (evaluation)."""
    top_p: float = 1.0
    """Nucleus mass, in (0, 1]."""
    max_tokens: int
    """Most tokens per completion."""
    stop: tuple[str, ...] = ()
    """Extra stop strings (EOS always stops)."""

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"Sampling.n must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"Sampling.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        object.__setattr__(self, "stop", tuple(self.stop or ()))  # a list from a caller is fine


@dataclass(frozen=True, kw_only=True)
class EnginePlacement:
    """Where the job's engines run (``rollout.build_engines``). The user sets it under ``sync:`` (its
    transport decides both where engines run and how weights reach them): ``SyncConfig.placement()``."""

    kind: Literal["colocated", "separate"] = "colocated"
    """``colocated``: one engine per ``rollout.vllm`` TP x PP consecutive trainer ranks, in the trainer
    processes. ``separate``: a pool of rollout servers that trainer rank 0 drives."""
    servers: tuple[str, ...] = ()
    """``host:port`` of running rollout servers (empty: ``MGTPO_ROLLOUT_HOSTS``, else local ones)."""
    server_port: int = 29650
    """Port of the servers named by ``MGTPO_ROLLOUT_HOSTS``."""
    local_servers: int = 1
    """Servers trainer rank 0 starts on localhost when no address is known."""
    timeout_s: float = 900.0
    """Longest wait for a server to start or to answer one request."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling of the G completions per prompt that every RL step trains on."""

    n: int = 8
    """Completions per prompt (the group size G of GRPO/GTPO)."""

    temperature: float = 1.0
    """Sampling temperature, > 0. The trainer must compute its log-probs at the same temperature:
    the engine reports log-probs of the tempered distribution it sampled from. 0 (greedy decoding)
    is rejected: the G >= 2 completions of a group would all be the same text, so every group
    advantage would be 0 and nothing would be learned."""

    top_p: float = 1.0
    """Nucleus sampling mass: 1 (the full distribution at ``temperature``) is the only value accepted.
    Below 1 vLLM samples from the renormalised nucleus and reports its log-probs, while the trainer
    scores every token, and computes GTPO's entropies, on the full vocabulary (its fused
    vocab-parallel pass does not truncate): the importance ratios, the mismatch correction and <H>_i
    would be biased without a warning, so the run is refused before it starts (docs/algorithms.md 15).
    The engine does no top-k or min-p truncation either (its ``SamplingParams`` set neither)."""

    max_tokens: int = 1024
    """Most tokens generated per completion; a completion that hits it is marked truncated."""

    stop: list[str] = field(default_factory=list)
    """Extra stop strings (EOS always stops). Needs the tokenizer (no ``skip_tokenizer_init``)."""

    seed: int = 0
    """Base sampling seed; each prompt of each step gets its own seed derived from it."""

    request_seeds: bool | None = True
    """Give every vLLM request its own seed (derived from ``seed``, the step and the prompt), so
    completions do not depend on how prompts are spread over engines. On by default, GPUs included:
    vLLM 0.32's GPU model runner (V2, its default with Triton) samples every request in one batched
    Gumbel kernel that reads each request's seed (``v1/worker/gpu/sample/gumbel.py``), so seeds cost
    nothing there; a request without one gets a seed drawn from the process-global NumPy RNG
    (``v1/worker/gpu/sample/states.py``), which the per-rank schedulers of a colocated engine of TP > 1
    (external launcher) must then draw identically, or their batches and collectives diverge. False:
    unseeded requests. None (resolved configs of older runs, where it meant "auto"): on."""

    staleness: int = 0
    """Most weight pushes a sampled token may be behind the weights that train on it (k >= 0; the
    bound is checked on every token, megatron_gtpo/rollout/staleness.py). 0: every step generates
    with the weights it trains from (on-policy up to the train-inference mismatch). k >= 1: the
    collector keeps the rollout batches of the next k steps submitted while a step trains (step s+k's
    batch is submitted at step s, by the weights step s starts from), so each batch trains at most k
    pushes after its sampler. With ``sync.transport: separate`` the rollout servers generate while
    the trainer trains and pushes; colocated engines share the trainer's processes and devices, so
    they generate the batches ahead before the step trains, with no overlap (staleness there buys
    nothing but the lag; use it to reproduce an off-policy schedule). k >= 1 requires
    ``algo.mismatch_correction: tis`` (or ``mis``): the loss weights each token by ``pi_old /
    pi_sampler`` from the sampler's own per-token log-probs (decoupled PPO; algo/importance.py). A
    resume regenerates the batches that were in flight from their recorded prompt cursors and seeds,
    with the restored weights (those steps are fresher, never staler): every prompt trains once."""

    partial: Literal["off", "abort", "continue"] = "off"
    """What a weight push does to the requests still generating on the rollout servers (separate
    transport, ``staleness`` >= 1): ``off``: the push waits until they finish (a request is sampled
    by one version); ``abort``: they are aborted and started again from their prompt, same seed, on
    the new weights; ``continue``: they go on with the new weights (the KV cache of the tokens so far
    is kept), each token tagged with the version that sampled it (``Completion.token_versions``).
    With ``staleness`` >= 2 or ``partial`` other than ``off`` the servers take pushes while they
    generate (in-flight weight updates); a group is always trained with all its completions."""

    offload_trainer: bool = False
    """Colocated engines: move Megatron's gradient buffers and optimizer state to host memory while
    the engines generate (back before the train step), so the KV cache can use that memory."""

    vllm: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``vllm.LLM`` (``dtype``, ``max_model_len``, ``gpu_memory_utilization``,
    ``enable_sleep_mode``, ``kv_cache_memory_bytes`` ...), passed through unchanged, except that
    colocated engines on GPU get ``gpu_memory_utilization`` from the memory plan and
    ``enable_sleep_mode`` unless set here (megatron_gtpo.plan.memory)."""

    def __post_init__(self) -> None:
        require(self.n >= 1, "n", self.n, "an integer >= 1")
        require(math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                "a float > 0")
        require(self.temperature > 0 or self.n < 2, "temperature", self.temperature,
                f"a float > 0 with n={self.n}: at temperature 0 (greedy) the {self.n} completions of a prompt are "
                f"identical, every group advantage is 0 and nothing is learned; sample with e.g. "
                f"rollout.temperature=1.0")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "a float in (0, 1]")
        require(self.top_p == 1, "top_p", self.top_p,
                "1.0: below 1 the engine samples from (and reports log-probs of) the renormalised nucleus, "
                "but the trainer's log-probs, importance ratios and entropies are over the full vocabulary, "
                "so the loss would be biased (docs/algorithms.md 15); set rollout.top_p=1.0 and shape the "
                "distribution with rollout.temperature")
        require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        require(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "non-empty strings")
        require(self.seed >= 0, "seed", self.seed, "an integer >= 0")
        require(isinstance(self.staleness, int) and self.staleness >= 0, "staleness", self.staleness,
                "an integer >= 0 (0: on-policy; k: batches sampled at most k weight pushes before they train)")
        require(self.partial in PARTIAL_MODES, "partial", self.partial, f"one of {', '.join(PARTIAL_MODES)}")
        # PARTIAL_MODES is the Literal's list (a unit test keeps them equal)
        require(self.partial == "off" or self.staleness >= 1, "partial", self.partial,
                f"off with staleness={self.staleness}: on-policy rollouts are never in flight at a weight push, so "
                f"there is nothing to abort or continue; set rollout.staleness >= 1")
        require("model" not in self.vllm, "vllm.model", self.vllm.get("model"),
                "unset: the model directory comes from the conversion step")

    def in_flight_pushes(self) -> str | None:
        """The ``partial`` mode under which rollout servers take weight pushes while they generate
        (staleness >= 2, or partial rollouts); None: a push waits for the one generate call in flight
        (staleness <= 1 without partial rollouts)."""
        return self.partial if self.staleness >= 2 or self.partial != "off" else None

    def seeded_requests(self) -> bool:
        """``request_seeds`` resolved (None: on)."""
        return self.request_seeds is not False

    def sampling(self) -> Sampling:
        """The sampling record of every rollout (everything a generate call needs but prompts and seed)."""
        return Sampling(n=self.n, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                        stop=tuple(self.stop))

    def for_engines(self, *, lm_head_fp32: bool, hf_weights: bool) -> RolloutConfig:
        """These settings as the engines start with them, the one rule of the trainer (``trainer.build``)
        and of every rollout server (``cli/rollout_server.py``):

        * ``lm_head_fp32`` (``model.lm_head_fp32``): vLLM's lm_head in fp32, as the trainer scores
          (``hf_overrides: {head_dtype: float32}``, vLLM 0.32's ``ModelConfig.head_dtype``), merged
          into any ``hf_overrides`` the recipe sets;
        * not ``hf_weights`` (the model directory holds a Megatron checkpoint): the engine starts
          empty (``load_format: dummy``) and the first push fills it, unless the recipe sets a
          ``load_format`` itself;
        * pushes while generating (``in_flight_pushes()``): synchronous scheduling
          (``async_scheduling: false``) unless the recipe sets it, so every token's version tag is
          that of the weights that sampled it."""
        vllm = dict(self.vllm)
        if lm_head_fp32:
            vllm["hf_overrides"] = {"head_dtype": "float32", **(vllm.get("hf_overrides") or {})}
        if not hf_weights:
            vllm.setdefault("load_format", "dummy")
        if self.in_flight_pushes() is not None:
            # Pushes land between two engine steps (rollout/inflight.py). vLLM's asynchronous
            # scheduling (a GPU default) keeps one batch in flight across that boundary, whose tokens
            # would be sampled by the old weights but tagged with the new version.
            vllm.setdefault("async_scheduling", False)
        return dataclasses.replace(self, vllm=vllm)
