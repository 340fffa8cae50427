"""The job's engines behind one generate call: how the generation work is fanned out over ranks.

Every trainer rank calls ``RolloutGroup.generate`` with the same full prompt list and gets the same
full completion list back (the TrainBatch contract: every rank holds the whole batch and takes its
own slice). How the work is spread depends on the transport:

* colocated: **every rank is part of one engine**. vLLM joins the torchrun world at start-up, so
  all ranks must build one (``external_launcher``). With engines of TP=1 (the CPU default) each rank
  holds a full-model engine, and the trainer's TP, CP and DP peers, which would otherwise idle
  during generation, each sample a contiguous share of the batch (:func:`engine_shares`); the shares
  are all-gathered in engine order. With ``vllm.tensor_parallel_size=k`` vLLM groups k consecutive
  ranks into one engine, exactly like Megatron's TP groups; the k ranks of an engine submit the same
  share and only its first rank's copy is kept. Every sample's seed is derived from the *whole*
  batch (sample j of prompt i: ``seeds[i] + j``, which is also how vLLM seeds the j-th sample of
  an n > 1 request), so the completions do not depend on the number of engines or on the split.
  Fewer prompts than engines (a small step over CP ranks, whose engines would otherwise idle and
  could serve stale weights unnoticed): a prompt's samples are split over several engines.
* separate: **global rank 0 holds the pool of rollout servers** (``rollout.pool.RolloutPool``), which
  spreads the prompts over the servers; rank 0 broadcasts the completions.

``generate`` is ``submit(...).wait()``. :meth:`RolloutGroup.submit` starts a call on this rank's
engine through the declared :class:`~megatron_gtpo.rollout.protocol.Engine` protocol
(``engine.submit`` -> ``engine.wait``) and returns a :class:`Generation`. Which engine it is never
matters here: a pool's servers generate in the background until ``Generation.wait`` (one-step-off
rollouts, ``rollout.staleness: 1``, train meanwhile); an engine in the trainer process generates
inside its ``submit`` (an immediate future).

Completions travel as Python objects over the gloo control group (``parallel.control``), never over
the default group, which is NCCL on GPU. A world of one rank needs no communication in either case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from megatron_gtpo.errors import ServerError, WeightPushError
from megatron_gtpo.parallel import control
from megatron_gtpo.rollout.config import Sampling
from megatron_gtpo.rollout.engine import call_seed, prompt_seeds
from megatron_gtpo.rollout.pool import balanced_runs
from megatron_gtpo.rollout.protocol import Engine
from megatron_gtpo.types import Completion, Prompt


class Generation:
    """One generate call of a :class:`RolloutGroup` (``submit``); ``wait`` returns its completions on
    every rank (a collective where completions travel: call it on every rank at the same point)."""

    def __init__(self, finish: Callable[[], list[Completion]]):
        self._finish, self._result = finish, None

    def wait(self) -> list[Completion]:
        """The completions, in prompt order (the same list on every rank); waits for a pool."""
        if self._result is None:
            self._result = self._finish()
        return self._result


class RolloutGroup:
    """The job's engines behind one generate call made on every rank."""

    def __init__(self, engine: Engine | None, *, shard: bool, model_dir: str,
                 seed: int = 0, ranks_per_engine: int = 1,
                 overlap: Callable[[float, float], dict[str, float] | None] | None = None):
        self.engine = engine
        """This rank's engine (None on ranks without one): a ``RolloutEngine`` or rank 0's
        ``RolloutPool``, driven only through the :class:`~megatron_gtpo.rollout.protocol.Engine` protocol."""
        self._overlap = overlap  # a pool's rollout/overlap_* of a train phase (placement._separate)
        self._shard, self._model_dir, self._seed, self._calls = shard, str(model_dir), seed, 0
        self._per_engine = ranks_per_engine
        self._tokenizer = None
        self._rank, self._world = control.world()
        if engine is None and not (self._world > 1 and not shard):
            raise ValueError("every rank needs an engine unless rank 0 generates for all (shard=False)")
        if self._world % ranks_per_engine:
            raise ValueError(f"world size {self._world} is not a multiple of the ranks per engine "
                             f"({ranks_per_engine} = vLLM tensor x pipeline parallel size)")

    @property
    def tokenizer(self):
        """The policy's Hugging Face tokenizer (also on ranks without an engine)."""
        if self.engine is not None:
            return self.engine.tokenizer
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_dir)
        return self._tokenizer

    def generate(self, prompts: list[Prompt], sampling: Sampling, *, seed: int | None = None) -> list[Completion]:
        """As :meth:`RolloutEngine.generate`; the same result on every rank."""
        return self.submit(prompts, sampling, seed=seed).wait()

    def submit(self, prompts: list[Prompt], sampling: Sampling, *, seed: int | None = None) -> Generation:
        """Starts :meth:`generate` (module docstring: a pool generates in the background until
        ``wait``; other engines generate now). Called on every rank at the same point."""
        if seed is None:
            seed = call_seed(self._seed, self._calls)
        self._calls += 1
        seeds = prompt_seeds(seed, len(prompts), sampling.n)
        if self._world > 1 and self._shard:
            done = self._sharded(prompts, seeds, sampling)
            return Generation(lambda: done)
        ticket = self.engine.submit(prompts, seeds=seeds, sampling=sampling) if self._rank == 0 else None
        own = lambda: self.engine.wait(ticket)  # noqa: E731
        if self._world == 1:
            return Generation(own)
        return Generation(lambda: _relink(_broadcast_outcome(own), prompts, offset=0))

    def _sharded(self, prompts: Sequence[Prompt], seeds: list[int], sampling: Sampling) -> list[Completion]:
        engines, index = self._world // self._per_engine, self._rank // self._per_engine
        lo, hi, first, count = engine_shares(len(prompts), sampling.n, engines)[index]
        mine = []
        if hi > lo and count:  # samples first .. first+count-1 of each prompt: vLLM seeds them seed+first+k
            part = sampling if count == sampling.n else dataclasses.replace(sampling, n=count)
            mine = self.engine.wait(self.engine.submit(prompts[lo:hi], seeds=[s + first for s in seeds[lo:hi]],
                                                       sampling=part))
        # The other ranks of an engine hold the same share: only an engine's first rank sends it (its
        # completions carry the routed experts of a mixture, ~1.5 MB each at 30B scale: issue 33's N5)
        lead = self._rank % self._per_engine == 0
        shares = control.all_gather_data((lo, mine if lead else None), records=(Completion,))
        first_ranks = shares[::self._per_engine]
        return [c for start, part in first_ranks for c in _relink(part, prompts, offset=start)]

    def overlap(self, start: float, end: float) -> dict[str, float]:
        """``rollout/overlap_*`` of a train phase [start, end] (wall clock): how long engines that
        generate in the background (a pool's servers: ``overlap`` given where it is built) generated
        during it. Empty where nothing was measured: engines in the trainer processes generate only
        inside ``submit`` (nothing to overlap), calls in flight across pushes, ranks but 0."""
        return (self._overlap(start, end) if self._overlap is not None else None) or {}

    def sleep(self, *, keep_weights: bool = False) -> None:
        """After a rollout: frees the engine's accelerator memory for training (KV cache dropped;
        weights dropped too, or kept on the host with ``keep_weights``) where the engine shares the
        trainer's devices."""
        if self.engine is not None:
            self.engine.sleep(keep_weights=keep_weights)

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Re-allocates the engine's ``weights`` (before a push) or ``kv_cache`` (before generating)."""
        if self.engine is not None:
            self.engine.wake_up(tags)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _broadcast_outcome(own: Callable[[], list[Completion] | None]) -> list[Completion]:
    """Rank 0's completions on every rank; a pool failure on rank 0 raises on every rank (instead of
    leaving the others waiting in the broadcast)."""
    payload = None
    if control.world()[0] == 0:
        try:
            payload = own()
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            payload = err
    payload = control.broadcast_data(payload, src=0, records=(Completion, ServerError, WeightPushError))
    if isinstance(payload, Exception):
        raise payload
    return payload


def _relink(completions: list[Completion], prompts: Sequence[Prompt], *, offset: int) -> list[Completion]:
    """Global prompt indices, and each group's prompt ids as the caller's own list again."""
    for c in completions:
        c.prompt_index += offset
        c.prompt_token_ids = prompts[c.prompt_index].token_ids
    return completions


def engine_shares(num_prompts: int, n: int, engines: int) -> list[tuple[int, int, int, int]]:
    """Each engine's share of a call of ``num_prompts`` prompts x ``n`` samples, in engine order:
    ``(lo, hi, first, count)`` = samples ``first .. first + count - 1`` of prompts ``lo .. hi - 1``.
    Concatenated in engine order they are every sample once, prompt-major. At least as many prompts
    as engines: contiguous runs of whole prompts (one vLLM call per engine, a prompt's samples share
    its prefill), sizes differing by at most one. Fewer: each prompt's samples are split over a
    contiguous run of engines, so every engine samples while there are at least as many samples as
    engines (with fewer, the last engines of a prompt get ``count`` 0)."""
    if num_prompts >= engines or not num_prompts:
        return [(lo, hi, 0, n) for lo, hi in balanced_runs(num_prompts, engines)]
    shares = []
    for prompt, (e_lo, e_hi) in enumerate(balanced_runs(engines, num_prompts)):
        for s_lo, s_hi in balanced_runs(n, e_hi - e_lo):
            shares.append((prompt, prompt + 1, s_lo, s_hi - s_lo))
    return shares
